"""``partition PATH[:ATTR] --gpus N``: trace, cost, place and report a Keras model.

Every error a user can cause is printed as one line on stderr with a non-zero exit; nothing is
written unless the whole plan is. TensorFlow's start-up noise is kept off the terminal unless
``--verbose``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import logging
import math
import os
import re
import shlex
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn, TextIO, cast

from rich.console import Console

from partitioner.cli.early import INTERRUPTED_EARLY
from partitioner.cli.early import interrupt_exits as _interrupt_exits
from partitioner.cli.early import set_sigint as _set_sigint
from partitioner.cli.exits import hard_exits_refused, run_exit_handlers
from partitioner.cli.loader import exit_call
from partitioner.cli.parsing import OneLineParser
from partitioner.cli.quiet import kept_copy
from partitioner.cli.stdlib import modules_kept, standard_library_kept
from partitioner.core.errors import (
    CatalogError,
    ModelLoadError,
    OutputError,
    PartitionError,
    UsageError,
    escape_control,
)
from partitioner.core.files import (
    check_links_followed,
    check_not_hiding_a_module,
    check_output_path,
    check_replaceable,
    default_caches,
    directory_name,
    marked,
    read_input_text,
    same_file,
    write_all_atomic,
)
from partitioner.core.ir import Schedule
from partitioner.core.jsonfiles import check_data_bounds, loads_bounded
from partitioner.core.options import (
    AUTO_STRATEGY,
    MAX_BATCH_SIZE,
    MAX_DEVICES,
    MAX_MICROBATCHES,
    MAX_SAMPLE_VALUES,
    MAX_TIME_LIMIT_S,
    InputShape,
    MeasureOptions,
    SearchOptions,
    TargetOptions,
    parse_memory_limit,
)
from partitioner.core.strategy import Family
from passes.backend import keras_config_file

if TYPE_CHECKING:
    from partitioner.api import Prepared
    from partitioner.plan.model import Plan

__all__ = ["FLAGS", "LIMITS", "build_parser", "cli_message", "main"]

logger = logging.getLogger(__name__)

_REAL_SIGNAL = signal.signal
"""``signal.signal`` itself, which :func:`_sigint_kept` replaces while the model's code runs."""

PROG = "partition"

LIMITS: Mapping[str, float] = MappingProxyType(
    {
        "--gpus": MAX_DEVICES,
        "--batch-size": MAX_BATCH_SIZE,
        "--microbatches": MAX_MICROBATCHES,
        "--time-limit": MAX_TIME_LIMIT_S,
    }
)
"""Each count on the command line -> the most it may be; checked before any work."""

FLAGS: Mapping[str, str] = MappingProxyType(
    {
        # what to plan for (TargetOptions)
        "gpus": "--gpus {}",
        "device_type": "--device-type {}",
        "topology": "--topology {}",
        "batch_size": "--batch-size {}",
        "input_shape": "--input-shape {}",
        "optimizer": "--optimizer {}",
        "memory_limit": "--memory-limit {}",
        "memory_limit_bytes": "--memory-limit {}",
        "precision": "--precision {}",
        # how to search (SearchOptions)
        "solver": "--solver {}",
        "seed": "--seed {}",
        "time_limit_s": "--time-limit {}",
        "pipeline": "--pipeline",
        "num_microbatches": "--microbatches {}",
        "schedule": "--schedule {}",
        "compare_strategies": "--strategies",
        "strategy": "--strategy {}",
        # how to measure (MeasureOptions)
        "profile": "--profile",
        "profile_ops": "--profile-ops",
        "cache_dir": "PARTITIONER_CACHE_DIR={}",
        "trace_cache": "--trace-cache",
    }
)
"""The library's argument names (as its error messages spell them, ``batch_size=32``) -> the
command line's spelling: a flag taking the value at ``{}``, or a switch (no ``{}``)."""


def _argument_pattern(flags: Mapping[str, str]) -> re.Pattern[str]:
    """``name=value`` of one of ``flags``' names in a message; the value quoted, bracketed or
    bare."""
    return re.compile(
        r"(?<![\w.-])(?P<name>"
        + "|".join(sorted(map(re.escape, flags), key=len, reverse=True))
        + r")=(?P<value>'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"|\([^()]*\)|\[[^\[\]]*\]|\{[^{}]*\}"
        r"|[^\s,;()\[\]'\"]*[^\s,;()\[\]'\".:])?"
    )


_ARGUMENT = _argument_pattern(FLAGS)
"""``name=value`` of an API argument in a message; the value quoted, bracketed or bare."""


def cli_message(
    message: str, quoted: Sequence[str] = (), more_flags: Mapping[str, str] | None = None
) -> str:
    """``message`` (a library error) with every API argument spelled as the command line
    spells it: ``batch_size=32`` -> ``--batch-size 32``, ``pipeline=True`` -> ``--pipeline``,
    ``device_type='cpu'`` -> ``--device-type cpu`` (see :data:`FLAGS`, and ``more_flags`` of a
    subcommand, e.g. ``rounds=`` -> ``--rounds``); not inside the ``quoted`` parts (the user's
    own code's words: Keras's ``input_shape=(10,)`` stays)."""
    flags = FLAGS if not more_flags else {**FLAGS, **more_flags}
    pattern = _ARGUMENT if not more_flags else _argument_pattern(flags)

    def spelled(text: str) -> str:
        return pattern.sub(lambda m: _as_flag(m, flags), text)

    kept = [q for q in quoted if q and q in message]
    if not kept:
        return spelled(message)
    parts = re.split("(" + "|".join(map(re.escape, kept)) + ")", message)
    return "".join(p if k % 2 else spelled(p) for k, p in enumerate(parts))


def _as_flag(match: re.Match[str], flags: Mapping[str, str]) -> str:
    """One ``name=value`` match as its flag."""
    template = flags[match["name"]]
    raw = match["value"]
    if "{}" not in template:  # a switch
        return f"no {template}" if raw == "False" else template
    if raw is not None and raw.startswith("{"):
        return _per_name_flags(template, raw)
    value = _flag_value(raw)
    if value is None:
        return template.replace(" {}", "").replace("{}", "")
    if match["name"] == "strategy":  # the command line's own spelling: data-parallel
        value = value.replace("_", "-")
    return template.format(value)


def _per_name_flags(template: str, raw: str) -> str:
    """A dict value (``input_shape={'a': (1,), 'b': (2,)}``) as the flag once per key
    (``--input-shape a=1 --input-shape b=2``)."""
    try:
        per_name = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return template.format(raw)
    if not isinstance(per_name, dict):
        return template.format(raw)
    return " ".join(template.format(f"{k}={_flag_value(repr(v))}") for k, v in per_name.items())


def _flag_value(raw: str | None) -> str | None:
    """A Python value as written in a message (``'cpu'``, ``(32, 32, 3)``, ``2``) as the
    command line writes it (``cpu``, ``32,32,3``, ``2``); ``None`` for no value."""
    if raw is None:
        return None
    try:
        value: Any = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return raw
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, str):
        return shlex.quote(value)
    return str(value)


_Parser = OneLineParser
"""argparse that reports a bad command line on one line (``worker`` and ``calibrate`` too)."""


def build_parser() -> argparse.ArgumentParser:
    """The ``partition PATH[:ATTR]`` command line: the model, one flag per option of the API's
    three option groups, and the output files."""
    parser = _Parser(
        prog=PROG,
        description="Place a Keras model's layers on devices: trace, cost, solve, report. "
        f"Also: '{PROG} show PLAN.json' re-renders a saved plan; '{PROG} devices' lists the "
        f"device catalog; '{PROG} worker --task I --cluster FILE' serves a TF cluster task.",
    )
    parser.add_argument("model", metavar="PATH[:ATTR]", help="Python file with the model")
    _add_target_flags(parser)
    _add_search_flags(parser)
    _add_measure_flags(parser)
    _add_output_flags(parser)
    parser.add_argument("--verbose", "-v", action="store_true", help="phase timings and logs")
    return parser


