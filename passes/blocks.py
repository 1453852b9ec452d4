"""Repeated blocks: trace two of a stack's identical blocks and write the other copies.

A 48-block decoder's training step has 21 000 ops, and TensorFlow builds each in Python: the
trace alone takes ~15 s, and the strategy search traces the model at several batch sizes. The
blocks are identical, so their ops are too. :func:`find_repeat` recognises a run of ``count``
identical blocks in a functional model's layers; :func:`reduced_call` runs the model with
blocks ``2 .. count-1`` skipped (every skipped layer hands on the output of its counterpart in
block 1, so what follows the stack reads block 1's output as it would read the last block's);
and :func:`expand_repeat` writes block 1's ops once per skipped block, renamed to that block's
layers, wired to the block before and after it as block 1 is wired to block 0 and to what
follows. The IR the rest of the pipeline sees is the one the full trace would give, op for op:
``tests/passes/test_blocks.py`` compares them.

When blocks are identical (what :func:`find_repeat` checks)
---------------------------------------------------------
Layers are compared by class, configuration (name aside; a layer whose ``get_config`` fails, by
its scalar attributes), weight shapes and output shapes; a run
of ``period`` layers repeated ``count >= MIN_BLOCKS`` times is a repeat when every layer of
blocks ``1 .. count-1`` reads, inside the run, only its own block or the one before at the same
relative positions as block 1's layer does, and outside the run the same layers as block 1's
layer does (a shared mask); and what follows the run reads only its last block. Every layer has
one call in the model (no shared layers).

When the ops are (what :func:`expand_repeat` checks, else it returns None and the caller traces
the whole model): the ops of block 0's and block 1's layers match one to one (types, output
shapes); no op of block 1 feeds anything before the run (a gradient summed over every block
would have ``count`` inputs, not two). Glue ops made outside every layer (a gradient's sum over
a block output's consumers) belong to the blocks they join: with block 1 when they touch block
1 and block 0 (one per boundary between blocks), with what follows when they touch the last
block and what follows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from partitioner.core.ir import Edge, Graph, Op, Phase

__all__ = [
    "MIN_BLOCKS",
    "MIN_SKIPPED_SHARE",
    "Repeat",
    "expand_repeat",
    "find_repeat",
    "reduced_call",
    "skipped_variables",
    "worth_reducing",
]

logger = logging.getLogger(__name__)

MIN_BLOCKS = 4
"""The fewest repeated blocks worth tracing two of (two are traced either way)."""

MIN_SKIPPED_SHARE = 1 / 3
"""The share of the model's layers (each unit with its sublayers) the blocks a reduced trace
skips must hold for it to be tried (:func:`worth_reducing`)."""

Region = Literal["before", "block0", "block1", "after", "mixed"]


@dataclass(frozen=True)
class Repeat:
    """``count`` blocks of ``period`` units each, starting at unit ``start`` (placement order)."""

    start: int
    period: int
    count: int
    unit_names: tuple[str, ...]
    """Every placement unit's name, in placement order."""

    def block_of(self, index: int) -> int | None:
        """The block of unit ``index``, or None outside the run."""
        offset = index - self.start
        if 0 <= offset < self.period * self.count:
            return offset // self.period
        return None

    def name_in_block(self, name: str, block: int) -> str:
        """The name of the unit at ``name``'s position in ``block`` (``name`` in block 1)."""
        index = self.unit_names.index(name)
        return self.unit_names[index + (block - 1) * self.period]


def _signature(layer: Any) -> Any:
    """What makes two layers interchangeable: class, configuration without the name, weight
    shapes and dtypes, output shapes."""
    try:
        config = dict(layer.get_config())
    except Exception:  # no working get_config: its scalar attributes stand for it
        config = {
            key: value
            for key, value in vars(layer).items()
            if isinstance(value, (int, float, str, bool, type(None), tuple))
            and "name" not in key
            and "path" not in key
        }
    config.pop("name", None)
    weights = tuple((tuple(w.shape), str(w.dtype)) for w in getattr(layer, "weights", ()))
    outputs = tuple(tuple(t.shape) for node in layer._inbound_nodes for t in node.output_tensors)
    return (type(layer).__qualname__, repr(sorted(config.items(), key=str)), weights, outputs)


def _parents(model: Any, layers: Sequence[Any]) -> list[tuple[int, ...]] | None:
    """Each layer's parent layers (indices into ``layers``; -1 for a model input), or None when
    a layer is called more than once."""
    index = {id(layer): k for k, layer in enumerate(layers)}
    in_model = {id(n) for nodes in model._nodes_by_depth.values() for n in nodes}
    parents = []
    for layer in layers:
        nodes = [n for n in layer._inbound_nodes if id(n) in in_model]
        if len(nodes) != 1:
            return None
        parents.append(tuple(index.get(id(p.operation), -1) for p in nodes[0].parent_nodes))
    return parents


