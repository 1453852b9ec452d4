"""PipeDream's dynamic program over contiguous pipeline stages.

Model (D. Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN Training",
SOSP 2019, section 3.1, without replication): the layers, in problem order, are cut into exactly
``D = num_devices`` non-empty contiguous stages, stage ``m`` on device ``m``. A pipeline's
throughput is set by its slowest stage, and a stage boundary costs the time to move the tensors
that cross it. With

* ``T_m(i+1..j)``: compute seconds (forward + backward) of layers ``i+1..j`` on device ``m``;
* ``C_m(i)``: transfer seconds of the bytes crossing the boundary after layer ``i`` between
  stages ``m - 1`` and ``m``, i.e. the sum of the bytes of every edge ``(a, b)`` with
  ``a <= i < b``, over ``topology.link_between(m - 1, m)`` -- the link that joins the two stages'
  devices, so a boundary between hosts pays the inter-host link and the DP puts it where few
  bytes cross (edge bytes already count both directions -- activations forward, gradients
  backward -- so PipeDream's factor 2 is inside the bytes);
* ``M(i+1..j)``: the stage's memory, which must fit device ``m`` (else the stage is infeasible),

the recurrence is::

    A(j, 0) = T_0(1..j)                                   if M(1..j) fits device 0, else inf
    A(j, m) = min_{i < j} max( A(i, m-1), C_m(i), T_m(i+1..j) )  over i with M(i+1..j) fitting m

and the answer is ``A(L, D-1)``. Evaluated directly this is ``O(L^2 D)``; the solver instead
decides its threshold form (``A(j, m) <= T``) in ``O(L log L)`` per stage and bisects on ``T``,
which is exact because every term is monotone in the stage's extent -- see
:mod:`partitioner.solvers.contiguous`. 10,000 layers x 8 devices solve in about a quarter second.

Stage ``m`` runs on device ``m``: with devices of different types the times ``T_m`` are those of
device ``m``, so a faster device gets a longer stage. The objective reported is ``A(L, D-1)``,
the bottleneck in seconds. Raises
:class:`~partitioner.core.errors.InfeasibleError` when no contiguous split fits device memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from partitioner.core.errors import InfeasibleError
from partitioner.core.ir import PartitionProblem, SolverResult, SolveStatus
from partitioner.solvers.base import SolverOptions, memory_infeasible_message, validate_problem_for
from partitioner.solvers.contiguous import min_bottleneck_split

__all__ = ["PipeDreamSolver", "boundary_bytes", "boundary_transfer_rows_s", "boundary_transfer_s"]

logger = logging.getLogger(__name__)


def boundary_bytes(problem: PartitionProblem) -> list[int]:
    """Bytes crossing a cut before every layer position ``c`` in ``0..L`` (0 at both ends): the
    bytes of every edge ``(a, b)`` with ``a < c <= b``."""
    n = problem.num_layers
    diff = [0] * (n + 2)
    for a, b, nbytes in problem.edges:
        diff[a + 1] += nbytes
        diff[b + 1] -= nbytes
    out = [0] * (n + 1)
    running = 0
    for c in range(1, n):
        running += diff[c]
        out[c] = running
    return out


def boundary_transfer_s(problem: PartitionProblem, boundary: int = 0) -> list[float]:
    """``C`` for a cut before every layer position ``c`` in ``0..L`` (0 at both ends).

    ``result[c]`` is the transfer time of the bytes of every edge ``(a, b)`` with
    ``a < c <= b``, over the link between devices ``boundary`` and ``boundary + 1`` (0 when there
    is one device).
    """
    link = (
        problem.topology.link_between(boundary, boundary + 1)
        if boundary + 1 < problem.num_devices
        else None
    )
    return [
        link.transfer_time_s(nbytes) if link is not None else 0.0
        for nbytes in boundary_bytes(problem)
    ]


def boundary_transfer_rows_s(problem: PartitionProblem) -> list[list[float]]:
    """``C_m`` for every stage boundary ``m = 1..D-1`` (between devices ``m - 1`` and ``m``)."""
    crossing = boundary_bytes(problem)
    rows: list[list[float]] = []
    memo: dict[object, list[float]] = {}
    for m in range(1, problem.num_devices):
        link = problem.topology.link_between(m - 1, m)
        if link not in memo:
            memo[link] = [
                link.transfer_time_s(nbytes) if link is not None else 0.0 for nbytes in crossing
            ]
        rows.append(memo[link])
    return rows or [[0.0] * len(crossing)]


@dataclass(frozen=True)
class PipeDreamSolver(SolverOptions):
    """PipeDream's stage DP: contiguous stages, slowest stage (compute or boundary) minimal."""

    name: ClassVar[str] = "dp"
    description: ClassVar[str] = "PipeDream's dynamic program over contiguous stages"

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        devices = problem.topology.devices
        split = min_bottleneck_split(
            problem.compute_time_s,
            problem.num_devices,
            memory_bytes=problem.memory_bytes,
            memory_limit_bytes=[d.memory_bytes for d in devices],
            cut_cost=boundary_transfer_rows_s(problem),
        )
        if split is None:
            raise InfeasibleError(
                memory_infeasible_message(
                    problem,
                    f"solver 'dp': no split into {problem.num_devices} contiguous stages fits "
                    "device memory",
                )
            )
        logger.debug("dp: cuts %s, bottleneck %.6g s", split.cuts, split.bottleneck)
        return SolverResult(
            solver=self.name,
            assignment=split.stage,
            status=SolveStatus.HEURISTIC,
            objective=split.bottleneck,
            notes=(f"stage boundaries before layers {list(split.cuts)}",) if split.cuts else (),
        )
