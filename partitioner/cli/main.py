"""``partition PATH[:ATTR] --gpus N``: trace, cost, place and report a Keras model.

Every error a user can cause is printed as one line on stderr with a non-zero exit; nothing is
written unless the whole plan is. TensorFlow's start-up noise is kept off the terminal unless
``--verbose``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NoReturn

from rich.console import Console

from partitioner.core.errors import OutputError, PartitionError, UsageError
from partitioner.core.ir import Schedule

__all__ = ["build_parser", "main"]

PROG = "partition"


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad command line on one line."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    from cost_models.devices.catalog import device_type_names
    from partitioner.solvers import solver_names

    parser = _Parser(
        prog=PROG,
        description="Place a Keras model's layers on devices: trace, cost, solve, report. "
        f"Also: '{PROG} show PLAN.json' re-renders a saved plan; '{PROG} devices' lists the "
        f"device catalog; '{PROG} worker --task I --cluster FILE' serves a TF cluster task.",
    )
    parser.add_argument("model", metavar="PATH[:ATTR]", help="Python file with the model")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="number of devices to place on (required unless --topology names a file)",
    )
    parser.add_argument(
        "--device-type",
        default="h100",
        help=f"device type from the catalog ({', '.join(device_type_names())}); default h100",
    )
    parser.add_argument("--batch-size", type=int, default=32, help="batch size (default 32)")
    parser.add_argument(
        "--solver",
        default="auto",
        help=f"placement solver ({', '.join(solver_names())}); default auto",
    )
    parser.add_argument(
        "--topology",
        "--link",
        dest="topology",
        default="pcie",
        metavar="pcie|nvlink|KIND|FILE",
        help="links between the devices: pcie, nvlink, a catalog link kind, or a JSON/TOML "
        "topology file (devices, hosts, links; overrides --gpus and --device-type)",
    )
    parser.add_argument("--optimizer", default="adam", help="optimizer, for memory (default adam)")
    parser.add_argument(
        "--input-shape",
        default=None,
        help="input shape without the batch dimension, e.g. 32,32,3 (needed for unknown dims)",
    )
    parser.add_argument(
        "--memory-limit",
        default=None,
        help="memory per device, e.g. 16GiB (default: the catalog's figure for the device type)",
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
        "--profile",
        action="store_true",
        help="measure layer times on the devices present (cached on disk) instead of estimating",
    )
    parser.add_argument(
        "--profile-ops",
        action="store_true",
        help="time every op inside the training step on this machine's CPU (cpu devices)",
    )
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
    parser.add_argument("--verbose", "-v", action="store_true", help="phase timings and logs")
    return parser


def _parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        dims = tuple(int(p) for p in text.replace("x", ",").split(",") if p.strip())
    except ValueError:
        raise UsageError(f"--input-shape {text!r} is not a list of integers like 32,32,3") from None
    if not dims or any(d < 1 for d in dims):
        raise UsageError(f"--input-shape {text!r} needs positive integers like 32,32,3")
    return dims


def _check_out(path: str | None, option: str = "--out") -> None:
    if path is None:
        return
    target = Path(path)
    parent = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise OutputError(f"{option} {path} is a directory; give a file path")
    if not parent.is_dir():
        raise OutputError(f"{option} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise OutputError(f"{option} {path} is not writable; choose another path")
    try:
        # os.access says yes to root everywhere; a real (invisible, unnamed) file says truly.
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as exc:
        raise OutputError(
            f"{option} {path} is not writable ({exc.strerror or exc}); choose another path"
        ) from None


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output path is writable and no two options name the same file."""
    named: dict[Path, str] = {}
    for option, path in (("--out", args.out), ("--report", args.report), ("--emit", args.emit)):
        _check_out(path, option)
        if path is None:
            continue
        key = Path(path).resolve()
        if key in named:
            raise UsageError(f"{named[key]} and {option} both name {path}; give different files")
        named[key] = option
    model_file = Path(args.model.rsplit(":", 1)[0] if ":" in args.model else args.model)
    for option, path in (("--out", args.out), ("--report", args.report), ("--emit", args.emit)):
        if path is not None and model_file.exists() and Path(path).resolve() == model_file.resolve():
            raise UsageError(f"{option} {path} is the model file itself; refusing to overwrite it")


def _check_pipeline_options(args: argparse.Namespace, num_devices: int) -> None:
    if not args.pipeline:
        for option, value in (("--microbatches", args.microbatches), ("--schedule", args.schedule)):
            if value is not None:
                raise UsageError(f"{option} needs --pipeline (plain splits run whole batches)")
        return
    if num_devices < 2:
        raise UsageError(
            "--pipeline needs at least 2 devices: a plan on one device has no stages to overlap "
            "(use --gpus 2 or more, or drop --pipeline)"
        )
    if args.microbatches is not None:
        if args.microbatches < 1:
            raise UsageError(f"--microbatches must be at least 1, got {args.microbatches}")
        if args.batch_size % args.microbatches:
            raise UsageError(
                f"--batch-size {args.batch_size} is not divisible by --microbatches "
                f"{args.microbatches}; pick M that divides the batch"
            )


@contextlib.contextmanager
def _quiet_native_stderr(enabled: bool) -> Iterator[None]:
    """Silence C++ start-up logging (absl, oneDNN, CUDA probes) written straight to fd 2."""
    if not enabled:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _configure_logging(verbose: bool) -> None:
    if not verbose:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    for noisy in ("tensorflow", "absl", "h5py"):
        logging.getLogger(noisy).setLevel(logging.INFO if verbose else logging.ERROR)


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
        render_plan(load_plan(args.plan), out, verbose=args.verbose)
    except PartitionError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.exit_code
    return 0


