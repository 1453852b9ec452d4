"""A placement plan: what was decided, what it is predicted to cost, and how to apply it.

A :class:`Plan` is a frozen record: the devices, the layer -> device assignment, the predicted
step time and per-device loads, the solver's status and objective, the baselines it was compared
with, and the advice for the user. It saves to and loads from a versioned JSON file (data only:
never pickled, never evaluated) and applies itself to a Keras model with
:func:`passes.rewrite.device_placement.place_model`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from partitioner.core.errors import PlanError
from partitioner.core.files import write_atomic
from partitioner.core.ir import CostedGraph, EventKind, Schedule, SolverResult, TimelineEvent
from partitioner.simulation.evaluate import DeviceLoad, PlanEvaluation

DevicePrediction = DeviceLoad
"""The predicted load of one device (the evaluation's own record)."""

__all__ = [
    "SCHEMA_VERSION",
    "BaselineResult",
    "DevicePrediction",
    "PipelineInfo",
    "Plan",
    "PlanDevice",
    "SolverInfo",
    "load_plan",
    "plan_from_solution",
]

SCHEMA_VERSION = 1


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
    input_shape: tuple[int, ...] | None = None
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
    """Layers whose compute times were profiled (``--profile``); every other cost is estimated."""
    cost_notes: tuple[str, ...] = ()
    """How the costs were obtained (profiled devices, cache hits, what stayed estimated)."""
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
    def device_type(self) -> str:
        return self.devices[0].device_type

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
        """A copy of ``model`` placed by this plan.

        A :class:`passes.rewrite.device_placement.PlacedModel`, or, for a pipelined plan, a
        :class:`passes.rewrite.pipeline.PipelinedModel` that trains with the plan's micro-batches and
        schedule. ``devices`` maps the plan's device indices to TensorFlow device strings
        (``devices[i]`` for plan device ``i``), so a plan for two GPUs can run on two logical
        CPU devices; by default each device's own name from the plan (a topology file or
        cluster names them), else the first N GPUs TensorFlow sees. A plan made for another
        model is refused with the missing and extra layers named.

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
            self, model, devices, cluster=cluster, timeout_s=timeout_s, step_timeout_s=step_timeout_s
        )

    # -- JSON -------------------------------------------------------------------------------

    def to_json_dict(self) -> dict[str, Any]:
        """The plan as JSON data (see the module docstring for the schema)."""
        return {
            "schema_version": self.schema_version,
            "model": self.model_name,
            "batch_size": self.batch_size,
            "input_shape": list(self.input_shape) if self.input_shape is not None else None,
            "link": self.link,
            "devices": [asdict(d) for d in self.devices],
            "assignment": dict(zip(self.layer_order, self.device_of_layer)),
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
        """Rebuild a plan from :meth:`to_json_dict` data, validating every field."""
        reader = _Reader(origin)
        obj = reader.obj(data, "")
        version = reader.integer(obj, "schema_version")
        if version != SCHEMA_VERSION:
            raise PlanError(
                f"{origin}: schema_version {version} is not supported (this partitioner reads "
                f"{SCHEMA_VERSION}); make the plan again with this version"
            )
        devices = tuple(
            PlanDevice(
                index=reader.integer(d, "index"),
                device_type=reader.text(d, "device_type"),
                memory_bytes=reader.integer(d, "memory_bytes"),
                host=reader.int_value(d.get("host", 0), "devices[].host"),
                name=str(d.get("name", "")),
            )
            for d in (reader.obj(x, "devices[]") for x in reader.items(obj, "devices"))
        )
        if not devices:
            raise PlanError(f"{origin}: 'devices' is empty")
        assignment = reader.obj(obj.get("assignment"), "assignment")
        order = tuple(assignment)
        device_of = tuple(reader.integer(assignment, k) for k in order)
        off = [(k, d) for k, d in zip(order, device_of) if not 0 <= d < len(devices)]
        if off:
            raise PlanError(
                f"{origin}: field 'assignment' puts layer {off[0][0]!r} on device {off[0][1]}, "
                f"but the plan has devices 0..{len(devices) - 1}"
            )
        predicted = reader.obj(obj.get("predicted"), "predicted")
        per = {
            key: reader.items(predicted, key)
            for key in ("compute_s", "memory_bytes", "memory_limit_bytes", "bytes_sent", "bytes_received")
        }
        for key, values in per.items():
            if len(values) != len(devices):
                raise PlanError(
                    f"{origin}: predicted.{key} has {len(values)} entries for {len(devices)} devices"
                )
        per_device = tuple(
            DevicePrediction(
                device=i,
                layers=tuple(k for k, d in zip(order, device_of) if d == i),
                compute_s=reader.num_value(per["compute_s"][i], f"predicted.compute_s[{i}]"),
                memory_bytes=reader.int_value(per["memory_bytes"][i], f"predicted.memory_bytes[{i}]"),
                memory_limit_bytes=reader.int_value(
                    per["memory_limit_bytes"][i], f"predicted.memory_limit_bytes[{i}]"
                ),
                bytes_sent=reader.int_value(per["bytes_sent"][i], f"predicted.bytes_sent[{i}]"),
                bytes_received=reader.int_value(
                    per["bytes_received"][i], f"predicted.bytes_received[{i}]"
                ),
            )
            for i in range(len(devices))
        )
        solver = reader.obj(obj.get("solver"), "solver")
        objective = solver.get("objective")
        shape = obj.get("input_shape")
        baselines = tuple(
            BaselineResult(
                solver=reader.text(b, "solver"),
                step_time_s=None if b.get("step_time_s") is None else reader.number(b, "step_time_s"),
                note=str(b.get("note", "")),
            )
            for b in (reader.obj(x, "baselines[]") for x in obj.get("baselines", []))
        )
        phases = reader.obj(obj.get("phase_times_s", {}), "phase_times_s")
        return cls(
            model_name=reader.text(obj, "model"),
            devices=devices,
            layer_order=order,
            device_of_layer=device_of,
            step_time_s=reader.number(predicted, "step_time_s"),
            lower_bound_s=reader.number(predicted, "lower_bound_s"),
            per_device=per_device,
            solver=SolverInfo(
                name=reader.text(solver, "name"),
                status=reader.text(solver, "status"),
                objective=None if objective is None else reader.number(solver, "objective"),
                solve_time_s=reader.number(solver, "solve_time_s"),
                notes=tuple(str(n) for n in solver.get("notes", [])),
            ),
            link=reader.text(obj, "link"),
            batch_size=reader.integer(obj, "batch_size"),
            input_shape=None
            if shape is None
            else tuple(reader.int_value(v, "input_shape[]") for v in reader.items(obj, "input_shape")),
            baselines=baselines,
            advice=tuple(str(a) for a in obj.get("advice", [])),
            phase_times_s=tuple((str(k), reader.number(phases, k)) for k in phases),
            pipeline=_read_pipeline(reader, obj.get("pipeline")),
            warnings=tuple(str(w) for w in obj.get("warnings", [])),
            layer_edges=tuple(
                _read_edge(reader, e, len(order)) for e in obj.get("layer_edges", []) or []
            ),
            layer_compute_s=tuple(
                reader.num_value(v, "layer_compute_s[]") for v in obj.get("layer_compute_s", []) or []
            ),
            timeline=tuple(_read_event(reader, e) for e in obj.get("timeline", []) or []),
            measured_layers=tuple(str(n) for n in obj.get("measured_layers", []) or []),
            cost_notes=tuple(str(n) for n in obj.get("cost_notes", []) or []),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the plan as JSON, atomically: the file is whole or untouched."""
        return write_atomic(path, self.to_json())


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
        **extra,
    )


