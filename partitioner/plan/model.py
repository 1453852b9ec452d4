"""A placement plan: what was decided, what it is predicted to cost, and how to apply it.

A :class:`Plan` is a frozen record: the devices, the layer -> device assignment, the predicted
step time and per-device loads, the solver's status and objective, the baselines it was compared
with, and the advice for the user. It saves to and loads from a versioned JSON file (data only:
never pickled, never evaluated) and applies itself to a Keras model with
:func:`passes.rewrite.device_placement.place_model`.

The devices are all of the topology planned for, used or not: a device that runs nothing
(:attr:`Plan.idle_devices`: no layer, in no replica) keeps its row, with zero loads, so indices
mean the same in the plan, its file and ``Plan.apply(devices=...)``.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from partitioner.core.errors import OutputError, PartitionError, PlanError
from partitioner.core.files import (
    check_not_hiding_a_module,
    check_output_path,
    check_outside_kept_files,
    check_replaceable,
    module_file_of,
    path_argument,
    read_input_text,
    write_atomic,
)
from partitioner.core.ir import CostedGraph, EventKind, Schedule, SolverResult, TimelineEvent
from partitioner.core.jsonfiles import json_digest, loads_bounded
from partitioner.core.options import InputShape
from partitioner.core.strategy import Family, Strategy
from partitioner.plan.schema import validate_plan_data
from partitioner.planner.explain import FamilyRow
from partitioner.simulation.evaluate import DeviceLoad, PlanEvaluation

DevicePrediction = DeviceLoad
"""The predicted load of one device (the evaluation's own record)."""

__all__ = [
    "SCHEMA_VERSION",
    "BaselineResult",
    "DevicePrediction",
    "InputSignature",
    "ModelFingerprint",
    "PipelineInfo",
    "Plan",
    "PlanDevice",
    "SolverInfo",
    "device_key",
    "load_plan",
    "plan_digest",
    "plan_from_solution",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2


@dataclass(frozen=True)
class PlanDevice:
    """A device of the plan: its index, catalog type, memory limit, host and TF device string.

    ``name`` is ``""`` for a local device whose TensorFlow name is chosen at apply time.
    """

    index: int
    device_type: str
    memory_bytes: int
    host: int = 0
    name: str = ""


@dataclass(frozen=True)
class SolverInfo:
    """Which solver made the plan and how its answer stands."""

    name: str
    status: str
    objective: float | None
    solve_time_s: float
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class BaselineResult:
    """A plan the chosen one was compared with (``step_time_s`` is None when it did not fit)."""

    solver: str
    step_time_s: float | None
    note: str = ""


@dataclass(frozen=True)
class PipelineInfo:
    """How the plan pipelines: the schedule, micro-batch count and stage order.

    ``stage_devices[s]`` is the device of stage ``s`` (stages in dataflow order);
    ``bubble_fraction[d]`` is the simulated idle share of device ``d``'s step.
    """

    schedule: Schedule
    num_microbatches: int
    stage_devices: tuple[int, ...]
    bubble_fraction: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.num_microbatches < 1:
            raise PlanError(f"num_microbatches={self.num_microbatches} must be >= 1")
        if len(set(self.stage_devices)) != len(self.stage_devices):
            raise PlanError(f"stage_devices {list(self.stage_devices)} names a device twice")


@dataclass(frozen=True)
class InputSignature:
    """One model input as the plan was made for it: its name (for messages), its shape without
    the batch, and its dtype (``float32``, ``int32``, ...)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


INPUT_PREFIX = "<input "
"""How :attr:`ModelFingerprint.layer_inputs` names a model input feeding a layer: ``<input K>``,
K its position in ``model.inputs`` (no layer name can be confused with it)."""


@dataclass(frozen=True)
class ModelFingerprint:
    """What a plan was made for, beyond its layer names: the model's inputs (``model.inputs``
    order) and each layer's weight shapes (``(layer, (shape, ...))`` in layer order, one shape
    per weight in Keras's order). :meth:`Plan.apply` compares the model at hand with it before it
    builds anything (:func:`passes.apply.model_fingerprint` makes both)."""

    inputs: tuple[InputSignature, ...]
    layer_weights: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...]
    layer_inputs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(layer, (layers and inputs feeding it, sorted))`` for each layer of a graph model
    (functional or Sequential) in its Keras graph, a model input named ``<input K>``
    (:data:`INPUT_PREFIX`); empty for a subclassed model and in plans of earlier releases (then
    the wiring is not compared)."""
    layer_classes: tuple[tuple[str, str], ...] = ()
    """``(layer, its class's qualified name)`` for each layer: a layer of another class under
    the same name (a weightless custom layer of fifty matmuls for an ``Activation``) is another
    model; empty in plans of earlier releases (then the classes are not compared)."""

    layer_trainable: tuple[tuple[str, int], ...] = ()
    """``(layer, how many of its weights train)``: a layer frozen (or unfrozen) since the plan has
    other gradients and optimizer state (four times the memory on a device, campaign 34t); empty
    in plans of earlier releases (then not compared)."""

    layer_dtypes: tuple[tuple[str, str], ...] = ()
    """``(layer, its dtype policy's name)``: ``float32``, ``float64``, ``mixed_float16``. A layer
    computing or keeping its weights in another precision has other step times and memory than
    the plan priced (a float32 plan applied to a ``mixed_float16`` or ``float64`` model without a
    word, campaign 34u); empty in plans of earlier releases (then not compared)."""

    @property
    def dtypes_of(self) -> Mapping[str, str]:
        """Layer name -> its dtype policy's name."""
        return dict(self.layer_dtypes)

    @property
    def trainable_of(self) -> Mapping[str, int]:
        """Layer name -> how many of its weights train."""
        return dict(self.layer_trainable)

    @property
    def classes_of(self) -> Mapping[str, str]:
        """Layer name -> its class."""
        return dict(self.layer_classes)

    @property
    def weights_of(self) -> Mapping[str, tuple[tuple[int, ...], ...]]:
        """Layer name -> its weight shapes."""
        return dict(self.layer_weights)

    @property
    def inputs_of(self) -> Mapping[str, tuple[str, ...]]:
        """Layer name -> the layers feeding it."""
        return dict(self.layer_inputs)


@dataclass(frozen=True)
class Plan:
    """A placement plan. ``assignment`` maps layer name -> device index."""

    model_name: str
    devices: tuple[PlanDevice, ...]
    layer_order: tuple[str, ...]
    device_of_layer: tuple[int, ...]
    step_time_s: float
    lower_bound_s: float
    per_device: tuple[DevicePrediction, ...]
    solver: SolverInfo
    link: str
    batch_size: int
    input_shape: InputShape | None = None
    """One sample's input shape (a tuple), or input name -> shape for several inputs."""
    baselines: tuple[BaselineResult, ...] = ()
    advice: tuple[str, ...] = ()
    phase_times_s: tuple[tuple[str, float], ...] = ()
    pipeline: PipelineInfo | None = None
    warnings: tuple[str, ...] = ()
    """Where the plan or its rewrite is not exact (e.g. BatchNorm over micro-batches): said loudly."""
    layer_edges: tuple[tuple[int, int, int], ...] = ()
    """``(src, dst, bytes)`` between layers (indices into ``layer_order``), for graph views."""
    layer_compute_s: tuple[float, ...] = ()
    """Each layer's forward+backward time on its device (``layer_order``), when known."""
    timeline: tuple[TimelineEvent, ...] = ()
    """The simulated step (coarse: one event per layer run or transfer), when recorded."""
    measured_layers: tuple[str, ...] = ()
    """Layers whose compute times were profiled (``profile=True``); every other cost is estimated."""
    cost_notes: tuple[str, ...] = ()
    """How the costs were obtained (profiled devices, cache hits, what stayed estimated)."""
    strategies: tuple[FamilyRow, ...] = ()
    """The best strategy of each family (single device, data parallel, pipeline, plain split,
    hybrid) by the predicted step of what it would run, fastest first, with why each lost
    (:func:`partitioner.planner.explain.family_rows`)."""
    strategy: Strategy | None = None
    """The training strategy the plan applies (replicas x stages, micro-batches, schedule), or
    ``None`` for a plan that applies its assignment alone. When set, ``device_of_layer`` is its
    replica 0's layer devices and ``step_time_s`` is its predicted step (the all-reduce of the
    replicas included)."""
    cluster_addresses: tuple[str, ...] = ()
    """The task addresses of the cluster the plan's topology was measured on (``partition
    calibrate``), in task order; empty when it was not. :meth:`apply` on a cluster refuses
    another one."""
    fingerprint: ModelFingerprint | None = None
    """The model's inputs and layer weight shapes when the plan was made; :meth:`apply` refuses
    a model that differs. ``None`` in plans of earlier releases (applied unchecked, with a
    warning)."""
    schema_version: int = SCHEMA_VERSION
    _assignment: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.layer_order) != len(self.device_of_layer):
            raise PlanError(
                f"plan for {self.model_name!r}: {len(self.layer_order)} layers but "
                f"{len(self.device_of_layer)} device indices"
            )
        if len(set(self.layer_order)) != len(self.layer_order):
            raise PlanError(f"plan for {self.model_name!r} names a layer twice")
        n = len(self.devices)
        bad = [(k, d) for k, d in zip(self.layer_order, self.device_of_layer) if not 0 <= d < n]
        if bad:
            raise PlanError(
                f"plan for {self.model_name!r}: layer {bad[0][0]!r} is on device {bad[0][1]}, "
                f"but the plan has devices 0..{n - 1}"
            )
        n_layers = len(self.layer_order)
        for a, b, nbytes in self.layer_edges:
            if not (0 <= a < n_layers and 0 <= b < n_layers) or nbytes < 0:
                raise PlanError(
                    f"plan for {self.model_name!r}: layer edge ({a}, {b}, {nbytes}) is outside "
                    f"layers 0..{n_layers - 1}"
                )
        if self.layer_compute_s and len(self.layer_compute_s) != n_layers:
            raise PlanError(
                f"plan for {self.model_name!r}: {len(self.layer_compute_s)} layer times for "
                f"{n_layers} layers"
            )
        if self.pipeline is not None:
            off = [d for d in self.pipeline.stage_devices if not 0 <= d < n]
            if off:
                raise PlanError(
                    f"plan for {self.model_name!r}: pipeline stage on device {off[0]}, but the "
                    f"plan has devices 0..{n - 1}"
                )
        if self.strategy is not None:
            _check_strategy(self, self.strategy)
        object.__setattr__(
            self, "_assignment", MappingProxyType(dict(zip(self.layer_order, self.device_of_layer)))
        )

    @property
    def assignment(self) -> Mapping[str, int]:
        """Layer name -> device index."""
        return self._assignment

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def share_batch_size(self) -> int:
        """The samples each layer runs on at once in the plan's step: the batch over its
        replicas and micro-batches (a batch the planner traced the model at)."""
        replicas = self.strategy.replicas if self.strategy is not None else 1
        micro = max(
            self.strategy.num_microbatches if self.strategy is not None else 1,
            self.pipeline.num_microbatches if self.pipeline is not None else 1,
        )
        return max(1, self.batch_size // (replicas * micro))

    @property
    def device_type(self) -> str:
        return self.devices[0].device_type

    @property
    def idle_devices(self) -> tuple[int, ...]:
        """The plan's devices that run nothing: in no replica of its strategy (without one: with
        no layer). A plan keeps every device of its topology, so its indices and ``devices=`` of
        :meth:`apply` stay those of the topology; a strategy leaves devices idle when fewer are
        faster, and a placement of fewer layers than devices cannot use them all."""
        used = set(self.strategy.devices if self.strategy is not None else self.device_of_layer)
        return tuple(d for d in range(len(self.devices)) if d not in used)

    # -- applying ---------------------------------------------------------------------------

    def apply(
        self,
        model: Any,
        devices: Sequence[str] | None = None,
        *,
        cluster: Any = None,
        timeout_s: float = 30.0,
        step_timeout_s: float = 30.0,
    ) -> Any:
        """A copy of ``model`` placed by this plan, or ``model`` itself placed in place.

        A :class:`passes.rewrite.device_placement.PlacedModel`, or, for a pipelined plan, a
        :class:`passes.rewrite.pipeline.PipelinedModel` that trains with the plan's micro-batches and
        schedule. A model those copies cannot take (its class overrides a step of
        :data:`passes.checks.OWN_STEPS`, ``train_step`` and others, or a layer cannot be rebuilt
        from its config: a custom
        layer without ``get_config``) is placed in place (:mod:`passes.rewrite.in_place`): its
        variables move to their layers' devices, each layer's forward and backward ops run there
        whichever step takes the gradients, and the model itself is returned, its class and its
        own steps kept; such a model is planned on whole batches or as data-parallel replicas
        (``replicate_in_place``: ``MirroredStrategy`` over the model itself), never
        micro-batched. ``devices`` maps the plan's device indices to TensorFlow device strings
        (``devices[i]`` for plan device ``i``), so a plan for two GPUs can run on two logical
        CPU devices; by default each device's own name from the plan (a topology file or
        cluster names them), else the first N GPUs TensorFlow sees; a device TensorFlow does not
        see here is refused, naming the ones it sees. A plan made for another model is refused
        with the missing and extra layers named, and one whose model had other inputs or layer
        weight shapes (:attr:`fingerprint`) naming the first difference, before anything is built.

        ``cluster`` (a ``{"worker": ["host:port", ...]}`` mapping, a cluster JSON file, a
        TF_CONFIG string, or a :class:`passes.cluster.runtime.ClusterHandle`) places the layers on the
        tasks of a TensorFlow cluster (``partition worker`` serves them): the client connects
        within ``timeout_s``, and a training or inference call whose worker dies or hangs fails
        with one line within ``step_timeout_s`` (the plan and the original model unchanged).
        """
        # The one sanctioned call from the plan to a later stage: the rewrite lives in
        # passes.apply; this method is the user's spelling of it (ARCHITECTURE.md).
        from passes.apply import apply_plan

        return apply_plan(
            self,
            model,
            devices,
            cluster=cluster,
            timeout_s=timeout_s,
            step_timeout_s=step_timeout_s,
        )

    # -- JSON -------------------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        """The plan as JSON data (see the module docstring for the schema), with its
        ``digest`` (:func:`plan_digest`)."""
        data = self._json_data()
        return {**data, "digest": plan_digest(data)}

    def _json_data(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "model": self.model_name,
            "batch_size": self.batch_size,
            "input_shape": _shape_json(self.input_shape),
            "link": self.link,
            "devices": [asdict(d) for d in self.devices],
            "assignment": dict(zip(self.layer_order, self.device_of_layer)),
            "layer_order": list(self.layer_order),
            "predicted": {
                "step_time_s": self.step_time_s,
                "lower_bound_s": self.lower_bound_s,
                "compute_s": [d.compute_s for d in self.per_device],
                "memory_bytes": [d.memory_bytes for d in self.per_device],
                "memory_limit_bytes": [d.memory_limit_bytes for d in self.per_device],
                "transfer_bytes": [d.transfer_bytes for d in self.per_device],
                "bytes_sent": [d.bytes_sent for d in self.per_device],
                "bytes_received": [d.bytes_received for d in self.per_device],
            },
            "solver": {
                "name": self.solver.name,
                "status": self.solver.status,
                "objective": self.solver.objective,
                "solve_time_s": self.solver.solve_time_s,
                "notes": list(self.solver.notes),
            },
            "baselines": [asdict(b) for b in self.baselines],
            "advice": list(self.advice),
            "warnings": list(self.warnings),
            "phase_times_s": dict(self.phase_times_s),
            "pipeline": None
            if self.pipeline is None
            else {
                "schedule": self.pipeline.schedule.value,
                "num_microbatches": self.pipeline.num_microbatches,
                "stage_devices": list(self.pipeline.stage_devices),
                "bubble_fraction": list(self.pipeline.bubble_fraction),
            },
            "measured_layers": list(self.measured_layers),
            "cost_notes": list(self.cost_notes),
            "cluster_addresses": list(self.cluster_addresses),
            "fingerprint": _fingerprint_json(self.fingerprint),
            "strategies": [_strategy_json(r) for r in self.strategies],
            "strategy": None if self.strategy is None else _chosen_json(self.strategy),
            "layer_edges": [list(e) for e in self.layer_edges],
            "layer_compute_s": list(self.layer_compute_s),
            "timeline": [
                {
                    "resource": e.resource,
                    "kind": e.kind.value,
                    "label": e.label,
                    "start_s": e.start_s,
                    "end_s": e.end_s,
                    "microbatch": e.microbatch,
                }
                for e in self.timeline
            ],
        }

    @classmethod
    def from_json_dict(cls, data: Any, origin: str = "plan") -> Plan:
        """Rebuild a plan from :meth:`to_json_dict` data.

        The data is validated against the plan JSON Schema first
        (:func:`partitioner.plan.schema.validate_plan_data`); what the schema cannot say is
        checked here: devices listed in index order, every device index within ``devices``, one
        entry per device, the strategy and the pipeline agreeing with the assignment and the batch
        (:func:`_check_consistency`), the fingerprint naming the assignment's layers, an event's
        start before its end. Errors are one-line :class:`PlanError` messages naming ``origin``
        and the field.
        """
        validate_plan_data(data, origin)
        devices = tuple(_device(d, i, origin) for i, d in enumerate(data["devices"]))
        order, device_of = _layer_order(data, origin)
        _check_assignment(order, device_of, len(devices), origin)
        predicted = data["predicted"]
        _check_lower_bound(predicted, origin)
        per_device = _per_device(predicted, order, device_of, len(devices), origin)
        strategy = _chosen(data.get("strategy"), origin)
        pipeline = _pipeline(data.get("pipeline"), origin)
        _check_consistency(
            data["batch_size"], devices, order, device_of, strategy, pipeline, origin
        )
        input_shape = _optional_tuple(data.get("input_shape"))
        fingerprint = _fingerprint(data.get("fingerprint"), order, origin)
        _check_input_shape(input_shape, fingerprint, origin)
        optional = _optional_fields(data, origin)
        _check_timeline(optional["timeline"], strategy, pipeline, origin)
        _check_predictions(data, devices, optional, origin)
        _check_digest(data, origin)
        fields: dict[str, Any] = dict(
            model_name=data["model"],
            devices=devices,
            layer_order=order,
            device_of_layer=device_of,
            step_time_s=float(predicted["step_time_s"]),
            lower_bound_s=float(predicted["lower_bound_s"]),
            per_device=per_device,
            solver=_solver_info(data["solver"]),
            link=data["link"],
            batch_size=data["batch_size"],
            input_shape=input_shape,
            pipeline=pipeline,
            strategy=strategy,
            fingerprint=fingerprint,
            **optional,
        )
        try:
            return cls(**fields)
        except PlanError as exc:
            raise PlanError(f"{origin}: {exc}; make the plan again") from None

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON, atomically: the file is whole or untouched. An existing file
        partitioner did not write (the user's) is not replaced: OutputError, as the CLI's
        ``--out`` (:func:`~partitioner.core.files.check_replaceable`)."""
        path = path_argument(path, "Plan.save", "give the file name, e.g. plan.save('plan.json')")
        target = check_output_path(path)
        module = module_file_of(path)
        if module is not None:
            raise OutputError(
                f"Plan.save path={path!r} is the source of module {module!r}, which this "
                "program imported; refusing to overwrite it: give another path"
            )
        # as the command line refuses them for --out (rows 173, 184, 191)
        resolved, shown = os.path.realpath(path), f"Plan.save path={path!r}"
        check_outside_kept_files(resolved, shown)
        check_not_hiding_a_module(resolved, shown)  # rows 251, 258 (campaign 34ai)
        check_replaceable(target, shown)  # last: the reasons above are more precise
        return write_atomic(path, self.to_json(), only_ours=True)


def _layer_order(
    data: Mapping[str, Any], origin: str
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """The layers in the model's order and each one's device: ``layer_order`` where the plan
    gives it (a tool that sorts an object's keys, ``jq -S``, keeps a list's order), else the
    order of ``assignment``'s keys (plans of earlier releases)."""
    assignment: Mapping[str, int] = data["assignment"]
    given = data.get("layer_order")
    if given is None:
        return tuple(assignment), tuple(assignment.values())
    if sorted(given) != sorted(assignment):
        raise PlanError(
            f"{origin}: field 'layer_order' names other layers than 'assignment' places "
            f"({len(given)} and {len(assignment)}); make the plan again"
        )
    return tuple(given), tuple(assignment[name] for name in given)


def plan_digest(data: Mapping[str, Any]) -> str:
    """The SHA-256 of a plan's JSON data without its ``digest``
    (:func:`~partitioner.core.jsonfiles.json_digest`)."""
    return json_digest(data)


def _check_digest(data: Mapping[str, Any], origin: str) -> None:
    """A plan file's figures are the planner's: its ``digest`` matches the rest (checked after
    the specific checks, which say what disagrees); a file without one is read as written,
    with a warning. An edit the checks cannot see (the batch size, a peak memory, bytes
    received) changes the digest: a plan's predictions hold only for what they were made for."""
    given = data.get("digest")
    if given is None:
        logger.warning(
            "%s has no digest (written by hand, or by a partitioner before it wrote one): its "
            "predictions are read as written, unchecked",
            origin,
        )
        return
    if given != plan_digest(data):
        raise PlanError(
            f"{origin}: it was changed after it was written (its digest does not match the "
            "rest): a plan's predictions hold only for the batch, devices and placement they "
            "were made for; make the plan again"
        )


def plan_from_solution(
    costed: CostedGraph,
    result: SolverResult,
    evaluation: PlanEvaluation,
    *,
    link: str,
    batch_size: int,
    **extra: Any,
) -> Plan:
    """The plan of a solver's placement of ``costed`` and its evaluation: devices, assignment,
    predictions, solver info, layer edges and times; ``extra`` sets the remaining fields
    (baselines, advice, pipeline, timeline, ...)."""
    problem = costed.problem()
    return Plan(
        model_name=costed.graph.name,
        devices=tuple(
            PlanDevice(
                index=d.index,
                device_type=d.device_type,
                memory_bytes=d.memory_bytes,
                host=d.host,
                name=d.name,
            )
            for d in costed.topology.devices
        ),
        layer_order=problem.layers,
        device_of_layer=result.assignment,
        step_time_s=evaluation.step_time_s,
        lower_bound_s=evaluation.lower_bound_s,
        per_device=evaluation.per_device,
        solver=SolverInfo(
            name=result.solver,
            status=result.status.value,
            objective=result.objective,
            solve_time_s=result.solve_time_s,
            notes=result.notes,
        ),
        link=link,
        batch_size=batch_size,
        layer_edges=problem.edges,
        layer_compute_s=tuple(
            problem.compute_time_s[d][k] for k, d in enumerate(result.assignment)
        ),
        cluster_addresses=costed.topology.cluster_addresses,
        **extra,
    )


# -- building a plan from schema-valid JSON data ------------------------------------------------
# Every helper below reads data that has passed validate_plan_data: types, required fields,
# enums and minimums are known to hold.


def _optional_fields(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The plan fields a file may leave out (baselines, advice, ... the strategies table)."""
    return {
        "baselines": tuple(_baseline(b) for b in data.get("baselines", [])),
        "advice": tuple(data.get("advice", [])),
        "phase_times_s": tuple((k, float(v)) for k, v in data.get("phase_times_s", {}).items()),
        "warnings": tuple(data.get("warnings", [])),
        "layer_edges": tuple((a, b, n) for a, b, n in data.get("layer_edges", [])),
        "layer_compute_s": tuple(float(v) for v in data.get("layer_compute_s", [])),
        "timeline": tuple(
            _event(e, f"timeline[{i}]", origin) for i, e in enumerate(data.get("timeline", []))
        ),
        "measured_layers": tuple(data.get("measured_layers", [])),
        "cost_notes": tuple(data.get("cost_notes", [])),
        "cluster_addresses": tuple(data.get("cluster_addresses", [])),
        "strategies": tuple(_strategy_row(r) for r in data.get("strategies", [])),
    }


def _device(data: Mapping[str, Any], position: int, origin: str) -> PlanDevice:
    """A ``devices[]`` record; its ``index`` is its position in the list."""
    if data["index"] != position:
        raise PlanError(
            f"{origin}: field 'devices[{position}].index' is {data['index']}, but devices are "
            f"listed in index order (expected {position}); make the plan again"
        )
    return PlanDevice(
        index=data["index"],
        device_type=data["device_type"],
        memory_bytes=data["memory_bytes"],
        host=data.get("host", 0),
        name=data.get("name", ""),
    )


def _check_assignment(
    order: Sequence[str], device_of: Sequence[int], num_devices: int, origin: str
) -> None:
    """Every layer on one of the plan's devices."""
    off = [(k, d) for k, d in zip(order, device_of) if d >= num_devices]
    if off:
        raise PlanError(
            f"{origin}: field 'assignment' puts layer {off[0][0]!r} on device {off[0][1]}, "
            f"but the plan has devices 0..{num_devices - 1}; make the plan again"
        )


_PER_DEVICE_FIELDS = (
    "compute_s",
    "memory_bytes",
    "memory_limit_bytes",
    "bytes_sent",
    "bytes_received",
)
"""The per-device lists of ``predicted`` that a plan reads (``transfer_bytes`` is derived)."""


def _per_device(
    predicted: Mapping[str, Any],
    order: Sequence[str],
    device_of: Sequence[int],
    num_devices: int,
    origin: str,
) -> tuple[DevicePrediction, ...]:
    """The ``predicted`` per-device lists as one record per device (one entry per device)."""
    for key in _PER_DEVICE_FIELDS:
        if len(predicted[key]) != num_devices:
            raise PlanError(
                f"{origin}: predicted.{key} has {len(predicted[key])} entries for "
                f"{num_devices} devices"
            )
    return tuple(
        DevicePrediction(
            device=i,
            layers=tuple(k for k, d in zip(order, device_of) if d == i),
            compute_s=float(predicted["compute_s"][i]),
            memory_bytes=predicted["memory_bytes"][i],
            memory_limit_bytes=predicted["memory_limit_bytes"][i],
            bytes_sent=predicted["bytes_sent"][i],
            bytes_received=predicted["bytes_received"][i],
        )
        for i in range(num_devices)
    )


def _solver_info(data: Mapping[str, Any]) -> SolverInfo:
    """The ``solver`` record."""
    objective = data.get("objective")
    return SolverInfo(
        name=data["name"],
        status=data["status"],
        objective=None if objective is None else float(objective),
        solve_time_s=float(data["solve_time_s"]),
        notes=tuple(data.get("notes", [])),
    )


def _strategy_json(row: FamilyRow) -> dict[str, Any]:
    """A ``strategies[]`` record."""
    data = asdict(row)
    data["family"] = row.family.value
    return data


def _strategy_row(data: Mapping[str, Any]) -> FamilyRow:
    """A ``strategies[]`` record read back."""
    speedup = data["speedup_over_single"]
    return FamilyRow(
        family=Family(data["family"]),
        description=data["description"],
        step_time_s=float(data["step_time_s"]),
        speedup_over_single=None if speedup is None else float(speedup),
        peak_memory_bytes=data["peak_memory_bytes"],
        memory_limit_bytes=data["memory_limit_bytes"],
        fits=data["fits"],
        chosen=data["chosen"],
        why_not=data["why_not"],
    )


def _check_strategy(plan: Plan, strategy: Strategy) -> None:
    """The applied ``strategy`` agrees with the plan: its devices exist, it places every layer,
    and the assignment is its replica 0."""
    name, n = plan.model_name, len(plan.devices)
    off = [d for d in strategy.devices if d >= n]
    if off:
        raise PlanError(
            f"plan for {name!r}: the strategy uses device {off[0]}, but the plan has devices "
            f"0..{n - 1}"
        )
    if len(strategy.stage_of_layer) != len(plan.layer_order):
        raise PlanError(
            f"plan for {name!r}: the strategy places {len(strategy.stage_of_layer)} layers, the "
            f"assignment {len(plan.layer_order)}"
        )
    if strategy.layer_devices(0) != plan.device_of_layer:
        raise PlanError(
            f"plan for {name!r}: the assignment is not the strategy's replica 0 (device_groups "
            f"{[list(g) for g in strategy.device_groups]}, stage_of_layer)"
        )


def _chosen_json(strategy: Strategy) -> dict[str, Any]:
    """The ``strategy`` record."""
    return {
        "family": strategy.family.value,
        "description": strategy.describe(),
        "device_groups": [list(g) for g in strategy.device_groups],
        "stage_of_layer": list(strategy.stage_of_layer),
        "num_microbatches": strategy.num_microbatches,
        "schedule": strategy.schedule.value,
    }


def _chosen(data: Mapping[str, Any] | None, origin: str) -> Strategy | None:
    """The ``strategy`` record read back (its family and description are derived, checked)."""
    if data is None:
        return None
    try:
        strategy = Strategy(
            device_groups=tuple(tuple(g) for g in data["device_groups"]),
            stage_of_layer=tuple(data["stage_of_layer"]),
            num_microbatches=data["num_microbatches"],
            schedule=Schedule(data["schedule"]),
        )
    except PartitionError as exc:
        raise PlanError(f"{origin}: field 'strategy': {exc}; make the plan again") from None
    if strategy.family.value != data["family"]:
        raise PlanError(
            f"{origin}: field 'strategy.family' is {data['family']!r}, but its replicas, stages "
            f"and micro-batches make it {strategy.family.value!r}; make the plan again"
        )
    return strategy


def _baseline(data: Mapping[str, Any]) -> BaselineResult:
    """A ``baselines[]`` record."""
    step = data["step_time_s"]
    return BaselineResult(
        solver=data["solver"],
        step_time_s=None if step is None else float(step),
        note=data.get("note", ""),
    )


def _optional_tuple(
    values: Sequence[int] | Mapping[str, Sequence[int]] | None,
) -> InputShape | None:
    """``input_shape``: a tuple, input name -> tuple, or None."""
    if values is None:
        return None
    if isinstance(values, Mapping):
        return {str(k): tuple(v) for k, v in values.items()}
    return tuple(values)


def _shape_json(shape: InputShape | None) -> list[int] | dict[str, list[int]] | None:
    """``input_shape`` as JSON: a list, an object of input name -> list, or null."""
    if shape is None:
        return None
    if isinstance(shape, Mapping):
        return {k: list(v) for k, v in shape.items()}
    return list(shape)


def _pipeline(data: Mapping[str, Any] | None, origin: str) -> PipelineInfo | None:
    """The ``pipeline`` record, or None for a plan that does not pipeline."""
    if data is None:
        return None
    try:
        return PipelineInfo(
            schedule=Schedule(data["schedule"]),
            num_microbatches=data["num_microbatches"],
            stage_devices=tuple(data["stage_devices"]),
            bubble_fraction=tuple(float(v) for v in data.get("bubble_fraction", [])),
        )
    except PlanError as exc:
        raise PlanError(f"{origin}: field 'pipeline': {exc}; make the plan again") from None


def _check_consistency(
    batch_size: int,
    devices: Sequence[PlanDevice],
    order: Sequence[str],
    device_of: Sequence[int],
    strategy: Strategy | None,
    pipeline: PipelineInfo | None,
    origin: str,
) -> None:
    """PlanError naming ``origin``, the fields and their values unless the plan file's parts
    agree: each device name one device, the strategy and the pipeline with the assignment
    (its device indices already checked in range) and the batch, and the pipeline block with the
    strategy (``Plan.apply`` runs the pipeline block, ``partition show`` reports the strategy)."""
    _check_device_names(devices, origin)
    if strategy is not None:
        _check_strategy_file(batch_size, len(devices), order, device_of, strategy, origin)
    if pipeline is not None:
        _check_pipeline_file(batch_size, len(devices), device_of, pipeline, origin)
    if strategy is not None:
        _check_blocks_agree(strategy, pipeline, origin)


_LOCAL_TASK = {"job": "localhost", "replica": "0", "task": "0"}
"""Where a device name without a job, replica or task is: this process."""


def device_key(name: str) -> str:
    """One spelling per TensorFlow device, read as TensorFlow's ``DeviceSpec`` reads a device
    string (pure Python: a plan file is checked without TensorFlow): ``CPU:0``, ``/cpu:0``,
    ``/device:CPU:0`` and ``/job:localhost/replica:0/task:0/device:CPU:0`` are one key (a name
    without a job, replica or task is this process's); ``""`` for no name, the name itself when
    it is not a device string."""
    if not name:
        return ""
    fields, kind = dict(_LOCAL_TASK), None
    for part in name.split("/"):
        bits = part.split(":")
        if len(bits) == 2 and bits[0] in _LOCAL_TASK:
            fields[bits[0]] = bits[1]
        elif kind is None and len(bits) == 3 and bits[0] == "device":
            kind = bits[1:]
        elif kind is None and len(bits) <= 2 and bits[0] and bits[0] not in fields:
            kind = [bits[0], bits[1] if len(bits) == 2 else "*"]
        elif part:
            return name
    if kind is None:
        return name
    try:
        numbers = [str(int(fields[k])) for k in ("replica", "task")]
        index = kind[1] if kind[1] == "*" else str(int(kind[1]))
    except ValueError:
        return name
    return (
        f"/job:{fields['job']}/replica:{numbers[0]}/task:{numbers[1]}/device:"
        f"{kind[0].upper()}:{index}"
    )


def _check_device_names(devices: Sequence[PlanDevice], origin: str) -> None:
    """No two plan devices name one TensorFlow device, however spelled (:func:`device_key`):
    their layers would run one after another there, not as planned and predicted."""
    first: dict[str, int] = {}
    for device in devices:
        key = device_key(device.name)
        if not key:
            continue
        j = first.setdefault(key, device.index)
        if j != device.index:
            raise PlanError(
                f"{origin}: field 'devices[{device.index}].name' is {device.name!r}, the device "
                f"'devices[{j}].name' names as {devices[j].name!r} ({key}): the layers of plan "
                f"devices {j} and {device.index} would run one after another there, not as "
                'planned; name each device once (or "" to choose it at apply time), or make the '
                "plan again"
            )


def _check_strategy_file(
    batch_size: int,
    num_devices: int,
    order: Sequence[str],
    device_of: Sequence[int],
    strategy: Strategy,
    origin: str,
) -> None:
    """The strategy's devices are the plan's, each of its stages holds a layer, the assignment
    is its replica 0, and its replicas x micro-batches divide the batch (as the planner makes
    them: each replica's micro-batch is an equal share)."""
    off_range = [d for d in strategy.devices if d >= num_devices]
    if off_range:
        raise PlanError(
            f"{origin}: field 'strategy.device_groups' uses device {off_range[0]}, but the plan "
            f"has devices 0..{num_devices - 1}; make the plan again"
        )
    stages, layers = strategy.stage_of_layer, len(order)
    if len(stages) != layers:
        raise PlanError(
            f"{origin}: field 'strategy.stage_of_layer' has {len(stages)} entries for the "
            f"{layers} layers of 'assignment'; make the plan again"
        )
    empty = [s for s in range(strategy.stages) if s not in set(stages)]
    if empty:
        raise PlanError(
            f"{origin}: field 'strategy.stage_of_layer' puts no layer on stage {empty[0]} of "
            f"{strategy.stages} (device_groups {[list(g) for g in strategy.device_groups]}); "
            "make the plan again"
        )
    replica0 = strategy.layer_devices(0)
    off = [k for k in range(layers) if device_of[k] != replica0[k]]
    if off:
        k = off[0]
        raise PlanError(
            f"{origin}: field 'assignment' puts layer {order[k]!r} on device {device_of[k]}, but "
            f"field 'strategy' ({strategy.family.value!r}: {strategy.describe()} on devices "
            f"{list(strategy.device_groups[0])}) puts it on device {replica0[k]}; make the plan "
            "again"
        )
    if strategy.replicas * strategy.num_microbatches > batch_size:
        raise PlanError(
            f"{origin}: field 'strategy.num_microbatches' is {strategy.num_microbatches}: "
            f"{strategy.replicas} replica(s) x {strategy.num_microbatches} micro-batch(es) are "
            f"more than batch_size={batch_size} samples; make the plan again"
        )
    shares = strategy.replicas * strategy.num_microbatches
    if batch_size % shares:
        raise PlanError(
            f"{origin}: field 'strategy' splits the batch into {strategy.replicas} replica(s) x "
            f"{strategy.num_microbatches} micro-batch(es), but batch_size={batch_size} is not "
            f"divisible by {shares} (each share is equal); make the plan again"
        )


def _check_pipeline_file(
    batch_size: int,
    num_devices: int,
    device_of: Sequence[int],
    pipeline: PipelineInfo,
    origin: str,
) -> None:
    """The pipeline's stages are the devices of the assignment, and its micro-batches divide
    the batch."""
    stages, micro = pipeline.stage_devices, pipeline.num_microbatches
    off_range = [d for d in stages if d >= num_devices]
    if off_range:
        raise PlanError(
            f"{origin}: field 'pipeline.stage_devices' names device {off_range[0]}, but the plan "
            f"has devices 0..{num_devices - 1}; make the plan again"
        )
    if micro > batch_size:
        raise PlanError(
            f"{origin}: field 'pipeline.num_microbatches' is {micro}, more than "
            f"batch_size={batch_size} samples; make the plan again"
        )
    if batch_size % micro:
        raise PlanError(
            f"{origin}: field 'pipeline.num_microbatches' is {micro}, but batch_size="
            f"{batch_size} is not divisible by it (each micro-batch is an equal share); make the "
            "plan again"
        )
    if stages and set(stages) != set(device_of):
        raise PlanError(
            f"{origin}: field 'pipeline.stage_devices' is {list(stages)}, but 'assignment' "
            f"uses devices {sorted(set(device_of))}; make the plan again"
        )


def _check_blocks_agree(strategy: Strategy, pipeline: PipelineInfo | None, origin: str) -> None:
    """The pipeline block is the strategy's pipeline: there exactly when the strategy runs
    micro-batches, with its count, schedule and stage devices (``Plan.apply`` runs the pipeline
    block, ``partition show`` reports the strategy: they must be one)."""
    micro, schedule = strategy.num_microbatches, strategy.schedule
    wanted = (
        f"field 'strategy' ({strategy.describe()}) runs {micro} micro-batch(es) by schedule "
        f"{schedule.value!r} on stages {list(strategy.device_groups[0])}; make the plan again"
    )
    if pipeline is None:
        if micro == 1:
            return
        raise PlanError(
            f"{origin}: field 'pipeline' is null (the plan would apply unpipelined), but {wanted}"
        )
    stages = pipeline.stage_devices
    same_stages = not stages or stages == strategy.device_groups[0]
    if (pipeline.num_microbatches, pipeline.schedule) == (micro, schedule) and same_stages:
        return
    raise PlanError(
        f"{origin}: field 'pipeline' runs {pipeline.num_microbatches} micro-batch(es) by "
        f"schedule {pipeline.schedule.value!r} on stages {list(stages)}, but {wanted}"
    )


def _check_timeline(
    timeline: Sequence[TimelineEvent],
    strategy: Strategy | None,
    pipeline: PipelineInfo | None,
    origin: str,
) -> None:
    """The simulated timeline (the step the plan predicts) is of the micro-batches the plan
    runs: a file whose micro-batch count was edited keeps the predictions of another schedule."""
    micro = (
        pipeline.num_microbatches
        if pipeline is not None
        else strategy.num_microbatches if strategy is not None else 1
    )
    ran = {e.microbatch for e in timeline if e.kind in (EventKind.FORWARD, EventKind.BACKWARD)}
    if not ran or ran == set(range(micro)):
        return
    shown = sorted(ran)
    listed = ", ".join(map(str, shown[:4])) + (", ..." if len(shown) > 4 else "")
    raise PlanError(
        f"{origin}: field 'timeline' simulates micro-batches {listed} ({len(shown)} of them), "
        f"but the plan runs {micro} micro-batch(es): its predictions are of another schedule; "
        "make the plan again"
    )


def _fingerprint_json(fingerprint: ModelFingerprint | None) -> dict[str, Any] | None:
    """The ``fingerprint`` record, or None."""
    if fingerprint is None:
        return None
    return {
        "inputs": [
            {"name": i.name, "shape": list(i.shape), "dtype": i.dtype} for i in fingerprint.inputs
        ],
        "layer_weights": {
            name: [list(shape) for shape in shapes] for name, shapes in fingerprint.layer_weights
        },
        "layer_inputs": {name: list(fed_by) for name, fed_by in fingerprint.layer_inputs},
        "layer_classes": dict(fingerprint.layer_classes),
        "layer_trainable": dict(fingerprint.layer_trainable),
        "layer_dtypes": dict(fingerprint.layer_dtypes),
    }


def _fingerprint(
    data: Mapping[str, Any] | None, order: Sequence[str], origin: str
) -> ModelFingerprint | None:
    """The ``fingerprint`` record read back; its layer weights name exactly the layers of the
    assignment (a layer left out would be applied unchecked)."""
    if data is None:
        return None
    known = set(order)
    wiring: Mapping[str, Sequence[str]] = data.get("layer_inputs") or {}
    classes: Mapping[str, str] = data.get("layer_classes") or {}
    trainable: Mapping[str, int] = data.get("layer_trainable") or {}
    dtypes: Mapping[str, str] = data.get("layer_dtypes") or {}
    for key, names in (
        ("layer_weights", list(data["layer_weights"])),
        ("layer_classes", list(classes)),
        ("layer_trainable", list(trainable)),
        ("layer_dtypes", list(dtypes)),
        (
            "layer_inputs",
            [
                *wiring,
                *(n for fed in wiring.values() for n in fed if not n.startswith(INPUT_PREFIX)),
            ],
        ),
    ):
        stray = [name for name in names if name not in known]
        if stray:
            raise PlanError(
                f"{origin}: field 'fingerprint.{key}' names layer {stray[0]!r}, which "
                "'assignment' does not place; make the plan again"
            )
    left_out = [name for name in order if name not in data["layer_weights"]]
    if left_out:
        raise PlanError(
            f"{origin}: field 'fingerprint.layer_weights' leaves out layer {left_out[0]!r} "
            f"({len(left_out)} of the {len(order)} layers 'assignment' places), whose weights "
            "would go unchecked when the plan is applied; make the plan again"
        )
    return ModelFingerprint(
        inputs=tuple(
            InputSignature(name=i["name"], shape=tuple(i["shape"]), dtype=i["dtype"])
            for i in data["inputs"]
        ),
        layer_weights=tuple(
            (name, tuple(tuple(shape) for shape in shapes))
            for name, shapes in data["layer_weights"].items()
        ),
        layer_inputs=tuple((name, tuple(fed_by)) for name, fed_by in wiring.items()),
        layer_classes=tuple(classes.items()),
        layer_trainable=tuple(trainable.items()),
        layer_dtypes=tuple(dtypes.items()),
    )


def _check_predictions(
    data: Mapping[str, Any],
    devices: Sequence[PlanDevice],
    optional: Mapping[str, Any],
    origin: str,
) -> None:
    """What a plan file predicts agrees with the plan: one entry per device in every list (a
    pipeline's bubbles too: one per device, of every replica), the strategies table's rows
    with their own memory and its chosen row the fastest, the timeline on the plan's devices
    and links and within the step, each device's compute within the step and its limit its
    memory, each baseline's solver once; PlanError naming ``origin`` and the field. (A plan may
    put a device over its memory: a forced placement does, and its advice says so.)"""
    predicted, pipeline = data["predicted"], data.get("pipeline") or {}
    for name, values in (
        ("predicted.transfer_bytes", predicted.get("transfer_bytes")),
        ("pipeline.bubble_fraction", pipeline.get("bubble_fraction")),
    ):
        if values and len(values) != len(devices):
            raise PlanError(
                f"{origin}: field {name!r} has {len(values)} entries for the plan's "
                f"{len(devices)} devices; make the plan again"
            )
    step = float(predicted["step_time_s"])
    _check_device_figures(predicted, devices, step, origin)
    solvers = [b.solver for b in optional["baselines"]]
    twice = next((name for i, name in enumerate(solvers) if name in solvers[:i]), None)
    if twice is not None:
        raise PlanError(
            f"{origin}: field 'baselines' lists solver {twice!r} twice; each baseline is one "
            "solver's placement: make the plan again"
        )
    _check_strategy_rows(optional["strategies"], {d.memory_bytes for d in devices}, origin)
    _check_timeline_figures(optional["timeline"], devices, step, origin)


def _check_device_figures(
    predicted: Mapping[str, Any], devices: Sequence[PlanDevice], step: float, origin: str
) -> None:
    """Each device's memory limit is the plan's device memory, and its compute fits in the
    ``step`` (a device computes only within it)."""
    for i, device in enumerate(devices):
        limit = predicted["memory_limit_bytes"][i]
        if limit != device.memory_bytes:
            raise PlanError(
                f"{origin}: field 'predicted.memory_limit_bytes[{i}]' is {limit}, but "
                f"'devices[{i}].memory_bytes' is {device.memory_bytes}: one device has one "
                "memory; make the plan again"
            )
        compute = float(predicted["compute_s"][i])
        if compute > step * (1 + _BOUND_SLACK):
            raise PlanError(
                f"{origin}: field 'predicted.compute_s[{i}]' is {compute!r} s, more than "
                f"'predicted.step_time_s' {step!r} s, the step it computes within; make the "
                "plan again"
            )


def _check_strategy_rows(rows: Sequence[FamilyRow], memories: Set[int], origin: str) -> None:
    """The ``strategies[]`` table (each family's best, the fastest marked chosen, whatever the
    plan itself runs): one row per family, its limit one of the plan's device ``memories``,
    each fitting exactly when its peak is within its limit, at most one chosen, and that one
    the fastest that fits (or any, when none fits)."""
    families = [row.family for row in rows]
    for i, row in enumerate(rows):
        if row.memory_limit_bytes not in memories:
            raise PlanError(
                f"{origin}: field 'strategies[{i}].memory_limit_bytes' is "
                f"{row.memory_limit_bytes}, no device's memory of the plan "
                f"({', '.join(map(str, sorted(memories)))}); make the plan again"
            )
        if families.index(row.family) != i:
            raise PlanError(
                f"{origin}: field 'strategies[{i}]' is a second {row.family.value} row; the "
                "table has each family's best once: make the plan again"
            )
        if row.fits != (row.peak_memory_bytes <= row.memory_limit_bytes):
            raise PlanError(
                f"{origin}: field 'strategies[{i}].fits' is {str(row.fits).lower()}, but its "
                f"peak of {row.peak_memory_bytes} bytes is "
                f"{'within' if not row.fits else 'over'} its limit of {row.memory_limit_bytes}; "
                "make the plan again"
            )
    chosen = [i for i, row in enumerate(rows) if row.chosen]
    if len(chosen) > 1:
        raise PlanError(
            f"{origin}: field 'strategies' marks rows {chosen} chosen; one is the fastest: "
            "make the plan again"
        )
    if not chosen:
        return
    best = rows[chosen[0]]
    fitting = [r for r in rows if r.fits]
    faster = min(fitting or rows, key=lambda r: r.step_time_s)
    if (fitting and not best.fits) or faster.step_time_s < best.step_time_s * (1 - _BOUND_SLACK):
        raise PlanError(
            f"{origin}: field 'strategies[{chosen[0]}]' ({best.family.value}, "
            f"{best.step_time_s!r} s{'' if best.fits else ', does not fit'}) is marked chosen, "
            f"but {faster.family.value} fits at {faster.step_time_s!r} s; make the plan again"
        )


def _check_timeline_figures(
    timeline: Sequence[TimelineEvent], devices: Sequence[PlanDevice], step: float, origin: str
) -> None:
    """Every timeline event is on one of the plan's devices (``device i``), or a channel
    between two of its devices or hosts (``link a->b``, ``hosts a->b``), and ends within the
    ``step`` it simulates."""
    end = max((e.end_s for e in timeline), default=0.0)
    if end > step * (1 + _BOUND_SLACK):
        raise PlanError(
            f"{origin}: field 'timeline' ends at {end!r} s, after 'predicted.step_time_s' "
            f"{step!r} s, the step it simulates; make the plan again"
        )
    hosts = 1 + max((d.host for d in devices), default=0)
    for i, event in enumerate(timeline):
        kind, _, rest = event.resource.partition(" ")
        ends = rest.split("->") if kind in ("link", "hosts") else [rest]
        bound = hosts if kind == "hosts" else len(devices)
        valid = kind in ("device", "link", "hosts") and len(ends) == (1 if kind == "device" else 2)
        valid = valid and all(e.isdigit() and int(e) < bound for e in ends)
        if not valid or (len(ends) == 2 and ends[0] == ends[1]):
            raise PlanError(
                f"{origin}: field 'timeline[{i}].resource' is {event.resource!r}, not one of "
                f"the plan's {len(devices)} devices ('device 0'..'device {len(devices) - 1}') "
                "nor a link between two of them; make the plan again"
            )


_BOUND_SLACK = 1e-9
"""The relative rounding a lower bound may sit above the step it bounds (both are sums of the
same op times, added in another order)."""


def _check_lower_bound(predicted: Mapping[str, Any], origin: str) -> None:
    """The lower bound on the step is not above the step (the planner writes ``min`` of both)."""
    step, bound = float(predicted["step_time_s"]), float(predicted["lower_bound_s"])
    if bound > step * (1 + _BOUND_SLACK):
        raise PlanError(
            f"{origin}: field 'predicted.lower_bound_s' is {bound!r}, above "
            f"'predicted.step_time_s' {step!r}, the step it bounds; make the plan again"
        )


def _check_input_shape(
    input_shape: InputShape | None, fingerprint: ModelFingerprint | None, origin: str
) -> None:
    """``input_shape`` gives each input the shape the fingerprint recorded for it (the trace
    took one from the other); both are the file's own, so a difference is an edit of one."""
    if input_shape is None or fingerprint is None or not fingerprint.inputs:
        return
    recorded = {i.name: i.shape for i in fingerprint.inputs}
    given: list[tuple[str | None, Any, tuple[int, ...]]]
    if isinstance(input_shape, Mapping):
        given = [(name, {name: list(shape)}, shape) for name, shape in input_shape.items()]
    else:  # one shape: the model's only input (a model of several has no name for it)
        only = fingerprint.inputs[0].name if len(recorded) == 1 else None
        given = [(only, list(input_shape), input_shape)]
    for name, spelled, shape in given:
        if name is None or recorded.get(name) != shape:
            known = ", ".join(f"{n!r} {list(s)}" for n, s in recorded.items())
            raise PlanError(
                f"{origin}: field 'input_shape' {spelled} contradicts 'fingerprint.inputs' "
                f"(inputs {known}), the shapes the plan was made for; make the plan again"
            )


def _event(data: Mapping[str, Any], where: str, origin: str) -> TimelineEvent:
    """A ``timeline[]`` record; its start must not come after its end."""
    start, end = float(data["start_s"]), float(data["end_s"])
    if start > end:
        raise PlanError(f"{origin}: field {where!r} has start_s={start} > end_s={end}")
    return TimelineEvent(
        resource=data["resource"],
        kind=EventKind(data["kind"]),
        label=data["label"],
        start_s=start,
        end_s=end,
        microbatch=data.get("microbatch", 0),
    )


MAX_PLAN_BYTES = 64 << 20
"""The largest plan file read (64 MiB; a plan of 100k layers is a few MiB)."""


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file written by :meth:`Plan.save`; errors name the file and the field.

    Read as a file from elsewhere: a regular file (checked before it is opened, so a FIFO or
    ``/dev/zero`` is refused, never read) of at most :data:`MAX_PLAN_BYTES`, its JSON nesting and
    numbers within :func:`~partitioner.core.jsonfiles.loads_bounded`'s bounds."""
    p = Path(path_argument(path, "load_plan", "give the file name, e.g. load_plan('plan.json')"))
    text = read_input_text(p, "plan file", PlanError, MAX_PLAN_BYTES)
    data = loads_bounded(
        text, f"{p} (plan file)", PlanError, "it may be truncated: make the plan again"
    )
    return Plan.from_json_dict(data, origin=str(p))
