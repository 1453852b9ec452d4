"""partitioner.core.batching: a graph at another batch size from two traces (pure Python)."""

from __future__ import annotations

from dataclasses import replace

from partitioner.core.batching import graph_at_batch
from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase, SparseGradient


def _graph(batch: int, *, quadratic: bool = False) -> Graph:
    """x (batch, 16) -> matmul with a (16, 32) weight -> its gradient (the weight's shape)."""
    act = batch * batch if quadratic else batch
    ops = (
        Op("x", "Placeholder", None, Phase.FORWARD, ((batch, 16),), ("float32",), 64 * batch),
        Op("w", "ReadVariableOp", "dense", Phase.FORWARD, ((16, 32),), ("float32",), 2048),
        Op(
            "mm", "MatMul", "dense", Phase.FORWARD, ((act, 32),), ("float32",), 128 * act,
            flops=2 * 16 * 32 * act,
        ),
        Op(
            "grad", "MatMul", "dense", Phase.BACKWARD, ((16, 32),), ("float32",), 2048,
            flops=2 * 16 * 32 * batch, transposed_bytes=64 * batch,
        ),
        Op("shape", "Shape", "dense", Phase.BACKWARD, ((-1,),), ("int32",), 0),
    )  # fmt: skip
    edges = (
        Edge("x", "mm", 64 * batch),
        Edge("w", "mm", 2048),
        Edge("x", "grad", 64 * batch),
        Edge("mm", "grad", 128 * act),
        Edge("grad", "shape", 2048),
    )
    return Graph("g", ops, edges, (LayerInfo("dense", "Dense", 512, 512, 2048, 2048),), batch)


def test_a_graph_affine_in_the_batch_is_recovered_exactly_at_any_batch() -> None:
    for batch in (1, 3, 4, 16, 64):
        assert graph_at_batch(_graph(8), _graph(2), batch) == _graph(batch)


def test_the_traced_batches_come_back_as_they_are() -> None:
    a, b = _graph(8), _graph(2)
    assert graph_at_batch(a, b, 8) is a and graph_at_batch(a, b, 2) is b


def test_a_value_that_is_not_affine_in_the_batch_is_refused() -> None:
    # batch**2 rows: the line through (2, 4) and (4, 16) gives -2 at batch 1, which is refused
    assert graph_at_batch(_graph(4, quadratic=True), _graph(2, quadratic=True), 1) is None


def test_traces_of_different_structure_are_refused() -> None:
    a, b = _graph(8), _graph(2)
    renamed = replace(b, ops=(*b.ops[:-1], replace(b.ops[-1], op_type="Size")))
    assert graph_at_batch(a, renamed, 4) is None
    reranked = replace(
        b, ops=(*b.ops[:2], replace(b.ops[2], output_shapes=((2, 2, 32),)), *b.ops[3:])
    )
    assert graph_at_batch(a, reranked, 4) is None


def test_two_traces_at_the_same_batch_determine_nothing() -> None:
    assert graph_at_batch(_graph(4), _graph(4), 2) is None
    assert graph_at_batch(_graph(4), _graph(2), 0) is None


def _with_embedding(graph: Graph, ids_per_example: int = 16) -> Graph:
    """``graph`` whose layer also holds an embedding table with an ``IndexedSlices`` gradient
    of ``batch x ids_per_example`` rows (the trace's record)."""
    rows = graph.batch_size * ids_per_example
    sparse = (SparseGradient("dense/table", rows, 256, 4, 51_200),)
    return replace(graph, layers=(replace(graph.layers[0], sparse_gradients=sparse),))


def test_sparse_gradient_rows_scale_with_the_batch() -> None:
    a, b = _with_embedding(_graph(8)), _with_embedding(_graph(2))
    for batch in (1, 4, 16, 64):
        got = graph_at_batch(a, b, batch)
        assert got == _with_embedding(_graph(batch))
        assert got is not None and got.layers[0].sparse_gradients[0].rows_per_step == 16 * batch


def test_traces_whose_sparse_gradients_differ_are_refused() -> None:
    a = _with_embedding(_graph(8))
    assert graph_at_batch(a, _graph(2), 4) is None  # sparse in one trace, dense in the other
    other = _with_embedding(_graph(2))
    widened = replace(
        other.layers[0],
        sparse_gradients=(replace(other.layers[0].sparse_gradients[0], row_bytes=512),),
    )
    assert graph_at_batch(a, replace(other, layers=(widened,)), 4) is None
