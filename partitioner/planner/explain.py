"""Why a strategy won and the others lost, in numbers: the rows of the families table.

For the best candidate of each family the planner scored, :func:`family_rows` gives its predicted
step, its speed-up over one device, its fullest device against its limit, and, for every family
but the winner, the reason it lost, taken from its own simulation:

* it does not fit (the device, the bytes it needs, the limit);
* its all-reduce (gradient bytes, seconds, share of its step) when that is what it adds over the
  winner;
* its pipeline bubble (idle share of the busiest stage) or its transfers;
* its replicas on different device types, the slowest pacing the step (equal shares of the
  batch);
* otherwise plainly: slower by a factor.

:func:`advice` turns the table into the plan's advice, so the advice follows the numbers rather
than a fixed sentence. :func:`idle_advice` says which devices the chosen strategy leaves idle and
what the fastest strategy that uses them all costs (fewer devices win when an all-reduce over
more replicas, or more transfers, cost more than they save). Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.core.strategy import Family
from partitioner.core.units import format_bytes, format_seconds
from partitioner.planner.search import (
    StrategyCandidate,
    StrategySearch,
    uneven_share_reason,
    uses_every_device,
)
from partitioner.simulation.strategy import StrategySimulation

__all__ = ["FamilyRow", "advice", "devices_text", "family_rows", "idle_advice"]


@dataclass(frozen=True)
class FamilyRow:
    """One row of the families table."""

    family: Family
    description: str
    step_time_s: float
    speedup_over_single: float | None
    """Single device step / this step; ``None`` when one device was not scored or does not fit."""
    peak_memory_bytes: int
    memory_limit_bytes: int
    fits: bool
    chosen: bool
    why_not: str
    """Empty on the chosen row."""


def _fullest(candidate: StrategyCandidate) -> tuple[int, int]:
    sim = candidate.simulation
    d = max(
        candidate.strategy.devices,
        key=lambda x: sim.peak_memory_bytes[x] / max(sim.memory_limit_bytes[x], 1),
    )
    return sim.peak_memory_bytes[d], sim.memory_limit_bytes[d]


def _why_not(candidate: StrategyCandidate, best: StrategyCandidate, single_s: float | None) -> str:
    sim = candidate.simulation
    if not sim.fits:
        device, need, limit = max(sim.over_memory, key=lambda o: o[1] - o[2])
        return (
            f"does not fit: device {device} needs {format_bytes(need)} of "
            f"{format_bytes(limit)}"
        )
    ratio = candidate.step_time_s / best.step_time_s if best.step_time_s > 0 else 1.0
    reasons = [
        r
        for r in (
            _all_reduce_reason(sim),
            _replica_reason(sim, single_s),
            uneven_share_reason(candidate),
        )
        if r
    ]
    bubble = _bubble(sim)
    if bubble >= 0.2:
        reasons.append(f"its stages idle up to {bubble:.0%} of the step (pipeline bubble)")
    if candidate.strategy.family is Family.SINGLE:
        reasons.append("one device does all the work")
    return "; ".join([f"{ratio:.2f}x slower", *reasons])


def _bubble(sim: StrategySimulation) -> float:
    """The largest idle share of replica 0's stage devices in its pipelined step (0 unpipelined);
    the devices of the other replicas are not in replica 0's simulation."""
    pipeline = sim.replica.pipeline
    if pipeline is None:
        return 0.0
    return max(pipeline.bubble_fraction[d] for d in sim.strategy.device_groups[0])


def _all_reduce_reason(sim: StrategySimulation) -> str:
    """The all-reduce, when it is a tenth of the step or more."""
    if sim.all_reduce_s <= 0 or sim.all_reduce_s < 0.1 * sim.step_time_s:
        return ""
    share = sim.all_reduce_s / sim.step_time_s
    return (
        f"its all-reduce of {format_bytes(sum(sim.gradient_bytes))} of gradients takes "
        f"{format_seconds(sim.all_reduce_s)} ({share:.0%} of its step)"
    )


def _replica_reason(sim: StrategySimulation, single_s: float | None) -> str:
    """Replicas whose share of the batch runs far slower than their share of one device's step
    (per-op costs that do not shrink with the batch)."""
    replicas = sim.strategy.replicas
    if replicas == 1 or single_s is None or sim.strategy.stages > 1:
        return ""
    replica_s = max(sim.replica_step_s)
    if replica_s < 0.75 * single_s:
        return ""
    return (
        f"a replica takes {format_seconds(replica_s)} on 1/{replicas} of the batch, "
        f"{replica_s / single_s:.0%} of one device's whole-batch step (a small batch does not "
        "fill a device)"
    )


