"""The pipeline rewrite: a plan's stages trained with micro-batches in GPipe or 1F1B order.

``pipeline_model(model, layer_devices, num_microbatches=M, schedule=...)`` returns a
:class:`PipelinedModel`: a placed copy of ``model`` (:func:`passes.rewrite.device_placement.place_model`
makes it; weights, gradients and optimizer slots on the planned devices) whose ``train_step``
splits each batch into ``M`` equal micro-batches, runs stage ``s`` of every micro-batch on the
stage's device, accumulates the gradients over the micro-batches and applies one optimizer update
per batch. ``predict``/``evaluate``/``call`` run the whole batch, as the placed model does.

Schedules (``partitioner.core.ir.Schedule``):

* GPipe (Y. Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
  Parallelism", NeurIPS 2019): every stage runs the forwards of micro-batches ``0..M-1``, then the
  backwards of ``M-1..0``.
* 1F1B, PipeDream-Flush (D. Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  ICML 2021): stage ``s`` of ``S`` runs ``w = min(S - s - 1, M)`` warm-up forwards, then
  alternates one forward and one backward (``F(w+i), B(i)``), then the remaining backwards, so at
  most ``S - s`` micro-batches' activations are live on stage ``s``.

Formulation. Stages are the plan's devices, ordered topologically by the dataflow between the
layers on them (a device whose layers feed another device and are fed back by it is no pipeline
and is refused). Let ``L = sum_m (b_m / B) * loss(x_m)`` with ``b_m = B / M`` the micro-batch size;
for a loss that is a mean over the batch, ``L`` is the batch loss, so ``dL/dw`` is the batch
gradient. Task ``F(s, m)`` evaluates stage ``s``'s layers on micro-batch ``m`` (and, on the last
stage, the micro-batch's weighted loss). Task ``B(s, m)`` is ``tf.gradients`` of the stage's
outputs (weighted by the upstream gradients) with respect to its inputs and its trainable
variables, with the inputs as ``stop_gradients``; ``tf.gradients`` colocates each gradient op with
its forward op, so the backward of a stage runs on its device. Variable gradients are summed over
the micro-batches inside the ``B`` tasks, on the stage's device.

Order. Within one ``tf.function`` the dataflow executor runs any op whose inputs are ready, so
without help micro-batch ``m+1``'s forward overlaps micro-batch ``m``'s backward in whatever
order the executor likes. Every task of a stage is therefore built inside
``tf.control_dependencies([previous task of the same stage])``: every op of the task either gets
that control input or consumes an op that has it, and TensorFlow's executor never starts an op
before its control inputs finish, so the tasks of one device run one after another, in the
schedule's order. ``docs/pipeline.md`` says what that does and does not guarantee (and why
per-stage nested ``tf.function``s would not do it: a control edge on a call waits only for the
callee's side effects).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import keras
import tensorflow as tf

from partitioner.core.errors import PlanError, RewriteError, UsageError
from partitioner.core.ir import EventKind, Phase, Schedule
from partitioner.core.microbatch import InexactKind, inexact_class_names
from partitioner.simulation.schedules import order_stages, pipeline_schedules, schedule_steps
from passes.checks import masks_steps
from passes.rewrite.device_placement import PlacedModel, apply_in_place, finish_copy, place_model
from passes.trace import placement_units

logger = logging.getLogger(__name__)

__all__ = [
    "PipelineGradients",
    "PipelineTask",
    "PipelinedModel",
    "SplitBatchTraining",
    "TaskTiming",
    "measure_task_times",
    "pipeline_model",
    "pipeline_order",
    "pipeline_warnings",
    "sum_gradients",
]

_TASK_KIND: Mapping[Phase, EventKind] = MappingProxyType(
    {Phase.FORWARD: EventKind.FORWARD, Phase.BACKWARD: EventKind.BACKWARD}
)
_BATCH_STATISTICS = inexact_class_names(InexactKind.BATCH_STATISTICS)
_NOT_DIVISIBLE = re.compile(r"batch size \d+ is not divisible by num_microbatches=\d+[^\n\]\"']*")


# -- schedules (pure Python) ------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineTask:
    """One stage's forward or backward of one micro-batch."""

    kind: EventKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{'F' if self.kind is EventKind.FORWARD else 'B'}{self.microbatch}"


