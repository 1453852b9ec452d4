"""partitioner: a graph-partitioning, model-parallel compiler for TensorFlow/Keras.

``partitioner.partition(model, gpus=2)`` traces a Keras model, costs it, solves a placement and
returns a :class:`~partitioner.plan.model.Plan`; ``plan.apply(model)`` rewrites the model onto devices.
Its options also come grouped: :class:`TargetOptions` (what to plan for), :class:`SearchOptions`
(how to search) and :class:`MeasureOptions` (how to measure), passed as ``target=``, ``search=``
and ``measure=``. TensorFlow is imported lazily, so the IR, cost models and solvers load without
it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from partitioner.core.errors import PartitionError

__version__ = "0.1.0"

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
