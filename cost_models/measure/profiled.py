"""Profiled costs: each layer's forward and backward time measured on the devices that are present.

How a layer is measured
-----------------------
The model is called once eagerly (``training=True``) while ``Layer.__call__`` and
``Operation.__call__`` are wrapped, the same way :mod:`passes.trace` finds its placement units;
every call of a unit records the tensors it was given. For each unit and each device, two
``tf.function``\\ s are built on copies of those tensors placed with ``tf.device``:

* ``forward``: the unit's call;
* ``forward+backward``: the call under a ``GradientTape`` and the gradients of its outputs (with
  a random upstream gradient) with respect to its trainable weights and to those of its inputs
  that depend on a trainable weight upstream (the inputs ``tf.gradients`` differentiates in the
  traced training step; the model's own inputs are not differentiated).

A third, empty function on the same inputs measures the fixed cost of calling a ``tf.function``,
which is subtracted. After ``warmup`` calls, the three are timed in interleaved rounds (so machine
noise hits them alike) until ``min_repeats`` rounds and ``min_time_s`` have passed (at most
``max_repeats``); each time is the median over the rounds. The backward time is
``median(forward+backward) - median(forward)`` (clamped at 0).

The cache
---------
One JSON file per (layer signature, device) in ``<cache dir>/layers/``: the key is the SHA-256 of
the layer's class and configuration (its name left out, so identical layers share an entry), the
shapes and dtypes of every call's inputs, the device's kind (its model name, not its index), the
TensorFlow version and the batch size. Files are written to a temporary file and renamed
(:func:`partitioner.core.files.write_atomic`), so an interrupted run (Ctrl-C) never leaves a partial
entry; an entry that is a symbolic link is a miss, and the new entry replaces the link itself,
never the file it points at. The cache directory is ``$PARTITIONER_CACHE_DIR``, else
``$XDG_CACHE_HOME/partitioner``, else ``~/.cache/partitioner``.

Merging
-------
:func:`apply_profile` (pure) scales each measured layer's forward ops on a device row so they sum
to the measured forward time, and its backward ops to the measured backward time, keeping the
analytic model's split between the ops; unmeasured layers and glue ops keep their estimates.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cost_models.devices.catalog import DeviceKind
from cost_models.devices.datafiles import check_schema, parse_json, read_text
from partitioner.core.errors import OutputError, PartitionError, TraceError
from partitioner.core.files import check_own_entry, default_cache_dir
from partitioner.core.ir import CostedGraph, Phase
from partitioner.core.options import InputShape

__all__ = [
    "CACHE_SCHEMA",
    "LayerTiming",
    "ProfileResult",
    "ProfileSettings",
    "ProfileWrites",
    "ProgressCallback",
    "Statistic",
    "apply_profile",
    "cache_write_problem",
    "default_cache_dir",
    "default_profile_devices",
    "device_kind",
    "profile_model",
    "time_model_step",
]

logger = logging.getLogger(__name__)

CACHE_SCHEMA = 1
"""Bumped whenever the measurement method changes, so old cache entries are ignored."""

ProgressCallback = Callable[[int, int, str], None]
"""``progress(done, total, label)``: called before each layer-device measurement and at the end."""


class Statistic(enum.Enum):
    """How repeated timings are summarised."""

    MEDIAN = "median"
    MIN = "min"

    def of(self, values: Sequence[float]) -> float:
        return statistics.median(values) if self is Statistic.MEDIAN else min(values)


@dataclass(frozen=True)
class ProfileSettings:
    """How many times each function runs: warm-up calls, then interleaved rounds."""

    warmup: int = 2
    min_repeats: int = 5
    max_repeats: int = 50
    min_time_s: float = 0.2
    """Keep timing rounds until this much time has been spent on a layer (and min_repeats)."""
    statistic: Statistic = Statistic.MEDIAN
    """How the rounds are summarised: the median (default), or the minimum (steadier on a machine
    shared with other work, where contention only ever adds time)."""

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise PartitionError(
                f"profile settings warmup={self.warmup}, min_repeats={self.min_repeats}, "
                f"max_repeats={self.max_repeats}: need warmup >= 0 and 1 <= min <= max"
            )
        if not (self.min_time_s >= 0 and math.isfinite(self.min_time_s)):
            raise PartitionError(f"profile settings min_time_s={self.min_time_s} must be >= 0")


@dataclass(frozen=True)
class LayerTiming:
    """One layer's measured times on one device (all calls of a shared layer together)."""

    layer: str
    device: str
    """The TensorFlow device string it ran on, e.g. ``/device:GPU:0``."""
    forward_time_s: float
    backward_time_s: float
    repeats: int
    cached: bool
    """Whether the figures came from the cache rather than a measurement in this run."""

    @property
    def total_time_s(self) -> float:
        return self.forward_time_s + self.backward_time_s


