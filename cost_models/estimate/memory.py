"""Training memory per layer: weights, gradients, optimizer slots and saved activations.

**Which tensors the backward keeps.** TensorFlow keeps a forward tensor alive until the last
backward op that reads it has run, and each op's gradient function decides what it reads; the
trace records those reads as forward -> backward edges. :func:`kept_activation_bytes` counts,
per layer, every forward tensor that a backward op *which runs* reads, each buffer once:

* **Only backward ops that run.** ``tf.gradients`` builds the gradient of every input of an op,
  constants included: a ``Mul`` by a constant (GELU's ``0.5 * x``, attention's ``1/sqrt(d)``
  scale) gets a branch ``Mul -> Sum -> Reshape`` for the constant's gradient that nothing
  consumes, and a model's first convolution an input gradient nobody fetches. TensorFlow runs
  only the ops the step's outputs (the loss, the gradients) and its side effects (variable
  assignments) need -- ``PruneFunctionBody`` (tensorflow/core/common_runtime/
  function_def_utils.h) "removes all stateless nodes that do not contribute to a return value
  from the function body" -- so a tensor only such a dead branch reads is not kept. The live ops are those from
  which a step output (an ``Identity``/``_Retval`` without consumers: the trace's outputs) or an
  effect op (``Assign*``, ``ResourceApply*``) is reachable. A graph that marks no backward
  output (a hand-built graph) is taken as all live.
* **Each buffer once per layer.** A view (``Reshape``, ``Identity``, ``Squeeze``,
  ``ExpandDims``, ``StopGradient``: TensorFlow forwards the input buffer) is the tensor it
  views: a layer norm's output read directly by three attention projections and through a
  ``Reshape`` by a dense layer's weight gradient is one buffer. A view of a weight
  (``ReadVariableOp`` -> ``Reshape``: Keras 3's ``EinsumDense`` kernel, the weightless trace's
  stand-ins) is the weight, counted as a parameter, not as an activation.

Per op class (TensorFlow's registered gradients, without XLA):

==============================  ============================================================
op class                        kept for the backward
==============================  ============================================================
ReLU, sigmoid, tanh, softmax    its output (the gradient is a function of ``y``)
convolution, matmul             its input (weight gradient) and its weights (input gradient;
                                weights are parameters, not activations)
batch matmul (attention)        both operands: Q and K for the scores, the probabilities and
                                V for the context (the probabilities are also the softmax's
                                output: one tensor)
batch norm (Keras 3, unfused)   its input and the batch statistics (per channel, small)
layer norm (Keras 3)            its input, ``gamma * rsqrt(var + eps)`` (broadcast to the
                                input's size) and the statistics (per row, small); its
                                output is kept by the next matmul
GELU (exact, ``erfc``)          ``0.5 x``, ``-x / sqrt 2`` and ``erfc(-x / sqrt 2)`` (three
                                tensors of the FFN width; not ``x`` itself: only the dead
                                constant branches read it); its output by the next matmul
max pooling                     its input and its output (``MaxPoolGrad`` reads both)
``Mul`` by a constant           nothing (the constant's gradient branch does not run)
bias add, add, reshape          nothing (their gradients do not read the forward tensors)
dropout                         its mask
==============================  ============================================================

XLA (``jit_compile``, auto-clustering) fuses an elementwise chain and recomputes its inner
values in the backward fusion, keeping only the chain's inputs: this model counts TensorFlow's
op-by-op graph, an upper bound for XLA runs. A BERT block (post-LN, exact GELU) keeps 28 tensors
the size of ``batch x seq x d_model`` by this count, 12 of them the GELU's three intermediates,
where XLA would keep its input (4).

**Transients.** The partial gradients a layer's backward adds up (a batch norm's input gets
three, one per use of ``x``; an unrolled RNN's weight one per step) are alive only while that
layer's backward runs: a device's peak is its layers' resident bytes plus the *largest*
transient among them (:func:`peak_memory_bytes`, :func:`partitioner.core.ir.peak_bytes`), never
their sum.

**Sparse gradients.** The gradient of a gathered variable (an ``Embedding``'s table) reaches
the optimizer as ``tf.IndexedSlices`` (:class:`~partitioner.core.ir.SparseGradient`): its memory
is the gathered rows and their indices, not the table. The optimizer slots stay the table's size.
An optimizer whose update turns the slices into a table-sized tensor
(:attr:`Optimizer.densifies_sparse_gradients`: momentum, Adam, AdamW, RMSprop) holds that tensor
during the update: it is counted as the layer's transient (a peak term, not resident).

**Precision.** Under mixed precision activations and transients are 16-bit; weights, their
gradients and optimizer slots stay float32 (:mod:`cost_models.estimate.precision`).
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from cost_models.estimate.precision import PrecisionPolicy, bytes_scale, traced_precision
from partitioner.core.errors import PartitionError
from partitioner.core.ir import Graph, LayerMemory, Phase

__all__ = [
    "Optimizer",
    "kept_activation_bytes",
    "layer_memory",
    "live_ops",
    "parse_optimizer",
    "peak_memory_bytes",
]

logger = logging.getLogger(__name__)


class Optimizer(enum.Enum):
    """A training optimizer, by the number of per-parameter state slots it keeps."""

    SGD = "sgd"
    MOMENTUM = "momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    RMSPROP = "rmsprop"
    ADAGRAD = "adagrad"

    @property
    def slots_per_param(self) -> int:
        """Optimizer state tensors kept per trainable weight (each the weight's size)."""
        return _SLOTS[self]

    @property
    def densifies_sparse_gradients(self) -> bool:
        """Whether Keras 3's update step turns an ``IndexedSlices`` gradient into a tensor of
        its variable's size (``UnsortedSegmentSum``, in ``m - g`` and the like): momentum, Adam,
        AdamW and RMSprop do; plain SGD (``scatter_sub``) and Adagrad (scatters into its
        accumulator) keep the rows. After the all-reduce, so the exchange stays sparse."""
        return self.value in _DENSIFYING


_DENSIFYING = frozenset({"momentum", "adam", "adamw", "rmsprop"})


_SLOTS: Mapping[Optimizer, int] = MappingProxyType(
    {
        Optimizer.SGD: 0,
        Optimizer.MOMENTUM: 1,
        Optimizer.ADAM: 2,
        Optimizer.ADAMW: 2,
        Optimizer.RMSPROP: 1,
        Optimizer.ADAGRAD: 1,
    }
)


_VIEW_OPS = frozenset(
    {
        "Reshape",
        "Identity",
        "Squeeze",
        "ExpandDims",
        "StopGradient",
        "PreventGradient",
        "EnsureShape",
    }
)
"""Ops whose output is their (first) input's buffer: TensorFlow forwards it without a copy."""
_NOT_ACTIVATIONS = frozenset({"ReadVariableOp", "VarHandleOp", "VariableV2", "Const"})
"""Buffers that are weights or constants (counted as parameters, or not at all)."""
_OUTPUT_OPS = frozenset({"Identity", "IdentityN", "_Retval", "NoOp"})
"""A step's outputs: an op of these types without consumers is fetched (the loss, a gradient)."""
_EFFECT_PREFIXES = ("Assign", "ResourceApply", "ResourceSparseApply", "ResourceScatter")
"""Op types with side effects (variable updates): they run whether or not anything reads them."""


def _is_sink(graph: Graph, i: int) -> bool:
    """Whether op ``i`` is a step output (an output op nobody reads) or an effect op."""
    op_type = graph.ops[i].op_type
    if op_type.startswith(_EFFECT_PREFIXES):
        return True
    return op_type in _OUTPUT_OPS and not graph.out_edges[i]


def live_ops(graph: Graph) -> tuple[bool, ...]:
    """Which ops of ``graph`` run, by op position: those a step output or an effect op
    (:func:`_is_sink`) depends on. TensorFlow prunes the rest (a constant's gradient branch).
    A graph none of whose backward ops is an output (hand-built) is taken as all live.

    The reverse reachability is written out over the graph's own edge lists rather than taken
    from networkx: building an ``nx.DiGraph`` for it took 1.4 s on the 124,040-op graph of
    :mod:`benchmarks.graph_scale` against 0.18 s here, and it runs once per costed batch."""
    sinks = [i for i in range(len(graph.ops)) if _is_sink(graph, i)]
    if not any(graph.ops[i].phase is Phase.BACKWARD for i in sinks):
        return (True,) * len(graph.ops)
    live = [False] * len(graph.ops)
    for i in sinks:
        live[i] = True
    index, stack = graph.op_index, sinks
    while stack:
        for e in graph.in_edges[stack.pop()]:
            j = index[e.src]
            if not live[j]:
                live[j] = True
                stack.append(j)
    return tuple(live)


def _buffer(graph: Graph, tensor: tuple[str, int]) -> tuple[str, int]:
    """The tensor whose buffer ``tensor`` is: followed back through views (:data:`_VIEW_OPS`)
    along the input of the view's own size."""
    index = graph.op_index
    while True:
        i = index[tensor[0]]
        op = graph.ops[i]
        if op.op_type not in _VIEW_OPS or tensor[1] != 0:
            return tensor
        data = [e for e in graph.in_edges[i] if e.bytes == op.output_bytes]
        if not data:
            return tensor
        tensor = data[0].tensor


def kept_activation_bytes(graph: Graph) -> tuple[int, ...]:
    """Bytes of the forward tensors the backward keeps, per layer (``graph.layers`` order):
    tensors a live backward op reads (:func:`live_ops`), each buffer once per layer
    (:func:`_buffer`), weights and constants excluded; in the layer of the op that hands the
    tensor to the backward (the module docstring lists what each op class keeps)."""
    live = live_ops(graph)
    index, ops = graph.op_index, graph.ops
    owner = graph.layer_graph.op_owner
    position = {info.name: k for k, info in enumerate(graph.layers)}
    kept = [0] * len(graph.layers)
    seen: set[tuple[tuple[str, int], int]] = set()
    for e in graph.edges:
        si, di = index[e.src], index[e.dst]
        if not (ops[si].phase is Phase.FORWARD and ops[di].phase is Phase.BACKWARD and live[di]):
            continue
        buffer = _buffer(graph, e.tensor)
        k = position[owner[e.src]]
        if ops[index[buffer[0]]].op_type in _NOT_ACTIVATIONS or (buffer, k) in seen:
            continue
        seen.add((buffer, k))
        kept[k] += e.bytes
    return tuple(kept)


def parse_optimizer(name: str) -> Optimizer:
    """The optimizer called ``name`` (case-insensitive; ``-``/``_`` ignored), e.g. ``'Adam'``."""
    key = name.strip().lower().replace("-", "").replace("_", "")
    for opt in Optimizer:
        if opt.value == key:
            return opt
    known = ", ".join(o.value for o in Optimizer)
    raise PartitionError(f"unknown optimizer {name!r}; known: {known}")


def layer_memory(
    graph: Graph,
    optimizer: Optimizer = Optimizer.ADAM,
    precision: PrecisionPolicy | None = None,
) -> tuple[LayerMemory, ...]:
    """Training memory of every layer of ``graph``, in ``graph.layers`` order.

    Weights count in full (trainable or not); gradients and ``optimizer.slots_per_param`` state
    slots count the trainable weights only (a sparse gradient its slices, module docstring); activations are the forward tensors the backward pass
    keeps (:func:`kept_activation_bytes`); the transient is the partial
    gradients the layer's backward adds up (:attr:`partitioner.core.ir.LayerNode.gradient_partial_bytes`).

    ``precision``, when it differs from the policy the graph was traced in, rescales the
    activations and transients (:func:`~cost_models.estimate.precision.bytes_scale`: 2 bytes per
    element under mixed precision, 4 otherwise); weights, gradients and optimizer slots stay
    float32 under every policy (mixed precision keeps float32 master weights).
    """
    slots = optimizer.slots_per_param
    nodes = graph.layer_graph.nodes
    kept = kept_activation_bytes(graph)
    scale = 1.0 if precision is None else bytes_scale(traced_precision(graph), precision)
    memories = []
    for info, node, kept_bytes in zip(graph.layers, nodes, kept, strict=True):
        tables = sum(g.dense_bytes for g in info.sparse_gradients)
        densified = tables if optimizer.densifies_sparse_gradients else 0
        memories.append(
            LayerMemory(
                layer=info.name,
                param_bytes=info.param_bytes,
                gradient_bytes=info.dense_gradient_bytes + info.sparse_gradient_bytes,
                optimizer_bytes=slots * info.trainable_param_bytes,
                activation_bytes=round(kept_bytes * scale),
                transient_bytes=max(round(node.gradient_partial_bytes * scale), densified),
                sparse_gradient_bytes=info.sparse_gradient_bytes,
                sparse_gradient_dense_bytes=tables,
            )
        )
    return tuple(memories)


def peak_memory_bytes(
    layer_memory: Sequence[LayerMemory], assignment: Sequence[int], num_devices: int
) -> tuple[int, ...]:
    """Peak training memory on each device when layer ``k`` runs on device ``assignment[k]``.

    The resident bytes of its layers (weights, gradients, optimizer slots, saved activations) plus
    the largest transient of one of them (partial gradients alive while that layer's backward runs;
    the backward pass runs one layer at a time on a device).
    """
    if len(assignment) != len(layer_memory):
        raise PartitionError(
            f"assignment has {len(assignment)} entries for {len(layer_memory)} layers; "
            "give one device per layer"
        )
    if num_devices < 1:
        raise PartitionError(f"num_devices={num_devices} must be >= 1")
    totals = [0] * num_devices
    transient = [0] * num_devices
    for mem, device in zip(layer_memory, assignment, strict=True):
        if not 0 <= device < num_devices:
            raise PartitionError(
                f"layer {mem.layer!r} is assigned to device {device}; devices are 0..{num_devices - 1}"
            )
        totals[device] += mem.total_bytes
        transient[device] = max(transient[device], mem.transient_bytes)
    return tuple(t + x for t, x in zip(totals, transient, strict=True))
