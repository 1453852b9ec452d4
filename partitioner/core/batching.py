"""A training step's graph at another batch size, from its traces at two batch sizes.

The strategy search prices every candidate at the batch it would really run (a replica's share,
a micro-batch), so it needs the model's graph at several batch sizes. Tracing a large model
takes seconds to tens of seconds each time. In the graphs of ordinary networks the batch size
only scales the leading dimension of the batch's tensors, so every op's FLOPs, every tensor's
bytes and every dimension is an affine function ``a + b * batch`` of it (a weight's gradient:
constant bytes, FLOPs proportional; an activation: both proportional; an attention score:
proportional, with the sequence length squared in ``b``; a sparse gradient's rows: the step's
lookups, proportional). Two traces at batches ``b1 != b2`` with the same ops and edges determine
each of those functions, and so the graph at any batch.

:func:`graph_at_batch` refuses (returns None) whenever the two traces differ in structure (op
ids, types, layers, phases, dtypes, edges) or a value would not be a non-negative integer at
the asked batch, so a caller traces that batch instead.

:class:`BatchShare` is the one place that knows why a step is traced at a batch other than the
one asked for (a replica's share, a micro-batch): :func:`at_share` rewords an error of the model's
own code at that batch to say so, with the argument to change. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TypeVar

from partitioner.core.errors import PartitionError, TraceError, quoting
from partitioner.core.ir import Edge, Graph, LayerInfo, Op

__all__ = ["TRACED_AT", "BatchShare", "at_share", "graph_at_batch"]

TRACED_AT = "it was traced at "
"""How an error of the model's code at a trace says where it ran: then ``batch_size=N`` (the
trace's batch), which :func:`at_share` replaces by the share of the batch it was."""

_E = TypeVar("_E", bound=PartitionError)


@dataclass(frozen=True)
class BatchShare:
    """A batch a step is traced at and why: ``batch_size`` over ``replicas`` data-parallel
    replicas, each share over ``num_microbatches`` micro-batches; ``given``: those are the
    ``num_microbatches=`` of ``pipeline=True``, not the strategy search's own."""

    batch_size: int
    replicas: int = 1
    num_microbatches: int = 1
    given: bool = False

    @property
    def size(self) -> int:
        """The samples the step is traced at."""
        return self.batch_size // (self.replicas * self.num_microbatches)

    def where(self) -> str:
        """``a micro-batch of 2 (batch_size=8 over num_microbatches=4)``, as arguments."""
        if self.num_microbatches == 1:
            if self.replicas == 1:
                return f"batch_size={self.batch_size}"
            return (
                f"a replica's share of {self.size} (batch_size={self.batch_size} over "
                f"{self.replicas} data-parallel replicas)"
            )
        micro = (
            f"num_microbatches={self.num_microbatches}"
            if self.given
            else f"{self.num_microbatches} micro-batches"
        )
        over = micro if self.replicas == 1 else f"{self.replicas} replicas and {micro} each"
        return f"a micro-batch of {self.size} (batch_size={self.batch_size} over {over})"

    def change(self) -> str:
        """The arguments that change the share, as the next step."""
        if self.given and self.num_microbatches > 1:
            return "change num_microbatches= or batch_size= so that a micro-batch suits the model"
        what = "a replica's share" if self.num_microbatches == 1 else "a micro-batch"
        return (
            f"change batch_size=, the devices (gpus=) or strategy= so that {what} suits the model"
        )


def at_share(error: _E, share: BatchShare) -> _E:
    """``error``, raised by the model's code traced at ``share.size``, saying which share of the
    batch that was and what changes it (its ``it was traced at batch_size=N`` clause replaced);
    as it is for the whole batch, and for an error that names no such trace."""
    clause = f"{TRACED_AT}batch_size={share.size}"
    head, found, tail = str(error).rpartition(clause)
    if not found or not isinstance(error, TraceError) or share.size == share.batch_size:
        return error
    text = f"{head}{TRACED_AT}{share.where()}{tail}; {share.change()}"
    return quoting(type(error)(text), *error.quoted)


