"""The strategy planner: strategies as data, all-reduce times, the simulated step of a strategy,
the search over families and its refinement (pure Python, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cost_models.estimate.collectives import all_reduce_s, concurrent_all_reduce_s, ring_order
from partitioner.core.errors import InvalidGraphError, PlanError
from partitioner.core.ir import CostedGraph, Schedule
from partitioner.core.strategy import Family, Strategy
from partitioner.planner.refine import boundary_moves, refine
from partitioner.planner.search import (
    StrategyOptions,
    device_layouts,
    microbatch_choices,
    search_batches,
    search_strategies,
)
from partitioner.simulation.evaluate import evaluate
from partitioner.simulation.strategy import microbatch_costed, simulate_strategy
from tests.planner.strategy_graphs import (
    FAST_LINK,
    SLOW_LINK,
    chain_at,
    chain_costs,
    uniform_topology,
)

# -- strategies as data -------------------------------------------------------------------------


def test_families_and_words() -> None:
    one = Strategy(((0,),), (0, 0))
    dp = Strategy(((0,), (1,)), (0, 0))
    pipe = Strategy(((0, 1),), (0, 1), 8, Schedule.ONE_F_ONE_B)
    split = Strategy(((0, 1),), (0, 1))
    hybrid = Strategy(((0, 1), (2, 3)), (0, 1), 16, Schedule.ONE_F_ONE_B)
    assert [s.family for s in (one, dp, pipe, split, hybrid)] == [
        Family.SINGLE,
        Family.DATA_PARALLEL,
        Family.PIPELINE,
        Family.PLACED,
        Family.HYBRID,
    ]
    assert hybrid.describe() == "2 data-parallel replicas x 2 stages, 1F1B, 16 micro-batches"
    assert one.describe() == "one device"
    assert hybrid.layer_devices(1) == (2, 3)
    assert hybrid.devices == (0, 1, 2, 3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"device_groups": ((0, 1), (2,)), "stage_of_layer": (0,)},
        {"device_groups": ((0,), (0,)), "stage_of_layer": (0,)},
        {"device_groups": ((0, 1),), "stage_of_layer": (0, 2)},
        {"device_groups": ((0, 1),), "stage_of_layer": (0, 1), "num_microbatches": 4},
        {"device_groups": ((0, 1),), "stage_of_layer": (0, 1), "schedule": Schedule.GPIPE},
    ],
)
def test_bad_strategies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidGraphError):
        Strategy(**kwargs)  # type: ignore[arg-type]


# -- all-reduce --------------------------------------------------------------------------------


def test_ring_all_reduce_times() -> None:
    topo = uniform_topology(4, SLOW_LINK)
    # 2 devices, 100 bytes: 2 (R-1) = 2 steps of 0.25 + 50/100.
    assert all_reduce_s(topo, (0, 1), 100) == pytest.approx(1.5)
    # 4 devices: 6 steps of 0.25 + 25/100.
    assert all_reduce_s(topo, (0, 1, 2, 3), 100) == pytest.approx(3.0)
    assert all_reduce_s(topo, (0,), 100) == 0.0
    assert all_reduce_s(topo, (0, 1), 0) == 0.0


def test_rings_sharing_a_host_channel_are_slower() -> None:
    topo = uniform_topology(4, SLOW_LINK, hosts=2)  # devices 0, 1 on host 0; 2, 3 on host 1
    assert ring_order(topo, (2, 0, 3, 1)) == (0, 1, 2, 3)
    alone = all_reduce_s(topo, (0, 2), 100)
    # Two stages all-reducing across the hosts at once share the host -> host channel.
    together = concurrent_all_reduce_s(topo, [((0, 2), 100), ((1, 3), 100)])
    assert together == pytest.approx(2 * (0.25 + 100 / 100))
    assert alone == pytest.approx(2 * (0.25 + 50 / 100))


# -- the simulated step of a strategy ----------------------------------------------------------

CHAIN = {"fwd_s": (1.0, 1.0, 1.0, 1.0), "weight_bytes": (100, 100, 100, 100), "act_bytes": 40}


def test_data_parallel_step_is_replica_step_plus_all_reduce() -> None:
    topo = uniform_topology(2, SLOW_LINK)
    half = chain_at(8, full_batch=16, topology=topo, **CHAIN)  # type: ignore[arg-type]
    sim = simulate_strategy(half, Strategy(((0,), (1,)), (0, 0, 0, 0)))
    one_replica = evaluate(half, (0, 0, 0, 0)).step_time_s
    assert sim.replica_step_s == pytest.approx((one_replica, one_replica))
    assert sim.gradient_bytes == (400,)
    assert sim.all_reduce_s == pytest.approx(all_reduce_s(topo, (0, 1), 400))
    assert sim.step_time_s == pytest.approx(one_replica + sim.all_reduce_s)
    # each replica holds the whole model: weights + gradients + the activations of its half.
    assert sim.peak_memory_bytes == (4 * (100 + 100 + 20),) * 2
    assert sim.fits


def test_memory_overflow_is_reported_per_device() -> None:
    topo = uniform_topology(2, SLOW_LINK, memory_bytes=500)
    costed = chain_at(16, full_batch=16, topology=topo, **CHAIN)  # type: ignore[arg-type]
    sim = simulate_strategy(costed, Strategy(((0,),), (0, 0, 0, 0)))
    assert not sim.fits
    assert sim.over_memory == ((0, 4 * (200 + 40), 500),)


# -- the search --------------------------------------------------------------------------------


def test_layouts_and_microbatch_choices() -> None:
    topo = uniform_topology(4, SLOW_LINK, hosts=2)
    assert device_layouts(topo, 2, 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    assert device_layouts(topo, 1, 4) == (((0, 1, 2, 3),),)
    assert microbatch_choices(32, 2, 4) == (1, 2, 4, 8)
    assert microbatch_choices(32, 1, 4) == (1,)
    assert microbatch_choices(6, 4, 4) == (1, 6)


def _search(link, memory_bytes=1 << 40, weight=100, **options):  # type: ignore[no-untyped-def]
    topo = uniform_topology(4, link, memory_bytes=memory_bytes)
    chain = dict(CHAIN, weight_bytes=(weight,) * 4)
    costs = chain_costs(32, topology=topo, **chain)
    return search_strategies(costs, 32, StrategyOptions(**options))


def test_cheap_gradients_on_a_fast_link_choose_data_parallel() -> None:
    found = _search(FAST_LINK)
    assert found.best.strategy.family is Family.DATA_PARALLEL
    assert found.best.strategy.replicas == 4
    single = found.best_per_family()[Family.SINGLE]
    assert found.best.step_time_s == pytest.approx(single.step_time_s / 4)


def test_heavy_gradients_on_a_slow_link_do_not_choose_data_parallel() -> None:
    found = _search(SLOW_LINK, weight=100_000)
    per_family = found.best_per_family()
    assert found.best.strategy.family is not Family.DATA_PARALLEL
    assert per_family[Family.DATA_PARALLEL].step_time_s > found.best.step_time_s


def test_a_model_that_fits_no_device_is_split() -> None:
    # 4 layers x (2 x 100 weights+grads + 40 activations) = 960 bytes; a device holds 600.
    found = _search(FAST_LINK, memory_bytes=600)
    assert found.best.simulation.fits
    assert found.best.strategy.stages > 1
    assert not found.best_per_family()[Family.SINGLE].simulation.fits


@pytest.mark.parametrize("link", [FAST_LINK, SLOW_LINK])
def test_the_choice_is_never_slower_than_a_fitting_candidate(link) -> None:  # type: ignore[no-untyped-def]
    found = _search(link, weight=1000)
    fitting = [c.step_time_s for c in found.candidates if c.simulation.fits]
    assert found.best.step_time_s <= min(fitting) + 1e-12
    assert {Family.SINGLE, Family.DATA_PARALLEL, Family.PIPELINE, Family.PLACED, Family.HYBRID} <= set(
        found.best_per_family()
    )


def test_forcing_a_family() -> None:
    found = _search(FAST_LINK, families=(Family.PIPELINE,))
    assert {c.strategy.family for c in found.candidates} == {Family.PIPELINE}


# -- refinement --------------------------------------------------------------------------------


def test_boundary_moves() -> None:
    assert boundary_moves((0, 0, 1, 1)) == ((1, 1), (2, 0))
    assert boundary_moves((0, 0)) == ()


def test_refinement_improves_an_uneven_split_and_never_worsens() -> None:
    topo = uniform_topology(2, FAST_LINK)
    costed = chain_at(16, full_batch=16, topology=topo, fwd_s=(1.0,) * 8, weight_bytes=(1,) * 8, act_bytes=8)
    start = simulate_strategy(costed, Strategy(((0, 1),), (0,) * 7 + (1,), 8, Schedule.ONE_F_ONE_B))
    best = refine(costed, start, seed=0, time_limit_s=5.0, max_moves=300).best
    assert best.step_time_s < 0.8 * start.step_time_s
    assert best.strategy.stage_of_layer.count(1) >= 3


def test_forcing_data_parallel_for_a_model_that_fits_no_device_names_bytes_and_what_fits() -> None:
    from partitioner.core.errors import InfeasibleError

    with pytest.raises(InfeasibleError) as info:
        _search(FAST_LINK, memory_bytes=600, families=(Family.DATA_PARALLEL,))
    message = str(info.value)
    assert "\n" not in message
    assert "strategy='data_parallel' does not fit" in message
    # a replica holds the whole model (4 x 200 bytes) and its half of the activations (4 x 20).
    assert "device 0 needs 880 B" in message and "its limit is 600 B" in message
    # data parallelism was forced: the smallest hybrid that fits keeps the replicas.
    assert "; the smallest hybrid that fits is 2 x 2 (2 data-parallel replicas x 2 stages" in message
    assert message.endswith(": strategy='hybrid'")


# -- the families table ------------------------------------------------------------------------


def test_family_rows_say_why_each_family_lost() -> None:
    from partitioner.planner.explain import advice, family_rows

    rows = family_rows(_search(SLOW_LINK, weight=100_000))
    chosen = [r for r in rows if r.chosen]
    assert len(chosen) == 1 and chosen[0].why_not == ""
    by_family = {r.family: r for r in rows}
    assert "all-reduce" in by_family[Family.DATA_PARALLEL].why_not
    assert by_family[Family.SINGLE].speedup_over_single == pytest.approx(1.0)
    text = advice(rows)
    assert text.startswith(f"Fastest predicted strategy: {chosen[0].description}")
    assert "data parallel" in text


def test_reduce_to_one_gathers_then_broadcasts() -> None:
    from cost_models.estimate.collectives import AllReduceAlgorithm

    topo = uniform_topology(4, SLOW_LINK)
    # 3 members send 100 bytes each to the root over their own links, then get the sum back.
    assert all_reduce_s(topo, (0, 1, 2, 3), 100, AllReduceAlgorithm.REDUCE_TO_ONE) == pytest.approx(
        2 * (0.25 + 100 / 100)
    )
    two_hosts = uniform_topology(4, SLOW_LINK, hosts=2)
    # members 2 and 3 share host 1 -> host 0's channel: 200 bytes on it.
    assert all_reduce_s(
        two_hosts, (0, 1, 2, 3), 100, AllReduceAlgorithm.REDUCE_TO_ONE
    ) == pytest.approx(2 * (0.25 + 200 / 100))


def test_the_simulated_all_reduce_is_the_one_the_rewrite_runs() -> None:
    from cost_models.estimate.collectives import AllReduceAlgorithm

    for device_type, groups, stages, expected in [
        ("h100", ((0,), (1,)), (0, 0, 0, 0), AllReduceAlgorithm.RING),  # NCCL
        ("cpu", ((0,), (1,)), (0, 0, 0, 0), AllReduceAlgorithm.REDUCE_TO_ONE),
        ("h100", ((0, 1), (2, 3)), (0, 0, 1, 1), AllReduceAlgorithm.REDUCE_TO_ONE),  # hybrid
    ]:
        topo = uniform_topology(4, SLOW_LINK, device_type=device_type)
        costed = chain_at(8, full_batch=16, topology=topo, **CHAIN)  # type: ignore[arg-type]
        sim = simulate_strategy(costed, Strategy(groups, stages))
        assert sim.algorithm is expected
        grads = sim.gradient_bytes
        rings = [(tuple(g[s] for g in groups), grads[s]) for s in range(len(groups[0]))]
        if expected is AllReduceAlgorithm.RING:
            assert sim.all_reduce_s == pytest.approx(concurrent_all_reduce_s(topo, rings))
        else:
            assert sim.all_reduce_s == pytest.approx(
                max(all_reduce_s(topo, r, b, expected) for r, b in rings)
            )


def test_costing_is_not_charged_to_the_time_limit_and_every_family_is_scored() -> None:
    import time as _time

    topo = uniform_topology(4, FAST_LINK)
    inner = chain_costs(32, topology=topo, **CHAIN)

    def slow_costs(batch: int):  # type: ignore[no-untyped-def]
        _time.sleep(0.05)  # costing (tracing, profiling) takes longer than the search's limit
        return inner(batch)

    found = search_strategies(slow_costs, 32, StrategyOptions(time_limit_s=0.01))
    assert set(found.best_per_family()) == set(Family)


def test_a_hybrid_bubble_counts_only_its_own_stage_devices() -> None:
    from partitioner.planner.explain import _bubble

    topo = uniform_topology(4, FAST_LINK)
    costed = chain_at(16, full_batch=32, topology=topo, **CHAIN)  # type: ignore[arg-type]
    sim = simulate_strategy(costed, Strategy(((0, 1), (2, 3)), (0, 0, 1, 1), 8, Schedule.ONE_F_ONE_B))
    # devices 2 and 3 are idle in replica 0's simulation; the bubble is replica 0's stages'.
    assert sim.replica.pipeline is not None and sim.replica.pipeline.bubble_fraction[2] == 1.0
    assert 0.0 < _bubble(sim) < 0.5


# -- a pipeline priced at its micro-batch ------------------------------------------------------


def _with_overhead(costed: CostedGraph, overhead_s: float) -> CostedGraph:
    """``costed`` with a fixed cost per op: a small batch is not proportionally cheaper."""
    rows = tuple(tuple(t + overhead_s for t in row) for row in costed.op_compute_time_s)
    return replace(costed, op_compute_time_s=rows)


def test_microbatch_costed_prices_each_op_at_the_micro_batch_times_m() -> None:
    topo = uniform_topology(2, FAST_LINK)
    whole = _with_overhead(chain_at(16, full_batch=16, topology=topo, **CHAIN), 0.5)  # type: ignore[arg-type]
    micro = _with_overhead(chain_at(4, full_batch=16, topology=topo, **CHAIN), 0.5)  # type: ignore[arg-type]
    priced = microbatch_costed(whole, micro, 4)
    for row, micro_row in zip(priced.op_compute_time_s, micro.op_compute_time_s):
        assert row == pytest.approx([4 * t for t in micro_row])
    # four micro-batches pay the fixed cost four times: dearer than the batch's linear share
    assert sum(priced.op_compute_time_s[0]) > sum(whole.op_compute_time_s[0])
    assert priced.layer_memory == whole.layer_memory and priced.graph == whole.graph
    assert microbatch_costed(whole, micro, 1) is whole
    # an op the micro-batch graph lacks keeps the batch's time
    def renamed(op_id: str) -> str:
        return op_id + "'" if op_id == "L0/f" else op_id

    graph = micro.graph
    renamed_micro = replace(micro, graph=replace(
        graph,
        ops=tuple(replace(op, id=renamed(op.id)) for op in graph.ops),
        edges=tuple(replace(e, src=renamed(e.src), dst=renamed(e.dst)) for e in graph.edges),
    ))  # fmt: skip
    kept = microbatch_costed(whole, renamed_micro, 4)
    assert kept.op_compute_time_s[0][0] == whole.op_compute_time_s[0][0]
    assert kept.op_compute_time_s[0][1] == pytest.approx(4 * micro.op_compute_time_s[0][1])
    other = chain_at(4, full_batch=16, topology=uniform_topology(3, FAST_LINK), **CHAIN)  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="3 devices, the replica's on 2"):
        microbatch_costed(whole, other, 4)


def test_the_search_prices_every_pipeline_at_its_micro_batch() -> None:
    topo = uniform_topology(2, FAST_LINK)
    inner = chain_costs(16, topology=topo, **CHAIN)
    asked: list[int] = []

    def costed_at(batch: int) -> CostedGraph:
        asked.append(batch)
        return _with_overhead(inner(batch), 0.05)

    found = search_strategies(costed_at, 16, StrategyOptions(refine=False))
    assert sorted(set(asked), reverse=True) == list(search_batches(2, 16)) == [16, 8, 4, 2]
    pipelines = [c for c in found.candidates if c.strategy.num_microbatches > 1]
    assert pipelines
    for c in pipelines:
        m = c.strategy.num_microbatches
        priced = microbatch_costed(costed_at(16), costed_at(16 // m), m)
        assert c.step_time_s == pytest.approx(simulate_strategy(priced, c.strategy).step_time_s)
        linear = simulate_strategy(costed_at(16), c.strategy).step_time_s
        assert c.step_time_s > linear  # the fixed cost is paid per micro-batch


def test_replicas_of_a_plain_split_are_not_scored_the_rewrite_cannot_run_them() -> None:
    topo = uniform_topology(4, FAST_LINK)
    found = search_strategies(chain_costs(32, topology=topo, **CHAIN), 32, StrategyOptions())
    hybrids = [c.strategy for c in found.candidates if c.strategy.family is Family.HYBRID]
    assert hybrids and all(s.num_microbatches > 1 for s in hybrids)


def test_strategies_placed_elsewhere_are_scored_beside_the_search() -> None:
    topo = uniform_topology(2, FAST_LINK)
    costed_at = chain_costs(16, topology=topo, **CHAIN)
    odd = Strategy(((0, 1),), (0, 1, 1, 1), 2, Schedule.GPIPE)
    found = search_strategies(
        costed_at, 16, StrategyOptions(schedules=(Schedule.ONE_F_ONE_B,), also_score=((odd, "mine"),))
    )
    mine = [c for c in found.candidates if c.placement == "mine"]
    assert [c.strategy for c in mine] == [odd]
    single_only = StrategyOptions(families=(Family.SINGLE,), also_score=((odd, "mine"),))
    assert all(c.placement != "mine" for c in search_strategies(costed_at, 16, single_only).candidates)
