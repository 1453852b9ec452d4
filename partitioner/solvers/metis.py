"""METIS k-way partitioning of the layer graph.

Formulation: the layers are the vertices of an undirected graph; an edge joins two layers that
exchange tensors, weighted by the bytes they exchange (forward + backward, parallel edges merged,
no self loops). Each vertex is weighted by the layer's mean compute time over the devices. METIS
splits the vertices into ``k = num_devices`` parts of (nearly) equal vertex weight while
minimising the weight of the cut edges, i.e. it balances compute and minimises cross-device
traffic. On heterogeneous devices, part ``d`` gets a target weight proportional to the speed of
device ``d`` (the inverse of the model's total time on it).

Weights are scaled to integers in ``[1, 10**6]``. The result is then post-processed: every empty
device gets one layer (:func:`~partitioner.solvers.base.fill_empty_devices`) and layers are moved
off devices whose memory they exceed (:func:`~partitioner.solvers.base.repair_memory`).

Reference: G. Karypis and V. Kumar, "A Fast and High Quality Multilevel Scheme for Partitioning
Irregular Graphs", SIAM J. Sci. Comput. 20(1), 359-392, 1998. Via ``pymetis.part_graph``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import pymetis

from partitioner.errors import SolverError
from partitioner.ir import PartitionProblem, SolverResult, SolveStatus
from partitioner.solvers.base import (
    SolverOptions,
    fill_empty_devices,
    max_load_s,
    repair_memory,
    validate_problem_for,
)

__all__ = ["MetisSolver", "scale_weights"]

logger = logging.getLogger(__name__)

_MAX_WEIGHT = 10**6


def scale_weights(values: Sequence[float]) -> list[int]:
    """Scale non-negative ``values`` to integers in ``[1, 10**6]`` (largest -> 10**6)."""
    top = max(values, default=0.0)
    if top <= 0:
        return [1] * len(values)
    return [max(1, min(_MAX_WEIGHT, round(v / top * _MAX_WEIGHT))) for v in values]


@dataclass(frozen=True)
class MetisSolver(SolverOptions):
    """METIS k-way partitioning of the layer graph, then empty-device fill and memory repair."""

    name: ClassVar[str] = "metis"
    description: ClassVar[str] = (
        "METIS k-way graph partitioning: balance compute, minimise bytes cut (Karypis & Kumar 1998)"
    )

    def solve(self, problem: PartitionProblem) -> SolverResult:
        validate_problem_for(problem)
        n, k = problem.num_layers, problem.num_devices
        if k == 1:
            raw: tuple[int, ...] = (0,) * n
        else:
            raw = self._part_graph(problem)
        filled = fill_empty_devices(raw, problem)
        repaired = repair_memory(filled, problem)
        final = _first_seen_order(fill_empty_devices(repaired, problem, strict_memory=True), problem)
        notes: list[str] = []
        moved_fill = sum(a != b for a, b in zip(raw, filled, strict=True))
        moved_mem = sum(a != b for a, b in zip(filled, repaired, strict=True))
        if moved_fill:
            notes.append(f"moved {moved_fill} layer(s) onto empty devices")
        if moved_mem:
            notes.append(f"moved {moved_mem} layer(s) to fit device memory")
        return SolverResult(
            solver=self.name,
            assignment=final,
            status=SolveStatus.HEURISTIC,
            objective=max_load_s(final, problem),
            notes=tuple(notes),
        )

    def _part_graph(self, problem: PartitionProblem) -> tuple[int, ...]:
        n, k = problem.num_layers, problem.num_devices
        mean_time = [sum(row[i] for row in problem.compute_time_s) / k for i in range(n)]
        vweights = scale_weights(mean_time)

        merged: dict[tuple[int, int], int] = {}
        for a, b, nbytes in problem.edges:
            if a == b:
                continue
            key = (min(a, b), max(a, b))
            merged[key] = merged.get(key, 0) + nbytes
        pairs = sorted(merged)
        scaled = scale_weights([float(merged[p]) for p in pairs])
        neighbours: list[list[tuple[int, int]]] = [[] for _ in range(n)]
        for (a, b), w in zip(pairs, scaled, strict=True):
            neighbours[a].append((b, w))
            neighbours[b].append((a, w))
        adj_starts = [0]
        adjacent: list[int] = []
        eweights: list[int] = []
        for row in neighbours:
            for v, w in row:
                adjacent.append(v)
                eweights.append(w)
            adj_starts.append(len(adjacent))

        totals = [sum(row) for row in problem.compute_time_s]
        tpwgts: list[float] | None = None
        if len(set(totals)) > 1 and all(t > 0 for t in totals):
            speed = [1.0 / t for t in totals]
            s = sum(speed)
            tpwgts = [x / s for x in speed[:-1]]
            tpwgts.append(1.0 - sum(tpwgts))

        try:
            part = pymetis.part_graph(
                k,
                pymetis.CSRAdjacency(adj_starts, adjacent),
                vweights=vweights,
                eweights=eweights if eweights else None,
                tpwgts=tpwgts,
                options=pymetis.Options(seed=self.seed),
            )
        except (RuntimeError, ValueError, TypeError) as exc:
            raise SolverError(f"METIS failed on {n} layers / {k} devices: {exc}") from exc
        assignment = tuple(int(p) for p in part.vertex_part)
        logger.debug("metis: edge cut %s, parts %s", part.edge_cuts, assignment)
        return assignment


def _first_seen_order(assignment: tuple[int, ...], problem: PartitionProblem) -> tuple[int, ...]:
    """Renumber the parts of identical devices in the order the layers reach them.

    METIS's part numbers are arbitrary; numbering them by first use puts the input layers on
    device 0 and reads naturally. Only done when every device is the same, so that no layer
    moves to a device of another type or memory size.
    """
    kinds = {(d.device_type, d.memory_bytes) for d in problem.topology.devices}
    if len(kinds) > 1 or len(set(problem.compute_time_s)) > 1:
        return assignment
    order: dict[int, int] = {}
    for d in assignment:
        order.setdefault(d, len(order))
    for d in range(problem.num_devices):
        order.setdefault(d, len(order))
    return tuple(order[d] for d in assignment)
