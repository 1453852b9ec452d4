"""PipeDream's stage DP (``dp``) and Baechi's m-ETF (``etf``)."""

from __future__ import annotations

import itertools
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError
from partitioner.core.ir import Device, Link, PartitionProblem, SolveStatus, Topology
from partitioner.solvers import get_solver
from partitioner.solvers.base import device_memory_bytes
from partitioner.solvers.dp import PipeDreamSolver, boundary_transfer_s
from partitioner.solvers.etf import EtfSolver, etf_schedule

LINK = Link("pcie", latency_s=0.0, bandwidth_bytes_per_s=100.0)


def make(
    times: list[float],
    n_dev: int,
    *,
    edges: list[tuple[int, int, int]] | None = None,
    memory: list[int] | None = None,
    dev_memory: int | list[int] = 10**12,
    speeds: list[float] | None = None,
) -> PartitionProblem:
    n = len(times)
    sp = speeds if speeds is not None else [1.0] * n_dev
    mems = dev_memory if isinstance(dev_memory, list) else [dev_memory] * n_dev
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=tuple(tuple(t / s for t in times) for s in sp),
        memory_bytes=tuple(memory if memory is not None else [1] * n),
        edges=tuple(edges if edges is not None else [(k, k + 1, 0) for k in range(n - 1)]),
        topology=Topology(tuple(Device(d, "gpu", m) for d, m in enumerate(mems)), LINK),
    )


@st.composite
def problems(draw: st.DrawFn, max_layers: int = 9, max_devices: int = 4) -> PartitionProblem:
    n = draw(st.integers(1, max_layers))
    n_dev = draw(st.integers(1, max_devices))
    times = draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))
    memory = draw(st.lists(st.integers(0, 60), min_size=n, max_size=n))
    dev_mem = draw(st.lists(st.integers(0, 300), min_size=n_dev, max_size=n_dev))
    speeds = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=n_dev, max_size=n_dev))
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 500)),
            max_size=2 * n,
        )
    )
    edges = [(min(a, b), max(a, b), w) for a, b, w in pairs if a != b]
    return make(times, n_dev, edges=edges, memory=memory, dev_memory=dev_mem, speeds=speeds)


def dp_cost(p: PartitionProblem, stage: tuple[int, ...]) -> float:
    """The DP's objective for a contiguous assignment: slowest stage or boundary."""
    cut = boundary_transfer_s(p)
    worst = max(
        sum(p.compute_time_s[d][k] for k in range(p.num_layers) if stage[k] == d)
        for d in range(p.num_devices)
    )
    for c in range(1, p.num_layers):
        if stage[c] != stage[c - 1]:
            worst = max(worst, cut[c])
    return worst


def fits(p: PartitionProblem, a: tuple[int, ...]) -> bool:
    used = device_memory_bytes(a, p)
    return all(u <= d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True))


def brute_dp(p: PartitionProblem) -> float | None:
    n, k = p.num_layers, p.num_devices
    best: float | None = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        stage = tuple(s for s in range(k) for _ in range(b[s], b[s + 1]))
        if fits(p, stage):
            v = dp_cost(p, stage)
            best = v if best is None else min(best, v)
    return best


# ---------------------------------------------------------------------------- dp


def test_boundary_transfer_counts_every_crossing_edge() -> None:
    p = make([1.0] * 4, 2, edges=[(0, 1, 100), (0, 3, 200), (2, 3, 50)])
    # cut before 1: edges (0,1), (0,3); before 2: (0,3); before 3: (0,3), (2,3).
    assert boundary_transfer_s(p) == [0.0, 3.0, 2.0, 2.5, 0.0]


def test_dp_avoids_an_expensive_boundary() -> None:
    # Balanced cut (before layer 2) sends 1000 B = 10 s; the cut before 3 sends nothing.
    p = make([1.0] * 4, 2, edges=[(0, 1, 0), (1, 2, 1000), (2, 3, 0)])
    r = PipeDreamSolver().solve(p)
    assert r.assignment == (0, 0, 0, 1)
    assert r.objective == pytest.approx(3.0)
    assert r.status is SolveStatus.HEURISTIC and r.solver == "dp"


