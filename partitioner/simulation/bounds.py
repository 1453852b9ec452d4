"""Lower bounds on the step time of any layer placement, and on the devices a model needs.

For a :class:`~partitioner.core.ir.PartitionProblem` with ``t[d][k]`` the forward+backward time of
layer ``k`` on device ``d`` and ``D`` devices (``t_min[k] = min_d t[d][k]``):

* ``work_s = sum_k t_min[k] / D``: some device carries at least the average load, and every
  layer costs at least ``t_min[k]`` wherever it goes. (On identical devices this is the model's
  total time on one device divided by ``D``. Dividing the total on the *fastest device* by ``D``
  instead is not a bound when devices are fast at different layers.)
* ``largest_layer_s = max_k t_min[k]``: a layer is not split, so its device runs at least that.
* ``critical_path_s``: the longest path of the layer DAG (edges ``a -> b``, ``a < b``) weighted
  by ``t_min``: a layer starts after its inputs are done, so one step takes at least that. This
  bounds the time of *one* step (a sequential execution, as the plan's simulator models it); it
  does **not** bound a pipelined step (stages working on different micro-batches), so
  :attr:`LowerBounds.throughput_s` leaves it out.
* ``best_s``: the largest of the three.
* ``min_devices``: the fewest devices whose memories can hold the model, i.e. the smallest ``m``
  such that the ``m`` largest device memories sum to at least the model's total memory (when all
  devices together are too small, ``D`` plus as many more of the largest device as it takes).
  Only a lower bound: layers are not split, so packing them (bin packing) can need more.

:func:`costed_lower_bounds` gives the same for a :class:`~partitioner.core.ir.CostedGraph`, with the
critical path taken over the *op* graph (each op at its fastest device time), which bounds the
op-level simulation exactly: an op never starts before its inputs end. Pure Python; no imports
beyond the IR.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from partitioner.core.ir import CostedGraph, PartitionProblem

__all__ = ["LowerBounds", "costed_lower_bounds", "lower_bounds", "min_devices_for_memory"]


@dataclass(frozen=True)
class LowerBounds:
    """Lower bounds on the step time (seconds) and the device count of any placement."""

    work_s: float
    critical_path_s: float
    largest_layer_s: float
    min_devices: int

    @property
    def best_s(self) -> float:
        """The tightest bound on the time of one (sequential) step: the largest of the three."""
        return max(self.work_s, self.critical_path_s, self.largest_layer_s)

    @property
    def throughput_s(self) -> float:
        """A bound on a pipelined step (the slowest stage): work and largest layer only."""
        return max(self.work_s, self.largest_layer_s)


def min_devices_for_memory(problem: PartitionProblem) -> int:
    """The smallest ``m`` whose ``m`` largest device memories hold the model's total memory."""
    total = sum(problem.memory_bytes)
    if total <= 0:
        return 1
    memories = sorted((d.memory_bytes for d in problem.topology.devices), reverse=True)
    held = 0
    for m, mem in enumerate(memories, start=1):
        held += mem
        if held >= total:
            return m
    largest = memories[0]
    if largest <= 0:
        return len(memories) + problem.num_layers  # nothing fits anywhere; say "more than all"
    return len(memories) + math.ceil((total - held) / largest)


def _min_times(rows: tuple[tuple[float, ...], ...]) -> list[float]:
    """Each column's smallest time; devices that share a row object are read once."""
    distinct = tuple({id(r): r for r in rows}.values())
    if len(distinct) == 1:
        return list(distinct[0])
    return [min(col) for col in zip(*distinct)]


def _longest_path(weights: list[float], edges: list[tuple[int, int]]) -> float:
    """Longest weighted path of a DAG whose edges go from lower to higher index."""
    best = list(weights)
    preds: list[list[int]] = [[] for _ in weights]
    for a, b in edges:
        preds[b].append(a)
    for k, w in enumerate(weights):
        if preds[k]:
            best[k] = w + max(best[p] for p in preds[k])
    return max(best, default=0.0)


def lower_bounds(problem: PartitionProblem) -> LowerBounds:
    """The bounds of the module docstring for ``problem`` (layer DAG critical path)."""
    t_min = _min_times(problem.compute_time_s)
    return LowerBounds(
        work_s=sum(t_min) / problem.num_devices,
        critical_path_s=_longest_path(t_min, [(a, b) for a, b, _ in problem.edges]),
        largest_layer_s=max(t_min, default=0.0),
        min_devices=min_devices_for_memory(problem),
    )


def costed_lower_bounds(costed: CostedGraph) -> LowerBounds:
    """The bounds for ``costed``: layer-level work and largest layer, op-level critical path."""
    layer = lower_bounds(costed.problem())
    graph = costed.graph
    op_min = _min_times(costed.op_compute_time_s)
    index = graph.op_index
    edges = [(index[e.src], index[e.dst]) for e in graph.edges]
    return LowerBounds(
        work_s=layer.work_s,
        critical_path_s=_longest_path(op_min, edges),
        largest_layer_s=layer.largest_layer_s,
        min_devices=layer.min_devices,
    )