@dataclass(frozen=True)
class ProfileResult:
    """The measured times of a model's layers on the devices that were profiled."""

    model: str
    batch_size: int
    devices: tuple[str, ...]
    device_kinds: tuple[str, ...]
    """The kind (model name) of each entry of ``devices``, the part of the cache key."""
    timings: tuple[LayerTiming, ...]
    skipped: tuple[str, ...]
    """Layers that could not be measured (never called, or no float output): kept estimated."""
    measured_count: int
    """Layer-device pairs measured in this run."""
    cached_count: int
    """Layer-device pairs read from the cache (or shared with an identical layer of this run)."""
    cache_dir: str | None
    profile_time_s: float
    tf_version: str = ""
    notes: tuple[str, ...] = field(default=())

    def timing(self, layer: str, device: str) -> LayerTiming | None:
        for t in self.timings:
            if t.layer == layer and t.device == device:
                return t
        return None

    @property
    def layers(self) -> tuple[str, ...]:
        """Layers with at least one timing, in first-seen order."""
        seen: dict[str, None] = {}
        for t in self.timings:
            seen.setdefault(t.layer, None)
        return tuple(seen)


# ----------------------------------------------------------------------------------------------
# Pure: merging measured times into a costed graph


def apply_profile(
    costed: CostedGraph,
    result: ProfileResult,
    device_rows: Mapping[int, str] | None = None,
) -> CostedGraph:
    """A new CostedGraph whose measured layers' op times sum to the measured times.

    ``device_rows`` maps a topology device index to the profiled TF device whose timings it
    takes. By default a profile of one device applies to every row (identical devices), and a
    profile of several devices gives row ``i`` the timings of ``result.devices[i]`` (rows beyond
    them stay estimated). For each measured layer and row, the layer's own forward ops
    (``op.layer == layer``) are scaled to sum to the measured forward time and its backward ops to
    the backward time; when the estimate of a phase is 0 the measured time is spread evenly over
    that phase's ops. Glue ops (``op.layer is None``) keep their estimates.
    """
    rows = _profile_rows(costed.topology.num_devices, result, device_rows)
    graph = costed.graph
    by_layer: dict[str, list[tuple[int, Phase]]] = {}
    for i, op in enumerate(graph.ops):
        if op.layer is not None:
            by_layer.setdefault(op.layer, []).append((i, op.phase))
    timing_index = {(t.layer, t.device): t for t in result.timings}
    new_rows: list[tuple[float, ...]] = []
    measured: set[str] = set()
    for d, row in enumerate(costed.op_compute_time_s):
        row_device = rows.get(d)
        if row_device is None:
            new_rows.append(row)
            continue
        timings = {
            layer: timing
            for layer in by_layer
            if (timing := timing_index.get((layer, row_device))) is not None
        }
        new_rows.append(_scaled_row(row, by_layer, timings))
        measured.update(timings)
    unknown = sorted({t.layer for t in result.timings} - {info.name for info in graph.layers})
    if unknown:
        logger.debug("profile names layers not in the graph (ignored): %s", unknown[:5])
    return CostedGraph(
        graph=graph,
        topology=costed.topology,
        op_compute_time_s=tuple(new_rows),
        layer_memory=costed.layer_memory,
        op_memory_share=costed.op_memory_share,
        measured=tuple(info.name for info in graph.layers if info.name in measured),
    )


def _profile_rows(
    n_rows: int, result: ProfileResult, device_rows: Mapping[int, str] | None
) -> dict[int, str]:
    """Topology row -> profiled device (the defaults of :func:`apply_profile`), checked."""
    if device_rows is not None:
        rows = dict(device_rows)
    elif len(result.devices) == 1:
        rows = {i: result.devices[0] for i in range(n_rows)}
    else:
        rows = {i: d for i, d in enumerate(result.devices) if i < n_rows}
    for i, dev in rows.items():
        if not 0 <= i < n_rows:
            raise PartitionError(
                f"device row {i} is outside the topology's devices 0..{n_rows - 1}; "
                "map only existing device indices"
            )
        if dev not in result.devices:
            raise PartitionError(
                f"device {dev!r} was not profiled; profiled: {', '.join(result.devices) or 'none'}"
            )
    return rows


