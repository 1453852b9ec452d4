"""JSON data checked against a JSON Schema: the one strict validator, and its errors' field paths.

Every schema-checked file (plan files, the device catalog, topology, calibration and cluster files)
is checked by :func:`strict_validator`: JSON Schema draft 2020-12 with the types data files
mean, ``integer`` a JSON integer (not a boolean, not ``1.0``) and ``number`` a finite number
(Python's JSON reader and TOML accept ``NaN`` and ``Infinity``). Of several problems a reader
reports the shallowest (:func:`error_order`), naming where it is by :func:`field_path`
(``hosts[0].devices[1].count``); the wording of what is wrong stays with each format.

Pure Python (the standard library and jsonschema).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

__all__ = [
    "MAX_CONTAINERS",
    "MAX_DEPTH",
    "MAX_NUMBER_CHARS",
    "MAX_VALUES",
    "bounded_float",
    "bounded_int",
    "check_containers",
    "check_data_bounds",
    "data_depth",
    "error_order",
    "field_path",
    "json_digest",
    "loads_bounded",
    "strict_validator",
]

_BARE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")
_BARE_KEY_NO_HYPHEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _is_integer(checker: Any, value: Any) -> bool:
    """JSON integers only: not booleans, and not floats with a zero fraction (``1.0``)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(checker: Any, value: Any) -> bool:
    """Finite numbers only: TOML and Python's JSON reader accept ``nan`` and ``inf``."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_StrictValidator: type[jsonschema.protocols.Validator] = jsonschema.validators.extend(  # type: ignore[no-untyped-call]
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine_many(
        {"integer": _is_integer, "number": _is_finite_number}
    ),
)
"""Draft 2020-12 with strict integers and finite numbers."""


def strict_validator(schema: Mapping[str, Any]) -> jsonschema.protocols.Validator:
    """A strict validator of ``schema``, once the schema itself is checked (a bad schema raises
    :class:`jsonschema.exceptions.SchemaError`)."""
    jsonschema.Draft202012Validator.check_schema(schema)
    return _StrictValidator(schema)


def field_path(path: Iterable[str | int], *, hyphens: bool = True) -> str:
    """``hosts[0].devices[1].count``; ``(top level)`` for the empty path.

    A key that is an identifier stands bare (``.count``), any other is quoted (``["a b"]``);
    with ``hyphens=False`` a key with a hyphen is quoted too."""
    bare = _BARE_KEY if hyphens else _BARE_KEY_NO_HYPHEN
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif bare.fullmatch(part):
            text += f".{part}" if text else part
        else:
            text += f"[{json.dumps(part)}]"
    return text or "(top level)"


def error_order(error: ValidationError, *, hyphens: bool = True) -> tuple[int, str]:
    """The order a reader reports errors in: the shallowest first, then by field path."""
    return len(error.absolute_path), field_path(error.absolute_path, hyphens=hyphens)


# -- bounded parsing: what a file from elsewhere may hold -----------------------------------------

MAX_CONTAINERS = 4_000_000
"""The most lists and objects one JSON file read may hold: a plan of 100k layers holds about a
million; parsing each costs time and about 150 bytes."""

MAX_VALUES = 8_000_000
"""The most values (numbers, strings, lists, objects) one JSON file read may hold: a plan file
under the 64 MiB size bound with 33 million numbers in one list took 30-45 s and 2.8 GB to be
refused (campaign 34i); a plan of 100k layers holds a few million."""

MAX_DEPTH = 64
"""The deepest nesting of lists and objects a data file may have (ours need under 10)."""

MAX_NUMBER_CHARS = 100
"""The most characters of one number in a data file (a byte count needs 20)."""


class _TooLong(ValueError):
    """A number past :data:`MAX_NUMBER_CHARS` (raised inside the JSON reader)."""


def bounded_int(token: str) -> int:
    """``json.loads``'s ``parse_int`` for every JSON reader of the product: a number past
    :data:`MAX_NUMBER_CHARS` is refused before Python converts it (a 5000-digit integer otherwise
    fails with Python's own advice to call ``sys.set_int_max_str_digits``)."""
    if len(token) > MAX_NUMBER_CHARS:
        raise _TooLong(f"a number of {len(token)} digits (at most {MAX_NUMBER_CHARS})")
    return int(token)


def bounded_float(token: str) -> float:
    """``json.loads``'s ``parse_float``, bounded as :func:`bounded_int`."""
    if len(token) > MAX_NUMBER_CHARS:
        raise _TooLong(f"a number of {len(token)} characters (at most {MAX_NUMBER_CHARS})")
    return float(token)


def check_containers(text: str, origin: str, error: type[Exception]) -> None:
    """``error`` when ``text`` may hold more than :data:`MAX_CONTAINERS` lists and objects or
    :data:`MAX_VALUES` values, before it is parsed (twenty million ``{}`` took 48 s and 3 GB)."""
    containers = text.count("{") + text.count("[")  # an upper bound (strings may hold some)
    if containers > MAX_CONTAINERS:
        raise error(
            f"{origin} holds {containers} lists/objects, more than {MAX_CONTAINERS} (any file "
            "partitioner reads has far fewer); is it the right file?"
        )
    values = text.count(",") + 1  # each value after the first of a list or object: a bound
    if values > MAX_VALUES:
        raise error(
            f"{origin} holds about {values} values, more than {MAX_VALUES} (any file "
            "partitioner reads has far fewer); is it the right file?"
        )


def data_depth(data: Any) -> int:
    """How deep lists and objects nest in ``data`` (a scalar is 0), without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, Mapping):
            children: Iterable[Any] = value.values()
        elif isinstance(value, list | tuple):
            children = value
        else:
            continue
        deepest = max(deepest, depth + 1)
        if depth + 1 > MAX_DEPTH:
            return depth + 1
        # only containers nest deeper: a scalar child never raises ``deepest`` past depth + 1
        stack.extend((child, depth + 1) for child in children if isinstance(child, _NESTING))
    return deepest


_NESTING = (Mapping, list, tuple)


def _has_big_number(data: Any) -> bool:
    """Whether ``data`` holds an integer of more than :data:`MAX_NUMBER_CHARS` digits."""
    stack = [data]
    limit = 10**MAX_NUMBER_CHARS
    while stack:
        value = stack.pop()
        if isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= limit:
            return True
    return False


def check_data_bounds(data: Any, origin: str, error: type[Exception]) -> Any:
    """``data`` (parsed JSON or TOML) when it nests at most :data:`MAX_DEPTH` deep and holds no
    integer of more than :data:`MAX_NUMBER_CHARS` digits; ``error`` in one line otherwise."""
    _check_depth(data, origin, error)
    if _has_big_number(data):
        raise error(
            f"{origin} holds a number of more than {MAX_NUMBER_CHARS} digits; is it the right "
            "file?"
        )
    return data


def _check_depth(data: Any, origin: str, error: type[Exception]) -> None:
    if data_depth(data) > MAX_DEPTH:
        raise error(
            f"{origin} nests lists/objects more than {MAX_DEPTH} deep; is it the right file?"
        )


class _Duplicate(ValueError):
    """A key given twice in one JSON object (raised inside the JSON reader)."""

    def __init__(self, key: str, first: Any, second: Any) -> None:
        super().__init__(key)
        self.key, self.first, self.second = key, first, second


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's pairs as a dict; :class:`_Duplicate` when a key repeats (Python's reader
    would keep the last value silently)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _Duplicate(key, out[key], value)
        out[key] = value
    return out


def loads_bounded(text: str, origin: str, error: type[Exception], hint: str) -> Any:
    """``text`` parsed as JSON, nesting at most :data:`MAX_DEPTH` deep, with numbers of at most
    :data:`MAX_NUMBER_CHARS` characters; ``error("<origin> is not valid JSON (...); <hint>")``
    in one line otherwise (never a RecursionError or a traceback). A key given twice in one
    object is refused, naming the key and both values (which one was meant is not known).
    More than :data:`MAX_CONTAINERS` lists and objects are refused before parsing: under any
    byte bound, twenty million ``{}`` took 48 s and 3 GB to parse."""
    check_containers(text, origin, error)
    try:
        data = json.loads(
            text, object_pairs_hook=_unique_keys, parse_int=bounded_int, parse_float=bounded_float
        )
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
    except _Duplicate as exc:
        raise error(
            f"{origin} gives key {exc.key!r} twice in one object (values {_short(exc.first)} and "
            f"{_short(exc.second)}); keep one of them, or make the file again"
        ) from None
    except _TooLong as exc:
        detail = str(exc)
    except RecursionError:
        detail = f"lists/objects nested more than {MAX_DEPTH} deep"
    except ValueError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    else:  # its numbers were bounded as they were read (bounded_int, bounded_float)
        _check_depth(data, origin, error)
        return data
    raise error(f"{origin} is not valid JSON ({detail}); {hint}")


def json_digest(data: Mapping[str, Any]) -> str:
    """The SHA-256 of JSON ``data`` without its ``digest`` key: its keys sorted, no spaces,
    every number by its value (a float equal to an integer as that integer: ``jq`` writes
    ``0.0`` as ``0``; other floats as Python writes them, which read back to the same value).
    A plan's ``digest`` (:func:`partitioner.plan.model.plan_digest`) and a calibrated topology
    file's: what proves a file partitioner wrote (:func:`partitioner.core.files.written_by_partitioner`)."""
    rest = _canonical({k: v for k, v in data.items() if k != "digest"})
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _canonical(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {k: _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value