def pipeline_order(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> tuple[tuple[PipelineTask, ...], ...]:
    """Each stage's tasks in the order the schedule runs them (see the module docstring)."""
    _check_microbatches(num_microbatches)
    if schedule not in pipeline_schedules():
        raise UsageError(
            f"schedule {schedule.value!r} does not pipeline; use one of "
            f"{', '.join(s.value for s in pipeline_schedules())}"
        )
    if num_stages < 1:
        raise UsageError(f"num_stages={num_stages} must be >= 1")
    steps = schedule_steps(schedule, num_stages, num_microbatches)
    return tuple(
        tuple(PipelineTask(_TASK_KIND[step.phase], s, step.microbatch) for step in stage_steps)
        for s, stage_steps in enumerate(steps)
    )


def _check_microbatches(num_microbatches: int) -> None:
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise UsageError(f"num_microbatches={num_microbatches!r} must be an integer >= 1")
    if num_microbatches < 1:
        raise UsageError(
            f"num_microbatches={num_microbatches} must be >= 1; use 1 for no micro-batching "
            "or e.g. 4 to split each batch into 4"
        )


# -- splitting a graph model into stages ------------------------------------------------------


@dataclass(frozen=True)
class _Stage:
    device: str
    nodes: tuple[Any, ...]
    """Keras graph nodes of the stage, in execution order."""
    input_ids: tuple[int, ...]
    """ids of the symbolic tensors the stage reads from other stages or the model's inputs."""
    output_ids: tuple[int, ...]
    """ids of the symbolic tensors the stage produces for other stages or as model outputs."""
    unit_names: tuple[str, ...]
    variables: tuple[Any, ...]
    """The trainable (Keras) variables of the stage's layers."""


@dataclass(frozen=True)
class _StageSplit:
    functional: Any
    stages: tuple[_Stage, ...]
    producers: tuple[tuple[int, ...], ...]
    """``producers[s]``: the stages whose ``F`` task ``F(s, m)`` needs (for the loss, too)."""
    consumers: tuple[tuple[int, ...], ...]
    """``consumers[s]``: the stages whose ``B`` task ``B(s, m)`` needs."""
    output_ids: tuple[int, ...]
    input_ids: tuple[int, ...]


def _graph_of(model: keras.Model) -> Any:
    from keras.src.models.functional import Functional

    if isinstance(model, keras.Sequential):
        functional = getattr(model, "_functional", None)
        if functional is None:
            raise RewriteError(
                f"Sequential model {model.name!r} has no known input shape, so it cannot be split "
                "into stages; start it with keras.Input(shape=...)"
            )
        return functional
    if isinstance(model, Functional):
        return model
    raise RewriteError(
        f"model {model.name!r} is a subclassed {type(model).__name__}: its call() cannot be split "
        "into pipeline stages; build it with the functional API or Sequential, or plan it "
        "without a pipeline (one device, data parallel or a plain split)"
    )


def _execution_order(functional: Any) -> list[Any]:
    order = []
    for depth in sorted(functional._nodes_by_depth, reverse=True):
        for node in functional._nodes_by_depth[depth]:
            if node.operation is not None and not node.is_input:
                order.append(node)
    return order


def _split(
    inner: keras.Model, device_of_unit: Mapping[int, str], prefer: Sequence[str] = ()
) -> _StageSplit:
    """Group the inner model's graph nodes by device and order the devices as stages: in
    dataflow order, ``prefer``'s order (the plan's) among devices the dataflow leaves unordered
    (two heads of one trunk)."""
    functional = _graph_of(inner)
    nodes = _execution_order(functional)
    node_device = [_node_device(functional, inner, node, device_of_unit) for node in nodes]
    producer_device = {
        id(t): device for node, device in zip(nodes, node_device) for t in node.outputs
    }
    order = _device_order(nodes, node_device, producer_device, prefer)
    stage_of_device = {d: k for k, d in enumerate(order)}
    node_stage = [stage_of_device[d] for d in node_device]
    producer_stage = {i: stage_of_device[d] for i, d in producer_device.items()}
    members = _stage_members(inner, functional, nodes, node_stage, len(order))
    inputs, consumed_by = _stage_inputs(nodes, node_stage, producer_stage, len(order))
    output_ids = tuple(id(t) for t in functional.outputs)
    flow = _stage_flow(members[0], consumed_by, output_ids)
    stages = tuple(
        _Stage(
            device=device,
            nodes=tuple(members[0][s]),
            input_ids=tuple(inputs[s]),
            output_ids=flow.outputs[s],
            unit_names=tuple(members[1][s]),
            variables=tuple(members[2][s]),
        )
        for s, device in enumerate(order)
    )
    return _StageSplit(
        functional=functional,
        stages=stages,
        producers=flow.producers,
        consumers=flow.consumers,
        output_ids=output_ids,
        input_ids=tuple(id(t) for t in functional.inputs),
    )


def _node_device(
    functional: Any, inner: keras.Model, node: Any, device_of_unit: Mapping[int, str]
) -> str:
    """The planned device of a graph node's layer (a nested model's: the one of all its layers)."""
    op = functional._get_operation_for_node(node)
    device = device_of_unit.get(id(op))
    if device is None and isinstance(op, keras.Model):
        devices = {device_of_unit.get(id(u.operation)) for u in placement_units(op)}
        if len(devices) != 1 or None in devices:
            raise RewriteError(
                f"nested model {op.name!r} has layers on {sorted(str(d) for d in devices)}; "
                "a pipeline stage cannot split a nested model: put its layers on one device "
                "or flatten it into the outer model"
            )
        device = devices.pop()
    if device is None:
        raise RewriteError(
            f"layer {op.name!r} of {inner.name!r} has no device in the plan; make the plan "
            "for this model"
        )
    return device


def _device_order(
    nodes: Sequence[Any],
    node_device: Sequence[str],
    producer_device: Mapping[int, str],
    prefer: Sequence[str] = (),
) -> list[str]:
    """The devices in stage order: the dataflow's topological order, the earliest in ``prefer``
    first among the ready, then the first reached (a two-headed model's heads on two devices
    are ready together: the plan's order of them was refused as not the dataflow's, 34ah).

    RewriteError when the devices feed each other in a cycle.
    """
    rank = {device: k for k, device in enumerate(prefer)}
    first_seen: dict[str, tuple[int, int]] = {}
    for device in node_device:
        first_seen.setdefault(device, (rank.get(device, len(rank)), len(first_seen)))
    witness: dict[tuple[str, str], str] = {}
    for node, device in zip(nodes, node_device):
        for t in node.input_tensors:
            src = producer_device.get(id(t))
            if src is not None and src != device:
                witness.setdefault((src, device), node.operation.name)
    found = order_stages(list(first_seen), witness, key=first_seen.__getitem__)
    if not found.blocked:
        return list(found.order)
    hops = ", ".join(f"{a} -> {b} (at layer {witness[(a, b)]!r})" for a, b in found.cycle)
    raise RewriteError(
        f"the plan is not a pipeline: its devices feed each other in a cycle: {hops}; "
        "pipeline stages must follow the dataflow: replan with a contiguous solver "
        '(solver="dp", "time" or "even") or plan with pipeline=False'
    )


def _stage_members(
    inner: keras.Model, functional: Any, nodes: Sequence[Any], node_stage: Sequence[int], n: int
) -> tuple[list[list[Any]], list[list[str]], list[list[Any]]]:
    """Per stage: its graph nodes (execution order), placement unit names, trainable variables."""
    unit_names = {id(u.operation): u.name for u in placement_units(inner)}
    stage_nodes: list[list[Any]] = [[] for _ in range(n)]
    stage_units: list[list[str]] = [[] for _ in range(n)]
    stage_vars: list[list[Any]] = [[] for _ in range(n)]
    seen_ops: set[int] = set()
    for node, s in zip(nodes, node_stage):
        stage_nodes[s].append(node)
        op = functional._get_operation_for_node(node)
        if id(op) in seen_ops:
            continue
        seen_ops.add(id(op))
        if isinstance(op, keras.Model):
            stage_units[s] += [unit_names.get(id(u.operation), u.name) for u in placement_units(op)]
        else:
            stage_units[s].append(unit_names.get(id(op), op.name))
        stage_vars[s] += list(getattr(op, "trainable_weights", []) or [])
    return stage_nodes, stage_units, stage_vars


def _stage_inputs(
    nodes: Sequence[Any], node_stage: Sequence[int], producer_stage: Mapping[int, int], n: int
) -> tuple[list[list[int]], dict[int, set[int]]]:
    """Per stage, the tensors it reads from elsewhere; per tensor, the other stages reading it."""
    consumed_by: dict[int, set[int]] = {}
    stage_inputs: list[list[int]] = [[] for _ in range(n)]
    for node, s in zip(nodes, node_stage):
        for t in node.input_tensors:
            src = producer_stage.get(id(t))
            if src is None or src != s:
                if id(t) not in stage_inputs[s]:
                    stage_inputs[s].append(id(t))
                if src is not None:
                    consumed_by.setdefault(id(t), set()).add(s)
    return stage_inputs, consumed_by


@dataclass(frozen=True)
class _StageFlow:
    outputs: tuple[tuple[int, ...], ...]
    """Per stage: the tensors it produces for other stages or as the model's outputs."""
    producers: tuple[tuple[int, ...], ...]
    consumers: tuple[tuple[int, ...], ...]


def _stage_flow(
    stage_nodes: Sequence[Sequence[Any]],
    consumed_by: Mapping[int, set[int]],
    output_ids: Sequence[int],
) -> _StageFlow:
    """Each stage's outputs, and which stages each stage's tasks wait for (see _StageSplit).

    A model output made before the last stage is read there by the loss.
    """
    last = len(stage_nodes) - 1
    outputs = []
    producers: list[set[int]] = [set() for _ in stage_nodes]
    consumers: list[set[int]] = [set() for _ in stage_nodes]
    for s, nodes in enumerate(stage_nodes):
        outs: list[int] = []
        for node in nodes:
            for t in node.outputs:
                if (id(t) in consumed_by or id(t) in output_ids) and id(t) not in outs:
                    outs.append(id(t))
                readers = set(consumed_by.get(id(t), ()))
                if id(t) in output_ids and s != last:
                    readers.add(last)
                for c in readers:
                    producers[c].add(s)
                    consumers[s].add(c)
        outputs.append(tuple(outs))
    return _StageFlow(
        outputs=tuple(outputs),
        producers=tuple(tuple(sorted(p)) for p in producers),
        consumers=tuple(tuple(sorted(c)) for c in consumers),
    )


# -- exactness warnings -----------------------------------------------------------------------


_RANDOM_RATES = ("rate", "dropout", "recurrent_dropout", "stddev")


def _draws_randomness(layer: Any) -> bool:
    """A layer with a seed generator draws random numbers in training unless every rate it has
    (dropout, recurrent dropout, noise) is 0 -- an LSTM with no dropout is exact."""
    if getattr(layer, "seed_generator", None) is None:
        return False
    rates = [
        getattr(layer, a)
        for a in _RANDOM_RATES
        if isinstance(getattr(layer, a, None), (int, float))
    ]
    return not rates or any(r > 0 for r in rates)


def _uses_batch_statistics(layer: Any) -> bool:
    """Whether ``layer`` is (a subclass of) a batch-statistics class of the inexact-layer table
    (:data:`partitioner.core.microbatch.INEXACT_LAYERS`) and trainable (a frozen one runs in
    inference mode, on its moving statistics: exact)."""
    trainable = bool(getattr(layer, "trainable", True))
    return trainable and any(cls.__name__ in _BATCH_STATISTICS for cls in type(layer).__mro__)


def _inexact_warnings(units: Sequence[Any], num_microbatches: int) -> tuple[str, ...]:
    if num_microbatches == 1:
        return ()
    batch_stats: list[str] = []
    random_layers: list[str] = []
    activity: list[str] = []
    masking: list[str] = []
    for unit in units:
        op = unit.operation
        layers = (
            op._flatten_layers(include_self=True, recursive=True)
            if hasattr(op, "_flatten_layers")
            else [op]
        )
        for layer in layers:
            if _uses_batch_statistics(layer):
                batch_stats.append(layer.name)
            if _draws_randomness(layer) and unit.name not in random_layers:
                random_layers.append(unit.name)
            if getattr(layer, "activity_regularizer", None) is not None:
                activity.append(layer.name)
            if masks_steps(layer):
                masking.append(layer.name)
    notes = []
    if batch_stats:
        notes.append(
            f"BatchNormalization layers {batch_stats[:4]}{'...' if len(batch_stats) > 4 else ''} "
            f"normalise each of the {num_microbatches} micro-batches with its own statistics and "
            f"update their moving averages {num_microbatches} times per batch: gradients differ "
            "from unpipelined training (use LayerNormalization or num_microbatches=1 to be exact)"
        )
    if random_layers:
        notes.append(
            f"random layers {random_layers[:4]}{'...' if len(random_layers) > 4 else ''} draw "
            "their masks per micro-batch, so their random streams differ from unpipelined "
            "training (the expected gradient is the same)"
        )
    if masking:
        notes.append(
            f"layers {masking[:4]}{'...' if len(masking) > 4 else ''} mask time steps: a loss "
            f"over them is averaged over each of the {num_microbatches} micro-batches' unmasked "
            "steps, not the whole batch's, so gradients differ from unpipelined training when "
            "the micro-batches hold different numbers of them"
        )
    if activity:
        notes.append(
            f"activity regularizers on {activity[:4]} add a loss per micro-batch call; their "
            "weighting differs from unpipelined training"
        )
    return tuple(notes)


def pipeline_warnings(model: keras.Model, num_microbatches: int) -> tuple[str, ...]:
    """Where pipelining ``model`` with ``num_microbatches`` is not exact (for ``Plan.warnings``)."""
    _check_microbatches(num_microbatches)
    return _inexact_warnings(placement_units(model), num_microbatches)


# -- the model --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PipelineGradients:
    """What one pipelined batch computes (graph tensors; see ``PipelinedModel.pipeline_gradients``)."""

    loss: Any
    """The batch loss: the micro-batch losses weighted by micro-batch size / batch size."""
    y_pred: Any
    """The model's outputs for the whole batch (micro-batch outputs concatenated)."""
    gradients: tuple[Any, ...]
    """Gradients of ``loss`` for ``trainable_weights``, in that order (``None`` where unused)."""
    timestamps: tuple[tuple[PipelineTask, Any, Any], ...] = ()
    """``(task, start, end)`` wall-clock timestamps, only when measured."""


@dataclass(frozen=True)
class TaskTiming:
    """When one task ran, in seconds from the earliest task start of the measured step."""

    task: PipelineTask
    device: str
    start_s: float
    end_s: float


class SplitBatchTraining(keras.Model):
    """What every model that splits each batch in its training step shares: the optimizer update
    without Keras's device-less "all-reduce" (:meth:`_apply_gradients`), and ``fit`` and
    ``train_on_batch`` that turn the step's in-graph batch-size assertion into the one-line
    :class:`UsageError` of :meth:`_batch_errors`."""

    def _batch_errors(self) -> contextlib.AbstractContextManager[None]:
        """Catches the error of the batch-size assertion this model's step makes."""
        return _batch_errors()

    def _apply_gradients(self, grads_and_vars: list[tuple[Any, Any]]) -> None:
        """One optimizer update, each variable's on its own device, and nothing elsewhere
        (:func:`passes.rewrite.device_placement.apply_in_place`)."""
        apply_in_place(self.optimizer, grads_and_vars)

    # -- clean errors for a batch that does not split -------------------------------------------

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        with self._batch_errors():
            return super().fit(*args, **kwargs)

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        with self._batch_errors():
            return super().train_on_batch(*args, **kwargs)


class PipelinedModel(SplitBatchTraining, PlacedModel):
    """A placed model whose training step pipelines micro-batches; see the module docstring."""

    def __init__(
        self,
        inner: keras.Model,
        layer_devices: Mapping[str, str] | None = None,
        *,
        num_microbatches: int = 1,
        schedule: Schedule = Schedule.ONE_F_ONE_B,
        enforce_order: bool = True,
        warnings: Sequence[str] = (),
        stage_order: Sequence[str] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(inner, layer_devices, **kwargs)
        _check_microbatches(num_microbatches)
        device_of_unit = {
            id(u.operation): d
            for u, d in zip(placement_units(inner), (layer_devices or {}).values())
        }
        split = _split(inner, device_of_unit, stage_order)
        order = pipeline_order(schedule, len(split.stages), num_microbatches)
        object.__setattr__(self, "_split", split)
        object.__setattr__(self, "_order", order)
        self.num_microbatches = num_microbatches
        self.schedule = schedule
        self.enforce_order = enforce_order
        self._warnings = tuple(warnings)

    # -- facts ----------------------------------------------------------------------------------

    @property
    def warnings(self) -> tuple[str, ...]:
        """Where micro-batched training is not exactly the unpipelined training (one line each)."""
        return self._warnings

    @property
    def stage_devices(self) -> tuple[str, ...]:
        """The device of each stage, in dataflow order."""
        return tuple(s.device for s in self._split.stages)

    @property
    def stage_layers(self) -> tuple[tuple[str, ...], ...]:
        """The placement units (layer names) of each stage."""
        return tuple(s.unit_names for s in self._split.stages)

    @property
    def task_order(self) -> tuple[tuple[PipelineTask, ...], ...]:
        """Each stage's tasks in the enforced order."""
        return self._order

    @property
    def output_device(self) -> str | None:
        return self._split.stages[-1].device

    # -- one pipelined batch --------------------------------------------------------------------

    def _split_batch(self, x: Any, y: Any, sample_weight: Any) -> tuple[list[Any], ...]:
        from keras.src import tree

        flat_x = [t for t in tree.flatten(x) if t is not None]
        if not flat_x:
            raise RewriteError("pipelined training needs input data (x is empty)")
        m = self.num_microbatches
        first = tf.convert_to_tensor(flat_x[0])
        static = first.shape[0]
        checks = []
        if static is not None:
            if static % m:
                raise UsageError(_not_divisible_message(int(static), m))
        else:
            batch = tf.shape(first)[0]
            checks.append(
                tf.debugging.Assert(
                    tf.equal(tf.math.floormod(batch, m), 0),
                    [tf.strings.format(_not_divisible_message("{}", m), batch)],
                )
            )
        return tuple(split_structure(part, m, checks) for part in (x, y, sample_weight))

    def _microbatch_loss_weight(self, weighted: bool) -> float:
        """What each micro-batch's loss is multiplied by so that they add up to the batch loss.

        A mean over the batch (Keras's default reduction, ``sum_over_batch_size``) is the
        average of the micro-batch means: weight ``1/M``; a ``sum`` is the sum of the sums.
        """
        from keras.src import tree

        losses = (
            [self.loss] if isinstance(self.loss, keras.losses.Loss) else tree.flatten(self.loss)
        )
        reductions = {
            str(getattr(loss, "reduction", "sum_over_batch_size")) for loss in losses if loss
        } or {"sum_over_batch_size"}
        if reductions == {"sum"}:
            return 1.0
        if "sum" in reductions:
            raise RewriteError(
                f"the losses' reductions {sorted(reductions)} mix sums and means over the batch; "
                "pipelining weights every micro-batch's loss alike: use one kind for all outputs"
            )
        if weighted and "mean_with_sample_weight" in reductions:
            logger.warning(
                "a loss with reduction 'mean_with_sample_weight' divides by each micro-batch's "
                "sum of sample weights: pipelined gradients are exact only when every "
                "micro-batch's weights add up alike"
            )
        return 1.0 / self.num_microbatches

    def pipeline_gradients(
        self, x: Any, y: Any = None, sample_weight: Any = None, *, measure: bool = False
    ) -> PipelineGradients:
        """The batch loss, outputs and gradients, computed stage by stage in the schedule's order.

        Only valid inside a ``tf.function`` (``fit`` traces ``train_step`` into one). With
        ``measure=True`` each task also records ``tf.timestamp()`` at its start and end.
        """
        if tf.executing_eagerly():
            raise RewriteError(
                "pipelined training builds a graph (tf.gradients and control dependencies); do not "
                "compile with run_eagerly=True, and call pipeline_gradients inside tf.function"
            )
        xs, ys, sws = self._split_batch(x, y, sample_weight)
        weight = self._microbatch_loss_weight(sample_weight is not None)
        build = _BatchBuild(self, _Microbatches(xs, ys, sws, weight), measure=measure)
        build.run(self._order)
        return build.result()

    def train_step(self, data: Any) -> Any:
        from keras.src import tree
        from keras.src.losses import loss as loss_module

        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        result = self.pipeline_gradients(x, y, sample_weight)
        self._loss_tracker.update_state(
            loss_module.unscale_loss_for_distribution(result.loss),
            sample_weight=tf.shape(next(i for i in tree.flatten(x) if i is not None))[0],
        )
        if self.trainable_weights:
            self._apply_gradients(list(zip(result.gradients, self.trainable_weights)))
        with tf.device(self.output_device):
            return self.compute_metrics(x, y, result.y_pred, sample_weight=sample_weight)


@dataclass(frozen=True)
class _Microbatches:
    """One batch split into micro-batches, and the weight of each micro-batch's loss."""

    xs: Sequence[Any]
    ys: Sequence[Any]
    sample_weights: Sequence[Any]
    loss_weight: float


class _BatchBuild:
    """The graph of one pipelined batch, built task by task (``pipeline_gradients``'s state).

    ``values[m]`` maps a symbolic tensor's id to its value for micro-batch ``m``;
    ``upstream[m]`` to the gradients flowing into it from later stages or the loss;
    ``handle[s]`` is the end marker of stage ``s``'s last task, which its next task waits for.
    """

    def __init__(self, model: PipelinedModel, batches: _Microbatches, *, measure: bool) -> None:
        self.model = model
        self.split: _StageSplit = model._split
        self.batches = batches
        self.measure = measure
        m_count = model.num_microbatches
        self.all_vars = list(model.trainable_weights)
        self.var_index = {id(v): k for k, v in enumerate(self.all_vars)}
        self.accumulated: list[Any] = [None] * len(self.all_vars)
        self.values: list[dict[int, Any]] = [
            dict(zip(self.split.input_ids, self.split.functional._standardize_inputs(x)))
            for x in batches.xs
        ]
        self.y_pred: list[Any] = [None] * m_count
        self.losses: list[Any] = [None] * m_count
        self.upstream: list[dict[int, list[Any]]] = [{} for _ in range(m_count)]
        self.done: set[PipelineTask] = set()
        self.handle: list[Any] = [None] * len(self.split.stages)
        self.stamps: list[tuple[PipelineTask, Any, Any]] = []

    @property
    def last_stage(self) -> int:
        return len(self.split.stages) - 1

    def run(self, order: Sequence[Sequence[PipelineTask]]) -> None:
        """Build every stage's tasks in ``order``, each as soon as the tasks it reads are built."""
        queues = [list(tasks) for tasks in order]
        while any(queues):
            progressed = False
            for queue in queues:
                if queue and self._ready(queue[0]):
                    self._build_task(queue.pop(0))
                    progressed = True
            if not progressed:  # pragma: no cover - the schedules are deadlock-free
                heads = [str(q[0]) for q in queues if q]
                raise RewriteError(f"pipeline schedule deadlocks at tasks {heads}")

    def result(self) -> PipelineGradients:
        """The batch loss, the concatenated outputs and the accumulated gradients."""
        from keras.src import tree

        with tf.device(self.model.output_device):
            loss = tf.add_n(self.losses) if len(self.losses) > 1 else self.losses[0]
            flat = [tree.flatten(p) for p in self.y_pred]
            joined = [tf.concat(list(parts), axis=0) for parts in zip(*flat)]
            y_full = tree.pack_sequence_as(self.y_pred[0], joined)
        return PipelineGradients(
            loss=loss,
            y_pred=y_full,
            gradients=tuple(self.accumulated),
            timestamps=tuple(self.stamps),
        )

    def _ready(self, task: PipelineTask) -> bool:
        """Whether the tasks ``task`` reads from other stages are built."""
        fwd, m = EventKind.FORWARD, task.microbatch
        if task.kind is fwd:
            return all(
                PipelineTask(fwd, p, m) in self.done for p in self.split.producers[task.stage]
            )
        return PipelineTask(fwd, task.stage, m) in self.done and all(
            PipelineTask(EventKind.BACKWARD, c, m) in self.done
            for c in self.split.consumers[task.stage]
        )

    def _build_task(self, task: PipelineTask) -> None:
        """Build ``task`` on its stage's device, after the stage's previous task (if enforced)."""
        s = task.stage
        stage = self.split.stages[s]
        deps: list[Any] = []
        if self.model.enforce_order and self.handle[s] is not None:
            deps.append(self.handle[s])
        with tf.device(stage.device), tf.name_scope(_task_scope(task)):
            start = None
            if self.measure:
                data_in = _task_inputs(task, stage, self.values, self.upstream)
                with tf.control_dependencies(deps + data_in):
                    start = _independent_timestamp()
                deps = [start]
            with tf.control_dependencies(deps):
                if task.kind is EventKind.FORWARD:
                    produced = self._forward(stage, s, task.microbatch)
                else:
                    produced = self._backward(stage, s, task.microbatch)
                produced = [p for p in produced if p is not None]
            with tf.control_dependencies(produced):
                end = _independent_timestamp() if self.measure else tf.no_op(name="done")
        if self.measure:
            self.stamps.append((task, start, end))
        self.handle[s] = end
        self.done.add(task)

    def _forward(self, stage: _Stage, s: int, m: int) -> list[Any]:
        """``F(s, m)``: the stage's layers on micro-batch ``m``; on the last stage, its loss."""
        from keras.src import tree
        from keras.src.models.functional import operation_fn

        vals = self.values[m]
        for node in stage.nodes:
            args, kwargs = node.arguments.fill_in(vals)
            op = self.split.functional._get_operation_for_node(node)
            outputs = operation_fn(op, training=True)(*args, **kwargs)
            for ref, value in zip(node.outputs, tree.flatten(outputs)):
                vals[id(ref)] = value
        produced = [vals[i] for i in stage.output_ids]
        if s == self.last_stage:
            produced.append(self._loss(m))
        return produced

    def _loss(self, m: int) -> Any:
        """Micro-batch ``m``'s outputs and weighted loss (read from the last stage's values)."""
        from keras.src import tree

        vals, b = self.values[m], self.batches
        outs = [vals[i] for i in self.split.output_ids]
        pred = tree.pack_sequence_as(self.split.functional._outputs_struct, outs)
        if isinstance(pred, (list, tuple)) and len(pred) == 1:
            pred = pred[0]
        self.y_pred[m] = pred
        loss = self.model._compute_loss(
            x=b.xs[m], y=b.ys[m], y_pred=pred, sample_weight=b.sample_weights[m], training=True
        )
        self.losses[m] = loss * b.loss_weight
        return self.losses[m]

    def _backward(self, stage: _Stage, s: int, m: int) -> list[Any]:
        """``B(s, m)``: gradients of the stage's outputs for its inputs and variables."""
        vals = self.values[m]
        grads_in = self.upstream[m]
        produced = self._loss_backward(m) if s == self.last_stage else []
        targets: list[Any] = []
        grad_ys: list[Any] = []
        for i in stage.output_ids:
            incoming = grads_in.get(i, [])
            if incoming and vals[i].dtype.is_floating:
                targets.append(vals[i])
                grad_ys.append(incoming[0] if len(incoming) == 1 else tf.add_n(incoming))
        if not targets:
            return produced
        input_ids = [
            i
            for i in stage.input_ids
            if i not in self.split.input_ids and vals[i].dtype.is_floating
        ]
        inputs = [vals[i] for i in input_ids]
        grads = tf.gradients(
            targets,
            inputs + [v.value for v in stage.variables],
            grad_ys=grad_ys,
            stop_gradients=inputs,
        )
        for i, g in zip(input_ids, grads[: len(inputs)]):
            if g is not None:
                grads_in.setdefault(i, []).append(g)
                produced.append(g)
        return produced + self._accumulate(list(stage.variables), grads[len(inputs) :])

    def _loss_backward(self, m: int) -> list[Any]:
        """The loss's own gradient for the outputs, and for any variable it reads directly
        (weight regularizers); the outputs stop it from reaching into the model."""
        vals = self.values[m]
        scaled = self.losses[m]
        if self.model.optimizer is not None:
            scaled = self.model.optimizer.scale_loss(scaled)
        outs = [(i, vals[i]) for i in self.split.output_ids if vals[i].dtype.is_floating]
        out_tensors = [t for _, t in outs]
        grads = tf.gradients(
            scaled, out_tensors + [v.value for v in self.all_vars], stop_gradients=out_tensors
        )
        for (i, _), g in zip(outs, grads[: len(outs)]):
            if g is not None:
                self.upstream[m].setdefault(i, []).append(g)
        return self._accumulate(self.all_vars, grads[len(outs) :])

    def _accumulate(self, variables: Sequence[Any], grads: Sequence[Any]) -> list[Any]:
        """Add ``grads`` to the variables' sums over the micro-batches (:func:`sum_gradients`:
        an ``Embedding``'s ``IndexedSlices`` stay sparse, so the optimizer gets the slices the
        whole batch gives, which Adam's sparse update needs to update as the original does,
        campaign 34v); the new sums' tensors."""
        made = []
        for v, g in zip(variables, grads):
            if g is None:
                continue
            k = self.var_index[id(v)]
            before = self.accumulated[k]
            total = g if before is None else sum_gradients([before, g], None)
            self.accumulated[k] = total
            made.append(total.values if isinstance(total, tf.IndexedSlices) else total)
        return made


def sum_gradients(values: Sequence[Any], divisor: float | None) -> Any:
    """``values`` (gradients of one variable: micro-batches', replicas') summed, and divided by
    ``divisor`` unless it is None, on the current device. ``tf.IndexedSlices`` stay sparse:
    indices and values are concatenated, the values divided (TensorFlow's
    ``aggregate_indexed_slices``), so an optimizer's sparse update sees every slice the whole
    batch gives; a sparse and a dense gradient are summed dense."""
    if all(isinstance(v, tf.IndexedSlices) for v in values):
        joined = tf.concat([v.values for v in values], axis=0)
        if divisor is not None:
            joined = joined / tf.cast(divisor, joined.dtype)
        indices = tf.concat([v.indices for v in values], axis=0)
        return tf.IndexedSlices(joined, indices, values[0].dense_shape)
    dense = [tf.convert_to_tensor(v) for v in values]
    total = tf.add_n(dense)
    return total if divisor is None else total / tf.cast(divisor, total.dtype)


def _task_scope(task: PipelineTask) -> str:
    """The name scope of a task's ops (``stage1_F0``); its end marker is ``<scope>/done``."""
    return f"stage{task.stage}_{task}"


def _independent_timestamp() -> Any:
    """``tf.timestamp()`` left out of ``tf.function``'s automatic control dependencies.

    Automatic control dependencies chain every stateful op that takes no resource (Timestamp,
    Print, Assert) in program order across the whole function; left in, the probes would
    serialise the stages they measure.
    """
    stamp = tf.timestamp()
    manager = getattr(stamp.graph, "experimental_acd_manager", None)
    if manager is not None:
        manager.run_independently(stamp.op)
    else:  # pragma: no cover - depends on the TensorFlow version
        logger.warning("cannot exempt timestamps from automatic control dependencies")
    return stamp


def split_structure(structure: Any, count: int, checks: Sequence[Any]) -> list[Any]:
    """``count`` equal pieces of ``structure`` (each tensor split along the batch axis once
    ``checks`` have run, its ``None`` leaves kept); ``[None] * count`` for ``None``."""
    from keras.src import tree

    if structure is None:
        return [None] * count
    leaves = tree.flatten(structure)
    with tf.control_dependencies(checks):
        parts = [
            None if t is None else tf.split(tf.convert_to_tensor(t), count, axis=0) for t in leaves
        ]
    return [
        tree.pack_sequence_as(structure, [None if p is None else p[k] for p in parts])
        for k in range(count)
    ]


def _not_divisible_message(batch: int | str, num_microbatches: int) -> str:
    return (
        f"batch size {batch} is not divisible by num_microbatches={num_microbatches}: each batch "
        f"is split into {num_microbatches} equal micro-batches; use a batch size (and a dataset "
        f"length) that is a multiple of {num_microbatches}, or another num_microbatches"
    )


@contextlib.contextmanager
def assertion_errors(pattern: re.Pattern[str]) -> Iterator[None]:
    """Turn an in-graph assertion whose message matches ``pattern`` into a one-line
    :class:`UsageError` (the rewrites check batch sizes inside the step)."""
    try:
        yield
    except tf.errors.InvalidArgumentError as exc:
        found = pattern.search(str(exc))
        if found is None:
            raise
        raise UsageError(found.group(0).strip()) from None


def _batch_errors() -> contextlib.AbstractContextManager[None]:
    """Turn the runtime batch-size assertion into the one-line :class:`UsageError`."""
    return assertion_errors(_NOT_DIVISIBLE)


def _task_inputs(
    task: PipelineTask,
    stage: _Stage,
    values: Sequence[Mapping[int, Any]],
    upstream: Sequence[Mapping[int, Sequence[Any]]],
) -> list[Any]:
    """The data a task waits for (for its start timestamp)."""
    vals = values[task.microbatch]
    if task.kind is EventKind.FORWARD:
        return [vals[i] for i in stage.input_ids]
    grads = upstream[task.microbatch]
    found = [g for i in stage.output_ids for g in grads.get(i, [])]
    return found or [vals[i] for i in stage.output_ids]


# -- building ---------------------------------------------------------------------------------


def pipeline_model(
    model: keras.Model,
    layer_devices: Mapping[str, str],
    *,
    num_microbatches: int,
    schedule: Schedule,
    sample_inputs: Sequence[Any],
    stage_devices: Sequence[str] | None = None,
    enforce_order: bool = True,
) -> PipelinedModel:
    """A pipelined copy of ``model`` with each placement unit on ``layer_devices[unit name]``.

    Stages are the distinct devices of ``layer_devices`` in dataflow order; ``stage_devices``
    (the plan's stage order as device strings), when given, must be that order. ``sample_inputs``
    (one array per model input, any batch size) builds the copy. ``enforce_order=False`` leaves
    the order of the tasks to TensorFlow's executor (for measurements). The original model is
    never modified.
    """
    _check_microbatches(num_microbatches)
    if not isinstance(schedule, Schedule) or schedule not in pipeline_schedules():
        shown = f'"{schedule.value}"' if isinstance(schedule, Schedule) else repr(schedule)
        known = " or ".join(f'schedule="{s.value}"' for s in pipeline_schedules())
        raise UsageError(
            f"schedule={shown} does not pipeline; use {known}, or plan with pipeline=False"
        )
    devices = list(dict.fromkeys(layer_devices.values()))
    if len(devices) < 2:
        raise PlanError(
            f"plan has no stages: every layer is on {devices[0] if devices else 'no device'}; "
            "plan for >= 2 devices or with pipeline=False"
        )
    placed = place_model(model, layer_devices, sample_inputs)
    units = placement_units(model)
    warnings = _inexact_warnings(units, num_microbatches)
    pipelined = PipelinedModel(
        placed.inner,
        placed.layer_devices,
        num_microbatches=num_microbatches,
        schedule=schedule,
        enforce_order=enforce_order,
        warnings=warnings,
        stage_order=tuple(stage_devices or ()),
        name=f"{model.name}_pipelined",
    )
    if stage_devices is not None and tuple(stage_devices) != pipelined.stage_devices:
        raise PlanError(
            f"the plan's stage order {list(stage_devices)} is not the dataflow order of "
            f"{model.name!r}'s layers on those devices {list(pipelined.stage_devices)}; "
            "replan for this model"
        )
    finish_copy(pipelined, model, sample_inputs, logger)
    for line in warnings:
        logger.warning("pipeline of %r: %s", model.name, line)
    return pipelined


def measure_task_times(
    pipelined: PipelinedModel, x: Any, y: Any = None, sample_weight: Any = None
) -> tuple[TaskTiming, ...]:
    """Run one pipelined forward+backward (no update) and say when each task started and ended.

    Times come from ``tf.timestamp()`` ops inside the graph: a task's start stamp runs once its
    inputs (and, with the order enforced, the previous task of its stage) are done, and its end
    stamp once its outputs are. Sorted by start time.
    """

    built: list[PipelineTask] = []

    @tf.function(autograph=False)
    def step(x: Any, y: Any, sample_weight: Any) -> Any:
        result = pipelined.pipeline_gradients(x, y, sample_weight, measure=True)
        built[:] = [task for task, _, _ in result.timestamps]
        stamps = [(start, end) for _, start, end in result.timestamps]
        # The loss and the gradients are returned so that the tasks' work is done: Grappler
        # turns computation read only through control edges (the end stamps') into NoOps.
        computed = [result.loss, *(g for g in result.gradients if g is not None)]
        return stamps, computed

    with _batch_errors():
        stamps, _ = step(x, y, sample_weight)
    t0 = min(float(s) for s, _ in stamps)
    timings = [
        TaskTiming(task, pipelined.stage_devices[task.stage], float(s) - t0, float(e) - t0)
        for task, (s, e) in zip(built, stamps)
    ]
    return tuple(sorted(timings, key=lambda t: (t.start_s, t.end_s)))
