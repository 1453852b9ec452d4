"""The device-placement rewrite: a plan's layer -> device map applied to a Keras model.

``place_model(model, layer_devices)`` returns a new :class:`PlacedModel` that

* is a fresh copy of ``model`` (Sequential and Functional models are cloned layer by layer,
  recursing into nested models and keeping shared layers shared; subclassed models are rebuilt
  from their config) holding the same weight values;
* creates each unit's variables under ``tf.device`` of its device (the unit's ``build`` runs
  inside the scope, so sublayers built there land there too), so parameters, gradients and the
  optimizer's slots (which Keras colocates with their variable) live on the planned device;
* runs each unit's ``call`` under ``tf.device`` of its device, and
* trains with ``fit`` through its own ``train_step``, which takes gradients with ``tf.gradients``.
  ``tf.gradients`` colocates every gradient op with its forward op, so the backward pass runs where
  the forward pass ran; Keras's default ``train_step`` (a ``GradientTape``) would leave gradient
  ops unplaced, which puts them all on the first device.

The original model is never modified. XLA compilation is turned off (``jit_compile=False``):
XLA clusters ignore ``tf.device`` annotations.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.backend import get_keras_mask, set_keras_mask

from partitioner.core.errors import RewriteError
from passes.checks import rebuild_refusal
from passes.rewrite.saved_state import carry_assets, carry_own_variables
from passes.trace import Unit, model_input, placement_units
from passes.weightless import is_deferred

logger = logging.getLogger(__name__)

__all__ = [
    "PlacedModel",
    "apply_in_place",
    "build_keeping_state",
    "default_device_strings",
    "finish_copy",
    "keep_output_names",
    "place_model",
    "sample_batch",
]


def apply_in_place(optimizer: Any, grads_and_vars: list[tuple[Any, Any]]) -> None:
    """One optimizer update, each variable's on its own device, and nothing elsewhere.

    In a replica context, Keras's TensorFlow optimizer first "all-reduces" the gradients over
    the replicas; with no ``tf.distribute`` strategy that is one ``IdentityN`` of *every*
    gradient, an op with no device, which TensorFlow places on the client's device: on a
    cluster every gradient then travels to the client and back before its update (measured on
    ``benchmarks.cluster_pipeline``: 8 x 4 MiB of gradients each way per step; the plain split
    of the reduced ``benchmarks.zoo.multi_tower`` over two loopback workers took 312 ms a step
    with it, 259 ms without). With no strategy there is one replica and nothing to reduce, so
    the update runs in the default strategy's cross-replica context (``merge_call``), where
    Keras skips the reduction. Keras's own path is kept under a strategy (its all-reduce is
    real) and for a ``LossScaleOptimizer`` (mixed precision), which refuses the cross-replica
    context and applies its inner optimizer in the replica context: its gradients still make
    the round trip on a cluster.
    """
    replica = tf.distribute.get_replica_context()
    loss_scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if replica is None or tf.distribute.has_strategy() or loss_scaled:
        optimizer.apply_gradients(grads_and_vars)
        return
    replica.merge_call(lambda _strategy: optimizer.apply_gradients(grads_and_vars))


def default_device_strings(num_devices: int) -> tuple[str, ...]:
    """``/device:GPU:i`` for each plan device, when TensorFlow sees that many GPUs."""
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) < num_devices:
        cpus = tf.config.list_logical_devices("CPU")
        raise RewriteError(
            f"the plan needs {num_devices} devices but TensorFlow sees {len(gpus)} GPU(s) and "
            f"{len(cpus)} CPU device(s); pass devices=[...] to apply(), e.g. "
            f"devices={[d.name for d in cpus][:num_devices] or ['/device:CPU:0']}"
        )
    return tuple(d.name for d in gpus[:num_devices])


def _placed(fn: Any, device: str) -> Any:
    @functools.wraps(fn)
    def run_on_device(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device):
            args, kwargs = received_on(device, (args, kwargs))
            return fn(*args, **kwargs)

    return run_on_device


def received_on(device: str, values: Any) -> Any:
    """``values`` (any nest) with each tensor made on another device copied onto ``device`` first.

    A layer's inputs are copied by one ``tf.identity`` under the layer's device (its gradient
    is the identity, so outputs and gradients are unchanged; Keras masks travel with their
    tensor). Without it, a tensor from another device that enters a loop is fetched again on
    every iteration: an LSTM(256) over 20 steps on one loopback worker took 50.5 ms with its
    ``initial_state`` made on the other worker and 19.6 ms with the state copied first (18.4 ms
    with everything local; tests/passes/test_device_placement.py checks the copy is there).
    """
    here = tf.DeviceSpec.from_string(device)

    def receive(value: Any) -> Any:
        if not isinstance(value, tf.Tensor):
            return value
        there = tf.DeviceSpec.from_string(value.device)
        if there.make_merged_spec(here) == there:  # already on ``device``
            return value
        copy = tf.identity(value)
        mask = get_keras_mask(value)
        if mask is not None:
            set_keras_mask(copy, receive(mask))
        return copy

    return tree.map_structure(receive, values)


def _pin(obj: Any, device: str) -> Any:
    """Make ``obj`` (a fresh layer or op of our copy) run its ``call`` under ``tf.device``."""
    object.__setattr__(obj, "call", _placed(obj.call, device))
    return obj


def _move_weights(copy_unit: Unit, source_unit: Unit, device: str) -> int:
    """Re-create the copy's variables on ``device``, holding the source's values (a source
    built without weights, :mod:`passes.weightless`: values from its initializers, created on
    ``device``).

    Keras defers creating variables built during a symbolic call and creates them later outside
    any device scope, so a ``tf.device`` around ``build`` is not enough; instead each variable's
    backing ``tf.Variable`` is created here, inside the scope, from the original's value.
    """
    new_weights = list(getattr(copy_unit.operation, "weights", []) or [])
    old_weights = list(getattr(source_unit.operation, "weights", []) or [])
    if [tuple(w.shape) for w in new_weights] != [tuple(w.shape) for w in old_weights]:
        raise RewriteError(
            f"layer {source_unit.name!r}: the copy's weights "
            f"{[tuple(w.shape) for w in new_weights]} differ from the original's "
            f"{[tuple(w.shape) for w in old_weights]}"
        )
    with tf.device(device):
        for new, old in zip(new_weights, old_weights):
            if is_deferred(old):  # a model built without weights: they are born here
                new._initialize_with_initializer(old._initializer)
            else:
                new._initialize(old.numpy())
    return len(new_weights)


def _carry_state(
    copy_units: Sequence[Unit], units: Sequence[Unit], devices: Sequence[str], *, assets: bool
) -> None:
    """What ``adapt()`` left in each unit (a vocabulary, a mean) carried into its copy, the
    way Keras's saving carries it (``assets=False``: a rebuilt subclassed model's copy got its
    assets before its first call)."""
    for copy_unit, unit, device in zip(copy_units, units, devices):
        if assets:
            carry_assets(copy_unit.operation, unit.operation, unit.name, device)
        carry_own_variables(copy_unit.operation, unit.operation, unit.name, device)


def _fresh_copy(operation: Any) -> Any:
    return operation.__class__.from_config(operation.get_config())


def _is_graph_model(model: Any) -> bool:
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def _clone_graph_model(model: keras.Model, device_of: Mapping[int, str]) -> keras.Model:
    def clone(operation: Any) -> Any:
        device = device_of.get(id(operation))
        if device is None:  # containers are recursed by clone_model; anything else is a unit
            return _fresh_copy(operation)
        return _pin(_fresh_copy(operation), device)

    try:
        return keras.models.clone_model(model, clone_function=clone, recursive=True)
    except Exception as exc:
        raise RewriteError(
            f"could not clone model {model.name!r} onto devices: {type(exc).__name__}: {exc}"
        ) from exc


def _rebuild_subclassed(
    model: keras.Model, units: Sequence[Unit], devices: Sequence[str], sample: Sequence[Any]
) -> keras.Model:
    try:
        copy = model.__class__.from_config(model.get_config())
    except Exception as exc:
        raise rebuild_refusal(model, exc) from exc
    for unit, source, device in zip(placement_units(copy), units, devices):
        _pin(unit.operation, device)
        carry_assets(unit.operation, source.operation, source.name, device)
    copy(model_input(model, sample), training=False)  # a call(self, x, training) requires it
    return copy


class PlacedModel(keras.Model):
    """A model whose layers run on the devices of a plan; see the module docstring."""

    def __init__(
        self,
        inner: keras.Model,
        layer_devices: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.inner = inner
        self.layer_devices = dict(layer_devices or {})

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        return self.inner(inputs, training=training)

    @property
    def output_device(self) -> str | None:
        """Where the loss and metrics run: the device of the last layer."""
        return next(reversed(self.layer_devices.values()), None)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Keras ``compile`` with XLA off and the optimizer's updates placed per variable.

        Each variable's update (``optimizer.update_step``) runs on the variable's own device;
        left unplaced, TensorFlow would run every update's arithmetic on the first device.
        """
        if kwargs.get("jit_compile") not in (None, False, "auto"):
            logger.warning("jit_compile is turned off: XLA would ignore the device placement")
        kwargs["jit_compile"] = False
        super().compile(*args, **kwargs)
        optimizer = self.optimizer
        if optimizer is not None and not getattr(optimizer, "_partitioner_placed", False):
            update_step = optimizer.update_step

            def placed_update_step(gradient: Any, variable: Any, learning_rate: Any) -> Any:
                with tf.device(getattr(variable, "_value", variable).device):
                    return update_step(gradient, variable, learning_rate)

            object.__setattr__(optimizer, "update_step", placed_update_step)
            object.__setattr__(optimizer, "_partitioner_placed", True)

    def compile_from_config(self, config: Any) -> None:
        """Compile from a ``get_compile_config()`` dict.

        Keras's own version silently does nothing for models that override ``compile``.
        """
        from keras.src.saving import serialization_lib

        self.compile(**serialization_lib.deserialize_keras_object(config))
        if self.optimizer is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    def gradients(self, loss: Any) -> list[Any]:
        """Gradients of ``loss`` for the trainable weights, each colocated with its forward op.

        Only valid inside a ``tf.function`` (``fit`` traces ``train_step`` into one).
        """
        return list(tf.gradients(loss, [v.value for v in self.trainable_weights]))

    def train_step(self, data: Any) -> Any:
        from keras.src.losses import loss as loss_module

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=True)
        with tf.device(self.output_device):
            loss = self._compute_loss(
                x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
            )
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
        )
        if self.optimizer is not None:
            loss = self.optimizer.scale_loss(loss)
        if self.trainable_weights:
            grads = self.gradients(loss)
            apply_in_place(self.optimizer, list(zip(grads, self.trainable_weights)))
        with tf.device(self.output_device):
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def place_model(
    model: keras.Model,
    layer_devices: Mapping[str, str],
    sample_inputs: Sequence[Any],
) -> PlacedModel:
    """Copy ``model`` with each placement unit on ``layer_devices[unit name]``.

    ``sample_inputs`` (one array per model input in ``model.inputs`` order, any batch size)
    builds the copy; the copy takes and returns the structures ``model`` does (dicts too).
    """
    units = placement_units(model)
    names = [u.name for u in units]
    missing = [n for n in names if n not in layer_devices]
    extra = sorted(set(layer_devices) - set(names))
    if missing or extra:
        raise RewriteError(
            f"the plan does not match model {model.name!r}: layers missing from the plan "
            f"{missing[:8]}{'...' if len(missing) > 8 else ''}, layers in the plan but not the "
            f"model {extra[:8]}{'...' if len(extra) > 8 else ''}; make the plan for this model"
        )
    devices = [layer_devices[n] for n in names]
    if _is_graph_model(model):
        inner = _clone_graph_model(model, {id(u.operation): d for u, d in zip(units, devices)})
    else:
        inner = _rebuild_subclassed(model, units, devices, sample_inputs)
    copy_units = placement_units(inner)
    if [type(u.operation) for u in copy_units] != [type(u.operation) for u in units]:
        raise RewriteError(
            f"the copy of {model.name!r} has other layers than the original "
            f"({len(copy_units)} vs {len(units)}); implement get_config/from_config"
        )
    moved = sum(_move_weights(c, u, d) for c, u, d in zip(copy_units, units, devices))
    _carry_state(copy_units, units, devices, assets=_is_graph_model(model))
    if moved != len(model.weights) or len(inner.weights) != len(model.weights):
        # Weights outside every unit (a subclassed model's own add_weight) keep their value.
        unit_ids = {id(w) for u in copy_units for w in getattr(u.operation, "weights", [])}
        rest_new = [w for w in inner.weights if id(w) not in unit_ids]
        unit_ids_old = {id(w) for u in units for w in getattr(u.operation, "weights", [])}
        rest_old = [w for w in model.weights if id(w) not in unit_ids_old]
        if [tuple(w.shape) for w in rest_new] != [tuple(w.shape) for w in rest_old]:
            raise RewriteError(
                f"the placed copy of {model.name!r} has {len(inner.weights)} weights, the "
                f"original {len(model.weights)}; the model could not be copied faithfully"
            )
        for new, old in zip(rest_new, rest_old):
            if not is_deferred(old):  # else the copy keeps its own fresh initial value
                new.assign(old.numpy())
    placed = PlacedModel(inner, dict(zip(names, devices)), name=f"{model.name}_placed")
    finish_copy(placed, model, sample_inputs)
    return placed


