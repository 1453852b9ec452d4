"""Issue 16's bad input, in the strategy planner: a forced family that does not fit, a batch the
replicas or micro-batches do not divide, and replicas on devices of different speeds (pure
Python, milliseconds)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.core.errors import InfeasibleError, UsageError
from partitioner.core.ir import CostedGraph, Device, Topology
from partitioner.core.strategy import Family, Strategy
from partitioner.core.units import format_seconds
from partitioner.planner.explain import family_rows
from partitioner.planner.search import (
    CostedAt,
    StrategyCandidate,
    StrategyOptions,
    StrategySearch,
    device_layouts,
    search_strategies,
    uneven_share_reason,
)
from partitioner.simulation.strategy import simulate_strategy
from tests.planner.strategy_graphs import FAST_LINK, chain_costs, uniform_topology

# 4 layers of 100 bytes of weights (and as many of gradients), 40 bytes of activations at 32.
CHAIN = {"fwd_s": (1.0, 1.0, 1.0, 1.0), "weight_bytes": (100, 100, 100, 100), "act_bytes": 40}
A100, V100 = "a100-80gb", "v100"


def _search(
    n_dev: int, batch_size: int, memory_bytes: int = 1 << 40, **options: object
) -> StrategySearch:
    topo = uniform_topology(n_dev, FAST_LINK, memory_bytes=memory_bytes)
    costs = chain_costs(32, topology=topo, **CHAIN)
    chosen = StrategyOptions(**options)  # type: ignore[arg-type]
    return search_strategies(costs, batch_size, chosen)


# -- a forced family that does not fit ---------------------------------------------------------


def test_forced_data_parallel_names_the_replica_bytes_the_limit_and_the_smallest_hybrid() -> None:
    # A replica holds 4 x (100 + 100) bytes and 4 x 20 of activations: 880 B > 600 B. Two layers
    # per stage fit, so hybrids of 2 stages fit; of those, 4 x 2 is the fastest on 8 devices.
    with pytest.raises(InfeasibleError) as info:
        _search(8, 32, memory_bytes=600, families=(Family.DATA_PARALLEL,))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        "strategy='data_parallel' does not fit: with 2 data-parallel replicas, device 0 needs "
        "880 B (a replica holds its stages' weights, gradients and optimizer slots) and its "
        "limit is 600 B; the smallest hybrid that fits is 4 x 2 (4 data-parallel replicas x 2 "
        "stages, "
    )
    assert message.endswith(" per step): strategy='hybrid'")


def test_forced_data_parallel_without_a_fitting_hybrid_names_the_smallest_strategy() -> None:
    # 300 B holds one layer (200 B + activations): only 4 stages of one replica fit.
    with pytest.raises(InfeasibleError) as info:
        _search(4, 32, memory_bytes=300, families=(Family.DATA_PARALLEL,))
    message = str(info.value)
    assert "its limit is 300 B; the smallest strategy that fits is 4 stages, " in message
    assert message.endswith("(strategy='pipeline')")
    assert "hybrid" not in message


def test_nothing_fits_anywhere_says_so() -> None:
    with pytest.raises(InfeasibleError) as info:
        _search(4, 32, memory_bytes=100, families=(Family.DATA_PARALLEL,))
    assert str(info.value).endswith("; no strategy of any family fits: use more or larger devices")


# -- a batch the replicas or the micro-batches do not divide -----------------------------------


def test_forced_data_parallel_with_a_batch_no_replica_count_divides() -> None:
    with pytest.raises(UsageError) as info:
        _search(4, 7, families=(Family.DATA_PARALLEL,))
    assert str(info.value) == (
        "batch_size=7 cannot be split evenly over 2, 3 or 4 data-parallel replicas "
        "(tf.distribute gives each an equal share), the replica counts "
        "strategy='data_parallel' can use on 4 devices: use batch_size=6 (2 or 3 replicas), "
        "8 (2 or 4 replicas) or 9 (3 replicas), or strategy='auto'"
    )


def test_forced_hybrid_with_a_batch_no_replica_count_divides() -> None:
    with pytest.raises(UsageError) as info:
        _search(4, 7, families=(Family.HYBRID,))
    assert str(info.value) == (
        "batch_size=7 cannot be split evenly over 2 data-parallel replicas (tf.distribute gives "
        "each an equal share), the replica counts strategy='hybrid' can use on 4 devices: use "
        "batch_size=6 (2 replicas) or 8 (2 replicas), or strategy='auto'"
    )


def test_forced_hybrid_on_too_few_devices() -> None:
    with pytest.raises(InfeasibleError) as info:
        _search(3, 8, families=(Family.HYBRID,))
    assert str(info.value) == (
        "strategy='hybrid' needs 4 or more devices and the topology has 3: use 4 or more "
        "devices or strategy='auto'"
    )


def test_forced_pipeline_with_a_batch_no_micro_batch_count_divides() -> None:
    # 13 has no divisor from 2 to 2 stages x 4 micro-batches per stage.
    with pytest.raises(UsageError) as info:
        _search(2, 13, families=(Family.PIPELINE,))
    assert str(info.value) == (
        "batch_size=13 has no divisor from 2 to 8 to split into equal micro-batches (at most 4 "
        "per stage, up to 2 stages), so strategy='pipeline' cannot pipeline it: use "
        "batch_size=12 or 14, or strategy='auto'"
    )


def test_replica_counts_skipped_for_divisibility_are_noted() -> None:
    found = _search(4, 30)
    assert not any(c.strategy.replicas == 4 for c in found.candidates)
    assert (
        "4 replicas not scored: batch_size=30 does not split evenly over them (tf.distribute "
        "gives each replica an equal share); scored 1, 2 and 3; for 4 replicas use "
        "batch_size=28 or 32"
    ) in found.notes
    forced = _search(4, 30, families=(Family.DATA_PARALLEL,), prune=False)
    assert {c.strategy.replicas for c in forced.candidates} == {2, 3}
    assert any(n.startswith("4 replicas not scored") for n in forced.notes)


def test_no_note_when_every_replica_count_divides_the_batch() -> None:
    assert not any("not scored" in n for n in _search(4, 24).notes)


# -- replicas on devices of different types ----------------------------------------------------


def _mixed(types: tuple[str, ...], v100_slowdown: float) -> tuple[Topology, CostedAt]:
    """The chain on devices of ``types``, each op ``v100_slowdown`` times slower on a V100."""
    topo = Topology(tuple(Device(d, t, 1 << 40) for d, t in enumerate(types)), FAST_LINK)
    inner = chain_costs(32, topology=topo, **CHAIN)
    factor = [v100_slowdown if t == V100 else 1.0 for t in types]

    def costed_at(batch_size: int) -> CostedGraph:
        costed = inner(batch_size)
        rows = tuple(
            tuple(t * factor[d] for t in row) for d, row in enumerate(costed.op_compute_time_s)
        )
        return replace(costed, op_compute_time_s=rows)

    return topo, costed_at


def test_layouts_keep_each_stage_position_on_alike_devices() -> None:
    interleaved, _ = _mixed((A100, V100, A100, V100), 2.0)
    # the two host-order layouts are the same mixed pair; the third pairs the A100s.
    assert device_layouts(interleaved, 2, 1) == (((0,), (1,)), ((0,), (2,)))
    # stages together already put stage 0 on the A100s and stage 1 on the V100s.
    assert device_layouts(interleaved, 2, 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    assert device_layouts(interleaved, 4, 1) == (((0,), (1,), (2,), (3,)),)  # no 4 alike
    v100_first, _ = _mixed((V100, V100, A100, A100), 2.0)
    # the V100 pair is alike but slower: the A100 pair is scored too.
    assert device_layouts(v100_first, 2, 1) == (((0,), (1,)), ((2,), (3,)))
    assert device_layouts(v100_first, 2, 2) == (((0, 1), (2, 3)), ((0, 2), (1, 3)))


def test_alike_replicas_win_over_a_mixed_pair() -> None:
    _, costs = _mixed((A100, V100, A100, V100), 3.0)
    found = search_strategies(costs, 32)
    data_parallel = found.best_per_family()[Family.DATA_PARALLEL]
    assert data_parallel.strategy.device_groups == ((0,), (2,))
    assert data_parallel.replica_device_types == (A100, A100)
    assert not any("equal shares" in n for n in found.notes)


def test_a_mixed_data_parallel_choice_says_the_slowest_replica_paces_the_step() -> None:
    _, costs = _mixed((A100, V100, A100, V100), 1.5)
    found = search_strategies(costs, 32)
    assert found.best.strategy.device_groups == ((0,), (1,), (2,), (3,))
    fast_s, slow_s, _, _ = found.best.simulation.replica_step_s
    assert slow_s == pytest.approx(1.5 * fast_s)
    assert (
        "data parallel (4 data-parallel replicas): replicas take equal shares of the batch "
        f"(tf.distribute splits it evenly): the 2 {A100} replicas take {format_seconds(fast_s)}, "
        f"the 2 {V100} replicas take {format_seconds(slow_s)}, and the step waits for the "
        "slowest"
    ) in found.notes


def test_a_mixed_family_that_lost_says_why_in_its_row() -> None:
    _, costs = _mixed((A100, V100), 3.0)
    costed = costs(16)
    single_sim = simulate_strategy(costs(32), Strategy(((0,),), (0, 0, 0, 0)))
    single = StrategyCandidate(single_sim, "-", (A100,))
    mixed_sim = simulate_strategy(costed, Strategy(((0,), (1,)), (0, 0, 0, 0)))
    mixed = StrategyCandidate(mixed_sim, "-", (A100, V100))
    assert mixed.step_time_s > single.step_time_s
    rows = family_rows(StrategySearch(best=single, candidates=(single, mixed)))
    row = next(r for r in rows if r.family is Family.DATA_PARALLEL)
    fast_s, slow_s = mixed_sim.replica_step_s
    assert row.why_not.endswith(
        f"; replicas take equal shares of the batch (tf.distribute splits it evenly): the {A100} "
        f"replica takes {format_seconds(fast_s)}, the {V100} replica takes "
        f"{format_seconds(slow_s)}, and the step waits for the slowest"
    )
    assert uneven_share_reason(replace(mixed, replica_device_types=(A100, A100))) == ""
    assert uneven_share_reason(replace(mixed, replica_device_types=())) == ""
