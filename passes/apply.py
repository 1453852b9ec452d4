"""Applying a plan to a Keras model: the plan's device indices become TensorFlow device strings,
and the model is placed (:func:`~passes.rewrite.device_placement.place_model`), pipelined
(:func:`~passes.rewrite.pipeline.pipeline_model`), replicated
(:func:`~passes.rewrite.replicate.realise_strategy`), or, on a cluster's tasks, placed or pipelined
(:func:`~passes.cluster.runtime.place_on_cluster`) or replicated
(:func:`~passes.cluster.runtime.replicate_on_cluster`).

Before anything is built, the plan is checked against what it is applied to: the model's layer
names, its inputs and layer weight shapes (the plan's
:class:`~partitioner.plan.model.ModelFingerprint`, made by :func:`model_fingerprint` when the plan
was made), and, off a cluster, that every device string names a device TensorFlow sees here
(TensorFlow's soft placement would otherwise run the layers of a missing device on CPU:0,
silently)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np
import tensorflow as tf

from partitioner.core.errors import PlanError, RewriteError, TraceError, UsageError
from partitioner.core.options import InputShape
from partitioner.core.strategy import Strategy
from partitioner.plan.model import (
    INPUT_PREFIX,
    InputSignature,
    ModelFingerprint,
    Plan,
    device_key,
)
from partitioner.plan.schema import check_plan_matches_model
from passes.checks import check_batch_split, in_place_reason
from passes.rewrite.device_placement import default_device_strings, place_model
from passes.trace import input_names, input_specs, placement_units, sample_batch_size

__all__ = ["apply_plan", "model_fingerprint"]

logger = logging.getLogger(__name__)

_NEXT_STEP = "re-plan this model: partition(model, ...)"


# -- what the plan was made for ----------------------------------------------------------------


def model_fingerprint(model: Any, input_shape: InputShape | None = None) -> ModelFingerprint:
    """``model``'s inputs (name, shape after the batch, dtype; ``model.inputs`` order) and the
    weight shapes of each of its placement units that is built, for
    :attr:`partitioner.plan.model.Plan.fingerprint`.

    An input's shape is the model's own where it declares every dimension, else the one
    ``input_shape`` (the plan's) gives, as the trace took it
    (:func:`passes.trace.input_specs`)."""
    try:
        specs = input_specs(model, 1)
    except TraceError:
        specs = input_specs(model, 1, input_shape)
    inputs = tuple(
        InputSignature(name, tuple(int(d) for d in spec.shape[1:]), spec.dtype.name)
        for name, spec in zip(input_names(model), specs)
    )
    units = placement_units(model)
    weights = tuple(
        (unit.name, tuple(tuple(int(d) for d in w.shape) for w in _weights(unit.operation)))
        for unit in units
        if getattr(unit.operation, "built", True)
    )
    wiring = _layer_inputs(
        model, {**_input_layers(model), **{id(u.operation): u.name for u in units}}
    )
    classes = tuple((unit.name, type(unit.operation).__qualname__) for unit in units)
    trainable = tuple(
        (unit.name, len(getattr(unit.operation, "trainable_weights", None) or []))
        for unit in units
        if getattr(unit.operation, "built", True)
    )
    dtypes = tuple(
        (unit.name, str(policy.name))
        for unit in units
        if (policy := getattr(unit.operation, "dtype_policy", None)) is not None
    )
    return ModelFingerprint(
        inputs=inputs,
        layer_weights=weights,
        layer_inputs=wiring,
        layer_classes=classes,
        layer_trainable=trainable,
        layer_dtypes=dtypes,
    )


def _input_layers(model: Any) -> dict[int, str]:
    """``id`` of each of the model's ``InputLayer``s -> ``<input K>``, K its position in
    ``model.inputs`` (a name Keras made up differs from build to build): which input feeds a
    layer is part of the wiring (two inputs swapped are another model)."""
    graph = getattr(model, "_functional", None) or model
    try:
        tensors = list(graph.inputs or [])
    except Exception:  # a subclassed model never called: no graph
        return {}
    out: dict[int, str] = {}
    for k, tensor in enumerate(tensors):
        history = getattr(tensor, "_keras_history", None)
        operation = getattr(history, "operation", None)
        if operation is not None:
            out[id(operation)] = f"{INPUT_PREFIX}{k}>"
    return out


def _layer_inputs(
    model: Any, unit_of: Mapping[int, str]
) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each unit of ``model``'s own Keras graph (a Sequential's: the functional graph Keras
    made of it) with the units feeding it, sorted; () without a graph (a subclassed model).
    Same names and weights wired in another order are another model (the campaign's rerun).
    ``unit_of`` names the model's inputs too (``<input NAME>``): a layer fed by one is fed by
    it; only units are listed."""
    graph = getattr(model, "_functional", None) or model
    by_depth = getattr(graph, "_nodes_by_depth", None)
    if not isinstance(by_depth, Mapping):
        return ()
    fed: dict[str, set[str]] = {}
    for nodes in by_depth.values():
        for node in nodes:
            name = unit_of.get(id(node.operation))
            if name is None or name.startswith(INPUT_PREFIX):
                continue
            parents = (unit_of.get(id(p.operation)) for p in node.parent_nodes)
            fed.setdefault(name, set()).update(p for p in parents if p is not None)
    return tuple((name, tuple(sorted(fed[name]))) for name in sorted(fed))


def _weights(operation: Any) -> list[Any]:
    """A Keras layer's weights (its sublayers' too); none for an operation without."""
    return list(getattr(operation, "weights", None) or [])


def _signature(sig: InputSignature) -> str:
    return f"{sig.shape} {sig.dtype}"


def _first_difference(made_for: ModelFingerprint, here: ModelFingerprint) -> str | None:
    """The first way ``here`` (the model at hand) differs from ``made_for`` (the plan's), in
    words; None when they agree. A layer unbuilt on either side is not compared."""
    if len(made_for.inputs) != len(here.inputs):
        return (
            f"the plan's model takes {len(made_for.inputs)} input(s) "
            f"{[_signature(i) for i in made_for.inputs]}, this model "
            f"{len(here.inputs)} {[_signature(i) for i in here.inputs]}"
        )
    for expected, found in zip(made_for.inputs, here.inputs):
        if (expected.shape, expected.dtype) != (found.shape, found.dtype):
            return (
                f"input {found.name!r} is {_signature(found)} here, but the plan was made for "
                f"{_signature(expected)}"
            )
    for planned, found_here, say in _LAYER_CHECKS:
        changed = _first_changed(planned(made_for), found_here(here))
        if changed is not None:
            return say(*changed)
    return _unrecorded_wiring(made_for, here)


_LAYER_CHECKS: tuple[
    tuple[
        Callable[[ModelFingerprint], Sequence[tuple[str, Any]]],
        Callable[[ModelFingerprint], Mapping[str, Any]],
        Callable[[str, Any, Any], str],
    ],
    ...,
] = (
    (
        lambda f: f.layer_classes,
        lambda f: f.classes_of,
        lambda name, found, planned: (
            f"layer {name!r} is a {found} here, but the plan was made for a {planned}"
        ),
    ),
    (
        lambda f: f.layer_trainable,
        lambda f: f.trainable_of,
        lambda name, found, planned: (
            f"layer {name!r} trains {found} of its weights here, but the plan was made for "
            f"{planned} (frozen or unfrozen since: its gradients and optimizer state differ)"
        ),
    ),
    (
        lambda f: f.layer_dtypes,
        lambda f: f.dtypes_of,
        lambda name, found, planned: (
            f"layer {name!r} runs in {found} here, but the plan was made for {planned} (its "
            "step times and memory were priced in that precision); make the plan for this model"
        ),
    ),
    (
        lambda f: f.layer_weights,
        lambda f: f.weights_of,
        lambda name, found, planned: (
            f"layer {name!r} has weights of shapes {list(found)} here, but the plan was made "
            f"for {list(planned)}"
        ),
    ),
    (
        lambda f: f.layer_inputs,
        lambda f: f.inputs_of,
        lambda name, found, planned: (
            f"layer {name!r} is fed by {list(found)} here, but in the plan's model by "
            f"{list(planned)} (the layers are wired otherwise)"
        ),
    ),
)
"""Each layer's recorded facts, compared in this order: the plan's, the model's, the words."""


def _unrecorded_wiring(made_for: ModelFingerprint, here: ModelFingerprint) -> str | None:
    """A layer wired in ``here``'s graph whose inputs the plan's fingerprint, which records
    wiring, leaves out (an edited file: the planner records every layer of a graph model), in
    words; None when the plan records none (a subclassed model, an earlier release)."""
    recorded = made_for.inputs_of
    if not recorded:
        return None
    for name, fed_by in here.layer_inputs:
        if name not in recorded:
            return (
                f"layer {name!r} is fed by {list(fed_by)} here, but the plan's fingerprint "
                "records no inputs for it (its wiring would go unchecked)"
            )
    return None


def _first_changed(
    planned: Sequence[tuple[str, Any]], here: Mapping[str, Any]
) -> tuple[str, Any, Any] | None:
    """The first layer of ``planned`` (``(layer, value)`` pairs) whose value ``here`` differs:
    ``(layer, value here, planned value)``; layers missing on either side are not compared."""
    for name, value in planned:
        if name in here and here[name] != value:
            return name, here[name], value
    return None


def _check_fingerprint(plan: Plan, model: Any) -> None:
    """PlanError naming the first difference between ``model`` and the model ``plan`` was made
    for (inputs, then layer weight shapes); a warning for a plan of an earlier release, which
    records none."""
    if plan.fingerprint is None:
        logger.warning(
            "the plan for %r records no model fingerprint (a plan file of an earlier release): "
            "this model's inputs and weight shapes are not checked against it; re-plan the model "
            "to have them checked",
            plan.model_name,
        )
        return
    difference = _first_difference(plan.fingerprint, model_fingerprint(model, plan.input_shape))
    if difference is not None:
        raise PlanError(
            f"the plan for {plan.model_name!r} does not fit this model: {difference}; {_NEXT_STEP}"
        )


# -- devices --------------------------------------------------------------------------------


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (a value from the caller may be huge)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _given_devices(devices: Any) -> tuple[str, ...] | None:
    """``devices=`` as a tuple of non-empty strings; UsageError naming the first bad entry."""
    if devices is None:
        return None
    if isinstance(devices, AbstractSet):
        raise UsageError(
            f"devices={_shown(devices)} is a set, which has no order: which plan device lands "
            "where would change from run to run; give a list, one device per plan device in "
            "order, e.g. devices=['/device:GPU:0', '/device:GPU:1']"
        )
    if isinstance(devices, (str, bytes, Mapping)) or not isinstance(devices, Iterable):
        raise UsageError(
            f"devices={_shown(devices)} must be a list of TensorFlow device strings, one per plan "
            "device, e.g. devices=['/device:GPU:0', '/device:GPU:1']"
        )
    given = tuple(devices)
    for i, name in enumerate(given):
        if not isinstance(name, str) or not name.strip():
            raise UsageError(
                f"devices[{i}] is {_shown(name)}, not a device string; give one TensorFlow device "
                f"per plan device, e.g. '/device:GPU:{i}' or '/device:CPU:{i}'"
            )
    return given


def _local_names() -> list[str]:
    """The devices TensorFlow sees in this process, as ``/device:TYPE:N``."""
    names = []
    for device in tf.config.list_logical_devices():
        spec = tf.DeviceSpec.from_string(device.name)
        names.append(f"/device:{spec.device_type}:{spec.device_index}")
    return names


_LOCAL_TASK = {"job": "localhost", "replica": 0, "task": 0}
"""Where this process's devices are, whether or not TensorFlow names it in their names."""


def _matches(wanted: Any, have: Any) -> bool:
    """Whether device spec ``have`` (a device TensorFlow lists here) is one ``wanted`` names:
    each field ``wanted`` sets is equal (the device type in any case; job, replica and task
    those of this process, ``/job:localhost/replica:0/task:0``)."""
    for attr in ("job", "replica", "task", "device_index"):
        value = getattr(wanted, attr)
        here = getattr(have, attr)
        if here is None:
            here = _LOCAL_TASK.get(attr)
        if value is not None and value != here:
            return False
    return str(wanted.device_type).upper() == str(have.device_type).upper()


def _missing_device(name: str) -> str | None:
    """Why ``name`` is not a device TensorFlow sees here (None when it is)."""
    try:
        wanted = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError) as exc:
        return f"is not a TensorFlow device string ({exc})"
    if wanted.device_type is None:
        return "names no device type (CPU, GPU, ...)"
    if wanted.device_index is None:
        return "names no one device (a wildcard or no index: give e.g. '/device:CPU:0')"
    local = [tf.DeviceSpec.from_string(d.name) for d in tf.config.list_logical_devices()]
    if any(_matches(wanted, have) for have in local):
        return None
    return "is not a device TensorFlow sees here"


