"""The schedules module: each schedule's step order, its activation peak, and the stage order."""

from __future__ import annotations

import itertools

import pytest

from partitioner.core.errors import UsageError
from partitioner.core.ir import Phase, Schedule
from partitioner.simulation.schedules import (
    Step,
    order_stages,
    peak_live_microbatches,
    pipeline_schedules,
    schedule_rule,
    schedule_steps,
    stage_steps,
)

F, B = Phase.FORWARD, Phase.BACKWARD


def steps(text: str) -> tuple[Step, ...]:
    """``"F0 F1 B0"`` -> the steps."""
    return tuple(Step(F if w[0] == "F" else B, int(w[1:])) for w in text.split())


# One case per schedule: (schedule, stages, micro-batches) -> every stage's order. A new schedule
# adds its case here (CONTRIBUTING.md: a schedule is the enum member, its rule, and this case).
CASES = {
    (Schedule.NONE, 2, 3): ("F0 B0 F1 B1 F2 B2", "F0 B0 F1 B1 F2 B2"),
    (Schedule.GPIPE, 3, 3): ("F0 F1 F2 B2 B1 B0",) * 3,
    (Schedule.ONE_F_ONE_B, 3, 4): (
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ),
}


def test_every_schedule_has_a_rule_and_a_case() -> None:
    assert {schedule_rule(s).schedule for s in Schedule} == set(Schedule)
    assert {case[0] for case in CASES} == set(Schedule)


@pytest.mark.parametrize(("key", "expected"), CASES.items(), ids=lambda v: str(v))
def test_each_schedules_order(key: tuple[Schedule, int, int], expected: tuple[str, ...]) -> None:
    schedule, k, m = key
    assert schedule_steps(schedule, k, m) == tuple(steps(e) for e in expected)
    for s in range(k):
        assert stage_steps(schedule, k, s, m) == steps(expected[s])


def test_one_f_one_b_with_fewer_microbatches_than_warm_up_slots() -> None:
    assert stage_steps(Schedule.ONE_F_ONE_B, 4, 0, 2) == steps("F0 F1 B0 B1")
    assert stage_steps(Schedule.ONE_F_ONE_B, 3, 0, 1) == steps("F0 B0")


def test_steps_compare_equal_to_plain_tuples() -> None:
    assert stage_steps(Schedule.GPIPE, 2, 1, 1) == ((F, 0), (B, 0))


def live_peak(order: tuple[Step, ...]) -> int:
    """Micro-batches alive at once when the steps run one after another."""
    live = best = 0
    for step in order:
        live += 1 if step.phase is F else -1
        best = max(best, live)
    return best


@pytest.mark.parametrize("schedule", list(Schedule))
def test_every_order_runs_each_step_once_forward_first(schedule: Schedule) -> None:
    for k, m in itertools.product(range(1, 6), range(1, 7)):
        for s, order in enumerate(schedule_steps(schedule, k, m)):
            assert sorted(order, key=lambda x: (x.phase.value, x.microbatch)) == sorted(
                (Step(p, i) for p in (F, B) for i in range(m)),
                key=lambda x: (x.phase.value, x.microbatch),
            )
            assert all(order.index(Step(F, i)) < order.index(Step(B, i)) for i in range(m))
            assert live_peak(order) == peak_live_microbatches(schedule, k, s, m)


def test_the_schedules_that_pipeline() -> None:
    assert pipeline_schedules() == (Schedule.GPIPE, Schedule.ONE_F_ONE_B)


def test_a_schedule_that_is_not_a_schedule_is_refused() -> None:
    with pytest.raises(UsageError, match="schedule='zigzag' is not a Schedule"):
        stage_steps("zigzag", 2, 0, 2)  # type: ignore[arg-type]


# -- the stage order ---------------------------------------------------------------------------


def test_stage_order_is_topological_smallest_key_first() -> None:
    # 1 and 3 are ready at first: 1 has the smaller key; then 0 (ready now) before 3.
    found = order_stages([0, 1, 2, 3], [(1, 0), (3, 2)], key=lambda d: d)
    assert found.order == (1, 0, 3, 2) and found.blocked == () and found.cycle == ()
    first_seen = {"b": 0, "a": 1, "c": 2}
    found_s = order_stages(list(first_seen), [("b", "c"), ("a", "c")], key=first_seen.__getitem__)
    assert found_s.order == ("b", "a", "c")


def test_a_cycle_blocks_the_devices_on_and_after_it() -> None:
    arcs = [(0, 1), (1, 2), (2, 1), (2, 3)]
    found = order_stages([3, 2, 1, 0, 4], arcs, key=lambda d: d)
    assert found.order == ()
    assert found.blocked == (3, 2, 1)
    assert set(found.cycle) == {(1, 2), (2, 1)}
    # the cycle's arcs chain back to where they start
    assert all(a[1] == b[0] for a, b in zip(found.cycle, found.cycle[1:] + found.cycle[:1]))
