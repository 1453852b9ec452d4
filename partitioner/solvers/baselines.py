"""Baseline placements, the yardsticks a real solver must beat.

* ``single``: every layer on device 0 (no model parallelism); raises
  :class:`~partitioner.errors.InfeasibleError` when the model does not fit, which is the point.
* ``even``: contiguous layers in problem order, split evenly by count -- layer ``k`` of ``L`` goes
  to device ``k * D // L``; what an expert writes by hand.
* ``round-robin``: layer ``k`` to device ``k % D``.

Baselines neither balance nor repair memory: a placement that does not fit raises
InfeasibleError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partitioner.ir import PartitionProblem, SolverResult, SolveStatus
from partitioner.solvers.base import (
    SolverOptions,
    check_memory,
    max_load_s,
    validate_problem_for,
)

__all__ = ["EvenSolver", "RoundRobinSolver", "SingleSolver"]


def _result(name: str, assignment: tuple[int, ...], problem: PartitionProblem) -> SolverResult:
    check_memory(assignment, problem, name)
    return SolverResult(
        solver=name,
        assignment=assignment,
        status=SolveStatus.HEURISTIC,
        objective=max_load_s(assignment, problem),
    )


@dataclass(frozen=True)
class SingleSolver(SolverOptions):
    """Every layer on device 0."""

    name: ClassVar[str] = "single"
    description: ClassVar[str] = "all layers on device 0 (no model parallelism)"

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        return _result(self.name, (0,) * problem.num_layers, problem)


@dataclass(frozen=True)
class EvenSolver(SolverOptions):
    """Contiguous layers, an equal count per device: layer k -> k * D // L."""

    name: ClassVar[str] = "even"
    description: ClassVar[str] = "contiguous layers split evenly by count (the hand-written split)"

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        n, d = problem.num_layers, problem.num_devices
        return _result(self.name, tuple(k * d // n for k in range(n)), problem)


@dataclass(frozen=True)
class RoundRobinSolver(SolverOptions):
    """Layer k -> device k % D."""

    name: ClassVar[str] = "round-robin"
    description: ClassVar[str] = "layer k on device k mod D"

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        d = problem.num_devices
        return _result(self.name, tuple(k % d for k in range(problem.num_layers)), problem)
