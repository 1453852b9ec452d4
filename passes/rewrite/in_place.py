"""Placement in place: a plan's layer -> device map applied to the user's own model object
(issue 36), for the models the copying rewrites cannot take: layers that cannot be rebuilt from
their config (a custom layer without ``get_config``, keras_hub layers whose configs do not
round-trip) and model classes with their own ``train_step`` / ``test_step`` / ``compute_loss``.

``place_in_place(model, layer_devices)`` changes ``model`` itself and returns it:

* each placement unit's variables (its sublayers' too) are created again on the unit's device,
  holding their values (the Keras variables stay the same objects, so the model's own code, its
  optimizers and its checkpoints keep them);
* each unit's ``call`` runs under ``tf.device`` of its device, and so does its backward pass,
  whichever training step takes the gradients (Keras's ``fit``, the model's own ``train_step``,
  the user's ``GradientTape``): the call is one ``tf.custom_gradient`` whose gradient function
  takes the gradients of the call's own ops (recorded by an inner tape) under the unit's device.
  A tape places gradient ops where the ``tape.gradient`` call is (Keras's default
  ``train_step`` left them all on the first device); this gradient function is run by the outer
  tape for that unit alone, inside the device scope. The gradients are those of the same ops,
  so they equal the unplaced model's (tests/passes/test_in_place.py compares outputs, gradients
  and updated weights);
* the model keeps its class, its own steps, its metrics and its configuration; XLA is turned off
  (``jit_compile=False``: XLA clusters ignore ``tf.device``), and its compiled step functions
  are traced again.

An optimizer built before the call finds its variables again (:func:`_rekey_optimizers`) and
keeps its slot variables where they were.

``replicate_in_place(model, replica_devices)`` is data parallelism of the model itself, through
``tf.distribute.MirroredStrategy``: every variable of the model and of its optimizers (a GAN's two
too) is created again inside the strategy's scope, holding its value, as a
``MirroredVariable`` with one copy per replica device, and the model's ``distribute_strategy`` is
that strategy; Keras's ``fit`` then runs the model's own ``train_step`` once per replica on its
share of each batch (``strategy.run``), and each optimizer's update all-reduces the replicas'
gradients. A model's own step reduces its loss its own way: Keras's losses scale a mean by
``1/R`` for the replicas' gradients to be summed, a step's ``keras.ops.mean`` does not. So each
replica here sees one replica (the strategy's ``num_replicas_in_sync`` is 1: Keras scales
nothing) and the optimizers **average** the replicas' gradients: for a loss that is a mean over
the batch, however reduced, and for terms that do not depend on the batch (weight
regularizers), that is the gradient on the whole batch, so one step equals the unreplicated
model's on the same batch. A loss *summed* over the batch (``reduction="sum"``, a hand-written
``ops.sum`` over rows) gets ``1/R`` of its gradient: a warning names a compiled one. A
variable the step assigns from its share (a sample counter) is updated per replica, as under
``MirroredStrategy``. Gradients are clipped after the average
(:func:`passes.rewrite.replicate.reduce_then_clip`). Random draws
(dropout, a VAE's sampling) are made per share, as for the copies; BatchNormalization
normalises each share by its own statistics.

Pipelines (micro-batches) need a step of partitioner's own and stay refused for these models
(:func:`passes.checks.batch_split_refusal`); so do replicas spanning several devices each.

Reference: the ``tf.custom_gradient`` + inner-tape construction is the one
``tf.recompute_grad`` uses (Chen et al. 2016), here without the recomputation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src import tree
from keras.src.backend import get_keras_mask, set_keras_mask

from partitioner.core.errors import RewriteError, UsageError
from passes.checks import in_place_reason
from passes.rewrite.device_placement import build_keeping_state, received_on, sample_batch
from passes.rewrite.replicate import (
    batch_errors,
    check_array_batches,
    check_replica_devices,
    default_cross_device_ops,
    equal_shares,
    reduce_then_clip,
    split_train_on_batch,
    test_as_one_batch,
    unequal_first_batch,
    whole_batch_results,
)
from passes.trace import placement_units
from passes.weightless import is_deferred

logger = logging.getLogger(__name__)

__all__ = [
    "OpRecorder",
    "in_place_reason",
    "op_recorder",
    "place_in_place",
    "placed_in_place",
    "replicate_in_place",
    "variable_devices",
]
"""``in_place_reason`` lives in :mod:`passes.checks` (plan-time checks read it too)."""

_MARK = "_partitioner_in_place"
"""The attribute a model placed in place carries: its layer -> device map."""


_RECORDER = "_partitioner_op_recorder"
"""The attribute holding a model's :class:`OpRecorder` (placed in place, one replica)."""