def _check_local_devices(device_strings: Sequence[str], given: bool) -> None:
    """UsageError (``devices=``) or PlanError (the plan's own names) naming the first device
    string that is not a device of this process, and the devices TensorFlow sees."""
    for i, name in enumerate(device_strings):
        why = _missing_device(name)
        if why is None:
            continue
        seen = _local_names()
        example = seen[: len(device_strings)]
        if given:
            raise UsageError(
                f"devices[{i}]={_shown(name)} {why} (TensorFlow sees {seen}); pass devices= from "
                f"those, e.g. devices={example}"
            )
        raise PlanError(
            f"the plan's device {i} is named {_shown(name)}, which {why} (TensorFlow sees "
            f"{seen}); "
            f"pass devices=[...] to apply(), e.g. devices={example}"
        )


def _check_waits(timeout_s: float, step_timeout_s: float | None) -> None:
    """Before connecting to ``cluster``: an infinite (or over an hour) wait on a down task is
    refused, as ``partition calibrate`` refuses it
    (:func:`~passes.cluster.calibrate.check_timeout_s`); the waits are checked without a cluster
    too (they are unused then, but a NaN is a mistake either way)."""
    from passes.cluster.calibrate import check_timeout_s

    check_timeout_s("timeout_s", timeout_s)
    if step_timeout_s is not None:
        check_timeout_s("step_timeout_s", step_timeout_s)