def test_dp_respects_memory_and_raises_when_nothing_fits() -> None:
    p = make([1.0] * 4, 2, memory=[5, 1, 1, 1], dev_memory=[10, 2])
    r = PipeDreamSolver().solve(p)
    assert r.assignment == (0, 0, 1, 1)
    with pytest.raises(InfeasibleError, match="solver 'dp': no split into 2 contiguous stages"):
        PipeDreamSolver().solve(make([1.0] * 4, 2, memory=[5, 5, 5, 5], dev_memory=9))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_dp_is_the_exact_optimum_over_contiguous_splits(p: PartitionProblem) -> None:
    if p.num_devices > p.num_layers:
        with pytest.raises(InfeasibleError):
            PipeDreamSolver().solve(p)
        return
    expected = brute_dp(p)
    if expected is None:
        with pytest.raises(InfeasibleError):
            PipeDreamSolver().solve(p)
        return
    r = PipeDreamSolver().solve(p)
    assert list(r.assignment) == sorted(r.assignment)
    assert set(r.assignment) == set(range(p.num_devices))
    assert fits(p, r.assignment)
    assert r.objective == pytest.approx(dp_cost(p, r.assignment), rel=1e-9, abs=1e-12)
    assert r.objective == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # ... hence never worse than the other contiguous splits that fit.
    for name in ("even", "params", "time"):
        try:
            other = get_solver(name).solve(p)
        except InfeasibleError:
            continue
        assert r.objective <= dp_cost(p, other.assignment) * (1 + 1e-9) + 1e-12, name


def test_dp_and_etf_scale_to_10000_layers() -> None:
    n, n_dev = 10_000, 8
    times = [1e-3 * (1 + (k * 7919) % 13) for k in range(n)]
    p = make(times, n_dev, edges=[(k, k + 1, 1000) for k in range(n - 1)])
    for solver in (PipeDreamSolver(), EtfSolver()):
        t0 = time.perf_counter()
        r = solver.solve(p)
        assert time.perf_counter() - t0 < 5.0, solver.name
        assert set(r.assignment) == set(range(n_dev))


# ---------------------------------------------------------------------------- etf


def test_etf_puts_parallel_branches_on_different_devices() -> None:
    # 0 -> {1, 2} -> 3, free links: the two 5 s branches run at once.
    p = make([1.0, 5.0, 5.0, 1.0], 2, edges=[(0, 1, 0), (0, 2, 0), (1, 3, 0), (2, 3, 0)])
    assignment, makespan = etf_schedule(p)
    assert assignment[1] != assignment[2]
    assert makespan == pytest.approx(7.0)
    r = EtfSolver().solve(p)
    assert r.objective == pytest.approx(7.0) and r.solver == "etf"


def test_etf_keeps_a_chain_local_when_links_are_slow() -> None:
    p = make([1.0] * 3, 2, edges=[(0, 1, 10_000), (1, 2, 10_000)])
    assignment, makespan = etf_schedule(p)
    assert assignment == (0, 0, 0) and makespan == pytest.approx(3.0)
    # The solver then fills the empty device.
    assert set(EtfSolver().solve(p).assignment) == {0, 1}


def test_etf_respects_memory() -> None:
    p = make([1.0] * 3, 2, memory=[6, 6, 6], dev_memory=[12, 6])
    r = EtfSolver().solve(p)
    assert fits(p, r.assignment)
    with pytest.raises(InfeasibleError, match="solver 'etf': layer 'l2' needs"):
        EtfSolver().solve(make([1.0] * 3, 2, memory=[6, 6, 6], dev_memory=[6, 6]))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_layers=14, max_devices=5), st.sampled_from(["dp", "etf"]))
def test_solver_properties(p: PartitionProblem, name: str) -> None:
    solver = get_solver(name)
    if p.num_devices > p.num_layers:
        with pytest.raises(InfeasibleError):
            solver.solve(p)
        return
    try:
        r = solver.solve(p)
    except InfeasibleError as exc:
        assert "\n" not in str(exc)
        return
    assert len(r.assignment) == p.num_layers
    assert all(0 <= d < p.num_devices for d in r.assignment)
    assert fits(p, r.assignment)
    if name == "dp" or all(d.memory_bytes >= max(p.memory_bytes) for d in p.topology.devices):
        assert set(r.assignment) == set(range(p.num_devices))  # no device left empty
    if name == "dp":
        assert list(r.assignment) == sorted(r.assignment)
    assert solver.solve(p) == r
