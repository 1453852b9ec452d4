"""Plan evaluation and the timed solve convenience."""

from __future__ import annotations

import pytest

from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    SolveStatus,
    Topology,
)
from partitioner.simulation.evaluate import PlanEvaluation, evaluate, lower_bound_s
from partitioner.solvers import get_solver, solve


def chain(times: list[float], n_dev: int, nbytes: int = 100, dev_memory: int = 1000) -> CostedGraph:
    """A chain of layers L0..Ln-1, one forward op and one backward op each (half the time each)."""
    n = len(times)
    layers = [f"L{k}" for k in range(n)]
    fwd = [Op(f"f{k}", "MatMul", layers[k], Phase.FORWARD) for k in range(n)]
    bwd = [Op(f"b{k}", "MatMulGrad", layers[k], Phase.BACKWARD) for k in reversed(range(n))]
    edges = [Edge(f"f{k}", f"f{k + 1}", nbytes) for k in range(n - 1)]
    edges += [Edge(f"f{n - 1}", f"b{n - 1}", nbytes)]
    edges += [Edge(f"b{k + 1}", f"b{k}", nbytes) for k in range(n - 1)]
    graph = Graph(
        "chain", tuple(fwd + bwd), tuple(edges), tuple(LayerInfo(x, "Dense") for x in layers)
    )
    op_times = [t / 2 for t in times] + [t / 2 for t in reversed(times)]
    topo = Topology(
        tuple(Device(d, "gpu", dev_memory) for d in range(n_dev)), Link("l", 0.0, 100.0)
    )
    return CostedGraph(
        graph,
        topo,
        tuple(tuple(op_times) for _ in range(n_dev)),
        tuple(LayerMemory(x, 10, 10, 20, 5) for x in layers),
    )


def test_evaluate_two_device_chain() -> None:
    c = chain([2.0, 2.0], 2)
    ev = evaluate(c, (0, 1))
    # f0 [0,1]; send 100 B (1 s) [1,2]; f1 [2,3]; b1 [3,4]; send back [4,5]; b0 [5,6].
    assert ev.step_time_s == pytest.approx(6.0)
    assert ev.cross_device_bytes == 200
    assert [d.layers for d in ev.per_device] == [("L0",), ("L1",)]
    assert [d.compute_s for d in ev.per_device] == [2.0, 2.0]
    assert [d.memory_bytes for d in ev.per_device] == [45, 45]
    assert [d.memory_limit_bytes for d in ev.per_device] == [1000, 1000]
    assert [(d.bytes_sent, d.bytes_received) for d in ev.per_device] == [(100, 100), (100, 100)]
    assert ev.lower_bound_s == pytest.approx(4.0)  # critical path f0 f1 b1 b0
    assert ev.fits and ev.simulation is not None
    assert ev.step_time_s >= ev.lower_bound_s


def test_lower_bound_of_a_chain_is_its_critical_path() -> None:
    # A chain runs one layer at a time: the whole chain bounds the step, beyond the largest
    # layer (10 s) and the balanced work (4 s).
    c = chain([10.0, 1.0, 1.0], 3)
    assert lower_bound_s(c) == pytest.approx(12.0)
    assert lower_bound_s(chain([3.0, 3.0, 3.0], 3)) == pytest.approx(9.0)


def test_single_device_step_is_total_compute() -> None:
    c = chain([1.0, 2.0, 3.0], 1)
    ev = evaluate(c, (0, 0, 0))
    assert ev.step_time_s == pytest.approx(6.0)
    assert ev.cross_device_bytes == 0
    assert ev.per_device[0].memory_bytes == 135


def test_memory_over_limit_is_reported() -> None:
    c = chain([1.0, 1.0], 1, dev_memory=50)
    ev = evaluate(c, (0, 0))
    assert not ev.fits and not ev.per_device[0].fits


@pytest.mark.parametrize("name", ["metis", "even", "round-robin", "single"])
def test_solve_times_and_evaluates(name: str) -> None:
    c = chain([1.0] * 6, 2)
    result, ev = solve(c, get_solver(name))
    assert isinstance(ev, PlanEvaluation)
    assert result.solver == name and result.status is SolveStatus.HEURISTIC
    assert result.solve_time_s > 0
    assert len(result.assignment) == 6
    assert ev.step_time_s >= ev.lower_bound_s
    assert evaluate(c, result.assignment) == ev
