"""Where a model placed in place runs (issue 36): which device holds each variable, and which
devices run each layer's forward and backward ops.

``device_report(model, x)`` traces one training step of ``model`` on ``x`` (its forward pass and
the gradient of its outputs' sum with respect to every trainable variable, inside a
``tf.function``; nothing runs) while the layers placed by
:func:`passes.rewrite.in_place.place_in_place` record the graph ops they add, and returns each
variable's device(s) and each layer's op devices, by phase. Gradients of a placed layer are its
own gradient function's ops (:mod:`passes.rewrite.in_place`); ops outside every layer (the loss,
the model's own ``call`` between layers) are not in the report, nor a variable's captured
handle and reads, nor ops TensorFlow colocates with another op: they run where that op (the
variable) is. For a model replicated in place
(``replicate_in_place``) the variables are listed, each on every replica's device, and no ops:
each replica runs the whole model on its device.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import keras
import tensorflow as tf

from partitioner.core.errors import RewriteError
from passes.rewrite.in_place import op_recorder, placed_in_place, variable_devices

__all__ = ["DeviceReport", "LayerOps", "device_report"]

Phase = Literal["forward", "backward"]

_WITH_THEIR_VARIABLE = frozenset({"Placeholder", "ReadVariableOp"})
"""Op types a traced step makes without a device of their own for a variable (its captured
handle, its reads): TensorFlow runs them where the variable is, which ``variables`` shows."""


@dataclass(frozen=True)
class LayerOps:
    """The ops one layer added to a traced step in one phase, counted by device."""

    layer: str
    phase: Phase
    devices: tuple[tuple[str, int], ...]
    """(device, number of ops), most ops first."""


@dataclass(frozen=True)
class DeviceReport:
    """Where a model placed in place runs (the module docstring)."""

    variables: tuple[tuple[str, str], ...]
    """(variable path, its device; a mirrored variable's devices, comma-separated)."""
    ops: tuple[LayerOps, ...]

    def off_device(self, layer_devices: Mapping[str, str]) -> tuple[str, ...]:
        """Each layer op group with an op on another device than ``layer_devices`` names for
        its layer, as ``"layer (phase) on DEVICE"``: empty when the placement holds."""
        found = []
        for entry in self.ops:
            wanted = tf.DeviceSpec.from_string(layer_devices[entry.layer])
            for device, _ in entry.devices:
                spec = tf.DeviceSpec.from_string(device)
                same = (spec.device_type, spec.device_index) == (
                    wanted.device_type,
                    wanted.device_index,
                )
                if not same:
                    found.append(f"{entry.layer} ({entry.phase}) on {device or 'no device'}")
        return tuple(found)


def device_report(model: keras.Model, x: Any) -> DeviceReport:
    """The :class:`DeviceReport` of ``model`` (placed or replicated in place) on a batch ``x``
    (as ``model(x)`` takes it)."""
    if placed_in_place(model) is None:
        raise RewriteError(f"model {model.name!r} is not placed in place; apply a plan to it first")
    variables = tuple(variable_devices(model).items())
    recorder = op_recorder(model)
    if recorder is None:  # replicated: the strategy runs the whole model on every device
        return DeviceReport(variables, ())

    @tf.function(autograph=False)
    def step(inputs: Any) -> Any:
        with tf.GradientTape() as tape:
            outputs = keras.tree.flatten(model(inputs, training=True))
            total = tf.add_n(
                [tf.reduce_sum(tf.cast(o, tf.float32)) for o in outputs if o.dtype.is_floating]
            )
        return tape.gradient(total, model.trainable_variables)

    recorder.ops, recorder.on = {}, True
    try:
        step.get_concrete_function(keras.tree.map_structure(tf.convert_to_tensor, x))
    finally:
        recorder.on = False
    ops = tuple(
        LayerOps(layer, _phase(phase), tuple(Counter(_devices(made)).most_common()))
        for (layer, phase), made in recorder.ops.items()
    )
    return DeviceReport(variables, ops)


def _phase(phase: str) -> Phase:
    return "forward" if phase == "forward" else "backward"


def _devices(ops: list[Any]) -> list[str]:
    """The device of each op, but for a variable's own (:data:`_WITH_THEIR_VARIABLE`) and one
    TensorFlow colocates with another op (an embedding gradient's shape, with its table)."""
    return [op.device for op in ops if op.device or not _runs_with_another(op)]


def _runs_with_another(op: Any) -> bool:
    own = f"loc:@{op.name}".encode()
    return op.type in _WITH_THEIR_VARIABLE or any(g != own for g in op.colocation_groups())
