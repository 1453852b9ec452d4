"""``auto``: run every fast solver, keep the best under one score, then let the ILP improve it.

1. Run the fast solvers -- metis, even, params, time, dp, etf, round-robin, single -- each with
   this solver's seed and time limit. One that raises
   :class:`~partitioner.core.errors.InfeasibleError` is noted and skipped. Each placement has its
   colocation groups moved onto the device of their first layer (most fast solvers ignore
   ``problem.colocate``); one that then exceeds device memory is skipped, and so is one that
   leaves a device empty while there are at least as many placement units (layers, a colocation
   group counting once) as devices -- the ILP's rule too: a pipeline stage with no layer is a
   wasted device (so ``single`` competes only on one device).
2. Score every candidate with the same function,
   :func:`~partitioner.solvers.ilp.throughput_objective_s`: the largest device load, compute plus
   the transfer time (over the link of that device pair) of every cut edge the device sends or
   receives, or the load of a host-to-host channel when that is larger (the pipeline stage time
   the ILP minimises). The best candidate is the lowest score (ties: the order above).
3. With the time left of ``time_limit_s``, less an estimate of the time to build the model
   (and at most ``ilp_max_layers`` layers, since building the integer program for a huge graph
   alone can outlast the budget), run
   :class:`~partitioner.solvers.ilp.IlpSolver` (throughput objective) warm-started from the best
   candidate. Its placement replaces the best only when it scores strictly lower.

The result therefore never scores worse than any candidate. ``notes`` lists every candidate and
its score (``"metis: 1.234 ms"``, ``"even: infeasible (memory)"``), then the choice. Status:
the ILP's (OPTIMAL or FEASIBLE) when it won or proved optimality, else HEURISTIC. ``best_bound``
is the larger of the ILP's proven bound and the work / largest-layer bound of
:func:`partitioner.simulation.bounds.lower_bounds` (both valid for this score).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import ClassVar

from partitioner.core.errors import InfeasibleError, PartitionError, SolverError
from partitioner.core.ir import PartitionProblem, SolverResult, SolveStatus
from partitioner.core.units import format_seconds
from partitioner.simulation.bounds import lower_bounds
from partitioner.solvers.base import (
    Solver,
    SolverOptions,
    colocation_roots,
    device_memory_bytes,
    memory_infeasible_message,
    validate_problem_for,
)
from partitioner.solvers.baselines import (
    EvenSolver,
    ParamsSolver,
    RoundRobinSolver,
    SingleSolver,
    TimeSolver,
)
from partitioner.solvers.dp import PipeDreamSolver
from partitioner.solvers.etf import EtfSolver
from partitioner.solvers.ilp import IlpSolver, model_build_s, throughput_objective_s
from partitioner.solvers.metis import MetisSolver

__all__ = ["CANDIDATES", "AutoSolver", "auto_score_s", "colocate_groups"]

logger = logging.getLogger(__name__)

CANDIDATES: tuple[type[SolverOptions], ...] = (
    MetisSolver,
    EvenSolver,
    ParamsSolver,
    TimeSolver,
    PipeDreamSolver,
    EtfSolver,
    RoundRobinSolver,
    SingleSolver,
)
"""The fast solvers ``auto`` runs, in tie-breaking order."""

_Best = tuple[float, str, tuple[int, ...]]
"""The best placement so far: its score, the solver that made it, the assignment."""

_MIN_ILP_TIME_S = 0.05
"""Below this much search time left, the ILP is not started."""


def auto_score_s(problem: PartitionProblem, assignment: tuple[int, ...]) -> float:
    """The score ``auto`` ranks placements by: the ILP's throughput objective, in seconds."""
    return throughput_objective_s(problem, assignment)


def colocate_groups(assignment: tuple[int, ...], problem: PartitionProblem) -> tuple[int, ...]:
    """Move every colocation group (merged when they share a layer) onto its first layer's device."""
    if not problem.colocate:
        return assignment
    return tuple(assignment[root] for root in colocation_roots(problem))


def _units(problem: PartitionProblem) -> int:
    """Placement units: layers, each colocation group counted once."""
    marks = colocate_groups(tuple(range(problem.num_layers)), problem)
    return len(set(marks))


def _fits(assignment: tuple[int, ...], problem: PartitionProblem) -> bool:
    used = device_memory_bytes(assignment, problem)
    return all(u <= d.memory_bytes for u, d in zip(used, problem.topology.devices, strict=True))


