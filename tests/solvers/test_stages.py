"""make_acyclic: any placement refined into ordered pipeline stages."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.core.errors import SolverError
from partitioner.core.ir import Device, Link, PartitionProblem, Topology
from partitioner.solvers.stages import (
    acyclic_on_devices,
    is_acyclic_stages,
    make_acyclic,
    stage_graph,
)

LINK = Link("nvlink", latency_s=1e-5, bandwidth_bytes_per_s=1e11)


def make(n: int, n_dev: int, edges: list[tuple[int, int]]) -> PartitionProblem:
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=((1.0,) * n,) * n_dev,
        memory_bytes=(1,) * n,
        edges=tuple((a, b, 10) for a, b in edges),
        topology=Topology(tuple(Device(d, "gpu", 100) for d in range(n_dev)), LINK),
    )


def ordered(p: PartitionProblem, stage: tuple[int, ...]) -> bool:
    return all(stage[a] <= stage[b] for a, b, _ in p.edges)


def test_acyclic_placement_is_only_renumbered() -> None:
    chain = make(4, 2, [(0, 1), (1, 2), (2, 3)])
    assert make_acyclic((0, 0, 1, 1), chain) == (0, 0, 1, 1)
    # Devices used in reverse order: relabelled, nothing moves between devices' groups.
    assert make_acyclic((1, 1, 0, 0), chain) == (0, 0, 1, 1)
    assert is_acyclic_stages((1, 1, 0, 0), chain)


def test_acyclic_on_devices_keeps_the_devices_the_assignment_chose() -> None:
    chain = make(4, 2, [(0, 1), (1, 2), (2, 3)])
    # the first two layers on device 1: the same pipeline, still starting on device 1
    assert acyclic_on_devices((1, 1, 0, 0), chain) == (1, 1, 0, 0)
    assert acyclic_on_devices((0, 1, 0, 1), chain) == (0, 1, 1, 1)  # repaired like make_acyclic
    three = make(3, 3, [(0, 1), (1, 2)])
    assert acyclic_on_devices((2, 1, 0), three) == (2, 1, 0)


def test_cycle_is_repaired() -> None:
    chain = make(4, 2, [(0, 1), (1, 2), (2, 3)])
    assert stage_graph((0, 1, 0, 1), chain) == {(0, 1), (1, 0)}
    assert not is_acyclic_stages((0, 1, 0, 1), chain)
    out = make_acyclic((0, 1, 0, 1), chain)
    assert is_acyclic_stages(out, chain) and ordered(chain, out)
    assert set(out) == {0, 1}
    assert out == (0, 1, 1, 1)


def test_empty_stage_is_filled() -> None:
    # Monotone repair would leave stage 2 empty: 0 -> 1 -> 2 chain with a back-jump.
    p = make(3, 3, [(0, 1), (1, 2)])
    out = make_acyclic((2, 1, 0), p)
    assert out == (0, 1, 2)
    p2 = make(4, 3, [(0, 3), (1, 3), (2, 3)])
    out2 = make_acyclic((1, 0, 0, 0), p2)
    assert set(out2) == {0, 1, 2} and ordered(p2, out2)


def test_bad_assignment_raises() -> None:
    p = make(2, 2, [(0, 1)])
    with pytest.raises(SolverError, match="3 entries for 2 layers"):
        make_acyclic((0, 1, 0), p)
    with pytest.raises(SolverError, match="device 5"):
        make_acyclic((0, 5), p)


@st.composite
def placements(draw: st.DrawFn) -> tuple[PartitionProblem, tuple[int, ...]]:
    n = draw(st.integers(1, 16))
    n_dev = draw(st.integers(1, 6))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))
    edges = sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})
    if draw(st.booleans()):
        edges = sorted(set(edges) | {(k, k + 1) for k in range(n - 1)})
    assignment = tuple(draw(st.lists(st.integers(0, n_dev - 1), min_size=n, max_size=n)))
    return make(n, n_dev, edges), assignment


@settings(max_examples=300, deadline=None)
@given(placements())
def test_make_acyclic_properties(case: tuple[PartitionProblem, tuple[int, ...]]) -> None:
    p, assignment = case
    out = make_acyclic(assignment, p)
    assert len(out) == p.num_layers
    assert all(0 <= s < p.num_devices for s in out)
    assert ordered(p, out)  # every edge to an equal or later stage ...
    assert is_acyclic_stages(out, p)  # ... so the stage graph is a DAG
    if p.num_layers >= p.num_devices:
        assert set(out) == set(range(p.num_devices))  # no empty stage
    assert make_acyclic(out, p) == out  # idempotent
    on_devices = acyclic_on_devices(assignment, p)  # the same stages, on a permutation of devices
    assert len({(s, d) for s, d in zip(out, on_devices)}) == len(set(out))
    assert is_acyclic_stages(on_devices, p)
    if is_acyclic_stages(assignment, p) and len(set(assignment)) == p.num_devices:
        # Already a DAG using every device: only a renumbering, the groups stay together.
        groups = {
            frozenset(k for k in range(p.num_layers) if assignment[k] == d) for d in set(assignment)
        }
        new = {frozenset(k for k in range(p.num_layers) if out[k] == d) for d in set(out)}
        assert groups == new
