"""Solvers: registry, shared helpers, baselines and METIS, with property tests on random DAGs."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError, SolverError
from partitioner.core.ir import Device, Link, PartitionProblem, SolveStatus, Topology
from partitioner.solvers import SOLVERS, fast_solver_names, get_solver, solver_names
from partitioner.solvers.auto import CANDIDATES
from partitioner.solvers.base import (
    Solver,
    device_loads_s,
    device_memory_bytes,
    fill_empty_devices,
    repair_memory,
    validate_problem_for,
)
from partitioner.solvers.metis import MetisSolver, scale_weights

GIB = 1 << 30
LINK = Link("nvlink", latency_s=1e-5, bandwidth_bytes_per_s=1e11)


def topology(
    n_dev: int, memory_bytes: int = 16 * GIB, memories: list[int] | None = None
) -> Topology:
    mems = memories if memories is not None else [memory_bytes] * n_dev
    return Topology(tuple(Device(i, "gpu", m) for i, m in enumerate(mems)), LINK)


def problem(
    times: list[float],
    n_dev: int,
    *,
    memory: list[int] | None = None,
    edges: list[tuple[int, int, int]] | None = None,
    dev_memory: int = 16 * GIB,
    speed: list[float] | None = None,
) -> PartitionProblem:
    n = len(times)
    speeds = speed if speed is not None else [1.0] * n_dev
    return PartitionProblem(
        layers=tuple(f"layer{k}" for k in range(n)),
        compute_time_s=tuple(tuple(t / s for t in times) for s in speeds),
        memory_bytes=tuple(memory if memory is not None else [1 << 20] * n),
        edges=tuple(edges if edges is not None else [(k, k + 1, 1000) for k in range(n - 1)]),
        topology=topology(n_dev, dev_memory),
    )


# ---------------------------------------------------------------------------- registry


def test_registry_names_and_immutability() -> None:
    # The product's solvers are all registered (a new one joins them without editing this test).
    assert set(solver_names()) >= {
        "auto",
        "dp",
        "etf",
        "even",
        "ilp",
        "metis",
        "params",
        "round-robin",
        "single",
        "time",
    }
    assert solver_names() == tuple(sorted(SOLVERS))
    assert SOLVERS["metis"] is MetisSolver
    with pytest.raises(TypeError):
        SOLVERS["x"] = MetisSolver  # type: ignore[index]
    for name in solver_names():
        s = get_solver(name)
        assert isinstance(s, Solver)
        assert s.name == name and s.description
        assert s.seed == 0 and s.time_limit_s == 10.0


def test_the_registry_is_the_one_list() -> None:
    # Registry order is the docs' order (simplest first); solver_names() sorts. A new solver
    # joins the registry without editing this test.
    docs_order = ["single", "even", "round-robin", "params", "time", "dp", "etf", "metis", "ilp"]
    assert [n for n in SOLVERS if n in docs_order] == docs_order
    assert fast_solver_names() == tuple(n for n in SOLVERS if SOLVERS[n].uses_time_limit is False)
    assert set(fast_solver_names()) >= set(docs_order) - {"ilp"}
    # auto runs fast solvers only (in its own tie-breaking order): today every one of ours.
    assert {cls.name for cls in CANDIDATES} <= set(fast_solver_names())
    assert {cls.name for cls in CANDIDATES} >= set(docs_order) - {"ilp"}
    for cls in SOLVERS.values():
        assert cls.description and "\n" not in cls.description, cls.name


def test_get_solver_errors_and_options() -> None:
    with pytest.raises(
        SolverError, match=r"unknown solver 'x'; known: auto, dp, etf, even, ilp, metis, params"
    ):
        get_solver("x")
    with pytest.raises(SolverError, match="no option bogus"):
        get_solver("metis", bogus=1)
    with pytest.raises(SolverError, match="seed"):
        get_solver("metis", seed="abc")
    with pytest.raises(SolverError, match="time_limit_s"):
        get_solver("metis", time_limit_s=-1.0)
    s = get_solver("metis", seed="7", time_limit_s="2.5")
    assert s == MetisSolver(seed=7, time_limit_s=2.5)
    with pytest.raises(AttributeError):
        s.seed = 3  # type: ignore[misc]


# ---------------------------------------------------------------------------- helpers


def test_validate_problem_for_rejects_more_devices_than_layers() -> None:
    p = problem([1.0, 1.0, 1.0], 4)
    with pytest.raises(
        InfeasibleError,
        match=r"gpus=4 is more than the 3 layers of the model; use at most 3 devices",
    ):
        validate_problem_for(p)
    for name in solver_names():
        if name == "single":  # uses one device whatever the count: the baseline still answers
            assert get_solver(name).solve(p).assignment == (0, 0, 0)
            continue
        with pytest.raises(InfeasibleError):
            get_solver(name).solve(p)
    validate_problem_for(problem([1.0] * 3, 3))


def test_fill_empty_devices_moves_best_layer() -> None:
    p = problem([4.0, 1.0, 2.0, 3.0], 3)
    out = fill_empty_devices((0, 0, 0, 1), p)
    # loads (7, 3, 0): moving layer 0 (4 s) to device 2 gives max load 3 -- the best choice.
    assert out == (2, 0, 0, 1)
    assert fill_empty_devices((0, 1, 2, 0), p) == (0, 1, 2, 0)


def test_repair_memory_moves_cheapest_layer_to_freest_device() -> None:
    p = PartitionProblem(
        layers=("a", "b", "c", "d"),
        compute_time_s=((3.0, 1.0, 2.0, 1.0),) * 3,
        memory_bytes=(6, 3, 4, 2),
        edges=(),
        topology=topology(3, memories=[10, 8, 9]),
    )
    # device 0 holds 6 + 3 + 4 = 13 > 10; cheapest layer there is b (1 s): move to device 2
    # (most free memory: 9 - 0 = 9 vs 8 - 2 = 6).
    out = repair_memory((0, 0, 0, 1), p)
    assert out == (0, 2, 0, 1)
    used = device_memory_bytes(out, p)
    assert all(u <= d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True))


def test_repair_memory_infeasible_message() -> None:
    p = problem([1.0] * 4, 2, memory=[3 * GIB] * 4, dev_memory=4 * GIB)
    with pytest.raises(InfeasibleError) as info:
        repair_memory((0, 0, 1, 1), p)
    msg = str(info.value)
    assert "\n" not in msg
    assert "12.00 GiB" in msg and "4.00 GiB" in msg and "at least 3 devices" in msg


def test_scale_weights_bounds() -> None:
    assert scale_weights([0.0, 0.0]) == [1, 1]
    w = scale_weights([1e-12, 0.5, 1.0])
    assert w == [1, 500_000, 1_000_000]


# ---------------------------------------------------------------------------- baselines


def test_baselines_assignments() -> None:
    p = problem([1.0] * 5, 2)
    assert get_solver("single").solve(p).assignment == (0,) * 5
    assert get_solver("even").solve(p).assignment == (0, 0, 0, 1, 1)
    assert get_solver("round-robin").solve(p).assignment == (0, 1, 0, 1, 0)
    r = get_solver("even").solve(p)
    assert r.status is SolveStatus.HEURISTIC and r.objective == pytest.approx(3.0)


def test_single_raises_when_model_does_not_fit() -> None:
    p = problem([1.0] * 4, 2, memory=[3 * GIB] * 4, dev_memory=8 * GIB)
    with pytest.raises(InfeasibleError, match="at least 2 devices"):
        get_solver("single").solve(p)
    # METIS repairs it instead.
    r = get_solver("metis").solve(p)
    assert sorted(device_memory_bytes(r.assignment, p)) == [6 * GIB, 6 * GIB]


def test_even_raises_instead_of_repairing() -> None:
    p = problem([1.0] * 4, 2, memory=[5 * GIB, 5 * GIB, 1, 1], dev_memory=8 * GIB)
    with pytest.raises(InfeasibleError, match="'even' puts"):
        get_solver("even").solve(p)
    r = get_solver("metis").solve(p)
    assert max(device_memory_bytes(r.assignment, p)) <= 8 * GIB


# ---------------------------------------------------------------------------- METIS


def test_metis_balances_a_chain() -> None:
    p = problem([1.0] * 8, 2)
    r = MetisSolver().solve(p)
    assert r.status is SolveStatus.HEURISTIC
    assert sorted(device_loads_s(r.assignment, p)) == [4.0, 4.0]
    assert r.objective == pytest.approx(4.0)


def test_metis_single_device() -> None:
    assert MetisSolver().solve(problem([1.0, 2.0], 1)).assignment == (0, 0)


def test_metis_heterogeneous_devices_get_proportional_work() -> None:
    p = problem([1.0] * 12, 2, speed=[2.0, 1.0])
    r = MetisSolver().solve(p)
    counts = [r.assignment.count(d) for d in range(2)]
    assert counts[0] > counts[1]


def test_metis_deterministic() -> None:
    p = problem(
        [float(k % 5 + 1) for k in range(30)],
        4,
        edges=[(k, k + 1, 100 * k) for k in range(29)] + [(0, 29, 5)],
    )
    assert MetisSolver(seed=3).solve(p) == MetisSolver(seed=3).solve(p)


# ---------------------------------------------------------------------------- properties


@st.composite
def random_problems(draw: st.DrawFn) -> PartitionProblem:
    n = draw(st.integers(1, 14))
    n_dev = draw(st.integers(1, 5))
    times = draw(st.lists(st.floats(0.0, 10.0), min_size=n, max_size=n))
    mem = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    dev_mem = draw(st.integers(0, 400))
    pairs = draw(
        st.lists(
            st.tuples(st.integers(0, n - 1), st.integers(0, n - 1), st.integers(0, 10**9)),
            max_size=3 * n,
        )
    )
    edges = [(k, k + 1, 10) for k in range(n - 1)] if draw(st.booleans()) else []
    edges += [(min(a, b), max(a, b), w) for a, b, w in pairs if a != b]
    speeds = draw(st.lists(st.floats(0.5, 2.0), min_size=n_dev, max_size=n_dev))
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=tuple(tuple(t / s for t in times) for s in speeds),
        memory_bytes=tuple(mem),
        edges=tuple(edges),
        topology=topology(n_dev, dev_mem),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_problems(), st.sampled_from(sorted(SOLVERS)), st.integers(0, 3))
def test_solver_properties(p: PartitionProblem, name: str, seed: int) -> None:
    solver = get_solver(name, seed=seed)
    if p.num_devices > p.num_layers and name != "single":
        # Only `single` answers with more devices than layers (it uses one device).
        with pytest.raises(InfeasibleError):
            solver.solve(p)
        return
    try:
        r = solver.solve(p)
    except InfeasibleError as exc:
        assert "\n" not in str(exc)
        total = sum(p.memory_bytes)
        limit = max(d.memory_bytes for d in p.topology.devices)
        if name == "metis":
            # METIS gives up only when no greedy move fits; the totals must be tight.
            assert total > limit or max(p.memory_bytes) > limit
        return
    assert r.solver == name
    assert len(r.assignment) == p.num_layers
    assert all(0 <= d < p.num_devices for d in r.assignment)
    used = device_memory_bytes(r.assignment, p)
    assert all(u <= d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True))
    if name != "single":
        assert set(r.assignment) == set(range(p.num_devices))  # no device left empty
    assert r.objective is not None and math.isfinite(r.objective)
    # deterministic (but for wall times some solvers record in solve_time_s and notes)
    again = solver.solve(p)
    assert (again.assignment, again.status, again.objective) == (r.assignment, r.status, r.objective)


@settings(max_examples=60, deadline=None)
@given(random_problems())
def test_fill_never_leaves_a_device_empty(p: PartitionProblem) -> None:
    if p.num_devices > p.num_layers:
        return
    out = fill_empty_devices((0,) * p.num_layers, p)
    assert set(out) == set(range(p.num_devices))


@settings(max_examples=60, deadline=None)
@given(random_problems())
def test_repair_memory_respects_limits_or_raises(p: PartitionProblem) -> None:
    start = tuple(k % p.num_devices for k in range(p.num_layers))
    try:
        out = repair_memory(start, p)
    except InfeasibleError:
        return
    used = device_memory_bytes(out, p)
    assert all(u <= d.memory_bytes for u, d in zip(used, p.topology.devices, strict=True))