def _devices(argv: Sequence[str], out: Console) -> int:
    from rich.table import Table

    from cost_models.devices.catalog import catalog
    from partitioner.core.units import format_bytes

    _devices_parser().parse_args(argv)
    table = Table(title="Device catalog (cost_models/data/devices.json)", title_justify="left")
    for column in ("type", "fp32 TFLOP/s", "bf16 TFLOP/s", "memory", "bandwidth", "link", "source"):
        table.add_column(column, justify="left" if column in ("type", "link", "source") else "right")
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
    out.print(table)
    return 0


def _raise_interrupt(signum: int, frame: object) -> NoReturn:
    raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "show":
        return _show(argv[1:], Console())
    if argv and argv[0] == "devices":
        return _devices(argv[1:], Console())
    if argv and argv[0] == "worker":
        from partitioner.cli.worker import main as worker_main

        return worker_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    # A polite kill (SIGTERM) unwinds like Ctrl-C, so atomic writers remove their temporary files.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    _configure_logging(args.verbose)
    out = Console()
    # Progress goes to a copy of stderr, so it still shows while TensorFlow's native start-up
    # logging (written straight to file descriptor 2) is silenced.
    err = Console(file=os.fdopen(os.dup(2), "w"), stderr=True)
    try:
        return _run(args, out, err)
    except PartitionError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return exc.exit_code
    except KeyboardInterrupt:
        sys.stderr.write(f"{PROG}: interrupted; no file was left half-written\n")
        return 130
    except Exception as exc:
        if args.verbose:
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(
            f"{PROG}: internal error: {type(exc).__name__}: {first} (run with --verbose for "
            "the traceback and report it)\n"
        )
        return 1


def _run(args: argparse.Namespace, out: Console, err: Console) -> int:
    from cost_models.devices.catalog import get_device_type
    from cost_models.devices.topology import load_topology
    from cost_models.estimate.memory import parse_optimizer
    from partitioner.cli.loader import check_model_path
    from partitioner.solvers import get_solver

    # 1. Validate every option before any slow work.
    if args.gpus is not None and args.gpus < 1:
        raise UsageError(f"--gpus must be at least 1, got {args.gpus}")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be at least 1, got {args.batch_size}")
    device = get_device_type(args.device_type)
    parse_optimizer(args.optimizer)
    get_solver(args.solver, seed=args.seed, time_limit_s=args.time_limit)
    input_shape = _parse_shape(args.input_shape)
    memory_limit_bytes = None
    if args.memory_limit is not None:
        from partitioner.core.units import parse_bytes

        try:
            memory_limit_bytes = parse_bytes(args.memory_limit)
        except ValueError as exc:
            raise UsageError(f"--memory-limit {exc}") from None
    topology = load_topology(
        args.topology,
        device_type=device.name,
        num_devices=args.gpus,
        memory_limit_bytes=memory_limit_bytes,
    )
    _check_pipeline_options(args, topology.num_devices)
    _check_outputs(args)
    check_model_path(args.model)

    # 2. Load, plan, report.
    started = time.perf_counter()
    from partitioner.report.terminal import PhaseProgress

    with (
        PhaseProgress(err, enabled=err.is_terminal) as progress,
        _quiet_native_stderr(not args.verbose),
    ):
        progress("importing TensorFlow")
        import tensorflow  # noqa: F401  (import cost shown as its own phase)

        t0 = time.perf_counter()
        from partitioner.api import partition
        from partitioner.cli.loader import load_model

        progress(f"loading {args.model}")
        model = load_model(args.model)
        load_s = time.perf_counter() - t0
        plan = partition(
            model,
            gpus=args.gpus,
            device_type=device.name,
            batch_size=args.batch_size,
            solver=args.solver,
            topology=args.topology,
            optimizer=args.optimizer,
            input_shape=input_shape,
            memory_limit_bytes=memory_limit_bytes,
            seed=args.seed,
            time_limit_s=args.time_limit,
            pipeline=args.pipeline,
            num_microbatches=args.microbatches,
            schedule=args.schedule or Schedule.ONE_F_ONE_B.value,
            profile=args.profile,
            profile_ops=args.profile_ops,
            progress=progress,
        )
    from dataclasses import replace

    plan = replace(plan, phase_times_s=(("load", load_s), *plan.phase_times_s))
    if args.out is not None:
        plan.save(args.out)
    if args.report is not None:
        from partitioner.report.html import write_html_report

        write_html_report(plan, args.report)
    if args.emit is not None:
        from partitioner.cli.loader import split_spec
        from passes.rewrite.codegen import emit_plan_module, write_placed_module

        write_placed_module(
            args.emit, emit_plan_module(model, plan, model_source=split_spec(args.model)[0])
        )
    from partitioner.report.terminal import render_plan

    render_plan(plan, out, verbose=args.verbose)
    if args.out is not None:
        out.print(f"Plan written to {args.out}")
    if args.report is not None:
        out.print(f"Report written to {args.report}")
    if args.emit is not None:
        out.print(f"Placed model code written to {args.emit}")
    if args.verbose:
        out.print(f"Total wall time: {time.perf_counter() - started:.2f} s")
    return 0
