"""Applying a plan to a Keras model: the plan's device indices become TensorFlow device strings,
and the model is placed (:func:`~passes.rewrite.device_placement.place_model`), pipelined
(:func:`~passes.rewrite.pipeline.pipeline_model`) or placed on a cluster's tasks
(:func:`~passes.cluster.runtime.place_on_cluster`)."""

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


def _replicas(plan: Plan, cluster: Any) -> Strategy | None:
    """The plan's strategy when it has replicas (``None`` otherwise); PlanError with the next
    step when those are asked to run from this client on a cluster."""
    strategy = plan.strategy
    if strategy is None or strategy.replicas == 1:
        return None
    if cluster is not None:
        raise PlanError(
            f"the plan runs {strategy.describe()}; replicas on a cluster's tasks train as one "
            "program per worker under tf.distribute.MultiWorkerMirroredStrategy, not from this "
            "client: emit that program with partition --emit (codegen.emit_plan_module) and run "
            "it on every worker"
        )
    return strategy


def _replicated(
    plan: Plan,
    strategy: Strategy,
    model: Any,
    device_strings: Sequence[str],
    sample: Sequence[Any],
) -> Any:
    """The copy of ``model`` that trains under the plan's replicas (data parallel or hybrid),
    through :func:`~passes.rewrite.replicate.realise_strategy`."""
    from passes.rewrite.replicate import realise_strategy

    per_replica = [
        {
            name: device_strings[strategy.device_groups[r][s]]
            for name, s in zip(plan.layer_order, strategy.stage_of_layer)
        }
        for r in range(strategy.replicas)
    ]
    return realise_strategy(
        model,
        per_replica,
        num_microbatches=strategy.num_microbatches,
        schedule=strategy.schedule,
        sample_inputs=sample,
    )


def _device_strings(plan: Plan, devices: Sequence[str] | None, handle: Any) -> tuple[str, ...]:
    """TensorFlow device strings for the plan's devices, in the plan's order."""
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

        return tuple(remote_device_strings(handle, plan.devices))
    if all(d.name for d in plan.devices):
        return tuple(d.name for d in plan.devices)
    return tuple(default_device_strings(plan.num_devices))


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
    strategy = _replicas(plan, cluster)
    handle = None
    if cluster is not None:
        from passes.cluster.runtime import ClusterHandle, connect

        handle = (
            cluster if isinstance(cluster, ClusterHandle) else connect(cluster, timeout_s=timeout_s)
        )
    device_strings = _device_strings(plan, devices, handle)
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
        return _replicated(plan, strategy, model, device_strings, sample)
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
