"""The IR validates itself and gives an exact layer-level view."""

from __future__ import annotations

import dataclasses

import pytest

from partitioner.core.errors import InvalidGraphError
from partitioner.core.ir import Edge, Graph, LayerInfo, Link, Op, Phase

F, B = Phase.FORWARD, Phase.BACKWARD


def op(name: str, layer: str | None, phase: Phase = F, nbytes: int = 4, flops: int = 0) -> Op:
    return Op(
        id=name,
        op_type="X",
        layer=layer,
        phase=phase,
        output_shapes=((1,),),
        output_dtypes=("float32",),
        output_bytes=nbytes,
        flops=flops,
    )


def two_layer_graph() -> Graph:
    """x -> a/matmul -> b/matmul -> loss; backward: loss_grad -> b/grad -> a/grad."""
    ops = (
        op("x", None),
        op("a/mm", "a", flops=10),
        op("b/mm", "b", flops=20),
        op("loss", None),
        op("loss_grad", None, B),
        op("b/grad", "b", B, flops=40),
        op("a/grad", "a", B, flops=30),
    )
    edges = (
        Edge("x", "a/mm", 100),
        Edge("a/mm", "b/mm", 64),
        Edge("b/mm", "loss", 8),
        Edge("loss", "loss_grad", 4),
        Edge("loss_grad", "b/grad", 8),
        Edge("a/mm", "b/grad", 64),  # b's weight gradient re-reads a's output (kept alive)
        Edge("b/grad", "a/grad", 64),
        Edge("x", "a/grad", 100),
    )
    return Graph(name="g", ops=ops, edges=edges, layers=(LayerInfo("a", "Dense"), LayerInfo("b", "Dense")))


def test_layer_view_totals_and_edges() -> None:
    lg = two_layer_graph().layer_graph
    a, b = lg.nodes
    assert (a.name, a.forward_flops, a.backward_flops) == ("a", 10, 30)
    assert (b.name, b.forward_flops, b.backward_flops) == ("b", 20, 40)
    # Glue ops merge into a neighbour: inputs into their consumer, the loss into its producer.
    assert lg.op_owner["x"] == "a" and lg.op_owner["loss"] == "b" and lg.op_owner["loss_grad"] == "b"
    (edge,) = lg.edges
    # a's output crosses once forward; b/grad reads the same tensor, counted once per layer;
    # the gradient flowing back from b to a counts as backward traffic.
    assert (edge.src, edge.dst, edge.forward_bytes, edge.backward_bytes) == ("a", "b", 64, 64)
    # Saved activations: forward outputs the backward pass reads (x for a; a's output for a too).
    assert a.activation_bytes == 100 + 64
    # b keeps the loss value (glue merged into b) that the loss gradient reads.
    assert b.activation_bytes == 4


def test_duplicate_op_id_rejected() -> None:
    g = two_layer_graph()
    with pytest.raises(InvalidGraphError, match="duplicate op id 'x'"):
        dataclasses.replace(g, ops=(*g.ops, op("x", None)))


def test_back_edge_means_not_topological() -> None:
    g = two_layer_graph()
    with pytest.raises(InvalidGraphError, match="not topologically sorted or the graph has a cycle"):
        dataclasses.replace(g, edges=(*g.edges, Edge("a/grad", "a/mm", 4)))


def test_self_loop_rejected() -> None:
    g = two_layer_graph()
    with pytest.raises(InvalidGraphError, match="cycle"):
        dataclasses.replace(g, edges=(*g.edges, Edge("b/mm", "b/mm", 4)))


def test_unknown_op_and_layer_rejected() -> None:
    g = two_layer_graph()
    with pytest.raises(InvalidGraphError, match="unknown op 'nope'"):
        dataclasses.replace(g, edges=(*g.edges, Edge("x", "nope", 4)))
    with pytest.raises(InvalidGraphError, match="unknown layer 'c'"):
        dataclasses.replace(g, ops=(*g.ops, op("c/mm", "c")))
    with pytest.raises(InvalidGraphError, match="duplicate layer names"):
        dataclasses.replace(g, layers=(*g.layers, LayerInfo("a", "Dense")))


def test_op_shape_dtype_mismatch_rejected() -> None:
    with pytest.raises(InvalidGraphError, match="output shapes"):
        Op(id="o", op_type="X", layer=None, phase=F, output_shapes=((1,),), output_dtypes=())


def test_graph_without_layers_has_no_layer_view() -> None:
    g = Graph(name="empty", ops=(op("x", None),), edges=(), layers=())
    with pytest.raises(InvalidGraphError, match="no layers"):
        _ = g.layer_graph


def test_link_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = Link("pcie", latency_s=1e-5, bandwidth_bytes_per_s=1e9)
    assert link.transfer_time_s(0) == 0.0
    assert link.transfer_time_s(2_000_000) == pytest.approx(1e-5 + 2e-3)
    with pytest.raises(InvalidGraphError):
        Link("bad", latency_s=0.0, bandwidth_bytes_per_s=0.0)


def test_ir_is_frozen() -> None:
    g = two_layer_graph()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.name = "other"  # type: ignore[misc]


def test_weight_reads_the_backward_uses_are_not_saved_activations() -> None:
    """A layer's backward reads its weights (ReadVariableOp) and its input: only the input counts;
    the weights are parameters, and the runtime aliases the variable's buffer."""
    ops = (
        Op("x", "Placeholder", None, F, ((8, 4),), ("float32",), 128),
        Op("w", "ReadVariableOp", "dense", F, ((4, 4),), ("float32",), 64),
        Op("mm", "MatMul", "dense", F, ((8, 4),), ("float32",), 128),
        Op("g", "MatMul", "dense", Phase.BACKWARD, ((4, 4),), ("float32",), 64),
    )
    edges = (
        Edge("x", "mm", 128),
        Edge("w", "mm", 64),
        Edge("x", "g", 128),
        Edge("w", "g", 64),
    )
    graph = Graph("g", ops, edges, (LayerInfo("dense", "Dense"),))
    (node,) = graph.layer_graph.nodes
    assert node.activation_bytes == 128


def test_an_input_joins_its_earliest_consumer_in_layer_order() -> None:
    """Two towers read one input; the op edges list tower b first (TF built it first), but the
    input belongs to tower a, the first in layer order, so its layer edge points a -> b."""
    from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase

    def op(id: str, layer: str | None) -> Op:
        return Op(id, "MatMul" if layer else "Placeholder", layer, Phase.FORWARD, ((4, 4),), ("float32",), 64)

    g = Graph(
        "towers",
        (op("x", None), op("b/mm", "b"), op("a/mm", "a")),
        (Edge("x", "b/mm", 64), Edge("x", "a/mm", 64)),
        (LayerInfo("a", "Dense"), LayerInfo("b", "Dense")),
    )
    lg = g.layer_graph
    assert lg.op_owner["x"] == "a"
    (edge,) = lg.edges
    assert (edge.src, edge.dst, edge.forward_bytes) == ("a", "b", 64)
