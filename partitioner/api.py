"""The library entry point: ``partitioner.partition(model, gpus=2) -> Plan``.

Orchestrates the one-way flow: validate options (before any slow work), trace the model, cost the
graph, solve, evaluate the chosen plan beside the baselines, and write advice. Nothing imports
this module but the package's lazy ``__init__`` and the CLI.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Protocol

from cost_models.devices.catalog import get_device_type
from cost_models.devices.topology import load_topology, topology_summary
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import parse_optimizer
from partitioner.core.errors import PartitionError, PlanError, UsageError
from partitioner.core.ir import (
    CostedGraph,
    Schedule,
    SolverResult,
    SolveStatus,
    Topology,
    peak_bytes,
)
from partitioner.core.microbatch import INEXACT_UNDER_MICROBATCHES
from partitioner.core.units import format_bytes, format_seconds
from partitioner.plan.model import (
    BaselineResult,
    PipelineInfo,
    Plan,
    load_plan,
    plan_from_solution,
)
from partitioner.simulation.evaluate import PlanEvaluation, evaluate, evaluate_pipeline
from partitioner.simulation.step import simulate_step
from partitioner.solvers import get_solver, solve
from partitioner.solvers.stages import make_acyclic

__all__ = ["BASELINES", "Progress", "load_plan", "partition"]

logger = logging.getLogger(__name__)

BASELINES = ("single", "even")
"""Baselines every plan is compared with: one device, and the even split an expert writes."""


class Progress(Protocol):
    """The ``progress`` callback: a phase's message, and for countable phases how far it is."""

    def __call__(
        self, message: str, completed: float | None = None, total: float | None = None
    ) -> None: ...


def _no_progress(message: str, completed: float | None = None, total: float | None = None) -> None:
    return None


def _check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{name} must be a positive integer, got {value!r}")
    return value


