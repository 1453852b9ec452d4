"""Baseline placements, the yardsticks a real solver must beat.

* ``single``: every layer on device 0 (no model parallelism); raises
  :class:`~partitioner.core.errors.InfeasibleError` when the model does not fit, which is the point.
* ``even``: contiguous layers in problem order, split evenly by count -- layer ``k`` of ``L`` goes
  to device ``k * D // L``; what an expert writes by hand.
* ``round-robin``: layer ``k`` to device ``k % D``.
* ``params``: contiguous blocks balanced by parameter size, DeepSpeed's pipeline
  ``partition_method="parameters"``. The problem carries no parameter counts, so each layer's
  ``memory_bytes`` (parameters + gradients + optimizer state + saved activations) stands in for
  them: the blocks balance memory, which is what the parameter split is for. When device memories
  differ, block ``d`` is weighed by the fraction of device ``d``'s memory it fills, so a larger
  device gets a larger block.
* ``time``: contiguous blocks balanced by compute time, torchgpipe's ``balance_by_time``
  (C. Kim et al., "torchgpipe: On-the-fly Pipeline Parallelism for Training Giant Models",
  arXiv:2004.09910, 2020); block ``d`` is timed on device ``d``.

``params`` and ``time`` use the exact linear partition of
:mod:`partitioner.solvers.contiguous`: the largest block weight is minimal over all splits into
exactly ``D`` non-empty contiguous blocks (block ``d`` on device ``d``).

On devices of different types, ``even`` and ``round-robin`` stay what a person would write
without looking at the devices (they are yardsticks); ``time`` and ``params`` weigh each block on
its own device.

Baselines neither balance nor repair memory: a placement that does not fit raises
InfeasibleError.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from partitioner.core.ir import PartitionProblem, SolverResult, SolveStatus
from partitioner.solvers.base import (
    SolverOptions,
    check_memory,
    max_load_s,
    validate_problem_for,
)
from partitioner.solvers.contiguous import linear_partition, min_bottleneck_split

__all__ = ["EvenSolver", "ParamsSolver", "RoundRobinSolver", "SingleSolver", "TimeSolver"]


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
    description: ClassVar[str] = (
        "everything on one device: no model parallelism (infeasible when it does not fit)"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        # No validate_problem_for: one device is used whatever the count, so "more devices than
        # layers" does not apply to this baseline.
        return _result(self.name, (0,) * problem.num_layers, problem)


@dataclass(frozen=True)
class EvenSolver(SolverOptions):
    """Contiguous layers, an equal count per device: layer k -> k * D // L."""

    name: ClassVar[str] = "even"
    description: ClassVar[str] = (
        "contiguous layers split evenly by count: the split an expert writes by hand"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        n, d = problem.num_layers, problem.num_devices
        return _result(self.name, tuple(k * d // n for k in range(n)), problem)


@dataclass(frozen=True)
class RoundRobinSolver(SolverOptions):
    """Layer k -> device k % D."""

    name: ClassVar[str] = "round-robin"
    description: ClassVar[str] = "layer k on device k mod N"

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        d = problem.num_devices
        return _result(self.name, tuple(k % d for k in range(problem.num_layers)), problem)


@dataclass(frozen=True)
class ParamsSolver(SolverOptions):
    """Contiguous blocks with the largest block's memory (the parameter stand-in) minimal."""

    name: ClassVar[str] = "params"
    description: ClassVar[str] = (
        "contiguous blocks balanced by parameter memory: DeepSpeed's "
        "`partition_method='parameters'`"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        memories = [d.memory_bytes for d in problem.topology.devices]
        if len(set(memories)) == 1 or min(memories) <= 0:
            weights = [float(m) for m in problem.memory_bytes]
            return _result(self.name, linear_partition(weights, problem.num_devices), problem)
        rows = [[m / cap for m in problem.memory_bytes] for cap in memories]
        split = min_bottleneck_split(rows, problem.num_devices)
        assert split is not None  # no memory limits and n >= D: always feasible
        return _result(self.name, split.stage, problem)


@dataclass(frozen=True)
class TimeSolver(SolverOptions):
    """Contiguous blocks with the slowest block's compute time minimal (torchgpipe, Kim 2020)."""

    name: ClassVar[str] = "time"
    description: ClassVar[str] = (
        "contiguous blocks balanced by compute time: torchgpipe's `balance_by_time`"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        split = min_bottleneck_split(problem.compute_time_s, problem.num_devices)
        assert split is not None  # no memory limits and n >= D: always feasible
        return _result(self.name, split.stage, problem)
