"""Why a strategy won and the others lost, in numbers: the rows of the families table.

For the best candidate of each family the planner scored, :func:`family_rows` gives its predicted
step, its speed-up over one device, its fullest device against its limit, and, for every family
but the winner, the reason it lost, taken from its own simulation:

* it does not fit (the device, the bytes it needs, the limit);
* its all-reduce (gradient bytes, seconds, share of its step) when that is what it adds over the
  winner;
* its pipeline bubble (idle share of the busiest stage) or its transfers;
* otherwise plainly: slower by a factor.

:func:`advice` turns the table into the plan's advice, so the advice follows the numbers rather
than a fixed sentence. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass

from partitioner.core.strategy import Family
from partitioner.core.units import format_bytes, format_seconds
from partitioner.planner.search import StrategyCandidate, StrategySearch

__all__ = ["FamilyRow", "advice", "family_rows"]


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


def _why_not(candidate: StrategyCandidate, best: StrategyCandidate) -> str:
    sim = candidate.simulation
    if not sim.fits:
        device, need, limit = max(sim.over_memory, key=lambda o: o[1] - o[2])
        return (
            f"does not fit: device {device} needs {format_bytes(need)} of "
            f"{format_bytes(limit)}"
        )
    ratio = candidate.step_time_s / best.step_time_s if best.step_time_s > 0 else 1.0
    slower = f"{ratio:.2f}x slower"
    if sim.all_reduce_s > 0 and sim.all_reduce_s >= 0.2 * candidate.step_time_s:
        share = sim.all_reduce_s / candidate.step_time_s
        return (
            f"{slower}: its all-reduce of {format_bytes(sum(sim.gradient_bytes))} of gradients "
            f"takes {format_seconds(sim.all_reduce_s)} ({share:.0%} of its step)"
        )
    pipeline = sim.replica.pipeline
    if pipeline is not None and pipeline.bubble_fraction:
        bubble = max(pipeline.bubble_fraction)
        if bubble >= 0.2:
            return f"{slower}: its stages idle up to {bubble:.0%} of the step (pipeline bubble)"
    if candidate.strategy.family is Family.SINGLE:
        return f"{slower}: one device does all the work"
    return slower


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
                why_not="" if chosen else _why_not(candidate, search.best),
            )
        )
    return tuple(rows)


def advice(rows: tuple[FamilyRow, ...]) -> str:
    """One paragraph from the table: what to run and why, with the numbers."""
    chosen = next((r for r in rows if r.chosen), None)
    if chosen is None:
        return "No strategy was scored."
    if not chosen.fits:
        return (
            f"No strategy fits: the closest, {chosen.description}, needs "
            f"{format_bytes(chosen.peak_memory_bytes)} on a device of "
            f"{format_bytes(chosen.memory_limit_bytes)}; use more or larger devices."
        )
    head = f"Run {chosen.description} ({format_seconds(chosen.step_time_s)} per step"
    if chosen.speedup_over_single is not None and chosen.family is not Family.SINGLE:
        head += f", {chosen.speedup_over_single:.2f}x one device"
    head += ")."
    others = [
        f"{r.family.label} ({r.description}): {r.why_not}" for r in rows if not r.chosen
    ]
    return " ".join([head, *(f"{o}." for o in others)])
