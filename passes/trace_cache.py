"""A cache on disk of traced training steps: the second plan of a model traces nothing.

Tracing a large model's step (:func:`passes.trace.trace_model`) takes seconds per batch size, and
a user plans the same model again and again: another ``--gpus``, topology, solver or strategy.
Each trace is stored after a plan succeeds and read instead of tracing the next time.

The key
-------
The SHA-256 of everything the traced graph depends on (:func:`trace_key`): the model's class and
configuration, every placement unit's path, class and configuration, every weight's path, shape,
dtype and trainability, the input specs the step is traced at (names, shapes, dtypes: the batch
size is their first dimension), whether the model was built without weights, TensorFlow's TF32
setting, Keras's float type and dtype policy, the versions of Python, TensorFlow and Keras, this
project's tracing code, and the bytes of every source file that defines a class of the model or
its layers outside TensorFlow and Keras, and of every module loaded from outside the Python
installation (the model's file and its local imports, from a zip archive or a ``.pyc`` too),
the environment variables (but the few a shell changes between runs: ``_VOLATILE_ENVIRONMENT``)
and, under the ``partition`` command, which records them, the content of every data file the
model's code read while it was loaded: editing the model's code, its settings file or an
environment variable it reads is a miss, even where its configuration does not change (a
subclassed layer's ``call``). A configuration
that is not JSON (an object without ``get_config``) is keyed by its ``repr``, whose address
changes every run: such a model is never served from the cache, it is traced.

What no key can see (a file read through TensorFlow's own file layer, by a subprocess or by
SQLite, a directory listing) is caught by the entry's **forward signature**: the ops the
model's forward pass makes at the batch on symbolic inputs (:func:`passes.trace.forward_signature`,
a fifth of a trace's time), recorded when it was traced and compared before it is served. A
model whose structure changed is traced again; one that cannot be called so is never cached.
The signature is taken at a batch left unknown, so one symbolic call a run checks the entries
of every batch it reads (a model that fixes its batch: at each batch).

The entries
-----------
One JSON file per key in ``<cache dir>/traces/`` (beside the profile cache's ``layers/``; the
cache directory is :func:`cost_models.measure.profiled.default_cache_dir`). Entries are written
only after the plan they served succeeded (a failed run leaves no new file), atomically (a
temporary file and a rename: a concurrent writer or a kill mid-write never leaves a partial
entry), and never through a symbolic link. An entry is read with the product's bounded,
non-blocking reader, its key checked, and decoded into a validated :class:`~partitioner.core.ir.Graph`;
anything else (a FIFO, a link, a truncated file, another user's entry or one reached through
another user's link, a count past :data:`MAX_ENTRY_VALUE`) is a miss with a warning. The
directory is bounded: after a write, the least recently used entries (a read touches its entry)
are removed until the rest fit in :data:`MAX_TRACE_CACHE_BYTES`; only files named as this
cache names them are ever removed. A cache that cannot take entries (a full
disk, a directory that is a file) costs a warning, never the plan.

A cached trace has no ``step_function`` (nothing to run): a run that measures (``profile``,
``profile_ops``) traces for real.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import keras
import tensorflow as tf

from partitioner.core.errors import PartitionError
from partitioner.core.files import (
    check_own_entry,
    open_regular,
    read_regular_text,
    system_dirs,
    write_atomic,
)
from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase, SparseGradient
from partitioner.core.jsonfiles import loads_bounded
from passes import blocks, trace, weightless

__all__ = [
    "MAX_TRACE_CACHE_BYTES",
    "MAX_TRACE_ENTRY_BYTES",
    "MIN_CACHED_TRACE_S",
    "TRACE_CACHE_SCHEMA",
    "TraceCache",
    "decode_graph",
    "encode_graph",
    "static_signature",
    "trace_key",
]

logger = logging.getLogger(__name__)

TRACE_CACHE_SCHEMA = 3
"""The version of an entry's layout; an entry of another is a miss."""

MAX_TRACE_ENTRY_BYTES = 64 << 20
"""The largest entry read or written (64 MiB; a ResNet-50 step takes 1 MiB); a larger trace is
not stored."""

MAX_TRACE_CACHE_BYTES = 1 << 30
"""What the entries may take together (1 GiB); the least recently used go first."""