class OpRecorder:
    """The graph ops each placed layer adds while a step is traced, by (layer, phase), phase
    ``forward`` or ``backward``, while :meth:`recording` is on
    (:func:`passes.rewrite.device_report.device_report` turns it on)."""

    def __init__(self) -> None:
        self.on = False
        self.ops: dict[tuple[str, str], list[Any]] = {}

    @contextlib.contextmanager
    def adding(self, layer: str, phase: str) -> Iterator[None]:
        """Records the ops made inside as ``layer``'s ``phase`` ops, when on and tracing."""
        if not (self.on and tf.inside_function()):
            yield
            return
        graph = tf.compat.v1.get_default_graph()
        start = len(graph.get_operations())
        try:
            yield
        finally:
            self.ops.setdefault((layer, phase), []).extend(graph.get_operations()[start:])


def op_recorder(model: Any) -> OpRecorder | None:
    """The :class:`OpRecorder` of a model placed in place by :func:`place_in_place`, or None."""
    return getattr(model, _RECORDER, None)


def placed_in_place(model: Any) -> Mapping[str, str] | None:
    """The layer -> device map ``model`` was placed in place with, or None."""
    return getattr(model, _MARK, None)


def variable_devices(model: Any) -> dict[str, str]:
    """Each of ``model``'s variables (by its path) -> the device TensorFlow holds it on (a
    mirrored variable's devices, comma-separated)."""
    return {v.path: _devices_of(getattr(v, "value", v)) for v in model.variables}


def _devices_of(variable: Any) -> str:
    copies = getattr(variable, "values", None)
    if isinstance(variable, tf.distribute.DistributedValues) and copies:
        return ", ".join(c.device for c in copies)
    return str(variable.device)


def place_in_place(
    model: keras.Model, layer_devices: Mapping[str, str], sample_inputs: Sequence[Any] = ()
) -> keras.Model:
    """Place ``model`` itself by ``layer_devices`` (placement unit name -> device string) and
    return it; see the module docstring. A model not built yet (a subclassed model never
    called) is built first on ``sample_inputs`` (one array per input), its state kept: built
    later, by its first call, every variable was made on the default device (campaign 34x)."""
    _check_not_placed(model)
    if sample_inputs and not _built(model):
        build_keeping_state(model, sample_batch(sample_inputs, model))
    units = placement_units(model)
    names = [u.name for u in units]
    missing = [n for n in names if n not in layer_devices]
    if missing:
        raise RewriteError(
            f"the plan does not place layers {missing[:8]} of model {model.name!r}; make the "
            "plan for this model"
        )
    recorder = OpRecorder()
    for unit in units:
        device = layer_devices[unit.name]
        _move_variables(unit.operation, device)
        placed = _placed_call(unit.operation, device, functools.partial(recorder.adding, unit.name))
        object.__setattr__(unit.operation, "call", placed)
    _retrace(model)
    _rekey_optimizers(model)
    object.__setattr__(model, _MARK, dict(zip(names, (layer_devices[n] for n in names))))
    object.__setattr__(model, _RECORDER, recorder)
    return model


