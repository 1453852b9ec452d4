"""The standard library the command writes its files with, as it was before the model's code ran.

A model file runs in this process and may replace a function of the standard library (campaign
34p: ``json.dumps`` returning ``"{not json"``, ``os.replace`` doing nothing). The command then
wrote a plan that was no JSON, or none at all, and still said "Plan written to plan.json".
:func:`standard_library_kept` notes the functions of the modules the run writes, encodes and
reads files with before the model's code runs, and puts back any the code replaced once it is
done, with a warning naming them: the files are written by Python's own functions.
:func:`modules_kept` does the same for ``sys.modules``: a module the code set to None there
(``sys.modules["hashlib"] = None``, campaign 34q), removed, or replaced (a standard library one,
campaign 34v) made the run's next import of it fail as an "internal error".
"""

from __future__ import annotations

import builtins
import codecs
import contextlib
import hashlib
import io
import json
import json.decoder
import json.encoder
import logging
import os
import os.path
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType
from typing import Any

__all__ = ["modules_kept", "standard_library_kept"]

logger = logging.getLogger(__name__)

_KEPT: tuple[ModuleType | type, ...] = (
    builtins, codecs, hashlib, io, json, json.decoder, json.encoder, os, os.path, shutil, stat,
    tempfile, json.JSONEncoder, json.JSONDecoder,
)  # fmt: skip
"""What the run's writes go through: their functions (and the JSON coder classes' methods)."""


def _functions(owner: ModuleType | type) -> dict[str, Any]:
    return {k: v for k, v in vars(owner).items() if callable(v) and not isinstance(v, type)}


@contextlib.contextmanager
def standard_library_kept() -> Iterator[None]:
    """Inside, the model's code may replace what it likes; on leaving, every function of
    :data:`_KEPT` it replaced (or removed) is put back, and a warning names them."""
    saved = [(owner, _functions(owner)) for owner in _KEPT]
    try:
        yield
    finally:
        restored = []
        for owner, functions in saved:
            now = vars(owner)
            for name, function in functions.items():
                if now.get(name) is not function:
                    setattr(owner, name, function)
                    restored.append(f"{getattr(owner, '__name__', owner)}.{name}")
        if restored:
            logger.warning(
                "the model's code replaced %s; the run put Python's own back before writing "
                "its files",
                ", ".join(sorted(restored)[:8]) + (" ..." if len(restored) > 8 else ""),
            )


def _replaced(name: str, before: ModuleType, now: object) -> bool:
    """Whether the code inside removed ``name`` from ``sys.modules`` (or set it to None), or put
    another object under a standard library name (``sys.modules["json"] =
    types.ModuleType("json")``: the run's next ``import json`` got it, campaign 34v). Other
    modules may be swapped by their own packages (lazy loaders), so only their removal counts."""
    if now is None:
        return True
    return now is not before and name.split(".")[0] in sys.stdlib_module_names


@contextlib.contextmanager
def modules_kept() -> Iterator[None]:
    """On leaving, every module of ``sys.modules`` that the code inside set to None or removed
    (and did not import again), and every standard library module it replaced, is put back, and
    a warning names them."""
    before = dict(sys.modules)
    try:
        yield
    finally:
        gone = sorted(
            name for name, module in before.items() if _replaced(name, module, sys.modules.get(name))
        )
        for name in gone:
            sys.modules[name] = before[name]
        if gone:
            logger.warning(
                "the model's code removed or replaced %s in sys.modules; the run put them back",
                ", ".join(gone[:8]) + (" ..." if len(gone) > 8 else ""),
            )
