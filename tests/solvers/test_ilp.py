"""The CP-SAT solver: never worse than the heuristics it is warm-started from, constraints kept,
bounds honest, time limits respected, deterministic."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError, SolverError
from partitioner.core.ir import Device, Link, PartitionProblem, SolveStatus, Topology
from partitioner.solvers import _coerce, ilp
from partitioner.solvers.base import device_loads_s, device_memory_bytes
from partitioner.solvers.baselines import EvenSolver, RoundRobinSolver, SingleSolver
from partitioner.solvers.ilp import (
    IlpSolver,
    cp_sat_in_worker_process,
    edge_transfer_times_s,
    step_objective_s,
    throughput_objective_s,
)
from partitioner.solvers.metis import MetisSolver

GIB = 1 << 30
MIB = 1 << 20
LINK = Link("nvlink", latency_s=1e-5, bandwidth_bytes_per_s=1e11)
HEURISTICS = (MetisSolver(), EvenSolver(), RoundRobinSolver())


def make_problem(
    times: list[float],
    n_dev: int,
    *,
    edges: list[tuple[int, int, int]] | None = None,
    memory: list[int] | None = None,
    dev_memory: list[int] | None = None,
    speed: list[float] | None = None,
    colocate: tuple[tuple[int, ...], ...] = (),
) -> PartitionProblem:
    n = len(times)
    speeds = speed if speed is not None else [1.0] * n_dev
    mems = dev_memory if dev_memory is not None else [16 * GIB] * n_dev
    return PartitionProblem(
        layers=tuple(f"layer{k}" for k in range(n)),
        compute_time_s=tuple(tuple(t / s for t in times) for s in speeds),
        memory_bytes=tuple(memory if memory is not None else [MIB] * n),
        edges=tuple(edges if edges is not None else [(k, k + 1, 10**6) for k in range(n - 1)]),
        topology=Topology(tuple(Device(i, "gpu", m) for i, m in enumerate(mems)), LINK),
        colocate=colocate,
    )


@st.composite
def problems(draw: st.DrawFn, *, light_comm: bool = False) -> PartitionProblem:
    """Random DAGs of 2-8 layers on 2-3 devices; ``light_comm`` keeps every layer's transfers
    below its compute time and the devices identical."""
    n_dev = draw(st.integers(2, 3))
    n = draw(st.integers(n_dev, 8))
    times = [draw(st.floats(1e-3, 1e-2)) for _ in range(n)]
    max_bytes = 10**6 if light_comm else 10**9
    edges = [
        (a, b, draw(st.integers(0, max_bytes)))
        for a in range(n)
        for b in range(a + 1, n)
        if b == a + 1 or draw(st.booleans())
    ]
    speed = None if light_comm else [draw(st.sampled_from([1.0, 0.5, 2.0])) for _ in range(n_dev)]
    memory = [draw(st.integers(1, 4)) * GIB for _ in range(n)]
    dev_memory = [draw(st.integers(8, 24)) * GIB for _ in range(n_dev)]
    if light_comm:
        dev_memory = [sum(memory)] * n_dev
    return make_problem(
        times, n_dev, edges=edges, memory=memory, dev_memory=dev_memory, speed=speed
    )


def fits(problem: PartitionProblem, assignment: tuple[int, ...]) -> bool:
    used = device_memory_bytes(assignment, problem)
    return all(u <= d.memory_bytes for u, d in zip(used, problem.topology.devices))


def heuristic_assignments(problem: PartitionProblem) -> dict[str, tuple[int, ...]]:
    out = {}
    for h in HEURISTICS:
        try:
            out[h.name] = h.solve(problem).assignment
        except InfeasibleError:
            continue
    return out


def critical_path_s(problem: PartitionProblem) -> float:
    """Longest path with every layer at its fastest time and free transfers."""
    fastest = [min(row[k] for row in problem.compute_time_s) for k in range(problem.num_layers)]
    finish = list(fastest)
    for a, b, _ in sorted(problem.edges, key=lambda e: e[1]):
        finish[b] = max(finish[b], finish[a] + fastest[b])
    return max(finish)


# ---------------------------------------------------------------------------- objective functions


def test_throughput_objective_counts_transfers_on_both_ends() -> None:
    p = make_problem([3.0, 1.0, 2.0], 2, edges=[(0, 1, 10**11), (1, 2, 0), (0, 2, 10**11)])
    xfer = LINK.transfer_time_s(10**11)
    assert edge_transfer_times_s(p) == (xfer, 0.0, xfer)
    # device 0: layer 0 (3 s) + two cut edges; device 1: layers 1, 2 (3 s) + the same two edges.
    assert throughput_objective_s(p, (0, 1, 1)) == pytest.approx(3.0 + 2 * xfer)
    assert throughput_objective_s(p, (0, 0, 0)) == pytest.approx(6.0)
    with pytest.raises(SolverError, match="3 layers"):
        throughput_objective_s(p, (0, 1))


def test_step_objective_list_schedules_in_layer_order() -> None:
    # a diamond 0 -> {1, 2} -> 3; 1 and 2 in parallel on two devices, one transfer each way.
    p = make_problem(
        [1.0, 2.0, 2.0, 1.0], 2, edges=[(0, 1, 10**11), (0, 2, 10**11), (1, 3, 0), (2, 3, 10**11)]
    )
    xfer = LINK.transfer_time_s(10**11)
    assert step_objective_s(p, (0, 0, 0, 0)) == pytest.approx(6.0)
    assert step_objective_s(p, (0, 0, 1, 0)) == pytest.approx(1.0 + xfer + 2.0 + xfer + 1.0)


# ---------------------------------------------------------------------------- throughput


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_never_worse_than_heuristics_and_fits(p: PartitionProblem) -> None:
    heur = heuristic_assignments(p)
    try:
        r = IlpSolver(time_limit_s=5.0).solve(p)
    except InfeasibleError as exc:
        assert "\n" not in str(exc)
        # CP-SAT proved no placement with every device used fits; the heuristics (which use
        # every device) must all have failed too.
        assert all(not fits(p, a) for a in heur.values())
        return
    assert r.solver == "ilp"
    assert fits(p, r.assignment)
    assert set(r.assignment) == set(range(p.num_devices))
    assert r.objective == pytest.approx(throughput_objective_s(p, r.assignment), rel=1e-12)
    for name, a in heur.items():
        if fits(p, a):
            assert r.objective <= throughput_objective_s(p, a), name
    # tiny problems are solved to proven optimality; the bound is a few ticks below
    assert r.status is SolveStatus.OPTIMAL
    assert r.best_bound is not None and r.best_bound <= r.objective
    assert r.gap is not None and r.gap < 1e-6


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(light_comm=True))
def test_ilp_never_worse_than_single_when_splitting_pays(p: PartitionProblem) -> None:
    # identical devices and transfers cheaper than any layer: using every device never costs
    # more than the single-device time, so the every-device-used rule cannot lose to `single`.
    single = SingleSolver().solve(p).assignment
    r = IlpSolver(time_limit_s=5.0).solve(p)
    assert r.objective is not None
    assert r.objective <= throughput_objective_s(p, single)


def test_tiny_problem_is_optimal_with_zero_gap() -> None:
    p = make_problem([3.0, 1.0, 2.0, 2.0], 2, edges=[(0, 1, 0), (1, 2, 0), (2, 3, 0)])
    r = IlpSolver().solve(p)
    assert r.status is SolveStatus.OPTIMAL
    assert r.objective == pytest.approx(4.0)
    assert r.gap is not None and r.gap < 1e-6
    assert any("proved optimal" in n for n in r.notes)


def test_single_device_is_trivially_optimal() -> None:
    p = make_problem([1.0, 2.0], 1)
    r = IlpSolver().solve(p)
    assert r.assignment == (0, 0)
    assert r.status is SolveStatus.OPTIMAL and r.gap == 0.0


@pytest.mark.parametrize("objective", ["throughput", "step"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(p=problems())
def test_acyclic_keeps_every_edge_in_stage_order(objective: str, p: PartitionProblem) -> None:
    try:
        r = IlpSolver(objective=objective, acyclic=True, time_limit_s=5.0).solve(p)  # type: ignore[arg-type]
    except InfeasibleError:
        return
    for a, b, _ in p.edges:
        assert r.assignment[a] <= r.assignment[b]
    assert fits(p, r.assignment)


def test_acyclic_costs_something_on_a_skewed_diamond() -> None:
    # the best unrestricted split sends traffic back to device 0; stage order forbids it
    times = [1.0, 4.0, 1.0, 1.0]
    edges = [(0, 1, 0), (0, 2, 0), (1, 3, 0), (2, 3, 0)]
    p = make_problem(times, 2, edges=edges)
    free = IlpSolver().solve(p)
    staged = IlpSolver(acyclic=True).solve(p)
    assert free.objective == pytest.approx(4.0)
    assert staged.objective is not None and staged.objective >= 4.0
    assert all(staged.assignment[a] <= staged.assignment[b] for a, b, _ in edges)


@pytest.mark.parametrize("objective", ["throughput", "step"])
def test_colocation_groups_share_a_device(objective: str) -> None:
    # without the group the best split is {0, 1} | {2, 3}; the group forces 0 and 3 together
    p = make_problem(
        [2.0, 2.0, 2.0, 2.0],
        2,
        edges=[(0, 1, 0), (1, 2, 0), (2, 3, 0)],
        colocate=((0, 3),),
    )
    r = IlpSolver(objective=objective).solve(p)  # type: ignore[arg-type]
    assert r.assignment[0] == r.assignment[3]
    assert r.status is SolveStatus.OPTIMAL


def test_memory_infeasible_raises_one_line() -> None:
    # three 6 GiB layers on two 10 GiB devices: 18 GiB < 20 GiB in total but no packing exists
    p = make_problem([1.0, 1.0, 1.0], 2, memory=[6 * GIB] * 3, dev_memory=[10 * GIB, 10 * GIB])
    with pytest.raises(InfeasibleError, match=r"solver 'ilp' proved no placement") as info:
        IlpSolver().solve(p)
    assert "\n" not in str(info.value)
    big = make_problem([1.0, 1.0], 2, memory=[20 * GIB, GIB], dev_memory=[10 * GIB] * 2)
    with pytest.raises(InfeasibleError, match=r"layer 'layer0' alone needs") as info:
        IlpSolver().solve(big)
    assert "\n" not in str(info.value)


# ---------------------------------------------------------------------------- step objective


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_step_makespan_between_critical_path_and_one_device(p: PartitionProblem) -> None:
    p = make_problem(
        list(p.compute_time_s[0]),
        p.num_devices,
        edges=list(p.edges),
        dev_memory=[16 * GIB] * p.num_devices,
    )
    r = IlpSolver(objective="step", time_limit_s=5.0).solve(p)
    assert r.objective is not None
    assert r.objective >= critical_path_s(p) * (1 - 1e-9)
    assert r.objective <= min(sum(row) for row in p.compute_time_s) * (1 + 1e-9)
    # a device runs one layer at a time
    assert r.objective >= max(device_loads_s(r.assignment, p)) * (1 - 1e-9)
    assert r.status is SolveStatus.OPTIMAL
    assert r.best_bound is not None and r.best_bound <= r.objective


def test_step_runs_parallel_branches_on_two_devices() -> None:
    # 0 -> {1, 2} -> 3 with free transfers: branches 1 and 2 overlap, makespan 1 + 5 + 1
    p = make_problem([1.0, 5.0, 5.0, 1.0], 2, edges=[(0, 1, 0), (0, 2, 0), (1, 3, 0), (2, 3, 0)])
    r = IlpSolver(objective="step").solve(p)
    assert r.objective == pytest.approx(7.0)
    assert r.assignment[1] != r.assignment[2]


def test_step_keeps_a_chain_with_costly_transfers_on_one_device() -> None:
    p = make_problem([1.0, 1.0, 1.0], 2, edges=[(0, 1, 10**12), (1, 2, 10**12)])
    r = IlpSolver(objective="step").solve(p)
    assert len(set(r.assignment)) == 1
    assert r.objective == pytest.approx(3.0)


# ---------------------------------------------------------------------------- limits, options


def big_problem(n: int = 300, n_dev: int = 4, seed: int = 0) -> PartitionProblem:
    rng = random.Random(seed)
    edges = [(k, k + 1, rng.randint(0, 10**7)) for k in range(n - 1)]
    edges += [(k, k + rng.randint(2, 5), rng.randint(0, 10**6)) for k in range(0, n - 5, 3)]
    return make_problem(
        [rng.uniform(1e-3, 1e-2) for _ in range(n)],
        n_dev,
        edges=sorted(set(edges)),
        memory=[rng.randint(1, 256) * MIB for _ in range(n)],
    )


@pytest.mark.parametrize("objective", ["throughput", "step"])
def test_a_model_too_large_to_build_in_the_limit_is_not_built(objective: str) -> None:
    """3,000 layers on 32 devices: building the model alone would outlast the limit, so the
    warm start comes back within it, and the note says why."""
    p = big_problem(3000, 32)
    assert ilp.model_build_s(p, objective) > 1.0
    r = IlpSolver(objective=objective, time_limit_s=1.0).solve(p)  # type: ignore[arg-type]
    assert r.status is SolveStatus.FEASIBLE and fits(p, r.assignment)
    assert r.solve_time_s < 5.0  # the heuristics' time, not the model's (minutes)
    assert any("time limit 1 s reached before the model was built" in n for n in r.notes)
    assert any("CP-SAT not run, returned the warm start (metis)" in n for n in r.notes)


@pytest.mark.parametrize("objective", ["throughput", "step"])
def test_tiny_time_limit_on_300_layers_still_returns_a_plan(objective: str) -> None:
    p = big_problem()
    r = IlpSolver(objective=objective, time_limit_s=0.05).solve(p)  # type: ignore[arg-type]
    assert r.status is SolveStatus.FEASIBLE
    assert len(r.assignment) == 300 and fits(p, r.assignment)
    assert any("time limit 0.05 s reached" in n for n in r.notes)
    assert r.solve_time_s < 5.0
    evaluate = step_objective_s if objective == "step" else throughput_objective_s
    assert r.objective is not None and r.objective <= evaluate(p, EvenSolver().solve(p).assignment)
    if objective == "throughput":
        assert set(r.assignment) == set(range(4))
        assert r.objective == pytest.approx(evaluate(p, r.assignment))


def test_same_problem_and_seed_give_the_same_plan() -> None:
    p = big_problem(n=14, n_dev=3, seed=4)
    a = IlpSolver(seed=3, time_limit_s=5.0).solve(p)
    b = IlpSolver(seed=3, time_limit_s=5.0).solve(p)
    assert a.assignment == b.assignment and a.objective == b.objective
    s1 = IlpSolver(seed=3, objective="step", time_limit_s=5.0).solve(p)
    s2 = IlpSolver(seed=3, objective="step", time_limit_s=5.0).solve(p)
    assert s1.assignment == s2.assignment and s1.objective == s2.objective


def test_warm_start_is_used_or_ignored_with_a_note() -> None:
    p = make_problem([1.0, 1.0, 1.0, 1.0], 2)
    r = IlpSolver(warm_start=(0, 0, 1, 1)).solve(p)
    assert r.notes[0].startswith("warm start: given warm_start (2.00002 s)")
    assert r.status is SolveStatus.OPTIMAL
    bad = IlpSolver(warm_start=(0, 0, 0, 0)).solve(p)  # leaves device 1 empty
    assert any(n.startswith("warm_start ignored: a device is left empty") for n in bad.notes)
    assert bad.objective == r.objective
    with pytest.raises(SolverError, match="4 layers"):
        IlpSolver(warm_start=(0, 1)).solve(p)


def test_options_from_command_line_strings() -> None:
    hints = typing.get_type_hints(IlpSolver)
    raw = {
        "seed": "3",
        "time_limit_s": "1.5",
        "objective": "step",
        "acyclic": "true",
        "warm_start": "0, 0,1,1",
        "num_workers": "2",
    }
    s = IlpSolver(**{k: _coerce("ilp", k, v, hints[k]) for k, v in raw.items()})
    assert s == IlpSolver(
        seed=3,
        time_limit_s=1.5,
        objective="step",
        acyclic=True,
        warm_start=(0, 0, 1, 1),
        num_workers=2,
    )
    assert s.name == "ilp" and s.description
    with pytest.raises(
        SolverError, match=r"objective='fast' is unknown; use one of throughput, step"
    ):
        IlpSolver(objective="fast")  # type: ignore[arg-type]
    with pytest.raises(SolverError, match="num_workers=0"):
        IlpSolver(num_workers=0)
    with pytest.raises(SolverError, match="warm_start='0,x'"):
        IlpSolver(warm_start="0,x")  # type: ignore[arg-type]
    with pytest.raises(SolverError, match="time_limit_s"):
        IlpSolver(time_limit_s=0.0)


# ---------------------------------------------------------------------------- process placement


def test_worker_process_gives_the_same_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    p = big_problem(n=12, n_dev=3, seed=2)
    local = [IlpSolver(objective=o, seed=1).solve(p) for o in ("throughput", "step")]  # type: ignore[arg-type]
    monkeypatch.setattr(ilp, "_IN_PROCESS", False)
    assert cp_sat_in_worker_process()
    remote = [IlpSolver(objective=o, seed=1).solve(p) for o in ("throughput", "step")]  # type: ignore[arg-type]
    for a, b in zip(local, remote):
        assert (a.assignment, a.objective, a.status) == (b.assignment, b.objective, b.status)
    with pytest.raises(InfeasibleError, match="proved no placement"):
        IlpSolver().solve(
            make_problem([1.0] * 3, 2, memory=[6 * GIB] * 3, dev_memory=[10 * GIB] * 2)
        )


@pytest.mark.slow
def test_tensorflow_imported_first_does_not_crash_cp_sat() -> None:
    # OR-Tools loaded after TensorFlow crashes CP-SAT (google/or-tools#3230); the solver then
    # runs CP-SAT in a worker process that loads OR-Tools first. Checked in a fresh interpreter.
    pytest.importorskip("tensorflow")
    code = (
        "import tensorflow; from partitioner.solvers.ilp import IlpSolver, "
        "cp_sat_in_worker_process; from tests.solvers.test_ilp import make_problem; "
        "assert cp_sat_in_worker_process(); "
        "p = make_problem([1.0, 2.0, 3.0, 1.0], 2); "
        "r = IlpSolver().solve(p); s = IlpSolver(objective='step').solve(p); "
        "assert r.status.value == s.status.value == 'optimal', (r, s)"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr[-2000:]
