"""End-to-end fuzzing (issue 8): random op-level graphs -> costs -> every solver -> simulators -> plan.

Inputs come from :mod:`fuzz_strategies`: op-level training graphs (forward ops by layer, backward
ops mirroring them, glue ops, tensors with sizes and FLOPs), heterogeneous device types and
per-device op times, memory limits in four regimes (some infeasible) and topologies of 1-2 hosts
with per-pair link overrides. Each invariant is its own test; example counts (``max_examples``):

* ``test_every_solver_places_every_layer_or_says_why``: 60 examples x all 10 solvers;
* ``test_colocation_is_respected_by_the_solvers_that_honour_it``: 40 examples x ilp, auto;
* ``test_simulated_step_is_a_valid_schedule``: 200 examples;
* ``test_pipelined_step_is_a_valid_schedule``: 200 examples (GPipe and 1F1B, M in 1..8);
* ``test_plan_json_is_deterministic_and_round_trips``: 20 examples x all 10 solvers, each plan
  built twice (with the single/even baselines, a timeline, and pipeline info in about half).

520 drawn cases and about 1,900 solver runs in all; the ILP and ``auto`` get
``time_limit_s=0.5`` (the problems have at most 6 layers and 4 devices, so CP-SAT finishes long
before that, and a search that ends before its limit is deterministic). The tests take 15-30 s
on the 2-core dev machine at load 5-6 (plus pytest's start-up). On a failure Hypothesis prints
the shrunk case; the strategies are deep, so shrinking can take minutes.
"""

from __future__ import annotations

import itertools
import json
import math
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import replace
from functools import cache
from pathlib import Path

import pytest
from fuzz_strategies import DEVICE_TYPES, FuzzCase, fuzz_cases
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError, PartitionError
from partitioner.core.files import write_atomic
from partitioner.core.ir import (
    CostedGraph,
    EventKind,
    PartitionProblem,
    Phase,
    Schedule,
    TimelineEvent,
    Topology,
)
from partitioner.plan.model import (
    BaselineResult,
    PipelineInfo,
    Plan,
    plan_from_solution,
)
from partitioner.simulation.bounds import costed_lower_bounds
from partitioner.simulation.evaluate import evaluate, evaluate_pipeline
from partitioner.simulation.pipeline import Stage, fed_ops, simulate_pipeline
from partitioner.simulation.step import channel_resource, device_resource, simulate_step
from partitioner.solvers import get_solver, solve, solver_names
from partitioner.solvers.base import colocation_roots, device_memory_bytes
from partitioner.solvers.stages import make_acyclic

TIME_LIMIT_S = 0.5
"""The solvers' time limit: small, and far above what CP-SAT needs on these problems."""

FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])
"""Settings every test here shares; each adds its ``max_examples``."""


def _close_or_above(value: float, bound: float) -> bool:
    """``value >= bound`` up to float rounding of sums of a few dozen terms."""
    return value >= bound - 1e-9 * max(1.0, abs(bound))


# ------------------------------------------------------------------------------- oracles


def _fits(assignment: Sequence[int], problem: PartitionProblem) -> bool:
    used = device_memory_bytes(assignment, problem)
    return all(u <= d.memory_bytes for u, d in zip(used, problem.topology.devices, strict=True))


def _contiguous_splits(num_layers: int, num_devices: int) -> Iterator[tuple[int, ...]]:
    """Every split of the layers into ``num_devices`` non-empty contiguous blocks, block d on d."""
    for cuts in itertools.combinations(range(1, num_layers), num_devices - 1):
        bounds = (0, *cuts, num_layers)
        yield tuple(d for d in range(num_devices) for _ in range(bounds[d], bounds[d + 1]))


