"""The options of a planning run, grouped by what they are about.

* :class:`TargetOptions`: what to plan for (devices, batch, optimizer, memory);
* :class:`SearchOptions`: how to search for a placement (solver, budget, pipelining);
* :class:`MeasureOptions`: how to measure costs instead of estimating them.

``partitioner.partition`` builds them from its keyword arguments (or takes them as they are), the
CLI builds them from its flags. Pure data: each dataclass checks its own fields when built and
raises :class:`~partitioner.core.errors.UsageError` naming the field as the Python API spells it
(``batch_size=0``). Names that later stages resolve (a device type in the catalog, a solver in the
registry, a topology) are checked by ``partitioner.api.prepare``, which knows those stages.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from partitioner.core.errors import UsageError
from partitioner.core.files import path_argument
from partitioner.core.ir import Schedule
from partitioner.core.strategy import Family
from partitioner.core.units import MAX_SIZE_BYTES, parse_bytes

__all__ = [
    "DEFAULT_DEVICE_TYPE",
    "DEFAULT_SCHEDULE",
    "MAX_BATCH_SIZE",
    "MAX_DEVICES",
    "MAX_MEMORY_BYTES",
    "MAX_MICROBATCHES",
    "MAX_PLAN_SECONDS",
    "MAX_SAMPLE_VALUES",
    "MAX_SEED",
    "MAX_TIME_LIMIT_S",
    "InputShape",
    "MeasureOptions",
    "SearchOptions",
    "TargetOptions",
    "parse_memory_limit",
    "parse_schedule",
    "short_repr",
    "short_text",
]

InputShape: TypeAlias = tuple[int, ...] | dict[str, tuple[int, ...]]
"""One sample's input shape without the batch dimension: one shape (a single-input model), or
input name -> shape (``{"token_ids": (128,), "padding_mask": (128,)}``)."""

DEFAULT_SCHEDULE = Schedule.ONE_F_ONE_B
"""The pipeline schedule when ``pipeline=True`` names none."""

DEFAULT_DEVICE_TYPE = "h100"
"""The device type when ``device_type`` is None: of a link kind's devices, TF_CONFIG's, and a
topology file's entries that name no type."""

# The bounds of every number a run takes, API and CLI alike (the CLI's flags map to these
# arguments), checked when the option groups are built: before any trace.
MAX_DEVICES = 512
"""The most devices a run plans for (``gpus``, a topology): a 1024-device topology takes
seconds to build and every placement stage grows with the devices."""
MAX_BATCH_SIZE = 1 << 24
"""The largest ``batch_size``."""
MAX_MICROBATCHES = 1024
"""The most ``num_microbatches``."""
MAX_TIME_LIMIT_S = 86_400.0
"""The longest ``time_limit_s``: a day."""
MAX_PLAN_SECONDS = 1e9
"""The longest time a plan file may state (a step, a phase, a link's latency): about 30 years;
a planner's figure is far below it, so a larger one is an edited or corrupted file."""
MAX_SAMPLE_VALUES = 1 << 31
"""The most values in one sample of ``input_shape`` (the product of its dimensions)."""
MAX_MEMORY_BYTES = MAX_SIZE_BYTES
"""The most memory per device (``memory_limit_bytes``, a topology's devices): 1 EiB, inside the
64-bit integers the solvers keep memory in (more fails deep inside them)."""
MAX_SEED = (1 << 31) - 1
"""The largest ``seed``: the solvers hand it to OR-Tools (CP-SAT's ``random_seed`` is a 32-bit
integer) and METIS (a C ``int``)."""
SINGLE_DEVICE_SOLVER = "single"
"""The solver that places every layer on one device: nothing for ``pipeline=True`` to overlap."""


