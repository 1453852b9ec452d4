"""Sparse (``tf.IndexedSlices``) gradients: their IR record, memory, and exchange price (pure
Python). The exchange the price stands for is checked against TensorFlow's in
``tests/passes/test_trace.py::test_the_priced_slices_are_the_ones_tensorflow_exchanges``."""

from __future__ import annotations

import pytest

from cost_models.estimate.collectives import (
    AllReduceAlgorithm,
    all_gather_equivalent_bytes,
    all_reduce_s,
    concurrent_all_gather_s,
    concurrent_reduce_to_one_s,
    gradient_exchange_s,
    measured_all_reduce_s,
    ring_bandwidth_bytes_per_s,
)
from cost_models.estimate.memory import Optimizer, layer_memory
from partitioner.core.errors import InvalidGraphError
from partitioner.core.ir import (
    AllReduceFit,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    SparseGradient,
    Topology,
)

LINK = Link("test", latency_s=0.001, bandwidth_bytes_per_s=1e6)
# The recommender: Embedding(200k x 64) float32, 16 ids per example, int32 ids.
TABLE_BYTES = 200_000 * 64 * 4


def _table(batch: int) -> SparseGradient:
    return SparseGradient("emb/embeddings", 16 * batch, 64 * 4, 4, TABLE_BYTES)