_STALE_TEMPORARY_S = 3600.0
"""A writer's temporary file older than this (an hour) was left by a killed run: removed."""

_ENTRY = re.compile(r"[0-9a-f]{64}\.json")
_TEMPORARY = re.compile(r"\.[0-9a-f]{64}\.json\.[^/]*\.tmp")
"""The names of this cache's entries and of their writers' temporary files
(:func:`~partitioner.core.files.write_atomic`): the only files eviction removes."""

_TRACING_CODE = (trace, blocks, weightless)
"""This project's modules whose code decides the traced graph: their source is in the key."""


MAX_HASHED_BYTES = 64 << 20
"""The largest file whose content the key hashes (64 MiB); a larger one (a dataset the model
read a header of) is keyed by its size, modification time and inode, as ``make`` keys files."""


def _file_digest(path: str, seen: dict[str, str]) -> str:
    """The SHA-256 of the regular file ``path``, or of the archive it is inside (a module
    imported from a zip file on ``sys.path``: ``lib.zip/helper.py``); of its size, time and
    inode past :data:`MAX_HASHED_BYTES`. Anything else (a FIFO, a device, unreadable) is never
    the same key twice: opened without blocking, never read."""
    if path not in seen:
        try:
            seen[path] = _digest_of(_archive_of(path))
        except OSError:
            seen[path] = f"unreadable {time.time_ns()}"
    return seen[path]


def _digest_of(path: str) -> str:
    try:
        fd = open_regular(path)  # a FIFO or a device is refused, never blocked on
    except PartitionError as exc:
        raise OSError(str(exc)) from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if st.st_size > MAX_HASHED_BYTES:
            return f"{st.st_size} {st.st_mtime_ns} {st.st_dev} {st.st_ino}"
        digest = hashlib.sha256()
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
        return digest.hexdigest()


def _archive_of(path: str) -> str:
    """``path``, or the nearest of its parents that is a regular file (its zip archive)."""
    here = Path(path)
    for candidate in (here, *here.parents):
        if candidate.is_file():
            return str(candidate)
    return path


def _local_sources() -> list[str]:
    """The source files of the modules loaded from outside the Python installation (the model's
    file and its own imports), but for this project's own packages (their tracing code is
    :data:`_TRACING_CODE`; which of the rest a run imported depends on its flags) and
    AutoGraph's generated modules (new each run)."""
    skipped = tuple(f"{d}{os.sep}" for d in system_dirs())
    files = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)  # a .py, a .pyc without source, a zip member
        if isinstance(path, str) and "autograph_generated" not in name:
            real = os.path.realpath(path)
            if not real.startswith(skipped):
                files.append(real)
    return sorted(set(files))


def _class_sources(objects: Iterable[Any]) -> list[str]:
    """The files defining the classes (and their bases) of ``objects`` that are not Keras's or
    TensorFlow's own: a custom layer's ``call`` is in the key even when installed."""
    own = tuple(os.path.dirname(m.__file__ or "") + os.sep for m in (keras, tf))
    files = set()
    for obj in objects:
        for cls in type(obj).__mro__:
            path = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if isinstance(path, str) and not os.path.realpath(path).startswith(own):
                files.add(os.path.realpath(path))
    return sorted(files)


def _config(obj: Any) -> Any:
    try:
        return obj.get_config()
    except Exception:  # no configuration: the repr stands for it
        return repr(obj)


_VOLATILE_ENVIRONMENT = frozenset(
    {"_", "OLDPWD", "PWD", "SHLVL", "COLUMNS", "LINES", "PARTITIONER_CACHE_DIR"}
)
"""Environment variables a shell changes between two runs of one command, which no model
reads; every other variable is in the key (a model may read one to choose its shapes)."""


def _environment() -> list[tuple[str, str]]:
    return sorted((k, v) for k, v in os.environ.items() if k not in _VOLATILE_ENVIRONMENT)