def _check_distinct(
    plan: Plan, strategy: Strategy | None, device_strings: Sequence[str], given: bool
) -> None:
    """UsageError (``devices=``) or PlanError (the plan's own names) when two devices that
    hold layers are one TensorFlow device, however spelled (``/cpu:0``, ``/device:CPU:0``): the
    stages would run one after another there, not as planned and predicted. Replicas check
    theirs where they are made (``realise_strategy``)."""
    if strategy is not None:
        return
    first: dict[str, int] = {}
    for i in sorted(set(plan.assignment.values())):
        name = device_strings[i]
        key = device_key(name)
        if not key:
            continue
        if key in first:
            where = "devices=" if given else "the plan's device names"
            error = UsageError if given else PlanError
            raise error(
                f"{where} put plan devices {first[key]} and {i} on one device "
                f"({_shown(device_strings[first[key]])} and {_shown(name)}): their layers would "
                "run one after another there, not as planned; give distinct devices (more "
                "logical devices can be made before TensorFlow starts: "
                "tf.config.set_logical_device_configuration), or plan for fewer devices"
            )
        first[key] = i


def _replicas(plan: Plan) -> Strategy | None:
    """The plan's strategy when it has replicas (``None`` otherwise)."""
    strategy = plan.strategy
    if strategy is None or strategy.replicas == 1:
        return None
    return strategy


