"""The shared vocabulary of `partitioner`: the op graph, its layer-level view, devices and links,
the costed problem a solver sees, and a solver's result.

Every type here is a frozen dataclass of tuples; nothing here imports TensorFlow. Every package may
import this module (and :mod:`partitioner.core.errors`); this module imports nothing of ours but errors.

Data flows one way::

    model --trace--> Graph --costs--> CostedGraph --problem()--> PartitionProblem --solve--> SolverResult
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

from partitioner.core.errors import InvalidGraphError

__all__ = [
    "AllReduceFit",
    "CostedGraph",
    "Device",
    "Edge",
    "EventKind",
    "Graph",
    "LayerEdge",
    "LayerGraph",
    "LayerInfo",
    "LayerMemory",
    "LayerNode",
    "Link",
    "Op",
    "PartitionProblem",
    "Phase",
    "Schedule",
    "SolveStatus",
    "SolverResult",
    "SparseGradient",
    "TensorCountFit",
    "TimelineEvent",
    "Topology",
    "peak_bytes",
]


_NOT_ACTIVATIONS = frozenset({"ReadVariableOp", "VarHandleOp", "Const"})
"""Forward ops whose outputs the backward reads but that are no saved activations: reads of the
weights (the runtime aliases the variable's buffer; the weights are counted as parameters) and
constants."""
_GRADIENT_SUMS = frozenset({"AddN", "AccumulateNV2"})
"""Ops ``tf.gradients`` uses to add a tensor's partial gradients from its several consumers."""


class Phase(enum.Enum):
    """Which part of a training step an op belongs to."""

    FORWARD = "forward"
    BACKWARD = "backward"


class Schedule(enum.Enum):
    """How micro-batches flow through pipeline stages."""

    NONE = "none"
    """No pipelining: one batch goes forward through every stage, then backward."""
    GPIPE = "gpipe"
    """GPipe (Huang et al., 2019): all micro-batches forward, then all backward."""
    ONE_F_ONE_B = "1f1b"
    """1F1B (PipeDream-Flush, Narayanan et al., 2021): after a warm-up of forwards, each stage
    alternates one forward and one backward, bounding live activations by the stage count."""

    @property
    def label(self) -> str:
        """The schedule's name as its paper writes it (its value where none is set)."""
        return {"gpipe": "GPipe", "1f1b": "1F1B"}.get(self.value, self.value)


class EventKind(enum.Enum):
    """What a timeline event is: compute on a device, or a transfer on a link."""

    FORWARD = "forward"
    BACKWARD = "backward"
    TRANSFER = "transfer"
    UPDATE = "update"
    """The optimizer's update after the last backward."""


@dataclass(frozen=True)
class TimelineEvent:
    """One interval of a simulated step on one resource.

    ``resource`` names a device (``"device 0"``) or a link channel (``"link 0->1"``,
    ``"hosts 0->1"``); ``label`` names what ran (a layer, a stage, a tensor);
    ``microbatch`` is 0 without pipelining.
    """

    resource: str
    kind: EventKind
    label: str
    start_s: float
    end_s: float
    microbatch: int = 0

    def __post_init__(self) -> None:
        if not (0.0 <= self.start_s <= self.end_s) or not math.isfinite(self.end_s):
            raise InvalidGraphError(
                f"timeline event {self.label!r} on {self.resource}: start_s={self.start_s} and "
                f"end_s={self.end_s} must satisfy 0 <= start <= end < inf"
            )


@dataclass(frozen=True)
class Op:
    """One operation of the traced training step.

    ``layer`` is the exact owning Keras layer (the innermost placement unit whose ``__call__``
    created the op), or ``None`` for glue ops created outside every unit (inputs, loss, captures).
    Backward ops are owned by the layer of the forward op they are the gradient of.
    """

    id: str
    op_type: str
    layer: str | None
    phase: Phase
    output_shapes: tuple[tuple[int, ...], ...] = ()
    output_dtypes: tuple[str, ...] = ()
    output_bytes: int = 0
    flops: int = 0
    transposed_bytes: int = 0
    """Bytes of the operands the kernel reads transposed (``MatMul``'s ``transpose_a/b``,
    ``BatchMatMul``'s ``adj_x/y``): a CPU kernel reorders a transposed weight on every call."""

    def __post_init__(self) -> None:
        if len(self.output_shapes) != len(self.output_dtypes):
            raise InvalidGraphError(
                f"op {self.id!r}: {len(self.output_shapes)} output shapes but "
                f"{len(self.output_dtypes)} output dtypes"
            )
        if self.output_bytes < 0 or self.flops < 0:
            raise InvalidGraphError(
                f"op {self.id!r}: negative output_bytes={self.output_bytes} or flops={self.flops}"
            )


@dataclass(frozen=True)
class Edge:
    """A tensor flowing from ``src`` (output ``output_index``) to ``dst``."""

    src: str
    dst: str
    bytes: int
    output_index: int = 0

    @property
    def tensor(self) -> tuple[str, int]:
        """The tensor's identity: its producing op and output index."""
        return (self.src, self.output_index)


@dataclass(frozen=True)
class SparseGradient:
    """A trainable variable whose gradient reaches the optimizer as ``tf.IndexedSlices``.

    The gradient of a gathered variable (an ``Embedding``'s table read by ``GatherV2``) is the
    gathered rows and their indices, not the table: ``rows_per_step`` rows of
    ``row_bytes`` values each and one ``index_bytes`` index per row (the indices' dtype: int32
    for Keras's ``Embedding``). ``rows_per_step`` is the number of indices the step gathers at
    the graph's batch (``batch x ids per example``), duplicates included: TensorFlow neither
    removes nor sums repeated ids before the optimizer (``AggregateIndexedSlicesGradients``
    concatenates). Affine in the batch. A variable whose gradient something densifies (a dense
    read of the same variable, a tied output projection) is not sparse and has no record.
    """

    variable: str
    """The variable's path (``embedding/embeddings``)."""
    rows_per_step: int
    row_bytes: int
    index_bytes: int
    dense_bytes: int
    """Bytes of the whole variable: what its gradient would be if dense."""

    def __post_init__(self) -> None:
        if min(self.rows_per_step, self.row_bytes, self.index_bytes, self.dense_bytes) < 0:
            raise InvalidGraphError(
                f"sparse gradient of {self.variable!r}: rows_per_step={self.rows_per_step}, "
                f"row_bytes={self.row_bytes}, index_bytes={self.index_bytes} and "
                f"dense_bytes={self.dense_bytes} must be >= 0"
            )

    @property
    def slices_bytes(self) -> int:
        """Bytes of the gradient as TensorFlow holds and exchanges it: values and indices."""
        return self.rows_per_step * (self.row_bytes + self.index_bytes)


@dataclass(frozen=True)
class LayerInfo:
    """A placement unit: a Keras layer (or an op that stands as a node of a functional graph)."""

    name: str
    class_name: str
    num_params: int = 0
    trainable_params: int = 0
    param_bytes: int = 0
    trainable_param_bytes: int = 0
    sparse_gradients: tuple[SparseGradient, ...] = ()
    """The trainable variables of this layer whose gradients are ``tf.IndexedSlices`` (the rest
    of ``trainable_param_bytes`` has dense gradients)."""
    trainable_tensors: int = 0
    """How many trainable variables (gradient tensors) the layer has, sparse ones included."""

    @property
    def dense_gradient_tensors(self) -> int:
        """How many of this layer's gradients replicas all-reduce (the dense ones)."""
        return max(0, self.trainable_tensors - len(self.sparse_gradients))

    @property
    def dense_gradient_bytes(self) -> int:
        """Bytes of this layer's dense gradients: the trainable weights without sparse ones."""
        sparse = sum(g.dense_bytes for g in self.sparse_gradients)
        return max(0, self.trainable_param_bytes - sparse)

    @property
    def sparse_gradient_bytes(self) -> int:
        """Bytes of this layer's ``IndexedSlices`` gradients at the graph's batch."""
        return sum(g.slices_bytes for g in self.sparse_gradients)


@dataclass(frozen=True)
class LayerNode:
    """A layer in the layer-level view, with the totals of the ops it owns."""

    name: str
    class_name: str
    index: int
    op_ids: tuple[str, ...]
    forward_flops: int
    backward_flops: int
    param_bytes: int
    trainable_param_bytes: int
    activation_bytes: int
    """Bytes of this layer's forward outputs that any backward op reads: the raw count, dead
    gradient branches and views included. What the memory model charges is
    :func:`cost_models.estimate.memory.kept_activation_bytes` (only the backward ops that run,
    each buffer once)."""
    gradient_partial_bytes: int = 0
    """Bytes of the partial gradients this layer's backward sums (the inputs of its ``AddN`` ops:
    a weight an unrolled RNN uses at every step gets one partial gradient per step, all alive
    until they are added). Transient: alive during this layer's backward only."""


@dataclass(frozen=True)
class LayerEdge:
    """Traffic between two layers, normalised so that ``src`` comes before ``dst`` in layer order.

    ``forward_bytes`` counts each forward tensor once per consuming layer; ``backward_bytes``
    counts tensors read by backward ops of the other layer (gradients flowing back, activations
    re-read), also once per consuming layer.
    """

    src: str
    dst: str
    forward_bytes: int
    backward_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


@dataclass(frozen=True)
class LayerGraph:
    """The layer-level view of a :class:`Graph`: nodes in layer order, edges from lower to higher."""

    nodes: tuple[LayerNode, ...]
    edges: tuple[LayerEdge, ...]
    op_owner: Mapping[str, str] = field(compare=False, repr=False)
    """Effective owner of every op: its layer, or for glue ops the layer it is merged into."""

    @cached_property
    def index(self) -> Mapping[str, int]:
        return MappingProxyType({n.name: i for i, n in enumerate(self.nodes)})


@dataclass(frozen=True)
class Graph:
    """The op graph of one training step, in topological order.

    Validated on construction: unique op ids, edges between known ops, every edge from an earlier
    op to a later one (so the order is topological and the graph acyclic), every op's layer known.
    """

    name: str
    ops: tuple[Op, ...]
    edges: tuple[Edge, ...]
    layers: tuple[LayerInfo, ...]
    batch_size: int = 1
    target_bytes: int = 0
    """Bytes of the training targets one step feeds besides the model's inputs: a target the
    size of each floating-point output (a loss compares each output with a target of its
    shape), at ``batch_size``. The trace's loss stands in for the user's, so no op reads them;
    a client feeding a remote step sends them with the inputs."""

    def __post_init__(self) -> None:
        position: dict[str, int] = {}
        for i, op in enumerate(self.ops):
            if op.id in position:
                raise InvalidGraphError(f"graph {self.name!r}: duplicate op id {op.id!r}")
            position[op.id] = i
        layer_names = [layer.name for layer in self.layers]
        if len(set(layer_names)) != len(layer_names):
            dupes = sorted({n for n in layer_names if layer_names.count(n) > 1})
            raise InvalidGraphError(f"graph {self.name!r}: duplicate layer names {dupes}")
        known_layers = set(layer_names)
        for op in self.ops:
            if op.layer is not None and op.layer not in known_layers:
                raise InvalidGraphError(
                    f"graph {self.name!r}: op {op.id!r} names unknown layer {op.layer!r}"
                )
        for e in self.edges:
            if e.src not in position or e.dst not in position:
                missing = e.src if e.src not in position else e.dst
                raise InvalidGraphError(f"graph {self.name!r}: edge names unknown op {missing!r}")
            if position[e.src] >= position[e.dst]:
                raise InvalidGraphError(
                    f"graph {self.name!r}: edge {e.src!r} -> {e.dst!r} goes backwards in the op "
                    "order: the ops are not topologically sorted or the graph has a cycle"
                )
            if e.bytes < 0:
                raise InvalidGraphError(
                    f"graph {self.name!r}: edge {e.src!r} -> {e.dst!r} bytes < 0"
                )
        if self.batch_size < 1:
            raise InvalidGraphError(f"graph {self.name!r}: batch_size={self.batch_size} < 1")
        if self.target_bytes < 0:
            raise InvalidGraphError(f"graph {self.name!r}: target_bytes={self.target_bytes} < 0")

    @cached_property
    def op_index(self) -> Mapping[str, int]:
        return MappingProxyType({op.id: i for i, op in enumerate(self.ops)})

    @cached_property
    def in_edges(self) -> tuple[tuple[Edge, ...], ...]:
        """Edges into each op, by op position."""
        incoming: list[list[Edge]] = [[] for _ in self.ops]
        for e in self.edges:
            incoming[self.op_index[e.dst]].append(e)
        return tuple(tuple(x) for x in incoming)

    @cached_property
    def out_edges(self) -> tuple[tuple[Edge, ...], ...]:
        """Edges out of each op, by op position."""
        outgoing: list[list[Edge]] = [[] for _ in self.ops]
        for e in self.edges:
            outgoing[self.op_index[e.src]].append(e)
        return tuple(tuple(x) for x in outgoing)

    @cached_property
    def layer_graph(self) -> LayerGraph:
        """The layer-level view; glue ops are merged into a neighbouring layer."""
        if not self.layers:
            raise InvalidGraphError(f"graph {self.name!r} has no layers to place")
        layer_pos = {layer.name: i for i, layer in enumerate(self.layers)}
        owner = [layer_pos[name] for name in self._resolved_owners(layer_pos)]
        op_ids, fwd_flops, bwd_flops = self._layer_ops_and_flops(owner)
        partial_bytes = self._gradient_partial_bytes(owner)
        saved_bytes, traffic = self._saved_activations_and_traffic(owner)
        nodes = tuple(
            LayerNode(
                name=info.name,
                class_name=info.class_name,
                index=k,
                op_ids=tuple(op_ids[k]),
                forward_flops=fwd_flops[k],
                backward_flops=bwd_flops[k],
                param_bytes=info.param_bytes,
                trainable_param_bytes=info.trainable_param_bytes,
                activation_bytes=saved_bytes[k],
                gradient_partial_bytes=partial_bytes[k],
            )
            for k, info in enumerate(self.layers)
        )
        edges = tuple(
            LayerEdge(self.layers[a].name, self.layers[b].name, fb, bb)
            for (a, b), (fb, bb) in sorted(traffic.items())
        )
        owner_map = MappingProxyType({op.id: self.layers[k].name for op, k in zip(self.ops, owner)})
        return LayerGraph(nodes=nodes, edges=edges, op_owner=owner_map)

    def _resolved_owners(self, layer_pos: Mapping[str, int]) -> list[str]:
        """The layer of every op, glue ops (``layer=None``) merged into a neighbouring layer.

        Glue ops join a producer's layer, chosen along the data's direction so that merging never
        makes data flow against the layer order (which a pipeline's stages follow): a forward
        glue op joins its latest producer layer (a loss reading two heads runs after both); a
        backward one joins the earliest layer among its backward producers (the gradient has
        come back that far). Else the earliest owned consumer (in layer order), else the first
        layer.
        """
        owner: list[str | None] = [op.layer for op in self.ops]
        for i, op in enumerate(self.ops):
            if owner[i] is not None:
                continue
            producers = [self.op_index[e.src] for e in self.in_edges[i]]
            owned = [j for j in producers if owner[j] is not None]
            if op.phase is Phase.BACKWARD:
                backward = [j for j in owned if self.ops[j].phase is Phase.BACKWARD]
                if backward:
                    owner[i] = min((owner[j] for j in backward), key=lambda n: layer_pos[n or ""])
                    continue
            if owned:
                owner[i] = max((owner[j] for j in owned), key=lambda n: layer_pos[n or ""])
        for i in reversed(range(len(self.ops))):
            if owner[i] is None:
                # An op no layer feeds (a model input, a constant) joins its earliest consumer in
                # layer order, so the layer edges it makes point the way the data flows.
                consumer_layers = [
                    c for e in self.out_edges[i] if (c := owner[self.op_index[e.dst]]) is not None
                ]
                if consumer_layers:
                    owner[i] = min(consumer_layers, key=lambda n: layer_pos[n])
        first = self.layers[0].name
        return [o if o is not None else first for o in owner]

    def _layer_ops_and_flops(
        self, owner: Sequence[int]
    ) -> tuple[list[list[str]], list[int], list[int]]:
        """Each layer's ops (in op order), forward FLOPs and backward FLOPs."""
        op_ids: list[list[str]] = [[] for _ in self.layers]
        fwd_flops = [0] * len(self.layers)
        bwd_flops = [0] * len(self.layers)
        for op, k in zip(self.ops, owner):
            op_ids[k].append(op.id)
            if op.phase is Phase.FORWARD:
                fwd_flops[k] += op.flops
            else:
                bwd_flops[k] += op.flops
        return op_ids, fwd_flops, bwd_flops

    def _gradient_partial_bytes(self, owner: Sequence[int]) -> list[int]:
        """Each layer's bytes of partial gradients: the inputs of its backward gradient sums."""
        partial_bytes = [0] * len(self.layers)
        for i, op in enumerate(self.ops):
            if (
                op.phase is Phase.BACKWARD
                and op.op_type in _GRADIENT_SUMS
                and len(self.in_edges[i]) > 1
            ):
                partial_bytes[owner[i]] += sum(e.bytes for e in self.in_edges[i])
        return partial_bytes

    def _saved_activations_and_traffic(
        self, owner: Sequence[int]
    ) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
        """Each layer's saved activation bytes (forward tensors the backward reads, each once),
        and the ``[forward, backward]`` bytes between every pair of layers ``(low, high)``
        (each tensor once per consuming layer)."""
        saved: list[set[tuple[str, int]]] = [set() for _ in self.layers]
        saved_bytes = [0] * len(self.layers)
        traffic: dict[tuple[int, int], list[int]] = {}
        seen: set[tuple[tuple[str, int], int]] = set()
        for e in self.edges:
            si, di = self.op_index[e.src], self.op_index[e.dst]
            src_op, dst_op = self.ops[si], self.ops[di]
            ks, kd = owner[si], owner[di]
            if (
                src_op.phase is Phase.FORWARD
                and dst_op.phase is Phase.BACKWARD
                and src_op.op_type not in _NOT_ACTIVATIONS
            ):
                if e.tensor not in saved[ks]:
                    saved[ks].add(e.tensor)
                    saved_bytes[ks] += e.bytes
            if ks == kd or (e.tensor, kd) in seen:
                continue
            seen.add((e.tensor, kd))
            key = (min(ks, kd), max(ks, kd))
            slot = traffic.setdefault(key, [0, 0])
            slot[0 if dst_op.phase is Phase.FORWARD else 1] += e.bytes
        return saved_bytes, traffic


@dataclass(frozen=True)
class Link:
    """A link between two devices: time = latency + bytes / bandwidth."""

    kind: str
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth_bytes_per_s > 0):
            raise InvalidGraphError(
                f"link {self.kind!r}: latency_s={self.latency_s} must be >= 0 and "
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} > 0"
            )

    def transfer_time_s(self, num_bytes: float) -> float:
        if num_bytes <= 0:
            return 0.0
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass(frozen=True)
class Device:
    """One device of a topology.

    ``host`` numbers the machine the device sits in (devices on different hosts talk over the
    topology's ``inter_host_link``); ``name`` is the TensorFlow device string to place on
    (``"/job:worker/replica:0/task:1/device:GPU:0"``), or ``""`` for the local default
    (``/device:GPU:<index>`` style names chosen at rewrite time).
    """

    index: int
    device_type: str
    memory_bytes: int
    host: int = 0
    name: str = ""

    def __post_init__(self) -> None:
        if self.memory_bytes < 0 or self.host < 0:
            raise InvalidGraphError(
                f"device {self.index} ({self.device_type}): memory_bytes={self.memory_bytes} and "
                f"host={self.host} must be >= 0"
            )