def short_text(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters (a 900 KB job name in a message)."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def short_repr(value: Any, limit: int = 40) -> str:
    """``repr(value)`` cut to ``limit`` characters (``10**400`` has 401 digits)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


def _integer(value: Any) -> int | None:
    """``value`` as a Python int when it is an integer (``int``, ``numpy.int64``: anything
    with ``__index__``), not a bool; else None."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _positive_int(name: str, value: Any, limit: int | None = None) -> int:
    """``value`` as an int when it is an integer >= 1 (not a bool, :func:`_integer`) and at most
    ``limit``; UsageError naming ``name=value``."""
    number = _integer(value)
    if number is None or number < 1:
        raise UsageError(f"{name}={value!r} must be a positive integer")
    if limit is not None and number > limit:
        raise UsageError(
            f"{name}={number} is more than {limit}, the most partition takes; give at most {limit}"
        )
    return number


def _flag(name: str, value: Any) -> bool:
    """``value`` when it is True or False; UsageError naming ``name=value``."""
    if not isinstance(value, bool):
        raise UsageError(f"{name}={value!r} must be True or False")
    return value


def _text(name: str, value: Any) -> str:
    """``value`` as a string (paths accepted); UsageError when it is neither."""
    if isinstance(value, os.PathLike):
        return os.fspath(value)  # type: ignore[no-any-return]
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{name}={value!r} must be a non-empty string")
    return value


def parse_schedule(value: Schedule | str) -> Schedule:
    """The :class:`Schedule` called ``value`` (case-insensitive); UsageError listing the known."""
    if isinstance(value, Schedule):
        return value
    try:
        return Schedule(str(value).lower())
    except ValueError:
        known = ", ".join(s.value for s in Schedule if s is not Schedule.NONE)
        raise UsageError(
            f"schedule={value!r} is not a pipeline schedule; known: {known}"
        ) from None


AUTO_STRATEGY = "auto"
"""``strategy=`` value: search every family and apply the fastest."""


def parse_strategy(value: Family | str | None) -> Family | str | None:
    """``strategy=``: ``None``, ``"auto"`` or a :class:`Family` (its value, case-insensitive,
    ``-`` for ``_``); UsageError listing the known."""
    if value is None or isinstance(value, Family):
        return value
    text = str(value).strip().lower().replace("-", "_")
    if text == AUTO_STRATEGY:
        return AUTO_STRATEGY
    try:
        return Family(text)
    except ValueError:
        known = ", ".join([AUTO_STRATEGY, *(f.value for f in Family)])
        raise UsageError(f"strategy={value!r} is not a strategy; known: {known}") from None


def parse_memory_limit(text: str) -> int:
    """``'16GiB'`` -> bytes, for ``memory_limit_bytes`` (at most :data:`MAX_MEMORY_BYTES`);
    UsageError naming ``memory_limit=``."""
    if not isinstance(text, str):
        raise UsageError(f"memory_limit={text!r} must be a size such as '16GiB'")
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise UsageError(f"memory_limit={exc}") from None


def _check_memory_limit(given: Any) -> int:
    """``memory_limit_bytes`` as an int: an integer of bytes in 1..:data:`MAX_MEMORY_BYTES`."""
    value = _integer(given)
    if value is None or value < 1:
        raise UsageError(
            f"memory_limit_bytes={short_repr(given)} must be a positive integer of bytes "
            "(17179869184 for 16 GiB)"
        )
    if value > MAX_MEMORY_BYTES:
        raise UsageError(
            f"memory_limit_bytes={short_repr(value)} is more than {MAX_MEMORY_BYTES} (1 EiB), the most "
            f"partition takes; give at most {MAX_MEMORY_BYTES}"
        )
    return value


def _check_sample_values(shape: InputShape) -> None:
    """Each input's sample holds at most :data:`MAX_SAMPLE_VALUES` values."""
    named = shape.items() if isinstance(shape, dict) else [("", shape)]
    for name, dims in named:
        values = math.prod(dims)
        if values > MAX_SAMPLE_VALUES:
            shown = f"{{{name!r}: {dims!r}}}" if name else repr(dims)
            raise UsageError(
                f"input_shape={shown} makes {values} values per sample, more than "
                f"{MAX_SAMPLE_VALUES}; give the shape of one sample"
            )


@dataclass(frozen=True)
class TargetOptions:
    """What to plan for: the devices, the batch and what training keeps in memory.

    ``gpus`` devices of ``device_type`` (a catalog name; ``None``: :data:`DEFAULT_DEVICE_TYPE`)
    joined by ``topology``: ``pcie``, ``nvlink``, a catalog link kind, ``tf-config`` or a
    JSON/TOML topology file (:func:`cost_models.devices.topology.load_topology`; a file names
    its own devices, so ``gpus`` may then be ``None``, and a ``device_type`` given beside a file
    that names every device's type, not all of them this one, is refused: it would be ignored). ``input_shape`` is one sample's shape, for inputs whose
    dimensions the model leaves unknown: one shape, or a dict of input name -> shape for a model
    with several inputs (``{"token_ids": (128,), "padding_mask": (128,)}``); ``optimizer``
    decides the memory of its slots; ``memory_limit_bytes`` overrides every device's memory (default: the catalog's figure).
    ``precision`` plans for a precision policy other than the model's (``fp32``, ``tf32``,
    ``mixed_float16`` / ``fp16``, ``mixed_bfloat16`` / ``bf16``; checked by
    :func:`cost_models.estimate.precision.parse_precision`); ``None``: the model's own dtype
    policy, float32 on TF32 tensor cores when TensorFlow's TF32 setting is on (its default).

    Bounds: ``gpus`` at most :data:`MAX_DEVICES`, ``batch_size`` :data:`MAX_BATCH_SIZE`,
    ``memory_limit_bytes`` :data:`MAX_MEMORY_BYTES`, :data:`MAX_SAMPLE_VALUES` values per sample.
    """

    gpus: int | None = None
    device_type: str | None = None
    topology: str = "pcie"
    batch_size: int = 32
    input_shape: InputShape | None = None
    optimizer: str = "adam"
    memory_limit_bytes: int | None = None
    precision: str | None = None

    def __post_init__(self) -> None:
        if self.precision is not None:
            object.__setattr__(self, "precision", _text("precision", self.precision))
        if self.gpus is not None:
            object.__setattr__(self, "gpus", _positive_int("gpus", self.gpus, MAX_DEVICES))
        object.__setattr__(
            self, "batch_size", _positive_int("batch_size", self.batch_size, MAX_BATCH_SIZE)
        )
        if self.device_type is not None:
            object.__setattr__(self, "device_type", _text("device_type", self.device_type))
        object.__setattr__(self, "topology", _text("topology", self.topology))
        object.__setattr__(self, "optimizer", _text("optimizer", self.optimizer))
        if self.input_shape is not None:
            shape = self._checked_shape(self.input_shape)
            _check_sample_values(shape)
            object.__setattr__(self, "input_shape", shape)
        if self.memory_limit_bytes is not None:
            limit = _check_memory_limit(self.memory_limit_bytes)
            object.__setattr__(self, "memory_limit_bytes", limit)

    @staticmethod
    def _checked_shape(shape: Any) -> InputShape:
        """``input_shape`` as a tuple of positive integers (any sequence of them accepted), or
        a dict of input name -> such a tuple."""
        if isinstance(shape, Mapping):
            if not shape or not all(isinstance(k, str) and k for k in shape):
                raise UsageError(
                    f"input_shape={dict(shape)!r} must map input names to shapes, e.g. "
                    "input_shape={'token_ids': (128,), 'padding_mask': (128,)}"
                )
            return {k: TargetOptions._one_shape(v) for k, v in shape.items()}
        return TargetOptions._one_shape(shape)

    @staticmethod
    def _one_shape(shape: Any) -> tuple[int, ...]:
        """One shape as a tuple of positive integers; UsageError naming ``input_shape``."""
        if isinstance(shape, int) and not isinstance(shape, bool):
            shape = (shape,)
        try:
            dims = tuple(operator.index(d) for d in shape if not isinstance(d, bool))
            if len(dims) != len(shape):
                dims = ()
        except TypeError:
            dims = ()
        if not dims or any(d < 1 for d in dims):
            raise UsageError(
                f"input_shape={shape!r} must be positive integers without the batch "
                "dimension, e.g. input_shape=(32, 32, 3)"
            )
        return dims


@dataclass(frozen=True)
class SearchOptions:
    """How to search: the solver, its seed and time budget, and pipelining.

    ``solver`` is a name in the solver registry (``partitioner.solvers.SOLVERS``); ``seed`` and
    ``time_limit_s`` are its options. With ``pipeline``, the plan's stages run
    ``num_microbatches`` micro-batches under ``schedule`` (``None``: :data:`DEFAULT_SCHEDULE`;
    ``num_microbatches`` ``None``: the most micro-batches up to 4 x devices that divide the
    batch, see :meth:`microbatches_for`) and its predictions are the pipelined step's. A
    pipeline has 2 micro-batches or more and a solver that splits (not ``solver='single'``):
    one micro-batch is a plain split, refused rather than priced as a pipeline. ``seed`` is in
    0..:data:`MAX_SEED`, ``time_limit_s`` at most :data:`MAX_TIME_LIMIT_S`. With
    ``compare_strategies``, the plan also compares every strategy family (single device, data
    parallel, pipeline, plain split, hybrid) by the predicted step of what each would run
    (:mod:`partitioner.planner`; the model is traced again at each per-replica batch).

    ``strategy`` says which strategy the plan applies: ``"auto"`` the fastest of every family, a
    :class:`~partitioner.core.strategy.Family` the fastest of that family (the stage placements
    by the planner's solvers and ``solver``'s own). ``None`` (the default) is ``"auto"`` when
    ``solver`` is ``"auto"`` without ``pipeline``; with a named solver or ``pipeline`` the plan
    applies that solver's split (and still compares the families, see
    :attr:`strategy_families`).
    """

    solver: str = "auto"
    seed: int = 0
    time_limit_s: float = 5.0
    pipeline: bool = False
    num_microbatches: int | None = None
    schedule: Schedule | None = None
    compare_strategies: bool = True
    strategy: Family | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "solver", _text("solver", self.solver))
        _flag("compare_strategies", self.compare_strategies)
        _flag("pipeline", self.pipeline)
        object.__setattr__(self, "strategy", parse_strategy(self.strategy))
        self._check_strategy()
        seed = _integer(self.seed)
        if seed is None or not 0 <= seed <= MAX_SEED:
            raise UsageError(
                f"seed={self.seed!r} must be an integer in 0..{MAX_SEED} (the solvers' random "
                "seed is a 32-bit integer)"
            )
        object.__setattr__(self, "seed", seed)
        self._check_time_limit()
        if self.schedule is not None:
            object.__setattr__(self, "schedule", parse_schedule(self.schedule))
        self._check_pipelining()

    def _check_strategy(self) -> None:
        """``strategy`` needs the strategy comparison, and is not ``pipeline``'s own split."""
        if self.strategy is None:
            return
        shown = self.strategy.value if isinstance(self.strategy, Family) else self.strategy
        if not self.compare_strategies:
            raise UsageError(
                f"strategy={shown!r} is chosen by comparing strategies: it needs "
                "compare_strategies=True"
            )
        unsplit = (Family.SINGLE, Family.DATA_PARALLEL)
        if self.strategy in unsplit and self.solver not in ("auto", SINGLE_DEVICE_SOLVER):
            spelled = shown.replace("_", "-")
            raise UsageError(
                f"solver={self.solver!r} places a model's stages, and strategy={spelled!r} has "
                f"none (the whole model on each device): drop solver={self.solver!r}, or use "
                "strategy='placed' (or 'pipeline', 'hybrid') to have it place them"
            )
        if self.pipeline:
            raise UsageError(
                f"strategy={shown!r} and pipeline=True: pipeline=True pipelines the solver's "
                "own split with the micro-batches and schedule given; strategy='pipeline' "
                "searches the pipelines. Use one"
            )

    @property
    def strategy_families(self) -> tuple[Family, ...] | None:
        """The families the plan's strategy is chosen from; ``None``: the plan applies the
        solver's split (a named solver, ``pipeline``, or no strategy comparison)."""
        if self.strategy is None:
            auto = self.solver == "auto" and not self.pipeline and self.compare_strategies
            return tuple(Family) if auto else None
        if self.strategy == AUTO_STRATEGY:
            return tuple(Family)
        return (Family(self.strategy),)

    def _check_time_limit(self) -> None:
        """``time_limit_s`` is a positive, finite number of seconds, at most a day: any real
        number (numpy's too, an int too large for a float), as a float."""
        t = self.time_limit_s
        shown = short_repr(t)
        real = not (isinstance(t, bool) or type(t).__name__ == "bool_") and isinstance(
            t, numbers.Real
        )
        value = (int(t) if isinstance(t, numbers.Integral) else float(t)) if real else math.nan
        finite = isinstance(value, int) or math.isfinite(value)  # an int is exact, however large
        if not (finite and value > 0):
            raise UsageError(f"time_limit_s={shown} must be a positive number of seconds")
        if value > MAX_TIME_LIMIT_S:
            raise UsageError(
                f"time_limit_s={shown} is more than {MAX_TIME_LIMIT_S:.15g}, the most partition "
                f"takes; give at most {MAX_TIME_LIMIT_S:.15g}"
            )
        object.__setattr__(self, "time_limit_s", float(value))

    def _check_pipelining(self) -> None:
        """Micro-batches and schedules only with ``pipeline``, a schedule that pipelines, at
        least 2 micro-batches, and a solver that splits."""
        if self.num_microbatches is not None:
            object.__setattr__(
                self,
                "num_microbatches",
                _positive_int("num_microbatches", self.num_microbatches, MAX_MICROBATCHES),
            )
        if not self.pipeline:
            for name, value in (
                ("num_microbatches", self.num_microbatches),
                ("schedule", None if self.schedule is None else self.schedule.value),
            ):
                if value is not None:
                    raise UsageError(f"{name}={value!r} needs pipeline=True{self._searched()}")
            return
        if self.schedule is Schedule.NONE:
            known = " or ".join(s.value for s in Schedule if s is not Schedule.NONE)
            raise UsageError(
                f"pipeline=True needs a pipeline schedule ({known}), not schedule='none'"
            )
        if self.num_microbatches == 1:
            raise UsageError(
                "num_microbatches=1 with pipeline=True is no pipeline: a pipeline needs at least "
                "2 micro-batches; give num_microbatches=2 or more, or drop pipeline=True for a "
                "plain split"
            )
        if self.solver == SINGLE_DEVICE_SOLVER:
            raise UsageError(
                f"solver={SINGLE_DEVICE_SOLVER!r} puts every layer on one device, so "
                "pipeline=True has no stages to pipeline; drop pipeline=True, or pick a solver "
                "that splits the model (solver='auto')"
            )

    def _searched(self) -> str:
        """Why a micro-batch count or schedule goes with ``pipeline=True`` only: plain splits
        run whole batches, and a ``strategy`` chooses its own (a circle of advice otherwise)."""
        if self.strategy is None:
            return " (plain splits run whole batches)"
        shown = self.strategy.value if isinstance(self.strategy, Family) else self.strategy
        return (
            f", which pipelines the solver's own split as given; strategy={shown!r} chooses the "
            f"micro-batches and schedule itself: drop them, or give pipeline=True instead of "
            f"strategy={shown!r}"
        )

    def check_devices(self, num_devices: int) -> None:
        """UsageError when ``strategy`` names a family that needs more devices than
        ``num_devices``, or stages that ``solver='single'`` cannot place."""
        family = self.strategy if isinstance(self.strategy, Family) else None
        if family is None or family is Family.SINGLE:
            return
        least = 4 if family is Family.HYBRID else 2
        if num_devices < least:
            raise UsageError(
                f"strategy={family.value!r} needs at least {least} devices, and the plan has "
                f"{num_devices}; give gpus={least} or more (on a cluster of CPU tasks, each task "
                f"is one device: run {least} tasks or more), or strategy='single'"
            )
        if self.solver == SINGLE_DEVICE_SOLVER and family is not Family.DATA_PARALLEL:
            raise UsageError(
                f"solver={SINGLE_DEVICE_SOLVER!r} puts every layer on one device, and "
                f"strategy={family.value!r} splits the model into stages; drop "
                f"solver={SINGLE_DEVICE_SOLVER!r} (the strategy places its stages with the "
                "planner's solvers), or use strategy='single'"
            )

    @property
    def pipeline_schedule(self) -> Schedule | None:
        """The schedule the plan runs: ``None`` without pipelining."""
        if not self.pipeline:
            return None
        return self.schedule or DEFAULT_SCHEDULE

    def microbatches_for(self, batch_size: int, num_devices: int) -> int:
        """The micro-batches per batch on ``num_devices`` devices (1 without pipelining; 2 or
        more with it: a pipeline of one micro-batch would be a plain split priced as a pipeline).

        Raises UsageError when pipelining one device or a batch of 1, when ``num_microbatches``
        does not divide ``batch_size``, or when none is given and no count from 2 to 4 x
        devices divides it."""
        if not self.pipeline:
            return 1
        if num_devices < 2:
            raise UsageError(
                "pipeline=True needs at least 2 devices: a plan on one device has no stages to "
                "overlap (use gpus=2 or more, or drop pipeline=True)"
            )
        if batch_size < 2:
            raise UsageError(
                f"batch_size={batch_size} cannot be split into micro-batches: pipeline=True "
                "needs a batch of 2 or more; give batch_size=2 or more, or drop pipeline=True "
                "for a plain split"
            )
        if self.num_microbatches is None:
            return self._default_microbatches(batch_size, num_devices)
        if batch_size % self.num_microbatches:
            raise UsageError(
                f"batch_size={batch_size} is not divisible by "
                f"num_microbatches={self.num_microbatches}; pick a number of micro-batches "
                "that divides the batch"
            )
        return self.num_microbatches

    @staticmethod
    def _default_microbatches(batch_size: int, num_devices: int) -> int:
        """The most micro-batches up to 4 x ``num_devices`` that divide ``batch_size`` (at
        least 2); UsageError naming the smallest count that would when none does."""
        top = min(batch_size, 4 * num_devices)
        best = max(m for m in range(1, top + 1) if batch_size % m == 0)
        if best >= 2:
            return best
        smallest = next(
            (m for m in range(2, math.isqrt(batch_size) + 1) if batch_size % m == 0), batch_size
        )
        hint = (
            f"give num_microbatches={smallest} (it divides the batch), "
            if smallest <= MAX_MICROBATCHES
            else ""
        )
        raise UsageError(
            f"batch_size={batch_size} has no divisor from 2 to {top} (4 x {num_devices} devices) "
            f"to pipeline as micro-batches; {hint}pick a batch size with a small divisor, or drop "
            "pipeline=True for a plain split"
        )