def _check_cluster_holds(strategy: Strategy, handle: Any) -> None:
    """PlanError with the next step when the cluster has fewer devices than the replicas use."""
    held = handle.devices_per_task()
    needed, capacity = len(strategy.devices), sum(held)
    if needed <= capacity:
        return
    cluster = handle.cluster
    tasks = (
        f"{cluster.num_tasks} {cluster.job_name} task(s) x {held[0]} device(s)"
        if len(set(held)) == 1
        else f"{cluster.num_tasks} {cluster.job_name} tasks holding {list(held)} devices"
    )
    raise PlanError(
        f"the plan runs {strategy.describe()} on {needed} devices, but the cluster in "
        f"{cluster.source} holds {capacity} ({tasks}); start workers for "
        f"{needed - capacity} more device(s) (partition worker), or plan for at most "
        f"{capacity} devices (gpus={capacity})"
    )


def _replicated(
    plan: Plan,
    strategy: Strategy,
    model: Any,
    device_strings: Sequence[str],
    sample: Sequence[Any],
    handle: Any,
    step_timeout_s: float,
) -> Any:
    """The copy of ``model`` that trains under the plan's replicas (data parallel or hybrid),
    through :func:`~passes.rewrite.replicate.realise_strategy`, or on a cluster's tasks through
    :func:`~passes.cluster.runtime.replicate_on_cluster`."""
    per_replica = [
        {
            name: device_strings[strategy.device_groups[r][s]]
            for name, s in zip(plan.layer_order, strategy.stage_of_layer)
        }
        for r in range(strategy.replicas)
    ]
    in_place = in_place_reason(model)
    if in_place is not None:  # its own train_step, layers that cannot be rebuilt
        _check_here(in_place, handle)
        from passes.rewrite.in_place import replicate_in_place

        return replicate_in_place(model, [next(iter(p.values())) for p in per_replica], sample)
    if handle is not None:
        from passes.cluster.runtime import replicate_on_cluster

        return replicate_on_cluster(
            model,
            per_replica,
            sample,
            handle,
            num_microbatches=strategy.num_microbatches,
            schedule=strategy.schedule,
            step_timeout_s=step_timeout_s,
        )
    from passes.rewrite.replicate import realise_strategy

    return realise_strategy(
        model,
        per_replica,
        num_microbatches=strategy.num_microbatches,
        schedule=strategy.schedule,
        sample_inputs=sample,
    )