@dataclass(frozen=True)
class TensorCountFit:
    """The same measured all-reduce of ``tensors`` tensors at a time: ``latency_s + bytes /
    bandwidth`` (:attr:`AllReduceFit.many`)."""

    tensors: int
    latency_s: float
    bandwidth_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.tensors >= 1 and self.latency_s >= 0 and self.bandwidth_bytes_per_s > 0):
            raise InvalidGraphError(
                f"all-reduce fit of {self.tensors} tensors: tensors must be >= 1, "
                f"latency_s={self.latency_s} >= 0 and bandwidth_bytes_per_s="
                f"{self.bandwidth_bytes_per_s} > 0"
            )


@dataclass(frozen=True)
class AllReduceFit:
    """A measured all-reduce among ``members`` devices: ``latency_s + bytes / bandwidth``.

    Fitted by least squares from timed all-reduces of gradient-like tensor lists as the runtime
    runs them (e.g. ``MultiWorkerMirroredStrategy``'s batched collective); ``algorithm`` is the
    algorithm it measured (``"ring"``, ``"reduce_to_one"``) or ``None`` for whichever the runtime
    chose. :mod:`cost_models.estimate.collectives` uses it instead of the link-derived estimate.

    ``tensors`` is how many tensors each measured all-reduce held (0: not recorded), and
    ``many`` the same all-reduce measured with more tensors: each tensor is its own transfer and
    sum, so a model's gradient list of ``n`` tensors is priced between the two
    (:func:`cost_models.estimate.collectives.measured_all_reduce_s`).
    """

    latency_s: float
    bandwidth_bytes_per_s: float
    members: int
    source: str
    algorithm: str | None = None
    tensors: int = 0
    many: TensorCountFit | None = None

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and self.bandwidth_bytes_per_s > 0 and self.members >= 2):
            raise InvalidGraphError(
                f"all-reduce fit: latency_s={self.latency_s} must be >= 0, "
                f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} > 0 and "
                f"members={self.members} >= 2"
            )
        if self.algorithm not in (None, "ring", "reduce_to_one"):
            raise InvalidGraphError(
                f"all-reduce fit: algorithm={self.algorithm!r} must be 'ring', 'reduce_to_one' "
                "or None"
            )
        if self.many is not None and not 1 <= self.tensors < self.many.tensors:
            raise InvalidGraphError(
                f"all-reduce fit: a fit of {self.many.tensors} tensors needs the base fit's "
                f"tensors ({self.tensors}) from 1 to fewer than that"
            )


