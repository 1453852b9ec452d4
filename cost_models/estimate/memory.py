"""Training memory per layer: weights, gradients, optimizer slots and saved activations.

**Which tensors the backward keeps.** TensorFlow keeps a forward tensor alive until the last
backward op that reads it has run, and each op's gradient function decides what it reads; the
trace records those reads as forward -> backward edges, and
:attr:`partitioner.core.ir.LayerNode.activation_bytes` counts every such tensor once, in the
layer that produced it, however many backward ops read it (a ReLU's output read by its
``ReluGrad`` and by the next matmul's weight gradient is one tensor). Per op class:

==============================  ============================================================
op class                        kept for the backward
==============================  ============================================================
ReLU, sigmoid, tanh, softmax    its output (the gradient is a function of ``y``)
convolution, matmul             its input (weight gradient) and its weights (input gradient;
                                weights are parameters, not activations)
batch norm (Keras 3, unfused)   its input and the batch statistics (per channel, small)
max pooling                     its input and its output (``MaxPoolGrad`` reads both)
bias add, add, reshape          nothing (their gradients do not read the forward tensors)
dropout                         its mask
==============================  ============================================================

**Transients.** The partial gradients a layer's backward adds up (a batch norm's input gets
three, one per use of ``x``; an unrolled RNN's weight one per step) are alive only while that
layer's backward runs: a device's peak is its layers' resident bytes plus the *largest*
transient among them (:func:`peak_memory_bytes`, :func:`partitioner.core.ir.peak_bytes`), never
their sum.

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
from partitioner.core.ir import Graph, LayerMemory

__all__ = ["Optimizer", "layer_memory", "parse_optimizer", "peak_memory_bytes"]

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
    slots count the trainable weights only; activations are the forward outputs the backward pass
    reads (:attr:`partitioner.core.ir.LayerNode.activation_bytes`); the transient is the partial
    gradients the layer's backward adds up (:attr:`partitioner.core.ir.LayerNode.gradient_partial_bytes`).

    ``precision``, when it differs from the policy the graph was traced in, rescales the
    activations and transients (:func:`~cost_models.estimate.precision.bytes_scale`: 2 bytes per
    element under mixed precision, 4 otherwise); weights, gradients and optimizer slots stay
    float32 under every policy (mixed precision keeps float32 master weights).
    """
    slots = optimizer.slots_per_param
    nodes = graph.layer_graph.nodes
    scale = 1.0 if precision is None else bytes_scale(traced_precision(graph), precision)
    return tuple(
        LayerMemory(
            layer=info.name,
            param_bytes=info.param_bytes,
            gradient_bytes=info.trainable_param_bytes,
            optimizer_bytes=slots * info.trainable_param_bytes,
            activation_bytes=round(node.activation_bytes * scale),
            transient_bytes=round(node.gradient_partial_bytes * scale),
        )
        for info, node in zip(graph.layers, nodes, strict=True)
    )


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
