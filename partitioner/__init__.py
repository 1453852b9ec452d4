"""partitioner: a graph-partitioning, model-parallel compiler for TensorFlow/Keras.

``partitioner.partition(model, gpus=2)`` traces a Keras model, costs it, solves a placement and
returns a :class:`~partitioner.plan.model.Plan`; ``plan.apply(model)`` rewrites the model onto devices.
Its options also come grouped: :class:`TargetOptions` (what to plan for), :class:`SearchOptions`
(how to search) and :class:`MeasureOptions` (how to measure), passed as ``target=``, ``search=``
and ``measure=``. TensorFlow is imported lazily, so the IR, cost models and solvers load without
it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from partitioner.core.errors import PartitionError

__version__ = "0.1.0"


def _check_own_packages() -> None:
    """partitioner's other top-level packages (``passes``, ``cost_models``) are the ones beside
    it: a project's own ``passes`` earlier on ``sys.path`` (the working directory under
    ``python -m``, an emitted program's folder) hid them, and partitioner failed with a
    traceback, or ran the user's modules as its own (campaign 34aa). ImportError in one line."""
    home = Path(__file__).resolve().parent.parent
    for name in ("cost_models", "passes"):
        spec = importlib.util.find_spec(name)
        where = (
            None
            if spec is None
            else (spec.origin or next(iter(spec.submodule_search_locations or ()), None))
        )
        if where is not None and Path(where).resolve().parent not in (home, home / name):
            raise ImportError(
                f"partitioner's package {name!r} is hidden by {where}, found first on sys.path "
                f"(the working directory or the program's folder): rename that {name!r}, or "
                "run from another directory"
            )
    for name in _NEEDED_PACKAGES:  # a file named like one (an emitted numpy.py) hides it
        spec = importlib.util.find_spec(name) if name not in sys.modules else None
        if spec is not None and spec.origin and spec.submodule_search_locations is None:
            raise ImportError(
                f"the package {name!r} that partitioner needs is hidden by {spec.origin}, found "
                "first on sys.path (the working directory or the program's folder): rename that "
                "file, or run from another directory"
            )


_NEEDED_PACKAGES = ("keras", "networkx", "numpy", "rich", "tensorflow")
"""Packages partitioner imports: a file of one's name earlier on ``sys.path`` hides it."""


try:
    _check_own_packages()
except ImportError as hidden:
    if sys.argv[:1] == ["-m"]:  # ``python -m partitioner``: argv[0] while runpy finds the module
        sys.stderr.write(f"partition: error: {hidden}\n")  # the CLI's one line, not a traceback
        raise SystemExit(2) from None
    raise

if TYPE_CHECKING:
    from partitioner.api import load_plan, partition
    from partitioner.core.options import MeasureOptions, SearchOptions, TargetOptions
    from partitioner.plan.model import Plan
    from passes.weightless import without_weights

__all__ = [
    "MeasureOptions",
    "PartitionError",
    "Plan",
    "SearchOptions",
    "TargetOptions",
    "__version__",
    "load_plan",
    "partition",
    "without_weights",
]


def __getattr__(name: str) -> Any:
    if name in ("partition", "load_plan"):
        from partitioner import api

        return getattr(api, name)
    if name in ("MeasureOptions", "SearchOptions", "TargetOptions"):
        from partitioner.core import options  # loaded on use: the CLI's Ctrl-C handler first

        return getattr(options, name)
    if name == "without_weights":
        from passes.weightless import without_weights

        return without_weights
    if name == "Plan":
        from partitioner.plan.model import Plan

        return Plan
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")