@dataclass(frozen=True)
class Topology:
    """Devices and the links between them.

    ``link_between(a, b)`` is, in order: an explicit per-pair override from ``links`` (stored
    with ``a < b``, symmetric), the ``inter_host_link`` when ``a`` and ``b`` sit on different
    hosts, else the intra-host ``link``.

    Transfers that share a physical link share its bandwidth: :meth:`channel_between` names
    the queue a transfer waits in. Intra-host pairs each have their own directed channel
    (point-to-point PCIe/NVLink); all traffic from host ``h`` to host ``g`` shares one
    channel (one NIC per host and direction).

    ``all_reduce`` is an optional measured all-reduce (:class:`AllReduceFit`) that replaces the
    estimate from the links when present.

    A topology measured by ``partition calibrate`` also carries the client's cost of a step
    (``client_step_s``, ``client_link``: every simulated step pays them) and ``device_flops_per_s`` (each
    device's float32 matrix-product FLOP/s, in device order; empty when not measured), which
    scales op times profiled on the planning machine to each device, and
    ``cluster_addresses`` (the measured cluster's task addresses, in task order), which a plan
    records so that applying it to another cluster is refused.
    """

    devices: tuple[Device, ...]
    link: Link
    inter_host_link: Link | None = None
    links: tuple[tuple[int, int, Link], ...] = ()
    all_reduce: AllReduceFit | None = None
    device_flops_per_s: tuple[float, ...] = ()
    cluster_addresses: tuple[str, ...] = ()
    client_step_s: float = 0.0
    """The fixed cost of one training step driven from a cluster's client (Keras's call, the
    remote function's dispatch), measured by ``partition calibrate``; 0 when not measured."""
    client_link: Link | None = None
    """The link the client feeds each step's input batch over (measured), or None."""
    concurrent_compute_factor: float = 1.0
    """How much longer a training step's compute takes on each device while every device
    computes at once than on one alone (their cores share a machine's memory bandwidth and
    caches), measured by ``partition calibrate`` on a reference step of matrix products; 1 when
    not measured. Data-parallel replicas compute at once for their whole step
    (:func:`~partitioner.simulation.strategy.simulate_strategy`)."""
    concurrent_memory_factor: float | None = None
    """The same for a memory-bound reference (elementwise passes over tensors larger than a
    core's caches): cores that share a memory bus slow such work far more (x1.24-1.28 on the
    two-core test machine, where the matrix-product step slowed x1.00-1.05). ``None``: not
    measured, memory-bound work is taken to slow as the compute reference does.
    :meth:`concurrent_factor` mixes the two by a piece of work's memory-bound share."""

    def concurrent_factor(self, memory_share: float) -> float:
        """How much longer work runs while every device computes at once: the compute
        reference's factor for its compute-bound part, the memory reference's for the
        ``memory_share`` (0..1) of it that is memory traffic."""
        compute = self.concurrent_compute_factor
        memory = compute if self.concurrent_memory_factor is None else self.concurrent_memory_factor
        return compute + (memory - compute) * memory_share

    def __post_init__(self) -> None:
        if not self.devices:
            raise InvalidGraphError("a topology needs at least one device")
        for i, d in enumerate(self.devices):
            if d.index != i:
                raise InvalidGraphError(f"device {i} has index {d.index}; indices must be 0..N-1")
        n = len(self.devices)
        seen: set[tuple[int, int]] = set()
        for a, b, _ in self.links:
            if not 0 <= a < b < n or (a, b) in seen:
                raise InvalidGraphError(
                    f"link override ({a}, {b}) must name two devices 0 <= a < b < {n}, once"
                )
            seen.add((a, b))
        if self.num_hosts > 1 and self.inter_host_link is None:
            raise InvalidGraphError(
                f"devices sit on {self.num_hosts} hosts but the topology has no inter_host_link"
            )
        if not 0.0 <= self.client_step_s < math.inf:
            raise InvalidGraphError(f"client_step_s={self.client_step_s} must be >= 0 seconds")
        for name in ("concurrent_compute_factor", "concurrent_memory_factor"):
            factor = getattr(self, name)
            if factor is not None and not 1.0 <= factor < math.inf:
                raise InvalidGraphError(f"{name}={factor} must be >= 1")
        if self.device_flops_per_s and (
            len(self.device_flops_per_s) != n or not all(f > 0 for f in self.device_flops_per_s)
        ):
            raise InvalidGraphError(
                f"device_flops_per_s={list(self.device_flops_per_s)} must give {n} speeds > 0 "
                "(one per device) or none"
            )

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @cached_property
    def num_hosts(self) -> int:
        return len({d.host for d in self.devices})

    @cached_property
    def _overrides(self) -> dict[tuple[int, int], Link]:
        # A plain dict (not a MappingProxyType) so topologies stay picklable for solver workers.
        return {(a, b): link for a, b, link in self.links}

    def link_between(self, a: int, b: int) -> Link | None:
        """The link from device ``a`` to ``b``; ``None`` when they are the same device."""
        if a == b:
            return None
        key = (a, b) if a < b else (b, a)
        override = self._overrides.get(key)
        if override is not None:
            return override
        if self.inter_host_link is not None and self.devices[a].host != self.devices[b].host:
            return self.inter_host_link
        return self.link

    def channel_between(self, a: int, b: int) -> tuple[str, int, int]:
        """The queue a transfer ``a -> b`` waits in: shared per host pair across hosts."""
        ha, hb = self.devices[a].host, self.devices[b].host
        if ha != hb and (min(a, b), max(a, b)) not in self._overrides:
            return ("host", ha, hb)
        return ("device", a, b)

    @cached_property
    def is_uniform(self) -> bool:
        """Whether every pair of distinct devices has the same link and every device the same type."""
        n = self.num_devices
        if len({(d.device_type, d.memory_bytes) for d in self.devices}) > 1:
            return False
        kinds = {self.link_between(a, b) for a in range(n) for b in range(a + 1, n)}
        return len(kinds) <= 1

    @cached_property
    def slowest_link(self) -> Link | None:
        """The link of lowest bandwidth between any two devices (``None`` for one device)."""
        n = self.num_devices
        links = [self.link_between(a, b) for a in range(n) for b in range(a + 1, n)]
        present = [x for x in links if x is not None]
        if not present:
            return None
        return min(present, key=lambda x: (x.bandwidth_bytes_per_s, -x.latency_s))


