"""The library entry point: ``partitioner.partition(model, gpus=2) -> Plan``.

Orchestrates the one-way flow: check the options (:func:`prepare`, before any slow work), leave
out the strategies a model placed in place cannot run (:func:`passes.checks.in_place_reason`: its
own training step, layers that cannot be rebuilt; replicas and stages need copies), trace the model, cost the graph, solve, evaluate the chosen plan beside
the baselines, write advice, and put the layers that emit no ops beside a neighbour and check that
the plan applies before returning it (:func:`partition_prepared`). The options travel as three groups
(:mod:`partitioner.core.options`): what to plan for, how to search, how to measure. Nothing
imports this module but the package's lazy ``__init__`` and the CLI.

**More devices than layers.** The layers bound the stages only. The strategy search uses the
other devices for replicas, and chooses a strategy on fewer devices when it is faster (the advice
names the idle devices and what the fastest strategy on all of them would cost). A solver's own
split (a named ``solver``, ``pipeline=True``, ``compare_strategies=False``) puts each layer on one
device, so it uses as many devices as layers, the first in host order
(:func:`placement_devices`), and its advice says which devices it leaves idle. The plan lists
every device either way (:attr:`~partitioner.plan.model.Plan.idle_devices`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from cost_models.devices.catalog import DeviceKind, get_device_type
from cost_models.devices.topology import links_note, load_topology, topology_summary
from cost_models.estimate.analytic import calibration_note
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import Optimizer, parse_optimizer
from cost_models.estimate.precision import parse_precision, traced_precision
from partitioner.core.batching import BatchShare, at_share, graph_at_batch
from partitioner.core.errors import (
    InfeasibleError,
    OutputError,
    PartitionError,
    PlanError,
    RewriteError,
    UsageError,
)
from partitioner.core.ir import (
    CostedGraph,
    Graph,
    PartitionProblem,
    Schedule,
    SolverResult,
    SolveStatus,
    TimelineEvent,
    Topology,
    peak_bytes,
)
from partitioner.core.microbatch import INEXACT_UNDER_MICROBATCHES, InexactLayer
from partitioner.core.options import (
    DEFAULT_DEVICE_TYPE,
    MAX_DEVICES,
    MAX_MEMORY_BYTES,
    MeasureOptions,
    SearchOptions,
    TargetOptions,
    parse_schedule,
)
from partitioner.core.strategy import Family, Strategy
from partitioner.core.units import format_bytes, format_seconds
from partitioner.plan.model import (
    BaselineResult,
    PipelineInfo,
    Plan,
    load_plan,
    plan_from_solution,
)
from partitioner.plan.strategic import plan_from_candidate, strategy_of_split
from partitioner.planner.explain import FamilyRow, devices_text, family_rows, idle_advice
from partitioner.planner.explain import advice as strategy_advice
from partitioner.planner.search import (
    StrategyCandidate,
    StrategyOptions,
    device_layouts,
    search_strategies,
    sub_problem,
)
from partitioner.simulation.evaluate import (
    DeviceLoad,
    PlanEvaluation,
    evaluate,
    evaluate_pipeline,
    lower_bound_s,
)
from partitioner.simulation.step import simulate_step
from partitioner.simulation.strategy import microbatch_costed
from partitioner.solvers import Solver, fast_solver_names, get_solver, solve
from partitioner.solvers.stages import acyclic_on_devices

if TYPE_CHECKING:
    from cost_models.measure.profiled import ProfileWrites
    from passes.trace import TraceResult
    from passes.trace_cache import TraceCache

_Inexact = tuple[tuple[InexactLayer, str], ...]
"""The layers not exact under a split batch: ``(why, layer name)`` (``passes.checks``)."""

__all__ = [
    "BASELINES",
    "MeasureOptions",
    "Prepared",
    "Progress",
    "SearchOptions",
    "TargetOptions",
    "load_plan",
    "partition",
    "partition_prepared",
    "prepare",
]

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


ESTIMATED_NOTE = "compute times estimated by the roofline model of each device type"
"""The cost note of a plan whose compute times are all estimated."""
PROFILED_STEPS = 5
"""``profile_ops=True``: steps run under TensorFlow's profiler (the op times are their median)."""
WALL_STEPS = 15
"""``profile_ops=True``: steps timed without the profiler (the whole step is their median)."""


@dataclass(frozen=True)
class Prepared:
    """A run's options checked against the catalog, the topology, the optimizers and the solver
    registry: everything :func:`partition_prepared` needs, built by :func:`prepare` before any
    slow work."""

    target: TargetOptions
    search: SearchOptions
    measure: MeasureOptions
    topology: Topology
    optimizer: Optimizer
    solver: Solver
    schedule: Schedule | None
    """The pipeline schedule; ``None`` without pipelining."""
    num_microbatches: int
    """Micro-batches per batch (1 without pipelining)."""
    write_cache: bool = True
    """With ``profile``: whether the profile cache takes entries (False once the run found it
    cannot: :func:`_cache_checked`; its profiles then read it without writing)."""


def prepare(
    target: TargetOptions,
    search: SearchOptions | None = None,
    measure: MeasureOptions | None = None,
) -> Prepared:
    """Check the options and resolve their names: the device type, the topology (loaded once
    here), the optimizer, the solver, the micro-batch count; with ``profile_ops``, that the
    topology has a cpu device. Fast, and without TensorFlow; raises a
    :class:`~partitioner.core.errors.PartitionError` subclass for every bad option."""
    _check_group(target, TargetOptions, "target")
    search = SearchOptions() if search is None else _check_group(search, SearchOptions, "search")
    measure = (
        MeasureOptions() if measure is None else _check_group(measure, MeasureOptions, "measure")
    )
    given = target.device_type
    device = get_device_type(DEFAULT_DEVICE_TYPE if given is None else given)
    topology = load_topology(
        target.topology,
        device_type=device.name,
        num_devices=target.gpus,
        memory_limit_bytes=target.memory_limit_bytes,
        device_type_given=given is not None,
    )
    _check_topology_bounds(target.topology, topology)
    search.check_devices(topology.num_devices)
    prepared = Prepared(
        target=target,
        search=search,
        measure=measure,
        topology=topology,
        optimizer=parse_optimizer(target.optimizer),
        solver=get_solver(search.solver, seed=search.seed, time_limit_s=search.time_limit_s),
        schedule=search.pipeline_schedule,
        num_microbatches=search.microbatches_for(target.batch_size, topology.num_devices),
    )
    if measure.profile_ops:
        _cpu_rows(topology)  # fail before the slow work
    if target.precision is not None:
        parse_precision(target.precision)  # fail before the slow work
    return prepared


_Options = TypeVar("_Options", TargetOptions, SearchOptions, MeasureOptions)


def _check_group(given: Any, group: type[_Options], label: str) -> _Options:
    """``given`` when it is a ``group``; UsageError naming ``label=`` otherwise."""
    if not isinstance(given, group):
        raise UsageError(
            f"{label}={given!r} must be a {group.__name__} (or omitted, with the flat keywords)"
        )
    return given


def _check_topology_bounds(spec: str, topology: Topology) -> None:
    """A topology of at most :data:`MAX_DEVICES` devices, each of at most
    :data:`MAX_MEMORY_BYTES` of memory (a topology file may describe more)."""
    if topology.num_devices > MAX_DEVICES:
        raise UsageError(
            f"topology={spec!r} describes {topology.num_devices} devices, more than "
            f"{MAX_DEVICES}, the most partition takes; describe at most {MAX_DEVICES}"
        )
    big = next((d for d in topology.devices if d.memory_bytes > MAX_MEMORY_BYTES), None)
    if big is not None:
        raise UsageError(
            f"topology={spec!r} gives device {big.index} ({big.device_type}) "
            f"{big.memory_bytes} bytes of memory, more than 1 EiB ({MAX_MEMORY_BYTES} B), the "
            "most partition takes; give its memory as a size such as '80GiB'"
        )


def _differs(value: Any, default: Any) -> bool:
    """Whether a keyword is away from its default (an array compared elementwise is)."""
    try:
        return bool(value != default)
    except (TypeError, ValueError):
        return True