def _some_placement_fits(problem: PartitionProblem, *, every_device_used: bool) -> bool:
    """Brute force: does any placement fit memory and keep colocation groups together?"""
    roots = colocation_roots(problem)
    units = sorted(set(roots))
    for choice in itertools.product(range(problem.num_devices), repeat=len(units)):
        unit_device = dict(zip(units, choice, strict=True))
        assignment = tuple(unit_device[r] for r in roots)
        if every_device_used and len(set(assignment)) < problem.num_devices:
            continue
        if _fits(assignment, problem):
            return True
    return False


def _may_be_infeasible(name: str, problem: PartitionProblem) -> bool:
    """When ``name`` may raise InfeasibleError, by its docstring's own conditions.

    Exact ones: ``single``/``even``/``round-robin`` fail iff their fixed placement does not fit;
    ``dp`` (and ``params`` on equal or all-positive memories) iff no split into D contiguous
    blocks fits; ``ilp`` and ``auto`` iff no placement fits (every device used when there are as
    many placement units as devices: the ILP's rule). Heuristics: ``time`` only when some
    contiguous split does not fit; ``metis`` (memory repair) and ``etf`` (greedy by free memory)
    never fail when the spare memory, sum of limits minus the model's total, is at least
    ``(D - 1) x`` the largest layer -- then some other device always has room for any layer.
    """
    n, d = problem.num_layers, problem.num_devices
    if name == "single":
        return not _fits((0,) * n, problem)
    if d > n:
        return True  # more devices than layers: every solver but `single` refuses
    if name == "even":
        return not _fits(tuple(k * d // n for k in range(n)), problem)
    if name == "round-robin":
        return not _fits(tuple(k % d for k in range(n)), problem)
    memories = [dev.memory_bytes for dev in problem.topology.devices]
    splits = list(_contiguous_splits(n, d))
    if name == "dp" or (name == "params" and (len(set(memories)) == 1 or min(memories) > 0)):
        return not any(_fits(s, problem) for s in splits)
    if name in ("params", "time"):
        return not all(_fits(s, problem) for s in splits)
    if name in ("metis", "etf"):
        spare = sum(memories) - sum(problem.memory_bytes)
        return spare < (d - 1) * max(problem.memory_bytes)
    assert name in ("ilp", "auto"), name
    units = len(set(colocation_roots(problem)))
    return not _some_placement_fits(problem, every_device_used=units >= d)


def _check_solver_answer(
    name: str, costed: CostedGraph, problem: PartitionProblem, seed: int
) -> None:
    """Run solver ``name`` on ``problem`` (``costed``'s, maybe with colocation) and check its
    answer, then evaluate it on ``costed`` as the plan would."""
    solver = get_solver(name, seed=seed, time_limit_s=TIME_LIMIT_S)
    try:
        result = solver.solve(problem)
    except InfeasibleError as exc:
        event(f"{name}: infeasible")
        message = str(exc)
        assert message and "\n" not in message, f"{name}: message not one line: {message!r}"
        assert _may_be_infeasible(name, problem), f"{name} refused a feasible problem: {message}"
        return
    where = f"{name}: assignment {result.assignment}"
    assert result.solver == name
    assert len(result.assignment) == problem.num_layers, where
    assert all(isinstance(x, int) and 0 <= x < problem.num_devices for x in result.assignment), (
        where
    )
    assert _fits(result.assignment, problem), f"{where} overflows device memory"
    if name in ("ilp", "auto"):  # the solvers that honour colocation and fill every device
        roots = colocation_roots(problem)
        assert all(result.assignment[k] == result.assignment[r] for k, r in enumerate(roots)), where
        if len(set(roots)) >= problem.num_devices:
            assert set(result.assignment) == set(range(problem.num_devices)), where
    assert result.objective is None or math.isfinite(result.objective)

    evaluation = evaluate(costed, result.assignment)
    assert evaluation.fits, where
    layers = sorted(x for load in evaluation.per_device for x in load.layers)
    assert layers == sorted(problem.layers), where
    assert _close_or_above(evaluation.step_time_s, evaluation.lower_bound_s), where


# ------------------------------------------------------------------------------- 1. solvers


@settings(FUZZ, max_examples=60)
@given(fuzz_cases(), st.integers(0, 3))
def test_every_solver_places_every_layer_or_says_why(case: FuzzCase, seed: int) -> None:
    """Every solver places each layer once, on a real device, within memory -- or raises a
    one-line InfeasibleError only under its documented conditions (:func:`_may_be_infeasible`)."""
    event(f"memory regime: {case.regime}")
    problem = case.costed.problem()
    for name in solver_names():
        _check_solver_answer(name, case.costed, problem, seed)


@st.composite
def _colocation_groups(draw: st.DrawFn, num_layers: int) -> tuple[tuple[int, ...], ...]:
    if num_layers < 2:
        return ()
    group = st.lists(st.integers(0, num_layers - 1), min_size=2, max_size=3, unique=True)
    return tuple(tuple(g) for g in draw(st.lists(group, min_size=1, max_size=2)))


@settings(FUZZ, max_examples=40)
@given(fuzz_cases(), st.data())
def test_colocation_is_respected_by_the_solvers_that_honour_it(
    case: FuzzCase, data: st.DataObject
) -> None:
    """``ilp`` and ``auto`` keep colocation groups together (the other solvers ignore
    ``problem.colocate``, as the auto docstring says) or raise only when no placement fits."""
    base = case.costed.problem()
    groups = data.draw(_colocation_groups(base.num_layers))
    problem = replace(base, colocate=groups)
    for name in ("ilp", "auto"):
        _check_solver_answer(name, case.costed, problem, seed=0)


# ------------------------------------------------------------------------------- 2. step simulator


def _assert_no_overlap(events: Sequence[TimelineEvent], slack: float) -> None:
    by_resource: dict[str, list[TimelineEvent]] = {}
    for ev in events:
        by_resource.setdefault(ev.resource, []).append(ev)
    for resource, mine in by_resource.items():
        mine.sort(key=lambda ev: (ev.start_s, ev.end_s))
        for a, b in itertools.pairwise(mine):
            assert b.start_s >= a.end_s - slack, f"{resource}: {a} overlaps {b}"


@settings(FUZZ, max_examples=200)
@given(fuzz_cases())
def test_simulated_step_is_a_valid_schedule(case: FuzzCase) -> None:
    """simulate_step: each op once, on its layer's device, for its time; after every input has
    arrived (over the link of that device pair); no overlap on a device or a link channel; each
    cross-device tensor sent once per destination device; step time >= every lower bound of
    :func:`costed_lower_bounds` (all three bound one sequential step; see bounds.py)."""
    costed, placement = case.costed, case.assignment
    graph, topo = costed.graph, costed.topology
    lg = graph.layer_graph
    sim = simulate_step(costed, placement, timeline=True)
    slack = 1e-9 * max(1.0, sim.step_time_s)
    n_ops = len(graph.ops)
    assert len(sim.op_start_s) == len(sim.op_end_s) == len(sim.op_device) == n_ops

    device_events: dict[int, list[TimelineEvent]] = {d: [] for d in range(topo.num_devices)}
    transfers: dict[tuple[str, str], list[TimelineEvent]] = {}
    for ev in sim.timeline:
        assert ev.end_s <= sim.step_time_s + slack
        if ev.kind is EventKind.TRANSFER:
            transfers.setdefault((ev.label, ev.resource), []).append(ev)
        else:
            assert ev.resource.startswith("device ")
            device_events[int(ev.resource.split()[1])].append(ev)

    for i, op in enumerate(graph.ops):
        layer = lg.op_owner[op.id]
        d = placement[lg.index[layer]]
        assert sim.op_device[i] == d
        assert 0.0 <= sim.op_start_s[i]
        assert sim.op_end_s[i] == sim.op_start_s[i] + costed.op_compute_time_s[d][i]
        kind = EventKind.FORWARD if op.phase is Phase.FORWARD else EventKind.BACKWARD
        holders = [
            ev
            for ev in device_events[d]
            if ev.label == layer
            and ev.kind is kind
            and ev.start_s <= sim.op_start_s[i]
            and sim.op_end_s[i] <= ev.end_s
        ]
        if sim.op_end_s[i] > sim.op_start_s[i]:
            assert len(holders) == 1, f"op {op.id} is in {len(holders)} timeline events"
        else:
            assert holders, f"op {op.id} is in no timeline event"
    assert sim.step_time_s == max(sim.op_end_s, default=0.0)

    # ops on one device never overlap, and its timeline events cover exactly its busy time
    for d in range(topo.num_devices):
        spans = sorted(
            (sim.op_start_s[i], sim.op_end_s[i]) for i in range(n_ops) if sim.op_device[i] == d
        )
        for (_, end0), (start1, _) in itertools.pairwise(spans):
            assert start1 >= end0
        covered = sum(ev.end_s - ev.start_s for ev in device_events[d])
        assert covered == pytest.approx(sim.device_busy_s[d], rel=1e-9, abs=1e-12)
    _assert_no_overlap(sim.timeline, slack)

    # inputs arrive before their consumer starts; each tensor crosses once per destination
    sends: set[tuple[str, int, int]] = set()
    for e in graph.edges:
        i, j = graph.op_index[e.src], graph.op_index[e.dst]
        a, b = sim.op_device[i], sim.op_device[j]
        if a == b:
            assert sim.op_start_s[j] >= sim.op_end_s[i]
            continue
        link = topo.link_between(a, b)
        assert link is not None
        assert sim.op_start_s[j] >= sim.op_end_s[i] + link.transfer_time_s(e.bytes) - slack
        if e.bytes > 0:
            sends.add((e.src, e.output_index, b))
            carriers = [
                ev
                for ev in transfers.get(
                    (f"{e.src}:{e.output_index}", channel_resource(topo, a, b)), []
                )
                if ev.start_s >= sim.op_end_s[i] - slack
                and ev.end_s <= sim.op_start_s[j] + slack
                and ev.end_s - ev.start_s == pytest.approx(link.transfer_time_s(e.bytes))
            ]
            assert carriers, f"no transfer of {e.src}:{e.output_index} to device {b} in time"
    assert sum(len(v) for v in transfers.values()) == len(sends)

    bounds = costed_lower_bounds(costed)
    for what, bound in (
        ("work", bounds.work_s),
        ("critical path", bounds.critical_path_s),
        ("largest layer", bounds.largest_layer_s),
        ("best", bounds.best_s),
    ):
        assert _close_or_above(sim.step_time_s, bound), f"step {sim.step_time_s} < {what} {bound}"


# ------------------------------------------------------------------------------- 3. pipeline


def _microbatch_critical_path_s(
    stages: Sequence[Stage], topo: Topology, num_microbatches: int
) -> float:
    """Longest dependency chain of one micro-batch through the stage tasks (module docstring of
    pipeline_sim): F(s) -> sends -> consumer F/B, F(s) -> B(s), B(s) -> gradient sends."""
    m = num_microbatches
    duration: dict[tuple[object, ...], float] = {}
    preds: dict[tuple[object, ...], list[tuple[object, ...]]] = {}
    for st_ in stages:
        duration[("F", st_.index)] = st_.forward_time_s / m
        duration[("B", st_.index)] = st_.backward_time_s / m
        preds.setdefault(("F", st_.index), [])
        preds.setdefault(("B", st_.index), []).append(("F", st_.index))
    for st_ in stages:
        for n, t in enumerate(st_.sends):
            dst = stages[t.dst_stage]
            link = topo.link_between(st_.device, dst.device)
            nbytes = t.batch_bytes / m
            seconds = (
                0.0
                if link is None or nbytes <= 0
                else link.latency_s + nbytes / link.bandwidth_bytes_per_s
            )
            node = ("X", st_.index, n)
            duration[node] = seconds
            preds[node] = [("F" if t.phase is Phase.FORWARD else "B", st_.index)]
            for consumer in t.consumers:
                preds[("F" if consumer is Phase.FORWARD else "B", t.dst_stage)].append(node)

    @cache
    def finish(node: tuple[object, ...]) -> float:
        return duration[node] + max((finish(p) for p in preds[node]), default=0.0)

    return max((finish(node) for node in duration), default=0.0)


@settings(FUZZ, max_examples=200)
@given(
    fuzz_cases(pipeline_safe=True),
    st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B]),
    st.integers(1, 8),
)
def test_pipelined_step_is_a_valid_schedule(
    case: FuzzCase, schedule: Schedule, num_microbatches: int
) -> None:
    """simulate_pipeline on a placement made acyclic: each (stage, micro-batch, phase) runs once
    on its stage's device, each send once per micro-batch on its channel, after what it depends
    on; no overlap per resource; step >= the busiest device, >= one micro-batch's critical path
    through the stage tasks, and >= the op-level critical path / M and the work bound.

    The graphs are ``pipeline_safe``: the loss reads the last layer and gradients flow back
    through the layers the loss depends on, as in every trace. (The unrestricted generator also
    sends a loss's gradient into layers the loss never read, which no trace does and which can
    leave no pipeline order at all. A loss reading several heads is handled: glue ops merge
    along the data's direction, see ``tests/test_ir.py``.)
    """
    costed = case.costed
    m = min(num_microbatches, costed.graph.batch_size)
    staged = make_acyclic(case.assignment, costed.problem())
    sim = simulate_pipeline(costed, staged, schedule=schedule, num_microbatches=m)
    stages = sim.stages
    k_stages = len(stages)
    slack = 1e-9 * max(1.0, sim.step_time_s)

    # every layer in exactly one stage, the stage of its (acyclic) device
    layers = [x for st_ in stages for x in st_.layers]
    assert sorted(layers) == sorted(costed.problem().layers)
    for st_ in stages:
        for name in st_.layers:
            assert staged[costed.problem().layers.index(name)] == st_.device

    compute: dict[tuple[int, int, EventKind], TimelineEvent] = {}
    sent: dict[tuple[str, int], TimelineEvent] = {}
    for ev in sim.timeline:
        assert ev.end_s <= sim.step_time_s + slack
        if ev.kind is EventKind.TRANSFER:
            assert (ev.label, ev.microbatch) not in sent, f"{ev} twice"
            sent[(ev.label, ev.microbatch)] = ev
            continue
        s = int(ev.label.split()[1])
        key = (s, ev.microbatch, ev.kind)
        assert key not in compute, f"{key} runs twice"
        compute[key] = ev
        assert ev.resource == device_resource(stages[s].device)
        phase_s = (
            stages[s].forward_time_s if ev.kind is EventKind.FORWARD else stages[s].backward_time_s
        )
        assert ev.end_s - ev.start_s == pytest.approx(phase_s / m, rel=1e-9, abs=1e-12)
    assert set(compute) == {
        (s, mb, kind)
        for s in range(k_stages)
        for mb in range(m)
        for kind in (EventKind.FORWARD, EventKind.BACKWARD)
    }
    for s in range(k_stages):
        for mb in range(m):
            f, b = compute[(s, mb, EventKind.FORWARD)], compute[(s, mb, EventKind.BACKWARD)]
            assert b.start_s >= f.end_s - slack
    n_sends = 0
    for st_ in stages:
        for t in st_.sends:
            dst_dev = stages[t.dst_stage].device
            label = f"stage {st_.index}->{t.dst_stage} " + (
                "activations" if t.phase is Phase.FORWARD else "gradients"
            )
            kind = EventKind.FORWARD if t.phase is Phase.FORWARD else EventKind.BACKWARD
            for mb in range(m):
                ev = sent[(label, mb)]
                n_sends += 1
                assert ev.resource == channel_resource(costed.topology, st_.device, dst_dev)
                assert ev.start_s >= compute[(st_.index, mb, kind)].end_s - slack
                for consumer in t.consumers:
                    ckind = EventKind.FORWARD if consumer is Phase.FORWARD else EventKind.BACKWARD
                    assert compute[(t.dst_stage, mb, ckind)].start_s >= ev.end_s - slack
    assert n_sends == len(sent)
    _assert_no_overlap(sim.timeline, slack)

    for d, busy in enumerate(sim.device_busy_s):
        mine = [ev for ev in sim.timeline if ev.resource == device_resource(d)]
        assert busy == pytest.approx(sum(ev.end_s - ev.start_s for ev in mine), rel=1e-9, abs=1e-12)
    assert _close_or_above(sim.step_time_s, max(sim.device_busy_s))
    chain = _microbatch_critical_path_s(stages, costed.topology, m)
    assert _close_or_above(sim.step_time_s, chain), f"step {sim.step_time_s} < chain {chain}"
    bounds = costed_lower_bounds(costed)
    # Fed ops (inputs and layer-less glue computed from them alone) order no stages by design
    # (partitioner.simulation.pipeline: every stage reads them where it runs), while the op
    # graph's critical path chains them before their consumers: a fed op with a time lets a
    # later stage start before that chain ends (a 2 ms glue op feeding layers on two stages:
    # step 2 ms, path 4 ms; so since fa3c51b and before). The bound holds without such ops.
    fed = fed_ops(costed.graph)
    timed_fed = any(
        fed[i] and any(row[i] > 0 for row in costed.op_compute_time_s) for i in range(len(fed))
    )
    if not timed_fed:
        assert _close_or_above(sim.step_time_s, bounds.critical_path_s / m)
    assert _close_or_above(sim.step_time_s, bounds.throughput_s)


