"""METIS k-way partitioning of the layer graph.

Formulation: the layers are the vertices of an undirected graph; an edge joins two layers that
exchange tensors, weighted by the bytes they exchange (forward + backward, parallel edges merged,
no self loops). Each vertex is weighted by the layer's mean compute time over the devices. METIS
splits the vertices into ``k = num_devices`` parts of (nearly) equal vertex weight while
minimising the weight of the cut edges, i.e. it balances compute and minimises cross-device
traffic. On heterogeneous devices, part ``d`` gets a target weight proportional to the speed of
device ``d`` (the inverse of the model's total time on it).

On a topology of several hosts the partition is hierarchical, because the links between hosts
are the slowest: the layers are first split into one part per host (target weights proportional
to the host's summed device speed), minimising the bytes that cross hosts, then each host's
layers are split among its devices the same way. Bytes cut between hosts are thus minimised
first, bytes cut within a host second.

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

from partitioner.core.errors import SolverError
from partitioner.core.ir import PartitionProblem, SolverResult, SolveStatus
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
        "METIS k-way partition of the layer graph (compute balanced, cut bytes minimised) + "
        "memory repair"
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
        final = _first_seen_order(
            fill_empty_devices(repaired, problem, strict_memory=True), problem
        )
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
        merged: dict[tuple[int, int], int] = {}
        for a, b, nbytes in problem.edges:
            if a == b:
                continue
            key = (min(a, b), max(a, b))
            merged[key] = merged.get(key, 0) + nbytes
        totals = [sum(row) for row in problem.compute_time_s]
        speed = [1.0 / t if t > 0 else 1.0 for t in totals]

        hosts: dict[int, list[int]] = {}
        for device in problem.topology.devices:
            hosts.setdefault(device.host, []).append(device.index)
        groups = list(hosts.values())
        if len(groups) <= 1 or len(groups) == k:
            part = self._metis(list(range(n)), mean_time, merged, speed, list(range(k)))
            assignment = tuple(part)
        else:
            # Level 1: layers to hosts; level 2: each host's layers to its devices.
            host_speed = [sum(speed[d] for d in members) for members in groups]
            to_host = self._metis(
                list(range(n)), mean_time, merged, host_speed, list(range(len(groups)))
            )
            result = [0] * n
            for h, members in enumerate(groups):
                layers = [i for i in range(n) if to_host[i] == h]
                if not layers:
                    continue
                inner = self._metis(layers, mean_time, merged, [speed[d] for d in members], members)
                for i, dev in zip(layers, inner, strict=True):
                    result[i] = dev
            assignment = tuple(result)
        logger.debug("metis: parts %s", assignment)
        return assignment

    def _metis(
        self,
        layers: list[int],
        weights: list[float],
        merged: dict[tuple[int, int], int],
        part_speed: list[float],
        labels: list[int],
    ) -> list[int]:
        """Split ``layers`` (the induced subgraph) into ``len(labels)`` parts of target weight
        proportional to ``part_speed``; returns the label of every layer."""
        k = len(labels)
        if k == 1:
            return [labels[0]] * len(layers)
        if len(layers) <= k:
            return [labels[i] for i in range(len(layers))]
        local = {layer: i for i, layer in enumerate(layers)}
        vweights = scale_weights([weights[layer] for layer in layers])
        pairs = sorted(p for p in merged if p[0] in local and p[1] in local)
        scaled = scale_weights([float(merged[p]) for p in pairs])
        neighbours: list[list[tuple[int, int]]] = [[] for _ in layers]
        for (a, b), w in zip(pairs, scaled, strict=True):
            neighbours[local[a]].append((local[b], w))
            neighbours[local[b]].append((local[a], w))
        adj_starts = [0]
        adjacent: list[int] = []
        eweights: list[int] = []
        for row in neighbours:
            for v, w in row:
                adjacent.append(v)
                eweights.append(w)
            adj_starts.append(len(adjacent))

        tpwgts: list[float] | None = None
        if len(set(part_speed)) > 1:
            total = sum(part_speed)
            tpwgts = [x / total for x in part_speed[:-1]]
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
            raise SolverError(f"METIS failed on {len(layers)} layers / {k} parts: {exc}") from exc
        return [labels[int(p)] for p in part.vertex_part]


def _first_seen_order(assignment: tuple[int, ...], problem: PartitionProblem) -> tuple[int, ...]:
    """Renumber the parts of identical devices in the order the layers reach them.

    METIS's part numbers are arbitrary; numbering them by first use puts the input layers on
    device 0 and reads naturally. Only done when every device is the same, so that no layer
    moves to a device of another type or memory size, or to a pair joined by another link.
    """
    if not problem.topology.is_uniform or len(set(problem.compute_time_s)) > 1:
        return assignment
    order: dict[int, int] = {}
    for d in assignment:
        order.setdefault(d, len(order))
    for d in range(problem.num_devices):
        order.setdefault(d, len(order))
    return tuple(order[d] for d in assignment)
