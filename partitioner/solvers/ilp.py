"""Exact placement by integer programming (OR-Tools CP-SAT), for two objectives.

Notation: layers ``k = 0..n-1`` (problem order), devices ``d = 0..D-1``, ``t[d][k]`` the
forward+backward time of layer ``k`` on device ``d``, ``m[k]`` its memory, ``M[d]`` the memory of
device ``d``, edges ``e = (a, b, bytes)`` with ``a < b``, and ``c[e](i, j) =
topology.link_between(i, j).transfer_time_s(bytes)`` the time to send edge ``e`` between devices
``i != j`` (links may differ per pair: NVLink within a host, Ethernet between hosts). For each
device ``d`` the other devices fall into *link classes* ``C`` -- the devices joined to ``d`` by
the same link, so ``c[e](d, j) = c[e](d, C)`` for every ``j`` in ``C`` (one class on a uniform
topology; two -- own host, other host -- across two hosts) -- and ``x[v, C] = sum_{j in C} x[v, j]``
says that layer ``v`` sits in ``C``. Both objectives share

1. ``x[k, d]`` in {0, 1}, ``sum_d x[k, d] = 1``: one device per layer;
2. ``sum_k m[k] x[k, d] <= M[d]``: memory;
3. ``x[k, d] = x[r, d]`` for every layer ``k`` of a colocation group whose first layer is ``r``;
4. with ``acyclic``: ``sum_d d x[a, d] <= sum_d d x[b, d]`` for every edge, so that traffic only
   flows from lower to higher (or equal) device index, i.e. devices are pipeline stages in order;
5. when every device has the same type, memory and layer times, every pair the same link, and
   ``acyclic`` is off, the symmetry break ``x[k, d] = 0`` for ``d > k`` (any placement
   renumbered by first use obeys it).

**throughput** (the default): the steady-state step time of a pipeline is set by its slowest
stage, as in PipeDream (Narayanan et al., "PipeDream: Generalized Pipeline Parallelism for DNN
Training", SOSP 2019). A device's load is its compute plus the transfers of every cut edge it
sends or receives (sender and receiver each pay ``c[e]``; transfers are not overlapped with
compute):

6. ``z[e, d, C] >= x[a, d] + x[b, C] - 1`` and ``z[e, d, C] >= x[b, d] + x[a, C] - 1``: edge
   ``e`` is cut with one end on ``d`` and the other in ``d``'s class ``C`` (minimisation keeps
   ``z`` at that value). With one class (all other devices), ``x[v, C] = 1 - x[v, d]`` and this
   is ``z[e, d] >= |x[a, d] - x[b, d]|``;
7. ``sum_k x[k, d] >= 1`` for every ``d`` when there are at least ``D`` placement units (layers,
   colocation groups counted once): every pipeline stage holds a layer;
8. ``T >= L[d] = sum_k t[d][k] x[k, d] + sum_{e, C} c[e](d, C) z[e, d, C]``; minimise ``T``.

9. hosts share their network link (:meth:`~partitioner.core.ir.Topology.channel_between`): with
   several hosts, some holding more than one device, for every host pair ``h < g``
   ``w[e, h, g] >= X[a, h] + X[b, g] - 1`` and ``w[e, h, g] >= X[a, g] + X[b, h] - 1`` with
   ``X[v, h] = sum_{d on h} x[v, d]``, and ``T >= sum_e c_host[e] w[e, h, g]``: the channel
   between two hosts is a resource like a device, loaded with every transfer between them (both
   directions together, as a device's load counts what it sends and receives).

This is exact for per-pair links: a cut edge costs each end the time over the link that actually
joins the two devices, so an edge across hosts costs its slow inter-host link and the optimum
keeps heavy edges within a host; and many devices sending across hosts at once queue on the one
channel. (A per-pair override between devices of two hosts is its own channel; with such
overrides block 9 is left out of the model -- CP-SAT then optimises a relaxation, its bound stays
valid, and the answer is reported FEASIBLE, not OPTIMAL.)

:func:`throughput_objective_s` evaluates this objective for any assignment.

**step**: the makespan of one training step scheduled at layer level, after Pesto (Hafeez et al.,
"Towards Optimal Placement and Scheduling of DNN Operations with Pesto", Middleware 2021), meant
for coarsened graphs of up to a few hundred nodes:

6. ``s[k]`` start, ``f[k] = s[k] + sum_d t[d][k] x[k, d]`` end;
7. per device, an optional interval ``[s[k], s[k] + t[d][k])`` present iff ``x[k, d]``, and
   ``NoOverlap`` over each device's intervals: a device runs one layer at a time;
8. ``cut[e] >= x[a, d] - x[b, d]`` for every ``d``, and ``s[b] >= f[a] + c[e] cut[e]`` (one link
   class); with several classes, ``s[b] >= f[a]`` and
   ``s[b] >= f[a] + c[e](d, C) (x[a, d] + x[b, C] - 1)`` for every ``d`` and class ``C``;
9. ``S >= f[k]``; minimise ``S``.

Simplifications of the step model, stated plainly: the layer graph is the problem's edges in
layer order, i.e. the *forward* pass only, with each layer's compute being its forward+backward
time (the backward pass is not scheduled in reverse); transfers overlap with compute and with
each other (no link contention); a device may be left empty when using it only adds transfers.
:func:`step_objective_s` evaluates an assignment by list scheduling in layer order.

Times are scaled to integer ticks, ``floor(seconds * scale)`` with ``scale = 10**9 / U`` for an
upper bound ``U`` of the objective (so every sum stays near ``10**9``, far inside int64), and each
value has an absolute error below ``U / 10**9`` (relative ``1e-3`` for values above
``U / 10**6``). Flooring makes the integer model's proven bound a valid lower bound in seconds;
the reported objective is recomputed in exact seconds from the final assignment, so
``best_bound <= objective``, and OPTIMAL means optimal at that resolution: its gap is a few ticks
(below ``1e-6`` relative), not exactly 0.

The search is warm-started (a full solution hint) from ``warm_start`` when given and feasible,
else from the best feasible placement of metis, even, round-robin and single under the chosen
objective (colocation groups moved onto the device of their first layer). That warm placement is
also the fallback: it is returned when it is better than the best CP-SAT found, or when CP-SAT
finds nothing within ``time_limit_s`` (which covers the heuristics and the search). With
``num_workers=1`` and ``seed`` as CP-SAT's random seed, a search that finishes before its time
limit is deterministic.

OR-Tools must load its native libraries before TensorFlow does (google/or-tools#3230: the other
order crashes CP-SAT). This module loads OR-Tools on import when TensorFlow is not loaded yet;
when it is, CP-SAT runs in one long-lived worker process (started on first use) that loads
OR-Tools first, and the results are the same.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import math
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, ClassVar, Literal

from partitioner.core.errors import InfeasibleError, PartitionError, SolverError
from partitioner.core.ir import Link, PartitionProblem, SolverResult, SolveStatus
from partitioner.core.units import format_bytes
from partitioner.solvers.base import (
    SolverOptions,
    checked_assignment,
    colocation_roots,
    device_loads_s,
    device_memory_bytes,
    link_classes,
    link_matrix,
    memory_infeasible_message,
    validate_problem_for,
)
from partitioner.solvers.baselines import EvenSolver, RoundRobinSolver, SingleSolver
from partitioner.solvers.metis import MetisSolver

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = [
    "BUILD_S_PER_TERM",
    "IlpObjective",
    "IlpSolver",
    "cp_sat_in_worker_process",
    "edge_pair_times_s",
    "edge_transfer_times_s",
    "model_build_s",
    "step_objective_s",
    "throughput_model_terms",
    "throughput_objective_s",
]

logger = logging.getLogger(__name__)

IlpObjective = Literal["throughput", "step"]
_OBJECTIVES: tuple[str, ...] = ("throughput", "step")

_Evaluate = Callable[[PartitionProblem, Sequence[int]], float]
_WarmStart = tuple[tuple[int, ...] | None, str, float]
"""A warm start: the placement (None when no heuristic fits), where it came from, its value."""

_TICKS_PER_UPPER_BOUND = 10**9
"""Integer ticks that the objective's upper bound is scaled to."""