@dataclass(frozen=True)
class LayerMemory:
    """Memory a layer needs on its device during training, in bytes."""

    layer: str
    param_bytes: int
    gradient_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    transient_bytes: int = 0
    """Alive only while the layer's backward runs (its partial gradients before they are summed):
    a device's peak is the sum of its layers' ``total_bytes`` plus the largest of their
    ``transient_bytes`` (:func:`cost_models.estimate.memory.peak_memory_bytes`). Solvers count it in full
    per layer (:attr:`footprint_bytes`), which never understates a device's peak."""
    sparse_gradient_bytes: int = 0
    """Of ``gradient_bytes``, the bytes of ``tf.IndexedSlices`` gradients (values and indices of
    the rows one replica's step gathers, :class:`SparseGradient`): replicas exchange them by an
    all-gather, the rest by an all-reduce (:mod:`cost_models.estimate.collectives`)."""
    sparse_gradient_dense_bytes: int = 0
    """Bytes of the variables whose gradients make ``sparse_gradient_bytes``: their gradients'
    size where a rewrite densifies them (:meth:`densified`)."""

    @property
    def dense_gradient_bytes(self) -> int:
        """Bytes of the gradients replicas all-reduce (``gradient_bytes`` less the slices)."""
        return self.gradient_bytes - self.sparse_gradient_bytes

    def densified(self) -> LayerMemory:
        """This layer's memory where its ``IndexedSlices`` gradients are made dense (a rewrite
        that adds micro-batch gradients into dense sums): each is its variable's size, and the
        conversion's dense tensor is alive beside the sum (a transient of one table)."""
        if not self.sparse_gradient_dense_bytes:
            return self
        return LayerMemory(
            layer=self.layer,
            param_bytes=self.param_bytes,
            gradient_bytes=self.dense_gradient_bytes + self.sparse_gradient_dense_bytes,
            optimizer_bytes=self.optimizer_bytes,
            activation_bytes=self.activation_bytes,
            transient_bytes=max(self.transient_bytes, self.sparse_gradient_dense_bytes),
        )

    @property
    def total_bytes(self) -> int:
        """Resident bytes: weights, gradients, optimizer slots and saved activations."""
        return self.param_bytes + self.gradient_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def footprint_bytes(self) -> int:
        """Resident plus transient bytes: what the layer needs while its backward runs."""
        return self.total_bytes + self.transient_bytes