# ------------------------------------------------------------------------------- 4. plan files


def _build_plan(
    costed: CostedGraph, solver_name: str, seed: int, pipeline: tuple[Schedule, int] | None
) -> Plan:
    """A plan assembled the way ``partitioner.api.partition`` does after tracing and costing:
    solve + evaluate, the single/even baselines, the timeline, and optionally pipeline info."""
    phases: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    result, evaluation = solve(
        costed, get_solver(solver_name, seed=seed, time_limit_s=TIME_LIMIT_S)
    )
    problem = costed.problem()
    info = None
    if pipeline is not None:
        schedule, m = pipeline
        staged = make_acyclic(result.assignment, problem)
        result = replace(result, assignment=staged)
        # the pipelined step, as the planner evaluates a pipelined split (its timeline is that
        # step's, and plan files hold the timeline within the step)
        evaluation = evaluate_pipeline(costed, staged, schedule=schedule, num_microbatches=m)
        sim = evaluation.pipeline
        assert sim is not None
        info = PipelineInfo(schedule, m, sim.stage_devices, sim.bubble_fraction)
        timeline = sim.timeline
    else:
        timeline = simulate_step(costed, result.assignment, timeline=True).timeline
    phases.append(("solve", time.perf_counter() - t0))
    baselines = []
    for name in ("single", "even"):
        try:
            _, ev = solve(costed, get_solver(name, seed=seed, time_limit_s=TIME_LIMIT_S))
        except PartitionError as exc:
            baselines.append(BaselineResult(name, None, str(exc)))
        else:
            baselines.append(BaselineResult(name, ev.step_time_s, "" if ev.fits else "over memory"))
    return plan_from_solution(
        costed,
        result,
        evaluation,
        link=costed.topology.link.kind,
        batch_size=costed.graph.batch_size,
        baselines=tuple(baselines),
        phase_times_s=tuple(phases),
        pipeline=info,
        timeline=timeline,
    )


