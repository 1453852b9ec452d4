"""The order the pipeline simulator runs is the order the pipeline rewrite builds.

For GPipe and 1F1B and several stage and micro-batch counts, the rewrite's task order
(``passes.rewrite.pipeline.pipeline_order``, the order it chains each stage's tasks in; no
TensorFlow graph is built) equals, stage by stage, the order in which the simulator
(``partitioner.simulation.pipeline.simulate_stages``) ran each device's compute tasks, with
uneven stage times and real transfers so that the simulation's timing could reorder nothing
but the schedule's choice.
"""

from __future__ import annotations

import itertools

import pytest

from partitioner.core.ir import Device, EventKind, Link, Phase, Schedule, Topology
from partitioner.simulation.pipeline import Stage, StageTransfer, simulate_stages
from partitioner.simulation.schedules import pipeline_schedules, schedule_steps
from passes.rewrite.pipeline import pipeline_order

F, B = Phase.FORWARD, Phase.BACKWARD
LINK = Link("test", latency_s=0.25, bandwidth_bytes_per_s=100.0)


def chain_stages(k: int) -> tuple[Stage, ...]:
    """``k`` stages on devices ``0..k-1``, stage ``s`` sending activations to ``s + 1`` and
    gradients back; the stages' times differ so that no two tasks end at the same instant."""
    stages = []
    for s in range(k):
        sends = []
        if s + 1 < k:
            sends.append(StageTransfer(s, s + 1, F, 40 * (s + 1), (F,)))
        if s > 0:
            sends.append(StageTransfer(s, s - 1, B, 30 * s, (B,)))
        stages.append(
            Stage(
                index=s,
                device=s,
                layers=(f"L{s}",),
                forward_time_s=1.0 + 0.37 * s,
                backward_time_s=2.0 + 0.53 * ((s * 7) % 5),
                static_memory_bytes=0,
                activation_bytes=0,
                sends=tuple(sends),
            )
        )
    return tuple(stages)


def simulated_order(schedule: Schedule, k: int, m: int) -> list[list[tuple[EventKind, int]]]:
    """Per stage: its compute tasks (kind, micro-batch) in the order the simulation ran them."""
    topology = Topology(tuple(Device(d, "gpu", 1 << 30) for d in range(k)), LINK)
    sim = simulate_stages(chain_stages(k), topology, schedule=schedule, num_microbatches=m)
    per_stage: list[list[tuple[EventKind, int]]] = [[] for _ in range(k)]
    for ev in sorted(sim.timeline, key=lambda ev: ev.start_s):
        if ev.kind is not EventKind.TRANSFER:
            per_stage[int(ev.resource.split()[-1])].append((ev.kind, ev.microbatch))
    return per_stage


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_the_rewrite_builds_the_order_the_simulator_runs(schedule: Schedule) -> None:
    for k, m in itertools.product((1, 2, 3, 4, 6), (1, 2, 3, 4, 5, 8)):
        built = pipeline_order(schedule, k, m)
        simulated = simulated_order(schedule, k, m)
        assert len(built) == k
        for s in range(k):
            assert all(task.stage == s for task in built[s])
            assert [(t.kind, t.microbatch) for t in built[s]] == simulated[s], (schedule, k, m, s)


def test_every_pipelining_schedule_is_checked_here() -> None:
    assert set(pipeline_schedules()) == {Schedule.GPIPE, Schedule.ONE_F_ONE_B}


@pytest.mark.parametrize("schedule", pipeline_schedules())
def test_the_rewrite_order_is_the_schedules_module_order(schedule: Schedule) -> None:
    kind = {F: EventKind.FORWARD, B: EventKind.BACKWARD}
    for k, m in itertools.product(range(1, 6), range(1, 7)):
        built = pipeline_order(schedule, k, m)
        for s, order in enumerate(schedule_steps(schedule, k, m)):
            assert [(t.kind, t.microbatch) for t in built[s]] == [
                (kind[x.phase], x.microbatch) for x in order
            ]