def _device_strings(
    plan: Plan, devices: Sequence[str] | None, handle: Any, used: Sequence[int] | None = None
) -> tuple[str, ...]:
    """TensorFlow device strings for the plan's devices, in the plan's order. On a cluster,
    ``used`` (the devices a strategy with replicas uses; it may leave some of the plan's idle)
    limits the mapping to those, and the others map to ``""``. Off a cluster, each must be a
    device of this process (:func:`_check_local_devices`)."""
    if devices is not None:
        device_strings = tuple(devices)
        if len(device_strings) != plan.num_devices:
            raise PlanError(
                f"the plan has {plan.num_devices} devices but devices= names "
                f"{len(device_strings)}: {list(device_strings)}"
            )
        if handle is None:
            _check_local_devices(device_strings, given=True)
        return device_strings
    if handle is not None:
        from passes.cluster.runtime import remote_device_strings

        if used is None:
            return tuple(remote_device_strings(handle, plan.devices))
        remote = dict(zip(used, remote_device_strings(handle, [plan.devices[i] for i in used])))
        return tuple(remote.get(i, "") for i in range(plan.num_devices))
    if all(d.name for d in plan.devices):
        named = tuple(d.name for d in plan.devices)
        _check_local_devices(named, given=False)
        return named
    return tuple(default_device_strings(plan.num_devices))