def _without_wall_clock(plan: Plan) -> Plan:
    """``plan`` with its wall-clock values zeroed: ``solver.solve_time_s`` and ``phase_times_s``
    (no solver note carries a time)."""
    return replace(
        plan,
        solver=replace(plan.solver, solve_time_s=0.0),
        phase_times_s=tuple((name, 0.0) for name, _ in plan.phase_times_s),
    )


_CATALOG_TYPE = dict(zip(DEVICE_TYPES, ("t4", "l4", "v100"), strict=True))


def _with_catalog_types(plan: Plan) -> Plan:
    """``plan`` with the fuzz's device types (labels of its synthetic costs) named as catalog
    types: a plan file names catalog types, and its reader refuses others."""
    devices = tuple(replace(d, device_type=_CATALOG_TYPE[d.device_type]) for d in plan.devices)
    return replace(plan, devices=devices)


def _plan_file(plan: Plan | str, path: Path) -> bytes:
    """The plan file's bytes with wall-clock fields zeroed (or the error, word for word)."""
    if isinstance(plan, str):
        return plan.encode()
    write_atomic(path, _without_wall_clock(plan).to_json())
    return path.read_bytes()


def _plan_or_error(
    costed: CostedGraph, name: str, seed: int, pipeline: tuple[Schedule, int] | None
) -> Plan | str:
    try:
        return _build_plan(costed, name, seed, pipeline)
    except PartitionError as exc:
        event(f"plan: {type(exc).__name__}")
        return f"{type(exc).__name__}: {exc}"


