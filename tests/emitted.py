"""Importing a module partitioner emitted, for the tests that run emitted code (one home)."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

_counter = itertools.count()


def import_emitted(path: Path) -> ModuleType:
    """The module at ``path`` (an emitted file), imported under a fresh name and registered in
    ``sys.modules`` as an import would be (what looks its module up, pickle or dataclasses,
    finds it)."""
    name = f"emitted_module_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
