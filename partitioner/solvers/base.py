"""The solver interface and the helpers every solver shares.

A solver maps a :class:`~partitioner.core.ir.PartitionProblem` (layers in order, per-device layer
times, per-layer memory, layer traffic, devices) to an assignment ``layer index -> device index``.
Every solver is a frozen dataclass whose fields are its options (``seed``, ``time_limit_s`` and
any of its own); ``name``, ``description`` (one line, what the solver stands for: the CLI's help,
the docs and the benchmark tables print it) and ``uses_time_limit`` (``True`` for the solvers that
search until ``time_limit_s``; the others are fast heuristics and baselines) are class constants.

Shared vocabulary:

* the *load* of device ``d`` is ``sum(compute_time_s[d][k] for k on d)``; the *max load* of an
  assignment is the largest load over devices (the step time of a perfectly overlapped pipeline,
  and the quantity the balancing helpers minimise);
* an assignment *fits* when, on every device ``d``, the summed ``memory_bytes`` of its layers is
  at most ``topology.devices[d].memory_bytes``.

Helpers:

* :func:`validate_problem_for` rejects more devices than layers (a placement cannot use them);
* :func:`fill_empty_devices` gives every empty device one layer, greedily choosing the move that
  most reduces (least increases) the max load;
* :func:`repair_memory` moves layers off over-full devices until the assignment fits, or raises
  :class:`~partitioner.core.errors.InfeasibleError` naming the memory the model needs;
* :func:`check_memory` raises the same error without repairing (for baselines);
* :func:`link_matrix` and :func:`link_classes` give the link between every pair of devices (a
  topology may join different pairs by different links: NVLink within a host, Ethernet between
  hosts, per-pair overrides), so that every solver prices a transfer by the pair it crosses.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from partitioner.core.errors import InfeasibleError, SolverError
from partitioner.core.ir import Link, PartitionProblem, SolverResult, Topology
from partitioner.core.units import format_bytes

__all__ = [
    "Solver",
    "SolverOptions",
    "check_memory",
    "device_loads_s",
    "device_memory_bytes",
    "fill_empty_devices",
    "link_classes",
    "link_matrix",
    "max_load_s",
    "memory_infeasible_message",
    "repair_memory",
    "transfer_time_s",
    "validate_problem_for",
]

logger = logging.getLogger(__name__)


@runtime_checkable
class Solver(Protocol):
    """A placement solver: a frozen dataclass whose fields are its options."""

    name: ClassVar[str]
    description: ClassVar[str]
    uses_time_limit: ClassVar[bool]

    @property
    def seed(self) -> int: ...

    @property
    def time_limit_s(self) -> float: ...

    def solve(self, problem: PartitionProblem) -> SolverResult:
        """Place every layer of ``problem`` on a device."""
        ...


@dataclass(frozen=True)
class SolverOptions:
    """The options every solver has; concrete solvers subclass this frozen dataclass."""

    uses_time_limit: ClassVar[bool] = False
    """Whether the solver searches until ``time_limit_s`` (``ilp``, ``auto``); a fast heuristic
    or baseline ignores the limit."""

    seed: int = 0
    time_limit_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise SolverError(f"solver option seed={self.seed!r} must be an integer")
        t = self.time_limit_s
        if (
            isinstance(t, bool)
            or not isinstance(t, (int, float))
            or not (t > 0 and math.isfinite(t))
        ):
            raise SolverError(
                f"solver option time_limit_s={t!r} must be a positive number of seconds"
            )


# --------------------------------------------------------------------------------------------
# Loads and memory
# --------------------------------------------------------------------------------------------


def device_loads_s(assignment: Sequence[int], problem: PartitionProblem) -> list[float]:
    """Compute seconds on each device under ``assignment``."""
    loads = [0.0] * problem.num_devices
    for k, d in enumerate(assignment):
        loads[d] += problem.compute_time_s[d][k]
    return loads


def max_load_s(assignment: Sequence[int], problem: PartitionProblem) -> float:
    """The largest device load of ``assignment``."""
    return max(device_loads_s(assignment, problem))


def device_memory_bytes(assignment: Sequence[int], problem: PartitionProblem) -> list[int]:
    """Peak bytes of memory on each device under ``assignment``: its layers' resident bytes
    plus the largest transient among them (one layer's backward runs at a time)."""
    used = [0] * problem.num_devices
    transient = [0] * problem.num_devices
    for k, d in enumerate(assignment):
        used[d] += problem.memory_bytes[k]
        if problem.transient_bytes:
            transient[d] = max(transient[d], problem.transient_bytes[k])
    return [u + t for u, t in zip(used, transient, strict=True)]


def memory_infeasible_message(
    problem: PartitionProblem, prefix: str = "", *, baseline: bool = False
) -> str:
    """One line: the memory the model needs, the largest device limit, the fewest devices."""
    total = sum(problem.memory_bytes)
    limit = max(d.memory_bytes for d in problem.topology.devices)
    head = f"{prefix}: " if prefix else ""
    biggest = max(range(problem.num_layers), key=lambda k: problem.memory_bytes[k])
    if problem.memory_bytes[biggest] > limit:
        return (
            f"{head}layer {problem.layers[biggest]!r} alone needs "
            f"{format_bytes(problem.memory_bytes[biggest], exact=True)}, more than the largest device memory "
            f"{format_bytes(limit, exact=True)}; no layer-level placement fits (use larger devices, a smaller "
            "batch, or split the layer)"
        )
    fewest = math.ceil(total / limit) if limit > 0 else problem.num_layers
    n_dev = problem.num_devices
    if fewest > n_dev:
        advice = f"use gpus={fewest} or more, or larger devices"
    elif baseline:
        advice = 'use a solver that balances memory (solver="metis")'
    else:
        advice = f"the layers do not pack into {n_dev} devices: use more or larger devices"
    return (
        f"{head}the model needs {format_bytes(total, exact=True)} of memory in total, the largest device "
        f"holds {format_bytes(limit, exact=True)}, so it needs at least {fewest} devices "
        f"(have {n_dev}); {advice}"
    )


def check_memory(assignment: Sequence[int], problem: PartitionProblem, solver: str) -> None:
    """Raise :class:`InfeasibleError` if ``assignment`` does not fit in device memory."""
    used = device_memory_bytes(assignment, problem)
    for d, (u, dev) in enumerate(zip(used, problem.topology.devices, strict=True)):
        if u > dev.memory_bytes:
            raise InfeasibleError(
                memory_infeasible_message(
                    problem,
                    f"solver {solver!r} puts {format_bytes(u, exact=True)} on device {d}, over its "
                    f"{format_bytes(dev.memory_bytes, exact=True)}",
                    baseline=True,
                )
            )


# --------------------------------------------------------------------------------------------
# Links between device pairs
# --------------------------------------------------------------------------------------------


def link_matrix(topology: Topology) -> tuple[tuple[Link | None, ...], ...]:
    """``m[a][b]``: the link from device ``a`` to ``b`` (``None`` on the diagonal)."""
    n = topology.num_devices
    return tuple(tuple(topology.link_between(a, b) for b in range(n)) for a in range(n))


def transfer_time_s(
    links: Sequence[Sequence[Link | None]], num_bytes: int, src: int, dst: int
) -> float:
    """Seconds to move ``num_bytes`` from device ``src`` to ``dst`` (0 on one device)."""
    link = links[src][dst]
    return 0.0 if link is None else link.transfer_time_s(num_bytes)


def link_classes(
    links: Sequence[Sequence[Link | None]],
) -> tuple[tuple[tuple[Link, tuple[int, ...]], ...], ...]:
    """For every device ``d``, the other devices grouped by the link that joins them to ``d``:
    ``((link, (e, ...)), ...)`` in order of first member. On a uniform topology every device has
    one class holding all the others; across two hosts, two (its host, the other host)."""
    out = []
    for d, row in enumerate(links):
        groups: dict[Link, list[int]] = {}
        for e, link in enumerate(row):
            if e != d and link is not None:
                groups.setdefault(link, []).append(e)
        out.append(tuple((link, tuple(members)) for link, members in groups.items()))
    return tuple(out)


# --------------------------------------------------------------------------------------------
# Shared steps
# --------------------------------------------------------------------------------------------


def validate_problem_for(problem: PartitionProblem) -> None:
    """Reject a problem with more devices than layers: a placement puts each layer on one device
    and leaves none of its devices empty, so it cannot use more devices than layers. Callers
    that plan for more place on a subset (``partitioner.api.placement_devices``,
    ``partitioner.planner.search.sub_problem``) and use the rest for replicas."""
    n_dev, n_layers = problem.num_devices, problem.num_layers
    if n_dev > n_layers:
        raise InfeasibleError(
            f"gpus={n_dev} is more than the {n_layers} layers of the model; "
            f"use at most {n_layers} devices for a placement (one layer or more on each), or "
            f"plan with partitioner.partition(), which places on {n_layers} of them and can run "
            "data-parallel replicas on all"
        )


def checked_assignment(assignment: Sequence[int], problem: PartitionProblem) -> tuple[int, ...]:
    """``assignment`` as a tuple of ints, after checking one valid device per layer."""
    if len(assignment) != problem.num_layers:
        raise SolverError(
            f"assignment has {len(assignment)} entries for {problem.num_layers} layers; "
            "give one device per layer"
        )
    out = tuple(int(d) for d in assignment)
    for k, d in enumerate(out):
        if not 0 <= d < problem.num_devices:
            raise SolverError(
                f"layer {problem.layers[k]!r} assigned to device {d}, not in "
                f"0..{problem.num_devices - 1}"
            )
    return out


def colocation_roots(problem: PartitionProblem) -> list[int]:
    """For each layer, the lowest-index layer it must share a device with (union-find over
    ``problem.colocate``; groups that share a layer merge)."""
    parent = list(range(problem.num_layers))

    def find(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for group in problem.colocate:
        for k in group[1:]:
            ra, rb = find(group[0]), find(k)
            if ra != rb:
                parent[max(ra, rb)] = min(ra, rb)
    return [find(k) for k in range(problem.num_layers)]


def fill_empty_devices(
    assignment: Sequence[int], problem: PartitionProblem, *, strict_memory: bool = False
) -> tuple[int, ...]:
    """Give every empty device one layer, while there are at least as many layers as devices.

    For each empty device ``e`` (in index order) consider every layer on a device holding two or
    more layers and move the one that gives the smallest max load afterwards (ties: smaller sum of
    the two affected loads, then lower layer index). Layers whose memory fits on ``e`` are
    preferred; with ``strict_memory`` the others are never moved (a device may then stay empty).
    """
    checked_assignment(assignment, problem)
    result = list(assignment)
    n_dev = problem.num_devices
    if problem.num_layers < n_dev:
        return tuple(result)
    times = problem.compute_time_s
    counts = [0] * n_dev
    for d in result:
        counts[d] += 1
    loads = device_loads_s(result, problem)
    for e in range(n_dev):
        if counts[e]:
            continue
        limit = problem.topology.devices[e].memory_bytes
        best: tuple[bool, float, float, int] | None = None
        # the largest load off ``src`` and ``e`` is among the three largest: O(1) per layer
        top = sorted(range(n_dev), key=lambda d: loads[d], reverse=True)[:3]
        for k, src in enumerate(result):
            if counts[src] < 2:
                continue
            fits = problem.memory_bytes[k] <= limit
            if strict_memory and not fits:
                continue
            new_src = loads[src] - times[src][k]
            new_e = times[e][k]
            others = next((loads[d] for d in top if d not in (src, e)), 0.0)
            key = (not fits, max(others, new_src, new_e), new_src + new_e, k)
            if best is None or key < best:
                best = key
        if best is None:
            continue
        k = best[3]
        src = result[k]
        loads[src] -= times[src][k]
        loads[e] += times[e][k]
        counts[src] -= 1
        counts[e] += 1
        result[k] = e
        logger.debug(
            "fill_empty_devices: moved layer %s from device %d to empty device %d",
            problem.layers[k],
            src,
            e,
        )
    return tuple(result)


def repair_memory(assignment: Sequence[int], problem: PartitionProblem) -> tuple[int, ...]:
    """Move layers until every device's memory holds its layers, or raise InfeasibleError.

    Repeatedly take the most over-full device (largest excess over its limit) and move its
    cheapest layer (smallest compute time there) that fits somewhere else onto the device with
    the most free memory that can hold it. Each move lowers the total excess by the layer's
    (positive) memory and never over-fills the target, so the loop ends.
    """
    checked_assignment(assignment, problem)
    result = list(assignment)
    devices = problem.topology.devices
    used = device_memory_bytes(result, problem)
    while True:
        excess = [u - dev.memory_bytes for u, dev in zip(used, devices, strict=True)]
        worst = max(range(len(excess)), key=lambda d: (excess[d], -d))
        if excess[worst] <= 0:
            return tuple(result)
        candidates = sorted(
            (k for k, d in enumerate(result) if d == worst and problem.memory_bytes[k] > 0),
            key=lambda k: (problem.compute_time_s[worst][k], k),
        )
        moved = False
        for k in candidates:
            need = problem.memory_bytes[k]
            targets = [
                d
                for d in range(len(devices))
                if d != worst and devices[d].memory_bytes - used[d] >= need
            ]
            if not targets:
                continue
            target = max(targets, key=lambda d: (devices[d].memory_bytes - used[d], -d))
            result[k] = target
            used[worst] -= need
            used[target] += need
            logger.debug(
                "repair_memory: moved layer %s from device %d to device %d",
                problem.layers[k],
                worst,
                target,
            )
            moved = True
            break
        if not moved:
            raise InfeasibleError(memory_infeasible_message(problem))