def partition(
    model: Any,
    *,
    gpus: int | None,
    device_type: str = "h100",
    batch_size: int = 32,
    solver: str = "auto",
    topology: str = "pcie",
    optimizer: str = "adam",
    input_shape: Sequence[int] | None = None,
    memory_limit_bytes: int | None = None,
    seed: int = 0,
    time_limit_s: float = 5.0,
    pipeline: bool = False,
    num_microbatches: int | None = None,
    schedule: Schedule | str = Schedule.ONE_F_ONE_B,
    profile: bool = False,
    profile_ops: bool = False,
    cache_dir: str | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Trace, cost and place ``model`` on ``gpus`` devices of ``device_type``.

    ``topology`` is ``pcie``, ``nvlink``, a catalog link kind, ``tf-config`` or a JSON/TOML
    topology file (:func:`cost_models.devices.topology.load_topology`; a file names its own devices and
    ``gpus`` may then be ``None``). With ``pipeline``, the plan's stages run ``num_microbatches``
    micro-batches under ``schedule`` (default: the most micro-batches up to 4 x devices that
    divide the batch) and its predictions are the pipelined step's. With ``profile``, every
    layer is timed (forward and backward) on the devices of the topology that are present here
    (:func:`cost_models.measure.profiled.profile_model`; cached on disk in ``cache_dir``, default
    ``$PARTITIONER_CACHE_DIR`` or the user's cache directory) and those times replace the
    estimates; the plan records which layers were measured. With ``profile_ops``, every op of
    the traced training step is timed inside the step on this machine's CPU
    (:func:`cost_models.measure.op_profile.profile_step_ops`) and those times replace the estimates of
    the topology's cpu devices (glue ops included; not cached).

    Returns a :class:`~partitioner.plan.model.Plan`; ``plan.apply(model)`` gives the placed model.
    Raises a :class:`~partitioner.core.errors.PartitionError` subclass with a one-line message for
    every bad option, before any slow work is done.
    """
    if gpus is not None:
        _check_positive_int("--gpus", gpus)
    _check_positive_int("--batch-size", batch_size)
    device = get_device_type(device_type)
    topo = load_topology(
        topology,
        device_type=device.name,
        num_devices=gpus,
        memory_limit_bytes=memory_limit_bytes,
    )
    opt = parse_optimizer(optimizer)
    chosen = get_solver(solver, seed=seed, time_limit_s=time_limit_s)
    sched, micro = _pipeline_options(
        pipeline, num_microbatches, schedule, batch_size, topo.num_devices
    )
    if profile_ops:
        _cpu_rows(topo)  # fail before the slow work
    say: Progress = progress or _no_progress
    phases: list[tuple[str, float]] = []

    from passes.trace import trace_model

    say("tracing")
    traced = trace_model(model, batch_size=batch_size, input_shape=input_shape)
    phases += [("trace", traced.trace_time_s), ("flops", traced.flops_time_s)]

    say("costing")
    t0 = time.perf_counter()
    costed = cost_graph(traced.graph, topology=topo, optimizer=opt)
    phases.append(("cost", time.perf_counter() - t0))
    cost_notes: tuple[str, ...] = ("compute times estimated by the roofline model of each device type",)
    if profile:
        t0 = time.perf_counter()
        costed, cost_notes = _profile(
            model, costed, batch_size=batch_size, input_shape=input_shape, cache_dir=cache_dir,
            say=say,
        )
        phases.append(("profile", time.perf_counter() - t0))
    if profile_ops:
        t0 = time.perf_counter()
        costed, op_notes = _profile_ops(traced, costed, say=say)
        cost_notes = (*cost_notes, *op_notes) if profile else op_notes
        phases.append(("profile ops", time.perf_counter() - t0))

    say(f"solving with {chosen.name}")
    t0 = time.perf_counter()
    result, evaluation = solve(costed, chosen)
    pipeline_info = None
    warnings: tuple[str, ...] = ()
    if sched is not None:
        result, evaluation = _pipeline_choice(
            costed, result, chosen.name, sched, micro, seed=seed, time_limit_s=time_limit_s
        )
        plain = evaluate(costed, result.assignment)
        sim = evaluation.pipeline
        pipeline_info = PipelineInfo(
            schedule=sched,
            num_microbatches=micro,
            stage_devices=sim.stage_devices if sim is not None else (),
            bubble_fraction=sim.bubble_fraction if sim is not None else (),
        )
        timeline = sim.timeline if sim is not None else ()
        warnings = _microbatch_warnings(costed, micro)
    else:
        timeline = simulate_step(costed, result.assignment, timeline=True).timeline
    phases.append(("solve", time.perf_counter() - t0))

    say("comparing with baselines")
    t0 = time.perf_counter()
    baselines = _baselines(
        costed, exclude=chosen.name, seed=seed, time_limit_s=time_limit_s, schedule=sched, micro=micro
    )
    if sched is not None:
        baselines = (
            BaselineResult(
                solver=f"{chosen.name} without pipelining", step_time_s=plain.step_time_s
            ),
            *baselines,
        )
    phases.append(("baselines", time.perf_counter() - t0))

    for line in warnings:
        logger.warning("%s", line)
    return plan_from_solution(
        costed,
        result,
        evaluation,
        link=topology_summary(costed.topology),
        batch_size=batch_size,
        input_shape=tuple(int(d) for d in input_shape) if input_shape is not None else None,
        baselines=baselines,
        advice=_advice(costed, evaluation, baselines, pipeline_info),
        phase_times_s=tuple(phases),
        pipeline=pipeline_info,
        warnings=warnings,
        timeline=timeline,
        measured_layers=costed.measured,
        cost_notes=cost_notes,
    )


PIPELINE_CANDIDATES = ("dp", "time", "even", "metis")
"""Contiguous-stage solvers ``auto`` also tries as pipelines (its own score is the steady state of
an endless pipeline; a finite number of micro-batches adds fill and drain)."""


def _pipeline_choice(
    costed: CostedGraph,
    result: SolverResult,
    solver: str,
    schedule: Schedule,
    micro: int,
    *,
    seed: int,
    time_limit_s: float,
) -> tuple[SolverResult, PlanEvaluation]:
    """The solver's placement as a pipeline (stages made acyclic) and, for ``auto``, the best of
    it and the contiguous solvers' placements by the simulated pipelined step (memory first).

    A placement that still is no pipeline raises PlanError for a named solver; ``auto`` then
    keeps the best of the others that are (its notes say so), and raises only when none is."""
    problem = costed.problem()

    def staged(r: SolverResult) -> tuple[SolverResult, PlanEvaluation]:
        assignment = make_acyclic(r.assignment, problem)
        if assignment != r.assignment:
            r = replace(
                r,
                assignment=assignment,
                notes=(*r.notes, "stages reordered into a pipeline (make_acyclic)"),
            )
        return r, evaluate_pipeline(costed, r.assignment, schedule=schedule, num_microbatches=micro)

    best: tuple[SolverResult, PlanEvaluation] | None
    try:
        best = staged(result)
    except PartitionError as exc:
        if solver != "auto":
            if not isinstance(exc, PlanError):
                raise
            raise PlanError(
                f"the {solver} placement is not a pipeline even with its stages reordered: "
                f"{exc}; or plan with --solver auto, dp, time or even"
            ) from None
        # auto's own placement: fall back to the best of the contiguous solvers' below
        logger.warning("auto's own placement cannot be pipelined (%s); trying the others", exc)
        best = None
        tried = [f"auto: not a pipeline ({_first_clause(str(exc))})"]
    else:
        if solver != "auto":
            return best
        tried = [f"auto: {format_seconds(best[1].step_time_s)}"]
    for name in PIPELINE_CANDIDATES:
        try:
            candidate = staged(get_solver(name, seed=seed, time_limit_s=time_limit_s).solve(problem))
        except PartitionError as exc:
            tried.append(f"{name}: {type(exc).__name__}")
            continue
        tried.append(f"{name}: {format_seconds(candidate[1].step_time_s)}")
        if best is None or (not candidate[1].fits, candidate[1].step_time_s) < (
            not best[1].fits,
            best[1].step_time_s,
        ):
            best = (replace(candidate[0], solver="auto", status=SolveStatus.HEURISTIC), candidate[1])
            tried[-1] += " (chosen)"
    if best is None:
        raise PlanError(
            "no placement of auto or of the contiguous solvers "
            f"({', '.join(PIPELINE_CANDIDATES)}) could be pipelined: {'; '.join(tried)}; "
            "plan without --pipeline"
        )
    note = f"pipelined {schedule.value} x {micro} simulated: " + "; ".join(tried)
    return replace(best[0], notes=(*best[0].notes, note)), best[1]


def _first_clause(message: str, limit: int = 160) -> str:
    """The start of an error message, for a plan's one-line notes."""
    head = message.split(": a pipeline", 1)[0].split("; ", 1)[0]
    return head if len(head) <= limit else head[: limit - 3] + "..."


def _profile_rows(topology: Topology) -> dict[int, str]:
    """Topology device -> the TF device here that stands for it (cpu rows: the CPU; GPU rows:
    the visible GPUs in order). Rows with nothing present stay estimated."""
    import tensorflow as tf

    gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
    rows: dict[int, str] = {}
    k = 0
    for d in topology.devices:
        if d.device_type == "cpu":
            rows[d.index] = "/device:CPU:0"
        elif k < len(gpus):
            rows[d.index] = gpus[k]
            k += 1
    return rows


def _profile(
    model: Any,
    costed: CostedGraph,
    *,
    batch_size: int,
    input_shape: Sequence[int] | None,
    cache_dir: str | None,
    say: Progress,
) -> tuple[CostedGraph, tuple[str, ...]]:
    """Measure the layers on the devices present and merge the times into ``costed``."""
    from cost_models.measure.profiled import apply_profile, profile_model

    topo = costed.topology
    rows = _profile_rows(topo)
    if not rows:
        import tensorflow as tf

        present = ", ".join(d.name for d in tf.config.list_logical_devices()) or "none"
        types = ", ".join(sorted({d.device_type for d in topo.devices}))
        raise UsageError(
            f"--profile measures the devices present, and none here is a {types} (TensorFlow "
            f"sees: {present}); plan for --device-type cpu to profile this machine, or drop "
            "--profile to use the estimates"
        )
    devices = sorted(set(rows.values()))
    result = profile_model(
        model,
        batch_size=batch_size,
        devices=devices,
        input_shape=input_shape,
        cache_dir=cache_dir,
        progress=lambda done, total, _label: say("profiling layers", done, total),
    )
    profiled = apply_profile(costed, result, device_rows=rows)
    notes = [
        f"profiled {len(profiled.measured)} of {len(costed.graph.layers)} layers on "
        f"{', '.join(devices)}: {result.measured_count} timings measured, "
        f"{result.cached_count} from the cache ({result.cache_dir})"
    ]
    estimated = [d.index for d in topo.devices if d.index not in rows]
    if estimated:
        notes.append(
            f"devices {estimated} are not present here: their times stay estimated (roofline)"
        )
    if result.skipped:
        notes.append(f"not profiled (estimated): {', '.join(map(str, result.skipped[:5]))}")
    return profiled, tuple(notes)


def _cpu_rows(topo: Topology) -> list[int]:
    """The topology's cpu devices, which ``--profile-ops`` measures; UsageError when none."""
    rows = [d.index for d in topo.devices if d.device_type == "cpu"]
    if not rows:
        types = ", ".join(sorted({d.device_type for d in topo.devices}))
        raise UsageError(
            f"--profile-ops times ops on this machine's CPU, and the plan has no cpu device "
            f"(it plans {types}); plan for --device-type cpu, or use --profile (per layer, on "
            "the devices present)"
        )
    return rows


def _profile_ops(
    traced: Any, costed: CostedGraph, *, say: Progress
) -> tuple[CostedGraph, tuple[str, ...]]:
    """Time every op inside the traced step on this machine's CPU; merge into the cpu rows."""
    import tensorflow as tf

    from cost_models.estimate.analytic import calibrated_roofline
    from cost_models.measure.op_profile import apply_op_profile, profile_step_ops, step_inputs

    topo = costed.topology
    rows = _cpu_rows(topo)
    say("profiling ops")
    with tf.device("/device:CPU:0"):
        prof = profile_step_ops(traced, step_inputs(traced), steps=10, warmup=3, statistic="min")
    dispatch_s = calibrated_roofline("cpu").dispatch_overhead_s
    profiled = apply_op_profile(costed, prof.op_time_s, rows, dispatch_s=dispatch_s)
    notes: tuple[str, ...] = (
        f"timed {len(prof.op_time_s)} of {len(traced.graph.ops)} ops inside the training step on "
        f"/device:CPU:0 (TensorFlow's profiler, least of {prof.profiled_steps} steps) for cpu "
        f"devices {rows}; {len(profiled.measured)} layers measured, plus "
        f"{1e6 * dispatch_s:.1f} us of executor time per op; ops TensorFlow ran side by side "
        "(its default threads) each appear slower",
    )
    estimated = [d.index for d in topo.devices if d.index not in rows]
    if estimated:
        notes += (f"devices {estimated} are not cpus: their op times stay estimated",)
    return profiled, notes


def _pipeline_options(
    pipeline: bool,
    num_microbatches: int | None,
    schedule: Schedule | str,
    batch_size: int,
    num_devices: int,
) -> tuple[Schedule | None, int]:
    """The schedule (``None`` without pipelining) and micro-batch count, validated."""
    if not pipeline:
        if num_microbatches not in (None, 1):
            raise UsageError("--microbatches needs --pipeline (plain splits run whole batches)")
        return None, 1
    try:
        sched = schedule if isinstance(schedule, Schedule) else Schedule(str(schedule).lower())
    except ValueError:
        known = ", ".join(s.value for s in Schedule if s is not Schedule.NONE)
        raise UsageError(f"--schedule {schedule!r} is not a pipeline schedule; known: {known}") from None
    if sched is Schedule.NONE:
        raise UsageError("--pipeline needs a pipeline schedule (gpipe or 1f1b), not 'none'")
    if num_devices < 2:
        raise UsageError(
            "--pipeline needs at least 2 devices: a plan on one device has no stages to overlap "
            "(use --gpus 2 or more, or drop --pipeline)"
        )
    if num_microbatches is None:
        micro = max(m for m in range(1, min(batch_size, 4 * num_devices) + 1) if batch_size % m == 0)
    else:
        micro = _check_positive_int("--microbatches", num_microbatches)
        if batch_size % micro:
            raise UsageError(
                f"--batch-size {batch_size} is not divisible by --microbatches {micro}; pick M "
                "that divides the batch"
            )
    return sched, micro


def _microbatch_warnings(costed: CostedGraph, num_microbatches: int) -> tuple[str, ...]:
    """One loud line per layer class that is not exact under micro-batching."""
    if num_microbatches <= 1:
        return ()
    by_class: dict[str, list[str]] = {}
    for layer in costed.graph.layers:
        if layer.class_name in INEXACT_UNDER_MICROBATCHES:
            by_class.setdefault(layer.class_name, []).append(layer.name)
    out = []
    for cls, names in sorted(by_class.items()):
        shown = ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3 else "")
        out.append(
            f"NOT EXACT: {cls} ({shown}) {INEXACT_UNDER_MICROBATCHES[cls]} "
            f"({num_microbatches} micro-batches)."
        )
    return tuple(out)


def _baselines(
    costed: CostedGraph,
    *,
    exclude: str,
    seed: int,
    time_limit_s: float,
    schedule: Schedule | None = None,
    micro: int = 1,
) -> tuple[BaselineResult, ...]:
    """``single`` (one device, no pipeline) and ``even`` (pipelined like the plan when it is)."""
    out = []
    for name in BASELINES:
        if name == exclude:
            continue
        baseline = get_solver(name, seed=seed, time_limit_s=time_limit_s)
        target = costed
        if name == "single":
            # The fastest device alone, to say whether a split is needed at all.
            fastest = min(
                range(costed.topology.num_devices), key=lambda d: sum(costed.op_compute_time_s[d])
            )
            dev = replace(costed.topology.devices[fastest], index=0, host=0)
            target = CostedGraph(
                graph=costed.graph,
                topology=Topology(devices=(dev,), link=costed.topology.link),
                op_compute_time_s=(costed.op_compute_time_s[fastest],),
                layer_memory=costed.layer_memory,
            )
        try:
            result, ev = solve(target, baseline)
            if schedule is not None and name != "single":
                staged = make_acyclic(result.assignment, target.problem())
                ev = evaluate_pipeline(
                    target, staged, schedule=schedule, num_microbatches=micro
                )
        except PartitionError as exc:
            out.append(BaselineResult(solver=name, step_time_s=None, note=str(exc)))
            continue
        note = "" if ev.fits else "over the memory limit"
        out.append(BaselineResult(solver=name, step_time_s=ev.step_time_s, note=note))
    return tuple(out)


def _advice(
    costed: CostedGraph,
    evaluation: PlanEvaluation,
    baselines: Sequence[BaselineResult],
    pipeline: PipelineInfo | None = None,
) -> tuple[str, ...]:
    """Honest advice: say when a plain split cannot beat one device, and what would."""
    advice = []
    n = costed.topology.num_devices
    total = peak_bytes(costed.layer_memory)
    limit = max(d.memory_bytes for d in costed.topology.devices)
    single = next((b for b in baselines if b.solver == "single"), None)
    dtype = costed.topology.devices[0].device_type
    fits_one = total <= limit
    if n > 1 and pipeline is not None:
        m = pipeline.num_microbatches
        if single is not None and single.step_time_s is not None:
            ratio = single.step_time_s / evaluation.step_time_s
            verdict = "faster" if ratio > 1 else "no faster"
            advice.append(
                f"Pipelined over {len(pipeline.stage_devices)} stages with {m} micro-batches "
                f"({pipeline.schedule.value}): predicted {format_seconds(evaluation.step_time_s)} "
                f"per batch vs {format_seconds(single.step_time_s)} on one device, {ratio:.2f}x "
                f"({verdict})."
            )
        if fits_one:
            advice.append(
                "The model also fits one device: data parallelism "
                "(tf.distribute.MirroredStrategy) needs no split and is worth comparing."
            )
        if max(pipeline.bubble_fraction, default=0.0) > 0.3:
            advice.append(
                f"Bubbles reach {max(pipeline.bubble_fraction):.0%} of the step on some device; "
                f"more micro-batches (--microbatches, now {m}) shrink them."
            )
    elif n > 1 and fits_one:
        fits = f"The model fits one {dtype} ({format_bytes(total)} of {format_bytes(limit)})"
        pointer = (
            "To use the devices at once, pipeline the stages with micro-batches (--pipeline) or "
            "use data parallelism (tf.distribute.MirroredStrategy)."
        )
        if single is None or single.step_time_s is None:
            advice.append(f"{fits}. {pointer}")
        elif evaluation.step_time_s >= single.step_time_s:
            advice.append(
                f"{fits}, and a plain split over {n} devices cannot beat it: the layers run one "
                f"device at a time (predicted {format_seconds(evaluation.step_time_s)} split vs "
                f"{format_seconds(single.step_time_s)} on one device). {pointer}"
            )
        else:
            gain = 1 - evaluation.step_time_s / single.step_time_s
            advice.append(
                f"{fits}: a plain split over {n} devices gains only {gain:.0%} over one device "
                f"({format_seconds(evaluation.step_time_s)} vs "
                f"{format_seconds(single.step_time_s)}), from ops that overlap; the "
                f"layers still run mostly one device at a time. {pointer}"
            )
    elif n > 1:
        advice.append(
            f"The model needs {format_bytes(total)}, more than one {dtype} holds "
            f"({format_bytes(limit)}): the split is required for memory."
        )
    over = [d for d in evaluation.per_device if not d.fits]
    if over:
        advice.append(
            "Devices over their memory limit: "
            + ", ".join(
                f"{d.device} ({format_bytes(d.memory_bytes)} > {format_bytes(d.memory_limit_bytes)})"
                for d in over
            )
        )
    return tuple(advice)