def _options(
    build: type[_Options], given: _Options | None, label: str, **keywords: Any
) -> _Options:
    """The option group ``given`` as ``label=``, else the one built from the flat ``keywords``;
    UsageError when ``given`` is no such group or both set a field (a keyword away from its
    default)."""
    if given is None:
        return build(**keywords)
    _check_group(given, build, label)
    defaults = build()
    for name, value in keywords.items():
        if _differs(value, getattr(defaults, name)):
            raise UsageError(
                f"partition() got {label}= and also {name}={value!r}; give {name} in {label}= only"
            )
    return given


def _flat_pipelining(
    pipeline: Any, schedule: Any, num_microbatches: Any, strategy: Any
) -> tuple[Any, Any]:
    """``partition``'s ``schedule`` and ``num_microbatches`` as :class:`SearchOptions` takes
    them: the schedule checked, and without pipelining unused (``None``), as is one
    micro-batch, the whole batch (the integer 1 only: ``True`` or ``1.0`` are refused). Beside
    a ``strategy`` a schedule is passed on, to be refused with the reason: the strategy
    chooses its own, and dropping the one asked for would plan another silently."""
    checked = None if schedule is None else parse_schedule(schedule)
    if pipeline is not False:
        return checked, num_microbatches
    one = type(num_microbatches) is int and num_microbatches == 1
    return (checked if strategy is not None else None), None if one else num_microbatches


def _check_progress(progress: Any) -> None:
    """``progress`` is ``None`` or a callable; UsageError naming it otherwise."""
    if progress is not None and not callable(progress):
        raise UsageError(
            f"progress={progress!r} must be a callable taking (message, completed, total), or None"
        )


def partition(
    model: Any,
    *,
    gpus: int | None = None,
    device_type: str | None = None,
    batch_size: int = 32,
    solver: str = "auto",
    topology: str = "pcie",
    optimizer: str = "adam",
    input_shape: Sequence[int] | dict[str, Any] | None = None,
    memory_limit_bytes: int | None = None,
    precision: str | None = None,
    seed: int = 0,
    time_limit_s: float = 5.0,
    pipeline: bool = False,
    num_microbatches: int | None = None,
    schedule: Schedule | str | None = None,
    compare_strategies: bool = True,
    strategy: Family | str | None = None,
    profile: bool = False,
    profile_ops: bool = False,
    cache_dir: str | None = None,
    trace_cache: bool = False,
    target: TargetOptions | None = None,
    search: SearchOptions | None = None,
    measure: MeasureOptions | None = None,
    progress: Progress | None = None,
) -> Plan:
    """Trace, cost and place ``model`` on ``gpus`` devices of ``device_type`` (default h100).

    The keywords are the flat spelling of three option groups (their docstrings say what each
    field does): :class:`~partitioner.core.options.TargetOptions` (what to plan for: ``gpus``
    to ``memory_limit_bytes``), :class:`~partitioner.core.options.SearchOptions` (``solver`` to
    ``strategy``; the schedule is unused without ``pipeline``, and refused beside a
    ``strategy``) and :class:`~partitioner.core.options.MeasureOptions` (``profile`` to
    ``trace_cache``). ``target=``, ``search=`` or ``measure=`` pass a group whole instead;
    :func:`prepare` and :func:`partition_prepared` are the two halves of this call.

    Returns a :class:`~partitioner.plan.model.Plan`; ``plan.apply(model)`` gives the placed model.
    Raises a :class:`~partitioner.core.errors.PartitionError` subclass with a one-line message for
    every bad option, before any slow work is done.
    ``gpus`` may exceed the model's layers (the module docstring: more devices than layers).
    """
    target = _options(
        TargetOptions, target, "target", gpus=gpus, device_type=device_type, topology=topology,
        batch_size=batch_size, input_shape=input_shape,
        optimizer=optimizer, memory_limit_bytes=memory_limit_bytes, precision=precision,
    )  # fmt: skip
    flat_schedule, microbatches = _flat_pipelining(pipeline, schedule, num_microbatches, strategy)
    search = _options(
        SearchOptions, search, "search", solver=solver, seed=seed, time_limit_s=time_limit_s,
        pipeline=pipeline, schedule=flat_schedule, num_microbatches=microbatches,
        compare_strategies=compare_strategies, strategy=strategy,
    )  # fmt: skip
    measure = _options(
        MeasureOptions, measure, "measure", profile=profile, profile_ops=profile_ops,
        cache_dir=cache_dir, trace_cache=trace_cache,
    )  # fmt: skip
    _check_progress(progress)
    return partition_prepared(model, prepare(target, search, measure), progress=progress)


@contextlib.contextmanager
def _timed(phases: list[tuple[str, float]], name: str) -> Iterator[None]:
    """Append the wall time of the ``with`` block to ``phases`` as ``name``."""
    t0 = time.perf_counter()
    yield
    phases.append((name, time.perf_counter() - t0))


def partition_prepared(
    model: Any,
    prepared: Prepared,
    *,
    progress: Progress | None = None,
    trace_cache: TraceCache | None = None,
    profile_writes: ProfileWrites | None = None,
) -> Plan:
    """Plan ``model`` with options already checked by :func:`prepare` (the CLI checks them
    before it imports TensorFlow; :func:`partition` is the two in one). ``trace_cache``: the
    caller's (:class:`passes.trace_cache.TraceCache`), which it flushes once its own outputs
    are written; without one, ``trace_cache=True`` makes one, flushed when the plan is made.
    ``profile_writes`` likewise holds the profile cache's new entries
    (:class:`cost_models.measure.profiled.ProfileWrites`)."""
    if not isinstance(prepared, Prepared):
        raise UsageError(f"prepared={prepared!r} must be what prepare(...) returns")
    _check_progress(progress)
    prepared = _cache_checked(prepared)
    own = trace_cache is None
    cache = _trace_cache(prepared.measure) if own else trace_cache
    writes = _profile_writes() if profile_writes is None else profile_writes
    plan = _partition_prepared(model, prepared, progress or _no_progress, cache, writes)
    if own and cache is not None:
        cache.flush()  # only now: a failed run leaves no new file
    if profile_writes is None:
        writes.flush()
    return plan


def _trace_cache(measure: MeasureOptions) -> TraceCache | None:
    """The run's trace cache (:mod:`passes.trace_cache`), or None: not asked for, or a run that
    measures (a profile runs the traced step itself), or no cache directory (no home)."""
    if not measure.trace_cache or not _traces_cached(measure):
        return None
    from cost_models.measure.profiled import default_cache_dir
    from partitioner.core.files import check_links_followed
    from passes.trace_cache import TraceCache

    try:
        given = measure.cache_dir if measure.cache_dir is not None else default_cache_dir()
        check_links_followed(given, "the cache directory")
    except RuntimeError:  # no home directory to hold the default
        return None
    except OutputError as exc:
        logger.warning("%s; tracing without the trace cache", exc)
        return None
    return TraceCache(Path(os.path.realpath(given)))


def _profile_writes() -> ProfileWrites:
    from cost_models.measure.profiled import ProfileWrites

    return ProfileWrites()


def _traces_cached(measure: MeasureOptions) -> bool:
    """Whether a run measured so may read traces from a cache: not one that profiles (a profile
    runs the traced step itself, which a cached trace does not have)."""
    return not (measure.profile or measure.profile_ops)


