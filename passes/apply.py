"""Applying a plan to a Keras model: the plan's device indices become TensorFlow device strings,
and the model is placed (:func:`~passes.rewrite.device_placement.place_model`), pipelined
(:func:`~passes.rewrite.pipeline.pipeline_model`), replicated
(:func:`~passes.rewrite.replicate.realise_strategy`), or, on a cluster's tasks, placed or pipelined
(:func:`~passes.cluster.runtime.place_on_cluster`) or replicated
(:func:`~passes.cluster.runtime.replicate_on_cluster`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from partitioner.core.errors import PlanError
from partitioner.core.strategy import Strategy
from partitioner.plan.model import Plan
from partitioner.plan.schema import check_plan_matches_model
from passes.rewrite.device_placement import default_device_strings, place_model
from passes.trace import input_specs, placement_units

__all__ = ["apply_plan"]


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
    limits the mapping to those, and the others map to ``""``."""
    if devices is not None:
        device_strings = tuple(devices)
        if len(device_strings) != plan.num_devices:
            raise PlanError(
                f"the plan has {plan.num_devices} devices but devices= names "
                f"{len(device_strings)}: {list(device_strings)}"
            )
        return device_strings
    if handle is not None:
        from passes.cluster.runtime import remote_device_strings

        if used is None:
            return tuple(remote_device_strings(handle, plan.devices))
        remote = dict(zip(used, remote_device_strings(handle, [plan.devices[i] for i in used])))
        return tuple(remote.get(i, "") for i in range(plan.num_devices))
    if all(d.name for d in plan.devices):
        return tuple(d.name for d in plan.devices)
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
    measured = plan.cluster_addresses
    given = tuple(spec.addresses)
    if not measured or measured == given:
        return
    differ = [
        f"task {t}: {measured[t] if t < len(measured) else 'none'} in the plan, "
        f"{given[t] if t < len(given) else 'none'} here"
        for t in range(max(len(measured), len(given)))
        if t >= len(measured) or t >= len(given) or measured[t] != given[t]
    ]
    raise PlanError(
        f"the plan was measured on another cluster than {spec.source} ({'; '.join(differ)}); "
        "calibrate this cluster (partition calibrate) and plan again, or apply the plan to the "
        "cluster it was measured on"
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
    """A copy of ``model`` placed by ``plan`` (see :meth:`partitioner.plan.model.Plan.apply`)."""
    strategy = _replicas(plan)
    handle = _connected(plan, cluster, timeout_s)
    if strategy is not None and handle is not None:
        _check_cluster_holds(strategy, handle)
    used = strategy.devices if strategy is not None else None
    device_strings = _device_strings(plan, devices, handle, used)
    check_plan_matches_model(
        plan.layer_order,
        [u.name for u in placement_units(model)],
        plan.model_name,
        applied_to=getattr(model, "name", None),
    )
    specs = input_specs(model, 1, plan.input_shape)
    # One sample per input, in ``model.inputs`` order; the rewrites call the model with its own
    # structure (a dict of inputs too). Masks are all true, token ids 0 (in every table).
    sample = [
        (np.ones if s.dtype.is_bool else np.zeros)(s.shape, s.dtype.as_numpy_dtype) for s in specs
    ]
    layer_devices = {name: device_strings[d] for name, d in plan.assignment.items()}
    pipeline = plan.pipeline
    if strategy is not None:
        return _replicated(plan, strategy, model, device_strings, sample, handle, step_timeout_s)
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
    return place_model(model, layer_devices, sample)
