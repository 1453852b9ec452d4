"""Solvers on heterogeneous topologies: mixed device types, per-pair links, several hosts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from cost_models.devices.topology import load_topology, parse_topology
from cost_models.estimate.costs import cost_graph
from partitioner.core.ir import (
    Device,
    Edge,
    Graph,
    LayerInfo,
    Link,
    Op,
    PartitionProblem,
    Phase,
    Topology,
)
from partitioner.solvers import get_solver
from partitioner.solvers.base import link_classes, link_matrix
from partitioner.solvers.contiguous import min_bottleneck_split
from partitioner.solvers.dp import boundary_transfer_rows_s
from partitioner.solvers.ilp import IlpSolver, step_objective_s, throughput_objective_s

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"
GIB = 1 << 30
FAST = Link("nvlink", latency_s=5e-6, bandwidth_bytes_per_s=450e9)
SLOW = Link("eth", latency_s=20e-6, bandwidth_bytes_per_s=1e9)


def dense_chain(num_layers: int = 8, batch: int = 256, width: int = 2048) -> Graph:
    """A chain of equal Dense layers with forward and backward matmuls (compute-bound)."""
    f32 = 4
    act = f32 * batch * width
    ops = [Op("x", "Placeholder", None, Phase.FORWARD, ((batch, width),), ("float32",), act)]
    edges: list[Edge] = []
    layers = []
    prev = "x"
    for i in range(num_layers):
        name = f"dense{i}"
        params = width * width
        layers.append(LayerInfo(name, "Dense", params, params, f32 * params, f32 * params))
        flops = 2 * batch * width * width
        ops.append(
            Op(
                f"{name}/mm",
                "MatMul",
                name,
                Phase.FORWARD,
                ((batch, width),),
                ("float32",),
                act,
                flops,
            )
        )
        edges.append(Edge(prev, f"{name}/mm", act))
        prev = f"{name}/mm"
    ops.append(Op("loss", "Mean", None, Phase.FORWARD, ((),), ("float32",), f32, batch * width))
    edges.append(Edge(prev, "loss", act))
    grad = "loss"
    for i in reversed(range(num_layers)):
        name = f"dense{i}"
        flops = 2 * batch * width * width
        ops.append(
            Op(
                f"{name}/gx",
                "MatMul",
                name,
                Phase.BACKWARD,
                ((batch, width),),
                ("float32",),
                act,
                flops,
            )
        )
        ops.append(
            Op(f"{name}/gw", "MatMul", name, Phase.BACKWARD, ((width, width),), ("float32",),
               f32 * width * width, flops)
        )  # fmt: skip
        edges.append(Edge(grad, f"{name}/gx", act))
        edges.append(Edge(grad, f"{name}/gw", act))
        edges.append(Edge("x" if i == 0 else f"dense{i - 1}/mm", f"{name}/gw", act))
        grad = f"{name}/gx"
    return Graph("chain", tuple(ops), tuple(edges), tuple(layers), batch_size=batch)


def two_type_problem(first: str, second: str) -> PartitionProblem:
    topo = parse_topology({"devices": [{"type": first}, {"type": second}], "link": "pcie"})
    return cost_graph(dense_chain(), topology=topo).problem()


def work_s(problem: PartitionProblem, assignment: tuple[int, ...], device: int) -> float:
    """Compute time the placement gives ``device``, measured on one reference device (0) so that
    it counts work, not speed."""
    return sum(problem.compute_time_s[0][k] for k, d in enumerate(assignment) if d == device)


# ------------------------------------------------------------------------- mixed device types


@pytest.mark.parametrize("solver", ["ilp", "dp", "auto", "time", "metis", "etf"])
@pytest.mark.parametrize("order", [("h100", "v100"), ("v100", "h100")])
def test_the_faster_device_gets_more_work(solver: str, order: tuple[str, str]) -> None:
    problem = two_type_problem(*order)
    fast = order.index("h100")
    slow = 1 - fast
    # The H100 is ~4x faster on these fp32 matmuls (67 vs 15.7 TFLOP/s at the same efficiency).
    assert sum(problem.compute_time_s[slow]) > 3.5 * sum(problem.compute_time_s[fast])
    result = get_solver(solver, time_limit_s=5.0).solve(problem)
    a = result.assignment
    assert set(a) == {0, 1}
    assert a.count(fast) > a.count(slow)
    assert work_s(problem, a, fast) > 2 * work_s(problem, a, slow)
    # ... and beats the even split, which ignores the devices' speeds
    even = get_solver("even").solve(problem).assignment
    assert throughput_objective_s(problem, a) < throughput_objective_s(problem, even)


def test_two_gpu_types_file_plan() -> None:
    topo = load_topology(str(EXAMPLES / "two_gpu_types.toml"))
    problem = cost_graph(dense_chain(), topology=topo).problem()
    a = get_solver("auto", time_limit_s=5.0).solve(problem).assignment
    h100 = next(d.index for d in topo.devices if d.device_type == "h100")
    assert a.count(h100) > a.count(1 - h100)


def test_params_weighs_blocks_by_device_memory() -> None:
    big = Device(0, "a", 80 * GIB)
    small = Device(1, "b", 20 * GIB)
    problem = PartitionProblem(
        layers=tuple(f"l{k}" for k in range(10)),
        compute_time_s=((1.0,) * 10,) * 2,
        memory_bytes=(GIB,) * 10,
        edges=tuple((k, k + 1, 10) for k in range(9)),
        topology=Topology((big, small), FAST),
    )
    a = get_solver("params").solve(problem).assignment
    assert a == (0,) * 8 + (1,) * 2  # 8/80 = 2/20 of each device's memory


# ------------------------------------------------------------------------- per-pair links


def two_hosts(devices_per_host: int = 2) -> Topology:
    n = 2 * devices_per_host
    devs = tuple(Device(i, "gpu", 80 * GIB, host=i // devices_per_host) for i in range(n))
    return Topology(devs, FAST, inter_host_link=SLOW)


def towers_problem() -> PartitionProblem:
    """Two towers of four 1 ms layers, interleaved in layer order (A0 B0 A1 B1 ...): 50 MB edges
    within a tower, 1 kB between them. Crossing hosts costs 50 ms for a tower edge."""
    heavy, light = 50_000_000, 1000
    edges = []
    for k in range(3):
        edges += [(2 * k, 2 * k + 2, heavy), (2 * k + 1, 2 * k + 3, heavy)]
    edges.append((6, 7, light))
    return PartitionProblem(
        layers=tuple(f"{'AB'[k % 2]}{k // 2}" for k in range(8)),
        compute_time_s=((1e-3,) * 8,) * 4,
        memory_bytes=(1 << 20,) * 8,
        edges=tuple(sorted(edges)),
        topology=two_hosts(),
    )


def cross_host_bytes(problem: PartitionProblem, assignment: tuple[int, ...]) -> int:
    devs = problem.topology.devices
    return sum(
        nbytes
        for a, b, nbytes in problem.edges
        if devs[assignment[a]].host != devs[assignment[b]].host
    )


@pytest.mark.parametrize("solver", ["ilp", "auto", "metis"])
def test_heavy_edges_stay_within_a_host(solver: str) -> None:
    problem = towers_problem()
    a = get_solver(solver, time_limit_s=5.0).solve(problem).assignment
    assert len(set(a)) == 4
    assert cross_host_bytes(problem, a) == 1000  # only the light edge between the towers
    assert throughput_objective_s(problem, a) < 3e-3


def test_ilp_step_objective_keeps_heavy_edges_within_a_host() -> None:
    problem = towers_problem()
    result = IlpSolver(objective="step", time_limit_s=5.0).solve(problem)
    assert cross_host_bytes(problem, result.assignment) <= 1000
    assert result.objective == pytest.approx(step_objective_s(problem, result.assignment))
    assert result.objective < 10e-3  # one tower edge across hosts alone would cost 50 ms


def test_objectives_price_each_pair_by_its_link() -> None:
    problem = towers_problem()
    heavy = 50_000_000
    # A0, A1 on device 0 and A2, A3 on device 2 (the other host); B0, B1 on 1 and B2, B3 on 3.
    placement = (0, 1, 0, 1, 2, 3, 2, 3)
    loads = [2e-3] * 4
    cross = SLOW.transfer_time_s(heavy)
    light_fast = FAST.transfer_time_s(1000)
    loads[0] += cross  # A1 -> A2 crosses hosts: 0 -> 2
    loads[2] += cross
    loads[1] += cross  # B1 -> B2: 1 -> 3
    loads[3] += cross
    loads[2] += light_fast  # A3 (2) -> B3 (3) on host 1
    loads[3] += light_fast
    channel = 2 * cross  # both crossings share the one channel between the hosts
    assert throughput_objective_s(problem, placement) == pytest.approx(max(*loads, channel))
    assert channel > max(loads)
    kept = (0, 2, 0, 2, 1, 3, 1, 3)  # towers within hosts
    inner = FAST.transfer_time_s(heavy)
    light_slow = SLOW.transfer_time_s(1000)
    assert throughput_objective_s(problem, kept) == pytest.approx(2e-3 + inner + light_slow)


def test_ilp_throughput_is_exact_with_per_pair_links() -> None:
    """Brute force over every placement that uses all devices, on mixed links and speeds."""
    devs = (
        Device(0, "h100", GIB, host=0),
        Device(1, "v100", GIB, host=0),
        Device(2, "h100", GIB, host=1),
    )
    topo = Topology(devs, FAST, inter_host_link=SLOW, links=((0, 1, Link("pcie", 1e-5, 12e9)),))
    times = (1.0e-3, 2.0e-3, 0.5e-3, 1.5e-3, 1.0e-3, 0.7e-3)
    problem = PartitionProblem(
        layers=tuple(f"l{k}" for k in range(6)),
        compute_time_s=(times, tuple(3 * t for t in times), times),
        memory_bytes=(1,) * 6,
        edges=((0, 1, 4_000_000), (1, 2, 300_000), (1, 3, 2_000_000), (2, 4, 9_000_000),
               (3, 4, 100_000), (4, 5, 5_000_000)),
        topology=topo,
    )  # fmt: skip
    best = min(
        throughput_objective_s(problem, a)
        for a in itertools.product(range(3), repeat=6)
        if len(set(a)) == 3
    )
    result = IlpSolver(time_limit_s=10.0).solve(problem)
    assert result.status.value == "optimal"
    assert result.objective == pytest.approx(best, rel=1e-6)


def test_link_classes_group_devices_by_link() -> None:
    topo = two_hosts(devices_per_host=3)
    classes = link_classes(link_matrix(topo))
    assert classes[0] == ((FAST, (1, 2)), (SLOW, (3, 4, 5)))
    assert classes[4] == ((SLOW, (0, 1, 2)), (FAST, (3, 5)))


# ------------------------------------------------------------------------- stage DP across hosts


def chain_with_a_light_edge() -> PartitionProblem:
    """Eight 1 ms layers; 50 MB between neighbours except 1 kB between layers 4 and 5."""
    edges = tuple((k, k + 1, 1000 if k == 4 else 50_000_000) for k in range(7))
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(8)),
        compute_time_s=((1e-3,) * 8,) * 4,
        memory_bytes=(1 << 20,) * 8,
        edges=edges,
        topology=two_hosts(),
    )


def test_dp_puts_the_host_boundary_where_few_bytes_cross() -> None:
    problem = chain_with_a_light_edge()
    rows = boundary_transfer_rows_s(problem)
    assert len(rows) == 3
    assert rows[0] == rows[2] != rows[1]  # device 1 -> 2 crosses hosts
    result = get_solver("dp").solve(problem)
    a = result.assignment
    # stage 1 (host 0) ends after layer 4; stage 2 (host 1) starts at layer 5
    assert a[4] == 1 and a[5] == 2
    assert cross_host_bytes(problem, a) == 1000
    assert result.objective == pytest.approx(max(3e-3, FAST.transfer_time_s(50_000_000)))


def test_min_bottleneck_split_with_a_row_per_boundary() -> None:
    n = 4
    cheap = [0.0] * (n + 1)
    dear_in_middle = [0.0, 0.0, 9.0, 0.0, 0.0]
    split = min_bottleneck_split([[1.0] * n], 3, cut_cost=[cheap, dear_in_middle])
    assert split is not None
    # the second boundary may not fall before layer 2 (cost 9); bottleneck 2 keeps it elsewhere
    assert split.cuts[1] != 2 and split.bottleneck == pytest.approx(2.0)
    with pytest.raises(Exception, match="cut_cost rows"):
        min_bottleneck_split([[1.0] * n], 3, cut_cost=[cheap, cheap, cheap])


# ------------------------------------------------------------------------- shared host channels


def test_transfers_between_two_hosts_share_one_channel() -> None:
    """Two cut edges 0 -> 2 and 1 -> 3 each load two devices once, but the one channel between
    the hosts twice."""
    heavy = 10_000_000
    problem = PartitionProblem(
        layers=("a", "b", "c", "d"),
        compute_time_s=((1e-4,) * 4,) * 4,
        memory_bytes=(1,) * 4,
        edges=((0, 2, heavy), (1, 3, heavy)),
        topology=two_hosts(),
    )
    c = SLOW.transfer_time_s(heavy)
    assert throughput_objective_s(problem, (0, 1, 2, 3)) == pytest.approx(2 * c)
    assert throughput_objective_s(problem, (0, 2, 1, 3)) == pytest.approx(
        1e-4 + FAST.transfer_time_s(heavy)
    )
    result = IlpSolver(time_limit_s=10.0).solve(problem)
    assert cross_host_bytes(problem, result.assignment) == 0
    assert result.status.value == "optimal"


def test_ilp_is_exact_with_host_channels() -> None:
    """Brute force on 2 hosts x 2 mixed devices, where the channel can be the bottleneck."""
    devs = tuple(Device(i, "h100" if i % 2 else "v100", GIB, host=i // 2) for i in range(4))
    topo = Topology(devs, FAST, inter_host_link=Link("eth", 1e-5, 5e9))
    times = (1.0e-3, 0.4e-3, 0.8e-3, 1.2e-3, 0.6e-3, 0.9e-3, 0.3e-3)
    problem = PartitionProblem(
        layers=tuple(f"l{k}" for k in range(7)),
        compute_time_s=tuple(tuple(t * (3 if d % 2 == 0 else 1) for t in times) for d in range(4)),
        memory_bytes=(1,) * 7,
        edges=((0, 1, 3_000_000), (0, 2, 2_000_000), (1, 3, 4_000_000), (2, 4, 1_000_000),
               (3, 5, 2_500_000), (4, 5, 500_000), (5, 6, 3_500_000), (1, 6, 200_000)),
        topology=topo,
    )  # fmt: skip
    best = min(
        throughput_objective_s(problem, a)
        for a in itertools.product(range(4), repeat=7)
        if len(set(a)) == 4
    )
    result = IlpSolver(time_limit_s=20.0).solve(problem)
    assert result.status.value == "optimal"
    assert result.objective == pytest.approx(best, rel=1e-6)


def test_a_link_across_hosts_leaves_the_channels_out_of_the_model() -> None:
    topo = Topology(two_hosts().devices, FAST, inter_host_link=SLOW, links=((0, 2, FAST),))
    problem = PartitionProblem(
        layers=("a", "b", "c", "d"),
        compute_time_s=((1e-3,) * 4,) * 4,
        memory_bytes=(1,) * 4,
        edges=((0, 1, 1000), (1, 2, 1000), (2, 3, 1000)),
        topology=topo,
    )
    result = IlpSolver(time_limit_s=5.0).solve(problem)
    assert result.status.value == "feasible"
    assert any("host channels not modelled" in note for note in result.notes)
    assert result.objective == pytest.approx(throughput_objective_s(problem, result.assignment))
