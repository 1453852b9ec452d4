"""The op graph as the simulators read it, built once per graph: integer indices, not names.

Every placement a search scores is simulated on the same few graphs; what does not depend on the
placement -- each op's owner layer, its phase, whether it is fed, its inputs and outputs by op
position, the op edges that cross layers -- is computed here once per :class:`Graph` (kept while
the graph lives) instead of once per simulation. Pure Python.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from partitioner.core.ir import Graph, Phase

__all__ = ["OpView", "op_view"]


@dataclass(frozen=True)
class OpView:
    """Placement-independent facts of a graph's ops, by op position."""

    op_layer: tuple[int, ...]
    """The index (layer order) of each op's effective owner layer."""
    forward: tuple[bool, ...]
    """Whether each op is a forward op."""
    fed: tuple[bool, ...]
    """Whether each op is fed (:func:`partitioner.simulation.pipeline.fed_ops`)."""
    inputs: tuple[tuple[tuple[int, int], ...], ...]
    """Per op, its in-edges as ``(producer position, output index)``, in edge order."""
    outputs: tuple[tuple[tuple[int, int, int], ...], ...]
    """Per op, its out-edges as ``(consumer position, output index, bytes)``, in edge order."""
    cross_layer_edges: tuple[tuple[int, int, int, int], ...]
    """``(producer, consumer, output index, bytes)`` of every edge between ops of two layers
    from an op that is not fed, in edge order: the only edges a placement can cut."""
    first_unfed_op: tuple[int, ...]
    """Per layer, the position of its first op that is not fed (the op count when none)."""


_VIEWS: dict[int, tuple[weakref.ref[Graph], OpView]] = {}
"""``id(graph)`` -> (a weak reference to ``graph``, its view). An id is unique only while its
object lives, so an entry is used only when its reference still leads to the very graph asked
about; the entry is dropped when the graph dies. Planning threads share it: each step is one
dict operation (atomic), and two threads that miss at once both build the same view."""


def op_view(graph: Graph) -> OpView:
    """``graph``'s view, built on first use and kept while ``graph`` lives."""
    key = id(graph)
    held = _VIEWS.get(key)
    if held is not None and held[0]() is graph:
        return held[1]
    view = _build(graph)
    _VIEWS[key] = (weakref.ref(graph), view)
    weakref.finalize(graph, _forget, key, weakref.ref(view))
    return view


def _forget(key: int, view: weakref.ref[OpView]) -> None:
    """Drop ``key``'s entry if it still holds ``view`` (a dead graph's; not a later graph's)."""
    held = _VIEWS.get(key)
    if held is not None and held[1] is view():
        _VIEWS.pop(key, None)


def _build(graph: Graph) -> OpView:
    lg = graph.layer_graph
    index = graph.op_index
    op_layer = tuple(lg.index[lg.op_owner[op.id]] for op in graph.ops)
    inputs = tuple(tuple((index[e.src], e.output_index) for e in ins) for ins in graph.in_edges)
    outputs = tuple(
        tuple((index[e.dst], e.output_index, e.bytes) for e in outs) for outs in graph.out_edges
    )
    fed: list[bool] = []
    for op, ins in zip(graph.ops, inputs, strict=True):
        fed.append(op.layer is None and all(fed[j] for j, _ in ins))
    cross = []
    for e in graph.edges:
        i, j = index[e.src], index[e.dst]
        if op_layer[i] != op_layer[j] and not fed[i]:
            cross.append((i, j, e.output_index, e.bytes))
    first = [len(graph.ops)] * len(lg.nodes)
    for i in reversed(range(len(graph.ops))):
        if not fed[i]:
            first[op_layer[i]] = i
    return OpView(
        op_layer=op_layer,
        forward=tuple(op.phase is Phase.FORWARD for op in graph.ops),
        fed=tuple(fed),
        inputs=inputs,
        outputs=outputs,
        cross_layer_edges=tuple(cross),
        first_unfed_op=tuple(first),
    )