def _read_pipeline(reader: _Reader, value: Any) -> PipelineInfo | None:
    if value is None:
        return None
    obj = reader.obj(value, "pipeline")
    name = reader.text(obj, "schedule")
    try:
        schedule = Schedule(name)
    except ValueError:
        raise reader.fail(
            "pipeline.schedule", f"is {name!r}; known: {', '.join(s.value for s in Schedule)}"
        ) from None
    return PipelineInfo(
        schedule=schedule,
        num_microbatches=reader.integer(obj, "num_microbatches"),
        stage_devices=tuple(
            reader.int_value(v, "pipeline.stage_devices[]") for v in reader.items(obj, "stage_devices")
        ),
        bubble_fraction=tuple(
            reader.num_value(v, "pipeline.bubble_fraction[]")
            for v in obj.get("bubble_fraction", []) or []
        ),
    )


def _read_edge(reader: _Reader, value: Any, n_layers: int) -> tuple[int, int, int]:
    if not isinstance(value, list) or len(value) != 3:
        raise reader.fail("layer_edges[]", f"must be [src, dst, bytes], got {value!r}")
    a, b, nbytes = (reader.int_value(v, "layer_edges[]") for v in value)
    return (a, b, nbytes)


def _read_event(reader: _Reader, value: Any) -> TimelineEvent:
    obj = reader.obj(value, "timeline[]")
    kind = reader.text(obj, "kind")
    try:
        event_kind = EventKind(kind)
    except ValueError:
        raise reader.fail(
            "timeline[].kind", f"is {kind!r}; known: {', '.join(k.value for k in EventKind)}"
        ) from None
    start, end = reader.number(obj, "start_s"), reader.number(obj, "end_s")
    if not 0 <= start <= end:
        raise reader.fail("timeline[]", f"has start_s={start} > end_s={end} or a negative start")
    return TimelineEvent(
        resource=reader.text(obj, "resource"),
        kind=event_kind,
        label=reader.text(obj, "label"),
        start_s=start,
        end_s=end,
        microbatch=reader.int_value(obj.get("microbatch", 0), "timeline[].microbatch"),
    )


