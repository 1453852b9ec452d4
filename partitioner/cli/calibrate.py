"""``partition calibrate``: measure a cluster's (or this host's) devices into a topology file.

    partition calibrate --cluster cluster.json --out calibrated.json   # the workers of a file
    partition calibrate --out calibrated.json                          # the workers of $TF_CONFIG
    partition calibrate --out local.json                               # this host's GPUs

then ``partition model.py --topology calibrated.json --profile-ops``. What is measured and how:
:mod:`passes.cluster.calibrate`. Progress goes to stderr; errors are one line, exit 2, and no
file is written. ``--rounds`` and ``--timeout`` are checked against the library's bounds
(:class:`passes.cluster.calibrate.CalibrationOptions`) before TensorFlow loads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from partitioner.cli.parsing import OneLineParser
from partitioner.cli.quiet import import_quietly
from partitioner.core.errors import OutputError, PartitionError, UsageError, escape_control

if TYPE_CHECKING:
    from passes.cluster.calibrate import CalibrationOptions

__all__ = ["FLAGS", "build_parser", "cli_message", "main"]

PROG = "partition calibrate"
QUICK_ROUNDS = 5
DEFAULT_ROUNDS = 15

FLAGS: Mapping[str, str] = MappingProxyType(
    {
        "cluster": "--cluster {}",
        "rounds": "--rounds {}",
        "step_timeout_s": "--timeout {}",
        "timeout_s": "--timeout {}",
    }
)
"""The library's argument names that only this command has -> its flags (the shared ones,
``device_type='h100'`` -> ``--device-type h100``, are :data:`partitioner.cli.main.FLAGS`)."""


def build_parser() -> argparse.ArgumentParser:
    from passes.cluster.calibrate import MAX_ROUNDS, MAX_TIMEOUT_S, MIN_ROUNDS

    parser = OneLineParser(
        prog=PROG,
        description="Measure the devices a plan will use (links, the replicas' all-reduce, "
        "compute speed) and write them as a topology file for partition --topology.",
    )
    parser.add_argument("--out", required=True, help="the topology file to write (.json)")
    parser.add_argument(
        "--cluster",
        default=None,
        help='cluster file {"worker": ["host:port", ...]} or TF_CONFIG form (default: '
        "$TF_CONFIG; neither: this host's GPUs)",
    )
    parser.add_argument(
        "--device-type", default=None, help="catalog type of the measured devices (default cpu)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help=f"timed rounds per size ({DEFAULT_ROUNDS}; {MIN_ROUNDS} to {MAX_ROUNDS})",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_ROUNDS} rounds per size")
    parser.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        help=f"seconds a task may take to answer (30; at most {MAX_TIMEOUT_S:g})",
    )
    return parser


def _check_out(path: str, cluster: str | None) -> Path:
    """The file ``--out`` replaces (a symbolic link's target), checked as ``partition``'s outputs
    are: a regular file or new, never one holding binary data (the user's), never the cluster
    file, nor partitioner's own files, Keras's configuration or a cache (campaign 34w: a
    topology written over the packaged catalog failed every later run). Called before
    calibrating and again before writing."""
    from partitioner.core.files import (
        check_output_path,
        check_outside_kept_files,
        check_replaceable,
        same_file,
    )

    if not path.endswith(".json"):
        raise UsageError(f"--out {path}: give a .json path (a topology file)")
    target = check_output_path(path, "cannot write the topology file")
    if cluster and os.path.exists(cluster) and os.path.exists(path) and same_file(path, cluster):
        raise UsageError(f"--out {path} is the cluster file; write the topology elsewhere")
    check_outside_kept_files(os.path.realpath(path), f"--out {path}")
    check_replaceable(target, f"--out {path}")
    return target


def _import_quietly() -> None:
    """TensorFlow imported without its start-up lines, and its Python warnings (a function
    traced per size) quiet."""
    import_quietly("tensorflow", "passes.cluster.calibrate")
    import tensorflow as tf

    tf.get_logger().setLevel("ERROR")


def cli_message(message: str) -> str:
    """A library error as this command spells it: ``rounds=0`` -> ``--rounds 0``,
    ``step_timeout_s=inf`` -> ``--timeout inf`` (:data:`FLAGS`), then the shared names through
    :func:`partitioner.cli.main.cli_message`."""
    from partitioner.cli.main import cli_message as shared

    return shared(message, more_flags=FLAGS)


def _options(args: argparse.Namespace) -> CalibrationOptions:
    """The checked options, before TensorFlow loads (the bounds live in the library; this
    import does not load TensorFlow)."""
    from passes.cluster.calibrate import CalibrationOptions, check_timeout_s

    rounds = (
        args.rounds if args.rounds is not None else (QUICK_ROUNDS if args.quick else DEFAULT_ROUNDS)
    )
    options = CalibrationOptions(
        rounds=rounds, step_timeout_s=args.timeout, device_type=args.device_type
    )
    options.check()
    check_timeout_s("timeout_s", args.timeout)
    return options


def _run(args: argparse.Namespace) -> int:
    options = _options(args)
    target = _check_out(args.out, args.cluster)
    _import_quietly()
    from cost_models.devices.tf_config import tf_config_text
    from passes.cluster.calibrate import calibrate_cluster, calibrate_local

    started = time.monotonic()

    def say(line: str) -> None:
        sys.stderr.write(f"[{time.monotonic() - started:5.1f} s] {line}\n")
        sys.stderr.flush()

    if args.cluster is not None or tf_config_text() is not None:
        cal = calibrate_cluster(args.cluster, options, timeout_s=args.timeout, progress=say)
    else:
        cal = calibrate_local(options, progress=say)
    data = cal.topology_data()
    _check_written(data)
    from partitioner.core.files import write_atomic
    from partitioner.core.jsonfiles import json_digest

    now = _check_out(args.out, args.cluster)
    if now != target:
        raise OutputError(
            f"--out {args.out} now leads to {now}, not to {target} "
            "as when calibration started (a symbolic link on it changed); refusing to write: "
            "run again"
        )
    data = {**data, "digest": json_digest(data)}  # a later run may replace it (its digest)
    write_atomic(target, json.dumps(data, indent=1) + "\n", follow_symlinks=False, only_ours=True)
    from partitioner.cli.main import print_out  # a full or closed stdout: one line, as a plan's

    return print_out(_summary(data, args.out, time.monotonic() - started), "the summary", [args.out])


def _check_written(data: dict[str, object]) -> None:
    """The file reads back as a topology (the planner's own reader), before it is written."""
    from cost_models.devices.topology import parse_topology

    parse_topology(data, origin="the measured topology")


def _summary(data: dict[str, object], out: str, seconds: float) -> str:
    from partitioner.core.units import format_bytes, format_seconds

    lines = []
    for entry in data["links"]:  # type: ignore[attr-defined]
        link = entry["link"]
        lines.append(
            f"link {entry['devices'][0]}<->{entry['devices'][1]}: latency "
            f"{format_seconds(link['latency_s'])}, "
            f"{format_bytes(link['bandwidth_bytes_per_s'])}/s"
        )
    fit: dict[str, Any] = data["all_reduce"]  # type: ignore[assignment]
    lines.append(
        f"all-reduce among {fit['members']}: latency {format_seconds(fit['latency_s'])}, "
        f"{format_bytes(fit['bandwidth_bytes_per_s'])}/s"
        + (f" ({fit['tensors']} tensors)" if "tensors" in fit else "")
    )
    many = fit.get("many_tensors")
    if many is not None:
        lines.append(
            f"all-reduce of {many['tensors']} tensors: latency "
            f"{format_seconds(many['latency_s'])}, {format_bytes(many['bandwidth_bytes_per_s'])}/s"
        )
    client = data["calibration"].get("client")  # type: ignore[attr-defined]
    if client is not None:
        lines.append(
            f"client: {format_seconds(client['step_s'])} per training step besides its ops"
        )
    lines.append(
        f"Topology written to {out} in {seconds:.0f} s; plan with: partition MODEL.py "
        f"--topology {out} --profile-ops"
    )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; errors print one line and return their exit code."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        return _run(args)
    except PartitionError as exc:
        sys.stderr.write(f"{PROG}: error: {escape_control(cli_message(str(exc)))}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; nothing was written\n")
        return 130