def _topology(n: int, hosts: int = 1) -> Topology:
    per_host = n // hosts
    devices = tuple(Device(d, "cpu", 1 << 40, host=d // per_host) for d in range(n))
    return Topology(devices, LINK, inter_host_link=LINK if hosts > 1 else None)


def test_a_sparse_gradient_is_its_rows_and_their_indices() -> None:
    g = _table(1024)
    assert g.slices_bytes == 16 * 1024 * (256 + 4)  # 4.26 MB, not the table's 51.2 MB
    info = LayerInfo("emb", "Embedding", 200_000 * 64, 200_000 * 64, TABLE_BYTES, TABLE_BYTES, (g,))
    assert info.dense_gradient_bytes == 0 and info.sparse_gradient_bytes == g.slices_bytes
    with pytest.raises(InvalidGraphError, match="rows_per_step=-1"):
        SparseGradient("v", -1, 4, 4, 4)


def _embedding_graph(optimizer: Optimizer) -> tuple[LayerMemory, ...]:
    g = SparseGradient("emb/embeddings", 64, 32, 4, 1000 * 32)
    layers = (
        LayerInfo("emb", "Embedding", 1000 * 8 + 8, 1000 * 8 + 8, 32_032, 32_032, (g,)),
        LayerInfo("head", "Dense", 10, 10, 40, 40),
    )
    ops = (
        Op("ids", "Placeholder", None, Phase.FORWARD, ((8, 8),), ("int32",), 256),
        Op("gather", "GatherV2", "emb", Phase.FORWARD, ((8, 8, 8),), ("float32",), 2048),
        Op("mm", "MatMul", "head", Phase.FORWARD, ((8, 1),), ("float32",), 32),
        Op("dmm", "MatMul", "head", Phase.BACKWARD, ((8, 8, 8),), ("float32",), 2048),
        Op("out", "Identity", "emb", Phase.BACKWARD, ((64, 8),), ("float32",), 2048),
    )
    edges = (
        Edge("ids", "gather", 256),
        Edge("gather", "mm", 2048),
        Edge("mm", "dmm", 32),
        Edge("dmm", "out", 2048),
    )
    graph = Graph("rec", ops, edges, layers, 8)
    return layer_memory(graph, optimizer)


def test_memory_holds_the_slices_and_dense_optimizer_slots() -> None:
    sgd, adam = _embedding_graph(Optimizer.SGD), _embedding_graph(Optimizer.ADAM)
    # the gradient: the 32-byte bias densely, the table's 64 rows x (32 + 4) bytes as slices
    assert sgd[0].gradient_bytes == 32 + 64 * 36
    assert sgd[0].sparse_gradient_bytes == 64 * 36
    assert sgd[0].dense_gradient_bytes == 32
    assert sgd[0].sparse_gradient_dense_bytes == 32_000
    assert sgd[0].transient_bytes == 0  # plain SGD scatters the rows
    assert adam[0].optimizer_bytes == 2 * 32_032  # slots stay the table's size
    assert adam[0].transient_bytes == 32_000  # Adam's update makes a table-sized gradient
    assert adam[1].gradient_bytes == sgd[1].gradient_bytes == 40  # dense layers unchanged
    assert {o for o in Optimizer if o.densifies_sparse_gradients} == {
        Optimizer.MOMENTUM,
        Optimizer.ADAM,
        Optimizer.ADAMW,
        Optimizer.RMSPROP,
    }


def test_densified_memory_is_the_dense_table() -> None:
    m = _embedding_graph(Optimizer.SGD)[0]
    dense = m.densified()
    assert dense.gradient_bytes == 32 + 32_000 and dense.sparse_gradient_bytes == 0
    assert dense.transient_bytes == 32_000  # the converted slices beside the sum
    assert dense.optimizer_bytes == m.optimizer_bytes
    plain = LayerMemory("d", 4, 4, 8, 0)
    assert plain.densified() is plain


def test_reduce_to_one_gathers_each_replicas_slices_and_broadcasts_their_concatenation() -> None:
    topo = _topology(4)
    s = 1000
    # gather: each member's s bytes on its own link; broadcast: the 4 s concatenation back
    expected = (0.001 + s / 1e6) + (0.001 + 4 * s / 1e6)
    got = gradient_exchange_s(topo, [((0, 1, 2, 3), 0, s)], AllReduceAlgorithm.REDUCE_TO_ONE)
    assert got == pytest.approx(expected)
    # dense and sparse share the two phases
    both = gradient_exchange_s(topo, [((0, 1, 2, 3), 500, s)], AllReduceAlgorithm.REDUCE_TO_ONE)
    assert both == pytest.approx((0.001 + 1500 / 1e6) + (0.001 + 4500 / 1e6))
    # members 2 and 3 share host 1's channel to the root's host
    two_hosts = _topology(4, hosts=2)
    shared = gradient_exchange_s(
        two_hosts, [((0, 1, 2, 3), 0, s)], AllReduceAlgorithm.REDUCE_TO_ONE
    )
    assert shared == pytest.approx((0.001 + 2 * s / 1e6) + (0.001 + 8 * s / 1e6))


def test_dense_gradients_are_priced_as_before() -> None:
    topo = _topology(4, hosts=2)
    for algorithm in AllReduceAlgorithm:
        dense = gradient_exchange_s(topo, [((0, 1, 2, 3), 10_000, 0)], algorithm)
        assert dense == pytest.approx(all_reduce_s(topo, (0, 1, 2, 3), 10_000, algorithm))
    assert concurrent_reduce_to_one_s(topo, [((0, 2), 100), ((1, 3), 100)]) == pytest.approx(
        2 * (0.001 + 200 / 1e6)
    )


def test_a_ring_all_gathers_the_slices_in_r_minus_1_steps() -> None:
    topo = _topology(4)
    s = 8000
    bw = ring_bandwidth_bytes_per_s(LINK)
    assert concurrent_all_gather_s(topo, [((0, 1, 2, 3), s)]) == pytest.approx(3 * (0.001 + s / bw))
    both = gradient_exchange_s(topo, [((0, 1, 2, 3), 4000, s)], AllReduceAlgorithm.RING)
    assert both == pytest.approx(all_reduce_s(topo, (0, 1, 2, 3), 4000) + 3 * (0.001 + s / bw))
    assert concurrent_all_gather_s(topo, [((0,), s), ((1, 2, 3, 0), 0)]) == 0.0


def test_the_recommender_exchanges_kilobytes_not_the_table() -> None:
    # Issue 33's recommender on two replicas of batch 512 each: 8192 rows of 260 bytes (2.1 MB)
    # per replica, where the dense table is 51.2 MB.
    topo = _topology(2)
    s = _table(512).slices_bytes
    dense = gradient_exchange_s(topo, [((0, 1), TABLE_BYTES, 0)], AllReduceAlgorithm.REDUCE_TO_ONE)
    sparse = gradient_exchange_s(topo, [((0, 1), 0, s)], AllReduceAlgorithm.REDUCE_TO_ONE)
    assert dense == pytest.approx(2 * (0.001 + TABLE_BYTES / 1e6))
    assert sparse == pytest.approx((0.001 + s / 1e6) + (0.001 + 2 * s / 1e6))
    assert dense / sparse == pytest.approx(2 * TABLE_BYTES / (3 * s), rel=1e-3)  # about 16x


def test_a_measured_all_reduce_prices_the_bytes_the_exchange_sends() -> None:
    fit = AllReduceFit(latency_s=0.002, bandwidth_bytes_per_s=5e5, members=2, source="test")
    topo = Topology(_topology(4).devices, LINK, all_reduce=fit)
    s = 3000
    # a ring all-gather sends (R - 1) s per member; an all-reduce of B sends 2 (R - 1) / R B
    assert all_gather_equivalent_bytes(4, s, AllReduceAlgorithm.RING) == 4 * s // 2
    assert all_gather_equivalent_bytes(4, s, AllReduceAlgorithm.REDUCE_TO_ONE) == 5 * s // 2
    assert all_gather_equivalent_bytes(1, s, AllReduceAlgorithm.RING) == 0
    for algorithm in AllReduceAlgorithm:
        equivalent = all_gather_equivalent_bytes(4, s, algorithm)
        got = gradient_exchange_s(topo, [((0, 1, 2, 3), 700, s)], algorithm)
        expected = measured_all_reduce_s(fit, 4, 700) + measured_all_reduce_s(fit, 4, equivalent)
        assert got == pytest.approx(expected)
    assert concurrent_all_gather_s(topo, [((0, 1, 2, 3), s)]) == pytest.approx(
        measured_all_reduce_s(fit, 4, 2 * s)
    )
