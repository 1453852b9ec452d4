"""Memory-constrained Earliest Task First (m-ETF) list scheduling of the layer DAG.

Reference: B. Jeon, L. Cai, P. Srivastava, J. Jiang, X. Ke, Y. Meng, C. Xie and I. Gupta,
"Baechi: Fast Device Placement of Machine Learning Graphs", ACM SoCC 2020 (m-ETF, after Hwang
et al.'s ETF, SIAM J. Comput. 1989).

Model: layer ``k`` is one task taking ``compute_time_s[d][k]`` (forward + backward) on device
``d``; a layer edge ``(a, b, bytes)`` delays ``b`` by ``c(bytes, dev(a), d) =
topology.link_between(dev(a), d).transfer_time_s(bytes)`` when ``a`` and ``b`` are on different
devices (the link of that pair: a device across hosts sees its inputs later). Layers are taken in problem order (a topological order,
since every edge goes from a lower to a higher index), so each is ready when its turn comes. For
layer ``k`` and every device ``d`` whose free memory holds it::

    start(k, d)  = max( free(d),  max_{(a, k)} end(a) + [dev(a) != d] * c(bytes, dev(a), d) )
    finish(k, d) = start(k, d) + compute_time_s[d][k]

and ``k`` goes to the device with the earliest finish (ties: lower index); ``free(d)`` and
``d``'s free memory are updated. Unlike Baechi, which picks the (ready task, device) pair with
the earliest start among all ready tasks, the order is fixed to the problem order, and links are
not serialised. Afterwards every empty device gets one layer
(:func:`~partitioner.solvers.base.fill_empty_devices`, memory-strict).

Cost ``O((L + E) D)`` (``O(L D + E)`` on a uniform topology, where the latest remote arrival is
the largest or second-largest producer time): 10,000 layers x 8 devices take well under a second. Raises
:class:`~partitioner.core.errors.InfeasibleError` when a layer fits on no device's remaining memory.
The objective reported is the schedule's makespan in seconds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from partitioner.core.errors import InfeasibleError
from partitioner.core.ir import Link, PartitionProblem, SolverResult, SolveStatus
from partitioner.core.units import format_bytes
from partitioner.solvers.base import (
    SolverOptions,
    fill_empty_devices,
    link_matrix,
    memory_infeasible_message,
    transfer_time_s,
    validate_problem_for,
)

__all__ = ["EtfSolver", "etf_schedule"]

logger = logging.getLogger(__name__)


def etf_schedule(problem: PartitionProblem) -> tuple[tuple[int, ...], float]:
    """The m-ETF assignment (before filling empty devices) and its makespan in seconds."""
    n, n_dev = problem.num_layers, problem.num_devices
    uniform = problem.topology.is_uniform or n_dev == 1
    preds = _predecessors(problem, uniform)
    links = link_matrix(problem.topology)
    free_s = [0.0] * n_dev
    free_mem = [d.memory_bytes for d in problem.topology.devices]
    end_s = [0.0] * n
    device = [0] * n
    for k in range(n):
        ready = _inputs_ready_s(preds[k], device, end_s, uniform, links)
        d, finish = _earliest_finish(problem, k, ready, free_s, free_mem)
        device[k] = d
        end_s[k] = finish
        free_s[d] = finish
        free_mem[d] -= problem.memory_bytes[k]
    return tuple(device), max(end_s, default=0.0)


def _predecessors(problem: PartitionProblem, uniform: bool) -> list[list[tuple[int, float, int]]]:
    """For every layer, its producers ``(a, transfer seconds, bytes)``; the transfer seconds are
    the one link's on a uniform topology (0 otherwise: per-pair links are priced per device)."""
    n_dev = problem.num_devices
    link = problem.topology.link_between(0, 1) if n_dev > 1 else None
    preds: list[list[tuple[int, float, int]]] = [[] for _ in range(problem.num_layers)]
    for a, b, nbytes in problem.edges:
        xfer = link.transfer_time_s(nbytes) if link is not None and uniform else 0.0
        preds[b].append((a, xfer, nbytes))
    return preds


