"""Large graphs stay fast (issue 20): the simulators' per-graph views and the strategy
simulation's replica reuse give the results they gave before, and the benchmark's graph is what
it says.

The digests below are of the results (their ``repr``: every float exactly) computed by the
simulators before they read :mod:`partitioner.simulation.opview` and reused replicas (commit
3b94609), on a 784-op graph of ``benchmarks.graph_scale`` across two hosts. A deliberate change
of the simulation model changes them; a speed-up must not. Changed once since, deliberately: the
pipelined digests when every backward after the first began to pay its gradient accumulation
(:func:`partitioner.simulation.pipeline.accumulate_time_s`); with that term set to 0 the step,
timeline, busy times and peaks were those of the old digests. And the four strategy digests
when the IR gained its sparse-gradient fields (``LayerInfo.sparse_gradients``,
``LayerMemory.sparse_gradient_bytes``/``sparse_gradient_dense_bytes``,
``StrategySimulation.sparse_gradient_bytes``): their ``repr`` with those default fields taken out
gives the old digests. And the micro-batch costed graph's when ``Topology`` gained the fields
of a calibrated topology (``device_flops_per_s``, ``cluster_addresses``, ``client_step_s``,
``client_link``): its ``repr`` without them gives the old digest. And the pipelined and hybrid
digests when ``Stage`` gained ``feed_bytes`` (the batch a client feeds each stage, priced only
with a measured client link, which this topology has not): their ``repr`` with every
``, feed_bytes=N`` taken out gives the old digests (a38ac83b.. -> a575135a.., 7011310c.. ->
3e44ad67.., 25a2f2b8.. -> ff5ededb.., 71a4cd88.. -> 662bb76d.., 8f16ba6e.. -> cd0800c9..).
And the pipelined, micro-batch and hybrid digests when ``Stage`` gained ``memory_share``,
``CostedGraph`` ``op_memory_share`` and ``Topology`` ``concurrent_memory_factor`` (how running at
once slows memory-bound work; this topology measured none): their ``repr`` with
``, memory_share=X``, ``, op_memory_share=(...)`` and ``, concurrent_memory_factor=None`` taken
out gives the digests before (a38ac83b.., 7011310c.., 25a2f2b8.., 71a4cd88.., 641c0bee..,
8f16ba6e..).
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from benchmarks.graph_scale import Settings, blocks_for, format_table, make_costed, make_topology
from partitioner.core.errors import InvalidGraphError
from partitioner.core.ir import CostedGraph, Schedule
from partitioner.core.strategy import Strategy
from partitioner.simulation.bounds import costed_lower_bounds
from partitioner.simulation.evaluate import evaluate, evaluate_pipeline
from partitioner.simulation.pipeline import simulate_pipeline
from partitioner.simulation.step import simulate_step
from partitioner.simulation.strategy import _replica, microbatch_costed, simulate_strategy
from partitioner.solvers import get_solver


def digest(value: object) -> str:
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


@pytest.fixture(scope="module")
def costed() -> CostedGraph:
    return make_costed(6, make_topology(16), batch=16)


def split(costed: CostedGraph, parts: int) -> tuple[int, ...]:
    n = len(costed.layer_memory)
    return tuple(k * parts // n for k in range(n))


def test_the_graph_is_a_training_step_of_the_size_asked(costed: CostedGraph) -> None:
    assert len(costed.graph.ops) == 784 and len(costed.layer_memory) == 26
    assert costed.topology.num_devices == 16 and costed.topology.num_hosts == 2
    assert blocks_for(100_000) == 806
    assert all(m.activation_bytes > 0 for m in costed.layer_memory[1:-1])


def test_step_simulation_is_unchanged(costed: CostedGraph) -> None:
    assert digest(simulate_step(costed, split(costed, 8), timeline=True)) == "d9af449a07b4f0f2"
    round_robin = tuple(k % 16 for k in range(len(costed.layer_memory)))
    assert digest(simulate_step(costed, round_robin, timeline=True)) == "b056dcfcf7d8ae83"
    assert digest(evaluate(costed, split(costed, 8))) == "4927c52df0dc014b"


@pytest.mark.parametrize(
    ("schedule", "simulated", "evaluated"),
    [
        (Schedule.GPIPE, "d4e6a6a1cabe2aa4", "aac1a9d189e0197d"),
        (Schedule.ONE_F_ONE_B, "f3d173b9ed8948e2", "6b4ed629a8a3c64f"),
    ],
)
def test_pipeline_simulation_is_unchanged(
    costed: CostedGraph, schedule: Schedule, simulated: str, evaluated: str
) -> None:
    place = split(costed, 8)
    sim = simulate_pipeline(costed, place, schedule=schedule, num_microbatches=8)
    assert digest(sim) == simulated
    ev = evaluate_pipeline(costed, place, schedule=schedule, num_microbatches=8)
    assert digest(ev) == evaluated


def test_strategy_simulation_is_unchanged(costed: CostedGraph) -> None:
    # digests of 29624b8's results with target_bytes=0, trainable_tensors=0,
    # concurrent_compute_factor=1.0 and other_shares_feed_s=0.0 added to their reprs (without
    # those the digests are 29624b8's)
    micro = microbatch_costed(costed, make_costed(6, costed.topology, batch=4), 4)
    assert digest(micro) == "7599d8957fa54d72"
    groups = ((0, 1, 2, 3), (8, 9, 10, 11), (4, 5, 6, 7), (12, 13, 14, 15))
    hybrid = Strategy(groups, split(costed, 4), 4, Schedule.ONE_F_ONE_B)
    assert digest(simulate_strategy(micro, hybrid)) == "22ebbe0c709fcfb3"
    data_parallel = Strategy(tuple((d,) for d in range(16)), (0,) * len(costed.layer_memory))
    assert digest(simulate_strategy(costed, data_parallel)) == "ba81bba37cc589cc"
    mixed = Strategy(((0, 8), (1, 2), (3, 9)), split(costed, 2))
    assert digest(simulate_strategy(costed, mixed)) == "fc67f2af24eb6726"


@pytest.mark.parametrize(
    "groups",
    [
        ((0, 1), (2, 3), (8, 9)),  # alike: one simulation
        ((0, 8), (1, 2), (3, 9), (10, 11)),  # across hosts and within: two
        ((0,), (5,), (9,), (15,)),
    ],
)
def test_a_reused_replica_is_the_one_simulated(
    costed: CostedGraph, groups: tuple[tuple[int, ...], ...]
) -> None:
    """Every replica simulated on its own gives the step and peaks the reuse reports."""
    stages = len(groups[0])
    for m, schedule in ((1, Schedule.NONE), (4, Schedule.ONE_F_ONE_B)):
        strategy = Strategy(groups, split(costed, stages), m, schedule)
        sim = simulate_strategy(costed, strategy)
        bounds = costed_lower_bounds(costed)
        each = [_replica(costed, strategy, r, bounds) for r in range(len(groups))]
        assert sim.replica_step_s == tuple(e.step_time_s for e in each)
        for e, group in zip(each, groups, strict=True):
            for d in group:
                assert sim.peak_memory_bytes[d] == e.per_device[d].memory_bytes
        assert sim.replica == each[0]


def test_the_table_names_what_does_not_count() -> None:
    row = {"phase": "solve ilp", "wall_s": 0.5, "peak_rss_bytes": 1 << 30, "counts": False}
    result = {
        "ops": 1,
        "edges": 0,
        "layers": 1,
        "layer_edges": 0,
        "devices": 1,
        "hosts": 1,
        "rows": [{**row, "note": "CP-SAT not run"}],
        "solve_and_simulate_s": 0.0,
        "target_s": 60.0,
        "met": True,
    }
    text = format_table(result)
    assert "solve ilp *" in text and "CP-SAT not run" in text and "met" in text
    assert Settings().microbatches == 32


@pytest.mark.parametrize(
    ("name", "expected"),
    [("etf", "15b920bcf7595863"), ("metis", "ae5ad83122fa3eba"), ("auto", "2ccda52cc0cd2354")],
)
def test_filling_empty_devices_is_unchanged(name: str, expected: str) -> None:
    """82 layers on 32 devices: etf and metis move layers onto empty devices
    (``fill_empty_devices``, now with the three largest loads instead of a scan per layer);
    the placements, objectives and notes are the old code's (commit 3b94609)."""
    problem = make_costed(20, make_topology(32), batch=16).problem()
    options = {"time_limit_s": 2.0, "ilp": False} if name == "auto" else {}
    result = get_solver(name, **options).solve(problem)
    assert digest((result.assignment, result.objective, result.notes)) == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1.0])
def test_a_shared_row_of_op_times_is_checked_once_and_still_refused(
    costed: CostedGraph, bad: float
) -> None:
    row = (bad, *costed.op_compute_time_s[0][1:])
    for rows in ((row,) * 16, (*costed.op_compute_time_s[:15], row)):
        with pytest.raises(InvalidGraphError, match="finite non-negative"):
            replace(costed, op_compute_time_s=rows)


def test_layer_times_are_summed_once_per_distinct_row(costed: CostedGraph) -> None:
    layer_rows = costed.layer_compute_time_s
    assert all(r is layer_rows[0] for r in layer_rows)
    slower = tuple(2 * t for t in costed.op_compute_time_s[0])
    mixed = replace(costed, op_compute_time_s=(slower, *costed.op_compute_time_s[1:]))
    rows = mixed.layer_compute_time_s
    assert rows[1] is rows[15] and rows[0] is not rows[1]
    owner = costed.graph.layer_graph
    expected = [0.0] * len(owner.nodes)
    for op, t in zip(costed.graph.ops, slower, strict=True):
        expected[owner.index[owner.op_owner[op.id]]] += t
    assert rows[0] == tuple(expected) and rows[1] == layer_rows[0]