def family_rows(search: StrategySearch) -> tuple[FamilyRow, ...]:
    """The best candidate of each family, fastest first, with why each lost."""
    per_family = search.best_per_family()
    single = per_family.get(Family.SINGLE)
    single_s = single.step_time_s if single is not None and single.simulation.fits else None
    rows = []
    for family, candidate in sorted(per_family.items(), key=lambda kv: kv[1].rank()):
        peak, limit = _fullest(candidate)
        chosen = candidate.strategy == search.best.strategy
        rows.append(
            FamilyRow(
                family=family,
                description=candidate.strategy.describe(),
                step_time_s=candidate.step_time_s,
                speedup_over_single=(
                    single_s / candidate.step_time_s
                    if single_s is not None and candidate.step_time_s > 0
                    else None
                ),
                peak_memory_bytes=peak,
                memory_limit_bytes=limit,
                fits=candidate.simulation.fits,
                chosen=chosen,
                why_not="" if chosen else _why_not(candidate, search.best, single_s),
            )
        )
    return tuple(rows)


def advice(
    rows: tuple[FamilyRow, ...], applied: Family | None = None, *, asked: bool = False
) -> str:
    """One paragraph from the table: which strategy is fastest and why the others lose, with the
    numbers; ``applied`` (the family the plan itself applies) adds what to run when it differs.
    ``asked``: the user named the families scored, so the best of them is the strategy asked
    for, not the fastest there is (one device may beat it: campaign 34u)."""
    chosen = next((r for r in rows if r.chosen), None)
    if chosen is None:
        return "No strategy was scored."
    if not chosen.fits:
        return (
            f"No strategy fits: the closest, {chosen.description}, needs "
            f"{format_bytes(chosen.peak_memory_bytes)} on a device of "
            f"{format_bytes(chosen.memory_limit_bytes)}; use more or larger devices."
        )
    what = "Strategy asked for" if asked else "Fastest predicted strategy"
    head = f"{what}: {chosen.description} ({format_seconds(chosen.step_time_s)}"
    if chosen.speedup_over_single is not None and chosen.family is not Family.SINGLE:
        head += f" per step, {chosen.speedup_over_single:.2f}x one device)."
    else:
        head += " per step)."
    others = [f"{r.family.label} ({r.description}): {r.why_not}." for r in rows if not r.chosen]
    tail = []
    if applied is not None and applied is not chosen.family:
        tail.append(_how_to_run(chosen.family, applied))
    return " ".join([head, *others, *tail])


def _how_to_run(chosen: Family, applied: Family) -> str:
    """What to run when the fastest family is not the one the plan applies, in the library's
    arguments (the command line spells them as its flags)."""
    if chosen is Family.SINGLE:
        return "Splitting does not pay here: train on one device."
    without = " (without pipeline=True)" if applied is Family.PIPELINE else ""
    return (
        f"This plan applies a {applied.label}, as asked; strategy={chosen.value!r}{without} "
        f"plans the {chosen.label} strategy."
    )


# -- devices left idle ---------------------------------------------------------------------------


def devices_text(devices: tuple[int, ...] | list[int]) -> str:
    """``device 3``, ``devices 2-7``, ``devices 1, 3 and 5-7``: indices, runs joined."""
    runs: list[list[int]] = []
    for d in sorted(set(devices)):
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    parts = [str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs]
    if len(parts) == 1 and len(runs[0]) == 1:
        return f"device {parts[0]}"
    head = ", ".join(parts[:-1])
    return f"devices {head} and {parts[-1]}" if head else f"devices {parts[-1]}"


def idle_advice(search: StrategySearch) -> str:
    """Which devices the chosen strategy leaves idle, and what the fastest strategy scored that
    uses every device costs (or why none does); ``""`` when the choice uses them all."""
    best = search.best
    n = len(best.simulation.memory_limit_bytes)
    used = set(best.strategy.devices)
    idle = [d for d in range(n) if d not in used]
    if not idle:
        return ""
    head = (
        f"The chosen strategy ({best.strategy.describe()}) uses {len(used)} of the {n} devices, "
        f"{devices_text(idle)} idle"
    )
    every = uses_every_device(search.candidates)
    if every is None:
        return f"{head}: none of the strategies scored uses all {n} (see the notes)."
    what = f"the fastest strategy on all {n}, {every.strategy.describe()},"
    if not every.simulation.fits:
        device, need, limit = max(every.simulation.over_memory, key=lambda o: o[1] - o[2])
        return (
            f"{head}: {what} does not fit (device {device} needs {format_bytes(need)} of "
            f"{format_bytes(limit)})."
        )
    ratio = every.step_time_s / best.step_time_s if best.step_time_s > 0 else 1.0
    if ratio <= 1.0 + 1e-9:
        return f"{head}: {what} is predicted no faster ({format_seconds(every.step_time_s)})."
    reasons = [_all_reduce_reason(every.simulation)]
    bubble = _bubble(every.simulation)
    if bubble >= 0.2:
        reasons.append(f"its stages idle up to {bubble:.0%} of the step (pipeline bubble)")
    return "; ".join(
        [
            f"{head}: {what} is predicted at {format_seconds(every.step_time_s)} per step, "
            f"{ratio:.2f}x slower",
            *filter(None, reasons),
        ]
    ) + "."