class _NotAffine(Exception):
    """A value of the two traces does not extend to the asked batch as an integer."""


class _Line:
    """The affine map through (b1, v1) and (b2, v2), evaluated at ``batch``."""

    def __init__(self, b1: int, b2: int, batch: int) -> None:
        self._num, self._den = batch - b1, b2 - b1

    def __call__(self, v1: int, v2: int) -> int:
        if v1 == v2:  # a constant, or a dimension unknown in both traces (-1)
            return v1
        step, rest = divmod((v2 - v1) * self._num, self._den)
        value = v1 + step
        if rest or value < 0 or min(v1, v2) < 0:
            raise _NotAffine
        return value


def _without_rows(info: LayerInfo) -> LayerInfo:
    """``info`` without the batch-dependent part: its sparse gradients' row counts."""
    if not info.sparse_gradients:
        return info
    rowless = tuple(replace(g, rows_per_step=0) for g in info.sparse_gradients)
    return replace(info, sparse_gradients=rowless)


def _layers_at(a: Graph, b: Graph, line: _Line) -> tuple[LayerInfo, ...]:
    """The layers at the asked batch: each sparse gradient's rows (the step's lookups) on the
    line through the two traces."""
    return tuple(
        x
        if not x.sparse_gradients
        else replace(
            x,
            sparse_gradients=tuple(
                replace(g, rows_per_step=line(g.rows_per_step, h.rows_per_step))
                for g, h in zip(x.sparse_gradients, y.sparse_gradients)
            ),
        )
        for x, y in zip(a.layers, b.layers)
    )


def _same_structure(a: Graph, b: Graph) -> bool:
    if len(a.ops) != len(b.ops) or len(a.edges) != len(b.edges):
        return False
    if a.layers != b.layers and [_without_rows(x) for x in a.layers] != [
        _without_rows(y) for y in b.layers
    ]:
        return False
    for x, y in zip(a.ops, b.ops):
        if (x.id, x.op_type, x.layer, x.phase, x.output_dtypes) != (
            y.id,
            y.op_type,
            y.layer,
            y.phase,
            y.output_dtypes,
        ) or [len(s) for s in x.output_shapes] != [len(s) for s in y.output_shapes]:
            return False
    return all(
        (e.src, e.dst, e.output_index) == (f.src, f.dst, f.output_index)
        for e, f in zip(a.edges, b.edges)
    )


def _op_at(x: Op, y: Op, line: _Line) -> Op:
    shapes = tuple(
        tuple(line(d1, d2) for d1, d2 in zip(s1, s2))
        for s1, s2 in zip(x.output_shapes, y.output_shapes)
    )
    return replace(
        x,
        output_shapes=shapes,
        output_bytes=line(x.output_bytes, y.output_bytes),
        flops=line(x.flops, y.flops),
        transposed_bytes=line(x.transposed_bytes, y.transposed_bytes),
    )


def graph_at_batch(a: Graph, b: Graph, batch: int) -> Graph | None:
    """The graph of the step at ``batch`` from the graphs ``a`` and ``b`` of the same model
    traced at two different batch sizes (see the module docstring); None when the two differ
    in structure or a value is not affine in the batch there."""
    if a.batch_size == b.batch_size or batch < 1:
        return None
    if batch in (a.batch_size, b.batch_size):
        return a if batch == a.batch_size else b
    if not _same_structure(a, b):
        return None
    line = _Line(a.batch_size, b.batch_size, batch)
    try:
        ops = tuple(_op_at(x, y, line) for x, y in zip(a.ops, b.ops))
        edges = tuple(
            e if e.bytes == f.bytes else Edge(e.src, e.dst, line(e.bytes, f.bytes), e.output_index)
            for e, f in zip(a.edges, b.edges)
        )
        layers = a.layers if a.layers == b.layers else _layers_at(a, b, line)
        targets = line(a.target_bytes, b.target_bytes)
    except _NotAffine:
        return None
    return Graph(a.name, ops, edges, layers, batch_size=batch, target_bytes=targets)