class _WholeStepMirrored(tf.distribute.MirroredStrategy):
    """``MirroredStrategy`` whose replicas each see one replica (``num_replicas_in_sync`` is 1):
    Keras scales no loss by ``1/R``; the optimizers average the replicas' gradients instead
    (:func:`_average_gradients`; the module docstring says why)."""

    def __init__(self, devices: Sequence[str], cross_device_ops: Any) -> None:
        super().__init__(devices=list(devices), cross_device_ops=cross_device_ops)
        self._own_reductions = 0
        self._own_lock = threading.Lock()
        extended = self.extended
        for name in ("batch_reduce_to", "_replica_ctx_all_reduce"):
            setattr(extended, name, self._only_averaged(getattr(extended, name)))

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    @contextlib.contextmanager
    def own_reduction(self) -> Iterator[None]:
        """Marks a replica inside an all-reduce of partitioner's own: an averaging optimizer's
        (:func:`_count_in`), the batch-share check's (:func:`_split_batches`)."""
        with self._own_lock:
            self._own_reductions += 1
        try:
            yield
        finally:
            with self._own_lock:
                self._own_reductions -= 1

    def _only_averaged(self, reduce: Callable[..., Any]) -> Callable[..., Any]:
        """``reduce`` refusing a sum of the replicas' values outside an averaging optimizer's
        all-reduce: an optimizer the model does not hold (a module's global, a helper
        object's) summed the replicas' gradients, R times the step (campaign 34z). When the
        merge runs, every replica waits inside its all-reduce, so the count is > 0 for the
        model's optimizers."""

        @functools.wraps(reduce)
        def only_averaged(reduce_op: Any, *args: Any, **kwargs: Any) -> Any:
            if self._own_reductions == 0 and str(reduce_op).upper().endswith("SUM"):
                raise RewriteError(
                    "a step of a model data parallel in place sums the replicas' values outside "
                    "the model's optimizers (an optimizer the model does not hold as an "
                    "attribute, or an all_reduce of its own): hold every optimizer the step "
                    "uses on the model (self.optimizer, self.d_optimizer) before applying the "
                    "plan"
                )
            return reduce(reduce_op, *args, **kwargs)

        return only_averaged


def replicate_in_place(
    model: keras.Model, replica_devices: Sequence[str], sample_inputs: Sequence[Any] = ()
) -> keras.Model:
    """Data parallelism of ``model`` itself on ``replica_devices`` (one replica each), its own
    ``train_step`` kept; see the module docstring. Returns ``model``."""
    _check_not_placed(model)
    devices = check_replica_devices(replica_devices)
    if len(devices) < 2:
        raise RewriteError(
            f"data parallelism needs >= 2 replica devices, got {list(replica_devices)}; use "
            "place_in_place for one device"
        )
    if sample_inputs and not _built(model):
        build_keeping_state(model, sample_batch(sample_inputs, model))
    strategy = _WholeStepMirrored(devices, default_cross_device_ops(devices))
    _warn_summed_losses(model, len(devices))
    _mirror(model, strategy)
    model._distribute_strategy = strategy
    _retrace(model, strategy)
    _split_batches(model, len(devices))
    object.__setattr__(model, _MARK, {u.name: ", ".join(devices) for u in placement_units(model)})
    return model


def _warn_summed_losses(model: keras.Model, replicas: int) -> None:
    """A warning for each compiled loss that sums over the batch (``reduction="sum"``): its
    gradient here is ``1/replicas`` of the whole batch's (the module docstring)."""
    for loss in tree.flatten(getattr(model, "loss", None)):
        if isinstance(loss, keras.losses.Loss) and loss.reduction == "sum":
            logger.warning(
                "loss %s sums over the batch: its gradient under %d data-parallel replicas in "
                "place is 1/%d of the whole batch's (the replicas' gradients are averaged); use "
                "a mean reduction",
                loss.name,
                replicas,
                replicas,
            )


def _mirror(model: keras.Model, strategy: Any) -> None:
    """Every variable of ``model`` and of its optimizers not yet mirrored is created again
    in ``strategy``'s scope with its value; each optimizer bound to ``strategy`` and averaging
    its replicas' gradients. Its metrics keep their variables, as the copies' do: one variable
    every replica updates in turn holds the whole batch's state whatever its update (a sum, a
    running maximum: mirrored, it was read as the sum of the replicas' maxima, campaign 34ac);
    a metric Keras makes in the scope is its own (summed on read)."""
    optimizers = _optimizers(model)
    state = list(model.variables)  # not its metrics' (the docstring)
    state += [v for o in optimizers for v in o.variables]
    seen: set[int] = set()
    with strategy.scope():
        for variable in state:
            if id(variable) in seen or isinstance(variable.value, tf.distribute.DistributedValues):
                continue
            seen.add(id(variable))
            if is_deferred(variable):
                variable._initialize_with_initializer(variable._initializer)
            else:
                variable._initialize(variable.numpy())
    replicas = len(strategy.extended.worker_devices)
    for optimizer in optimizers:
        inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's applies
        for made in (optimizer, inner):
            if isinstance(made, keras.optimizers.Optimizer):
                made._distribution_strategy = strategy
        reduce_then_clip(optimizer, 1.0 / replicas)  # the replicas' gradients averaged
        _count_in(optimizer, strategy)
    _rekey_optimizers(model)