def _inputs_ready_s(
    preds: list[tuple[int, float, int]],
    device: list[int],
    end_s: list[float],
    uniform: bool,
    links: tuple[tuple[Link | None, ...], ...],
) -> list[float]:
    """When all of a layer's inputs are on each device: the latest local end, or the latest end +
    transfer from another device.

    On a uniform topology the remote arrival on ``d`` is the largest over producers on other
    devices: the overall largest, or the second largest when the largest comes from ``d`` itself.
    With per-pair links it is the latest producer end plus its pair's transfer time.
    """
    n_dev = len(links)
    devices = range(n_dev)
    local = [0.0] * n_dev
    remote = [0.0] * n_dev
    for a, xfer, _ in preds:
        da, t = device[a], end_s[a]
        if t > local[da]:
            local[da] = t
        if t + xfer > remote[da]:
            remote[da] = t + xfer
    if uniform:
        top = max(devices, key=lambda e: remote[e])
        second = max((remote[e] for e in devices if e != top), default=0.0)
        arrival = [second if d == top else remote[top] for d in devices]
    else:
        arrival = [0.0] * n_dev
        for a, _, nbytes in preds:
            da, t = device[a], end_s[a]
            for d in devices:
                if d != da:
                    at = t + transfer_time_s(links, nbytes, da, d)
                    if at > arrival[d]:
                        arrival[d] = at
    return [max(local[d], arrival[d]) for d in devices]


def _earliest_finish(
    problem: PartitionProblem,
    k: int,
    ready_s: list[float],
    free_s: list[float],
    free_mem: list[int],
) -> tuple[int, float]:
    """The device where layer ``k`` finishes first among those whose free memory holds it (ties:
    lower index), and that finish; raise InfeasibleError when none holds it."""
    need = problem.memory_bytes[k]
    times = problem.compute_time_s
    best: tuple[float, int] | None = None
    for d in range(problem.num_devices):
        if free_mem[d] < need:
            continue
        finish = max(free_s[d], ready_s[d]) + times[d][k]
        if best is None or finish < best[0]:
            best = (finish, d)
    if best is None:
        roomiest = max(range(problem.num_devices), key=lambda d: (free_mem[d], -d))
        raise InfeasibleError(
            memory_infeasible_message(
                problem,
                f"solver 'etf': layer {problem.layers[k]!r} needs "
                f"{format_bytes(need, exact=True)} but the most free memory left is "
                f"{format_bytes(free_mem[roomiest], exact=True)} on device {roomiest}",
            )
        )
    return best[1], best[0]


@dataclass(frozen=True)
class EtfSolver(SolverOptions):
    """Baechi's m-ETF: each layer, in order, to the device where it finishes first."""

    name: ClassVar[str] = "etf"
    description: ClassVar[str] = (
        "Baechi's memory-constrained earliest-task-first list scheduling (m-ETF)"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        raw, makespan = etf_schedule(problem)
        final = fill_empty_devices(raw, problem, strict_memory=True)
        moved = sum(a != b for a, b in zip(raw, final, strict=True))
        notes = (f"moved {moved} layer(s) onto empty devices",) if moved else ()
        if moved:
            makespan = _makespan(final, problem)
        logger.debug("etf: makespan %.6g s", makespan)
        return SolverResult(
            solver=self.name,
            assignment=final,
            status=SolveStatus.HEURISTIC,
            objective=makespan,
            notes=notes,
        )


def _makespan(assignment: tuple[int, ...], problem: PartitionProblem) -> float:
    """The m-ETF schedule length of a fixed ``assignment`` (layers in problem order)."""
    n_dev = problem.num_devices
    links = link_matrix(problem.topology)
    end_s = [0.0] * problem.num_layers
    preds: list[list[tuple[int, int]]] = [[] for _ in range(problem.num_layers)]
    for a, b, nbytes in problem.edges:
        preds[b].append((a, nbytes))
    free_s = [0.0] * n_dev
    for k, d in enumerate(assignment):
        t = free_s[d]
        for a, nbytes in preds[k]:
            arrive = end_s[a]
            if assignment[a] != d:
                arrive += transfer_time_s(links, nbytes, assignment[a], d)
            t = max(t, arrive)
        end_s[k] = t + problem.compute_time_s[d][k]
        free_s[d] = end_s[k]
    return max(end_s, default=0.0)