def _connected(plan: Plan, cluster: Any, timeout_s: float) -> Any:
    """The :class:`~passes.cluster.runtime.ClusterHandle` of ``cluster`` (connecting to it
    unless it is one), or None without a cluster; refused first when the plan was measured on
    another cluster."""
    if cluster is None:
        return None
    from passes.cluster.runtime import ClusterHandle, WorkerCluster, connect, load_cluster

    if isinstance(cluster, ClusterHandle):
        _check_same_cluster(plan, cluster.cluster)
        return cluster
    spec = cluster if isinstance(cluster, WorkerCluster) else load_cluster(cluster)
    _check_same_cluster(plan, spec)
    return connect(spec, timeout_s=timeout_s)


def _check_same_cluster(plan: Plan, spec: Any) -> None:
    """PlanError naming the tasks whose address differs from the cluster the plan's topology
    was measured on (``partition calibrate``); nothing to check for a plan not measured so."""
    from cost_models.devices.tf_config import address_key

    measured = plan.cluster_addresses
    given = tuple(spec.addresses)
    # one server however spelled: localhost is 127.0.0.1, port 02222 is 2222
    same = [address_key(a) for a in measured] == [address_key(a) for a in given]
    if not measured or same:
        return
    differ = [
        f"task {t}: {measured[t] if t < len(measured) else 'none'} in the plan, "
        f"{given[t] if t < len(given) else 'none'} here"
        for t in range(max(len(measured), len(given)))
        if t >= len(measured)
        or t >= len(given)
        or address_key(measured[t]) != address_key(given[t])
    ]
    raise PlanError(
        f"the plan was measured on another cluster than {spec.source} ({'; '.join(differ)}); "
        "calibrate this cluster (partition calibrate) and plan again, or apply the plan to the "
        "cluster it was measured on"
    )


def _sample_array(spec: Any) -> Any:
    """One sample for a ``tf.TensorSpec``: masks all true, token ids 0 (in every table), empty
    strings for a string input (``np.zeros`` of numpy's object dtype would be the int 0)."""
    if spec.dtype.is_bool:
        return np.ones(spec.shape, dtype=bool)
    if spec.dtype == tf.string:
        return np.full(spec.shape, b"", dtype=object)
    return np.zeros(spec.shape, spec.dtype.as_numpy_dtype)


def _check_applies_to(plan: Plan, model: Any) -> None:
    """PlanError unless ``plan`` was made for ``model``: its layers, then its fingerprint."""
    check_plan_matches_model(
        plan.layer_order,
        [u.name for u in placement_units(model)],
        plan.model_name,
        applied_to=getattr(model, "name", None),
    )
    _check_fingerprint(plan, model)


def _check_model(model: Any) -> None:
    """UsageError unless ``model`` is a Keras model that no plan has placed yet."""
    import keras

    from passes.rewrite.device_placement import PlacedModel
    from passes.rewrite.replicate import ReplicatedModel

    if isinstance(model, (PlacedModel, ReplicatedModel)):
        raise UsageError(
            f"model {model.name!r} is already a copy placed by Plan.apply "
            f"({type(model).__name__}); apply the plan to the original model"
        )
    if not isinstance(model, keras.Model):
        raise UsageError(
            f"Plan.apply needs a keras.Model, got {type(model).__name__} ({_shown(model)}); "
            "build the model (e.g. build_model() of the model file) and pass it"
        )