_MIN_SEARCH_S = 0.01
"""CP-SAT's search time when the warm start used up the time limit."""

BUILD_S_PER_TERM = 2e-5
"""Measured cost of building the model per (layer or edge) x device term (OR-Tools' Python
builder; 9.5M terms of a 3,226-layer, 64-device problem took ~95 s), kept out of its search."""

_ORTOOLS_MODULE = "ortools.sat.python.cp_model"
_IN_PROCESS = "tensorflow" not in sys.modules or _ORTOOLS_MODULE in sys.modules
"""Whether CP-SAT may run in this process: OR-Tools' native libraries must load before
TensorFlow's (they bundle clashing protobuf/abseil; the other order crashes CP-SAT, see
google/or-tools#3230). So OR-Tools is loaded now if TensorFlow is not; otherwise CP-SAT runs in a
worker process that loads OR-Tools first."""
if _IN_PROCESS:
    importlib.import_module(_ORTOOLS_MODULE)


# --------------------------------------------------------------------------------------------
# Objectives in exact seconds
# --------------------------------------------------------------------------------------------


def edge_transfer_times_s(problem: PartitionProblem) -> tuple[float, ...]:
    """Seconds to send each edge's bytes over the slowest link between any two devices
    (``problem.edges`` order): the worst case of :func:`edge_pair_times_s`."""
    link = problem.topology.slowest_link
    if link is None:
        return tuple(0.0 for _ in problem.edges)
    return tuple(link.transfer_time_s(nbytes) for _, _, nbytes in problem.edges)


_PairCost = Callable[[int, int, int], float]
"""``cost(edge_index, src_device, dst_device)``: the transfer time of a cut edge."""


def edge_pair_times_s(problem: PartitionProblem) -> _PairCost:
    """``cost(i, src, dst)``: seconds to send edge ``i``'s bytes from device ``src`` to ``dst``
    over the link that joins them (0 when ``src == dst``)."""
    links = link_matrix(problem.topology)
    memo: dict[tuple[int, Link], float] = {}
    nbytes = [e[2] for e in problem.edges]

    def cost(i: int, src: int, dst: int) -> float:
        link = links[src][dst]
        if link is None:
            return 0.0
        key = (i, link)
        value = memo.get(key)
        if value is None:
            value = memo[key] = link.transfer_time_s(nbytes[i])
        return value

    return cost


def throughput_objective_s(problem: PartitionProblem, assignment: Sequence[int]) -> float:
    """The largest load of a device or a host-to-host channel.

    A device's load is its compute plus the transfer time of every cut edge it touches (both ends
    pay it, over the link between them); a channel's load is the transfer time of every cut edge
    between its two hosts (:meth:`~partitioner.core.ir.Topology.channel_between`, both directions
    together). This is the pipeline step time the ``throughput`` objective minimises (see the
    module docstring).
    """
    dev = checked_assignment(assignment, problem)
    loads = device_loads_s(dev, problem)
    topo = problem.topology
    links = link_matrix(topo)
    channels: dict[tuple[int, int], float] = {}
    for a, b, nbytes in problem.edges:
        da, db = dev[a], dev[b]
        if da != db:
            link = links[da][db]
            c = 0.0 if link is None else link.transfer_time_s(nbytes)
            loads[da] += c
            loads[db] += c
            kind, ha, hb = topo.channel_between(da, db)
            if kind == "host":
                key = (min(ha, hb), max(ha, hb))
                channels[key] = channels.get(key, 0.0) + c
    return max(max(loads), max(channels.values(), default=0.0))


def throughput_model_terms(problem: PartitionProblem) -> int:
    """The size of the throughput model in (layer or edge) x device terms: ``(L + E) D`` on a
    uniform topology, more with several link classes per device and shared host channels (what
    ``auto`` budgets the model's build time by)."""
    n_dev = problem.num_devices
    classes = sum(len(c) for c in link_classes(link_matrix(problem.topology)))
    hosts = _shared_host_channels(problem)
    pairs = len(hosts) * (len(hosts) - 1) // 2 if hosts else 0
    return problem.num_layers * n_dev + len(problem.edges) * (classes + pairs * n_dev)


def model_build_s(problem: PartitionProblem, objective: str = "throughput") -> float:
    """An estimate of the seconds it takes to build the model of ``objective`` for ``problem``
    (:data:`BUILD_S_PER_TERM` per term; the step model has one precedence term per edge and
    link class of every device instead of the throughput model's cut and channel terms)."""
    if objective == "throughput":
        return BUILD_S_PER_TERM * throughput_model_terms(problem)
    classes = sum(len(c) for c in link_classes(link_matrix(problem.topology)))
    return BUILD_S_PER_TERM * (
        problem.num_layers * problem.num_devices + len(problem.edges) * classes
    )


