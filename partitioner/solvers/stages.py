"""Turn any placement into pipeline stages: an acyclic device graph, numbered in order.

A placement's *stage graph* (quotient graph) has an arc ``d -> e`` when some layer edge goes from
a layer on device ``d`` to a layer on device ``e != d``. A pipeline needs that graph acyclic, and
reads best when every arc goes from a lower to a higher device index (device ``s`` = stage
``s``). :func:`make_acyclic` refines any assignment into one where **every layer edge**
``(a, b)`` has ``stage[a] <= stage[b]`` -- which implies both properties -- in three steps:

1. *Relabel.* Order the devices by Kahn's algorithm on the stage graph (networkx's
   lexicographic topological sort), always taking the available device of lowest index; when a
   cycle leaves none available, take the remaining device whose first layer (in problem order)
   comes first, breaking the cycle there. The device
   at position ``s`` of that order becomes stage ``s``. When the stage graph is already acyclic
   this is a topological order and step 2 changes nothing; when its arcs already go from lower
   to higher index, it is the identity (so an ordered placement keeps its devices, and
   :func:`make_acyclic` is idempotent).
2. *Monotone repair.* In problem order (a topological order of the layers, since edges go from
   lower to higher index), ``stage[k] = max(label[k], max(stage[p] for p in preds(k)))``; a layer
   only ever moves to a later stage, and afterwards every edge satisfies the property.
3. *No empty stage* (when there are at least as many layers as devices). Sort the layers by
   ``(stage, index)`` -- still a topological order, because along an edge the stage does not
   decrease and, within a stage, the index grows -- giving the non-decreasing sequence
   ``s_1 <= ... <= s_L``, and replace it by ``s'_i = max(s'_{i-1}, min(s_i, s'_{i-1} + 1),
   D - 1 - (L - i))`` (``s'_0 = -1``): non-decreasing, steps of 0 or 1 from stage 0 to ``D - 1``
   (so every stage is used), and equal to ``s`` whenever ``s`` already uses every stage.
   A non-decreasing sequence along a topological order keeps every edge's property.

Stage ``s`` runs on device ``s``; with devices of different types or memories the relabelling
changes which device a layer runs on, and no step checks memory -- callers that need it check
(:func:`~partitioner.solvers.base.check_memory`). :func:`acyclic_on_devices` keeps the devices
instead: stage ``s`` on the device step 1 relabelled ``s`` (a solver that gave the heavier first
layers to the faster device keeps that choice). Cost ``O(L + E + D log D)``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import networkx as nx

from partitioner.core.ir import PartitionProblem
from partitioner.solvers.base import checked_assignment

__all__ = ["acyclic_on_devices", "is_acyclic_stages", "make_acyclic", "stage_graph"]

logger = logging.getLogger(__name__)


def stage_graph(assignment: Sequence[int], problem: PartitionProblem) -> set[tuple[int, int]]:
    """The arcs ``(d, e)``, ``d != e``, of the device-level quotient graph of ``assignment``."""
    dev = checked_assignment(assignment, problem)
    return {(dev[a], dev[b]) for a, b, _ in problem.edges if dev[a] != dev[b]}


def _stage_digraph(dev: Sequence[int], problem: PartitionProblem) -> nx.DiGraph[int]:
    """The stage graph as a networkx graph over every device (unused ones included)."""
    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(problem.num_devices))
    graph.add_edges_from(stage_graph(dev, problem))
    return graph


def is_acyclic_stages(assignment: Sequence[int], problem: PartitionProblem) -> bool:
    """Whether the device-level quotient graph of ``assignment`` has no cycle."""
    return bool(nx.is_directed_acyclic_graph(_stage_digraph(assignment, problem)))


def _relabel(dev: tuple[int, ...], problem: PartitionProblem) -> list[int]:
    """Step 1: the new stage of every device (Kahn's order by index, cycles broken by first use).

    Each round takes the lexicographic (lowest index first) topological order of the devices left
    as far as it goes; when a cycle stops it, the device left whose first layer comes first loses
    its incoming arcs and the next round starts from it.
    """
    n_dev = problem.num_devices
    first = [problem.num_layers + d for d in range(n_dev)]  # unused devices go last, by index
    for k, d in enumerate(dev):
        if first[d] >= problem.num_layers:
            first[d] = k
    graph = _stage_digraph(dev, problem)
    order: list[int] = []
    while graph:
        done = len(order)
        try:
            for d in nx.lexicographical_topological_sort(graph):
                order.append(d)
        except nx.NetworkXUnfeasible:  # a cycle: break it at the remaining device used first
            graph.remove_nodes_from(order[done:])
            d = min(graph, key=lambda d: first[d])
            logger.debug("make_acyclic: breaking a cycle of the stage graph at device %d", d)
            graph.remove_edges_from(list(graph.in_edges(d)))
        else:
            break
    label = [0] * n_dev
    for position, d in enumerate(order):
        label[d] = position
    return label


def make_acyclic(assignment: Sequence[int], problem: PartitionProblem) -> tuple[int, ...]:
    """Refine ``assignment`` so every layer edge goes to an equal or later stage (see module)."""
    dev = checked_assignment(assignment, problem)
    n, n_dev = problem.num_layers, problem.num_devices
    label = _relabel(dev, problem)
    preds: list[list[int]] = [[] for _ in range(n)]
    for a, b, _ in problem.edges:
        preds[b].append(a)
    stage = [0] * n
    for k in range(n):
        s = label[dev[k]]
        for p in preds[k]:
            if stage[p] > s:
                s = stage[p]
        stage[k] = s
    if n >= n_dev and len(set(stage)) < n_dev:
        order = sorted(range(n), key=lambda k: (stage[k], k))
        prev = -1
        for i, k in enumerate(order, start=1):
            new = max(prev, min(stage[k], prev + 1), n_dev - 1 - (n - i))
            stage[k] = new
            prev = new
    return tuple(stage)


def acyclic_on_devices(assignment: Sequence[int], problem: PartitionProblem) -> tuple[int, ...]:
    """:func:`make_acyclic`'s stages, each on the device step 1 relabelled to it (not on the
    device of the stage's index): the same pipeline, on the devices the assignment chose."""
    label = _relabel(checked_assignment(assignment, problem), problem)
    device_of_stage = {stage: device for device, stage in enumerate(label)}
    return tuple(device_of_stage[s] for s in make_acyclic(assignment, problem))