@pytest.fixture(scope="module", autouse=False)
def cp_sat_loaded() -> None:
    """CP-SAT imported before the determinism check: ``auto`` skips its ILP when too little of
    its time limit is left, and a first call that also imports OR-Tools found too little (CI:
    "heuristic" then "optimal")."""
    import importlib

    importlib.import_module("ortools.sat.python.cp_model")


@settings(FUZZ, max_examples=20)
@given(
    fuzz_cases(),
    st.integers(0, 3),
    st.one_of(
        st.none(),
        st.tuples(st.sampled_from([Schedule.GPIPE, Schedule.ONE_F_ONE_B]), st.integers(1, 4)),
    ),
)
def test_plan_json_is_deterministic_and_round_trips(
    cp_sat_loaded: None, case: FuzzCase, seed: int, pipeline: tuple[Schedule, int] | None
) -> None:
    """Same inputs and seed give a byte-identical plan file for every solver (or the same error
    message), once the wall-clock values -- ``solver.solve_time_s`` and ``phase_times_s`` -- are
    zeroed; and every plan survives ``to_json -> from_json_dict -> to_json`` unchanged,
    wall-clock values included."""
    # a device holds at least a byte, as the planner's inputs and plan files are held to
    # (a topology file or --memory-limit of 0 is refused); the fuzz draws 0 for "too small"
    topology = case.costed.topology
    devices = tuple(replace(d, memory_bytes=max(1, d.memory_bytes)) for d in topology.devices)
    costed = replace(case.costed, topology=replace(topology, devices=devices))
    if pipeline is not None:  # micro-batches divide the batch, as the planner makes them
        batch = costed.graph.batch_size
        count = max(m for m in range(1, min(pipeline[1], batch) + 1) if batch % m == 0)
        pipeline = (pipeline[0], count)
    with tempfile.TemporaryDirectory() as tmp:
        for name in solver_names():
            plan = _plan_or_error(costed, name, seed, pipeline)
            again = _plan_or_error(costed, name, seed, pipeline)
            first = _plan_file(plan, Path(tmp) / f"{name}-1.json")
            second = _plan_file(again, Path(tmp) / f"{name}-2.json")
            assert first == second, f"solver {name}: two runs give different plan files"
            if isinstance(plan, str):
                continue
            text = _with_catalog_types(plan).to_json()
            assert Plan.from_json_dict(json.loads(text)).to_json() == text, name
            assert Counter(plan.device_of_layer) == Counter(
                x for d in plan.per_device for x in [d.device] * len(d.layers)
            )
