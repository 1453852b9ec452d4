"""Training memory per layer: weights, gradients, optimizer slots and saved activations."""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType

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


def layer_memory(graph: Graph, optimizer: Optimizer = Optimizer.ADAM) -> tuple[LayerMemory, ...]:
    """Training memory of every layer of ``graph``, in ``graph.layers`` order.

    Weights count in full (trainable or not); gradients and ``optimizer.slots_per_param`` state
    slots count the trainable weights only; activations are the forward outputs the backward pass
    reads (:attr:`partitioner.core.ir.LayerNode.activation_bytes`); the transient is the partial
    gradients the layer's backward adds up (:attr:`partitioner.core.ir.LayerNode.gradient_partial_bytes`).
    """
    slots = optimizer.slots_per_param
    nodes = graph.layer_graph.nodes
    return tuple(
        LayerMemory(
            layer=info.name,
            param_bytes=info.param_bytes,
            gradient_bytes=info.trainable_param_bytes,
            optimizer_bytes=slots * info.trainable_param_bytes,
            activation_bytes=node.activation_bytes,
            transient_bytes=node.gradient_partial_bytes,
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