def _shared_host_channels(problem: PartitionProblem) -> tuple[tuple[int, ...], ...] | None:
    """The devices of every host when block 9 applies (several hosts, one with two or more
    devices); ``()`` when it does not matter (it is implied by the device loads); ``None`` when
    a per-pair override crosses hosts (block 9 is then not modelled exactly)."""
    topo = problem.topology
    hosts: dict[int, list[int]] = {}
    for d in topo.devices:
        hosts.setdefault(d.host, []).append(d.index)
    if len(hosts) < 2 or all(len(m) == 1 for m in hosts.values()):
        return ()
    if any(topo.devices[a].host != topo.devices[b].host for a, b, _ in topo.links):
        return None
    return tuple(tuple(m) for _, m in sorted(hosts.items()))


def _list_schedule(
    durations: Sequence[Sequence[float]],
    edges: Sequence[tuple[int, int, int]],
    comm: _PairCost,
    dev: Sequence[int],
    order: Sequence[int],
) -> list[float]:
    """Start times of list scheduling ``order`` (topological): each layer starts once its device
    is free and every input has arrived (``comm(edge, src, dst)`` added across devices)."""
    preds: list[list[tuple[int, int]]] = [[] for _ in dev]
    for i, (a, b, _) in enumerate(edges):
        preds[b].append((a, i))
    free = [0.0] * len(durations)
    start = [0.0] * len(dev)
    end = [0.0] * len(dev)
    for k in order:
        d = dev[k]
        s = free[d]
        for a, i in preds[k]:
            s = max(s, end[a] + (comm(i, dev[a], d) if dev[a] != d else 0.0))
        start[k] = s
        end[k] = s + durations[d][k]
        free[d] = end[k]
    return start


def step_objective_s(problem: PartitionProblem, assignment: Sequence[int]) -> float:
    """Makespan of one step under ``assignment``, list-scheduled in layer order.

    Each device runs its layers in problem order, each as soon as its inputs have arrived (the
    transfer time over the pair's link is added on a cut edge); the step model of the module
    docstring.
    """
    dev = checked_assignment(assignment, problem)
    comm = edge_pair_times_s(problem)
    start = _list_schedule(problem.compute_time_s, problem.edges, comm, dev, range(len(dev)))
    return max(s + problem.compute_time_s[d][k] for k, (s, d) in enumerate(zip(start, dev)))


# --------------------------------------------------------------------------------------------
# Constraints shared by the model, the warm start and the fallback
# --------------------------------------------------------------------------------------------


def _identical_devices(problem: PartitionProblem) -> bool:
    """Same type, memory and layer times on every device, and the same link between every pair."""
    devs = problem.topology.devices
    return (
        len({(d.device_type, d.memory_bytes) for d in devs}) == 1
        and len(set(problem.compute_time_s)) == 1
        and problem.topology.is_uniform
    )


def _first_use_order(assignment: Sequence[int], num_devices: int) -> tuple[int, ...]:
    order: dict[int, int] = {}
    for d in assignment:
        order.setdefault(d, len(order))
    for d in range(num_devices):
        order.setdefault(d, len(order))
    return tuple(order[d] for d in assignment)


@dataclass(frozen=True)
class _Rules:
    """The constraints of the model that a candidate placement must also satisfy."""

    roots: tuple[int, ...]
    acyclic: bool
    require_nonempty: bool
    symmetric: bool

    def violation(self, problem: PartitionProblem, dev: Sequence[int]) -> str | None:
        used = device_memory_bytes(dev, problem)
        for d, (u, device) in enumerate(zip(used, problem.topology.devices, strict=True)):
            if u > device.memory_bytes:
                return (
                    f"device {d} holds {format_bytes(u, exact=True)}, over its "
                    f"{format_bytes(device.memory_bytes, exact=True)}"
                )
        for k, r in enumerate(self.roots):
            if dev[k] != dev[r]:
                return f"layers {problem.layers[r]!r} and {problem.layers[k]!r} must be colocated"
        if self.acyclic:
            for a, b, _ in problem.edges:
                if dev[a] > dev[b]:
                    return f"edge {problem.layers[a]!r} -> {problem.layers[b]!r} goes to a lower device"
        if self.require_nonempty and len(set(dev)) < problem.num_devices:
            return "a device is left empty"
        return None

    def normalise(self, dev: Sequence[int], num_devices: int) -> tuple[int, ...]:
        """Move colocation groups onto their first layer's device; renumber under symmetry."""
        out = tuple(dev[r] for r in self.roots)
        return _first_use_order(out, num_devices) if self.symmetric else out