def load_plan(path: str | os.PathLike[str]) -> Plan:
    """Read a plan file written by :meth:`Plan.save`; errors name the file and the field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PlanError(f"no such plan file: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlanError(f"cannot read plan file {p}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(
            f"{p} is not a valid plan file (JSON error at line {exc.lineno} column {exc.colno}: "
            f"{exc.msg}); it may be truncated: make the plan again"
        ) from None
    from partitioner.plan.schema import validate_plan_data

    validate_plan_data(data, str(p))
    return Plan.from_json_dict(data, origin=str(p))


class _Reader:
    """Typed access to untrusted JSON with errors that name the file and the field."""

    def __init__(self, origin: str) -> None:
        self.origin = origin

    def fail(self, where: str, what: str) -> PlanError:
        return PlanError(f"{self.origin}: field {where!r} {what}")

    def obj(self, value: Any, where: str) -> Mapping[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where or "(top level)", f"must be an object, got {type(value).__name__}")
        return value

    def items(self, obj: Mapping[str, Any], key: str) -> list[Any]:
        if key not in obj:
            raise self.fail(key, "is missing")
        value = obj[key]
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list, got {type(value).__name__}")
        return value

    def text(self, obj: Mapping[str, Any], key: str) -> str:
        if key not in obj:
            raise self.fail(key, "is missing")
        value = obj[key]
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, got {type(value).__name__}")
        return value

    def integer(self, obj: Mapping[str, Any], key: str) -> int:
        if key not in obj:
            raise self.fail(key, "is missing")
        return self.int_value(obj[key], key)

    def int_value(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(where, f"must be an integer, got {type(value).__name__}")
        return value

    def number(self, obj: Mapping[str, Any], key: str) -> float:
        if key not in obj:
            raise self.fail(key, "is missing")
        return self.num_value(obj[key], key)

    def num_value(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(where, f"must be a finite number, got {value!r}")
        return float(value)