def peak_bytes(memories: Iterable[LayerMemory]) -> int:
    """Peak memory of layers sharing a device: their resident bytes plus the largest transient."""
    resident = transient = 0
    for m in memories:
        resident += m.total_bytes
        transient = max(transient, m.transient_bytes)
    return resident + transient


@dataclass(frozen=True)
class CostedGraph:
    """A graph with costs for one topology.

    ``op_compute_time_s[d][i]`` is the time of op ``i`` on device ``d``; ``layer_memory`` follows
    the graph's layer order. ``measured`` names the layers whose times were profiled.
    ``op_memory_share[i]`` is the part (0..1) of op ``i``'s time that is memory traffic (its
    roofline's memory term over both terms; an optimizer's update given to the op counts whole),
    what :meth:`Topology.concurrent_factor` prices when devices compute at once; empty: not
    known, every op taken as compute-bound.
    """

    graph: Graph
    topology: Topology
    op_compute_time_s: tuple[tuple[float, ...], ...]
    layer_memory: tuple[LayerMemory, ...]
    measured: tuple[str, ...] = ()
    op_memory_share: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n_ops = len(self.graph.ops)
        if len(self.op_compute_time_s) != self.topology.num_devices:
            raise InvalidGraphError(
                f"{len(self.op_compute_time_s)} rows of op times for "
                f"{self.topology.num_devices} devices"
            )
        # devices of one type share one row object: check each distinct row once
        for row in {id(r): r for r in self.op_compute_time_s}.values():
            if len(row) != n_ops or not all(0.0 <= t < math.inf for t in row):
                raise InvalidGraphError(
                    f"op times must be {n_ops} finite non-negative numbers per device"
                )
        if tuple(m.layer for m in self.layer_memory) != tuple(x.name for x in self.graph.layers):
            raise InvalidGraphError("layer_memory must follow the graph's layer order")
        shares = self.op_memory_share
        if shares and (len(shares) != n_ops or not all(0.0 <= x <= 1.0 for x in shares)):
            raise InvalidGraphError(f"op_memory_share must be {n_ops} numbers in [0, 1] or none")

    def concurrent_factor(self, device: int, ops: Iterable[int] | None = None) -> float:
        """:meth:`Topology.concurrent_factor` of the work of ``ops`` (default: every op) on
        ``device``: their memory-bound share weighted by their times there."""
        topology, shares = self.topology, self.op_memory_share
        if not shares or topology.concurrent_memory_factor in (
            None,
            topology.concurrent_compute_factor,
        ):  # one factor for every op
            return topology.concurrent_factor(0.0)
        row = self.op_compute_time_s[device]
        chosen = range(len(row)) if ops is None else tuple(ops)
        total = math.fsum(row[i] for i in chosen)
        memory = math.fsum(row[i] * shares[i] for i in chosen)
        return topology.concurrent_factor(memory / total if total > 0 else 0.0)

    @cached_property
    def layer_compute_time_s(self) -> tuple[tuple[float, ...], ...]:
        """Forward + backward time of each layer (layer order) on each device; devices that share
        a row of op times share their row of layer times (each distinct row summed once)."""
        lg = self.graph.layer_graph
        owner = [lg.index[lg.op_owner[op.id]] for op in self.graph.ops]
        made: dict[int, tuple[float, ...]] = {}
        for d_times in self.op_compute_time_s:
            if id(d_times) not in made:
                per_layer = [0.0] * len(lg.nodes)
                for k, t in zip(owner, d_times):
                    per_layer[k] += t
                made[id(d_times)] = tuple(per_layer)
        return tuple(made[id(d_times)] for d_times in self.op_compute_time_s)

    def problem(self) -> PartitionProblem:
        """The layer-level problem a solver sees (built once per costed graph)."""
        return self._problem

    @cached_property
    def _problem(self) -> PartitionProblem:
        lg = self.graph.layer_graph
        return PartitionProblem(
            layers=tuple(n.name for n in lg.nodes),
            compute_time_s=self.layer_compute_time_s,
            memory_bytes=tuple(m.total_bytes for m in self.layer_memory),
            transient_bytes=tuple(m.transient_bytes for m in self.layer_memory),
            edges=tuple((lg.index[e.src], lg.index[e.dst], e.total_bytes) for e in lg.edges),
            topology=self.topology,
        )