# --------------------------------------------------------------------------------------------
# The solver
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IlpSolver(SolverOptions):
    """CP-SAT placement minimising the pipeline stage time or the one-step makespan."""

    name: ClassVar[str] = "ilp"
    description: ClassVar[str] = (
        "CP-SAT integer program on the pipelined time (or the one-step makespan), under memory "
        "limits"
    )
    uses_time_limit: ClassVar[bool] = True

    objective: IlpObjective = "throughput"
    acyclic: bool = False
    warm_start: tuple[int, ...] | None = None
    num_workers: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.objective not in _OBJECTIVES:
            raise SolverError(
                f"solver 'ilp' option objective={self.objective!r} is unknown; use one of "
                f"{', '.join(_OBJECTIVES)}"
            )
        if not isinstance(self.acyclic, bool):
            raise SolverError(f"solver 'ilp' option acyclic={self.acyclic!r} must be true or false")
        nw = self.num_workers
        if isinstance(nw, bool) or not isinstance(nw, int) or nw < 1:
            raise SolverError(
                f"solver 'ilp' option num_workers={nw!r} must be an integer >= 1 (1 is deterministic)"
            )
        object.__setattr__(self, "warm_start", _parse_warm_start(self.warm_start))

    # ---------------------------------------------------------------------------------------

    def solve(self, problem: PartitionProblem, *, build_in_limit: bool = True) -> SolverResult:
        """Warm start, CP-SAT search, then the better of the two in exact seconds.

        With ``build_in_limit`` (the default) a model whose estimated build time
        (:func:`model_build_s`) exceeds what is left of ``time_limit_s`` is not built: the warm
        start is returned, so a problem too large for the ILP (thousands of layers on tens of
        devices) stays within its time limit. ``auto`` passes ``False``: it has already kept
        the estimated build time out of the limit it gives the ILP."""
        t0 = time.perf_counter()
        validate_problem_for(problem)
        _check_layers_fit(problem)
        rules, notes = self._rules(problem)
        evaluate = step_objective_s if self.objective == "step" else throughput_objective_s
        if problem.num_devices == 1:
            return self._one_device(problem, rules, evaluate, t0)
        warm = self._warm_start(problem, rules, evaluate, notes)
        build_s = model_build_s(problem, self.objective) if build_in_limit else 0.0
        left_s = self.time_limit_s - (time.perf_counter() - t0)
        if build_s > max(left_s, _MIN_SEARCH_S):
            return self._too_large(warm, notes, t0, build_s, left_s)
        outcome = self._search(problem, rules, warm[0], t0)
        if outcome.assignment is None:
            return self._warm_fallback(outcome, warm, notes, t0)
        return self._searched(problem, outcome, outcome.assignment, warm, notes, t0)

    # ---------------------------------------------------------------------------------------

    def _rules(self, problem: PartitionProblem) -> tuple[_Rules, list[str]]:
        """The model's rules for ``problem`` (constraints 3-5, 7), and the first notes."""
        n_dev = problem.num_devices
        roots = colocation_roots(problem)
        n_units = len(set(roots))
        step = self.objective == "step"
        rules = _Rules(
            roots=tuple(roots),
            acyclic=self.acyclic,
            require_nonempty=not step and n_units >= n_dev,
            symmetric=not self.acyclic and _identical_devices(problem),
        )
        notes: list[str] = []
        if not step and n_units < n_dev:
            notes.append(f"only {n_units} colocation units for {n_dev} devices; some stay empty")
        return rules, notes

    def _one_device(
        self, problem: PartitionProblem, rules: _Rules, evaluate: _Evaluate, t0: float
    ) -> SolverResult:
        """One device: every layer on it (optimal), if it fits."""
        dev = (0,) * problem.num_layers
        reason = rules.violation(problem, dev)
        if reason is not None:
            raise InfeasibleError(memory_infeasible_message(problem, f"solver 'ilp': {reason}"))
        value = evaluate(problem, dev)
        return SolverResult(
            solver=self.name,
            assignment=dev,
            status=SolveStatus.OPTIMAL,
            objective=value,
            solve_time_s=time.perf_counter() - t0,
            notes=("one device: every layer on device 0",),
            best_bound=value,
        )

    def _search(
        self,
        problem: PartitionProblem,
        rules: _Rules,
        warm: tuple[int, ...] | None,
        t0: float,
    ) -> _CpOutcome:
        """Run CP-SAT in the time left; raise when it proves infeasibility or rejects the model."""
        outcome = _run_cp_sat(
            _CpRequest(
                problem=problem,
                rules=rules,
                warm=warm,
                objective=self.objective,
                seed=self.seed,
                # the warm-start heuristics spent part of the budget
                time_limit_s=max(_MIN_SEARCH_S, self.time_limit_s - (time.perf_counter() - t0)),
                num_workers=self.num_workers,
            )
        )
        logger.debug(
            "ilp: CP-SAT %s in %.3f s (%s objective, %d layers, %d devices)",
            outcome.status,
            outcome.wall_time_s,
            self.objective,
            problem.num_layers,
            problem.num_devices,
        )
        if outcome.status == "INFEASIBLE":
            raise InfeasibleError(memory_infeasible_message(problem, _infeasible_prefix(rules)))
        if outcome.status == "MODEL_INVALID":  # pragma: no cover - a bug in the model
            raise SolverError(
                f"solver 'ilp': CP-SAT rejected the model ({outcome.detail}); report this bug"
            )
        return outcome

    def _warm_fallback(
        self, outcome: _CpOutcome, warm: _WarmStart, notes: list[str], t0: float
    ) -> SolverResult:
        """CP-SAT found nothing in time: the warm start, or an error when there is none."""
        hint, source, value = warm
        if hint is None:
            raise SolverError(
                f"solver 'ilp' found no placement within time_limit_s={self.time_limit_s:g} "
                "and no heuristic placement satisfies the constraints; raise the time limit"
            )
        notes.append(
            f"time limit {self.time_limit_s:g} s reached before CP-SAT found a placement; "
            f"returned the warm start ({source})"
        )
        return self._warm_result(hint, value, notes, t0, _clamp_bound(outcome.bound_s, value))

    def _warm_result(
        self,
        hint: tuple[int, ...],
        value: float,
        notes: list[str],
        t0: float,
        best_bound: float | None = None,
    ) -> SolverResult:
        """The warm start returned as the solver's (feasible) result."""
        return SolverResult(
            solver=self.name,
            assignment=hint,
            status=SolveStatus.FEASIBLE,
            objective=value,
            solve_time_s=time.perf_counter() - t0,
            notes=tuple(notes),
            best_bound=best_bound,
        )

    def _too_large(
        self, warm: _WarmStart, notes: list[str], t0: float, build_s: float, left_s: float
    ) -> SolverResult:
        """The model would take longer to build than the time left: the warm start, unsearched
        (or an error when there is none), so that the solver stays within ``time_limit_s``."""
        hint, source, value = warm
        too_long = (
            f"time limit {self.time_limit_s:g} s reached before the model was built: building "
            f"it would take ~{build_s:.3g} s, more than the {max(0.0, left_s):.3g} s left"
        )
        if hint is None:
            raise SolverError(
                f"solver 'ilp': {too_long}, and no heuristic placement satisfies the "
                "constraints; raise time_limit_s or use a fast solver"
            )
        notes.append(f"{too_long}; CP-SAT not run, returned the warm start ({source})")
        logger.info("ilp: %s", notes[-1])
        return self._warm_result(hint, value, notes, t0)

    def _searched(
        self,
        problem: PartitionProblem,
        outcome: _CpOutcome,
        dev: tuple[int, ...],
        warm: _WarmStart,
        notes: list[str],
        t0: float,
    ) -> SolverResult:
        """CP-SAT's placement ``dev`` retimed in exact seconds (or the warm start when that is
        better), with its bound and a note on optimality or the gap."""
        step = self.objective == "step"
        if step:
            value = _retimed_makespan_s(problem, dev, outcome.starts)
        else:
            value = throughput_objective_s(problem, dev)
        hint, source, hint_value = warm
        if hint is not None and hint_value < value:
            notes.append(
                f"kept the warm start ({source}): {hint_value:.6g} s beats CP-SAT's "
                f"{value:.6g} s after time rounding"
            )
            dev, value = hint, hint_value
        bound = _clamp_bound(outcome.bound_s, value)
        relaxed = not step and _shared_host_channels(problem) is None
        proved = outcome.status == "OPTIMAL" and not relaxed
        notes.append(self._optimality_note(outcome, value, bound, relaxed, proved))
        logger.info(
            "ilp: %s objective %.6g s, bound %s s (%s)",
            self.objective,
            value,
            "none" if bound is None else f"{bound:.6g}",
            outcome.status,
        )
        return SolverResult(
            solver=self.name,
            assignment=dev,
            status=SolveStatus.OPTIMAL if proved else SolveStatus.FEASIBLE,
            objective=value,
            solve_time_s=time.perf_counter() - t0,
            notes=tuple(notes),
            best_bound=bound,
        )

    def _optimality_note(
        self,
        outcome: _CpOutcome,
        value: float,
        bound: float | None,
        relaxed: bool,
        proved: bool,
    ) -> str:
        """Proved optimal, optimal for a relaxation, or stopped at the time limit: with the gap."""
        if proved:
            return "proved optimal by CP-SAT"
        gap = (
            f"gap {max(0.0, (value - bound) / value) if value > 0 else 0.0:.1%}"
            if bound is not None
            else "no lower bound proved"
        )
        if relaxed and outcome.status == "OPTIMAL":
            return (
                "optimal for the device loads; host channels not modelled (a per-pair link "
                f"crosses hosts); {gap}"
            )
        return f"time limit {self.time_limit_s:g} s reached; {gap}"

    # ---------------------------------------------------------------------------------------

    def _warm_start(
        self,
        problem: PartitionProblem,
        rules: _Rules,
        evaluate: _Evaluate,
        notes: list[str],
    ) -> _WarmStart:
        """The hint: ``warm_start`` if feasible, else the best feasible heuristic placement."""
        n_dev = problem.num_devices
        if self.warm_start is not None:
            given = checked_assignment(self.warm_start, problem)
            reason = rules.violation(problem, given)
            if reason is None:
                hint = rules.normalise(given, n_dev)
                value = evaluate(problem, hint)
                notes.append(f"warm start: given warm_start ({value:.6g} s)")
                return hint, "given warm_start", value
            notes.append(f"warm_start ignored: {reason}")
            logger.info("ilp: warm_start ignored: %s", reason)

        best: _WarmStart = (None, "", math.inf)
        for heuristic in (
            MetisSolver(seed=self.seed),
            EvenSolver(),
            RoundRobinSolver(),
            SingleSolver(),
        ):
            try:
                raw = heuristic.solve(problem).assignment
            except PartitionError as exc:
                logger.debug("ilp: warm start %s skipped: %s", heuristic.name, exc)
                continue
            cand = rules.normalise(raw, n_dev)
            if rules.violation(problem, cand) is not None:
                continue
            value = evaluate(problem, cand)
            if value < best[2]:
                best = (cand, heuristic.name, value)
        if best[0] is not None:
            notes.append(f"warm start: {best[1]} ({best[2]:.6g} s)")
        return best