def apply_plan(
    plan: Plan,
    model: Any,
    devices: Sequence[str] | None = None,
    *,
    cluster: Any = None,
    timeout_s: float = 30.0,
    step_timeout_s: float = 30.0,
) -> Any:
    """A copy of ``model`` placed by ``plan`` (see :meth:`partitioner.plan.model.Plan.apply`),
    checked first (the module docstring)."""
    _check_model(model)
    given = _given_devices(devices)
    strategy = _replicas(plan)
    _check_waits(timeout_s, step_timeout_s)
    handle = _connected(plan, cluster, timeout_s)
    if strategy is not None and handle is not None:
        _check_cluster_holds(strategy, handle)
    used = strategy.devices if strategy is not None else None
    device_strings = _device_strings(plan, given, handle, used)
    _check_distinct(plan, strategy, device_strings, given is not None)
    _check_applies_to(plan, model)
    check_batch_split(model, plan)
    specs = input_specs(model, sample_batch_size(model, plan.share_batch_size), plan.input_shape)
    # One sample per input, in ``model.inputs`` order; the rewrites call the model with its own
    # structure (a dict of inputs too).
    sample = [_sample_array(s) for s in specs]
    _built_and_checked(plan, model, sample)
    if strategy is not None:
        return _replicated(plan, strategy, model, device_strings, sample, handle, step_timeout_s)
    return _one_replica(plan, model, device_strings, sample, handle, step_timeout_s)


def _built_and_checked(plan: Plan, model: Any, sample: Sequence[Any]) -> None:
    """A model whose weights are made only when it is built (a subclassed model never called)
    built here on the sample batch, as every rewrite would build it, and its weight shapes
    checked against the plan's fingerprint then: a plan for ``Net(16)`` applied to ``Net(256)``
    passed, the unbuilt model having no shapes to compare (campaign 34ae). Keras's lock on new
    state stays off, as for a model the trace built (its own ``compile`` may add some)."""
    layers = model._flatten_layers()
    if model.built and all(getattr(layer, "built", True) for layer in layers):
        return
    from passes.rewrite.device_placement import build_keeping_state, sample_batch

    locked = bool(getattr(getattr(model, "_tracker", None), "locked", False))
    try:
        build_keeping_state(model, sample_batch(sample, model))
    except Exception:  # a model that cannot be built so: the rewrites say why
        return
    finally:
        if not locked and getattr(model, "_tracker", None) is not None:
            model._tracker.unlock()
    _check_fingerprint(plan, model)


def _check_here(in_place: str, handle: Any) -> None:
    """RewriteError when a model placed in place (``in_place`` says why) is applied on a
    cluster's tasks (``handle``): they take copies of its layers."""
    if handle is not None:
        raise RewriteError(
            f"{in_place}: Plan.apply places such a model itself (in place), on this process's "
            "devices, and a cluster's tasks take copies of its layers; apply the plan here "
            "without cluster="
        )


def _one_replica(
    plan: Plan,
    model: Any,
    device_strings: Sequence[str],
    sample: list[Any],
    handle: Any,
    step_timeout_s: float,
) -> Any:
    """``model`` placed by a plan of one replica: on a cluster's tasks (``handle``), pipelined,
    copied onto the devices, or, a model the copies cannot take, placed in place."""
    layer_devices = {name: device_strings[d] for name, d in plan.assignment.items()}
    pipeline = plan.pipeline
    in_place = in_place_reason(model)
    if in_place is not None:
        _check_here(in_place, handle)
    if handle is not None:
        from passes.cluster.runtime import place_on_cluster

        return place_on_cluster(
            model,
            layer_devices,
            sample,
            handle,
            num_microbatches=pipeline.num_microbatches if pipeline else None,
            schedule=pipeline.schedule if pipeline else None,
            step_timeout_s=step_timeout_s,
        )
    if pipeline is not None:
        from passes.rewrite.pipeline import pipeline_model

        return pipeline_model(
            model,
            layer_devices,
            num_microbatches=pipeline.num_microbatches,
            schedule=pipeline.schedule,
            sample_inputs=sample,
            stage_devices=[device_strings[d] for d in pipeline.stage_devices],
        )
    if in_place is not None:  # its own train_step, layers that cannot be rebuilt
        from passes.rewrite.in_place import place_in_place

        return place_in_place(model, layer_devices, sample)
    return place_model(model, layer_devices, sample)