def sample_batch(sample_inputs: Sequence[Any], model: keras.Model | None = None) -> Any:
    """What a model is called on for ``sample_inputs`` (one array per input, ``model.inputs``
    order): ``model``'s own input structure (a dict, a nested structure), or the one input, or
    the list of them."""
    if model is not None:
        return model_input(model, sample_inputs)
    return sample_inputs[0] if len(sample_inputs) == 1 else list(sample_inputs)


def build_keeping_state(copy: keras.Model, batch: Any) -> None:
    """Call ``copy`` on ``batch`` (which builds it), then give its state (non-trainable
    variables) back the values it had: a layer whose ``call`` updates its own variable (a step
    counter) would otherwise start one call ahead of the original (campaign 34r)."""
    state = [(v, v.numpy()) for v in copy.non_trainable_weights if not is_deferred(v)]
    copy(batch, training=False)  # a call(self, x, training) requires it
    for variable, value in state:
        variable.assign(value)


def keep_output_names(copy: keras.Model, model: keras.Model) -> None:
    """Give ``copy`` ``model``'s output names (a functional model's: its output layers'),
    which Keras's ``compile`` names each output's loss and metrics by (``o1_loss``, ``o2_mae``):
    without them a copy of a two-output model reported one output's loss under the loss
    function's name and the other's not at all (campaign 34r)."""
    names = getattr(model, "output_names", None)
    if names:
        copy.output_names = list(names)


def finish_copy(
    copy: keras.Model,
    model: keras.Model,
    sample_inputs: Sequence[Any],
    log: logging.Logger = logger,
) -> None:
    """Build the rewritten ``copy`` of ``model`` on ``sample_inputs`` and compile it as ``model``
    is compiled (settings that cannot be copied are a warning on ``log``: call compile()). The
    copy's state is the original's again after that call: a layer whose ``call`` updates its
    own variable (a step counter) would otherwise start one call ahead (campaign 34r)."""
    build_keeping_state(copy, sample_batch(sample_inputs, model))
    keep_output_names(copy, model)
    if model.compiled:
        try:
            copy.compile_from_config(model.get_compile_config())
        except Exception as exc:
            log.warning("could not copy the compile settings (%s); call compile()", exc)