def _parse_warm_start(value: object) -> tuple[int, ...] | None:
    """``None``, a sequence of ints, or a comma-separated string (from the command line)."""
    if value is None:
        return None
    items: Sequence[object]
    if isinstance(value, str):
        items = [p for p in value.replace(" ", "").split(",") if p]
    elif isinstance(value, (list, tuple)):
        items = value
    else:
        raise SolverError(
            f"solver 'ilp' option warm_start={value!r} must be device indices, e.g. 0,0,1,1"
        )
    out: list[int] = []
    for item in items:
        try:
            d = int(item) if isinstance(item, (int, str)) and not isinstance(item, bool) else -1
        except ValueError:
            d = -1
        if d < 0:
            raise SolverError(
                f"solver 'ilp' option warm_start={value!r} must be device indices >= 0, "
                "e.g. 0,0,1,1"
            )
        out.append(d)
    return tuple(out)


def _clamp_bound(bound_s: float | None, objective_s: float) -> float | None:
    """A proven bound in seconds, at most ``objective_s``; None when it proves nothing."""
    if bound_s is None or not math.isfinite(bound_s) or bound_s <= 0:
        return None
    return min(objective_s, bound_s)


def _check_layers_fit(problem: PartitionProblem) -> None:
    limit = max(d.memory_bytes for d in problem.topology.devices)
    if max(problem.memory_bytes) > limit or sum(problem.memory_bytes) > sum(
        d.memory_bytes for d in problem.topology.devices
    ):
        raise InfeasibleError(memory_infeasible_message(problem, "solver 'ilp'"))


def _infeasible_prefix(rules: _Rules) -> str:
    extra = []
    if any(k != r for k, r in enumerate(rules.roots)):
        extra.append("colocation groups")
    if rules.acyclic:
        extra.append("stage order (acyclic)")
    if rules.require_nonempty:
        extra.append("every device used")
    tail = f" with {', '.join(extra)}" if extra else ""
    return f"solver 'ilp' proved no placement fits device memory{tail}"


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Built:
    x: list[list[cp_model.IntVar]]
    starts: list[cp_model.IntVar]
    ticks_per_s: float


def _ticks(seconds: float, ticks_per_s: float) -> int:
    return math.floor(seconds * ticks_per_s)


def _common(
    problem: PartitionProblem, rules: _Rules, warm: tuple[int, ...] | None
) -> tuple[cp_model.CpModel, list[list[cp_model.IntVar]]]:
    """Blocks 1-5 of the module docstring: assignment, memory, colocation, order, symmetry."""
    n, n_dev = problem.num_layers, problem.num_devices
    from ortools.sat.python import cp_model

    model = cp_model.CpModel()
    # 1. one device per layer
    x = [[model.new_bool_var(f"x[{k},{d}]") for d in range(n_dev)] for k in range(n)]
    for k in range(n):
        model.add_exactly_one(x[k])
    # 2. memory
    total = sum(problem.memory_bytes)
    for d, device in enumerate(problem.topology.devices):
        if total > device.memory_bytes:
            model.add(
                sum(problem.memory_bytes[k] * x[k][d] for k in range(n) if problem.memory_bytes[k])
                <= device.memory_bytes
            )
    # 3. colocation
    for k, r in enumerate(rules.roots):
        if k != r:
            for d in range(n_dev):
                model.add(x[k][d] == x[r][d])
    # 4. stage order
    if rules.acyclic:
        for a, b, _ in problem.edges:
            model.add(
                sum(d * x[a][d] for d in range(1, n_dev))
                <= sum(d * x[b][d] for d in range(1, n_dev))
            )
    # 5. symmetry break for identical devices: layer k on a device <= k
    if rules.symmetric:
        for k in range(min(n, n_dev)):
            for d in range(k + 1, n_dev):
                model.add(x[k][d] == 0)
    if warm is not None:
        for k in range(n):
            for d in range(n_dev):
                model.add_hint(x[k][d], warm[k] == d)
    return model, x