def _count_in(optimizer: Any, strategy: _WholeStepMirrored) -> None:
    """``optimizer``'s all-reduce counted as an averaging one by ``strategy``
    (:meth:`_WholeStepMirrored._only_averaged`); once per optimizer and strategy."""
    made = getattr(optimizer, "inner_optimizer", None) or optimizer  # a LossScaleOptimizer's
    if getattr(made, "_partitioner_counted_by", None) is strategy:
        return
    reduce = made._all_reduce_sum_gradients

    def counted(grads_and_vars: Any) -> Any:
        with strategy.own_reduction():
            return reduce(grads_and_vars)

    made._all_reduce_sum_gradients = counted
    made._partitioner_counted_by = strategy


def _split_batches(model: keras.Model, replicas: int) -> None:
    """The model's ``train_step`` behind the check that every replica got as many rows,
    ``fit`` refusing array batches ``replicas`` does not divide, ``train_on_batch`` and
    ``predict_on_batch`` giving each replica its share (Keras's give every replica the whole
    batch, and predicted R times the rows, campaign 34z): as the copies
    (:class:`passes.rewrite.replicate.ReplicatedModel`), on the model's own methods."""
    step, fit, build = model.train_step, model.fit, model._maybe_symbolic_build
    test = model.test_step

    @functools.wraps(step)
    def train_step(data: Any) -> Any:
        with model.distribute_strategy.own_reduction():
            shares = equal_shares(data, replicas)
        logs = step(shares)
        with model.distribute_strategy.own_reduction():
            return whole_batch_results(model, logs, shares)

    @functools.wraps(test)
    def test_step(data: Any) -> Any:
        logs = test(data)
        with model.distribute_strategy.own_reduction():
            return whole_batch_results(model, logs, data)

    @functools.wraps(fit)
    def fit_shares(x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        batch_size = args[0] if args else kwargs.get("batch_size")
        check_array_batches(x, batch_size, kwargs.get("validation_split"), replicas)
        with batch_errors():
            return fit(x, y, *args, **kwargs)

    def symbolic_build(*args: Any, **kwargs: Any) -> Any:
        with unequal_first_batch(replicas, model.distribute_strategy), _labels_needed(model):
            built = build(*args, **kwargs)
        _mirror(model, model.distribute_strategy)  # optimizers the build made
        return built

    def train_on_batch(x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        return split_train_on_batch(model, replicas, x, y, *args, **kwargs)

    def test_on_batch(
        x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:  # Keras's gave every replica the whole batch: each sample counted R times
        return test_as_one_batch(model, x, y, sample_weight, return_dict)

    def predict_on_batch(x: Any) -> Any:  # Keras's gave every replica the whole batch: R x rows
        rows = int(np.shape(tree.flatten(x)[0])[0])
        return model.predict(x, batch_size=rows, verbose=0)

    for name, made in (
        ("train_step", train_step),
        ("test_step", test_step),
        ("fit", fit_shares),
        ("_maybe_symbolic_build", symbolic_build),
        ("train_on_batch", train_on_batch),
        ("predict_on_batch", predict_on_batch),
        ("test_on_batch", test_on_batch),
    ):
        object.__setattr__(model, name, made)


@contextlib.contextmanager
def _labels_needed(model: keras.Model) -> Iterator[None]:
    """Keras's build of a replicated model from its first batch fails on a batch without labels
    (``fit(x)``, keras.io's VAE) with "None values not supported"; one device never builds so
    and trains (the model's own step ignores a compiled loss): one line naming what to change
    (campaign 34ad)."""
    try:
        yield
    except ValueError as exc:
        if "None values not supported" not in str(exc):
            raise
        raise UsageError(
            f"model {model.name!r} is given batches without labels (fit(x)) under data "
            "parallelism in place, and Keras builds its compiled loss and metrics from the "
            "first batch's labels: compile it without loss= and metrics= (its own train_step "
            "computes its loss), or give the labels"
        ) from None


def _check_not_placed(model: keras.Model) -> None:
    """RewriteError when ``model`` is placed in place already, or was built inside a
    ``tf.distribute`` strategy's scope (its variables that strategy's: its first ``fit`` failed
    with TensorFlow's "Mixing different tf.distribute.Strategy objects", campaign 34y)."""
    if placed_in_place(model) is not None:
        raise RewriteError(
            f"model {model.name!r} is already placed in place by a plan; build the model again "
            "and apply the plan to that"
        )
    if any(isinstance(v.value, tf.distribute.DistributedValues) for v in model.variables):
        raise RewriteError(
            f"model {model.name!r} was built inside a tf.distribute strategy's scope (its "
            "variables are that strategy's); build it outside every strategy's scope: "
            "Plan.apply makes the replicas the plan asks for"
        )


def _optimizers(model: keras.Model) -> list[Any]:
    """The optimizers ``model`` holds in its attributes (``compile``'s, a GAN's own two), in
    lists, tuples and dicts of them too (``self.optimizers = [g, d]``: one left out summed its
    replicas' gradients, campaign 34y)."""
    found: dict[int, Any] = {}
    stack: list[tuple[Any, int]] = [(v, 0) for v in list(vars(model).values())]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, keras.optimizers.Optimizer):
            found.setdefault(id(value), value)
        elif isinstance(value, (list, tuple, dict)) and depth < 3:
            items = value.values() if isinstance(value, dict) else value
            stack += [(v, depth + 1) for v in list(items)]
    return list(found.values())


def _rekey_optimizers(model: keras.Model) -> None:
    """The model's optimizers that are built (``compile``'s, and a GAN's own attributes) find
    their variables again: a TensorFlow optimizer keys each variable by its backing
    ``tf.Variable``, which the move created anew ("Unknown variable" at the next ``fit``,
    campaign 34w). Their slot variables stay where they were."""
    for optimizer in _optimizers(model):
        inner = getattr(optimizer, "inner_optimizer", None)  # a LossScaleOptimizer's
        for made in (optimizer, inner):
            if isinstance(made, keras.optimizers.Optimizer) and made.built:
                made._trainable_variables_indices = {
                    made._var_key(v): i for i, v in enumerate(made._trainable_variables)
                }


def _built(model: keras.Model) -> bool:
    """Whether ``model`` and every layer it holds have made their variables."""
    layers = model._flatten_layers()
    return bool(model.built) and all(getattr(layer, "built", True) for layer in layers)


def _move_variables(operation: Any, device: str) -> None:
    """``operation``'s variables (its sublayers' too) created again on ``device``, holding their
    values (a variable built without its value, :mod:`passes.weightless`: from its initializer)."""
    with tf.device(device):
        for variable in getattr(operation, "weights", None) or []:
            if is_deferred(variable):
                variable._initialize_with_initializer(variable._initializer)
            else:
                variable._initialize(variable.numpy())


def _retrace(model: keras.Model, strategy: Any = None) -> None:
    """The model's compiled step functions dropped (they hold the variables as they were), and
    XLA off: its clusters ignore ``tf.device``; a later ``compile`` turns it off too, with the
    copies' warning (``compile(jit_compile=True)`` after the placement failed at the first
    ``fit`` with TensorFlow's traceback, campaign 34x). Under data parallelism (``strategy``) a
    later ``compile`` runs in the strategy's scope and mirrors the optimizers it is given."""
    if getattr(model, "jit_compile", False):
        logger.warning("jit_compile is turned off: XLA would ignore the device placement")
    if hasattr(model, "jit_compile"):
        model.jit_compile = False
    for name in ("train_function", "test_function", "predict_function"):
        if hasattr(model, name):
            setattr(model, name, None)
    compile_ = model.compile

    @functools.wraps(compile_)
    def compile_without_xla(*args: Any, **kwargs: Any) -> Any:
        with strategy.scope() if strategy is not None else contextlib.nullcontext():
            with _state_unlocked(model):
                made = compile_(*args, **kwargs)  # the model's own compile, whatever it takes
        if strategy is not None:
            _mirror(model, strategy)
        if getattr(model, "jit_compile", False):
            logger.warning("jit_compile is turned off: XLA would ignore the device placement")
        model.jit_compile = False
        return made

    object.__setattr__(model, "compile", compile_without_xla)


@contextlib.contextmanager
def _state_unlocked(model: keras.Model) -> Iterator[None]:
    """Keras's lock on new state of a built model lifted while its own ``compile`` runs: the
    placement built a model never called, and keras.io's GAN makes its loss trackers in its
    ``compile`` (Keras's "You cannot add new elements of state ... already built" there,
    campaign 34ab), which it may on a model not yet built. Locked again after."""
    tracker: Any = getattr(model, "_tracker", None)
    locked = tracker is not None and bool(tracker.locked)
    if locked:
        tracker.unlock()
    try:
        yield
    finally:
        if locked:
            model._lock_state()


def _differentiable(value: Any) -> bool:
    """A tensor a gradient flows through: floating or complex (``tf.signal.fft``'s output: a
    complex output left out gave every layer before it a zero gradient, campaign 34w)."""
    return isinstance(value, tf.Tensor) and (value.dtype.is_floating or value.dtype.is_complex)


_Adding = Callable[[str], contextlib.AbstractContextManager[None]]
"""A layer's :meth:`OpRecorder.adding`: the ops made inside, recorded as its ``phase``'s."""


def _placed_call(operation: Any, device: str, adding: _Adding) -> Any:
    """``operation``'s ``call`` with its forward ops and its backward ops on ``device``."""
    call = operation.call

    @functools.wraps(call)
    def run_on_device(*args: Any, **kwargs: Any) -> Any:
        with tf.device(device), adding("forward"):
            args, kwargs = received_on(device, (args, kwargs))
            flat = tree.flatten((args, kwargs))
            symbolic = not any(isinstance(x, tf.Tensor) for x in flat)  # KerasTensors
            trains = bool(getattr(operation, "trainable_weights", None))
            if symbolic or not (trains or any(_differentiable(x) for x in flat)):
                return call(*args, **kwargs)  # nothing to differentiate: its ops are here
            # an Embedding (integer inputs) too: its variables' gradient runs on ``device``
            return _with_placed_gradient(call, device, args, kwargs, adding)

    return run_on_device


def _with_placed_gradient(call: Any, device: str, args: Any, kwargs: Any, adding: _Adding) -> Any:
    """``call(*args, **kwargs)`` as one ``tf.custom_gradient`` whose gradient runs on ``device``
    (the module docstring)."""
    flat = tree.flatten((args, kwargs))
    where = [i for i, x in enumerate(flat) if _differentiable(x)]
    made: dict[str, Any] = {}

    @tf.custom_gradient
    def forward(*inputs: Any) -> Any:
        # persistent: the gradient function runs once per gradient taken through it (a
        # persistent outer tape asked twice, a gradient penalty's second order, campaign 34w)
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(inputs)
            given = list(flat)
            for i, x in zip(where, inputs):
                given[i] = x
            a, k = tree.pack_sequence_as((args, kwargs), given)
            out = call(*a, **k)
        outs = [o for o in tree.flatten(out) if isinstance(o, tf.Tensor)]
        made["out"], made["masks"] = out, [get_keras_mask(o) for o in outs]

        def gradient(*dys: Any, variables: Any = None) -> Any:
            pairs = [(o, dy) for o, dy in zip(outs, dys) if _differentiable(o)]
            with tf.device(device), adding("backward"):
                sources = [*inputs, *(variables or [])]
                grads = tape.gradient(
                    [o for o, _ in pairs],
                    sources,
                    output_gradients=[tf.zeros_like(o) if dy is None else dy for o, dy in pairs],
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            return grads[: len(inputs)], grads[len(inputs) :]

        return [tf.identity(o) for o in outs], gradient

    results = iter(forward(*[flat[i] for i in where]))
    masks = iter(made["masks"])
    placed = []
    for value in tree.flatten(made["out"]):
        if isinstance(value, tf.Tensor):
            value, mask = next(results), next(masks)
            if mask is not None:
                set_keras_mask(value, mask)
        placed.append(value)
    return tree.pack_sequence_as(made["out"], placed)
