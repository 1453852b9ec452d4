"""The strategy simulation prices an embedding's ``IndexedSlices`` gradient as TensorFlow
exchanges it, and the planner's choice follows (pure Python)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.estimate.collectives import AllReduceAlgorithm, gradient_exchange_s
from partitioner.core.ir import CostedGraph, LayerMemory, Link, Schedule, SparseGradient
from partitioner.core.strategy import Family, Strategy
from partitioner.planner.search import StrategyOptions, search_strategies
from partitioner.simulation.strategy import (
    gradient_bytes_per_stage,
    keeps_sparse_gradients,
    simulate_strategy,
    sparse_gradient_bytes_per_stage,
    static_overflow,
)
from tests.planner.strategy_graphs import chain_at, uniform_topology

# 10 ms + bytes / 1 MB/s: a 51.2 MB table takes 51 s each way, a replica's slices a tenth of a s.
LINK = Link("test", latency_s=0.01, bandwidth_bytes_per_s=1e6)
TABLE_BYTES = 200_000 * 64 * 4
IDS_PER_EXAMPLE = 16
ROW_BYTES = 64 * 4
FULL_BATCH = 32
CHAIN = {"fwd_s": (1.0, 1.0, 1.0, 1.0), "weight_bytes": (100, 100, 100, 100), "act_bytes": 40}


def _recommender(batch: int, *, sparse: bool = True, devices: int = 2) -> CostedGraph:
    """``chain_at``'s four layers, L0 an embedding whose gradient is ``IndexedSlices`` of
    ``batch x 16`` rows (``sparse``) or dense (the table)."""
    topo = uniform_topology(devices, LINK, device_type="cpu")
    costed = chain_at(batch, full_batch=FULL_BATCH, topology=topo, **CHAIN)  # type: ignore[arg-type]
    g = SparseGradient("L0/embeddings", IDS_PER_EXAMPLE * batch, ROW_BYTES, 4, TABLE_BYTES)
    first = costed.layer_memory[0]
    memory = LayerMemory(
        first.layer,
        TABLE_BYTES,
        g.slices_bytes if sparse else TABLE_BYTES,
        0,
        first.activation_bytes,
        sparse_gradient_bytes=g.slices_bytes if sparse else 0,
        sparse_gradient_dense_bytes=TABLE_BYTES if sparse else 0,
    )
    layers = (replace(costed.graph.layers[0], sparse_gradients=(g,) if sparse else ()),)
    graph = replace(costed.graph, layers=layers + costed.graph.layers[1:])
    return replace(costed, graph=graph, layer_memory=(memory, *costed.layer_memory[1:]))


def test_data_parallel_all_gathers_the_slices() -> None:
    strategy = Strategy(((0,), (1,)), (0, 0, 0, 0))
    half = FULL_BATCH // 2
    sim = simulate_strategy(_recommender(half), strategy)
    s = IDS_PER_EXAMPLE * half * (ROW_BYTES + 4)
    assert sim.algorithm is AllReduceAlgorithm.REDUCE_TO_ONE
    assert sim.sparse_gradient_bytes == (s,)
    assert sim.gradient_bytes == (s + 300,)
    # the dense 300 bytes and the slices go to the root, the sum and the 2-fold concatenation back
    assert sim.all_reduce_s == pytest.approx(
        (0.01 + (300 + s) / 1e6) + (0.01 + (300 + 2 * s) / 1e6)
    )
    dense = simulate_strategy(_recommender(half, sparse=False), strategy)
    assert dense.sparse_gradient_bytes == ()
    assert dense.all_reduce_s == pytest.approx(2 * (0.01 + (TABLE_BYTES + 300) / 1e6))
    assert dense.all_reduce_s > 100 * sim.all_reduce_s


def test_rewrites_that_sum_micro_batches_densely_exchange_and_hold_the_table() -> None:
    costed = _recommender(FULL_BATCH // 2, devices=4)
    hybrid = Strategy(((0, 1), (2, 3)), (0, 0, 1, 1))
    pipeline = Strategy(((0, 1),), (0, 0, 1, 1), num_microbatches=2, schedule=Schedule.GPIPE)
    split = Strategy(((0, 1),), (0, 0, 1, 1))
    assert not keeps_sparse_gradients(hybrid) and not keeps_sparse_gradients(pipeline)
    assert keeps_sparse_gradients(split)
    assert keeps_sparse_gradients(Strategy(((0,), (1,)), (0, 0, 0, 0)))
    assert gradient_bytes_per_stage(costed, hybrid) == (TABLE_BYTES + 100, 200)
    assert sparse_gradient_bytes_per_stage(costed, hybrid) == (0, 0)
    sim = simulate_strategy(costed, hybrid)
    groups = [((0, 2), TABLE_BYTES + 100, 0), ((1, 3), 200, 0)]
    assert sim.all_reduce_s == pytest.approx(
        gradient_exchange_s(costed.topology, groups, AllReduceAlgorithm.REDUCE_TO_ONE)
    )
    # stage 0's device holds the table's weights; the pipeline also its dense gradient sum and
    # the converted slices (two tables more), the plain split only the slices
    piped = simulate_strategy(costed, pipeline)
    kept = simulate_strategy(costed, split)
    assert piped.peak_memory_bytes[0] >= 3 * TABLE_BYTES
    assert kept.peak_memory_bytes[0] < TABLE_BYTES + 2 * costed.layer_memory[0].gradient_bytes
    tight = replace(
        costed,
        topology=uniform_topology(4, LINK, memory_bytes=3 * TABLE_BYTES // 2, device_type="cpu"),
    )
    assert not static_overflow(tight, split) and static_overflow(tight, pipeline)


def _search(sparse: bool):  # type: ignore[no-untyped-def]
    return search_strategies(
        lambda batch: _recommender(batch, sparse=sparse),
        FULL_BATCH,
        StrategyOptions(refine=False, time_limit_s=10.0),
    )


def test_the_planner_chooses_data_parallel_once_the_embedding_is_priced_sparse() -> None:
    # One device: 4 layers x 3 s = 12 s. Two replicas: 6 s, plus 102 s for the dense table's
    # all-reduce but 0.2 s for the slices.
    dense, sparse = _search(sparse=False), _search(sparse=True)
    assert dense.best.strategy.family is not Family.DATA_PARALLEL
    assert sparse.best.strategy.family is Family.DATA_PARALLEL
    assert sparse.best.step_time_s == pytest.approx(
        6.0 + sparse.best.simulation.all_reduce_s, rel=1e-6
    )
    assert sparse.best.simulation.all_reduce_s < 0.25
