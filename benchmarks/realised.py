"""The zoo on the realised objective: the strategy ``auto`` chooses against the other families.

Issue 16, item 6. For one (model, devices, topology) group, :func:`realised_group` runs the
strategy planner as the product does (:func:`partitioner.planner.search.search_strategies`, every
family, stages placed by :data:`partitioner.api.STRATEGY_SOLVERS`, the search limited to
:data:`partitioner.api.STRATEGY_SEARCH_LIMIT_S`) and reports the predicted step
(:func:`partitioner.simulation.strategy.simulate_strategy`: the step the rewrite would run, each
replica costed at its own batch) of:

* ``auto``: the planner's choice, in words (:meth:`Strategy.describe`);
* the best candidate of each family the planner scored (``single``, ``data_parallel``,
  ``pipeline``, ``placed``, ``hybrid``);
* the **even-split pipeline**: one replica of ``N`` stages placed by the ``even`` solver (made
  acyclic, as the planner makes every pipeline's stages), under the default schedule (1F1B) with
  the best of the micro-batch counts the planner tries
  (:func:`partitioner.planner.search.microbatch_choices`).

Gains are ``1 - auto / other`` and only against strategies that fit in memory. Pure Python over
the costed graphs; the caller traces the model at every per-replica batch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from partitioner.api import STRATEGY_SEARCH_LIMIT_S, STRATEGY_SOLVERS
from partitioner.core.errors import PartitionError
from partitioner.core.ir import CostedGraph
from partitioner.core.options import DEFAULT_SCHEDULE
from partitioner.core.strategy import Family, Strategy
from partitioner.planner.search import (
    StrategyOptions,
    device_layouts,
    microbatch_choices,
    search_strategies,
    sub_problem,
)
from partitioner.simulation.strategy import (
    StrategySimulation,
    microbatch_costed,
    simulate_strategy,
)
from partitioner.solvers import get_solver
from partitioner.solvers.stages import make_acyclic

__all__ = [
    "EVEN_PIPELINE",
    "FamilyResult",
    "GroupResult",
    "RealisedSummary",
    "even_pipeline",
    "realised_group",
    "summarize_realised",
]

EVEN_PIPELINE = "even_pipeline"
"""The name of the even-split pipeline's entry among a group's results."""
TOLERANCE = 1e-9


@dataclass(frozen=True)
class FamilyResult:
    """The best strategy of one family (or the even-split pipeline) in a group."""

    name: str
    """A :class:`Family` value, or :data:`EVEN_PIPELINE`."""
    description: str
    step_time_s: float
    fits: bool
    placement: str
    """The solver that placed its stages (``"-"`` for one stage)."""
    num_microbatches: int = 1


@dataclass(frozen=True)
class GroupResult:
    """One (model, devices, topology): ``auto``'s strategy and the others, on the simulated step."""

    model: str
    devices: int
    topology: str
    device_type: str
    link: str
    batch_size: int
    chosen_family: str
    chosen_description: str
    chosen_placement: str
    chosen_step_s: float
    chosen_fits: bool
    results: tuple[FamilyResult, ...]
    """Best per family (in :class:`Family` order), then the even-split pipeline when it exists."""
    search_time_s: float
    notes: tuple[str, ...] = ()

    def result(self, name: str) -> FamilyResult | None:
        return next((r for r in self.results if r.name == name), None)

    def step_s(self, name: str) -> float | None:
        """The step of ``name``'s entry when it fits, else ``None``."""
        r = self.result(name)
        return r.step_time_s if r is not None and r.fits else None

    @property
    def best_replicated_s(self) -> float | None:
        """The faster of one device and data parallelism (what runs without model parallelism)."""
        steps = [s for s in (self.step_s("single"), self.step_s("data_parallel")) if s is not None]
        return min(steps, default=None)

    def gain_over(self, other_s: float | None) -> float | None:
        if other_s is None or other_s <= 0 or not self.chosen_fits:
            return None
        return 1.0 - self.chosen_step_s / other_s

    @property
    def ok(self) -> bool:
        """``auto`` is no slower than any strategy reported beside it that fits."""
        others = [r.step_time_s for r in self.results if r.fits]
        if not others:
            return True
        return self.chosen_fits and self.chosen_step_s <= min(others) * (1 + TOLERANCE)

    def to_json(self) -> dict[str, Any]:
        """The record: every field, and ``step_s``: the predicted step of each entry by name."""
        out = asdict(self)
        out["step_s"] = {r.name: r.step_time_s for r in self.results}
        out["fits"] = {r.name: r.fits for r in self.results}
        return out