def _partition_prepared(
    model: Any,
    prepared: Prepared,
    say: Progress,
    cache: TraceCache | None,
    writes: ProfileWrites,
) -> Plan:
    phases: list[tuple[str, float]] = []
    inexact = _check_model(model)
    _check_splittable(model, prepared)
    traced = _trace(model, prepared.target, say, phases, cache)
    costed, cost_notes = _cost(model, traced, prepared, say, phases, writes)
    costed_at = _CostedAt(model, prepared, costed, traced, cache, writes)
    pipelined = _pipelined_costs(costed_at, prepared, say, phases)
    say(f"solving with {prepared.solver.name}")
    with _timed(phases, "solve"), _memory_limit_named(prepared):
        solved = _solve(costed, prepared, inexact, pipelined)
    say("comparing with baselines")
    with _timed(phases, "baselines"):
        baselines = _all_baselines(costed, solved, prepared, pipelined)
    compared = None
    if prepared.search.compare_strategies and prepared.topology.num_devices > 1:
        say("comparing strategies")
        with _timed(phases, "strategies"), _memory_limit_named(prepared):
            compared = _compare(costed_at, prepared, solved)
    from passes.apply import model_fingerprint  # what plan.apply checks the model against

    common: dict[str, Any] = {
        "link": topology_summary(costed.topology),
        "batch_size": prepared.target.batch_size,
        "input_shape": prepared.target.input_shape,
        "fingerprint": model_fingerprint(model, prepared.target.input_shape),
        "baselines": baselines,
        "phase_times_s": tuple(phases),
        "measured_layers": costed.measured,
        "cost_notes": cost_notes,
    }
    note: tuple[str, ...] = ()
    if compared is not None and compared.applied is not None:
        chosen = _strategy_plan(compared, compared.applied, prepared, common, inexact)
        try:
            return _applyable(model, _bound_below_every_row(chosen, costed), costed)
        except RewriteError as exc:
            if set(prepared.search.strategy_families or ()) != set(Family):
                raise
            note = (
                f"The fastest strategy ({compared.applied.strategy.describe()}) cannot be applied "
                f"to this model ({exc}); the plan applies {prepared.solver.name}'s split instead.",
            )
    for line in solved.warnings:
        logger.warning("%s", line)
    plan = _split_plan(costed, solved, compared, common)
    plan = _bound_below_every_row(replace(plan, advice=(*note, *plan.advice)), costed)
    return _applyable(model, plan, costed)


def _families_asked(prepared: Prepared) -> bool:
    """Whether the user named the strategy families to score (``strategy=``), not all."""
    families = prepared.search.strategy_families
    return families is not None and set(families) != set(Family)


def _faster_than_asked(
    step_s: float, baselines: Sequence[BaselineResult], asked: bool
) -> tuple[str, ...]:
    """The line naming the fastest plan beside a strategy the user asked for that beats it (one
    device, a plain split), which the strategy comparison did not score."""
    faster = [b for b in baselines if b.step_time_s is not None and b.step_time_s < step_s]
    if not asked or not faster:
        return ()
    best = min(faster, key=lambda b: cast(float, b.step_time_s))
    best_s = cast(float, best.step_time_s)
    return (
        f"Predicted faster than the strategy asked for: {best.solver} "
        f"({format_seconds(best_s)} per step, {step_s / best_s:.2f}x faster); plan without "
        "strategy= to compare every strategy.",
    )


def _bound_below_every_row(plan: Plan, costed: CostedGraph) -> Plan:
    """``plan`` with a lower bound that holds for every plan it is shown beside: a pipelined
    plan's own bound is its micro-batched configuration's (the micro-batches' fixed costs
    counted ``M`` times), which the unpipelined split and one device beat: "lower bound 1.395
    ms" above a listed 338 us, ratios under 1 (campaign 34u). The least of its own bound, the
    whole-batch graph's bound on these devices and every step the plan lists (a bound above a
    plan that runs is no bound)."""
    steps = [
        plan.step_time_s,
        *(b.step_time_s for b in plan.baselines if b.step_time_s is not None),
        *(r.step_time_s for r in plan.strategies if r.fits),
    ]
    bound = min(plan.lower_bound_s, lower_bound_s(costed), *steps)
    return plan if bound == plan.lower_bound_s else replace(plan, lower_bound_s=bound)


@contextlib.contextmanager
def _memory_limit_named(prepared: Prepared) -> Iterator[None]:
    """A plan that does not fit says so when the devices' memory is the limit the caller gave
    (the solvers see only device memories, and advise larger devices)."""
    try:
        yield
    except InfeasibleError as exc:
        limit = prepared.target.memory_limit_bytes
        if limit is None:
            raise
        raise InfeasibleError(
            f"{exc}; each device's memory here is memory_limit_bytes={limit} as given"
        ) from None


def _check_model(model: Any) -> _Inexact:
    """Refuse, in one line and before the slow work, what is no Keras model; the layers, nested
    ones too, that are not exact under a split batch. A model the copying rewrites refuse (its
    own training step, layers that cannot be rebuilt) is placed in place, on whole batches or
    as data-parallel replicas (:func:`passes.checks.batch_split_refusal` leaves out the
    strategies that micro-batch)."""
    from passes.backend import check_keras_backend

    check_keras_backend()
    import keras

    from passes.checks import inexact_layers

    if not isinstance(model, keras.Model):
        raise UsageError(
            f"model= is {'None' if model is None else 'a ' + type(model).__qualname__}, not a "
            "Keras model; pass a keras.Model (a Sequential, functional or subclassed model)"
        )
    return inexact_layers(model)


_SPLITTING = {
    Family.DATA_PARALLEL: "replicas",
    Family.PIPELINE: "micro-batches",
    Family.HYBRID: "replicas and micro-batches",
}
"""The families that split each batch into shares, and into what."""


def _whole_batch_families(
    model: Any, families: tuple[Family, ...]
) -> tuple[tuple[Family, ...], tuple[str, ...]]:
    """``families`` without those that split each batch when ``model`` cannot take a split (a
    fixed batch, a sparse input), or without those that micro-batch when it takes replicas only
    (a model placed in place), with a note saying why; as given otherwise."""
    from passes.checks import batch_split_refusal

    splitting = [f for f in families if f in _SPLITTING]
    why = batch_split_refusal(model, "replicas or micro-batches", False) if splitting else None
    if why is None:
        splitting = [f for f in splitting if f is not Family.DATA_PARALLEL]
        why = batch_split_refusal(model, "micro-batches") if splitting else None
    kept = tuple(f for f in families if f not in splitting)
    if why is None or not kept:
        return families, ()
    names = ", ".join(f.value for f in splitting)
    return kept, (f"not compared: {names} ({why})",)


def _check_splittable(model: Any, prepared: Prepared) -> None:
    """UsageError before the trace when every plan the options allow splits each batch (a
    family of :data:`_SPLITTING` named, or ``pipeline=True``) and ``model`` cannot take that
    (:func:`passes.checks.batch_split_refusal`: a fixed batch, a sparse input, micro-batches of
    a model placed in place); the search leaves those families out by itself otherwise."""
    from passes.checks import batch_split_refusal

    families = prepared.search.strategy_families
    if prepared.search.pipeline:
        shares, micro = "micro-batches", True
    elif families is not None and all(f in _SPLITTING for f in families):
        shares = " or ".join(_SPLITTING[f] for f in families)
        micro = any(f is not Family.DATA_PARALLEL for f in families)
    else:
        return
    why = batch_split_refusal(model, shares, micro)
    if why is not None:
        raise UsageError(why)


def _applyable(model: Any, plan: Plan, costed: CostedGraph) -> Plan:
    """``plan`` with every layer that emits no op on the device (stage) of a neighbour in the
    Keras graph (:func:`passes.checks.join_neighbours`; such a layer costs nothing, so the
    predictions stand), checked applyable (:func:`passes.checks.check_applyable`): a plan that
    cannot be applied is refused here in one line, never written."""
    from passes.checks import check_applyable, join_neighbours, opless_layers

    opless = opless_layers(costed.graph)
    strategy = plan.strategy
    if opless and strategy is not None:
        stages = join_neighbours(
            model, dict(zip(plan.layer_order, strategy.stage_of_layer)), opless
        )
        strategy = replace(strategy, stage_of_layer=tuple(stages[n] for n in plan.layer_order))
        plan = replace(plan, strategy=strategy, device_of_layer=strategy.layer_devices(0))
    elif opless:
        devices = join_neighbours(model, plan.assignment, opless)
        plan = replace(plan, device_of_layer=tuple(devices[n] for n in plan.layer_order))
    check_applyable(model, plan)
    return plan


def _split_plan(
    costed: CostedGraph, solved: _Solved, compared: _Compared | None, common: dict[str, Any]
) -> Plan:
    """The plan that applies the solver's split (pipelined when asked), written as a strategy of
    one replica, beside the families table when the strategies were compared."""
    pipeline = solved.pipeline
    strategy = solved.strategy
    refused = compared.refused if compared is not None else ()
    rows = compared.rows if compared is not None else ()
    scored = tuple(r.family for r in rows)
    advice = _advice(costed, solved.evaluation, common["baselines"], pipeline, refused, scored)
    idle = solved.idle_advice
    if idle and Family.DATA_PARALLEL in refused:  # no replicas to recommend
        idle = idle.replace(_use_them_all(pipeline is not None), "")
    if idle:
        advice = (idle, *advice)
    if rows:
        advice = (strategy_advice(rows, strategy.family), *advice)
    return plan_from_solution(
        costed,
        solved.result,
        solved.evaluation,
        advice=advice,
        pipeline=pipeline,
        warnings=solved.warnings,
        timeline=solved.timeline,
        strategies=rows,
        strategy=strategy,
        **common,
    )


