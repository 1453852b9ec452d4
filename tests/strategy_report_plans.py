"""Plans that apply a training strategy (R replicas x S stages), for the report tests.

Built from :func:`report_plans.make_plan` (its layer names with markup included) as the strategy
planner's plans are: the assignment is replica 0's layer devices, the devices of the other
replicas carry the load of replica 0's device of the same stage with no layers listed, and the
timeline is replica 0's simulated step.
"""

from __future__ import annotations

from dataclasses import replace

from report_plans import COMPUTE_S, LAYERS, MIB, make_plan

from partitioner.core.ir import EventKind, Schedule, TimelineEvent
from partitioner.core.strategy import Family, Strategy
from partitioner.plan.model import DevicePrediction, PipelineInfo, Plan, PlanDevice
from partitioner.planner.explain import FamilyRow

STEP_S = 2e-3
SINGLE_STEP_S = 3.6e-3


def _loads(strategy: Strategy, num_devices: int) -> tuple[DevicePrediction, ...]:
    devices = strategy.layer_devices(0)
    out = []
    for d in range(num_devices):
        on_d = tuple(n for n, x in zip(LAYERS, devices) if x == d)
        out.append(
            DevicePrediction(
                device=d,
                layers=on_d,
                compute_s=sum(c for c, x in zip(COMPUTE_S, devices) if x == d),
                memory_bytes=10 * MIB if on_d else 0,
                memory_limit_bytes=64 * MIB,
                bytes_sent=0,
                bytes_received=0,
            )
        )
    first = strategy.device_groups[0]
    for group in strategy.device_groups[1:]:
        for stage, d in enumerate(group):
            out[d] = replace(out[first[stage]], device=d, layers=())
    return tuple(out)


def _timeline(strategy: Strategy) -> tuple[TimelineEvent, ...]:
    """Replica 0's step: each layer forward on its device, then backward, then the update."""
    devices, events, t = strategy.layer_devices(0), [], 0.0
    for name, d, c in zip(LAYERS, devices, COMPUTE_S):
        events.append(TimelineEvent(f"device {d}", EventKind.FORWARD, name, t, t + c / 3))
        t += c / 3
    for name, d, c in reversed(list(zip(LAYERS, devices, COMPUTE_S))):
        events.append(TimelineEvent(f"device {d}", EventKind.BACKWARD, name, t, t + 2 * c / 3))
        t += 2 * c / 3
    events += [
        TimelineEvent(f"device {d}", EventKind.UPDATE, "sgd", t, t + 1e-5)
        for d in strategy.device_groups[0]
    ]
    return tuple(events)


def _rows(strategy: Strategy) -> tuple[FamilyRow, ...]:
    chosen = FamilyRow(
        strategy.family, strategy.describe(), STEP_S, SINGLE_STEP_S / STEP_S,
        10 * MIB, 64 * MIB, True, True, "",
    )  # fmt: skip
    single = FamilyRow(
        Family.SINGLE, "one device", SINGLE_STEP_S, 1.0, 20 * MIB, 64 * MIB, True, False,
        "1.80x slower",
    )  # fmt: skip
    return (chosen, single)


def strategy_plan(
    device_groups: tuple[tuple[int, ...], ...],
    stage_of_layer: tuple[int, ...] = (0,) * len(LAYERS),
    *,
    num_microbatches: int = 1,
    with_timeline: bool = True,
) -> Plan:
    """The plan of ``make_plan``'s model under the strategy ``device_groups`` x ``stage_of_layer``."""
    schedule = Schedule.ONE_F_ONE_B if num_microbatches > 1 else Schedule.NONE
    strategy = Strategy(device_groups, stage_of_layer, num_microbatches, schedule)
    n = max(strategy.devices) + 1
    base = make_plan(pipelined=False, with_timeline=False)
    pipeline = None
    if num_microbatches > 1:
        pipeline = PipelineInfo(schedule, num_microbatches, device_groups[0])
    return replace(
        base,
        devices=tuple(PlanDevice(d, "h100", 64 * MIB) for d in range(n)),
        device_of_layer=strategy.layer_devices(0),
        step_time_s=STEP_S,
        lower_bound_s=STEP_S / 2,
        per_device=_loads(strategy, n),
        timeline=_timeline(strategy) if with_timeline else (),
        layer_edges=(),
        pipeline=pipeline,
        strategies=_rows(strategy),
        strategy=strategy,
    )