@dataclass(frozen=True)
class PartitionProblem:
    """What a solver sees: layers in order, per-device times, memory, traffic, devices.

    ``compute_time_s[d][k]`` is layer ``k``'s forward+backward time on device ``d``;
    ``edges`` are ``(src, dst, bytes)`` with ``src < dst`` (layer order). ``memory_bytes`` is
    each layer's resident bytes and ``transient_bytes`` what it adds only while its backward
    runs: a device's peak is the sum of its layers' resident bytes plus the largest of their
    transients (:func:`peak_bytes`), not the sum of both (that counted every batch norm's
    partial input gradients at once: ResNet-50 at batch 256 needed 61 GiB, not 23).
    """

    layers: tuple[str, ...]
    compute_time_s: tuple[tuple[float, ...], ...]
    memory_bytes: tuple[int, ...]
    edges: tuple[tuple[int, int, int], ...]
    topology: Topology
    colocate: tuple[tuple[int, ...], ...] = ()
    """Groups of layers (by index) that must share a device."""
    transient_bytes: tuple[int, ...] = ()
    """Per layer, bytes alive only during its backward (empty: none)."""

    def __post_init__(self) -> None:
        n = len(self.layers)
        for group in self.colocate:
            if any(not 0 <= k < n for k in group):
                raise InvalidGraphError(
                    f"colocation group {group} names a layer outside 0..{n - 1}"
                )
        if n == 0:
            raise InvalidGraphError("a partition problem needs at least one layer")
        if self.transient_bytes and len(self.transient_bytes) != n:
            raise InvalidGraphError("transient_bytes must have one entry per layer (or none)")
        if len(self.memory_bytes) != n or any(len(r) != n for r in self.compute_time_s):
            raise InvalidGraphError(
                "compute_time_s rows and memory_bytes must have one entry per layer"
            )
        if len(self.compute_time_s) != self.topology.num_devices:
            raise InvalidGraphError("compute_time_s needs one row per device")
        for a, b, nbytes in self.edges:
            if not (0 <= a < b < n) or nbytes < 0:
                raise InvalidGraphError(f"bad layer edge ({a}, {b}, {nbytes}) for {n} layers")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_devices(self) -> int:
        return self.topology.num_devices


class SolveStatus(enum.Enum):
    """How a solver's answer stands."""

    OPTIMAL = "optimal"
    FEASIBLE = "feasible"
    """Feasible, found by a search that may have stopped at its time limit."""
    HEURISTIC = "heuristic"
    """Feasible, found by a heuristic or baseline that proves nothing about optimality."""


@dataclass(frozen=True)
class SolverResult:
    """A solver's placement: ``assignment[k]`` is the device of layer ``k`` (problem order)."""

    solver: str
    assignment: tuple[int, ...]
    status: SolveStatus
    objective: float | None = None
    solve_time_s: float = 0.0
    notes: tuple[str, ...] = ()
    best_bound: float | None = None
    """A proven lower bound on the objective (from an exact solver), when one is known."""

    @property
    def gap(self) -> float | None:
        """Relative gap between the objective and the best bound (0 when proven optimal)."""
        if self.objective is None or self.best_bound is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.best_bound) / self.objective)