def _strategy_plan(
    compared: _Compared,
    chosen: StrategyCandidate,
    prepared: Prepared,
    common: dict[str, Any],
    inexact: _Inexact = (),
) -> Plan:
    """The plan that applies the chosen strategy: replica 0's simulation on the graph costed at
    the per-replica batch, the step with the all-reduce (:func:`plan_from_candidate`)."""
    strategy = chosen.strategy
    costed = compared.graphs[prepared.target.batch_size // strategy.replicas]
    assignment = strategy.layer_devices(0)
    pipeline = chosen.simulation.replica.pipeline
    if pipeline is not None:
        timeline = pipeline.timeline
    else:
        timeline = simulate_step(costed, assignment, timeline=True).timeline
    warnings = _microbatch_warnings(inexact, strategy.num_microbatches, strategy.replicas)
    for line in warnings:
        logger.warning("%s", line)
    over = [d for d in chosen.simulation.replica.per_device if not d.fits]
    idle = (compared.idle_advice,) if compared.idle_advice else ()
    asked = _families_asked(prepared)
    advice = (
        strategy_advice(compared.rows, strategy.family, asked=asked),
        *_faster_than_asked(chosen.step_time_s, common["baselines"], asked),
        *idle,
        *_over_memory(over),
    )
    return plan_from_candidate(
        costed,
        chosen,
        solver=prepared.solver.name,
        solve_time_s=compared.search_time_s,
        notes=compared.notes,
        advice=advice,
        warnings=warnings,
        timeline=timeline,
        strategies=compared.rows,
        **common,
    )


STRATEGY_SEARCH_LIMIT_S = 2.0
"""The most seconds the strategy comparison searches (its costing comes first and is not
counted): a plan's main search keeps the solver's time limit, and so does the refinement of the
best strategy, which its move budget ends (the same plan on a busy machine)."""

STRATEGY_SOLVERS = tuple(name for name in fast_solver_names() if name != "single")
"""The solvers that place a strategy's stages: every solver of the registry that does not search
until a time limit (one device is the ``single`` family itself); the plan's own solver's split
(``auto``, ``ilp``, ...) is one more candidate, so no solver's split is faster on the plan's
objective (tests/test_api_strategy.py)."""


@dataclass(frozen=True)
class _Compared:
    """The strategy comparison: the families table, the graph costed at each per-replica batch,
    and the strategy the plan applies (``None``: the plan applies the solver's split)."""

    rows: tuple[FamilyRow, ...]
    graphs: dict[int, CostedGraph]
    applied: StrategyCandidate | None
    notes: tuple[str, ...]
    search_time_s: float
    idle_advice: str = ""
    """Which devices the applied strategy leaves idle and what using them all costs
    (:func:`~partitioner.planner.explain.idle_advice`), when it leaves some."""
    refused: tuple[Family, ...] = ()
    """The families the model's own code refuses at every share of the batch they would run
    (:attr:`~partitioner.planner.search.StrategySearch.refused`): no advice recommends them."""


class _CostedAt:
    """``costed_at(b)``: the model traced and costed again at batch ``b`` (a replica's share, a
    micro-batch), measured as this run was; each batch once.

    Without measurements, a batch's graph comes from two traces at other batches where they
    determine it exactly (:func:`~partitioner.core.batching.graph_at_batch`), so a large model
    is traced twice, not once per batch the strategy search prices: at the batch and at its
    half, whichever batches the search asks for (the same two traces in every run at this
    batch, which the trace cache then serves)."""

    def __init__(
        self,
        model: Any,
        prepared: Prepared,
        costed: CostedGraph,
        traced: TraceResult,
        cache: TraceCache | None = None,
        writes: ProfileWrites | None = None,
    ):
        self.model, self._prepared, self._cache = model, prepared, cache
        self._writes = writes
        self.graphs = {prepared.target.batch_size: costed}
        self._traced = {prepared.target.batch_size: traced}
        measure = prepared.measure
        self._derive = not (measure.profile or measure.profile_ops)
        self._half_tried = False

    def _trace_half(self) -> None:
        """Trace the model at half the batch, once: the second trace the others derive from.
        A model that refuses that batch is traced at each batch asked instead."""
        half = self._prepared.target.batch_size // 2
        if self._half_tried or half < 1 or half in self._traced:
            return
        self._half_tried = True
        target = replace(self._prepared.target, batch_size=half)
        with contextlib.suppress(PartitionError):
            self._traced[half] = _trace(self.model, target, _no_progress, [], self._cache)

    def _traced_at(self, batch: int) -> TraceResult:
        if self._derive:
            self._trace_half()
        if self._derive and len(self._traced) >= 2:
            low, high = min(self._traced), max(self._traced)
            graph = graph_at_batch(self._traced[low].graph, self._traced[high].graph, batch)
            if graph is not None:
                return replace(self._traced[low], graph=graph, step_function=None)
        target = replace(self._prepared.target, batch_size=batch)
        self._traced[batch] = _trace(self.model, target, _no_progress, [], self._cache)
        return self._traced[batch]

    def confirm(self, batch: int) -> None:
        """Trace the model for real at ``batch`` unless it was: a derived graph never ran the
        model's own code there (a layer may refuse some batches, in its forward pass or in its
        gradient); its error is raised. The trace cache serves it the next time."""
        if batch not in self._traced:
            target = replace(self._prepared.target, batch_size=batch)
            self._traced[batch] = _trace(self.model, target, _no_progress, [], self._cache)

    def __call__(self, batch: int) -> CostedGraph:
        if batch not in self.graphs:
            at = replace(self._prepared, target=replace(self._prepared.target, batch_size=batch))
            traced = self._traced_at(batch)
            self.graphs[batch], _ = _cost(self.model, traced, at, _no_progress, [], self._writes)
        return self.graphs[batch]


def _pipelined_costs(
    costed_at: _CostedAt, prepared: Prepared, say: Progress, phases: list[tuple[str, float]]
) -> CostedGraph | None:
    """With a pipeline asked for, the batch's graph with its ops priced at the micro-batch
    (:func:`~partitioner.simulation.strategy.microbatch_costed`): what the pipeline's step is
    simulated on. ``None`` without one."""
    if prepared.schedule is None:
        return None
    batch, micro = prepared.target.batch_size, prepared.num_microbatches
    if micro == 1:
        return costed_at(batch)
    say(f"costing a micro-batch of {batch // micro}")
    share = BatchShare(batch, num_microbatches=micro, given=True)
    with _timed(phases, "micro-batch cost"):
        try:
            at_micro = costed_at(share.size)
            costed_at.confirm(share.size)  # derived: the model's own code never ran there
        except PartitionError as exc:  # the model's own code at the micro-batch: say which
            raise at_share(exc, share) from exc
        return microbatch_costed(costed_at(batch), at_micro, micro)


def _compare(costed_at: _CostedAt, prepared: Prepared, solved: _Solved) -> _Compared | None:
    """Every strategy family scored by the predicted step of what it would run
    (:func:`partitioner.planner.search.search_strategies`, the model traced and costed again at
    each per-replica batch and micro-batch, measured as this run was), with the solver's own
    split as one more candidate. ``None`` when the comparison fails and the plan applies the
    solver's split anyway (a warning says why); a forced family's failure raises."""
    batch, families = prepared.target.batch_size, prepared.search.strategy_families
    solver = prepared.solver.name
    whole, left_out = _whole_batch_families(costed_at.model, families or tuple(Family))
    options = StrategyOptions(
        families=whole,
        placement_solvers=STRATEGY_SOLVERS
        + ((solver,) if solver not in (*STRATEGY_SOLVERS, "auto") else ()),
        seed=prepared.search.seed,
        time_limit_s=min(prepared.search.time_limit_s, STRATEGY_SEARCH_LIMIT_S),
        refine_limit_s=prepared.search.time_limit_s,  # the user's: its note says to raise it
        also_score=((solved.strategy, solved.result.solver),),
    )
    t0 = time.perf_counter()
    try:
        search = search_strategies(costed_at, batch, options, confirm=costed_at.confirm)
    except PartitionError as exc:
        if families is not None and set(families) != set(Family):
            raise
        logger.warning("strategies not compared: %s", exc)
        return None
    # a plain split by a named solver is that solver's own split, under its name (it applied
    # another solver's refined split labelled round-robin, campaign 34w)
    own_split = families is not None and set(families) == {Family.PLACED} and solver != "auto"
    applied = None if families is None or own_split else search.best
    return _Compared(
        rows=family_rows(search),
        graphs=costed_at.graphs,
        applied=applied,
        notes=(*left_out, *search.notes),
        search_time_s=time.perf_counter() - t0,
        idle_advice=idle_advice(search),
        refused=search.refused,
    )


def _trace(
    model: Any,
    target: TargetOptions,
    say: Progress,
    phases: list[tuple[str, float]],
    cache: TraceCache | None = None,
) -> TraceResult:
    """Trace one training step of ``model`` at the target's batch size (read from ``cache``
    when it holds it: the phase is then ``trace cache``)."""
    from passes.trace import trace_model

    say("tracing")
    if cache is None:
        traced = trace_model(model, batch_size=target.batch_size, input_shape=target.input_shape)
    else:
        hits = cache.hits
        traced = cache.trace(model, target.batch_size, target.input_shape)
        if cache.hits > hits:
            phases.append(("trace cache", traced.trace_time_s))
            return traced
    phases += [("trace", traced.trace_time_s), ("flops", traced.flops_time_s)]
    return traced


def _cost(
    model: Any,
    traced: TraceResult,
    prepared: Prepared,
    say: Progress,
    phases: list[tuple[str, float]],
    writes: ProfileWrites | None = None,
) -> tuple[CostedGraph, tuple[str, ...]]:
    """The costed graph and notes on where its times come from: estimated, then replaced by
    measured layer times (``profile``; new cache entries wait in ``writes``) and op times
    (``profile_ops``) when asked."""
    say("costing")
    given = prepared.target.precision
    policy = (
        traced_precision(traced.graph, traced.tf32_enabled)
        if given is None
        else parse_precision(given)
    )
    with _timed(phases, "cost"):
        costed = cost_graph(
            traced.graph, topology=prepared.topology, optimizer=prepared.optimizer, precision=policy
        )
    types = {d.device_type for d in prepared.topology.devices}
    notes: tuple[str, ...] = (f"{ESTIMATED_NOTE}: {calibration_note(types)}",)
    if prepared.measure.profile or prepared.measure.profile_ops:
        from passes.trace import KERAS_CALL_LOCK

        # Measuring wraps Keras's Layer.__call__ (profile) and runs TensorFlow's process-wide
        # profiler (profile_ops), and a time taken while another thread works is not this
        # model's: one measurement (or trace) at a time in a process.
        with KERAS_CALL_LOCK:
            costed, notes = _measured(
                model, traced, costed, prepared, (say, phases, writes), notes
            )
    origin = "the model's dtype policy" if given is None else f"precision={given!r}"
    links = links_note(prepared.topology)
    notes = (*notes, *_loop_notes(traced.graph))
    return costed, (*notes, f"priced at precision {policy.value} ({origin})", links)


_LOOPS = frozenset({"While", "StatelessWhile"})
"""TensorFlow's loop ops (``tf.while_loop``, ``keras.ops.fori_loop``, ``tf.map_fn``)."""


def _loop_notes(graph: Graph) -> tuple[str, ...]:
    """A note naming the layers that run a loop of their own: the trace prices a loop's body
    once, whatever the trip count, which it cannot know (campaign 34s: a body run 200 times was
    predicted as one pass, 186x under its unrolled twin)."""
    layers = sorted({op.layer for op in graph.ops if op.op_type in _LOOPS and op.layer})
    if not layers:
        return ()
    shown = ", ".join(repr(name) for name in layers[:5]) + (" ..." if len(layers) > 5 else "")
    return (
        f"layers {shown} run a loop (tf.while_loop): its body is priced once per step, not once "
        "per iteration (the trace cannot know how many); profile=True measures them",
    )


def _cache_checked(prepared: Prepared) -> Prepared:
    """With ``profile``, the profile cache checked once for writing: one that cannot be written
    is one warning, and the run's profiles (one per batch the strategy search costs) read it
    without writing (``write_cache=False``), instead of one warning each."""
    measure = prepared.measure
    if not measure.profile or not prepared.write_cache:
        return prepared
    from cost_models.measure.profiled import cache_write_problem

    problem = cache_write_problem(measure.cache_dir)
    if problem is None:
        return prepared
    logger.warning(
        "profile cache %s not written (%s); this run's measurements are not cached",
        measure.cache_dir or "(default)",
        problem,
    )
    return replace(prepared, write_cache=False)


def _measured(
    model: Any,
    traced: TraceResult,
    costed: CostedGraph,
    prepared: Prepared,
    run: tuple[Progress, list[tuple[str, float]], ProfileWrites | None],
    notes: tuple[str, ...],
) -> tuple[CostedGraph, tuple[str, ...]]:
    """``costed`` with measured layer times (``profile``) and op times (``profile_ops``);
    ``run``: the progress, the phases and where new profile cache entries wait."""
    say, phases, writes = run
    measure = prepared.measure
    if measure.profile:
        with _timed(phases, "profile"):
            costed, notes = _profile(model, costed, prepared, say=say, writes=writes)
    if measure.profile_ops:
        with _timed(phases, "profile ops"):
            costed, op_notes = _profile_ops(
                model, traced, costed, optimizer=prepared.optimizer, say=say
            )
        notes = (*notes, *op_notes) if measure.profile else op_notes
    return costed, notes


@dataclass(frozen=True)
class _Solved:
    """The chosen placement, its evaluation and what the plan records beside them."""

    result: SolverResult
    evaluation: PlanEvaluation
    timeline: tuple[TimelineEvent, ...]
    pipeline: PipelineInfo | None = None
    plain_step_time_s: float | None = None
    """With pipelining, the step time of the same placement without it."""
    warnings: tuple[str, ...] = ()
    idle_advice: str = ""
    """Which devices the placement leaves idle, when the model has fewer layers than devices."""

    @property
    def strategy(self) -> Strategy:
        """The split as a strategy of one replica (its pipeline's stages and schedule)."""
        pipeline = self.pipeline
        return strategy_of_split(
            self.result.assignment,
            stage_devices=pipeline.stage_devices if pipeline is not None else (),
            num_microbatches=pipeline.num_microbatches if pipeline is not None else 1,
            schedule=pipeline.schedule if pipeline is not None else Schedule.NONE,
        )


def _solve(
    costed: CostedGraph,
    prepared: Prepared,
    inexact: _Inexact = (),
    pipelined: CostedGraph | None = None,
) -> _Solved:
    """The solver's placement (:func:`_solve_on`); on a topology of more devices than the model
    has layers, placed on as many devices as layers (:func:`placement_devices`) and simulated on
    the whole topology, the other devices idle (the strategy search uses them for replicas)."""
    devices = placement_devices(costed, prepared.solver.name)
    if devices is None:
        return _solve_on(costed, prepared, inexact, pipelined)
    sub = _on_devices(costed, devices)
    sub_pipelined = None if pipelined is None else _on_devices(pipelined, devices)
    solved = _solve_on(sub, prepared, inexact, sub_pipelined)
    return _lifted(solved, devices, costed, pipelined, prepared.solver.name)


def placement_devices(costed: CostedGraph, solver: str) -> tuple[int, ...] | None:
    """The devices a placement of ``costed`` by ``solver`` is solved on when the topology has more
    devices than the model has layers: as many as layers, the first in host order (a placement
    puts each layer on one device and leaves none of its devices empty, so it cannot use more).
    ``None`` when it can use every device, and for ``single`` (one device whatever the count)."""
    problem = costed.problem()
    if solver == "single" or problem.num_devices <= problem.num_layers:
        return None
    return device_layouts(costed.topology, 1, problem.num_layers)[0][0]


def _on_devices(costed: CostedGraph, devices: tuple[int, ...]) -> CostedGraph:
    """``costed`` on ``devices`` only, renumbered ``0..len(devices)-1`` in that order."""
    return replace(
        costed,
        topology=sub_problem(costed.problem(), devices).topology,
        op_compute_time_s=tuple(costed.op_compute_time_s[d] for d in devices),
    )


def _use_them_all(pipelined: bool) -> str:
    """What a placement that leaves devices idle recommends (not when the model's own code
    refuses a replica's share of the batch: :attr:`_Compared.refused`): replicas, which a
    pipeline asked for (``pipeline=True``) excludes."""
    without = ", without pipeline=True," if pipelined else ""
    return f" (strategy='data_parallel'{without} can use them all, as data-parallel replicas)"


def _lifted(
    solved: _Solved,
    devices: tuple[int, ...],
    costed: CostedGraph,
    pipelined: CostedGraph | None,
    solver: str,
) -> _Solved:
    """``solved`` (placed on ``devices``, renumbered) on the whole topology: its assignment in the
    topology's indices, simulated again there so that every device has its row (the idle ones
    empty), and a line saying which devices it leaves idle."""
    assignment = tuple(devices[d] for d in solved.result.assignment)
    n, used = costed.topology.num_devices, set(assignment)
    idle = tuple(d for d in range(n) if d not in used)
    line = (
        f"A placement puts each layer on one device and the model has "
        f"{costed.problem().num_layers} layers: this {solver} plan uses {len(used)} of the {n} "
        f"devices, {devices_text(idle)} idle{_use_them_all(solved.pipeline is not None)}"
    )
    result = replace(solved.result, assignment=assignment, notes=(*solved.result.notes, line))
    solved = replace(solved, result=result, idle_advice=line + ".")
    if solved.pipeline is None:
        timeline = simulate_step(costed, assignment, timeline=True).timeline
        return replace(solved, evaluation=evaluate(costed, assignment), timeline=timeline)
    info = solved.pipeline
    evaluation = evaluate_pipeline(
        pipelined or costed,
        assignment,
        schedule=info.schedule,
        num_microbatches=info.num_microbatches,
    )
    sim = evaluation.pipeline
    if sim is not None:
        info = replace(info, stage_devices=sim.stage_devices, bubble_fraction=sim.bubble_fraction)
    return replace(
        solved, evaluation=evaluation, pipeline=info, timeline=sim.timeline if sim else ()
    )


def _solve_on(
    costed: CostedGraph,
    prepared: Prepared,
    inexact: _Inexact = (),
    pipelined: CostedGraph | None = None,
) -> _Solved:
    """The solver's placement, simulated op by op; with pipelining, the best pipelined placement
    (:func:`_pipeline_choice`, on ``pipelined``: the graph priced at the micro-batch) with its
    schedule, stages and micro-batching warnings."""
    result, evaluation = solve(costed, prepared.solver)
    schedule, micro = prepared.schedule, prepared.num_microbatches
    if schedule is None:
        timeline = simulate_step(costed, result.assignment, timeline=True).timeline
        return _Solved(result=result, evaluation=evaluation, timeline=timeline)
    result, evaluation = _pipeline_choice(pipelined or costed, result, prepared, schedule)
    sim = evaluation.pipeline
    info = PipelineInfo(
        schedule=schedule,
        num_microbatches=micro,
        stage_devices=sim.stage_devices if sim is not None else (),
        bubble_fraction=sim.bubble_fraction if sim is not None else (),
    )
    return _Solved(
        result=result,
        evaluation=evaluation,
        timeline=sim.timeline if sim is not None else (),
        pipeline=info,
        plain_step_time_s=evaluate(costed, result.assignment).step_time_s,
        warnings=_microbatch_warnings(inexact, micro),
    )


PIPELINE_CANDIDATES = ("dp", "time", "even", "metis")
"""Contiguous-stage solvers ``auto`` also tries as pipelines (its own score is the steady state of
an endless pipeline; a finite number of micro-batches adds fill and drain)."""

_Evaluated = tuple[SolverResult, PlanEvaluation]


@dataclass(frozen=True)
class _Pipelining:
    """What choosing a pipelined placement needs: the costed graph and its problem, the schedule
    and micro-batches, and the options the candidate solvers run with."""

    costed: CostedGraph
    problem: PartitionProblem
    schedule: Schedule
    num_microbatches: int
    search: SearchOptions

    def staged(self, result: SolverResult) -> _Evaluated:
        """``result`` with its stages reordered into a pipeline, and its pipelined step."""
        assignment = acyclic_on_devices(result.assignment, self.problem)
        if assignment != result.assignment:
            result = replace(
                result,
                assignment=assignment,
                notes=(*result.notes, "stages reordered into a pipeline (acyclic_on_devices)"),
            )
        return result, evaluate_pipeline(
            self.costed,
            result.assignment,
            schedule=self.schedule,
            num_microbatches=self.num_microbatches,
        )

    def candidate(self, name: str, tried: list[str]) -> _Evaluated | None:
        """Solver ``name``'s placement as a pipeline, or ``None`` when it fails; either way one
        entry in ``tried``."""
        try:
            solver = get_solver(name, seed=self.search.seed, time_limit_s=self.search.time_limit_s)
            candidate = self.staged(solver.solve(self.problem))
        except PartitionError as exc:
            tried.append(f"{name}: {type(exc).__name__}")
            return None
        tried.append(f"{name}: {format_seconds(candidate[1].step_time_s)}")
        return candidate


def _pipeline_choice(
    costed: CostedGraph, result: SolverResult, prepared: Prepared, schedule: Schedule
) -> _Evaluated:
    """The solver's placement as a pipeline (stages made acyclic) and, for ``auto``, the best of
    it and the contiguous solvers' placements by the simulated pipelined step (memory first).

    A placement that still is no pipeline raises PlanError for a named solver; ``auto`` then
    keeps the best of the others that are (its notes say so), and raises only when none is."""
    pipelining = _Pipelining(
        costed=costed,
        problem=costed.problem(),
        schedule=schedule,
        num_microbatches=prepared.num_microbatches,
        search=prepared.search,
    )
    if prepared.solver.name != "auto":
        return _named_pipeline(pipelining, result, prepared.solver.name)
    return _auto_pipeline(pipelining, result)


def _named_pipeline(pipelining: _Pipelining, result: SolverResult, solver: str) -> _Evaluated:
    """A named solver's placement as a pipeline; PlanError naming the way out when it is none."""
    try:
        return pipelining.staged(result)
    except PlanError as exc:
        raise PlanError(
            f"the {solver} placement is not a pipeline even with its stages reordered: {exc}; "
            "plan with solver='auto' instead, or with a contiguous solver ('dp', 'time' or "
            "'even')"
        ) from None


def _auto_pipeline(pipelining: _Pipelining, own: SolverResult) -> _Evaluated:
    """The best pipeline of auto's own placement and the contiguous solvers' (fitting memory
    first, then the step time); the solver notes list every candidate's simulated step."""
    best: _Evaluated | None = None
    try:
        best = pipelining.staged(own)
    except PartitionError as exc:
        # auto's own placement: fall back to the best of the contiguous solvers'
        logger.warning("auto's own placement cannot be pipelined (%s); trying the others", exc)
        tried = [f"auto: not a pipeline ({_first_clause(str(exc))})"]
    else:
        tried = [f"auto: {format_seconds(best[1].step_time_s)}"]
    for name in PIPELINE_CANDIDATES:
        candidate = pipelining.candidate(name, tried)
        if candidate is not None and _better(candidate[1], best):
            best = (
                replace(candidate[0], solver="auto", status=SolveStatus.HEURISTIC),
                candidate[1],
            )
            tried[-1] += " (chosen)"
    if best is None:
        raise PlanError(
            "no placement of auto or of the contiguous solvers "
            f"({', '.join(PIPELINE_CANDIDATES)}) could be pipelined: {'; '.join(tried)}; "
            "plan without pipeline=True"
        )
    note = (
        f"pipelined {pipelining.schedule.value} x {pipelining.num_microbatches} simulated: "
        + "; ".join(tried)
    )
    return replace(best[0], notes=(*best[0].notes, note)), best[1]


def _better(candidate: PlanEvaluation, best: _Evaluated | None) -> bool:
    """Whether ``candidate`` beats ``best``: fitting in memory first, then the step time."""
    if best is None:
        return True
    return (not candidate.fits, candidate.step_time_s) < (not best[1].fits, best[1].step_time_s)


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
        if get_device_type(d.device_type).kind is DeviceKind.CPU:
            rows[d.index] = "/device:CPU:0"
        elif k < len(gpus):
            rows[d.index] = gpus[k]
            k += 1
    return rows


def _profile(
    model: Any,
    costed: CostedGraph,
    prepared: Prepared,
    *,
    say: Progress,
    writes: ProfileWrites | None = None,
) -> tuple[CostedGraph, tuple[str, ...]]:
    """Measure the layers on the devices present and merge the times into ``costed`` (new
    cache entries wait in ``writes`` for the run to succeed)."""
    target, measure = prepared.target, prepared.measure
    from cost_models.measure.profiled import apply_profile, profile_model

    topo = costed.topology
    rows = _profile_rows(topo)
    if not rows:
        import tensorflow as tf

        present = ", ".join(d.name for d in tf.config.list_logical_devices()) or "none"
        types = ", ".join(sorted({d.device_type for d in topo.devices}))
        raise UsageError(
            f"profile=True measures the devices present, and none here is a {types} (TensorFlow "
            f"sees: {present}); plan for device_type='cpu' to profile this machine, or drop "
            "profile=True to use the estimates"
        )
    devices = sorted(set(rows.values()))
    result = profile_model(
        model,
        batch_size=target.batch_size,
        devices=devices,
        input_shape=target.input_shape,
        cache_dir=measure.cache_dir,
        write_cache=prepared.write_cache,
        writes=writes,
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
    """The topology's cpu devices, which ``profile_ops`` measures; UsageError when none."""
    rows = [d.index for d in topo.devices if get_device_type(d.device_type).kind is DeviceKind.CPU]
    if not rows:
        types = ", ".join(sorted({d.device_type for d in topo.devices}))
        raise UsageError(
            f"profile_ops=True times ops on this machine's CPU, and the plan has no cpu device "
            f"(it plans {types}); plan for device_type='cpu', or use profile=True (per layer, "
            "on the devices present)"
        )
    return rows


def _profile_ops(
    model: Any, traced: TraceResult, costed: CostedGraph, *, optimizer: Optimizer, say: Progress
) -> tuple[CostedGraph, tuple[str, ...]]:
    """Time every op inside the traced step on this machine's CPU; merge into the cpu rows,
    scaled so that one device's step is the whole step measured without the profiler."""
    import tensorflow as tf

    from cost_models.estimate.analytic import calibrated_roofline
    from cost_models.measure.op_profile import apply_step_profile, profile_step_ops, step_inputs

    topo = costed.topology
    rows = _cpu_rows(topo)
    say("profiling ops")
    with tf.device("/device:CPU:0"):
        prof = profile_step_ops(
            traced, step_inputs(traced), steps=PROFILED_STEPS, warmup=3, wall_steps=WALL_STEPS
        )
    dispatch_s = calibrated_roofline("cpu").dispatch_overhead_s
    profiled, factor = apply_step_profile(costed, prof, rows, dispatch_s=dispatch_s)
    notes: tuple[str, ...] = (
        f"timed {len(prof.op_time_s)} of {len(traced.graph.ops)} ops inside the training step on "
        f"/device:CPU:0 (TensorFlow's profiler, median of {prof.profiled_steps} steps) for cpu "
        f"devices {rows}; {len(profiled.measured)} layers measured, plus "
        f"{1e6 * dispatch_s:.1f} us of executor time per op; the op times scaled by "
        f"x{factor:.3f} so that one device's step is the step measured without the profiler "
        f"({format_seconds(prof.step_time_s)}, median of {WALL_STEPS}); ops TensorFlow ran side "
        "by side (its default threads) count their share of the CPU while they ran",
    )
    estimated = [d.index for d in topo.devices if d.index not in rows]
    if estimated:
        notes += (f"devices {estimated} are not cpus: their op times stay estimated",)
    profiled, update_notes = _with_update(model, traced, profiled, rows, optimizer)
    profiled, speed_notes = _at_device_speeds(profiled, rows)
    return profiled, (*notes, *update_notes, *speed_notes)


def _with_update(
    model: Any, traced: TraceResult, costed: CostedGraph, rows: list[int], optimizer: Optimizer
) -> tuple[CostedGraph, tuple[str, ...]]:
    """The optimizer's update of the step, timed here, given to each layer's backward ops."""
    import tensorflow as tf

    from cost_models.estimate.costs import with_update_time
    from cost_models.measure.op_profile import step_inputs
    from cost_models.measure.update import update_time_s

    with tf.device("/device:CPU:0"):
        update_s = update_time_s(
            model, traced.step_function, step_inputs(traced), lambda: _keras_optimizer(optimizer)
        )
    if update_s is None:
        return costed, (
            "the optimizer's update not timed (Keras cannot clone the model, or its outputs "
            "have no static shape): the step is priced without it",
        )
    return with_update_time(costed, rows, update_s), (
        f"the {optimizer.value} update of every variable timed here ({format_seconds(update_s)}: "
        "train_on_batch of a clone less the traced step and Keras's fixed cost) and given to "
        "the layers by their weights and slots",
    )


def _keras_optimizer(optimizer: Optimizer) -> Any:
    """A new Keras optimizer of ``optimizer``'s kind (``momentum``: SGD with momentum 0.9)."""
    import keras

    if optimizer is Optimizer.MOMENTUM:
        return keras.optimizers.SGD(momentum=0.9)
    return keras.optimizers.get(optimizer.value)


def _at_device_speeds(costed: CostedGraph, rows: list[int]) -> tuple[CostedGraph, tuple[str, ...]]:
    """Op times profiled here, scaled to each device's speed measured by ``partition calibrate``
    (the same matrix-product benchmark timed in this process)."""
    if not costed.topology.device_flops_per_s:
        return costed, ()
    from cost_models.estimate.costs import SAME_SPEED_BAND, scale_to_device_speeds
    from cost_models.measure.transfers import matmul_flops_per_s

    here = matmul_flops_per_s("/device:CPU:0")
    scaled, factors = scale_to_device_speeds(costed, rows, here)
    speeds = costed.topology.device_flops_per_s
    each = ", ".join(
        f"device {d} x{f:.2f} ({speeds[d] / 1e9:.0f} GFLOP/s)" for d, f in factors.items()
    )
    return scaled, (
        f"op times scaled to each device's measured speed against this process's "
        f"{here / 1e9:.0f} GFLOP/s (float32 matrix products; a device within "
        f"{SAME_SPEED_BAND:.0%} of it is taken as this speed, x1.00): {each}",
    )


def _microbatch_warnings(
    inexact: _Inexact, num_microbatches: int, replicas: int = 1
) -> tuple[str, ...]:
    """One loud line per layer class that is not exact when the batch is split into micro-batches
    or replicas' shares (statistics over a part of the batch, random draws): ``inexact`` from
    :func:`passes.checks.inexact_layers` (nested layers too; a rate 0 or a frozen
    BatchNormalization is exact)."""
    if num_microbatches * replicas <= 1:
        return ()
    parts = [f"{replicas} replicas"] if replicas > 1 else []
    if num_microbatches > 1:
        parts.append(f"{num_microbatches} micro-batches")
    split = " x ".join(parts)
    by_class: dict[str, list[str]] = {}
    why: dict[str, str] = {}
    for entry, name in inexact:
        by_class.setdefault(entry.class_name, []).append(name)
        why[entry.class_name] = INEXACT_UNDER_MICROBATCHES.get(entry.class_name, entry.why)
    out = []
    for cls, names in sorted(by_class.items()):
        shown = ", ".join(names[:3]) + (f" +{len(names) - 3} more" if len(names) > 3 else "")
        out.append(f"NOT EXACT: {cls} ({shown}) {why[cls]} ({split}).")
    return tuple(out)


def _all_baselines(
    costed: CostedGraph, solved: _Solved, prepared: Prepared, pipelined: CostedGraph | None = None
) -> tuple[BaselineResult, ...]:
    """The baselines of :data:`BASELINES` (but the solver's own), after a pipelined plan's own
    placement without pipelining (``pipelined``: the graph priced at the micro-batch, which a
    pipelined baseline is simulated on)."""
    baselines = _baselines(costed, prepared, pipelined)
    if solved.plain_step_time_s is None:
        return baselines
    plain = BaselineResult(
        solver=f"{prepared.solver.name} without pipelining", step_time_s=solved.plain_step_time_s
    )
    return (plain, *baselines)


def _fastest_alone(costed: CostedGraph) -> CostedGraph:
    """``costed`` on its fastest device alone, to say whether a split is needed at all."""
    fastest = min(
        range(costed.topology.num_devices), key=lambda d: sum(costed.op_compute_time_s[d])
    )
    dev = replace(costed.topology.devices[fastest], index=0, host=0)
    return CostedGraph(
        graph=costed.graph,
        topology=Topology(devices=(dev,), link=costed.topology.link),
        op_compute_time_s=(costed.op_compute_time_s[fastest],),
        layer_memory=costed.layer_memory,
    )


def _baselines(
    costed: CostedGraph, prepared: Prepared, pipelined: CostedGraph | None = None
) -> tuple[BaselineResult, ...]:
    """``single`` (one device, no pipeline) and ``even`` (pipelined like the plan when it is, on
    ``pipelined``; on as many devices as layers when there are more devices,
    :func:`placement_devices`)."""
    search, schedule = prepared.search, prepared.schedule
    out = []
    for name in BASELINES:
        if name == prepared.solver.name:
            continue
        baseline = get_solver(name, seed=search.seed, time_limit_s=search.time_limit_s)
        if name == "single":
            target = _fastest_alone(costed)
        else:
            target = pipelined if schedule is not None and pipelined is not None else costed
        devices = placement_devices(target, name)
        if devices is not None:  # more devices than layers: one layer on each of the first
            target = _on_devices(target, devices)
        try:
            result, ev = solve(target, baseline)
            if schedule is not None and name != "single":
                staged = acyclic_on_devices(result.assignment, target.problem())
                ev = evaluate_pipeline(
                    target, staged, schedule=schedule, num_microbatches=prepared.num_microbatches
                )
        except PartitionError as exc:
            out.append(BaselineResult(solver=name, step_time_s=None, note=_baseline_note(name, exc)))
            continue
        n = costed.topology.num_devices
        notes = [] if devices is None else [f"on {len(devices)} of the {n} devices"]
        notes += [] if ev.fits else ["over the memory limit"]
        out.append(BaselineResult(solver=name, step_time_s=ev.step_time_s, note="; ".join(notes)))
    return tuple(out)


def _baseline_note(name: str, exc: PartitionError) -> str:
    """Why the baseline ``name`` has no step: its error, but for ``single`` (the model on one
    device) without the device count its message advises, which the user's own is above (it
    told a user of four devices to use gpus=2, campaign 34am)."""
    text = str(exc)
    if name == "single" and isinstance(exc, InfeasibleError) and "; use gpus=" in text:
        return text.split("; use gpus=", 1)[0].removesuffix(" (have 1)") + "; one device cannot hold it"
    return text


def _advice(
    costed: CostedGraph,
    evaluation: PlanEvaluation,
    baselines: Sequence[BaselineResult],
    pipeline: PipelineInfo | None = None,
    refused: tuple[Family, ...] = (),
    scored: tuple[Family, ...] = (),
) -> tuple[str, ...]:
    """Honest advice: say when a plain split cannot beat one device, and what would (not the
    families ``refused``: the model's own code fails at the shares of the batch they run; nor
    as a thing to try, the families ``scored`` beside the plan)."""
    n = costed.topology.num_devices
    total = peak_bytes(costed.layer_memory)
    limit = max(d.memory_bytes for d in costed.topology.devices)
    single = next((b for b in baselines if b.solver == "single"), None)
    single_s = single.step_time_s if single is not None else None
    advice: list[str] = []
    if n > 1 and pipeline is not None:
        fits_one = total <= limit and Family.DATA_PARALLEL not in (*refused, *scored)
        advice += _pipeline_advice(
            evaluation, single_s, pipeline, fits_one=fits_one, batch=costed.graph.batch_size
        )
    elif n > 1 and total <= limit:
        fits = (
            f"The model fits one {costed.topology.devices[0].device_type} "
            f"({format_bytes(total)} of {format_bytes(limit)})"
        )
        used = sum(1 for d in evaluation.per_device if d.layers)
        advice.append(_split_advice(fits, evaluation, single_s, used, refused))
    elif n > 1:
        advice.append(
            f"The model needs {format_bytes(total)}, more than one "
            f"{costed.topology.devices[0].device_type} holds ({format_bytes(limit)}): the split "
            "is required for memory."
        )
    advice += _over_memory([d for d in evaluation.per_device if not d.fits])
    return tuple(advice)


def _over_memory(over: Sequence[DeviceLoad]) -> tuple[str, ...]:
    """The advice line naming the devices over their memory limit, if any."""
    if not over:
        return ()
    return (
        "Devices over their memory limit: "
        + ", ".join(
            f"{d.device} ({format_bytes(d.memory_bytes)} > {format_bytes(d.memory_limit_bytes)})"
            for d in over
        ),
    )


def _pipeline_advice(
    evaluation: PlanEvaluation,
    single_s: float | None,
    pipeline: PipelineInfo,
    *,
    fits_one: bool,
    batch: int,
) -> list[str]:
    """A pipelined plan against one device, data parallelism, and its bubbles (more
    micro-batches only where a larger count divides the ``batch``)."""
    advice = []
    m = pipeline.num_microbatches
    if single_s is not None:
        ratio = single_s / evaluation.step_time_s
        verdict = "faster" if ratio > 1 else "no faster"
        advice.append(
            f"Pipelined over {len(pipeline.stage_devices)} stages with {m} micro-batches "
            f"({pipeline.schedule.value}): predicted {format_seconds(evaluation.step_time_s)} "
            f"per batch vs {format_seconds(single_s)} on one device, {ratio:.2f}x ({verdict})."
        )
    if fits_one:
        advice.append(
            "The model also fits one device: data parallelism "
            "(tf.distribute.MirroredStrategy) needs no split and is worth comparing."
        )
    if max(pipeline.bubble_fraction, default=0.0) > 0.3:
        head = f"Bubbles reach {max(pipeline.bubble_fraction):.0%} of the step on some device; "
        if any(batch % more == 0 for more in range(m + 1, batch + 1)):
            advice.append(f"{head}more micro-batches (--microbatches, now {m}) shrink them.")
        else:
            rows = f"{batch // m} row" + ("s" if batch // m > 1 else "")
            advice.append(
                f"{head}no more micro-batches divide the batch of {batch} ({m} micro-batches of "
                f"{rows}): a larger batch (--batch-size) or fewer stages shrink them."
            )
    return advice


def _split_advice(
    fits: str,
    evaluation: PlanEvaluation,
    single_s: float | None,
    n: int,
    refused: tuple[Family, ...] = (),
) -> str:
    """A plain split of a model that fits one device: what it gains, and what would gain more
    (of the families the model's own code does not refuse, ``refused``)."""
    pointer = _pointer(refused)
    if single_s is None:
        return f"{fits}. {pointer}"
    if evaluation.step_time_s >= single_s:
        return (
            f"{fits}, and a plain split over {n} devices cannot beat it: the layers run one "
            f"device at a time (predicted {format_seconds(evaluation.step_time_s)} split vs "
            f"{format_seconds(single_s)} on one device). {pointer}"
        )
    gain = 1 - evaluation.step_time_s / single_s
    return (
        f"{fits}: a plain split over {n} devices gains only {gain:.0%} over one device "
        f"({format_seconds(evaluation.step_time_s)} vs {format_seconds(single_s)}), from ops "
        f"that overlap; the layers still run mostly one device at a time. {pointer}"
    )


def _pointer(refused: tuple[Family, ...]) -> str:
    """How else to use the devices at once: pipelining, data parallelism, but those ``refused``
    (then, when both are, one device)."""
    ways = []
    if Family.PIPELINE not in refused:
        ways.append("pipeline the stages with micro-batches (--pipeline)")
    if Family.DATA_PARALLEL not in refused:
        ways.append("use data parallelism (tf.distribute.MirroredStrategy)")
    if not ways:
        return (
            "The model's own code refuses the shares of the batch that pipelining and data "
            "parallelism run (see the notes): train on one device."
        )
    return f"To use the devices at once, {' or '.join(ways)}."