@dataclass(frozen=True)
class _Classes:
    """The link classes of every device (see the module docstring), with each edge's transfer
    ticks per class: ``ticks[e][d][i]`` for class ``i`` of device ``d``."""

    members: tuple[tuple[tuple[int, ...], ...], ...]
    ticks: tuple[tuple[tuple[int, ...], ...], ...]
    single: bool
    """Every device has one class holding all the others (a uniform topology)."""


def _classes(problem: PartitionProblem, ticks_per_s: float) -> _Classes:
    classes = link_classes(link_matrix(problem.topology))
    members = tuple(tuple(m for _, m in per_dev) for per_dev in classes)
    ticks = tuple(
        tuple(
            tuple(_ticks(link.transfer_time_s(nbytes), ticks_per_s) for link, _ in per_dev)
            for per_dev in classes
        )
        for _, _, nbytes in problem.edges
    )
    n_dev = problem.num_devices
    single = all(len(m) == 1 and len(m[0]) == n_dev - 1 for m in members)
    return _Classes(members=members, ticks=ticks, single=single)


def _pair_ticks(cls: _Classes, e: int, src: int, dst: int) -> int:
    if src == dst:
        return 0
    for i, members in enumerate(cls.members[src]):
        if dst in members:
            return cls.ticks[e][src][i]
    return 0  # pragma: no cover - every other device is in some class


def _in_class(
    x: list[list[cp_model.IntVar]], v: int, d: int, members: tuple[int, ...], n_dev: int
) -> cp_model.LinearExpr:
    """``x[v, C]``: 1 when layer ``v`` sits on a device of class ``members`` of device ``d``."""
    from ortools.sat.python import cp_model

    if len(members) == n_dev - 1:
        return 1 - x[v][d]
    return cp_model.LinearExpr.sum([x[v][j] for j in members])


def _upper_comm_s(problem: PartitionProblem) -> float:
    """Every edge over the slowest link: an upper bound of any transfer total."""
    return sum(edge_transfer_times_s(problem))


def _build_throughput(
    problem: PartitionProblem,
    rules: _Rules,
    warm: tuple[int, ...] | None,
) -> tuple[cp_model.CpModel, _Built]:
    """The throughput model: blocks 1-5, then 6-9 of the module docstring."""
    n, n_dev = problem.num_layers, problem.num_devices
    upper = max(sum(row) for row in problem.compute_time_s) + 2 * _upper_comm_s(problem)
    ticks_per_s = _TICKS_PER_UPPER_BOUND / upper if upper > 0 else 1.0
    t = [[_ticks(v, ticks_per_s) for v in row] for row in problem.compute_time_s]
    cls = _classes(problem, ticks_per_s)
    horizon = max(sum(row) for row in t) + 2 * sum(
        max((max(per_dev, default=0) for per_dev in per_edge), default=0) for per_edge in cls.ticks
    )

    model, x = _common(problem, rules, warm)
    cut_terms = _add_cut_edges(model, x, problem, cls, warm)
    # 7. every device holds a layer
    if rules.require_nonempty:
        for d in range(n_dev):
            model.add(sum(x[k][d] for k in range(n)) >= 1)
    # 8. T >= load of every device; minimise T
    stage = model.new_int_var(0, horizon, "T")
    for d in range(n_dev):
        model.add(
            stage
            >= sum(t[d][k] * x[k][d] for k in range(n) if t[d][k])
            + sum(ce * z for ce, z in cut_terms[d])
        )
    _add_host_channels(model, x, stage, problem, ticks_per_s, warm)
    model.minimize(stage)
    if warm is not None:
        model.add_hint(stage, _ticks_throughput(problem, t, cls, warm, ticks_per_s))
    return model, _Built(x=x, starts=[], ticks_per_s=ticks_per_s)


def _add_cut_edges(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    problem: PartitionProblem,
    cls: _Classes,
    warm: tuple[int, ...] | None,
) -> list[list[tuple[int, cp_model.IntVar]]]:
    """Block 6: ``z[e, d, C]``, edge ``e`` cut with one end on ``d`` and the other in ``d``'s
    link class ``C``; returns each device's ``(ticks, z)`` load terms."""
    n_dev = problem.num_devices
    cut_terms: list[list[tuple[int, cp_model.IntVar]]] = [[] for _ in range(n_dev)]
    for i, (a, b, _) in enumerate(problem.edges):
        for d in range(n_dev):
            for members, ce in zip(cls.members[d], cls.ticks[i][d], strict=True):
                if ce <= 0:
                    continue
                z = model.new_bool_var(f"z[{i},{d},{members[0]}]")
                model.add(z >= x[a][d] + _in_class(x, b, d, members, n_dev) - 1)
                model.add(z >= x[b][d] + _in_class(x, a, d, members, n_dev) - 1)
                cut_terms[d].append((ce, z))
                if warm is not None:
                    model.add_hint(
                        z,
                        (warm[a] == d and warm[b] in members)
                        or (warm[b] == d and warm[a] in members),
                    )
    return cut_terms


def _add_host_channels(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    stage: cp_model.IntVar,
    problem: PartitionProblem,
    ticks_per_s: float,
    warm: tuple[int, ...] | None,
) -> None:
    """Block 9: ``T >=`` the load of every host-to-host channel (when hosts share one)."""
    hosts = _shared_host_channels(problem)
    inter = problem.topology.inter_host_link
    if not hosts or inter is None:
        return
    from ortools.sat.python import cp_model as cpm

    on = [
        [cpm.LinearExpr.sum([x[v][d] for d in members]) for members in hosts]
        for v in range(problem.num_layers)
    ]
    host_of = {d: h for h, members in enumerate(hosts) for d in members}
    for h in range(len(hosts)):
        for g in range(h + 1, len(hosts)):
            terms: list[tuple[int, cp_model.IntVar]] = []
            for i, (a, b, nbytes) in enumerate(problem.edges):
                ce = _ticks(inter.transfer_time_s(nbytes), ticks_per_s)
                if ce <= 0:
                    continue
                w = model.new_bool_var(f"w[{i},{h},{g}]")
                model.add(w >= on[a][h] + on[b][g] - 1)
                model.add(w >= on[a][g] + on[b][h] - 1)
                terms.append((ce, w))
                if warm is not None:
                    model.add_hint(w, {host_of[warm[a]], host_of[warm[b]]} == {h, g})
            if terms:
                model.add(stage >= sum(ce * w for ce, w in terms))