def _scaled_row(
    row: tuple[float, ...],
    by_layer: Mapping[str, Sequence[tuple[int, Phase]]],
    timings: Mapping[str, LayerTiming],
) -> tuple[float, ...]:
    """``row`` with each timed layer's forward and backward ops scaled to the measured times."""
    times = list(row)
    for layer, timing in timings.items():
        positions = by_layer[layer]
        for phase, target in (
            (Phase.FORWARD, timing.forward_time_s),
            (Phase.BACKWARD, timing.backward_time_s),
        ):
            idx = [i for i, p in positions if p is phase]
            if not idx:
                continue
            estimate = sum(row[i] for i in idx)
            target = max(0.0, target)
            for i in idx:
                times[i] = row[i] * (target / estimate) if estimate > 0 else target / len(idx)
    return tuple(times)


# ----------------------------------------------------------------------------------------------
# The cache


def _entry_path(cache_dir: Path, key: str) -> Path:
    return cache_dir / "layers" / f"{key}.json"


MAX_CACHE_ENTRY_BYTES = 1 << 20
"""The largest profile cache entry read (1 MiB); a larger one, or one that is not a regular
file (a FIFO, a device), is ignored with a warning, as a malformed one is."""

MAX_MEASURED_LAYER_S = 3600.0
"""The longest forward or backward time a cache entry may give one layer (an hour): a larger
one is an edited or corrupted entry, ignored (with a warning) and measured again; a plan built
on it would state a step no plan file takes (``MAX_PLAN_SECONDS``)."""

_CACHE_SCHEMA_RESOURCE = "measure/profile_cache.schema.json"
"""The JSON Schema of a cache entry, next to this reader (package data of ``cost_models``)."""


def _read_entry(cache_dir: Path, key: str) -> tuple[float, float, int] | None:
    """The cached ``(forward_s, backward_s, repeats)`` of ``key``; None when there is no
    entry, an entry of another schema, or (with a warning) an unreadable, oversized, malformed
    or not regular one (a FIFO is refused without blocking: ``read_text``; a symbolic link is
    not followed: the entry is this cache's own file, never the file a link points at)."""
    path = _entry_path(cache_dir, key)
    if not os.path.lexists(path):
        return None
    origin = f"profile cache entry {str(path)!r}"
    try:
        check_own_entry(path)  # another user's entry in a shared cache is not this run's
    except OutputError as exc:
        logger.warning("ignoring %s: %s", origin, exc)
        return None
    try:
        text = read_text(
            path, origin, PartitionError, max_bytes=MAX_CACHE_ENTRY_BYTES, follow_symlinks=False
        )
        raw = parse_json(text, origin, PartitionError)
        if isinstance(raw, dict) and (raw.get("schema") != CACHE_SCHEMA or raw.get("key") != key):
            return None
        check_schema(raw, "cost_models", _CACHE_SCHEMA_RESOURCE, origin, PartitionError)
    except PartitionError as exc:
        logger.warning("ignoring %s", exc)
        return None
    fwd, bwd = float(raw["forward_time_s"]), float(raw["backward_time_s"])
    if max(fwd, bwd) > MAX_MEASURED_LAYER_S:
        logger.warning(
            "ignoring %s: it gives a layer %s s, more than the %s s any measured layer takes "
            "(an edited or corrupted entry)",
            origin, max(fwd, bwd), MAX_MEASURED_LAYER_S,
        )  # fmt: skip
        return None
    return fwd, bwd, int(raw["repeats"])


