"""Reading data files: text -> JSON or TOML -> checked against a JSON Schema -> one-line errors.

Every file format the cost models read (the device catalog, topology files, calibrations, the
profile cache, TF_CONFIG and cluster files) goes through these steps, each reader adding only
its format's meaning:

* :func:`read_text` reads a regular file of at most ``max_bytes`` (a FIFO, a device or a
  directory is refused without blocking: :func:`partitioner.core.files.read_regular_text`), or
  raises ``error("cannot read <origin>: ...")``;
* :func:`parse_json` / :func:`parse_toml` parse it strictly (data only, never code; JSON with
  duplicate keys or ``NaN``/``Infinity`` is refused), or raise ``error("<origin> is not valid
  JSON (...); <hint>")``;
* :func:`schema_problem` checks the parsed data against a JSON Schema (draft 2020-12; integers
  are JSON integers, not booleans or ``1.0``; numbers are finite: the strict validator of
  :mod:`partitioner.core.jsonfiles`, which plan files use too) shipped next to the reader
  (:func:`load_schema`) and returns the shallowest problem as a :class:`SchemaProblem`: the
  field path (jsonschema's error path) and what is wrong, worded for people;
  :func:`check_schema` raises it as ``error("<origin>: <path>: <what>")``.

A schema node may carry ``"x-errors"``: a mapping from a JSON Schema keyword (``type``,
``minItems``, ``not``, ...) to the message for a failure of that keyword at that node, where
``{got}`` stands for a description of the value (``a string ('two')``) and ``{value}`` for its
``repr``. Without one, the
message is a generic one (``must be >= 0, got -1``, ``unknown key 'x'; known keys: a, b``).

Pure Python (jsonschema); never imports TensorFlow.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

from partitioner.core.errors import PartitionError, UsageError
from partitioner.core.files import UnreadableInput, check_links_followed, read_regular_text
from partitioner.core.jsonfiles import (
    MAX_DEPTH,
    bounded_float,
    bounded_int,
    check_containers,
    check_data_bounds,
    error_order,
    field_path,
    strict_validator,
)
from partitioner.core.options import short_repr

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml
    except ImportError:
        _toml = None

__all__ = [
    "MAX_DATA_FILE_BYTES",
    "SchemaProblem",
    "check_schema",
    "check_text_size",
    "describe_value",
    "field_path",
    "load_schema",
    "parse_json",
    "parse_toml",
    "read_text",
    "schema_problem",
]

_TYPE_NOUN = {
    "object": "a table/object",
    "array": "a list",
    "string": "a string",
    "integer": "an integer",
    "number": "a finite number",
    "boolean": "a boolean",
    "null": "null",
}


# --------------------------------------------------------------------------------------------
# Text and parsing
# --------------------------------------------------------------------------------------------


_NEXT_STEP = {
    "missing": "; check the path",
    "type": "; give a regular file",
    "size": "; is it the right file?",
}

MAX_DATA_FILE_BYTES = 16 << 20
"""The largest data file :func:`read_text` reads unless told (16 MiB)."""


def read_text(
    path: Path,
    origin: str,
    error: type[PartitionError],
    hint: str = "",
    *,
    max_bytes: int = MAX_DATA_FILE_BYTES,
    follow_symlinks: bool = True,
) -> str:
    """The UTF-8 text of the regular file ``path`` of at most ``max_bytes``, through the one
    bounded reader (:func:`partitioner.core.files.read_regular_text`: a FIFO, a device or a
    directory is refused without blocking, and a symbolic link without ``follow_symlinks``;
    another user's link in a sticky directory anyone may write is never followed:
    :func:`~partitioner.core.files.check_links_followed`); ``error`` naming ``origin``
    otherwise."""
    tail = f"; {hint}" if hint else ""
    try:
        check_links_followed(path, "cannot read", origin, streams=False)
    except PartitionError as exc:  # a cluster file planted by another user: not the user's
        raise error(str(exc)) from None
    try:
        return read_regular_text(path, max_bytes, follow_symlinks=follow_symlinks)
    except UnreadableInput as exc:
        step = _NEXT_STEP.get(exc.kind, "") if exc.kind == "missing" or not hint else ""
        raise error(f"cannot read {origin}: {exc.reason}{step}{tail}") from None


def check_text_size(text: str, origin: str, error: type[PartitionError], max_bytes: int) -> str:
    """``text`` (an environment variable's, say) when its UTF-8 form is at most ``max_bytes``;
    ``error`` naming ``origin`` and its size otherwise."""
    size = len(text.encode("utf-8", errors="surrogateescape"))
    if size > max_bytes:
        limit = f"{max_bytes // 2**20} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
        raise error(
            f"{origin} holds {size} bytes, more than the {limit} read; is it the right value?"
        )
    return text


def _reject_constant(token: str) -> float:
    raise ValueError(f"{token} is not a number JSON allows")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(
    text: str, origin: str, error: type[PartitionError], hint: str = "fix the file"
) -> Any:
    """``text`` parsed as strict JSON (no duplicate keys, no ``NaN``/``Infinity``), nesting at
    most :data:`~partitioner.core.jsonfiles.MAX_DEPTH` deep (never a RecursionError), numbers
    and lists/objects within the bounds every JSON reader holds
    (:func:`~partitioner.core.jsonfiles.bounded_int`,
    :func:`~partitioner.core.jsonfiles.check_containers`)."""
    check_containers(text, origin, error)
    try:
        data = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_reject_constant,
            parse_int=bounded_int,
            parse_float=bounded_float,
        )
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except RecursionError:
        detail = f"lists/objects nested more than {MAX_DEPTH} deep"
    except ValueError as exc:
        detail = str(exc)
    else:
        return check_data_bounds(data, origin, error)
    raise error(f"{origin} is not valid JSON ({detail}); {hint}")


def parse_toml(text: str, origin: str, error: type[PartitionError]) -> Any:
    """``text`` parsed as TOML (Python 3.11's ``tomllib``, else the ``tomli`` package)."""
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise UsageError(
            f"{origin}: reading TOML needs Python 3.11+ or the 'tomli' package; write it as "
            "JSON instead"
        )
    try:
        data = _toml.loads(text)
    except _toml.TOMLDecodeError as exc:
        raise error(f"{origin} is not valid TOML ({exc}); fix the file") from None
    except RecursionError:
        raise error(
            f"{origin} is not valid TOML (nested more than {MAX_DEPTH} deep); fix the file"
        ) from None
    return check_data_bounds(data, origin, error)


# --------------------------------------------------------------------------------------------
# Schemas
# --------------------------------------------------------------------------------------------


@functools.cache
def _validator(package: str, resource: str, ref: str | None) -> jsonschema.protocols.Validator:
    schema = load_schema(package, resource)
    jsonschema.Draft202012Validator.check_schema(schema)
    if ref is not None:
        schema = {"$defs": schema.get("$defs", {}), "$ref": ref}
    return strict_validator(schema)


@functools.cache
def _schema_text(package: str, resource: str) -> str:
    ref = resources.files(package)
    for part in resource.split("/"):
        ref = ref.joinpath(part)
    return ref.read_text(encoding="utf-8")


def load_schema(package: str, resource: str) -> dict[str, Any]:
    """The JSON Schema ``resource`` (a ``/``-separated path) of ``package``, as a fresh dict."""
    loaded: dict[str, Any] = json.loads(_schema_text(package, resource))
    return loaded


# --------------------------------------------------------------------------------------------
# Problems, worded for people
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SchemaProblem:
    """What is wrong with a value: where (the path into the data) and what."""

    path: tuple[str | int, ...]
    rule: str
    """The JSON Schema keyword that failed (``type``, ``required``, ``minimum``, ...)."""
    what: str
    """``must be a positive integer, got a string ('two')``, ``is missing key 'type'``."""
    missing_key: str | None = None
    """For ``required``: the missing key (``path`` is then its parent's path)."""


def describe_value(value: object) -> str:
    """A value as a message names it: ``a string ('two')``, ``a number (3)``, ``a list``."""
    if isinstance(value, bool):
        return f"a boolean ({value!r})"
    if isinstance(value, dict):
        return "an object (a table)" if value else "an empty object (table)"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({short_repr(value, 60)})"
    if isinstance(value, (int, float)):
        return f"a number ({short_repr(value, 60)})"
    if value is None:
        return "null"
    return type(value).__name__


def _number(value: object) -> str:
    return repr(value)


def _bounds(schema: Mapping[str, Any], value: object) -> str:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is not None and high is not None and schema.get("type") == "integer":
        return f"must be an integer in {low}..{high}, got {_number(value)}"
    for key, sign in (
        ("exclusiveMinimum", ">"),
        ("minimum", ">="),
        ("exclusiveMaximum", "<"),
        ("maximum", "<="),
    ):
        bound = schema.get(key)
        if bound is not None and isinstance(value, (int, float)):
            fails = {
                ">": value <= bound,
                ">=": value < bound,
                "<": value >= bound,
                "<=": value > bound,
            }[sign]
            if fails:
                return f"must be {sign} {bound}, got {_number(value)}"
    return f"is out of range, got {_number(value)}"


def _generic(error: ValidationError) -> tuple[str, str | None]:
    """The generic message of one failure, and the missing key of a ``required`` failure."""
    rule: Any = error.validator
    value: Any = error.instance
    expected: Any = error.validator_value
    schema: Mapping[str, Any] = error.schema if isinstance(error.schema, Mapping) else {}
    got = describe_value(value)
    if rule == "required" and isinstance(value, dict):
        missing = next(k for k in expected if k not in value)
        return f"is missing key {missing!r}", missing
    if rule == "additionalProperties" and isinstance(value, dict):
        known = list(schema.get("properties", {}))
        unknown = next(k for k in value if k not in known)
        return f"unknown key {short_repr(unknown, 60)}; known keys: {', '.join(known)}", None
    if rule == "type":
        types = [str(t) for t in (expected if isinstance(expected, list) else [expected])]
        return f"must be {' or '.join(_TYPE_NOUN.get(t, t) for t in types)}, got {got}", None
    if rule in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        return _bounds(schema, value), None
    if rule == "minItems":
        return f"must have at least {expected} item(s), got {len(value)}", None
    if rule == "minProperties":
        return f"must have at least {expected} key(s), got {len(value)}", None
    if rule == "minLength":
        return f"must be a non-empty string, got {got}", None
    if rule == "enum":
        return f"must be one of {', '.join(map(repr, expected))}, got {got}", None
    if rule == "const":
        return f"must be {expected!r}, got {got}", None
    if rule == "pattern":
        return f"must match {expected!r}, got {got}", None
    message = str(error.message)  # it may quote the value whole
    return (message if len(message) <= 200 else f"{message[:197]}..."), None


def _problem(error: ValidationError) -> SchemaProblem:
    rule = str(error.validator)
    what, missing = _generic(error)
    custom = error.schema.get("x-errors", {}) if isinstance(error.schema, Mapping) else {}
    if rule in custom:
        what = (
            str(custom[rule])
            .replace("{got}", describe_value(error.instance))
            .replace("{value}", repr(error.instance))
        )
    return SchemaProblem(tuple(error.absolute_path), rule, what, missing)


def schema_problem(
    data: object, package: str, resource: str, *, ref: str | None = None
) -> SchemaProblem | None:
    """The shallowest problem of ``data`` against the schema ``resource`` of ``package`` (or
    its definition ``ref``, e.g. ``"#/$defs/cluster"``), or None when it is valid."""
    instance: Any = data
    # One error held at a time (a list of every error grows with the file's bad entries).
    first = min(
        _validator(package, resource, ref).iter_errors(instance), key=error_order, default=None
    )
    return None if first is None else _problem(first)


def check_schema(
    data: object,
    package: str,
    resource: str,
    origin: str,
    error: type[PartitionError],
    *,
    ref: str | None = None,
) -> None:
    """Raise ``error("<origin>: <field path>: <what>")`` unless ``data`` fits the schema."""
    problem = schema_problem(data, package, resource, ref=ref)
    if problem is not None:
        raise error(f"{origin}: {field_path(problem.path)}: {problem.what}")