def _ticks_throughput(
    problem: PartitionProblem,
    t: list[list[int]],
    cls: _Classes,
    dev: Sequence[int],
    ticks_per_s: float,
) -> int:
    loads = [0] * problem.num_devices
    for k, d in enumerate(dev):
        loads[d] += t[d][k]
    channels: dict[tuple[int, int], int] = {}
    hosts = _shared_host_channels(problem)
    inter = problem.topology.inter_host_link
    devices = problem.topology.devices
    for i, (a, b, nbytes) in enumerate(problem.edges):
        if dev[a] != dev[b]:
            loads[dev[a]] += _pair_ticks(cls, i, dev[a], dev[b])
            loads[dev[b]] += _pair_ticks(cls, i, dev[b], dev[a])
            ha, hb = devices[dev[a]].host, devices[dev[b]].host
            if hosts and inter is not None and ha != hb:
                key = (min(ha, hb), max(ha, hb))
                ce = _ticks(inter.transfer_time_s(nbytes), ticks_per_s)
                channels[key] = channels.get(key, 0) + ce
    return max(max(loads), max(channels.values(), default=0))


def _build_step(
    problem: PartitionProblem,
    rules: _Rules,
    warm: tuple[int, ...] | None,
) -> tuple[cp_model.CpModel, _Built]:
    """The step model: blocks 1-5, then the step objective's 6-9 of the module docstring."""
    n = problem.num_layers
    upper = sum(max(row[k] for row in problem.compute_time_s) for k in range(n)) + _upper_comm_s(
        problem
    )
    ticks_per_s = _TICKS_PER_UPPER_BOUND / upper if upper > 0 else 1.0
    t = [[_ticks(v, ticks_per_s) for v in row] for row in problem.compute_time_s]
    cls = _classes(problem, ticks_per_s)
    worst = [
        max((max(per_dev, default=0) for per_dev in per_edge), default=0) for per_edge in cls.ticks
    ]
    horizon = sum(max(row[k] for row in t) for k in range(n)) + sum(worst)

    model, x = _common(problem, rules, warm)
    starts, ends = _add_layer_runs(model, x, t, horizon)
    cuts = _add_precedence(model, x, starts, ends, problem, cls, worst)
    # 9. makespan
    has_successor = {a for a, _, _ in problem.edges}
    makespan = model.new_int_var(0, horizon, "S")
    for k in range(n):
        if k not in has_successor:
            model.add(makespan >= ends[k])
    model.minimize(makespan)
    if warm is not None:
        _hint_step(model, problem, t, cls, warm, starts, ends, cuts, makespan)
    return model, _Built(x=x, starts=starts, ticks_per_s=ticks_per_s)


def _add_layer_runs(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    t: list[list[int]],
    horizon: int,
) -> tuple[list[cp_model.IntVar], list[cp_model.IntVar]]:
    """Blocks 6-7 of the step model: each layer's start and end, one layer at a time per device."""
    n_dev, n = len(t), len(x)
    starts = [model.new_int_var(0, horizon, f"s[{k}]") for k in range(n)]
    ends = [model.new_int_var(0, horizon, f"f[{k}]") for k in range(n)]
    for k in range(n):
        model.add(ends[k] == starts[k] + sum(t[d][k] * x[k][d] for d in range(n_dev)))
    for d in range(n_dev):
        model.add_no_overlap(
            [
                model.new_optional_fixed_size_interval_var(
                    starts[k], t[d][k], x[k][d], f"run[{k},{d}]"
                )
                for k in range(n)
            ]
        )
    return starts, ends


def _add_precedence(
    model: cp_model.CpModel,
    x: list[list[cp_model.IntVar]],
    starts: list[cp_model.IntVar],
    ends: list[cp_model.IntVar],
    problem: PartitionProblem,
    cls: _Classes,
    worst: list[int],
) -> list[tuple[int, cp_model.IntVar]]:
    """Block 8 of the step model: precedence, with the transfer time on a cut edge (over the
    pair's link); returns the ``(edge, cut)`` variables of the one-class form."""
    n_dev = problem.num_devices
    cuts: list[tuple[int, cp_model.IntVar]] = []
    for i, (a, b, _) in enumerate(problem.edges):
        if worst[i] <= 0:
            model.add(starts[b] >= ends[a])
            continue
        if cls.single:
            ce = cls.ticks[i][0][0]
            cut = model.new_bool_var(f"cut[{i}]")
            for d in range(n_dev):
                model.add(cut >= x[a][d] - x[b][d])
            model.add(starts[b] >= ends[a] + ce * cut)
            cuts.append((i, cut))
            continue
        model.add(starts[b] >= ends[a])
        for d in range(n_dev):
            for members, ce in zip(cls.members[d], cls.ticks[i][d], strict=True):
                if ce > 0:
                    model.add(
                        starts[b]
                        >= ends[a] + ce * (x[a][d] + _in_class(x, b, d, members, n_dev) - 1)
                    )
    return cuts


def _hint_step(
    model: cp_model.CpModel,
    problem: PartitionProblem,
    t: list[list[int]],
    cls: _Classes,
    warm: tuple[int, ...],
    starts: list[cp_model.IntVar],
    ends: list[cp_model.IntVar],
    cuts: list[tuple[int, cp_model.IntVar]],
    makespan: cp_model.IntVar,
) -> None:
    """Hint the step model with the list schedule of the warm start, in layer order."""
    n = problem.num_layers

    def comm_ticks(e: int, src: int, dst: int) -> float:
        return float(_pair_ticks(cls, e, src, dst))

    start = _list_schedule(t, problem.edges, comm_ticks, warm, range(n))
    for k in range(n):
        s = round(start[k])
        model.add_hint(starts[k], s)
        model.add_hint(ends[k], s + t[warm[k]][k])
    for i, cut in cuts:
        a, b, _ = problem.edges[i]
        model.add_hint(cut, warm[a] != warm[b])
    model.add_hint(makespan, max(round(start[k]) + t[warm[k]][k] for k in range(n)))


def _retimed_makespan_s(
    problem: PartitionProblem, dev: Sequence[int], starts: Sequence[int]
) -> float:
    """Exact-seconds makespan of CP-SAT's schedule: its order per device, re-timed as early as
    possible with the true durations and transfer times."""
    order = sorted(range(len(dev)), key=lambda k: (starts[k], k))
    comm = edge_pair_times_s(problem)
    start = _list_schedule(problem.compute_time_s, problem.edges, comm, dev, order)
    return max(s + problem.compute_time_s[d][k] for k, (s, d) in enumerate(zip(start, dev)))