def _candidate_result(name: str, sim: StrategySimulation, placement: str) -> FamilyResult:
    return FamilyResult(
        name=name,
        description=sim.strategy.describe(),
        step_time_s=sim.step_time_s,
        fits=sim.fits,
        placement=placement,
        num_microbatches=sim.strategy.num_microbatches,
    )


def even_pipeline(costed_at: Callable[[int], CostedGraph], batch_size: int) -> FamilyResult | None:
    """One replica over every device, layers placed by ``even`` (made acyclic), the default
    schedule at the best of the planner's micro-batch counts, each priced at its micro-batch as
    the planner prices it (:func:`~partitioner.simulation.strategy.microbatch_costed`); ``None``
    when it cannot run."""
    costed = costed_at(batch_size)
    n = costed.topology.num_devices
    if n < 2:
        return None
    layout = device_layouts(costed.topology, 1, n)[0]
    problem = sub_problem(costed.problem(), layout[0])
    try:
        stages = make_acyclic(get_solver("even", seed=0).solve(problem).assignment, problem)
    except PartitionError:
        return None
    best: StrategySimulation | None = None
    for m in microbatch_choices(
        costed.graph.batch_size, n, StrategyOptions().max_microbatches_per_stage
    ):
        if m == 1:
            continue
        try:
            priced = microbatch_costed(costed, costed_at(batch_size // m), m)
            sim = simulate_strategy(priced, Strategy(layout, stages, m, DEFAULT_SCHEDULE))
        except PartitionError:
            continue
        if best is None or (not sim.fits, sim.step_time_s) < (not best.fits, best.step_time_s):
            best = sim
    return None if best is None else _candidate_result(EVEN_PIPELINE, best, "even")


def realised_group(
    model: str,
    topology: str,
    costed_at: Callable[[int], CostedGraph],
    batch_size: int,
    *,
    time_limit_s: float = STRATEGY_SEARCH_LIMIT_S,
) -> GroupResult:
    """Search every strategy for one group (see the module docstring); ``costed_at(b)`` is the
    model traced at batch ``b`` and costed on the group's topology."""
    options = StrategyOptions(placement_solvers=STRATEGY_SOLVERS, time_limit_s=time_limit_s)
    t0 = time.perf_counter()
    search = search_strategies(costed_at, batch_size, options)
    elapsed = time.perf_counter() - t0
    per_family = search.best_per_family()
    results = [
        _candidate_result(f.value, per_family[f].simulation, per_family[f].placement)
        for f in Family
        if f in per_family
    ]
    costed = costed_at(batch_size)
    even = even_pipeline(costed_at, batch_size)
    if even is not None:
        results.append(even)
    best = search.best
    return GroupResult(
        model=model,
        devices=costed.topology.num_devices,
        topology=topology,
        device_type=costed.topology.devices[0].device_type,
        link=costed.topology.link.kind,
        batch_size=batch_size,
        chosen_family=best.strategy.family.value,
        chosen_description=best.strategy.describe(),
        chosen_placement=best.placement,
        chosen_step_s=best.step_time_s,
        chosen_fits=best.simulation.fits,
        results=tuple(results),
        search_time_s=elapsed,
        notes=search.notes,
    )


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RealisedSummary:
    """``auto``'s gains on the simulated step, over the groups where both sides fit."""

    groups: tuple[GroupResult, ...]

    def gains(self, name: str, *, min_devices: int = 1) -> list[float]:
        """``auto``'s gain over ``name`` (a family value, :data:`EVEN_PIPELINE`, or
        ``"replicated"``: the best of single and data parallel) in every group where it fits."""
        out = []
        for g in self.groups:
            if g.devices < min_devices:
                continue
            other = g.best_replicated_s if name == "replicated" else g.step_s(name)
            gain = g.gain_over(other)
            if gain is not None:
                out.append(gain)
        return out

    @property
    def losses(self) -> tuple[GroupResult, ...]:
        return tuple(g for g in self.groups if not g.ok)

    def chosen_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for g in self.groups:
            counts[g.chosen_family] = counts.get(g.chosen_family, 0) + 1
        return {f.value: counts[f.value] for f in Family if f.value in counts}

    def needs_split(self) -> list[GroupResult]:
        """Groups where neither one device nor a data-parallel replica fits the model."""
        return [g for g in self.groups if g.best_replicated_s is None]

    def unpipelinable(self) -> list[GroupResult]:
        """Groups where the even split has no pipeline that runs (or fits)."""
        return [g for g in self.groups if g.devices > 1 and g.step_s(EVEN_PIPELINE) is None]


def summarize_realised(groups: Sequence[GroupResult]) -> RealisedSummary:
    return RealisedSummary(tuple(groups))


def ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.3f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def avg(xs: Sequence[float]) -> str:
    """``mean% over n groups (min a%, max b%)``."""
    if not xs:
        return "- (no group)"
    return (
        f"{sum(xs) / len(xs) * 100:.1f}% over {len(xs)} groups "
        f"(min {min(xs) * 100:.1f}%, max {max(xs) * 100:.1f}%)"
    )


def entry_cell(g: GroupResult, name: str) -> str:
    """``step ms`` of an entry (``(M n)`` when pipelined), ``does not fit`` or ``-``."""
    r = g.result(name)
    if r is None:
        return "-"
    if not r.fits:
        return "does not fit"
    return ms(r.step_time_s) + (f" (M {r.num_microbatches})" if r.num_microbatches > 1 else "")


def summary_lines(summary: RealisedSummary) -> list[str]:
    """The headline lines (plain text; the README adds Markdown)."""
    n = len(summary.groups)
    losses = summary.losses
    counts = ", ".join(f"{k} {v}" for k, v in summary.chosen_counts().items())
    multi = [g for g in summary.groups if g.devices > 1]
    split = summary.needs_split()
    return [
        f"auto's strategy no slower than every family's best and the even-split pipeline: "
        f"{'yes' if not losses else 'NO'} ({n - len(losses)} of {n} groups)"
        + "".join(f"; loses {g.model} x{g.devices} {g.topology}" for g in losses),
        f"auto chose: {counts or '-'}",
        "auto's predicted step vs the best of single device and data parallel: "
        + avg(summary.gains("replicated")),
        "auto's predicted step vs one device: " + avg(summary.gains("single")),
        "auto's predicted step vs the best data parallel: " + avg(summary.gains("data_parallel")),
        "auto's predicted step vs the even-split pipeline (1F1B, best M): "
        + avg(summary.gains(EVEN_PIPELINE))
        + f"; {len(summary.unpipelinable())} of {len(multi)} groups have no even-split "
        "pipeline that runs and fits",
        "auto's predicted step vs the best pure pipeline: " + avg(summary.gains("pipeline")),
        f"groups where neither one device nor a data-parallel replica fits: "
        f"{len(split)} of {n}"
        + (
            " (auto: "
            + "; ".join(
                f"{g.model} x{g.devices} {g.topology} {g.chosen_description}"
                + ("" if g.chosen_fits else ", does not fit either")
                for g in split
            )
            + ")"
            if split
            else ""
        ),
    ]