def trace_key(
    model: Any,
    batch_size: int,
    input_shape: Any,
    files: Iterable[str] = (),
    static: Callable[[], str] | None = None,
) -> str:
    """The key of ``model``'s step traced at ``batch_size`` (with ``input_shape``): see the
    module docstring for what it covers; ``files``: data files the model's code read (their
    content joins the key). ``static``: what gives :func:`static_signature` of the built model
    (a run's cache computes it once for every batch it reads)."""
    specs = trace.input_specs(model, batch_size, input_shape)
    trace.build_sublayers(model, specs, given=input_shape)  # as a trace builds it
    signature = {
        "static": static() if static is not None else static_signature(model, files),
        "specs": [[s.name, s.shape.as_list(), s.dtype.name] for s in specs],
        "batch_size": batch_size,
    }
    text = json.dumps(signature, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def static_signature(model: Any, files: Iterable[str] = ()) -> str:
    """The part of :func:`trace_key` no batch changes, as JSON text: the built ``model``'s and
    its units' classes and configurations, its weights, the settings, versions, environment and
    sources the module docstring lists."""
    units = trace.placement_units(model)
    seen: dict[str, str] = {}
    sources = [*_local_sources(), *_class_sources([model, *(u.operation for u in units)])]
    sources += [os.path.realpath(m.__file__ or "") for m in _TRACING_CODE]
    sources += [os.path.realpath(f) for f in files]
    signature = {
        "schema": TRACE_CACHE_SCHEMA,
        "model": [type(model).__qualname__, _config(model)],
        "units": [[u.name, list(u.path), type(u.operation).__qualname__, _config(u.operation)]
                  for u in units],
        "weights": [[v.path, list(v.shape), str(v.dtype), bool(v.trainable)] for v in model.weights],
        "weightless": weightless.is_weightless(model),
        "tf32": bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        "keras": [keras.__version__, keras.config.floatx(), keras.config.dtype_policy().name],
        "versions": [sys.version, tf.__version__],
        "environment": _environment(),
        "sources": {path: _file_digest(path, seen) for path in sorted(set(sources))},
    }  # fmt: skip
    return json.dumps(signature, sort_keys=True, default=repr, separators=(",", ":"))


def encode_graph(graph: Graph) -> dict[str, Any]:
    """``graph`` as JSON values: ops and edges as rows, layers and ops referred to by index."""
    layer_at = {info.name: i for i, info in enumerate(graph.layers)}
    op_at = graph.op_index
    return {
        "name": graph.name,
        "batch_size": graph.batch_size,
        "target_bytes": graph.target_bytes,
        "layers": [
            [x.name, x.class_name, x.num_params, x.trainable_params, x.param_bytes,
             x.trainable_param_bytes, x.trainable_tensors,
             [[g.variable, g.rows_per_step, g.row_bytes, g.index_bytes, g.dense_bytes]
              for g in x.sparse_gradients]]
            for x in graph.layers
        ],
        "ops": [
            [op.id, op.op_type, -1 if op.layer is None else layer_at[op.layer], op.phase.value,
             [list(s) for s in op.output_shapes], list(op.output_dtypes), op.output_bytes,
             op.flops, op.transposed_bytes]
            for op in graph.ops
        ],
        "edges": [[op_at[e.src], op_at[e.dst], e.bytes, e.output_index] for e in graph.edges],
    }  # fmt: skip


MAX_ENTRY_VALUE = 1 << 62
"""The largest count an entry may give (FLOPs, bytes, a dimension): no traced step comes near
it (a 70 B model's step is ~10**18 FLOPs); a larger one is an edited or corrupted entry."""


def _int(value: Any) -> int:
    if type(value) is not int or not -1 <= value <= MAX_ENTRY_VALUE:
        raise ValueError(f"expected an integer in -1..2**62, found {str(value)[:40]}")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, found {value!r}")
    return value


def _layer(row: Sequence[Any]) -> LayerInfo:
    name, cls, params, trainable, pbytes, tbytes, tensors, sparse = row
    gradients = tuple(
        SparseGradient(_str(v), _int(r), _int(rb), _int(ib), _int(db))
        for v, r, rb, ib, db in sparse
    )
    return LayerInfo(
        _str(name), _str(cls), _int(params), _int(trainable), _int(pbytes), _int(tbytes),
        gradients, _int(tensors),
    )  # fmt: skip


def _op(row: Sequence[Any], layers: Sequence[LayerInfo]) -> Op:
    op_id, op_type, layer, phase, shapes, dtypes, out_bytes, flops, transposed = row
    index = _int(layer)
    return Op(
        id=_str(op_id),
        op_type=_str(op_type),
        layer=None if index == -1 else layers[index].name,
        phase=Phase(phase),
        output_shapes=tuple(tuple(_int(d) for d in s) for s in shapes),
        output_dtypes=tuple(_str(d) for d in dtypes),
        output_bytes=_int(out_bytes),
        flops=_int(flops),
        transposed_bytes=_int(transposed),
    )


def decode_graph(raw: Mapping[str, Any]) -> Graph:
    """The :class:`Graph` :func:`encode_graph` wrote; ``ValueError`` (or
    :class:`~partitioner.core.errors.InvalidGraphError`) for anything else."""
    try:
        layers = tuple(_layer(row) for row in raw["layers"])
        ops = tuple(_op(row, layers) for row in raw["ops"])
        edges = tuple(
            Edge(ops[_int(s)].id, ops[_int(d)].id, _int(b), _int(i)) for s, d, b, i in raw["edges"]
        )
        return Graph(
            _str(raw["name"]), ops, edges, layers,
            batch_size=_int(raw["batch_size"]), target_bytes=_int(raw["target_bytes"]),
        )  # fmt: skip
    except (KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"{type(exc).__name__}: {exc}") from None


@dataclass
class TraceCache:
    """The trace cache of one planning run in ``directory`` (its ``traces/``): :meth:`trace`
    reads an entry or traces; :meth:`flush` stores the new traces once the run succeeded."""

    directory: Path
    files: tuple[str, ...] = ()
    """Data files the model's code read (the command records them): their content joins the
    key, so a model built from a changed ``settings.json`` is traced again."""
    pending: dict[str, tuple[trace.TraceResult, str]] = field(default_factory=dict)
    """The traces this run made, each with its forward signature, for :meth:`flush`."""
    hits: int = 0
    _static: dict[int, tuple[Any, str]] = field(default_factory=dict, repr=False)
    """Per model (held, so its id stays its own): :func:`static_signature`, once a run."""
    _forwards: dict[tuple[int, int | None], tuple[Any, str | None]] = field(
        default_factory=dict, repr=False
    )
    """Per model and batch (None: any): its forward signature, once a run."""

    @property
    def entries(self) -> Path:
        return self.directory / "traces"

    def trace(self, model: Any, batch_size: int, input_shape: Any) -> trace.TraceResult:
        """The step of ``model`` at ``batch_size`` from the cache, else traced
        (:func:`passes.trace.trace_model`) and kept for :meth:`flush`."""
        with trace.KERAS_CALL_LOCK:  # the key reads the model as a trace does
            key = trace_key(
                model, batch_size, input_shape, self.files, lambda: self._static_of(model)
            )
            t0 = time.perf_counter()
            graph = self._read(key, lambda: self.forward_signature(model, batch_size, input_shape))
            if graph is not None and [x.name for x in graph.layers] == [
                u.name for u in trace.placement_units(model)
            ]:
                self.hits += 1
                return _cached_result(model, graph, time.perf_counter() - t0)
        traced = trace.trace_model(model, batch_size=batch_size, input_shape=input_shape)
        if traced.trace_time_s + traced.flops_time_s >= MIN_CACHED_TRACE_S:
            forward = self.forward_signature(model, batch_size, input_shape)
            if forward is not None:  # a model that cannot be checked so is never served
                self.pending[key] = (traced, forward)
        return traced

    def _static_of(self, model: Any) -> str:
        held = self._static.get(id(model))
        if held is None or held[0] is not model:
            held = self._static[id(model)] = (model, static_signature(model, self.files))
        return held[1]

    def forward_signature(self, model: Any, batch_size: int, input_shape: Any) -> str | None:
        """The forward signature an entry of ``model`` at ``batch_size`` is checked against:
        the one at any batch (``any <sha>``: one symbolic call serves every batch a run reads),
        else, for a model that fixes its batch, the one at ``batch_size`` (``at <b> <sha>``)."""
        whole = self._forward_at(model, None, input_shape)
        if whole is not None:
            return f"any {whole}"
        at = self._forward_at(model, batch_size, input_shape)
        return None if at is None else f"at {batch_size} {at}"

    def _forward_at(self, model: Any, batch_size: int | None, input_shape: Any) -> str | None:
        held = self._forwards.get((id(model), batch_size))
        if held is None or held[0] is not model:
            signature = trace.forward_signature(
                model, batch_size=batch_size, input_shape=input_shape
            )
            held = self._forwards[(id(model), batch_size)] = (model, signature)
        return held[1]

    def _read(self, key: str, signature: Callable[[], str | None]) -> Graph | None:
        """The entry of ``key``, if the model's forward pass now makes the ops it made when it
        was traced (``signature()``: :func:`passes.trace.forward_signature`, computed only
        when there is an entry; None: never served)."""
        path = self.entries / f"{key}.json"
        if not os.path.lexists(path):
            return None
        forward = signature()
        if forward is None:
            return None
        try:
            check_own_entry(path)
            text = read_regular_text(path, MAX_TRACE_ENTRY_BYTES, follow_symlinks=False)
            raw = loads_bounded(text, f"entry {path}", PartitionError, "it is traced again")
            if raw.get("schema") != TRACE_CACHE_SCHEMA or raw.get("key") != key:
                return None
            if raw.get("forward") != forward:  # changed by what the key cannot see
                logger.info("the model's forward pass changed since %s was traced", path)
                return None
            graph = decode_graph(raw["graph"])
        except (PartitionError, ValueError, AttributeError, KeyError) as exc:
            logger.warning("ignoring the trace cache entry %s: %s", path, exc)
            return None
        with contextlib.suppress(OSError):  # the least recently used go first (_evict)
            os.utime(path, follow_symlinks=False)
        return graph

    def flush(self) -> None:
        """Store the traces this run made; a cache that cannot take them costs a warning."""
        if not self.pending:
            return
        try:
            self._check_directory()
            self.entries.mkdir(mode=0o700, parents=True, exist_ok=True)
            for key, (traced, forward) in self.pending.items():
                self._write(key, traced.graph, forward)
            self._evict()
        except (OSError, PartitionError) as exc:
            logger.warning("traces not cached in %s: %s", self.entries, _reason(exc))
        self.pending.clear()

    def _check_directory(self) -> None:
        now = os.path.realpath(self.directory)
        if now != str(self.directory):
            raise PartitionError(
                f"the cache directory now leads to {now} (a symbolic link put on it after the "
                "run started), which entries are never written through"
            )
        if self.entries.is_symlink():
            raise PartitionError("it is a symbolic link, which entries are never written through")

    def _write(self, key: str, graph: Graph, forward: str) -> None:
        body = {
            "schema": TRACE_CACHE_SCHEMA,
            "key": key,
            "forward": forward,
            "graph": encode_graph(graph),
        }
        text = json.dumps(body, separators=(",", ":"))
        if len(text) > MAX_TRACE_ENTRY_BYTES:
            logger.debug("trace of %s not cached: %d bytes", graph.name, len(text))
            return
        write_atomic(self.entries / f"{key}.json", text, follow_symlinks=False, private=True)

    def _evict(self) -> None:
        """Remove the least recently used entries past :data:`MAX_TRACE_CACHE_BYTES`, and the
        temporary files of writers killed more than an hour ago."""
        now, entries = time.time(), []
        for path in self.entries.iterdir():
            st = path.lstat()
            if not stat.S_ISREG(st.st_mode):
                continue  # never this cache's: left alone
            if _TEMPORARY.fullmatch(path.name) and now - st.st_mtime > _STALE_TEMPORARY_S:
                path.unlink(missing_ok=True)
            elif _ENTRY.fullmatch(path.name):
                entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= MAX_TRACE_CACHE_BYTES:
                break
            path.unlink(missing_ok=True)
            total -= size


MIN_CACHED_TRACE_S = 1.0
"""The shortest trace stored (1 s): reading an entry and checking the model's forward pass
takes a good part of a second, more than a cheap trace (a decoder traced two blocks deep)."""


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError):
        return str(exc.strerror or exc)
    return str(exc)


def _cached_result(model: Any, graph: Graph, load_time_s: float) -> trace.TraceResult:
    return trace.TraceResult(
        graph=graph,
        units=trace.placement_units(model),
        trace_time_s=load_time_s,
        flops_time_s=0.0,
        step_function=None,
        weightless=weightless.is_weightless(model),
        tf32_enabled=bool(tf.config.experimental.tensor_float_32_execution_enabled()),
        input_bounds=trace.integer_input_bounds(model),
    )
