"""``auto``: never worse than any candidate under its score; the ILP improves it when it can."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError, SolverError
from partitioner.core.ir import Device, Link, PartitionProblem, SolveStatus, Topology
from partitioner.solvers import get_solver
from partitioner.solvers.auto import CANDIDATES, AutoSolver, auto_score_s, colocate_groups
from partitioner.solvers.base import device_memory_bytes

LINK = Link("nvlink", latency_s=1e-5, bandwidth_bytes_per_s=1e9)


def make(
    times: list[float],
    n_dev: int,
    *,
    edges: list[tuple[int, int, int]] | None = None,
    memory: list[int] | None = None,
    dev_memory: int = 10**12,
    colocate: tuple[tuple[int, ...], ...] = (),
) -> PartitionProblem:
    n = len(times)
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=(tuple(times),) * n_dev,
        memory_bytes=tuple(memory if memory is not None else [1] * n),
        edges=tuple(edges if edges is not None else [(k, k + 1, 1000) for k in range(n - 1)]),
        topology=Topology(tuple(Device(d, "gpu", dev_memory) for d in range(n_dev)), LINK),
        colocate=colocate,
    )


@st.composite
def problems(draw: st.DrawFn) -> PartitionProblem:
    n = draw(st.integers(1, 10))
    n_dev = draw(st.integers(1, 4))
    times = draw(st.lists(st.floats(0.0, 1.0), min_size=n, max_size=n))
    memory = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 10**6)),
            max_size=2 * n,
        )
    )
    edges = [(min(a, b), max(a, b), w) for a, b, w in pairs if a != b]
    return make(times, n_dev, edges=edges, memory=memory, dev_memory=draw(st.integers(20, 300)))


def candidate_scores(p: PartitionProblem) -> dict[str, float]:
    out = {}
    for cls in CANDIDATES:
        solver = cls()
        try:
            a = colocate_groups(solver.solve(p).assignment, p)  # type: ignore[attr-defined]
        except InfeasibleError:
            continue
        used = device_memory_bytes(a, p)
        if any(u > d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True)):
            continue
        if p.num_layers >= p.num_devices and len(set(a)) < p.num_devices:
            continue
        out[solver.name] = auto_score_s(p, a)  # type: ignore[attr-defined]
    return out


def test_notes_list_every_candidate_and_the_choice() -> None:
    p = make([1e-3] * 12, 3, memory=[5] * 12, dev_memory=25)
    r = AutoSolver(time_limit_s=2.0).solve(p)
    heads = [n.split(":")[0] for n in r.notes]
    assert heads[:8] == [c.name for c in CANDIDATES]  # type: ignore[attr-defined]
    assert "single: infeasible (memory)" in r.notes  # 60 B on a 25 B device
    assert heads[8] == "ilp" and r.notes[-1].startswith("chose ")
    assert r.objective == pytest.approx(auto_score_s(p, r.assignment))
    assert r.best_bound is not None and r.best_bound <= r.objective
    assert r.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE, SolveStatus.HEURISTIC)


def test_ilp_improves_on_the_candidates() -> None:
    # Total 38 s on 2 devices: the best non-contiguous split is {0, 4, 5} / {1, 2, 3} at 20 s
    # plus cut edges that cost nothing (0 B); every fast candidate ends at 21 s or worse.
    times = [5.0, 2.0, 8.0, 8.0, 8.0, 7.0]
    edges = [(0, 1, 0), (1, 2, 0), (2, 3, 10), (3, 4, 0), (4, 5, 10)]
    p = make(times, 2, edges=edges)
    r = AutoSolver(time_limit_s=5.0).solve(p)
    scores = candidate_scores(p)
    assert min(scores.values()) > 21.0
    assert r.objective == pytest.approx(20.0)
    assert r.notes[-1] == "chose ilp"
    assert r.status is SolveStatus.OPTIMAL
    assert r.gap is not None and r.gap < 1e-3


def test_without_the_ilp_status_is_heuristic() -> None:
    p = make([1.0] * 6, 2)
    r = AutoSolver(ilp=False).solve(p)
    assert r.status is SolveStatus.HEURISTIC and "ilp: off" in r.notes
    r2 = AutoSolver(ilp_max_layers=3).solve(p)
    assert "ilp: skipped (6 layers > ilp_max_layers=3)" in r2.notes


def test_colocation_is_respected() -> None:
    p = make([1.0] * 6, 2, colocate=((0, 5),))
    r = AutoSolver(ilp=False).solve(p)
    assert r.assignment[0] == r.assignment[5]


def test_options_are_checked() -> None:
    with pytest.raises(SolverError, match="ilp_max_layers"):
        get_solver("auto", ilp_max_layers=-1)
    with pytest.raises(SolverError, match="time_limit_s"):
        get_solver("auto", time_limit_s=0)
    assert get_solver("auto", ilp="false") == AutoSolver(ilp=False)


def test_infeasible_when_nothing_fits() -> None:
    p = make([1.0] * 4, 2, memory=[10] * 4, dev_memory=15)
    with pytest.raises(InfeasibleError):
        AutoSolver(time_limit_s=1.0).solve(p)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_auto_is_never_worse_than_any_candidate(p: PartitionProblem) -> None:
    solver = AutoSolver(time_limit_s=1.0)
    if p.num_devices > p.num_layers:
        with pytest.raises(InfeasibleError):
            solver.solve(p)
        return
    scores = candidate_scores(p)
    try:
        r = solver.solve(p)
    except InfeasibleError:
        assert not scores
        return
    used = device_memory_bytes(r.assignment, p)
    assert all(u <= d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True))
    assert set(r.assignment) == set(range(p.num_devices))
    score = auto_score_s(p, r.assignment)
    assert r.objective == pytest.approx(score)
    for name, s in scores.items():
        assert score <= s * (1 + 1e-12) + 1e-15, name
    assert r.best_bound is not None and r.best_bound <= score * (1 + 1e-9) + 1e-12


def test_10000_layer_chain_within_budget() -> None:
    n = 10_000
    times = [1e-4 * (1 + (k * 7919) % 13) for k in range(n)]
    p = make(times, 8, memory=[1 << 20] * n, dev_memory=1 << 40)
    t0 = time.perf_counter()
    r = AutoSolver(time_limit_s=5.0).solve(p)
    elapsed = time.perf_counter() - t0
    assert elapsed < 10.0
    assert set(r.assignment) == set(range(8))
    assert r.objective is not None and r.best_bound is not None
    assert r.objective <= 1.05 * r.best_bound  # a chain splits almost perfectly
