"""Lower bounds: examples, and no plan of any solver beats them."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from partitioner.core.errors import InfeasibleError
from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    PartitionProblem,
    Phase,
    Topology,
)
from partitioner.simulation.bounds import (
    LowerBounds,
    costed_lower_bounds,
    lower_bounds,
    min_devices_for_memory,
)
from partitioner.simulation.evaluate import evaluate, lower_bound_s
from partitioner.solvers import fast_solver_names, get_solver
from partitioner.solvers.ilp import step_objective_s, throughput_objective_s

FAST = fast_solver_names()


def problem(
    times: list[list[float]],
    edges: list[tuple[int, int, int]],
    memory: list[int] | None = None,
    dev_memory: list[int] | None = None,
) -> PartitionProblem:
    n_dev, n = len(times), len(times[0])
    mems = dev_memory if dev_memory is not None else [10**9] * n_dev
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=tuple(tuple(r) for r in times),
        memory_bytes=tuple(memory if memory is not None else [1] * n),
        edges=tuple(edges),
        topology=Topology(
            tuple(Device(d, "gpu", m) for d, m in enumerate(mems)), Link("l", 0.0, 100.0)
        ),
    )


def test_bounds_of_a_diamond() -> None:
    # 0 -> {1, 2} -> 3 on two identical devices.
    p = problem([[1.0, 4.0, 2.0, 1.0]] * 2, [(0, 1, 0), (0, 2, 0), (1, 3, 0), (2, 3, 0)])
    b = lower_bounds(p)
    assert b == LowerBounds(work_s=4.0, critical_path_s=6.0, largest_layer_s=4.0, min_devices=1)
    assert b.best_s == 6.0 and b.throughput_s == 4.0


def test_work_uses_each_layers_fastest_device() -> None:
    # Device 0 is fast at layer 0, device 1 at layer 1: placing each on its fast device takes
    # 1 s, so "total on the fastest device / D" (50.5 s) would not be a bound.
    p = problem([[1.0, 100.0], [100.0, 1.0]], [])
    b = lower_bounds(p)
    assert b.work_s == 1.0 and b.largest_layer_s == 1.0 and b.critical_path_s == 1.0
    assert throughput_objective_s(p, (0, 1)) == pytest.approx(1.0)


def test_min_devices() -> None:
    p = problem([[1.0] * 4] * 3, [], memory=[5, 5, 5, 5], dev_memory=[4, 12, 8])
    assert min_devices_for_memory(p) == 2  # 12 + 8 >= 20
    p = problem([[1.0] * 4] * 2, [], memory=[5, 5, 5, 5], dev_memory=[8, 8])
    assert min_devices_for_memory(p) == 3  # 16 < 20: one more 8-byte device
    p = problem([[1.0]] * 1, [], memory=[0], dev_memory=[0])
    assert min_devices_for_memory(p) == 1
    # A lower bound only: 3 layers of 6 B need 3 devices of 10 B although 2 hold 18 B.
    p = problem([[1.0] * 3] * 3, [], memory=[6, 6, 6], dev_memory=[10, 10, 10])
    assert lower_bounds(p).min_devices == 2


def costed_dag(
    times: list[float], edges: list[tuple[int, int]], n_dev: int, nbytes: int
) -> CostedGraph:
    """Layers with one forward and one backward op each; forward edges a -> b, backward b -> a."""
    n = len(times)
    names = [f"L{k}" for k in range(n)]
    fwd = [Op(f"f{k}", "MatMul", names[k], Phase.FORWARD) for k in range(n)]
    bwd = [Op(f"b{k}", "MatMulGrad", names[k], Phase.BACKWARD) for k in reversed(range(n))]
    op_edges = [Edge(f"f{a}", f"f{b}", nbytes) for a, b in edges]
    op_edges += [Edge(f"f{k}", f"b{k}", nbytes) for k in range(n)]
    op_edges += [Edge(f"b{b}", f"b{a}", nbytes) for a, b in edges]
    graph = Graph(
        "dag", tuple(fwd + bwd), tuple(op_edges), tuple(LayerInfo(x, "Dense") for x in names)
    )
    op_times = [t * 0.4 for t in times] + [t * 0.6 for t in reversed(times)]
    topo = Topology(tuple(Device(d, "gpu", 10**6) for d in range(n_dev)), Link("l", 1e-3, 1e4))
    return CostedGraph(
        graph,
        topo,
        tuple(tuple(op_times) for _ in range(n_dev)),
        tuple(LayerMemory(x, 1, 1, 2, 1) for x in names),
    )


def test_placement_lower_bound_includes_the_critical_path() -> None:
    c = costed_dag([2.0, 2.0], [(0, 1)], 2, 100)
    assert lower_bound_s(c) == pytest.approx(4.0)  # f0 f1 b1 b0 in sequence
    assert costed_lower_bounds(c).work_s == pytest.approx(2.0)
    assert evaluate(c, (0, 1)).step_time_s >= 4.0


@st.composite
def dags(draw: st.DrawFn) -> CostedGraph:
    n = draw(st.integers(1, 10))
    n_dev = draw(st.integers(1, 4))
    times = draw(st.lists(st.floats(0.0, 5.0), min_size=n, max_size=n))
    pairs = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=2 * n))
    edges = sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})
    if draw(st.booleans()):
        edges = sorted(set(edges) | {(k, k + 1) for k in range(n - 1)})
    return costed_dag(times, edges, n_dev, draw(st.integers(0, 10**5)))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dags())
def test_no_plan_beats_the_lower_bounds(costed: CostedGraph) -> None:
    p = costed.problem()
    layer = lower_bounds(p)
    bound = lower_bound_s(costed)
    assert bound == pytest.approx(costed_lower_bounds(costed).best_s)
    for name in FAST:
        try:
            r = get_solver(name).solve(p)
        except InfeasibleError:
            continue
        slack = 1e-9 * max(1.0, bound)
        assert evaluate(costed, r.assignment).step_time_s >= bound - slack, name
        assert throughput_objective_s(p, r.assignment) >= layer.throughput_s - slack, name
        assert step_objective_s(p, r.assignment) >= layer.best_s - slack, name