@dataclass(frozen=True)
class MeasureOptions:
    """How to measure costs instead of estimating them.

    ``profile`` times every layer (forward and backward) on the devices of the topology that are
    present here (:func:`cost_models.measure.profiled.profile_model`; cached on disk in
    ``cache_dir``, default ``$PARTITIONER_CACHE_DIR`` or the user's cache directory) and those
    times replace the estimates; the plan records which layers were measured. ``profile_ops``
    times every op of the traced training step inside the step on this machine's CPU
    (:func:`cost_models.measure.op_profile.profile_step_ops`) and those times replace the
    estimates of the topology's cpu devices (glue ops included; not cached).

    ``trace_cache`` reads each traced training step from ``cache_dir`` instead of tracing it
    again, and stores the run's new traces there once the plan succeeds
    (:mod:`passes.trace_cache`); off unless asked (the ``partition`` command asks), so a library
    call writes no file it was not told to. A run that measures traces for real.
    """

    profile: bool = False
    profile_ops: bool = False
    cache_dir: str | None = None
    trace_cache: bool = False

    def __post_init__(self) -> None:
        _flag("profile", self.profile)
        _flag("profile_ops", self.profile_ops)
        _flag("trace_cache", self.trace_cache)
        if self.cache_dir is not None:
            given = path_argument(
                self.cache_dir, "cache_dir", "give a directory, e.g. cache_dir='cache'"
            )
            object.__setattr__(self, "cache_dir", given)