def _add_target_flags(parser: argparse.ArgumentParser) -> None:
    """What to plan for (:class:`~partitioner.core.options.TargetOptions`)."""
    from cost_models.devices.catalog import device_type_names

    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="number of devices to place on (required unless --topology names a file)",
    )
    parser.add_argument(
        "--device-type",
        default=None,
        help=f"device type from the catalog ({', '.join(device_type_names())}); default h100 "
        "(a topology file names its own; --device-type is then the type of its entries that "
        "name none)",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument(
        "--topology",
        "--link",
        dest="topology",
        default="pcie",
        metavar="pcie|nvlink|KIND|FILE",
        help="links between the devices: pcie, nvlink, a catalog link kind, or a JSON/TOML "
        "topology file (devices, hosts, links; --gpus, if given, must agree with it)",
    )
    parser.add_argument("--optimizer", default="adam", help="optimizer, for memory (default adam)")
    parser.add_argument(
        "--precision",
        default=None,
        metavar="fp32|tf32|fp16|bf16",
        help="plan for this precision instead of the model's dtype policy: fp32, tf32, "
        "mixed_float16 (fp16), mixed_bfloat16 (bf16); default: the model's, float32 on TF32 "
        "tensor cores as TensorFlow runs it",
    )
    parser.add_argument(
        "--input-shape",
        default=None,
        action="append",
        metavar="[NAME=]SHAPE",
        help="input shape without the batch dimension (needed for unknown dims): 32,32,3 for a "
        "single-input model, or NAME=SHAPE once per input, e.g. --input-shape token_ids=128 "
        "--input-shape padding_mask=128",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        help="memory per device, e.g. 16GiB (default: the catalog's figure for the device type)",
    )


def _add_search_flags(parser: argparse.ArgumentParser) -> None:
    """How to search (:class:`~partitioner.core.options.SearchOptions`); the solver choices
    come from the solver registry, the schedule choices from :class:`Schedule`."""
    from partitioner.solvers import solver_names

    parser.add_argument(
        "--solver",
        default="auto",
        choices=solver_names(),
        metavar="NAME",
        help=f"placement solver ({', '.join(solver_names())}); default auto",
    )
    parser.add_argument("--seed", type=int, default=0, help="solver seed (default 0)")
    parser.add_argument(
        "--time-limit", type=float, default=5.0, help="solver time budget in seconds (default 5)"
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="pipeline the stages with micro-batches (GPipe / 1F1B) instead of a plain split",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="micro-batches per batch with --pipeline (default: the most up to 4 x devices that "
        "divides the batch size)",
    )
    parser.add_argument(
        "--schedule",
        default=None,
        choices=[s.value for s in Schedule if s is not Schedule.NONE],
        help="pipeline schedule with --pipeline (default 1f1b)",
    )
    parser.add_argument(
        "--strategy",
        default=None,
        type=lambda text: text.replace("_", "-"),
        choices=[AUTO_STRATEGY, *(f.value.replace("_", "-") for f in Family)],
        help="the strategy the plan applies: auto (the fastest predicted of every family; the "
        "default with --solver auto), or the fastest of one family: single, data-parallel "
        "(tf.distribute replicas), pipeline, placed (a plain split, for memory) or hybrid "
        "(replicas of pipelines). Without it, --solver NAME or --pipeline apply that split",
    )
    parser.add_argument(
        "--strategies",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="compare every strategy (one device, data parallel, pipeline, plain split, hybrid) "
        "by the predicted step of what it would run (default on; --no-strategies skips the "
        "extra traces at each per-replica batch)",
    )


def _add_measure_flags(parser: argparse.ArgumentParser) -> None:
    """How to measure (:class:`~partitioner.core.options.MeasureOptions`; the cache directory
    is ``$PARTITIONER_CACHE_DIR``)."""
    parser.add_argument(
        "--profile",
        action="store_true",
        help="measure layer times on the devices present (cached on disk in "
        "$PARTITIONER_CACHE_DIR or the user's cache directory) instead of estimating",
    )
    parser.add_argument(
        "--profile-ops",
        action="store_true",
        help="time every op inside the training step on this machine's CPU (cpu devices)",
    )
    parser.add_argument(
        "--trace-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="read the traced training step from the cache directory when an earlier run "
        "traced this model at this batch, and store new traces there (default on; "
        "--no-trace-cache traces again and writes nothing)",
    )


def _add_output_flags(parser: argparse.ArgumentParser) -> None:
    """The files a run writes."""
    parser.add_argument("--out", default=None, help="write the plan as JSON to this file")
    parser.add_argument(
        "--report", default=None, metavar="HTML", help="write a self-contained HTML report here"
    )
    parser.add_argument(
        "--emit",
        default=None,
        metavar="PY",
        help="write a Python module that rebuilds the model with explicit tf.device blocks",
    )


def _options(
    args: argparse.Namespace, paths: _Paths | None = None
) -> tuple[TargetOptions, SearchOptions, MeasureOptions]:
    """The API's option groups from the flags (each checks its own fields), with the paths
    made absolute (the topology file, the profile cache; resolved now without ``paths``)."""
    if paths is None:
        paths = _resolve_paths(args)
    memory_limit_bytes = None
    if args.memory_limit is not None:
        memory_limit_bytes = parse_memory_limit(args.memory_limit)
    target = TargetOptions(
        gpus=args.gpus,
        device_type=args.device_type,
        topology=args.topology if paths.topology_file is None else str(paths.topology_file),
        batch_size=args.batch_size,
        input_shape=_parse_shape(args.input_shape),
        optimizer=args.optimizer,
        memory_limit_bytes=memory_limit_bytes,
        precision=args.precision,
    )
    search = SearchOptions(
        solver=args.solver,
        seed=args.seed,
        time_limit_s=args.time_limit,
        pipeline=args.pipeline,
        num_microbatches=args.microbatches,
        schedule=None if args.schedule is None else Schedule(args.schedule),
        compare_strategies=args.strategies,
        strategy=args.strategy,
    )
    measure = MeasureOptions(
        profile=args.profile,
        profile_ops=args.profile_ops,
        cache_dir=paths.cache_dir or paths.trace_cache_dir,
        trace_cache=paths.trace_cache_dir is not None,
    )
    return target, search, measure


def _parse_shape(texts: Sequence[str] | None) -> InputShape | None:
    """``--input-shape 32,32,3`` (or ``32x32x3``) as a tuple, or ``--input-shape NAME=SHAPE``
    repeated as a dict of input name -> shape; TargetOptions checks the values."""
    if not texts:
        return None
    named = ["=" in t for t in texts]
    if not any(named) and len(texts) == 1:
        return _dims(texts[0])
    if not all(named):
        raise UsageError(
            f"--input-shape {' --input-shape '.join(texts)}: with several inputs name each, "
            "e.g. --input-shape token_ids=128 --input-shape padding_mask=128"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for text in texts:
        name, _, dims = text.partition("=")
        if not name.strip() or name.strip() in shapes:
            raise UsageError(f"--input-shape {text!r}: give each input once as NAME=SHAPE")
        shapes[name.strip()] = _dims(dims, text)
    return shapes


def _dims(text: str, flag_value: str | None = None) -> tuple[int, ...]:
    """``32,32,3`` (or ``32x32x3``) as a tuple of ints; UsageError quoting the flag's value."""
    parts = text.replace("x", ",").split(",")
    if parts and not parts[-1].strip():
        parts = parts[:-1]  # a trailing comma: "784," is (784,)
    try:
        # every part a number: "16,,16" is a typo, not (16, 16)
        dims = tuple(int(p) for p in parts) if all(p.strip() for p in parts) else ()
    except ValueError:
        dims = ()
    if not dims:
        raise UsageError(
            f"--input-shape {flag_value or text!r} is not a list of integers like 32,32,3"
        )
    return dims


class _Output(NamedTuple):
    """An output file: its flag, the path as given, and that path resolved (absolute, every
    symbolic link on it followed) before the model's code runs, which may re-point a link."""

    option: str
    given: str
    path: str
    existed: bool = True
    """Whether a file was there when the run started: one there now that was not is the model's
    code's (it may have written it, or made it and read it back through TensorFlow's file layer,
    which no hook sees), and is not replaced."""


@dataclass(frozen=True)
class _Paths:
    """Every path of the command line made absolute against the working directory the run
    started in, before the model's code runs (it may ``os.chdir``): everything afterwards reads
    and writes these."""

    start: str
    """The working directory when the run started."""
    model: str
    """``PATH[:ATTR]`` with ``PATH`` absolute."""
    topology_file: Path | None
    """``--topology`` made absolute when it names a file."""
    outputs: tuple[_Output, ...]
    cache_dir: str | None
    """The profile cache directory (absolute) with ``--profile``."""
    trace_cache_dir: str | None = None
    """The cache directory (absolute) the trace cache uses, None without one
    (``--no-trace-cache``, or a path through another user's link: a warning says so)."""
    cache_base: str | None = None
    """The cache directory (absolute, resolved) whether this run uses a cache or not: no output
    may be it or a folder of its entries (:func:`_check_outside_own_files`)."""
    no_cache: str | None = None
    """With ``--profile``, why there is no profile cache (no home directory), decided before
    Keras is imported: its import makes ``~/.keras``, and the home with it."""
    model_file: str = ""
    """The model's file resolved through every symbolic link before its code runs: the file an
    emitted program imports (a link re-pointed later changes nothing, campaign 34y)."""

    def shown(self, given: str, path: str) -> str:
        """How a message names a file: as given while the working directory is the one the
        run started in and ``given`` still leads to ``path`` (it names the same file), ``path``
        (absolute) once either moved (a symbolic link on ``given`` re-pointed)."""
        try:
            moved = not same_file(os.getcwd(), self.start)
        except OSError:  # the directory the model's code changed to is gone
            moved = True
        same = os.path.realpath(os.path.join(self.start, given)) == os.path.realpath(path)
        return path if moved or not same else given

    def shown_input(self, path: Path) -> str:
        """An input file, as :meth:`shown`: relative to the start directory when in it."""
        inside = path.is_relative_to(self.start)
        return self.shown(str(path.relative_to(self.start)) if inside else str(path), str(path))


def _resolve_paths(args: argparse.Namespace) -> _Paths:
    """Every path the command line names, absolute (see :class:`_Paths`)."""
    from partitioner.cli.loader import split_spec

    try:
        start = os.getcwd()
    except OSError as exc:
        raise UsageError(
            f"the working directory is gone ({exc.strerror or exc}); cd to an existing one"
        ) from None
    path, attr = split_spec(args.model)
    model = os.path.join(start, path)
    topology_file = _topology_file(args.topology)
    named = (("--out", args.out), ("--report", args.report), ("--emit", args.emit))
    for option, given in named:
        spelled = directory_name(given) if given is not None else None
        if spelled is not None:
            raise OutputError(f"{option} {given} {spelled}; give a file path")
    cache_dir = no_cache = None
    if args.profile:
        from cost_models.measure.profiled import default_cache_dir

        try:
            given_cache = os.path.join(start, default_cache_dir())
            check_links_followed(
                given_cache, "the profile cache directory (PARTITIONER_CACHE_DIR)", given_cache
            )
            cache_dir = os.path.realpath(given_cache)
        except RuntimeError as exc:  # no home directory
            no_cache = f"{exc}; set PARTITIONER_CACHE_DIR to cache"
    traced = args.trace_cache and not (args.profile or args.profile_ops)
    trace_cache_dir = _trace_cache_dir(start) if traced else None
    # Outputs are resolved now, through every symbolic link, and written there: a link the
    # model's code re-points later changes nothing, and one it puts on the resolved path is
    # refused (_check_still_resolved), never written through.
    outputs = []
    for option, given in named:
        if given is not None:
            joined = os.path.join(start, given)
            check_links_followed(joined, option, given)
            outputs.append(
                _Output(option, given, os.path.realpath(joined), os.path.lexists(joined))
            )
    return _Paths(
        start=start,
        model=model if attr is None else f"{model}:{attr}",
        topology_file=None if topology_file is None else Path(start, topology_file),
        outputs=tuple(outputs),
        cache_dir=cache_dir,
        trace_cache_dir=trace_cache_dir,
        no_cache=no_cache,
        cache_base=next((os.path.realpath(os.path.join(start, d)) for d in default_caches()), None),
        model_file=os.path.realpath(os.path.join(start, model)),
    )


def _trace_cache_dir(start: str) -> str | None:
    """The trace cache's directory, resolved before the model's code runs; None (a warning:
    the run traces) when there is none (no home directory) or it leads through another user's
    link (:func:`check_links_followed`)."""
    from cost_models.measure.profiled import default_cache_dir

    try:
        given = os.path.join(start, default_cache_dir())
        check_links_followed(given, "the cache directory (PARTITIONER_CACHE_DIR)", given)
    except RuntimeError:  # no home directory
        return None
    except OutputError as exc:
        logger.warning("%s; tracing without the trace cache", exc)
        return None
    return os.path.realpath(given)


def _check_still_resolved(path: str, option: str, shown: str) -> None:
    """``path``, resolved before the model's code ran (:class:`_Output`), still resolves to
    itself: a symbolic link the code has put on it since is refused, never written through."""
    now = os.path.realpath(path)
    if now != path:
        raise OutputError(
            f"{option} {shown} now leads to {now}, not to {path} as when the run started (the "
            "model's code changed a symbolic link on it); refusing to write: give a path "
            "without symbolic links"
        )


def _check_out(path: str, option: str, shown: str) -> None:
    """``path`` is a regular file or new (never a FIFO, socket, device or directory: a symlink
    counts as its target), in an existing directory, and writable; messages name ``shown``."""
    _check_still_resolved(path, option, shown)
    try:
        target = check_output_path(path, option)
    except OutputError as exc:
        raise OutputError(str(exc).replace(f"{option} {path}", f"{option} {shown}", 1)) from None
    writable = os.access(target, os.W_OK) if target.exists() else True
    if not os.access(target.parent, os.W_OK) or not writable:
        raise OutputError(f"{option} {shown} is not writable; choose another path")
    try:
        # os.access says yes to root everywhere; a real (invisible, unnamed) file says truly.
        with tempfile.TemporaryFile(dir=target.parent):
            pass
    except OSError as exc:
        raise OutputError(
            f"{option} {shown} is not writable ({exc.strerror or exc}); choose another path"
        ) from None


def _check_outputs(paths: _Paths, inputs: Sequence[tuple[str, Path | tuple[int, int]]]) -> None:
    """Every output path can be written, no two options name the same file, and none is one of
    the run's ``inputs`` (``(what, path)``: the model file, the topology file, and once the
    model is loaded the modules it imported); and the profile cache directory still resolves
    to the directory it was when the run started."""
    if paths.cache_dir is not None and os.path.realpath(paths.cache_dir) != paths.cache_dir:
        raise OutputError(
            f"the profile cache directory {paths.cache_dir} now leads to "
            f"{os.path.realpath(paths.cache_dir)} (the model's code put a symbolic link on it); "
            "refusing to write the cache through it: set PARTITIONER_CACHE_DIR to a directory "
            "the model's code leaves alone"
        )
    seen: list[_Output] = []
    for out in paths.outputs:
        shown = paths.shown(out.given, out.path)
        _check_out(out.path, out.option, shown)
        _check_outside_own_files(paths, out, shown)
        check_not_hiding_a_module(out.path, f"{out.option} {shown}")
        for earlier in seen:
            if same_file(out.path, earlier.path):
                raise UsageError(
                    f"{earlier.option} and {out.option} both name {shown}; give different files"
                )
        for what, source in inputs:
            if _is_input(out.path, source):
                raise UsageError(
                    f"{out.option} {shown} is {what}; refusing to overwrite it: give another path"
                )
        _check_still_ours(out, shown)
        seen.append(out)


def _check_still_ours(out: _Output, shown: str) -> None:
    """Right before the write: ``out`` is still new, or still a file partitioner wrote (the
    model's code run while rendering, a ``get_config``, may have made or edited it since the
    checks: replaced, campaign 34af)."""
    if not out.existed and os.path.lexists(out.path):
        raise UsageError(
            f"{out.option} {shown} did not exist when the run started, and something made it "
            "while the run went on (the model's code, or another process); refusing to "
            "overwrite it: give another path"
        )
    check_replaceable(Path(os.path.realpath(out.path)), f"{out.option} {shown}")


def _check_outside_own_files(paths: _Paths, out: _Output, shown: str) -> None:
    """``out`` is not in this project's own installation nor Keras's configuration file
    (:func:`~partitioner.core.files.check_outside_kept_files`), nor a cache directory or a folder
    of its entries, whether this run uses it or not (the trace cache's ``traces/``, the profile
    cache's ``layers/``: files a run replaces after its outputs are written)."""
    from partitioner.core.files import check_outside_kept_files

    caches = {d for d in (paths.cache_base, paths.cache_dir, paths.trace_cache_dir) if d}
    check_outside_kept_files(out.path, f"{out.option} {shown}", sorted(caches))


def _is_input(path: str, source: Path | tuple[int, int]) -> bool:
    """Whether the output ``path`` is the input ``source``: a path (however linked), or a file
    identity ``(st_dev, st_ino)`` recorded when the model's code read it (renamed since, or read
    through a link since removed)."""
    if not isinstance(source, tuple):
        return same_file(path, source)
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == source


@dataclass(frozen=True)
class _UserCode:
    """What the model's code brought in: the names ``sys.modules`` held before it ran, the
    files it opened for reading while it ran (filled in as it runs), and the outputs anything
    opened meanwhile (:func:`partitioner.cli.watch.watching_opens`: TensorFlow's file layer)."""

    before: frozenset[str]
    read: set[str]
    opened: set[str] = field(default_factory=set)
    traces: list[Any] = field(default_factory=list)
    """The run's trace cache (:class:`passes.trace_cache.TraceCache`), if it has one, flushed
    once the outputs are written."""
    profiles: list[Any] = field(default_factory=list)
    """The profile cache entries the run measured
    (:class:`cost_models.measure.profiled.ProfileWrites`), written once the outputs are."""


def _imported(paths: _Paths, code: _UserCode) -> list[tuple[str, Path | tuple[int, int]]]:
    """The run's inputs the model's code brought in from the user's tree: the files of the
    modules it imported since ``sys.modules`` held ``code.before``, and every other file it
    read (a module loaded without an import, ``runpy``, a data file)."""
    from partitioner.cli.loader import user_files_read, user_module_files, user_read_identities

    modules = user_module_files(code.before)
    found: list[tuple[str, Path | tuple[int, int]]] = [
        (f"the module {paths.shown_input(file)} that the model imports", file) for file in modules
    ]
    found += [
        (f"the file {paths.shown_input(file)} that the model's code read", file)
        for file in user_files_read(code.read)
        if file not in modules
    ]
    found += [
        (f"the file the model's code read as {paths.shown_input(file)}", identity)
        for identity, file in user_read_identities(code.read).items()
    ]
    found += [
        (f"the file {paths.shown_input(Path(file))} that the model's code read", Path(file))
        for file in sorted(code.opened)
    ]
    sources = [Path(paths.model_file), *_imported_by_source(paths.model_file)]
    found += [
        (f"the module {paths.shown_input(file)} that the model's code imports", file)
        for file in sources[1:]
        if file not in modules
    ]
    return found  # a file its code opens only when it trains: no output replaces it (row 229)


def _imported_by_source(model_file: str) -> list[Path]:
    """The modules beside ``model_file`` that its source imports anywhere, run or not yet (an
    ``import helper`` inside ``train_step``, which an emitted program runs: ``--emit helper.py``
    replaced it, campaign 34y), and those the modules found import in turn: dotted names
    (``import sub.helper``), ``importlib.import_module("helper")`` (campaign 34z)."""
    here = Path(model_file).parent
    found: list[Path] = []
    queue = [Path(model_file)]
    while queue and len(found) < 200:
        for name in sorted(_names_imported(queue.pop(0))):
            for file in _module_files(here, name):
                if file not in found:
                    found.append(file)
                    queue.append(file)
    return found


def _names_imported(source: Path) -> set[str]:
    """The dotted module names ``source`` imports (``import``, ``from ... import``, and
    ``import_module`` or ``__import__`` of a string)."""
    import ast

    try:
        tree = ast.parse(source.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else None
            callee = node.func.id if isinstance(node.func, ast.Name) else callee
            if callee in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def _module_files(here: Path, dotted: str) -> list[Path]:
    """The files under ``here`` that importing ``dotted`` may run: each package on the way and
    the module itself (``a/__init__.py``, ``a/b.py``, ``a/b/__init__.py`` for ``a.b``)."""
    parts = [p for p in dotted.split(".") if p.isidentifier()]
    files = []
    for k in range(1, len(parts) + 1):
        base = here.joinpath(*parts[:k])
        files += [base.with_name(base.name + ".py"), base / "__init__.py"]
    return [file for file in files if file.is_file()]


def _check_counts(args: argparse.Namespace) -> None:
    """Every count on the command line against :data:`LIMITS`, before any work (a huge
    ``--gpus`` would build a topology of that many devices first)."""
    values = {
        "--gpus": args.gpus,
        "--batch-size": args.batch_size,
        "--microbatches": args.microbatches,
        "--time-limit": args.time_limit,
    }
    for flag, value in values.items():
        limit = LIMITS[flag]
        if value is not None and value > limit:
            raise UsageError(
                f"{flag} {value} is more than {limit:.15g}, the most partition takes; give at "
                f"most {limit:.15g}"
            )
    shape = _parse_shape(args.input_shape)
    named = shape.items() if isinstance(shape, dict) else [("", shape or ())]
    for name, dims in named:
        values_per_sample = math.prod(dims)
        if values_per_sample > MAX_SAMPLE_VALUES:
            label = f"{name}=" if name else ""
            raise UsageError(
                f"--input-shape {label}{','.join(map(str, dims))} makes {values_per_sample} "
                f"values per sample, more than {MAX_SAMPLE_VALUES}; give the shape of one sample"
            )


def _topology_file(spec: str) -> Path | None:
    """The path of ``--topology`` when it names a file (a ``.json``/``.toml`` suffix)."""
    path = Path(spec.strip())
    return path if path.suffix.lower() in (".json", ".toml") else None


def _check_topology_file(path: Path) -> None:
    """A topology file is a regular file of at most ``MAX_TOPOLOGY_BYTES``, nests and
    counts within bounds, and makes at most :data:`MAX_DEVICES` devices; checked before the
    topology is built (which takes time growing with the square of the devices)."""
    import tomllib

    from cost_models.devices.topology import MAX_TOPOLOGY_BYTES

    origin = f"topology file {str(path)!r}"
    text = read_input_text(path, "topology file", UsageError, MAX_TOPOLOGY_BYTES)
    if path.suffix.lower() == ".json":
        data = loads_bounded(text, origin, CatalogError, "fix the file")
    else:
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise CatalogError(f"{origin} is not valid TOML ({exc}); fix the file") from None
        except (RecursionError, ValueError) as exc:
            detail = "nested too deep" if isinstance(exc, RecursionError) else "a number too long"
            raise CatalogError(f"{origin} is not valid TOML ({detail}); fix the file") from None
        check_data_bounds(data, origin, CatalogError)
    devices = _topology_devices(data)
    if devices > MAX_DEVICES:
        raise UsageError(
            f"{origin} describes {devices} devices, more than {MAX_DEVICES}, the most partition "
            f"takes; describe at most {MAX_DEVICES}"
        )


def _count(value: object) -> int:
    """A topology entry's ``count`` (1 when absent or malformed: the reader reports those)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _topology_devices(data: object) -> int:
    """How many devices the topology file data describes (``hosts[].count`` x its devices'
    counts, or the top-level ``devices``); malformed parts count 0, as the reader refuses them."""
    if not isinstance(data, dict):
        return 0
    hosts = data.get("hosts") if "hosts" in data else [{"devices": data.get("devices")}]
    total = 0
    for host in hosts if isinstance(hosts, list) else []:
        if not isinstance(host, dict) or not isinstance(host.get("devices"), list):
            continue
        entries = host["devices"]
        per_host = sum(_count(d.get("count")) if isinstance(d, dict) else 1 for d in entries)
        total += _count(host.get("count")) * per_host
    return total


@contextlib.contextmanager
def _quiet_native_stderr(enabled: bool, shown: TextIO) -> Iterator[None]:
    """Silence C++ start-up logging (absl, oneDNN, CUDA probes) written straight to fd 2, but
    not what the model's code writes: Python's ``sys.stderr`` goes to ``shown`` (a copy of the
    real stderr) meanwhile, so a model that says why it stops (``print(..., file=sys.stderr)``
    before ``sys.exit(3)``) is heard; Python warnings show only when raised from the user's
    own files (:func:`~partitioner.cli.loader.is_user_file`), not TensorFlow's or Keras's."""
    if not enabled:
        yield
        return
    from partitioner.cli.loader import is_user_file
    from partitioner.core.files import system_dirs

    system = system_dirs()  # once: TensorFlow's import warns while it runs
    sys.stderr.flush()
    saved, python_stderr, show = kept_copy(2), sys.stderr, warnings.showwarning

    def show_users(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        if is_user_file(filename, system):
            show(message, category, filename, lineno, file, line)

    try:
        with open(os.devnull, "w") as devnull:  # closed at once: the model's code may close it
            os.dup2(devnull.fileno(), 2)
        sys.stderr = cast(TextIO, _StderrOrNothing(shown))
        warnings.showwarning = show_users
        yield
    finally:
        warnings.showwarning = show
        with contextlib.suppress(Exception):  # the model's code may have set it to None
            sys.stderr.flush()
        sys.stderr = python_stderr
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def _stdout_kept_from_children() -> Iterator[None]:
    """File descriptor 1 at /dev/null while the model's code runs, and Python's ``sys.stdout``
    writing to a copy of it (which no child inherits) meanwhile: what the model's code prints is
    shown, but a process it starts and leaves running (a daemon forked twice, out of reach of
    :func:`_stop_children`) does not hold the user's stdout open, where ``partition ... | cat``
    would wait for it. (File descriptor 2 is /dev/null meanwhile too: :func:`_quiet_native_stderr`.)"""
    if sys.stdout is None:
        yield
        return
    _flush_or_drop(sys.stdout)
    try:
        saved = kept_copy(1)  # not inheritable
        # The model's prints go through a copy of their own: one that fails (a full disk) is
        # pointed at /dev/null by _flush_or_drop, which on ``saved`` itself made the report
        # go to /dev/null too, with status 0 and no word (campaign 34u).
        printed = kept_copy(1)
    except OSError:  # started with stdout closed
        yield
        return
    python_stdout = sys.stdout
    encoding, errors = getattr(python_stdout, "encoding", None), getattr(python_stdout, "errors", None)
    copy = open(printed, "w", buffering=1, encoding=encoding, errors=errors, closefd=False)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
        sys.stdout = cast(TextIO, _StderrOrNothing(copy))
        yield
    finally:
        _flush_or_drop(copy)
        with contextlib.suppress(OSError, ValueError):
            copy.close()  # leaves ``printed`` open (closefd=False)
        sys.stdout = python_stdout
        os.dup2(saved, 1)
        os.close(saved)
        os.close(printed)


def _configure_logging(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("tensorflow", "absl", "h5py"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)
    for handler in logging.getLogger().handlers:  # the command line's own (not a test's)
        if type(handler) is logging.StreamHandler:
            handler.addFilter(_FLAG_SPELLING)


class _FlagSpelling(logging.Filter):
    """The library's warnings with its arguments spelled as the command line's flags
    (:func:`cli_message`, as its errors are: ``batch_size=4`` -> ``--batch-size 4``), not inside
    what they quote of the model's own code."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] not in ("partitioner", "passes", "cost_models"):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        quoted = [q for a in args if isinstance(a, PartitionError) for q in a.quoted]
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: logging reports it as it would have
            return True
        record.msg, record.args = cli_message(message, quoted), ()
        return True


_FLAG_SPELLING = _FlagSpelling()


def _show_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=f"{PROG} show", description="Re-render a saved plan's tables.")
    parser.add_argument("plan", help="a plan JSON file written by partition --out")
    parser.add_argument("--verbose", "-v", action="store_true", help="phase timings")
    return parser


def _devices_parser() -> argparse.ArgumentParser:
    return _Parser(prog=f"{PROG} devices", description="List the device catalog.")


def _show(argv: Sequence[str], out: Console) -> int:
    from partitioner.plan.model import load_plan
    from partitioner.report.terminal import render_plan

    args = _show_parser().parse_args(argv)
    try:
        with out.capture() as tables:
            render_plan(load_plan(args.plan), out, verbose=args.verbose, spell=cli_message)
        return print_out(tables.get(), "the plan's tables", ())
    except PartitionError as exc:
        return _error(exc)


def _devices(argv: Sequence[str], out: Console) -> int:
    from rich.table import Table

    from cost_models.devices.catalog import catalog
    from partitioner.core.units import format_bytes

    _devices_parser().parse_args(argv)
    table = Table(title="Device catalog (cost_models/data/devices.json)", title_justify="left")
    for column in ("type", "fp32 TFLOP/s", "bf16 TFLOP/s", "memory", "bandwidth", "link", "source"):
        table.add_column(
            column, justify="left" if column in ("type", "link", "source") else "right"
        )
    cat = catalog()
    for name in cat:
        d = cat[name]
        table.add_row(
            name,
            f"{d.peak_flops('float32') / 1e12:.1f}",
            f"{d.peak_flops('bfloat16') / 1e12:.1f}",
            format_bytes(d.memory_bytes),
            f"{d.memory_bandwidth_bytes_per_s / 1e9:.0f} GB/s",
            d.default_link,
            d.source,
        )
    with out.capture() as listed:
        out.print(table)
    try:
        return print_out(listed.get(), "the device catalog", ())
    except PartitionError as exc:
        return _error(exc)


def _error(exc: PartitionError) -> int:
    """Print a library error on one line (control characters escaped), in the command line's
    terms; its exit code."""
    _say(f"{PROG}: error: {escape_control(cli_message(str(exc), exc.quoted))}\n")
    return exc.exit_code


def _plain_streams() -> None:
    """Let stdout and stderr print on a terminal that is not UTF-8 (``LC_ALL=C``, Latin-1):
    characters it cannot show become ``?`` instead of an exception; rich draws ASCII boxes
    for such a console by itself."""
    for stream in (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            "\u2500\u2026\u2713".encode(encoding)
        except (UnicodeEncodeError, LookupError):
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(errors="replace")  # type: ignore[union-attr]


class _Interrupts:
    """The run's SIGINT (and SIGTERM) handler: raises ``KeyboardInterrupt`` and remembers that
    one arrived. An interrupt landing inside Python's import machinery (a run imports
    TensorFlow for a second or more) can surface as another exception (CPython's
    ``TypeError: expected a message argument`` from a failed ImportError): after an interrupt,
    whatever ends the run is the interrupt's (one line, 130), not an internal error."""

    ends_run = True
    """For :func:`partitioner.core.files.write_all_atomic`: a signal this handler takes ends
    the run, so files being written are put back as they were."""

    def __init__(self) -> None:
        self.arrived = False

    def __call__(self, signum: int, frame: object) -> NoReturn:
        self.arrived = True
        raise KeyboardInterrupt

    def honour(self) -> None:
        """``KeyboardInterrupt`` again if one arrived: raised inside a weakref callback of
        Python's import machinery, it is printed as "Exception ignored" and swallowed, and the
        run went on to write its files and exit 0."""
        if self.arrived:
            raise KeyboardInterrupt


_INTERRUPTS = _Interrupts()


def _unraisable_but_interrupts(unraisable: Any) -> None:
    """``sys.unraisablehook`` of a ``partition`` process: a Ctrl-C raised where Python cannot
    raise it (a weakref callback of the import machinery) is not printed as "Exception ignored"
    with its traceback; :meth:`_Interrupts.honour` ends the run with it at the next phase. Any
    other is Python's to print. Nor is an error Ctrl-C caused there: a C function returning with
    the interrupt pending (TensorFlow's ``Flatten`` calling ``__import__``) is a ``SystemError``
    whose cause is the ``KeyboardInterrupt``, or, where the C code reports it itself
    (``PyErr_WriteUnraisable``), a bare ``SystemError``: CPython's mark of C code that returned
    while an exception was pending, which after an interrupt is the interrupt's."""
    exc = unraisable.exc_value
    if _INTERRUPTS.arrived and (_caused_by_interrupt(exc) or isinstance(exc, SystemError)):
        return
    sys.__unraisablehook__(unraisable)


def _caused_by_interrupt(exc: BaseException | None) -> bool:
    """Whether ``exc`` is a ``KeyboardInterrupt`` or was raised while one was (its causes and
    contexts, a few deep)."""
    for _ in range(8):
        if exc is None:
            return False
        if isinstance(exc, KeyboardInterrupt):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _raise_interrupt(signum: int, frame: object) -> NoReturn:
    _INTERRUPTS(signum, frame)


THREAD_GRACE_S = 2.0
"""How long a ``partition`` process waits, once its work is done, for threads the model's code
left running (they would keep the interpreter alive forever) before it exits without them."""

SUBCOMMANDS = ("show", "devices", "worker", "calibrate")


def main(argv: Sequence[str] | None = None) -> int:
    """The ``partition`` command; its exit status.

    Without ``argv`` it runs this process's own command line (the ``partition`` script,
    ``python -m partitioner``) and owns the process: Ctrl-C at any moment is one line and status
    130 (at once outside the run, where nothing is being written; inside it a
    ``KeyboardInterrupt`` unwinds, so atomic writers remove their temporary files; after the
    plan is written, up to the process's very end: :func:`_end_process`), a stdout or stderr
    that fails leaves no traceback and changes no status (:func:`print_out`,
    :func:`_flush_or_drop`, :func:`_own_stderr`), and threads and child processes the model's
    code left running do not keep the process (or a pipe from it) alive (:func:`_leave`). With
    ``argv`` (tests, another program calling it) it only returns the status: signals, streams
    and threads are the caller's.
    """
    if argv is not None:
        return _main(list(argv), process=False)
    _interrupt_exits(INTERRUPTED_EARLY)
    _own_stderr()
    sys.unraisablehook = _unraisable_but_interrupts
    os.register_at_fork(after_in_child=_default_signals)
    os.register_at_fork(after_in_child=_copies_at_devnull(_stream_files()))
    args = sys.argv[1:]
    try:
        try:
            status = _main(args, process=True)
        finally:  # the run is over: a signal now ends the process at once
            _interrupt_exits("interrupted")
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except SystemExit as exc:  # argparse: --help, a bad command line
        status = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except KeyboardInterrupt:  # arrived as the run's handlers were changed
        status = _interrupted()
    command = args[0] if args and args[0] in SUBCOMMANDS else None
    return _leave(status, model_ran=command is None)


def _main(argv: list[str], *, process: bool) -> int:
    """:func:`main` for ``argv``: a subcommand, or a plan; an error none of them turned into
    its line (the packaged device catalog, which every parser reads, broken) as one line."""
    try:
        return _dispatch(argv, process=process)
    except PartitionError as exc:
        return _error(exc)


def _dispatch(argv: list[str], *, process: bool) -> int:
    _plain_streams()
    if argv and argv[0] == "show":
        return _show(argv[1:], _stdout_console())
    if argv and argv[0] == "devices":
        return _devices(argv[1:], _stdout_console())
    if argv and argv[0] == "worker":
        from partitioner.cli.worker import main as worker_main

        return worker_main(argv[1:])
    if argv and argv[0] == "calibrate":
        from partitioner.cli.calibrate import main as calibrate_main

        if process:  # it writes a file: Ctrl-C unwinds, and it says so itself
            _set_sigint(signal.default_int_handler)
        return calibrate_main(argv[1:])
    return _main_plan(argv, process=process)


def _main_plan(argv: list[str], *, process: bool) -> int:
    """``partition PATH[:ATTR] ...``: every failure as one line and its status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    # A polite kill (SIGTERM) unwinds like Ctrl-C, so atomic writers remove their temporary files.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    _configure_logging(args.verbose)
    out = _stdout_console()
    # Progress goes to a copy of stderr, so it still shows while TensorFlow's native start-up
    # logging (written straight to file descriptor 2) is silenced.
    err = Console(
        file=os.fdopen(kept_copy(2), "w", encoding=sys.stderr.encoding, errors="replace"),
        stderr=True,
    )
    for handler in logging.getLogger().handlers:  # warnings must show through the silence too
        if type(handler) is logging.StreamHandler and handler.stream is sys.stderr:
            handler.setStream(err.file)
    if process:  # from here on Ctrl-C unwinds: the run may be writing its files
        _set_sigint(_INTERRUPTS)
    exits: contextlib.AbstractContextManager[list[str]] = (
        hard_exits_refused() if process else contextlib.nullcontext([])
    )
    try:
        with exits as notes:
            status = _run(args, out, err)
        for note in notes:
            _say(f"{PROG}: note: {note}\n")
        _INTERRUPTS.honour()  # arrived, swallowed, and never honoured since: still 130
        return status
    except PartitionError as exc:
        return _interrupted() if _INTERRUPTS.arrived else _error(exc)
    except KeyboardInterrupt:
        return _interrupted()
    except SystemExit as exc:  # only the model's code exits: argparse ran before
        return _error(
            ModelLoadError(
                f"the model's code called {exit_call(exc)} while it was planned; no file was "
                "written: remove the exit from the model file"
            )
        )
    except BaseException as exc:
        if _INTERRUPTS.arrived:  # an interrupt that surfaced as another exception
            return _interrupted()
        if args.verbose:
            raise
        return _internal_error(exc, _model_file(args.model))


def _interrupted() -> int:
    """Say that Ctrl-C (or SIGTERM) ended the run; its status."""
    _say(f"{PROG}: interrupted; no file was left half-written\n")
    return 130


class _Unwritten:
    """Stdout as a rich Console sees it (its terminal, encoding, descriptor) but never
    writes to: rich writes and flushes its file even while capturing, where a full disk raises.
    Everything is drawn into captures and printed by :func:`print_out`, after the files."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _stdout_console() -> Console:
    """The Console the report is drawn with, as it would be on stdout (:class:`_Unwritten`)."""
    return Console(file=cast(TextIO, _Unwritten(sys.stdout)))


def _say(line: str) -> None:
    """``line`` on stderr, if stderr takes it (a full or closed one is not worth a traceback);
    the interpreter's own stderr when the model's code set ``sys.stderr`` to None."""
    stream = sys.stderr if sys.stderr is not None else sys.__stderr__
    if stream is None:  # started without a stderr
        return
    with contextlib.suppress(OSError, ValueError, AttributeError):
        _blocking(stream)
        stream.write(line)
        stream.flush()


def _blocking(stream: TextIO) -> None:
    """``stream``'s descriptor in blocking mode: the model's code may have made the pipe
    non-blocking (``O_NONBLOCK`` is shared by every copy of it), where a write past the pipe's
    buffer would stop short."""
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        os.set_blocking(stream.fileno(), True)


def print_out(text: str, what: str, written: Sequence[str]) -> int:
    """Print ``text`` (``what`` it is) on stdout, after the run's files (``written``, as shown)
    were written; the run's status. A reader that closed the pipe (``partition ... | head -1``)
    ends the run quietly with status 0, as it took what it wanted and the files are whole; any
    other failure (a full disk, ``>/dev/full``) is one line naming the files that were written
    (OutputError, status 2)."""
    try:
        if sys.stdout is not None:  # None: started with stdout closed; nothing to print to
            _blocking(sys.stdout)
            sys.stdout.write(text)
            sys.stdout.flush()
    except BrokenPipeError:
        return 0
    except (OSError, ValueError) as exc:
        reason = (exc.strerror if isinstance(exc, OSError) else None) or str(exc)
        kept = (
            f"; {' and '.join(written)} {'was' if len(written) == 1 else 'were'} written all the same"
            if written
            else ""
        )
        raise OutputError(f"cannot print {what} on stdout ({reason}){kept}") from None
    return 0


def _flush_or_drop(stream: TextIO | None) -> None:
    """Flush ``stream``; if that fails (a closed pipe, a full disk), point its file descriptor at
    /dev/null, so what it still holds goes nowhere instead of failing again when the
    interpreter exits ("Exception ignored ... BrokenPipeError")."""
    if stream is None:
        return
    try:
        stream.flush()
    except (OSError, ValueError):
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, stream.fileno())
            finally:
                os.close(devnull)
            stream.flush()


def _own_stderr() -> None:
    """Stderr for a ``partition`` process, which every error's line goes to: a file descriptor 2
    that was closed (``2>&-``) is /dev/null from here on (before, ``sys.stderr`` was None and a
    plan failed at its start with status 1 and no file), and a stderr that fails (a full disk,
    a closed pipe) is dropped (:class:`_StderrOrNothing`), so an error still ends with its own
    status (2), not 1 from a traceback nobody can see."""
    try:
        os.fstat(2)
    except OSError:
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            if devnull != 2:
                os.dup2(devnull, 2)
                os.close(devnull)
            sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)
    sys.stderr = cast(TextIO, _StderrOrNothing(sys.stderr))


def _default_signals() -> None:
    """SIGINT and SIGTERM at their default actions (unless ignored) in a child the model's code
    forks (``os.fork``, ``multiprocessing``): the CLI's handlers there would run the CLI's own
    ending in the copy (its ``interrupted`` line, a second one) when it is stopped."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            with contextlib.suppress(ValueError):  # not Python's main thread
                _REAL_SIGNAL(signum, signal.SIG_DFL)


def _stream_files() -> frozenset[tuple[int, int]]:
    """The files (device, inode) stdout and stderr are, as the process started."""
    files = set()
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            st = os.fstat(fd)
            files.add((st.st_dev, st.st_ino))
    return frozenset(files)


def _copies_at_devnull(files: frozenset[tuple[int, int]]) -> Callable[[], None]:
    """For a child the model's code forks: every file descriptor but 0, 1 and 2 that is one of
    ``files`` (the copies of stdout and stderr the CLI keeps to show its own lines while the
    model's code has fds 1 and 2 at /dev/null) pointed at /dev/null. A daemon forked twice,
    out of reach of :func:`_stop_children`, would hold the user's pipe open with them
    (``partition ... | cat`` waiting for it); the model's child processes write nowhere."""

    def blank() -> None:
        try:
            fds = [int(name) for name in os.listdir("/proc/self/fd")]
        except OSError:
            fds = list(range(3, 256))
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            for fd in fds:
                with contextlib.suppress(OSError):
                    st = os.fstat(fd)
                    if fd > 2 and fd != devnull and (st.st_dev, st.st_ino) in files:
                        os.dup2(devnull, fd, inheritable=False)
            os.close(devnull)

    return blank


class _StderrOrNothing:
    """``sys.stderr`` of a ``partition`` process: a write or flush that fails drops stderr
    (:func:`_flush_or_drop`: file descriptor 2 at /dev/null) instead of raising."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        if self._stream is not None:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                _flush_or_drop(self._stream)
        return len(text)

    def flush(self) -> None:
        _flush_or_drop(self._stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _leave(status: int, *, model_ran: bool) -> int:
    """The end of a ``partition`` process with ``status``: stdout and stderr flushed (or
    dropped, :func:`_flush_or_drop`). After an interrupt the process ends at once; a subcommand
    returns ``status`` to the interpreter's exit. After a plan (``model_ran``) it waits up to
    :data:`THREAD_GRACE_S` for the threads and the child processes the model's code started
    (``threading``, ``multiprocessing``, ``subprocess``, ``os.fork``: :func:`_children_left`),
    names those still running in one line, stops the children (:func:`_stop_children`: they
    hold stdout and stderr, so ``partition ... | tee log`` would wait for them) and ends at once
    (``os._exit``: the interpreter's exit would wait for those threads for ever); with nothing
    left it ends by :func:`_end_process`, where Ctrl-C is one line and 130 to the last moment.
    An interrupted plan's children are sent SIGTERM on the way out, without a wait."""
    if status == 130:  # interrupted: nothing to wait for (a stdout nobody reads would block)
        if model_ran:
            _signal_all(_with_descendants(_live_children()), signal.SIGTERM)
        _flush_or_drop(sys.stderr)
        os._exit(status)
    _flush_or_drop(sys.stdout)  # blocks while a pipe is full and unread; Ctrl-C still ends it
    _flush_or_drop(sys.stderr)
    if not model_ran:
        return status
    deadline = time.monotonic() + THREAD_GRACE_S  # one wait for the threads and the children
    left = _threads_left(THREAD_GRACE_S)
    children = _children_left(max(0.0, deadline - time.monotonic()))
    if not left and not children:
        _end_process(status)
    _say(f"{PROG}: note: {_left_running(left, children)}\n")
    _stop_children(children)
    _flush_or_drop(sys.stderr)
    os._exit(status)


def _end_process(status: int) -> NoReturn:
    """End a plan's process with ``status``, its threads done: the exit handlers (``atexit``:
    the model's, ``multiprocessing``'s, logging's) run with Ctrl-C still one line and status 130,
    stdout and stderr are flushed, and the process ends (``os._exit``). The interpreter's own
    teardown is skipped: Python puts SIGINT back to its default action before it frees its
    modules (a second or more once TensorFlow is loaded), so a Ctrl-C just after "Plan written
    to ..." killed the process without a word. Objects still alive are not finalised, which
    Python's exit does not promise either (a file the model's code opened, wrote and never
    closed may keep its last buffered lines). The handlers run for at most
    :data:`~partitioner.cli.exits.EXIT_HANDLERS_GRACE_S`; one that raises or never returns is one
    ``note:`` line (:func:`~partitioner.cli.exits.run_exit_handlers`)."""
    for note in run_exit_handlers():
        _say(f"{PROG}: note: {note}\n")
    _interrupt_exits("interrupted")  # again: an exit handler may have replaced it
    _flush_or_drop(sys.stdout)
    _flush_or_drop(sys.stderr)
    os._exit(status)


def _left_running(threads: Sequence[threading.Thread], children: Sequence[_Child]) -> str:
    """``the model's code left 1 thread running ('spinner'); exiting anyway after 2 s``, with
    the child processes it started too, by name and pid (they are stopped)."""
    parts = []
    kinds = (
        ("thread", "threads", [t.name for t in threads]),
        ("child process", "child processes", [c.name for c in children]),
    )
    for one, many, names in kinds:
        if names:
            shown = ", ".join(escape_control(repr(name)) for name in names[:5])
            more = f" and {len(names) - 5} more" if len(names) > 5 else ""
            parts.append(f"{len(names)} {one if len(names) == 1 else many} running ({shown}{more})")
    if children:
        pids = ", ".join(str(c.pid) for c in children[:5]) + (", ..." if len(children) > 5 else "")
        parts[-1] += f" as pid{'s' if len(children) > 1 else ''} {pids}"
    stopped = "; the child processes are stopped" if children else ""
    return (
        f"the model's code left {' and '.join(parts)}; exiting anyway after "
        f"{THREAD_GRACE_S:g} s{stopped}"
    )


PROC = "/proc"
"""Where Linux lists its processes; without it (another system) only the ``multiprocessing``
children of the model's code are known."""

STOP_GRACE_S = 1.0
"""How long a child process the model's code left running has to end after SIGTERM before it is
killed (SIGKILL)."""


@dataclass(frozen=True)
class _Child:
    """A child process of this one: its pid and its name (a ``multiprocessing`` Process's own,
    else the command name /proc gives)."""

    pid: int
    name: str


def _children_left(grace_s: float) -> list[_Child]:
    """The model's child processes still running after waiting up to ``grace_s`` for them to
    end (:func:`_live_children`)."""
    deadline = time.monotonic() + grace_s
    while True:
        left = _live_children()
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return left
        time.sleep(min(0.1, remaining))


def _live_children() -> list[_Child]:
    """Every running child of this process that /proc lists, however it was started
    (``subprocess``, ``os.fork``, ``multiprocessing``), but ``multiprocessing``'s daemons (its
    exit handler stops them) and the helpers that end with this process (:func:`_helper_pids`);
    the product's own children that it waited for are gone. Without /proc, the
    ``multiprocessing`` children that are not daemons (the interpreter's exit joins them)."""
    mp = sys.modules.get("multiprocessing")
    processes = list(mp.active_children()) if mp is not None else []
    table = _process_table()
    if table is None:
        return [_Child(p.pid, p.name) for p in processes if not p.daemon and p.is_alive()]
    names = {p.pid: str(p.name) for p in processes}
    skip = _helper_pids() | {p.pid for p in processes if p.daemon}
    me = os.getpid()
    return [
        _Child(pid, names.get(pid, name))
        for pid, (parent, name, state) in sorted(table.items())
        if parent == me and state not in ("Z", "X") and pid not in skip
    ]


def _helper_pids() -> set[int]:
    """Child processes started for this one's own use, which end when it does (each reads a
    pipe from it): ``multiprocessing``'s resource tracker and fork server, and the ``ilp``
    solver's CP-SAT worker. Read from private attributes, defensively: where they are not found
    the process is named and stopped like any other."""
    found: set[int] = set()
    for module, path in (
        ("multiprocessing.resource_tracker", ("_resource_tracker", "_pid")),
        ("multiprocessing.forkserver", ("_forkserver", "_forkserver_pid")),
        ("partitioner.solvers.ilp", ("_WORKER", "_proc", "pid")),
    ):
        value: Any = sys.modules.get(module)
        for attr in path:
            value = getattr(value, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            found.add(value)
    return found


def _process_table() -> dict[int, tuple[int, str, str]] | None:
    """Every process /proc lists: pid -> (parent pid, command name, state letter); None
    without a /proc that lists this process."""
    try:
        entries = os.listdir(PROC)
    except OSError:
        return None
    table: dict[int, tuple[int, str, str]] = {}
    for entry in entries:
        stat = _proc_stat(entry) if entry.isdigit() else None
        if stat is None:
            continue
        # "PID (NAME) STATE PPID ...": the name may hold spaces and parentheses
        end = stat.rfind(")")
        name, fields = stat[stat.find("(") + 1 : end], stat[end + 1 :].split()
        if len(fields) >= 2 and fields[1].isdigit():
            table[int(entry)] = (int(fields[1]), name, fields[0])
    return table if os.getpid() in table else None


def _proc_stat(pid: int | str) -> str | None:
    """The /proc stat line of process ``pid``; None when it is gone (or there is no /proc)."""
    try:
        with open(os.path.join(PROC, str(pid), "stat"), "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return None


def _stop_children(children: Sequence[_Child]) -> None:
    """Stop ``children`` and every process under them (a shell's command holds stdout too):
    SIGTERM, then SIGKILL for those still running after :data:`STOP_GRACE_S`, waiting up to as
    long again for them to end; this process's children are reaped."""
    pids = _with_descendants(children)
    for signum in (signal.SIGTERM, signal.SIGKILL):
        _signal_all(pids, signum)
        deadline = time.monotonic() + STOP_GRACE_S
        pids = _still_running(pids)
        while pids and time.monotonic() < deadline:
            time.sleep(0.05)
            pids = _still_running(pids)


def _with_descendants(children: Sequence[_Child]) -> list[int]:
    """The pids of ``children`` and of every process under them that /proc lists."""
    pids = [c.pid for c in children]
    table = _process_table() if pids else None
    return pids if table is None else pids + _descendants(table, pids)


def _descendants(table: Mapping[int, tuple[int, str, str]], roots: Sequence[int]) -> list[int]:
    """The processes under ``roots`` in ``table`` (children, their children, ...)."""
    seen = set(roots)
    found: list[int] = []
    frontier = set(roots)
    while frontier:
        frontier = {pid for pid, row in table.items() if row[0] in frontier and pid not in seen}
        seen |= frontier
        found += sorted(frontier)
    return found


def _signal_all(pids: Sequence[int], signum: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signum)


def _still_running(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` that have not ended; this process's children that ended are reaped.
    (Without /proc the pids are all this process's children.)"""
    alive = []
    for pid in pids:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                continue  # ended, and now reaped
        except ChildProcessError:  # not a child of this process, or reaped already
            stat = _proc_stat(pid)
            if stat is None or stat[stat.rfind(")") + 2 :][:1] in ("Z", "X"):
                continue
        alive.append(pid)
    return alive


def _threads_left(grace_s: float) -> list[threading.Thread]:
    """The threads besides this one that would keep the interpreter from exiting (alive and not
    daemons), after waiting up to ``grace_s`` for them to end."""
    deadline = time.monotonic() + grace_s
    while True:
        left = [
            t
            for t in threading.enumerate()
            if t is not threading.current_thread() and not t.daemon and t.is_alive()
        ]
        remaining = deadline - time.monotonic()
        if not left or remaining <= 0:
            return left
        left[0].join(timeout=min(0.1, remaining))


def _tf_config_cluster(topology: str) -> dict[str, list[str]] | None:
    """TF_CONFIG's cluster when the plan is for ``--topology tf-config`` (the emitted
    multi-worker program then names the real task addresses), else None."""
    from cost_models.devices.tf_config import parse_tf_config
    from cost_models.devices.topology import TF_CONFIG_SPEC, bounded_tf_config_text

    text = bounded_tf_config_text()
    if topology.strip().lower() not in (TF_CONFIG_SPEC, "tf_config") or text is None:
        return None
    return parse_tf_config(text).as_dict()


def _model_file(spec: str) -> str | None:
    """The real path of the model file of ``PATH[:ATTR]`` (None where it cannot be known)."""
    from partitioner.cli.loader import split_spec

    try:
        return os.path.realpath(split_spec(spec)[0])
    except (OSError, ValueError):
        return None


def _internal_error(exc: BaseException, model_file: str | None = None) -> int:
    """One line for an exception that is not a PartitionError: the model's own when it was
    raised in ``model_file`` (a function of the model file that the planner called: not a bug
    of the planner), else a bug of ours."""
    where = _user_frame(exc, model_file)
    if where is not None:
        # the model file ran, so TensorFlow is imported (_plan imports it before loading)
        from partitioner.core.errors import error_line

        return _error(
            ModelLoadError(
                f"the model's code raised {type(exc).__name__}: {error_line(exc)} (in "
                f"{where.name}() of {where.filename}, line {where.lineno}); fix the model file"
            )
        )
    text = str(exc).strip()
    first = escape_control(text.splitlines()[0]) if text else ""
    _say(
        f"{PROG}: internal error: {type(exc).__name__}: {first} (run with --verbose for "
        "the traceback and report it)\n"
    )
    return 1


def _user_frame(exc: BaseException, model_file: str | None) -> traceback.FrameSummary | None:
    """The innermost frame of ``exc``'s traceback in ``model_file``, or None."""
    if model_file is None:
        return None
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if os.path.realpath(f.filename) == model_file]
    return mine[-1] if mine else None


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    """Check every option and output before any slow work, then plan, write and report. Every
    path is made absolute first: the model's code may change the working directory."""
    from partitioner.api import prepare
    from partitioner.cli.loader import check_model_path

    paths = _resolve_paths(args)
    _check_counts(args)
    if paths.topology_file is not None:
        _check_topology_file(paths.topology_file)
    prepared = prepare(*_options(args, paths))
    if paths.no_cache is not None:  # the profiler would find the home Keras's import made
        logger.warning("profile cache not written (%s)", paths.no_cache)
        prepared = replace(prepared, write_cache=False)
    # checked as given (its messages name it so); nothing has run yet: it is the same file
    model_file = Path(paths.start, check_model_path(args.model))
    inputs = [("the model file, an input of this run", model_file)]
    if keras_config_file().exists():  # read when Keras is imported, before the model's code
        inputs.append(("Keras's configuration file, which this run reads", keras_config_file()))
    if paths.topology_file is not None:
        inputs.append(("the topology file, an input of this run", paths.topology_file))
    _check_outputs(paths, inputs)
    started = time.perf_counter()
    model, plan, code = _plan(args, paths, prepared, err, inputs)
    from partitioner.report.terminal import escape, render_plan

    # Drawn before anything is written, so a report that cannot be drawn fails the run whole.
    with out.capture() as report:
        render_plan(plan, out, verbose=args.verbose, spell=cli_message)
    # Layers may import more of the user's modules while traced: checked again, then written.
    _check_outputs(paths, [*inputs, *_imported(paths, code)])
    _write_outputs(args, paths, model, plan)
    for cache in [*code.traces, *code.profiles]:  # only now: a failed run leaves no new file
        cache.flush()
    # The files first, then stdout: a stdout that fails (a closed pipe, a full disk) loses none.
    what = plan.strategy.describe() if plan.strategy is not None else "the placement"
    labels = {"--out": "Plan", "--report": "Report", "--emit": f"Model code ({what})"}
    shown = [paths.shown(written.given, written.path) for written in paths.outputs]
    with out.capture() as footer:
        for written, name in zip(paths.outputs, shown):
            out.print(f"{escape(labels[written.option])} written to {escape(name)}")
        if args.verbose:
            out.print(f"Total wall time: {time.perf_counter() - started:.2f} s")
    return print_out(report.get() + footer.get(), "the report", [escape_control(n) for n in shown])


def _plan(
    args: argparse.Namespace,
    paths: _Paths,
    prepared: Prepared,
    err: Console,
    inputs: Sequence[tuple[str, Path]],
) -> tuple[Any, Plan, _UserCode]:
    """Import TensorFlow, load the model and plan it, with progress on ``err``; the plan's
    phases start with loading the model. Also what the model's code brought in (:class:`_UserCode`):
    once it is loaded, no output may be a module it imported or a file it read (checked before
    planning, and again after it)."""
    from dataclasses import replace

    from partitioner.report.terminal import PhaseProgress

    with (
        PhaseProgress(err, enabled=err.is_terminal) as progress,
        _quiet_native_stderr(not args.verbose, cast(TextIO, err.file)),
        _stdout_kept_from_children(),
        _keeping_umask(),
    ):
        progress("importing TensorFlow")
        import tensorflow  # noqa: F401  (import cost shown as its own phase)

        _INTERRUPTS.honour()  # one that landed in the import machinery was swallowed there

        t0 = time.perf_counter()
        from cost_models.measure.profiled import ProfileWrites
        from partitioner.api import partition_prepared
        from partitioner.cli.loader import load_model

        progress(f"loading {args.model}")
        code = _UserCode(frozenset(sys.modules), set())
        own_sigint = signal.getsignal(signal.SIGINT)  # the model's code may install its own
        # Planning needs shapes, not weight values: the model is built without its weights
        # unless its layers are timed on this machine's devices.
        with _model_code(paths, code):
            model = load_model(paths.model, weightless=not (args.profile or args.profile_ops))
        _rearm_interrupt(own_sigint)
        load_s = time.perf_counter() - t0
        _check_outputs(paths, [*inputs, *_imported(paths, code)])
        prepared = _trace_cache_kept(paths, prepared)
        code.traces.extend(_trace_cache_of(paths, prepared, code))

        def phase(message: str, completed: float | None = None, total: float | None = None) -> None:
            _INTERRUPTS.honour()
            _rearm_interrupt(own_sigint)
            progress(message, completed, total)

        with _model_code(paths, code):  # layers may load more
            cache = code.traces[0] if code.traces else None
            code.profiles.append(ProfileWrites())
            plan = partition_prepared(
                model, prepared, progress=phase, trace_cache=cache, profile_writes=code.profiles[0]
            )
        _rearm_interrupt(own_sigint)
    return model, replace(plan, phase_times_s=(("load", load_s), *plan.phase_times_s)), code


def _trace_cache_kept(paths: _Paths, prepared: Prepared) -> Prepared:
    """``prepared`` without the trace cache when its directory no longer resolves where it did
    before the model's code ran (the code put a symbolic link on it): a warning, and the run
    traces and writes no entry there."""
    from dataclasses import replace

    cache = paths.trace_cache_dir
    if cache is None or os.path.realpath(cache) == cache:
        return prepared
    logger.warning(
        "the cache directory %s now leads to %s (the model's code put a symbolic link on it); "
        "tracing without the trace cache",
        cache,
        os.path.realpath(cache),
    )
    return replace(prepared, measure=replace(prepared.measure, trace_cache=False))


def _trace_cache_of(paths: _Paths, prepared: Prepared, code: _UserCode) -> list[Any]:
    """The run's trace cache in the directory resolved before the model's code ran, keyed by
    the data files that code read too; none without one."""
    if paths.trace_cache_dir is None or not prepared.measure.trace_cache:
        return []
    from partitioner.cli.loader import user_files_read
    from passes.trace_cache import TraceCache

    files = tuple(str(f) for f in user_files_read(code.read))
    return [TraceCache(Path(paths.trace_cache_dir), files=files)]


@contextlib.contextmanager
def _model_code(paths: _Paths, code: _UserCode) -> Iterator[None]:
    """Around the model's code (its loading, then its layers traced): watched
    (:func:`_watching_the_model`), its SIGINT handler kept out, and what it replaced of the
    standard library and ``sys.modules`` put back when it is done, before the run's own code
    opens or writes anything with them (a model replacing ``builtins.open`` made the next
    watch fail as an internal error, campaign 34s)."""
    with (
        standard_library_kept(),
        modules_kept(),
        _watching_the_model(paths, code),
        _sigint_kept(),
    ):
        yield


@contextlib.contextmanager
def _watching_the_model(paths: _Paths, code: _UserCode) -> Iterator[None]:
    """While the model's code runs: the files Python opens (the loader's audit hook) into
    ``code.read``, and every open of an existing output by anything, TensorFlow's C++ file
    layer too (:func:`partitioner.cli.watch.watching_opens`), into ``code.opened``."""
    from partitioner.cli.loader import recording_files_read
    from partitioner.cli.watch import watching_opens

    with (
        recording_files_read(code.read),
        watching_opens([out.path for out in paths.outputs], code.opened),
    ):
        yield


@contextlib.contextmanager
def _keeping_umask() -> Iterator[None]:
    """The process's umask as it was before the model's code ran, again after it: a model file
    that calls ``os.umask(0o777)`` made the run's new outputs mode 0000 (unreadable to the
    user who asked for them)."""
    umask = os.umask(0o077)  # read it (the only way), then put it back at once
    os.umask(umask)
    try:
        yield
    finally:
        os.umask(umask)


@contextlib.contextmanager
def _sigint_kept() -> Iterator[None]:
    """While the model's code runs, its ``signal.signal(SIGINT, ...)`` (or ``SIGTERM``) leaves
    the run's handler in place (and returns it): Ctrl-C and a polite kill (``timeout``, systemd)
    are how the user stops the run, and a model that ignored one (``SIG_IGN``) had it discarded
    by the kernel, the run going on to replace the old plan with status 0 (campaign 34v;
    :func:`_rearm_interrupt` restores a handler after the fact, which cannot bring that back)."""

    def kept(signum: int, handler: Any) -> Any:
        main = threading.current_thread() is threading.main_thread()
        if signum in (signal.SIGINT, signal.SIGTERM) and main:  # SIGTERM too (campaign 34v)
            return signal.getsignal(signum)
        return _REAL_SIGNAL(signum, handler)

    signal.signal = kept  # type: ignore[assignment]
    try:
        yield
    finally:
        signal.signal = _REAL_SIGNAL


def _rearm_interrupt(handler: Any) -> None:
    """Install ``handler``, the SIGINT handler of the run before the model's code ran, again
    (after the model is loaded, at each phase of the plan, and after it). A native library may
    have replaced it underneath: OR-Tools' CP-SAT catches Ctrl-C while it solves (to stop its
    search) and leaves SIGINT at its default action, which would end the run without a word.
    And a model file may install its own (``signal.signal(SIGINT, ...)`` at import), which made
    Ctrl-C the model's error (status 2) instead of the run's one line and 130."""
    if handler is not None and threading.current_thread() is threading.main_thread():
        _REAL_SIGNAL(signal.SIGINT, handler)  # not the model's view of it (_sigint_kept)


def _write_outputs(args: argparse.Namespace, paths: _Paths, model: Any, plan: Plan) -> None:
    """The plan (``--out``), the HTML report (``--report``) and the placed code (``--emit``):
    each made in memory first, then written all together, or none (a run that fails writes no
    file, and leaves every file it would have replaced as it was). Paths are the ones resolved
    before the model's code ran."""
    files: list[tuple[str, str]] = []
    for output in paths.outputs:
        if output.option == "--out":
            files.append((output.path, plan.to_json()))
        elif output.option == "--report":
            from partitioner.report.html import render_html

            files.append((output.path, marked(render_html(plan), "<!--")))  # replaceable later
        else:
            from partitioner.cli.loader import loaded_attr, split_spec
            from passes.rewrite.codegen import emit_plan_module

            attr = loaded_attr(paths.model) or split_spec(paths.model)[1]
            source = emit_plan_module(
                model, plan, model_source=paths.model_file, model_attr=attr,
                cluster_addresses=_tf_config_cluster(args.topology),
            )  # fmt: skip
            files.append((output.path, marked(source, "#")))  # a later run may replace it
    for output in paths.outputs:  # rendering may have run the model's code (a get_config)
        shown = paths.shown(output.given, output.path)
        _check_still_resolved(output.path, output.option, shown)
        _check_still_ours(output, shown)
    if files:
        # Resolved paths: a link appearing at one now is replaced itself, never written through.
        write_all_atomic(files, follow_symlinks=False, only_ours=True)
