"""Checks on plan files: the JSON Schema every saved plan must satisfy, and the model match.

The schema (``partitioner/plan/plan.schema.json``, JSON Schema draft 2020-12, shipped in the
package) documents exactly what :meth:`partitioner.plan.model.Plan.to_json_dict` writes for
``schema_version`` 2 (and reads version 1, the same without ``strategy``; the optional
``fingerprint``, the model's inputs and layer weight shapes, is absent from files of earlier
releases). :func:`validate_plan_data` checks untrusted JSON data against it (integers
are JSON integers, numbers are finite: :mod:`partitioner.core.jsonfiles`'s strict validator) before a plan is rebuilt, and raises a
:class:`~partitioner.core.errors.PlanError` whose one-line message names the file and the field
path (``plan.json: field 'predicted.step_time_s' must be number, got string``). :func:`check_plan_matches_model` refuses to apply a plan to a model whose layers are
not the ones it places, naming the missing and the extra layers.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from cost_models.devices.catalog import device_type_names
from partitioner.core.errors import PlanError
from partitioner.core.ir import Schedule
from partitioner.core.jsonfiles import error_order, field_path, strict_validator
from partitioner.core.options import (
    MAX_BATCH_SIZE,
    MAX_DEVICES,
    MAX_MEMORY_BYTES,
    MAX_MICROBATCHES,
    MAX_PLAN_SECONDS,
    short_repr,
)
from partitioner.core.strategy import Family

__all__ = [
    "PLAN_SCHEMA_RESOURCE",
    "check_plan_matches_model",
    "plan_schema",
    "validate_plan_data",
]

PLAN_SCHEMA_RESOURCE = ("plan", "plan.schema.json")
"""Where the schema lies inside the ``partitioner`` package."""

_MAX_NAMES = 10
_AGAIN = "; make the plan again"
_JSON_TYPE = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
    type(None): "null",
}


def plan_schema() -> dict[str, Any]:
    """The plan JSON Schema as a fresh dict (safe to modify).

    The schedule and strategy family names come from :class:`~partitioner.core.ir.Schedule` and
    :class:`~partitioner.core.strategy.Family` (their one home): the file asks for a string
    there and the loaded schema lists the enum's values."""
    schema: dict[str, Any] = json.loads(_schema_text())
    schedule = schema["properties"]["pipeline"]["properties"]["schedule"]
    schedule["enum"] = [s.value for s in Schedule]
    family = schema["properties"]["strategies"]["items"]["properties"]["family"]
    family["enum"] = [f.value for f in Family]
    chosen = schema["properties"]["strategy"]["properties"]
    chosen["family"]["enum"] = [f.value for f in Family]
    chosen["schedule"]["enum"] = [s.value for s in Schedule]
    _put_bounds(schema["properties"])
    return schema


MAX_SPEEDUP = 1e6
"""The largest speed-up over one device a plan file may state: at most 512 devices, each at
most a few thousand times faster than the slowest of the catalog."""


def _put_bounds(fields: dict[str, Any]) -> None:
    """The bounds the planner itself holds a run to, from their one home
    (:mod:`partitioner.core.options`, the device catalog): the batch, the device count, each
    device's memory and catalog type, and the memory figures (a plan that fits keeps its peaks
    within its limits)."""
    fields["batch_size"]["maximum"] = MAX_BATCH_SIZE
    devices = fields["devices"]
    devices["maxItems"] = MAX_DEVICES
    device = devices["items"]["properties"]
    # a memory limit is a positive size, as the planner's own options and topology files hold
    device["memory_bytes"].update(minimum=1, maximum=MAX_MEMORY_BYTES)
    device["device_type"]["enum"] = list(device_type_names())
    predicted = fields["predicted"]["properties"]
    predicted["memory_bytes"]["items"]["maximum"] = MAX_MEMORY_BYTES
    predicted["memory_limit_bytes"]["items"].update(minimum=1, maximum=MAX_MEMORY_BYTES)
    row = fields["strategies"]["items"]["properties"]
    row["memory_limit_bytes"].update(minimum=1, maximum=MAX_MEMORY_BYTES)
    row["speedup_over_single"].update(exclusiveMinimum=0, maximum=MAX_SPEEDUP)
    fields["pipeline"]["properties"]["num_microbatches"]["maximum"] = MAX_MICROBATCHES
    fields["strategy"]["properties"]["num_microbatches"]["maximum"] = MAX_MICROBATCHES
    fields["solver"]["properties"]["objective"]["maximum"] = float(MAX_MEMORY_BYTES)
    _bound_seconds(fields)


def _bound_seconds(node: Any) -> None:
    """Every number of seconds in the schema (a property named ``..._s``, or a list of them) at
    most :data:`~partitioner.core.options.MAX_PLAN_SECONDS`: a 300-digit step time showed."""
    if isinstance(node, list):
        for item in node:
            _bound_seconds(item)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if isinstance(value, dict) and (key.endswith("_s") or key.endswith("_seconds")):
            for target in (value, value.get("items"), value.get("additionalProperties")):
                if isinstance(target, dict) and "number" in str(target.get("type")):
                    target.setdefault("maximum", MAX_PLAN_SECONDS)
        _bound_seconds(value)


@functools.lru_cache(maxsize=1)
def _schema_text() -> str:
    resource = resources.files("partitioner")
    for part in PLAN_SCHEMA_RESOURCE:
        resource = resource / part
    return resource.read_text(encoding="utf-8")


@functools.lru_cache(maxsize=1)
def _validator() -> jsonschema.protocols.Validator:
    return strict_validator(plan_schema())



