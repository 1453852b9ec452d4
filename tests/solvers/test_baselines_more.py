"""The contiguous baselines ``params`` and ``time`` and their exact linear partition."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError, SolverError
from partitioner.core.ir import Device, Link, PartitionProblem, SolveStatus, Topology
from partitioner.solvers import get_solver
from partitioner.solvers.base import device_loads_s, device_memory_bytes
from partitioner.solvers.contiguous import linear_partition, min_bottleneck_split

LINK = Link("nvlink", latency_s=1e-5, bandwidth_bytes_per_s=1e11)


def make(
    times: list[float],
    n_dev: int,
    *,
    memory: list[int] | None = None,
    dev_memory: int = 10**12,
    speeds: list[float] | None = None,
) -> PartitionProblem:
    n = len(times)
    sp = speeds if speeds is not None else [1.0] * n_dev
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=tuple(tuple(t / s for t in times) for s in sp),
        memory_bytes=tuple(memory if memory is not None else [1] * n),
        edges=tuple((k, k + 1, 100) for k in range(n - 1)),
        topology=Topology(tuple(Device(d, "gpu", dev_memory) for d in range(n_dev)), LINK),
    )


def brute_bottleneck(weights: list[float], k: int) -> float:
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(weights[b[i] : b[i + 1]]) for i in range(k)))
    return best


def block_sums(weights: list[float], blocks: tuple[int, ...], k: int) -> list[float]:
    out = [0.0] * k
    for w, b in zip(weights, blocks, strict=True):
        out[b] += w
    return out


def test_linear_partition_examples() -> None:
    assert linear_partition([1.0] * 5, 2) == (0, 0, 0, 1, 1)
    assert linear_partition([1.0] * 4, 4) == (0, 1, 2, 3)
    blocks = linear_partition([9.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], 2)
    assert max(block_sums([9.0] + [1.0] * 9, blocks, 2)) == 9.0
    assert linear_partition([0.0, 0.0, 0.0], 3) == (0, 1, 2)
    with pytest.raises(SolverError, match="cannot fill 3 non-empty blocks"):
        linear_partition([1.0, 1.0], 3)
    with pytest.raises(SolverError, match="non-negative"):
        linear_partition([1.0, -1.0], 1)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.25, 7.0, 100.0]), min_size=1, max_size=9),
    st.integers(1, 5),
)
def test_linear_partition_is_optimal_contiguous_and_never_empty(
    weights: list[float], k: int
) -> None:
    if k > len(weights):
        return
    blocks = linear_partition(weights, k)
    assert list(blocks) == sorted(blocks)  # contiguous, in order
    assert set(blocks) == set(range(k))  # no empty block
    assert max(block_sums(weights, blocks, k)) == pytest.approx(brute_bottleneck(weights, k))


def test_split_respects_memory_and_cut_costs() -> None:
    # Without limits the best split of (1,1,1,1) into 2 is 2|2; a cut after layer 1 costs 5.
    split = min_bottleneck_split([[1.0] * 4], 2, cut_cost=[0.0, 0.0, 5.0, 0.0, 0.0])
    assert split is not None and split.cuts in ((1,), (3,)) and split.bottleneck == 3.0
    # Memory: block 0 holds at most 1 byte.
    split = min_bottleneck_split(
        [[1.0] * 4], 2, memory_bytes=[1, 1, 1, 1], memory_limit_bytes=[1, 10]
    )
    assert split is not None and split.stage == (0, 1, 1, 1)
    assert (
        min_bottleneck_split([[1.0] * 4], 2, memory_bytes=[3, 3, 3, 3], memory_limit_bytes=[5, 5])
        is None
    )


def test_time_balances_compute_params_balances_memory() -> None:
    times = [4.0, 1.0, 1.0, 1.0, 1.0]
    memory = [1, 1, 1, 1, 4]
    p = make(times, 2, memory=memory)
    t = get_solver("time").solve(p)
    assert t.assignment == (0, 1, 1, 1, 1)
    assert t.status is SolveStatus.HEURISTIC and t.objective == pytest.approx(4.0)
    m = get_solver("params").solve(p)
    assert max(device_memory_bytes(m.assignment, p)) == 4
    assert m.assignment == (0, 0, 0, 0, 1)


def test_time_uses_each_devices_speed() -> None:
    # Device 0 is twice as fast: it should take about two thirds of the layers.
    p = make([1.0] * 9, 2, speeds=[2.0, 1.0])
    r = get_solver("time").solve(p)
    assert r.assignment.count(0) == 6
    assert max(device_loads_s(r.assignment, p)) == pytest.approx(3.0)


def test_params_and_time_raise_when_memory_does_not_fit() -> None:
    p = make([1.0] * 4, 2, memory=[6, 6, 6, 6], dev_memory=10)
    for name in ("params", "time"):
        with pytest.raises(InfeasibleError, match=f"'{name}' puts"):
            get_solver(name).solve(p)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=12),
    st.lists(st.integers(0, 50), min_size=12, max_size=12),
    st.integers(1, 4),
)
def test_contiguous_baselines_are_monotone_and_fill_every_device(
    times: list[float], memory: list[int], n_dev: int
) -> None:
    n = len(times)
    if n_dev > n:
        return
    p = make(times, n_dev, memory=memory[:n])
    for name in ("even", "params", "time"):
        r = get_solver(name).solve(p)
        assert list(r.assignment) == sorted(r.assignment), name
        assert set(r.assignment) == set(range(n_dev)), name
    t = get_solver("time").solve(p)
    e = get_solver("even").solve(p)
    assert max(device_loads_s(t.assignment, p)) <= max(device_loads_s(e.assignment, p)) + 1e-9