def _write_entry(
    cache_dir: Path, key: str, signature: Mapping[str, Any], fwd: float, bwd: float, reps: int
) -> None:
    from partitioner.core.files import write_atomic

    path = _entry_path(cache_dir, key)
    now = os.path.realpath(cache_dir)
    if now != str(cache_dir):
        raise PartitionError(
            f"the cache directory {cache_dir} now leads to {now} (a symbolic link put on it "
            "after the run started, by the model's code or another process), which a cache "
            "entry is never written through"
        )
    if path.parent.is_symlink():
        raise PartitionError(
            f"its directory {path.parent} is a symbolic link (to "
            f"{os.path.realpath(path.parent)}), which a cache entry is never written through"
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    body = {
        "schema": CACHE_SCHEMA,
        "key": key,
        "forward_time_s": fwd,
        "backward_time_s": bwd,
        "repeats": reps,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "signature": signature,
    }
    # The entry itself is replaced (a symbolic link there too), never a link's target: a link
    # in the cache, by mistake or by another user of a shared cache, points at somebody's file.
    text = json.dumps(body, indent=1, sort_keys=True, default=str) + "\n"
    write_atomic(path, text, follow_symlinks=False, private=True)  # no other user edits it


def cache_write_problem(cache_dir: str | os.PathLike[str] | None) -> str | None:
    """Why the profile cache in ``cache_dir`` (default :func:`default_cache_dir`) cannot take
    entries, or None: a caller that profiles several times says it once. A directory not made
    yet is made with the first entry (its nearest existing parent must take files); a path
    through another user's link in a shared directory (:func:`check_links_followed`) takes
    none."""
    from partitioner.core.files import check_links_followed

    try:
        given = cache_dir if cache_dir is not None else default_cache_dir()
    except RuntimeError as exc:  # no home directory to hold the default
        return f"{exc}; set PARTITIONER_CACHE_DIR to cache"
    try:
        check_links_followed(given, "its path")
    except OutputError as exc:
        return str(exc)
    cache = Path(os.path.realpath(given))
    layers = cache / "layers"
    if layers.is_symlink():
        return f"its directory {layers} is a symbolic link, which entries are never written through"
    existing = next((d for d in (layers, *layers.parents) if d.exists()), Path("/"))
    try:  # made with the first entry, not here: a run that fails before then leaves nothing
        if not existing.is_dir():
            return f"{existing} is not a directory"
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        return f"{exc.strerror or exc}"
    return None


def _cache_key(signature: Mapping[str, Any]) -> str:
    text = json.dumps(signature, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------------------------
# TensorFlow side


def default_profile_devices() -> tuple[str, ...]:
    """Every GPU TensorFlow sees, else the first CPU (logical CPU copies share one processor)."""
    import tensorflow as tf

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    if gpus:
        return tuple(gpus)
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    return (cpus[0],) if cpus else ("/device:CPU:0",)


def _cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_kind(device: str) -> str:
    """The kind of a TF device string: the GPU's model name, or the CPU's model and core count."""
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    if (spec.device_type or "CPU").upper() == DeviceKind.GPU.tf_name:
        gpus = tf.config.list_physical_devices("GPU")
        index = spec.device_index or 0
        if 0 <= index < len(gpus):
            details = tf.config.experimental.get_device_details(gpus[index])
            return f"gpu:{details.get('device_name', 'unknown')}:cc{details.get('compute_capability', '')}"
        return f"gpu:{index}"
    threads = tf.config.threading.get_intra_op_parallelism_threads() or os.cpu_count() or 1
    return f"cpu:{_cpu_model_name()}:{os.cpu_count()}cores:{threads}threads"


def _device_id(device: str) -> tuple[str, int]:
    import tensorflow as tf

    spec = tf.DeviceSpec.from_string(device)
    return ((spec.device_type or "CPU").upper(), spec.device_index or 0)


@dataclass
class _Call:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    needs_grad: tuple[bool, ...]
    """Per flattened tensor of (args, kwargs): whether the step differentiates it."""


@contextlib.contextmanager
def _recording(units: Sequence[Any], calls: dict[str, list[_Call]], inputs: Sequence[Any]) -> Iterator[None]:
    """Wrap Layer/Operation ``__call__`` and record each outermost unit call's tensors."""
    import tensorflow as tf
    from keras.src.layers.layer import Layer
    from keras.src.ops.operation import Operation

    unit_by_id = {id(u.operation): u for u in units}
    stack: list[int] = []
    # Tensors (by id, kept alive in ``keep``) that depend on a trainable weight.
    depends: dict[int, bool] = {id(t): False for t in inputs}
    keep: list[Any] = list(inputs)
    originals = {cls: cls.__dict__["__call__"] for cls in (Layer, Operation)}

    def wrap(original: Any) -> Any:
        def recording_call(op_self: Any, *args: Any, **kwargs: Any) -> Any:
            unit = unit_by_id.get(id(op_self))
            if unit is None or stack:
                return original(op_self, *args, **kwargs)
            flat = tf.nest.flatten((args, kwargs))
            needs = tuple(
                bool(tf.is_tensor(t) and t.dtype.is_floating and depends.get(id(t), True))
                for t in flat
            )
            stack.append(id(op_self))
            try:
                out = original(op_self, *args, **kwargs)
            finally:
                stack.pop()
            calls.setdefault(unit.name, []).append(_Call(args, dict(kwargs), needs))
            has_weights = bool(getattr(op_self, "trainable_weights", None))
            dep = has_weights or any(needs)
            for t in tf.nest.flatten(out):
                if tf.is_tensor(t):
                    depends[id(t)] = dep
                    keep.append(t)
            return out

        return recording_call

    for cls, original in originals.items():
        cls.__call__ = wrap(original)
    try:
        yield
    finally:
        for cls, original in originals.items():
            cls.__call__ = original


def _model_inputs(model: Any, batch_size: int, input_shape: InputShape | None, seed: int) -> list[Any]:
    """Random values for each model input (token ids in range of the embeddings that read them)."""
    from cost_models.measure.op_profile import random_inputs
    from passes.trace import input_specs, integer_input_bounds

    specs = input_specs(model, batch_size, input_shape)
    return random_inputs(specs, seed, integer_input_bounds(model))


def _capture_calls(
    model: Any, units: Sequence[Any], batch_size: int, input_shape: InputShape | None, seed: int
) -> dict[str, list[_Call]]:
    from passes.trace import model_input

    inputs = _model_inputs(model, batch_size, input_shape, seed)
    calls: dict[str, list[_Call]] = {}
    try:
        with _recording(units, calls, inputs):
            model(model_input(model, inputs), training=True)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TraceError(
            f"running model {model.name!r} once to find each layer's inputs failed: "
            f"{type(exc).__name__}: {first}"
        ) from exc
    return calls


def _spec_of(value: Any) -> Any:
    import tensorflow as tf

    if tf.is_tensor(value):
        return {"shape": [int(d) if d is not None else -1 for d in value.shape], "dtype": value.dtype.name}
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return type(value).__name__


def _layer_signature(operation: Any, unit_name: str, model_name: str, calls: Sequence[_Call]) -> dict[str, Any]:
    import tensorflow as tf

    try:
        config = dict(operation.get_config())
        config.pop("name", None)
        config_text = json.dumps(config, sort_keys=True, default=str)
    except Exception:  # no usable config: key on the unit itself (no sharing)
        config_text = f"unshared:{model_name}/{unit_name}"
    return {
        "class": f"{type(operation).__module__}.{type(operation).__qualname__}",
        "config": config_text,
        "weights": [[list(map(int, w.shape)), str(w.dtype), bool(w.trainable)] for w in operation.weights]
        if hasattr(operation, "weights")
        else [],
        "calls": [
            {
                "args": tf.nest.map_structure(_spec_of, list(c.args)),
                "kwargs": {k: tf.nest.map_structure(_spec_of, v) for k, v in sorted(c.kwargs.items())},
                "grad": list(c.needs_grad),
            }
            for c in calls
        ],
    }


def _median_time(fn: Callable[[], Any], sync: Callable[[Any], None]) -> float:
    t0 = time.perf_counter()
    sync(fn())
    return time.perf_counter() - t0


def _sync(out: Any) -> None:
    """Wait for ``out``: reading one element forces the (possibly asynchronous) device work to
    finish."""
    import tensorflow as tf

    flat = [t for t in tf.nest.flatten(out) if tf.is_tensor(t)]
    if flat:
        _ = flat[-1].numpy().ravel()[:1]


def _placed_copies(calls: Sequence[_Call]) -> list[tuple[_Call, list[Any]]]:
    """Each call with its flattened inputs, tensors copied onto the enclosing ``tf.device``."""
    import tensorflow as tf

    prepared = []
    for call in calls:
        flat = tf.nest.flatten((call.args, call.kwargs))
        prepared.append((call, [tf.identity(t) if tf.is_tensor(t) else t for t in flat]))
    return prepared


@dataclass(frozen=True)
class _UnitFunctions:
    """The three timed functions of one unit on one device, and their arguments."""

    forward: Callable[[], Any]
    forward_backward: Callable[[], Any]
    empty: Callable[[], Any]


def _unit_functions(
    operation: Any, calls: Sequence[_Call], seed: int
) -> _UnitFunctions:
    """``tf.function``\\ s of every call of the unit (forward; forward and gradients; nothing) on
    copies of the recorded inputs, placed on the enclosing ``tf.device``."""
    import numpy as np
    import tensorflow as tf

    has_training = bool(getattr(operation, "_call_has_training_arg", False))
    prepared = _placed_copies(calls)
    all_flat = [v for _, placed in prepared for v in placed]
    tensor_pos = [i for i, v in enumerate(all_flat) if tf.is_tensor(v)]
    needs = [g for call, _ in prepared for g in call.needs_grad]

    def run_forward(tensors: Sequence[Any]) -> list[Any]:
        flat = list(all_flat)
        for i, t in zip(tensor_pos, tensors):
            flat[i] = t
        outs: list[Any] = []
        pos = 0
        for call, placed in prepared:
            values = flat[pos : pos + len(placed)]
            pos += len(placed)
            args, kwargs = tf.nest.pack_sequence_as((call.args, call.kwargs), values)
            if has_training and "training" not in kwargs:
                kwargs = {**kwargs, "training": True}
            out = operation(*args, **kwargs)
            outs.extend(t for t in tf.nest.flatten(out) if tf.is_tensor(t) and t.dtype.is_floating)
        return outs

    fwd_fn = tf.function(lambda *tensors: run_forward(tensors), autograph=False)
    tensor_args = [all_flat[i] for i in tensor_pos]
    outputs = fwd_fn(*tensor_args)
    if not outputs:
        raise _NotProfilable("no floating-point output")
    rng = np.random.default_rng(seed)
    upstream = [tf.constant(rng.standard_normal(tuple(o.shape)), dtype=o.dtype) for o in outputs]
    watched_idx = [k for k, i in enumerate(tensor_pos) if needs[i]]
    weights = [getattr(w, "value", w) for w in (getattr(operation, "trainable_variables", []) or [])]

    def forward_backward(grads_in: list[Any], *tensors: Any) -> Any:
        watched = [tensors[k] for k in watched_idx]
        with tf.GradientTape(watch_accessed_variables=False) as tape:
            for w in (*watched, *weights):
                tape.watch(w)
            outs = run_forward(tensors)
        grads = tape.gradient(outs, [*watched, *weights], output_gradients=grads_in)
        return [g.values if isinstance(g, tf.IndexedSlices) else g for g in grads if g is not None]

    bwd_fn = tf.function(forward_backward, autograph=False)
    empty_fn = tf.function(
        lambda *tensors: tf.identity(tensors[0]) if tensors else tf.constant(0.0), autograph=False
    )
    return _UnitFunctions(
        forward=lambda: fwd_fn(*tensor_args),
        forward_backward=lambda: bwd_fn(upstream, *tensor_args),
        empty=lambda: empty_fn(*tensor_args),
    )


def _measure_unit(
    operation: Any, calls: Sequence[_Call], device: str, settings: ProfileSettings, seed: int
) -> tuple[float, float, int]:
    """Median forward and backward seconds of all calls of one unit on ``device``."""
    import tensorflow as tf

    with tf.device(device):
        fns = _unit_functions(operation, calls, seed)
    for _ in range(settings.warmup + 1):  # +1: the first call traces
        _sync(fns.empty())
        _sync(fns.forward())
        _sync(fns.forward_backward())
    f_times: list[float] = []
    b_times: list[float] = []
    e_times: list[float] = []
    start = time.perf_counter()
    while len(f_times) < settings.max_repeats:
        e_times.append(_median_time(fns.empty, _sync))
        f_times.append(_median_time(fns.forward, _sync))
        b_times.append(_median_time(fns.forward_backward, _sync))
        if len(f_times) >= settings.min_repeats and time.perf_counter() - start >= settings.min_time_s:
            break
    stat = settings.statistic
    base = stat.of(e_times)
    fwd = max(0.0, stat.of(f_times) - base)
    both = max(0.0, stat.of(b_times) - base)
    return fwd, max(0.0, both - fwd), len(f_times)


class _NotProfilable(Exception):
    pass


@dataclass(frozen=True)
class _Run:
    """What every layer-device measurement of one :func:`profile_model` call shares."""

    model_name: str
    batch_size: int
    settings: ProfileSettings
    cache: Path
    use_cache: bool
    seed: int
    tf_version: str
    write_cache: bool = True
    writes: ProfileWrites | None = None
    """Where new entries wait for the run to succeed; None: written as measured."""


@dataclass
class ProfileWrites:
    """The profile cache entries a planning run measured, written by :meth:`flush` once the
    run succeeded (its outputs written): a run that fails or is interrupted leaves no new
    cache file, as the trace cache's runs leave none."""

    entries: list[tuple[Path, str, dict[str, Any], float, float, int]] = field(
        default_factory=list
    )

    def flush(self) -> None:
        """Write the entries; a cache that cannot take them costs one warning."""
        try:
            for cache, key, signature, fwd, bwd, reps in self.entries:
                _write_entry(cache, key, signature, fwd, bwd, reps)
        except (OSError, PartitionError) as exc:
            logger.warning(
                "profile cache not written (%s); this run's measurements are not cached", exc
            )
        self.entries.clear()


@dataclass
class _Tally:
    """The measurements so far (an accumulator private to :func:`profile_model`)."""

    timings: list[LayerTiming] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    measured_count: int = 0
    cached_count: int = 0
    memo: dict[str, tuple[float, float, int]] = field(default_factory=dict)
    signatures: dict[str, dict[str, Any]] = field(default_factory=dict)
    cache_unwritable: bool = False
    """A write to the cache failed once (a warning said why): the rest of the run does not
    try again, so a cache that cannot be written is one warning, not one per layer."""

    def skip(self, unit: str) -> None:
        if unit not in self.skipped:
            self.skipped.append(unit)


def _device_kinds(devices: Sequence[str]) -> tuple[str, ...]:
    """The kind of each device (:func:`device_kind`); PartitionError for one not present."""
    import tensorflow as tf

    present = tf.config.list_logical_devices()
    known = {_device_id(d.name) for d in present}
    for d in devices:
        if _device_id(d) not in known:
            names = ", ".join(sorted(x.name for x in present))
            raise PartitionError(f"device {d!r} is not present; present: {names}")
    return tuple(device_kind(d) for d in devices)


def _signature(run: _Run, tally: _Tally, unit: Any, calls: Sequence[_Call], kind: str) -> dict[str, Any]:
    """The cache signature of ``unit`` on a device of ``kind`` (the layer's part memoised)."""
    if unit.name not in tally.signatures:
        tally.signatures[unit.name] = _layer_signature(unit.operation, unit.name, run.model_name, calls)
    return {
        "schema": CACHE_SCHEMA,
        "layer": tally.signatures[unit.name],
        "device": kind,
        "tf": run.tf_version,
        "batch_size": run.batch_size,
        "statistic": run.settings.statistic.value,
    }


def _measure_and_store(
    run: _Run, tally: _Tally, unit: Any, calls: Sequence[_Call], dev: str, signature: dict[str, Any]
) -> None:
    """Measure ``unit`` on ``dev``, record it, and write it to the cache (a failure to
    measure leaves the layer estimated)."""
    import tensorflow as tf

    key = _cache_key(signature)
    try:
        fwd, bwd, reps = _measure_unit(unit.operation, calls, dev, run.settings, run.seed)
    except _NotProfilable as exc:
        logger.info("layer %r not profiled: %s", unit.name, exc)
        tally.skip(unit.name)
        return
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        logger.warning("layer %r could not be profiled on %s (%s); it stays estimated", unit.name, dev, exc)
        tally.skip(unit.name)
        return
    tally.measured_count += 1
    tally.memo[key] = (fwd, bwd, reps)
    tally.timings.append(LayerTiming(unit.name, dev, fwd, bwd, reps, cached=False))
    if run.use_cache and run.write_cache and run.writes is not None:
        run.writes.entries.append((run.cache, key, signature, fwd, bwd, reps))
    elif run.use_cache and run.write_cache and not tally.cache_unwritable:
        try:
            _write_entry(run.cache, key, signature, fwd, bwd, reps)
        except (OSError, PartitionError) as exc:
            tally.cache_unwritable = True
            logger.warning(
                "profile cache %s not written (%s); this run's measurements are not cached",
                run.cache,
                exc,
            )


def _cached(run: _Run, tally: _Tally, unit: Any, dev: str, signature: dict[str, Any]) -> bool:
    """Record ``unit`` on ``dev`` from this run's memo or the cache; False when neither has it."""
    key = _cache_key(signature)
    hit = tally.memo.get(key)
    if hit is None and run.use_cache:
        hit = _read_entry(run.cache, key)
    if hit is None:
        return False
    fwd, bwd, reps = hit
    tally.cached_count += 1
    tally.timings.append(LayerTiming(unit.name, dev, fwd, bwd, reps, cached=True))
    tally.memo[key] = hit
    return True


def _profile_units(
    run: _Run,
    units: Sequence[Any],
    calls: Mapping[str, Sequence[_Call]],
    devices: Sequence[tuple[str, str]],
    progress: ProgressCallback | None,
) -> _Tally:
    """Every unit on every ``(device, kind)``: from the cache where it has the entry, else
    measured (and stored)."""
    tasks = [(u, d, k) for u in units for d, k in devices]
    tally = _Tally()
    for done, (unit, dev, kind) in enumerate(tasks):
        unit_calls = calls.get(unit.name)
        if not unit_calls:
            tally.skip(unit.name)
            continue
        signature = _signature(run, tally, unit, unit_calls, kind)
        if _cached(run, tally, unit, dev, signature):
            continue
        if progress is not None:
            progress(done, len(tasks), f"{unit.name} on {dev}")
        _measure_and_store(run, tally, unit, unit_calls, dev, signature)
    if progress is not None:
        progress(len(tasks), len(tasks), "done")
    return tally


def _resolved_cache(cache_dir: str | os.PathLike[str] | None) -> Path | None:
    """The cache directory, resolved now: entries go where the cache was when the run started
    (see :func:`_write_entry`); None without a home directory to hold the default (measured,
    not cached)."""
    try:
        return Path(os.path.realpath(cache_dir if cache_dir is not None else default_cache_dir()))
    except RuntimeError:
        return None


def profile_model(
    model: Any,
    *,
    batch_size: int,
    devices: Sequence[str] | None = None,
    input_shape: InputShape | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    settings: ProfileSettings | None = None,
    progress: ProgressCallback | None = None,
    seed: int = 0,
    write_cache: bool = True,
    writes: ProfileWrites | None = None,
) -> ProfileResult:
    """Measure every placement unit's forward and backward time on each of ``devices``.

    ``devices`` are TF device strings (default :func:`default_profile_devices`). Units are those
    of :func:`passes.trace.placement_units`, so the names match the traced graph's layers.
    Results come from the cache when an entry with the same key exists (``use_cache``); new
    measurements are written to it unless ``write_cache`` is False (a caller that found the
    cache unwritable, :func:`cache_write_problem`), in ``writes`` (:class:`ProfileWrites`)
    until the caller's run succeeds when given. ``progress(done, total, label)`` is called before each
    measurement and once at the end with ``done == total``.
    """
    import tensorflow as tf

    from passes.trace import placement_units

    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PartitionError(f"batch_size={batch_size!r} must be an integer >= 1")
    devs = tuple(devices) if devices else default_profile_devices()
    kinds = _device_kinds(devs)
    cache = _resolved_cache(cache_dir)
    use_cache = use_cache and cache is not None
    run = _Run(
        model.name, batch_size, ProfileSettings() if settings is None else settings,
        cache or Path(os.devnull), use_cache, seed, tf.__version__, write_cache, writes,
    )  # fmt: skip
    start = time.perf_counter()
    units = placement_units(model)
    calls = _capture_calls(model, units, batch_size, input_shape, seed)
    tally = _profile_units(run, units, calls, tuple(zip(devs, kinds)), progress)
    elapsed = time.perf_counter() - start
    logger.debug(
        "profiled %s: %d measured, %d cached, %d skipped in %.2fs",
        model.name, tally.measured_count, tally.cached_count, len(tally.skipped), elapsed,
    )
    return ProfileResult(
        model=model.name,
        batch_size=batch_size,
        devices=devs,
        device_kinds=kinds,
        timings=tuple(tally.timings),
        skipped=tuple(tally.skipped),
        measured_count=tally.measured_count,
        cached_count=tally.cached_count,
        cache_dir=str(cache) if use_cache else None,
        profile_time_s=elapsed,
        tf_version=tf.__version__,
    )


def time_model_step(
    model: Any,
    *,
    batch_size: int,
    device: str | None = None,
    input_shape: InputShape | None = None,
    settings: ProfileSettings | None = None,
    seed: int = 0,
) -> float:
    """Median seconds of the whole model's gradient computation (forward + backward, no update).

    The step is the one :func:`passes.trace.trace_model` traces: the model called with
    ``training=True``, the mean of squares of its outputs as the loss, ``tf.gradients`` with
    respect to the trainable weights. The fixed cost of calling a ``tf.function`` is subtracted.
    """
    import tensorflow as tf

    from passes.trace import model_input

    cfg = ProfileSettings() if settings is None else settings
    dev = device or default_profile_devices()[0]
    inputs = _model_inputs(model, batch_size, input_shape, seed)

    def step(*xs: Any) -> Any:
        outs = model(model_input(model, xs), training=True)
        terms = [
            tf.reduce_mean(tf.square(tf.cast(t, tf.float32)))
            for t in tf.nest.flatten(outs)
            if tf.is_tensor(t) and t.dtype.is_floating
        ]
        loss = tf.add_n(terms)
        grads = tf.gradients(loss, [v.value for v in model.trainable_variables])
        return [g for g in grads if g is not None]

    with tf.device(dev):
        placed = [tf.identity(x) for x in inputs]
        step_fn = tf.function(step, autograph=False)
        empty_fn = tf.function(lambda *xs: tf.identity(xs[0]), autograph=False)

    for _ in range(cfg.warmup + 1):
        _sync(step_fn(*placed))
        _sync(empty_fn(*placed))
    s_times: list[float] = []
    e_times: list[float] = []
    start = time.perf_counter()
    while len(s_times) < cfg.max_repeats:
        e_times.append(_median_time(lambda: empty_fn(*placed), _sync))
        s_times.append(_median_time(lambda: step_fn(*placed), _sync))
        if len(s_times) >= cfg.min_repeats and time.perf_counter() - start >= cfg.min_time_s:
            break
    return max(0.0, cfg.statistic.of(s_times) - cfg.statistic.of(e_times))