# --------------------------------------------------------------------------------------------
# Running CP-SAT: in this process, or in a worker process when TensorFlow was loaded first
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CpRequest:
    problem: PartitionProblem
    rules: _Rules
    warm: tuple[int, ...] | None
    objective: str
    seed: int
    time_limit_s: float
    num_workers: int


@dataclass(frozen=True)
class _CpOutcome:
    status: str
    """CP-SAT's status name: OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN or MODEL_INVALID."""
    assignment: tuple[int, ...] | None
    starts: tuple[int, ...]
    """Start ticks of the step schedule (empty for the throughput objective)."""
    bound_s: float | None
    wall_time_s: float
    detail: str = ""


def cp_sat_in_worker_process() -> bool:
    """Whether CP-SAT runs in a worker process (TensorFlow was imported before this module)."""
    return not _IN_PROCESS


def _run_cp_sat(request: _CpRequest) -> _CpOutcome:
    if _IN_PROCESS:
        return _solve_cp_sat_here(request, ctrl_c_interrupts=True)
    return _WORKER.call(request)


@contextlib.contextmanager
def _ctrl_c_stops_search(solver: cp_model.CpSolver) -> Iterator[None]:
    """Ctrl-C during ``solver.solve`` stops the search at once and raises KeyboardInterrupt.

    CP-SAT's own SIGINT handler (``catch_sigint_signal``) ends the search and returns its best
    assignment as if the time had run out, so a Ctrl-C was swallowed and the plan written. Here
    that handler is off; Python's own handler stays, and its wakeup byte (``set_wakeup_fd``,
    written by the C-level handler while ``solve`` holds the main thread) lets a watcher thread
    call ``stop_search``. Python raises KeyboardInterrupt when ``solve`` returns."""
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only: it is not blocked in this solve
        return
    receiver, sender = socket.socketpair()
    sender.setblocking(False)
    previous = signal.set_wakeup_fd(sender.fileno(), warn_on_full_buffer=False)
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            if select.select([receiver], [], [], 0.05)[0]:
                data = receiver.recv(64)
                if previous != -1:
                    with contextlib.suppress(OSError):
                        os.write(previous, data)  # the wakeup fd we borrowed still hears it
                if signal.SIGINT in data:
                    solver.stop_search()
                    return

    watcher = threading.Thread(target=watch, name="cp-sat-ctrl-c", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        signal.set_wakeup_fd(previous)
        watcher.join()
        receiver.close()
        sender.close()


def _solve_cp_sat_here(request: _CpRequest, *, ctrl_c_interrupts: bool = False) -> _CpOutcome:
    """Build and solve the model of ``request`` with CP-SAT in this process; with
    ``ctrl_c_interrupts`` a Ctrl-C stops it and raises (:func:`_ctrl_c_stops_search`)."""
    from ortools.sat.python import cp_model

    problem = request.problem
    if request.objective == "step":
        model, build = _build_step(problem, request.rules, request.warm)
    else:
        model, build = _build_throughput(problem, request.rules, request.warm)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = request.time_limit_s
    solver.parameters.num_workers = request.num_workers
    solver.parameters.random_seed = request.seed
    solver.parameters.log_search_progress = False
    with _ctrl_c_stops_search(solver) if ctrl_c_interrupts else contextlib.nullcontext():
        status = solver.solve(model)
    assignment: tuple[int, ...] | None = None
    starts: tuple[int, ...] = ()
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assignment = tuple(
            next(d for d in range(problem.num_devices) if solver.boolean_value(row[d]))
            for row in build.x
        )
        starts = tuple(int(solver.value(v)) for v in build.starts)
    bound = solver.best_objective_bound
    return _CpOutcome(
        status=solver.status_name(status),
        assignment=assignment,
        starts=starts,
        bound_s=bound / build.ticks_per_s if math.isfinite(bound) else None,
        wall_time_s=float(solver.wall_time),
        detail=model.validate() if status == cp_model.MODEL_INVALID else "",
    )


_WORKER_COMMAND = (
    f"import {_ORTOOLS_MODULE}; from partitioner.solvers.ilp import _worker_main; _worker_main()"
)


def _send(stream: IO[bytes], payload: object) -> None:
    data = pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "little") + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> object | None:
    """The next message, or None at end of stream."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    size = int.from_bytes(head, "little")
    data = stream.read(size)
    if len(data) < size:
        return None
    message: object = pickle.loads(data)
    return message


class _Worker:
    """One long-lived child process that runs CP-SAT for this process, started on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        logger.info(
            "ilp: TensorFlow was imported before OR-Tools; running CP-SAT in a worker process"
        )
        return subprocess.Popen(
            [sys.executable, "-P", "-c", _WORKER_COMMAND],  # -P: not the cwd's modules (34am)
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )

    def call(self, request: _CpRequest) -> _CpOutcome:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            proc = self._proc
            assert proc.stdin is not None and proc.stdout is not None
            try:
                _send(proc.stdin, request)
                reply = _receive(proc.stdout)
            except (BrokenPipeError, OSError):
                reply = None
            if reply is None:
                code = proc.wait()
                self._proc = None
                raise SolverError(
                    f"solver 'ilp': the CP-SAT worker process exited with code {code}; "
                    "import partitioner before tensorflow to run CP-SAT in this process"
                )
            if isinstance(reply, BaseException):
                raise reply
            if not isinstance(reply, _CpOutcome):  # pragma: no cover - protocol bug
                raise SolverError(f"solver 'ilp': bad reply {type(reply)!r} from the CP-SAT worker")
            return reply

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hung solver
            proc.kill()
            proc.wait()


_WORKER = _Worker()
atexit.register(_WORKER.close)


def _worker_main() -> None:  # pragma: no cover - runs in the worker process
    """Serve CP-SAT requests from stdin until it closes; replies go to the original stdout,
    and file descriptor 1 is pointed at stderr so that stray native output cannot corrupt them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns Ctrl-C (and this process)
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    while True:
        request = _receive(requests)
        if request is None:
            return
        reply: object
        try:
            if not isinstance(request, _CpRequest):
                raise SolverError(f"solver 'ilp' worker: bad request {type(request)!r}")
            reply = _solve_cp_sat_here(request)
        except Exception as exc:
            reply = (
                exc
                if isinstance(exc, PartitionError)
                else SolverError(f"solver 'ilp' worker failed: {type(exc).__name__}: {exc}")
            )
        _send(replies, reply)
