"""Which forward tensors the memory model keeps for the backward (cost_models.estimate.memory):
only tensors a backward op that runs reads (a constant's gradient branch is pruned by
TensorFlow), each buffer once per layer (views forward their input's buffer), and views of
weights counted as weights, not activations. Hand-made graphs: no TensorFlow."""

from __future__ import annotations

from cost_model_graphs import act, op

from cost_models.estimate.memory import kept_activation_bytes, layer_memory, live_ops
from partitioner.core.ir import Edge, Graph, LayerInfo, Phase

B = 16
BW = Phase.BACKWARD


def _gelu_like(*, fetched_constant_grad: bool, outputs: bool = True) -> Graph:
    """x -> Mul(x, c) -> Erf -> y, with the backward of both: the gradient of the Mul's input
    reads c only (a weightless constant), the constant's gradient reads x and, unless
    ``fetched_constant_grad``, ends in a Reshape nobody reads. The gradient of the Mul's input
    is fetched through an Identity (a step output) when ``outputs``."""
    ops = (
        op("x", "Placeholder", None, shape=(B, 8)),
        op("c", "Const", "act", shape=()),
        op("mul", "Mul", "act", shape=(B, 8), flops=B * 8),
        op("erf", "Erf", "act", shape=(B, 8), flops=B * 8),
        op("g/erf", "Mul", "act", shape=(B, 8), phase=BW),
        op("g/mul_x", "Mul", "act", shape=(B, 8), phase=BW),
        op("g/mul_c", "Mul", "act", shape=(B, 8), phase=BW),
        op("g/mul_c_sum", "Sum", "act", shape=(), phase=BW),
        op("g/mul_c_out", "Identity" if fetched_constant_grad else "Reshape", "act", shape=(),
           phase=BW),
        op("g/out", "Identity" if outputs else "Neg", "act", shape=(B, 8), phase=BW),
    )  # fmt: skip
    edges = (
        Edge("x", "mul", act(B, 8)),
        Edge("c", "mul", 4),
        Edge("mul", "erf", act(B, 8)),
        Edge("mul", "g/erf", act(B, 8)),  # Erf's gradient reads its input
        Edge("g/erf", "g/mul_x", act(B, 8)),
        Edge("c", "g/mul_x", 4),
        Edge("g/erf", "g/mul_c", act(B, 8)),
        Edge("x", "g/mul_c", act(B, 8)),  # the constant's gradient reads x
        Edge("g/mul_c", "g/mul_c_sum", act(B, 8)),
        Edge("g/mul_c_sum", "g/mul_c_out", 4),
        Edge("g/mul_x", "g/out", act(B, 8)),
    )
    return Graph("gelu_like", ops, edges, (LayerInfo("act", "Activation"),), batch_size=B)


def test_a_constants_gradient_branch_does_not_keep_its_input() -> None:
    graph = _gelu_like(fetched_constant_grad=False)
    live = dict(zip((o.id for o in graph.ops), live_ops(graph), strict=True))
    assert not live["g/mul_c"] and not live["g/mul_c_out"]
    assert live["g/mul_x"] and live["g/erf"]
    # Erf's input is kept; x, read only by the dead branch, is not
    assert kept_activation_bytes(graph) == (act(B, 8),)
    # the raw count of the IR (every forward -> backward read) has both
    assert graph.layer_graph.nodes[0].activation_bytes == 2 * act(B, 8)


def test_a_fetched_branch_keeps_its_input() -> None:
    assert kept_activation_bytes(_gelu_like(fetched_constant_grad=True)) == (2 * act(B, 8),)


def test_a_graph_that_marks_no_output_is_all_live() -> None:
    graph = _gelu_like(fetched_constant_grad=False, outputs=False)
    assert all(live_ops(graph))
    assert kept_activation_bytes(graph) == (graph.layer_graph.nodes[0].activation_bytes,)


def _dense_with_views() -> Graph:
    """h (a layer's output) read by a weight gradient directly and through a Reshape, and a
    weight read through ReadVariableOp -> Reshape (Keras 3's EinsumDense kernel) by the input
    gradient."""
    ops = (
        op("x", "Placeholder", None, shape=(B, 8)),
        op("h", "Relu", "dense", shape=(B, 8)),
        op("w", "ReadVariableOp", "dense", shape=(8, 4)),
        op("w_view", "Reshape", "dense", shape=(8, 4)),
        op("h_view", "Reshape", "dense", shape=(B, 8)),
        op("y", "MatMul", "dense", shape=(B, 4), flops=2 * B * 8 * 4),
        op("g/dw", "MatMul", "dense", shape=(8, 4), phase=BW),
        op("g/dw2", "MatMul", "dense", shape=(8, 4), phase=BW),
        op("g/dx", "MatMul", "dense", shape=(B, 8), phase=BW),
        op("g/out", "Identity", "dense", shape=(8, 4), phase=BW),
        op("g/out2", "Identity", "dense", shape=(8, 4), phase=BW),
        op("g/out3", "Identity", "dense", shape=(B, 8), phase=BW),
    )  # fmt: skip
    edges = (
        Edge("x", "h", act(B, 8)),
        Edge("w", "w_view", act(8, 4)),
        Edge("h", "h_view", act(B, 8)),
        Edge("h_view", "y", act(B, 8)),
        Edge("w_view", "y", act(8, 4)),
        Edge("h", "g/dw", act(B, 8)),
        Edge("h_view", "g/dw2", act(B, 8)),
        Edge("w_view", "g/dx", act(8, 4)),
        Edge("g/dw", "g/out", act(8, 4)),
        Edge("g/dw2", "g/out2", act(8, 4)),
        Edge("g/dx", "g/out3", act(B, 8)),
    )
    return Graph("views", ops, edges, (LayerInfo("dense", "Dense"),), batch_size=B)


def test_a_view_is_its_inputs_buffer_and_a_weight_view_no_activation() -> None:
    graph = _dense_with_views()
    # h once (direct and through its Reshape), the weight's Reshape not at all
    assert kept_activation_bytes(graph) == (act(B, 8),)
    assert graph.layer_graph.nodes[0].activation_bytes == 2 * act(B, 8) + act(8, 4)
    assert layer_memory(graph)[0].activation_bytes == act(B, 8)
