"""Plans built directly from the dataclasses, for the report tests (no TensorFlow, no solver).

The layer names include markup that must stay text in every report: an HTML tag with an
``onerror`` handler, a script-closing sequence, and ``rich`` markup.
"""

from __future__ import annotations

from partitioner.core.ir import EventKind, Schedule, TimelineEvent
from partitioner.plan.model import (
    BaselineResult,
    DevicePrediction,
    PipelineInfo,
    Plan,
    PlanDevice,
    SolverInfo,
)

XSS_IMG = "<img src=x onerror=alert(1)>"
XSS_SCRIPT = "</script><script>alert(1)</script>"
RICH_MARKUP = "[bold red]not markup[/bold red]"

LAYERS = ("input_1", "conv1", XSS_IMG, "dense_1", XSS_SCRIPT, RICH_MARKUP, "head")
DEVICE_OF_LAYER = (0, 0, 0, 1, 1, 2, 2)
EDGES = (
    (0, 1, 4096),
    (1, 2, 4096),
    (2, 3, 8192),
    (3, 4, 2048),
    (2, 4, 1024),
    (4, 5, 512),
    (5, 6, 256),
)
COMPUTE_S = (0.0, 2e-4, 3e-4, 4e-4, 1e-4, 2e-4, 1e-4)
MIB = 2**20


def _loads(memory: tuple[int, int, int], limit: int) -> tuple[DevicePrediction, ...]:
    out = []
    for d in range(3):
        on_d = tuple(n for n, x in zip(LAYERS, DEVICE_OF_LAYER) if x == d)
        out.append(
            DevicePrediction(
                device=d,
                layers=on_d,
                compute_s=sum(c for c, x in zip(COMPUTE_S, DEVICE_OF_LAYER) if x == d),
                memory_bytes=memory[d],
                memory_limit_bytes=limit,
                bytes_sent=(8192 + 1024, 512, 0)[d],
                bytes_received=(0, 8192 + 1024, 512)[d],
            )
        )
    return tuple(out)


def _timeline(num_microbatches: int) -> tuple[TimelineEvent, ...]:
    """A plausible pipelined step: each micro-batch forward through the devices, then back."""
    events = []
    fwd_s, bwd_s, xfer_s = 1e-4, 2e-4, 3e-5
    for m in range(num_microbatches):
        t = m * fwd_s
        for d, label in enumerate(
            ("stage 0: input_1 … " + XSS_IMG, "dense_1 … " + XSS_SCRIPT, RICH_MARKUP)
        ):
            events.append(TimelineEvent(f"device {d}", EventKind.FORWARD, label, t, t + fwd_s, m))
            t += fwd_s
            if d < 2:
                events.append(
                    TimelineEvent(
                        f"link {d}->{d + 1}",
                        EventKind.TRANSFER,
                        f"{LAYERS[2 + 2 * d]} out",
                        t,
                        t + xfer_s,
                        m,
                    )
                )
                t += xfer_s
    start = max(e.end_s for e in events)
    for m in range(num_microbatches):
        t = start + m * bwd_s
        for d in (2, 1, 0):
            events.append(
                TimelineEvent(
                    f"device {d}", EventKind.BACKWARD, f"grad {LAYERS[2 * d]}", t, t + bwd_s, m
                )
            )
            t += bwd_s
    end = max(e.end_s for e in events)
    events += [
        TimelineEvent(f"device {d}", EventKind.UPDATE, "adam", end, end + 2e-5, 0) for d in range(3)
    ]
    return tuple(events)


def make_plan(
    *, pipelined: bool = True, with_timeline: bool = True, over_memory: bool = False
) -> Plan:
    """A three-device plan with every optional field filled (unless switched off)."""
    limit = 64 * MIB
    memory = (10 * MIB, 70 * MIB if over_memory else 20 * MIB, 5 * MIB)
    timeline = _timeline(4 if pipelined else 1) if with_timeline else ()
    step = max((e.end_s for e in timeline), default=1.2e-3)
    return Plan(
        model_name=f"model {XSS_IMG}",
        devices=tuple(
            PlanDevice(
                index=d,
                device_type="h100",
                memory_bytes=limit,
                host=d // 2,
                name=f"/job:worker/task:{d // 2}/device:GPU:{d % 2}",
            )
            for d in range(3)
        ),
        layer_order=LAYERS,
        device_of_layer=DEVICE_OF_LAYER,
        step_time_s=step,
        lower_bound_s=step / 1.7,
        per_device=_loads(memory, limit),
        solver=SolverInfo(
            name="auto",
            status="feasible",
            objective=step,
            solve_time_s=0.25,
            notes=(f"metis: 1.2 ms {XSS_IMG}", "dp: 1.1 ms"),
        ),
        link="pcie",
        batch_size=32,
        input_shape=(16,),
        baselines=(
            BaselineResult(solver="single", step_time_s=step * 1.9),
            BaselineResult(solver="even", step_time_s=step * 0.9, note="faster here"),
            BaselineResult(solver="metis", step_time_s=None, note=f"does not fit: {XSS_SCRIPT}"),
        ),
        advice=(f"Advice about {XSS_IMG}",),
        phase_times_s=(("trace", 0.5), ("solve", 0.25)),
        pipeline=PipelineInfo(
            schedule=Schedule.ONE_F_ONE_B,
            num_microbatches=4,
            stage_devices=(0, 1, 2),
            bubble_fraction=(0.3, 0.25, 0.2),
        )
        if pipelined
        else None,
        warnings=(f"BatchNorm layer {XSS_IMG} sees micro-batches of 8, not the batch of 32",),
        layer_edges=EDGES,
        layer_compute_s=COMPUTE_S,
        timeline=timeline,
    )