def _longest_run(codes: Sequence[int]) -> tuple[int, int, int] | None:
    """(start, period, count) of the run of identical blocks that saves the most units
    (``(count - 2) * period``), smaller periods first on ties; None below MIN_BLOCKS."""
    n, best, best_saved = len(codes), None, 0
    for period in range(1, n // MIN_BLOCKS + 1):
        run = 0
        for i in range(n - period + 1):
            if i + period < n and codes[i] == codes[i + period]:
                run += 1
                continue
            count = (run + period) // period  # units i - run .. i + period - 1 repeat
            saved = (count - 2) * period
            if count >= MIN_BLOCKS and saved > best_saved:
                best, best_saved = (i - run, period, count), saved
            run = 0
    return best


def _wired_alike(parents: Sequence[tuple[int, ...]], start: int, period: int, count: int) -> bool:
    """Blocks 1 .. count-1 read what block 1 reads, shifted (see the module docstring), and
    what follows the run reads only its last block."""
    end = start + period * count
    for block in range(1, count):
        for offset in range(period):
            unit, model_unit = start + block * period + offset, start + period + offset
            for p, q in zip(parents[unit], parents[model_unit], strict=False):
                inside = start <= p < end
                if len(parents[unit]) != len(parents[model_unit]):
                    return False
                if inside and (p - unit != q - model_unit or p < unit - offset - period):
                    return False
                if not inside and p != q:
                    return False
    last = end - period
    return all(not (start <= p < last) for unit in range(end, len(parents)) for p in parents[unit])


def find_repeat(model: Any, unit_names: Sequence[str]) -> Repeat | None:
    """The run of identical blocks of a functional model's layers (see the module docstring),
    or None (not a functional model, no run of MIN_BLOCKS, wired otherwise)."""
    layers = [
        op for op in getattr(model, "operations", None) or [] if type(op).__name__ != "InputLayer"
    ]
    if not hasattr(model, "_nodes_by_depth") or len(layers) != len(unit_names):
        return None
    if [layer.name for layer in layers] != list(unit_names):
        return None  # nested containers: units are not the model's own layers
    parents = _parents(model, layers)
    if parents is None:
        return None
    codes: dict[Any, int] = {}
    found = _longest_run([codes.setdefault(_signature(layer), len(codes)) for layer in layers])
    if found is None or not _wired_alike(parents, *found):
        return None
    start, period, count = found
    return Repeat(start, period, count, tuple(unit_names))


def worth_reducing(repeat: Repeat, layers_per_unit: Sequence[int]) -> bool:
    """Whether tracing ``repeat`` two blocks deep may pay: the blocks it skips hold at least
    :data:`MIN_SKIPPED_SHARE` of the model's layers (``layers_per_unit``: each unit counted with
    its sublayers, a unit's ops being roughly its layers'). Below that the reduced trace saves
    little, and where its blocks' ops differ (ResNet-50's identity blocks: their
    BatchNormalization gradients come out otherwise in block 1) the whole model is traced
    after it, so the run pays for both (a third more on ResNet-50's trace)."""
    first, end = repeat.start + 2 * repeat.period, repeat.start + repeat.period * repeat.count
    return sum(layers_per_unit[first:end]) >= MIN_SKIPPED_SHARE * sum(layers_per_unit)


def _layers(model: Any) -> list[Any]:
    return [op for op in model.operations if type(op).__name__ != "InputLayer"]


def skipped_variables(model: Any, repeat: Repeat) -> set[int]:
    """``id`` of every variable of the layers :func:`reduced_call` skips."""
    layers = _layers(model)
    first, end = repeat.start + 2 * repeat.period, repeat.start + repeat.period * repeat.count
    return {id(w) for layer in layers[first:end] for w in getattr(layer, "variables", ())}


def reduced_call(model: Any, repeat: Repeat) -> Callable[[Any], Any]:
    """``model``'s training-mode call with blocks ``2 .. count-1`` skipped: each of their
    layers hands on the outputs of its counterpart in block 1 (Keras's own graph runner)."""
    from keras.src.models.functional import operation_fn

    layers = _layers(model)
    first_skipped = repeat.start + 2 * repeat.period
    end = repeat.start + repeat.period * repeat.count
    proxy = {
        id(layers[k]): id(
            layers[repeat.start + repeat.period + (k - first_skipped) % repeat.period]
        )
        for k in range(first_skipped, end)
    }
    outputs: dict[int, Any] = {}

    def run(op: Any) -> Callable[..., Any]:
        if id(op) in proxy:
            return lambda *args, **kwargs: outputs[proxy[id(op)]]
        call = operation_fn(op, training=True)

        def remembered(*args: Any, **kwargs: Any) -> Any:
            outputs[id(op)] = result = call(*args, **kwargs)
            return result

        return remembered

    def reduced(inputs: Any) -> Any:
        flat = model._standardize_inputs(inputs)
        result = model._run_through_graph(flat, operation_fn=run)
        return result[0] if isinstance(result, (list, tuple)) and len(result) == 1 else result

    return reduced


def _unit_regions(graph: Graph, repeat: Repeat) -> dict[str, Region] | None:
    """Each layer-owned op's region; None when an op belongs to a skipped block."""
    index = {name: k for k, name in enumerate(repeat.unit_names)}
    regions: dict[str, Region] = {}
    for op in graph.ops:
        if op.layer is None:
            continue
        block = repeat.block_of(index[op.layer])
        if block is None:
            regions[op.id] = "before" if index[op.layer] < repeat.start else "after"
        elif block > 1:
            return None
        else:
            regions[op.id] = "block0" if block == 0 else "block1"
    return regions


def _glue_regions(graph: Graph, regions: dict[str, Region]) -> dict[str, Region] | None:
    """Regions of the glue ops, from the layer-owned ops they read or feed: a glue op between
    two blocks (a gradient's sum over a block output's consumers) belongs to the later block,
    one between the last block and what follows to what follows, one that every block reads
    and block 1 does not feed (an input) stays as it is; None when one joins block 1 to what
    comes before the run."""
    near: dict[str, set[Region]] = {op.id: set() for op in graph.ops if op.layer is None}
    fed_by: dict[str, set[Region]] = {op_id: set() for op_id in near}
    for e in graph.edges:
        if e.dst in near and e.src in regions:
            fed_by[e.dst].add(regions[e.src])
        for end, other in ((e.src, e.dst), (e.dst, e.src)):
            if end in near and other in regions:
                near[end].add(regions[other])
    glue: dict[str, Region] = {}
    for op_id, touched in near.items():
        if "block1" not in fed_by[op_id] and {"block0", "block1"} <= touched:
            glue[op_id] = "mixed"  # a source every block reads (an input mask): kept once
        elif "block1" in touched:
            if touched <= {"block0", "block1"}:
                glue[op_id] = "block1"
            elif touched <= {"block1", "after"}:
                glue[op_id] = "after"
            else:
                return None
        elif "block0" in touched and touched <= {"before", "block0"}:
            glue[op_id] = "block0"
        else:
            glue[op_id] = "mixed"  # kept as it is
    return glue


def _counterparts(
    graph: Graph, repeat: Repeat, region: Mapping[str, Region]
) -> dict[str, str] | None:
    """Block 0's ops -> their counterparts in block 1: a layer's ops to the ops of the layer at
    its position in block 1, block 0's glue to block 1's, each in trace order; None when the
    two blocks' ops differ."""
    groups: dict[tuple[int, int], list[Op]] = {}
    index = {name: k for k, name in enumerate(repeat.unit_names)}
    for op in graph.ops:
        where = region[op.id]
        if where not in ("block0", "block1"):
            continue
        block = 0 if where == "block0" else 1
        offset = -1 if op.layer is None else (index[op.layer] - repeat.start) % repeat.period
        groups.setdefault((offset, block), []).append(op)
    pairs: dict[str, str] = {}
    for position in {key for key, _ in groups}:
        first, second = groups.get((position, 0), []), groups.get((position, 1), [])
        matched = _by_name(first, second) or _by_order(first, second)
        if matched is None:
            return None
        pairs.update(matched)
    return pairs


def _kind(op: Op) -> tuple[Any, ...]:
    return (op.op_type, op.output_shapes, op.output_dtypes)


def _by_order(first: Sequence[Op], second: Sequence[Op]) -> dict[str, str] | None:
    """The two lists' ops paired in order, if they are alike in order."""
    if [_kind(o) for o in first] != [_kind(o) for o in second]:
        return None
    return {a.id: b.id for a, b in zip(first, second)}


def _by_name(first: Sequence[Op], second: Sequence[Op]) -> dict[str, str] | None:
    """The two layers' ops paired by name with the layer's own name taken out (TensorFlow
    names an op after its layer's scope; the gradient pass may create two blocks' ops in
    different orders), if every op finds an alike partner that way."""
    if not first or len(first) != len(second) or first[0].layer is None:
        return None
    a_layer, b_layer = first[0].layer, second[0].layer
    if b_layer is None:
        return None
    keyed = {o.id.replace(b_layer, "\0"): o for o in second}
    pairs: dict[str, str] = {}
    for o in first:
        partner = keyed.get(o.id.replace(a_layer, "\0"))
        if partner is None or _kind(partner) != _kind(o):
            return None
        pairs[o.id] = partner.id
    return pairs if len(set(pairs.values())) == len(pairs) else None


def _copy_id(op_id: str, block: int) -> str:
    return op_id if block == 1 else f"{op_id}#block{block}"


@dataclass(frozen=True)
class _Plan:
    """How the reduced trace's ops and edges become the full graph's."""

    repeat: Repeat
    region: Mapping[str, Region]
    counterpart: Mapping[str, str]

    def edges(self, e: Edge) -> list[Edge] | None:
        """The full graph's copies of the reduced graph's edge ``e``; None when ``e`` cannot be
        copied exactly (block 1 feeding what comes before the run)."""
        rs, rd, last = self.region[e.src], self.region[e.dst], self.repeat.count - 1
        blocks = range(1, self.repeat.count)

        def at(src: str, dst: str) -> Edge:
            return Edge(src, dst, e.bytes, e.output_index)

        if rs == "block1" and rd == "block1":
            return [at(_copy_id(e.src, j), _copy_id(e.dst, j)) for j in blocks]
        if rs == "block0" and rd == "block1":
            back = self.counterpart.get(e.src)
            if back is None:
                return None
            return [
                at(e.src if j == 1 else _copy_id(back, j - 1), _copy_id(e.dst, j)) for j in blocks
            ]
        if rs == "block1" and rd == "block0":
            back = self.counterpart.get(e.dst)
            if back is None:
                return None
            return [
                at(_copy_id(e.src, j), e.dst if j == 1 else _copy_id(back, j - 1)) for j in blocks
            ]
        if rs == "block1":
            return [at(_copy_id(e.src, last), e.dst)] if rd == "after" else None
        if rd == "block1":  # from what follows (the last block) or before (every block)
            if rs == "after":
                return [at(e.src, _copy_id(e.dst, last))]
            return [at(e.src, _copy_id(e.dst, j)) for j in blocks]
        return [e]

    def ops(self, op: Op) -> list[Op]:
        if self.region[op.id] != "block1":
            return [op]
        return [
            replace(
                op,
                id=_copy_id(op.id, j),
                layer=None if op.layer is None else self.repeat.name_in_block(op.layer, j),
            )
            for j in range(1, self.repeat.count)
        ]


def _in_trace_order(ops: Sequence[Op], edges: Sequence[Edge], plan: _Plan) -> list[Op]:
    """The full graph's ops in the order a trace of the whole model creates them: each
    stretch of block 1's ops once per block, in block order, or in reverse block order where
    the stretch feeds block 0 (a backward pass: the gradients flow from the last block to the
    first; the step's outputs, one per weight, come in block order)."""
    feeds_block0 = {e.src for e in edges if plan.region[e.dst] == "block0"}
    order: list[Op] = []
    stretch: list[Op] = []

    def flush() -> None:
        if not stretch:
            return
        copies = [plan.ops(op) for op in stretch]  # copies[i][j - 1]: op i in block j
        blocks = range(len(copies[0]))
        if stretch[0].phase is Phase.BACKWARD and any(op.id in feeds_block0 for op in stretch):
            blocks = blocks[::-1]
        order.extend(copies[i][j] for j in blocks for i in range(len(stretch)))
        stretch.clear()

    for op in ops:
        if plan.region[op.id] == "block1":
            if stretch and stretch[-1].phase is not op.phase:
                flush()
            stretch.append(op)
        else:
            flush()
            order.append(op)
    flush()
    return order


def _is_topological(ops: Sequence[Op], edges: Sequence[Edge]) -> bool:
    position = {op.id: k for k, op in enumerate(ops)}
    return len(position) == len(ops) and all(position[e.src] < position[e.dst] for e in edges)


def expand_repeat(graph: Graph, repeat: Repeat) -> Graph | None:
    """The full step's graph from the trace of :func:`reduced_call` (see the module
    docstring); None when the reduced trace cannot be expanded exactly."""
    regions = _unit_regions(graph, repeat)
    if regions is None:
        return None
    glue = _glue_regions(graph, regions)
    if glue is None:
        return None
    region = {**regions, **glue}
    counterpart = _counterparts(graph, repeat, region)
    if counterpart is None:
        return None
    plan = _Plan(repeat, region, counterpart)
    edges: list[Edge] = []
    for e in graph.edges:
        copies = plan.edges(e)
        if copies is None:
            return None
        edges.extend(copies)
    ordered = _in_trace_order(graph.ops, graph.edges, plan)
    if not _is_topological(ordered, edges):
        return None
    return replace(graph, ops=tuple(ordered), edges=tuple(edges))