@dataclass(frozen=True)
class AutoSolver(SolverOptions):
    """Best of the fast solvers under the throughput score, improved by a warm-started ILP."""

    name: ClassVar[str] = "auto"
    description: ClassVar[str] = (
        "the default: every fast solver as a candidate, the best kept, then the warm-started ILP"
    )
    uses_time_limit: ClassVar[bool] = True

    ilp: bool = True
    ilp_max_layers: int = 2000

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.ilp, bool):
            raise SolverError(f"solver 'auto' option ilp={self.ilp!r} must be true or false")
        m = self.ilp_max_layers
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise SolverError(
                f"solver 'auto' option ilp_max_layers={m!r} must be an integer >= 0 "
                "(0 never runs the ILP)"
            )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        """Steps 1-3 of the module docstring."""
        t0 = time.perf_counter()
        validate_problem_for(problem)
        notes: list[str] = []
        best = self._best_candidate(problem, notes)
        best, status, bound = self._improve_with_ilp(problem, best, notes, t0)
        if best is None:
            raise InfeasibleError(
                memory_infeasible_message(problem, "solver 'auto': no candidate placement fits")
            )
        score, chosen, assignment = best
        notes.append(f"chose {chosen}")
        logger.info("auto: chose %s (%.6g s)", chosen, score)
        return SolverResult(
            solver=self.name,
            assignment=assignment,
            status=status,
            objective=score,
            notes=tuple(notes),
            best_bound=min(bound, score) if math.isfinite(bound) else None,
        )

    def _best_candidate(self, problem: PartitionProblem, notes: list[str]) -> _Best | None:
        """Steps 1-2: run every candidate, note its score (or why it is out), keep the best."""
        best: _Best | None = None
        need_all = _units(problem) >= problem.num_devices
        for cls in CANDIDATES:
            solver: Solver = cls(seed=self.seed, time_limit_s=self.time_limit_s)  # type: ignore[assignment]
            assignment = _candidate(solver, problem, need_all, notes)
            if assignment is None:
                continue
            score = auto_score_s(problem, assignment)
            notes.append(f"{solver.name}: {format_seconds(score)}")
            if best is None or score < best[0]:
                best = (score, solver.name, assignment)
        return best

    def _improve_with_ilp(
        self, problem: PartitionProblem, best: _Best | None, notes: list[str], t0: float
    ) -> tuple[_Best | None, SolveStatus, float]:
        """Step 3: the warm-started ILP in the time left, when allowed; the best placement, its
        status and the best lower bound known."""
        status = SolveStatus.HEURISTIC
        bound = lower_bounds(problem).throughput_s
        n = problem.num_layers
        build_s = model_build_s(problem)
        remaining_s = self.time_limit_s - (time.perf_counter() - t0) - build_s
        if not self.ilp or self.ilp_max_layers == 0:
            notes.append("ilp: off")
            return best, status, bound
        if n > self.ilp_max_layers:
            notes.append(f"ilp: skipped ({n} layers > ilp_max_layers={self.ilp_max_layers})")
            return best, status, bound
        if remaining_s < _MIN_ILP_TIME_S:
            notes.append("ilp: skipped (too little of time_limit_s left)")
            return best, status, bound
        ilp = IlpSolver(
            seed=self.seed,
            time_limit_s=remaining_s,
            objective="throughput",
            warm_start=best[2] if best is not None else None,
        )
        try:
            result = ilp.solve(problem, build_in_limit=False)
        except PartitionError as exc:
            logger.info("auto: ilp gave nothing: %s", exc)
            notes.append(f"ilp: no placement ({type(exc).__name__})")
            return best, status, bound
        score = auto_score_s(problem, result.assignment)
        notes.append(f"ilp: {format_seconds(score)} ({result.status.value})")
        if result.best_bound is not None:
            bound = max(bound, result.best_bound)
        won = best is None or score < best[0]
        if won:
            best = (score, "ilp", result.assignment)
        if won or result.status is SolveStatus.OPTIMAL:
            status = result.status
        return best, status, bound


def _candidate(
    solver: Solver, problem: PartitionProblem, need_all: bool, notes: list[str]
) -> tuple[int, ...] | None:
    """A candidate's placement with its colocation groups together, or None (and a note) when it
    is infeasible, fails, overflows memory after colocation, or leaves a device empty while
    ``need_all``."""
    try:
        raw = solver.solve(problem).assignment
    except InfeasibleError as exc:
        logger.debug("auto: %s infeasible: %s", solver.name, exc)
        notes.append(f"{solver.name}: infeasible (memory)")
        return None
    except SolverError as exc:
        logger.warning("auto: %s failed: %s", solver.name, exc)
        notes.append(f"{solver.name}: failed")
        return None
    assignment = colocate_groups(raw, problem)
    if assignment != raw and not _fits(assignment, problem):
        notes.append(f"{solver.name}: infeasible (memory, after colocation)")
        return None
    if need_all and len(set(assignment)) < problem.num_devices:
        notes.append(f"{solver.name}: skipped (leaves a device empty)")
        return None
    return assignment
