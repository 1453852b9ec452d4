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

import json
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError

__all__ = ["error_order", "field_path", "strict_validator"]

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