def _order(error: Any) -> tuple[Any, ...]:
    """The order a plan file's problems are reported in: the shallowest, then by field path."""
    return (*error_order(error, hyphens=False), str(error.validator))

def validate_plan_data(data: Any, origin: str = "plan") -> None:
    """Raise :class:`PlanError` unless ``data`` (parsed JSON) is a valid plan of this version.

    The message is one line: ``origin``, the field path and what is wrong with it. Of several
    problems the shallowest is reported (a missing top-level field before a bad list item).
    """
    # One error held at a time: a file with millions of bad entries must not hold them all
    # (a 7.5 MB plan file reached 3.8 GB in a list of every error).
    first, bad_version = None, False
    for error in _validator().iter_errors(data):
        bad_version = bad_version or list(error.absolute_path) == ["schema_version"]
        if first is None or _order(error) < _order(first):
            first = error
    if first is None:
        return
    version = data.get("schema_version") if isinstance(data, dict) else None
    if bad_version and isinstance(version, int) and not isinstance(version, bool):
        raise PlanError(
            f"{origin}: schema_version {version} is not supported (this "
            "partitioner reads 1 and 2); make the plan again with this version"
        )
    raise PlanError(f"{origin}: {_describe(first)}")


def _path(parts: Iterable[str | int]) -> str:
    return field_path(parts, hyphens=False)


def _json_type(value: Any) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def _is_non_finite(value: Any) -> bool:
    return isinstance(value, float) and not math.isfinite(value)


def _types(expected: Any) -> list[str]:
    return list(expected) if isinstance(expected, list) else [str(expected)]


def _describe(error: ValidationError) -> str:
    """One line for ``error``; a value quoted is cut to 60 characters (a 10 MB string was
    printed whole)."""
    parts = list(error.absolute_path)
    where = _path(parts)[:200]
    value = error.instance
    shown = short_repr(value, 60)
    rule = error.validator
    expected: Any = error.validator_value
    schema: Any = error.schema
    if rule == "required" and isinstance(value, dict):
        missing = [k for k in expected if k not in value]
        name = _path([*parts, missing[0]]) if missing else where
        return f"field {name!r} is missing"
    if rule == "type" and _is_non_finite(value) and "number" in _types(expected):
        return f"field {where!r} must be a finite number, got {shown}"
    if rule == "type":
        wanted = " or ".join(expected) if isinstance(expected, list) else str(expected)
        return f"field {where!r} must be {wanted}, got {_json_type(value)}"
    if rule == "additionalProperties" and isinstance(value, dict):
        known = schema.get("properties", {}) if isinstance(schema, dict) else {}
        unknown = ", ".join(short_repr(k, 60) for k in sorted(k for k in value if k not in known))
        return (
            f"field {where!r} has unknown field(s) {unknown}; "
            "this is not a plan file of schema version 1 or 2 (make the plan again)"
        )
    if rule == "enum" and parts and parts[-1] == "device_type":
        return (
            f"field {where!r} is {shown}, not a device type of the catalog ("
            f"{', '.join(expected)}; partition devices lists them){_AGAIN}"
        )
    if rule == "enum":
        options = ", ".join(repr(v) for v in expected)
        return f"field {where!r} must be one of {options}, got {shown}{_AGAIN}"
    if rule == "const":
        return f"field {where!r} must be {expected!r}, got {shown}"
    if rule in ("minimum", "maximum"):
        sign = ">=" if rule == "minimum" else "<="
        return f"field {where!r} must be {sign} {expected}, got {shown}{_AGAIN}"
    if rule in ("minItems", "maxItems"):
        bound = "at least" if rule == "minItems" else "at most"
        count = len(value) if isinstance(value, list) else "?"
        return f"field {where!r} must have {bound} {expected} items, got {count}{_AGAIN}"
    if rule == "pattern":
        return f"field {where!r} must match {expected!r}, got {shown}{_AGAIN}"
    message = str(error.message)  # it may quote the value whole
    return f"field {where!r}: {message if len(message) <= 200 else message[:197] + '...'}"


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_MAX_NAMES])
    more = f", +{len(names) - _MAX_NAMES} more" if len(names) > _MAX_NAMES else ""
    return f"[{shown}{more}]"


def check_plan_matches_model(
    plan_layers: Sequence[str],
    model_layers: Sequence[str],
    model_name: str,
    *,
    applied_to: str | None = None,
) -> None:
    """Raise :class:`PlanError` unless the model's placement units are the plan's layers.

    ``plan_layers`` are the layers the plan places (``Plan.layer_order``), ``model_layers``
    the placement units of the model it is applied to, ``model_name`` the model the plan was
    made for and ``applied_to`` (optional) the name of the model at hand. *Missing* layers are
    placed by the plan but absent from the model; *extra* layers are in the model but the plan
    does not place them. Order does not matter.
    """
    model_set = set(model_layers)
    plan_set = set(plan_layers)
    missing = [n for n in plan_layers if n not in model_set]
    extra = [n for n in model_layers if n not in plan_set]
    if not missing and not extra:
        return
    other = f" and not for {applied_to!r}" if applied_to and applied_to != model_name else ""
    raise PlanError(
        f"plan was made for model {model_name!r}{other} ({len(plan_layers)} layers; this model "
        f"has {len(model_layers)}); missing layers {_names(missing)} (in the plan, not in the "
        f"model), extra layers {_names(extra)} (in the model, not in the plan); make a new plan "
        "for this model"
    )
