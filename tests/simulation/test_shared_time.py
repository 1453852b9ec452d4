"""The step simulator on CPU devices, which run their ready ops side by side (processor sharing):
hand-computed schedules, the plain split it no longer rewards, and schedule invariants."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.core.ir import CostedGraph, Device, EventKind, Link
from partitioner.simulation.shared import IN_ORDER, SHARED, op_orders
from partitioner.simulation.step import simulate_step
from tests.test_simulate import costed

FREE_LINK = Link("free", latency_s=0.0, bandwidth_bytes_per_s=1e18)


def on(c: CostedGraph, *device_types: str) -> CostedGraph:
    """``c`` with its devices of the given catalog types, in order."""
    devices = tuple(
        Device(d.index, t, d.memory_bytes, d.host, d.name)
        for d, t in zip(c.topology.devices, device_types, strict=True)
    )
    return replace(c, topology=replace(c.topology, devices=devices))


def test_cpus_share_their_time_and_gpus_and_unknown_types_run_in_order() -> None:
    c = costed([("a", "A", 1.0)], [], ["A"], n_dev=4)
    assert op_orders(on(c, "cpu", "a100-80gb", "gpu", "cpu").topology) == (
        SHARED,
        IN_ORDER,
        IN_ORDER,
        SHARED,
    )
    assert op_orders(on(c, "not-in-the-catalog", "cpu", "cpu", "cpu").topology)[0] is IN_ORDER


def test_two_ready_ops_share_one_cpu_and_end_together() -> None:
    ops = [("src", "A", 0.0), ("x", "A", 10.0), ("y", "A", 10.0)]
    c = costed(ops, [("src", "x", 0), ("src", "y", 0)], ["A"], n_dev=1)
    gpu, cpu = simulate_step(on(c, "gpu"), (0,)), simulate_step(on(c, "cpu"), (0,))
    assert gpu.op_end_s == (0.0, 10.0, 20.0)
    assert cpu.op_start_s == (0.0, 0.0, 0.0)
    assert cpu.op_end_s == pytest.approx((0.0, 20.0, 20.0))
    # one device alone is work-conserving either way: the same step and busy time
    assert cpu.step_time_s == pytest.approx(gpu.step_time_s) == 20.0
    assert cpu.device_busy_s == gpu.device_busy_s


def test_an_op_that_joins_later_gets_half_the_cpu() -> None:
    # a: 10 s from 0; b: 1 s, ready at 5 (after c, 5 s on the other device).
    # a alone for 5 s (5 done), then a and b at half speed: b ends at 7, a at 11.
    ops = [("a", "A", 10.0), ("c", "B", 5.0), ("b", "A", 1.0)]
    c = on(costed(ops, [("c", "b", 0)], ["A", "B"], link=FREE_LINK), "cpu", "cpu")
    sim = simulate_step(c, {"A": 0, "B": 1})
    assert sim.op_start_s == pytest.approx((0.0, 0.0, 5.0))
    assert sim.op_end_s == pytest.approx((11.0, 5.0, 7.0))
    assert sim.step_time_s == pytest.approx(11.0)
    assert sim.device_busy_s == pytest.approx((11.0, 5.0))


def backward_split() -> CostedGraph:
    """Two layers' backward: L1's input gradient ``dx1`` (sent to L0's device) and its weight
    gradient ``dw1`` both need ``g``; L0's ``dx0`` needs ``dx1``. 4 s each, a free link."""
    ops = [("g", "L1", 0.0), ("dx1", "L1", 4.0), ("dw1", "L1", 4.0), ("dx0", "L0", 4.0)]
    edges = [("g", "dx1", 8), ("g", "dw1", 8), ("dx1", "dx0", 8)]
    return costed(ops, edges, ["L0", "L1"], link=FREE_LINK)


def test_a_split_across_cpus_does_not_overlap_the_next_layers_backward() -> None:
    """On GPUs (in order) ``dx1`` leaves at 4 s and ``dw1`` overlaps ``dx0``: 8 s. On CPUs
    ``dx1`` and ``dw1`` share the core, ``dx1`` leaves at 8 s: 12 s, one device's time."""
    c = backward_split()
    assert simulate_step(on(c, "gpu", "gpu"), {"L0": 0, "L1": 1}).step_time_s == 8.0
    split = simulate_step(on(c, "cpu", "cpu"), {"L0": 0, "L1": 1})
    assert split.step_time_s == pytest.approx(12.0)
    assert simulate_step(on(c, "cpu", "cpu"), {"L0": 0, "L1": 0}).step_time_s == 12.0


def test_transfers_from_cpus_queue_on_their_channel_in_the_order_they_are_sent() -> None:
    # a (1 s) and b (3 s) on device 0 share it: a ends at 2, b at 4; 100 B take 1.5 s each.
    ops = [("a", "A", 1.0), ("b", "A", 3.0), ("c", "B", 0.0)]
    c = on(costed(ops, [("a", "c", 100), ("b", "c", 100)], ["A", "B"]), "cpu", "cpu")
    sim = simulate_step(c, (0, 1), timeline=True)
    moved = [
        (ev.label, ev.start_s, ev.end_s) for ev in sim.timeline if ev.kind is EventKind.TRANSFER
    ]
    assert moved == [("a:0", 2.0, 3.5), ("b:0", 4.0, 5.5)]
    assert sim.step_time_s == 5.5
    assert sim.link_busy_s == (((0, 1), 3.0),)
    assert sim.bytes_sent == (200, 0) and sim.bytes_received == (0, 200)


def test_a_cpu_beside_a_gpu() -> None:
    c = on(backward_split(), "gpu", "cpu")
    sim = simulate_step(c, {"L0": 0, "L1": 1})
    assert sim.step_time_s == pytest.approx(12.0)  # dx1 shares the cpu with dw1
    sim = simulate_step(on(backward_split(), "cpu", "gpu"), {"L0": 0, "L1": 1})
    assert sim.step_time_s == pytest.approx(8.0)  # the gpu sends dx1 first


def cpu_dags() -> st.SearchStrategy[tuple[CostedGraph, tuple[int, ...]]]:
    from tests.test_simulate import random_dags

    def to_cpus(case: tuple[CostedGraph, tuple[int, ...]], gpu_mask: Sequence[bool]):
        c, assignment = case
        types = ["gpu" if g else "cpu" for g, _ in zip(gpu_mask, c.topology.devices)]
        return on(c, *types), assignment

    return st.builds(to_cpus, random_dags(), st.lists(st.booleans(), min_size=4, max_size=4))


def union_s(spans: Sequence[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


@settings(max_examples=100, deadline=None)
@given(cpu_dags())
def test_shared_schedule_invariants(case: tuple[CostedGraph, tuple[int, ...]]) -> None:
    c, assignment = case
    sim = simulate_step(c, assignment)
    g, eps = c.graph, 1e-9
    times = c.op_compute_time_s
    assert sim.step_time_s >= max(sim.device_busy_s) - eps
    for i in range(len(g.ops)):  # an op takes at least its time alone
        assert sim.op_end_s[i] - sim.op_start_s[i] >= times[sim.op_device[i]][i] - eps
    for e in g.edges:  # and starts after its inputs end (plus the transfer when remote)
        i, j = g.op_index[e.src], g.op_index[e.dst]
        need = sim.op_end_s[i]
        if sim.op_device[i] != sim.op_device[j]:
            need += c.topology.link.transfer_time_s(e.bytes)
        assert sim.op_start_s[j] >= need - eps
    for d in range(c.topology.num_devices):  # no device idles while it has work: busy = union
        spans = [
            (sim.op_start_s[i], sim.op_end_s[i]) for i in range(len(g.ops)) if sim.op_device[i] == d
        ]
        assert union_s(spans) == pytest.approx(sim.device_busy_s[d], abs=1e-6)
    assert sum(sim.bytes_sent) == sum(sim.bytes_received)
    assert simulate_step(c, assignment) == sim  # deterministic
    events = simulate_step(c, assignment, timeline=True).timeline
    for d in range(c.topology.num_devices):  # the timeline covers the busy time
        mine = [(ev.start_s, ev.end_s) for ev in events if ev.resource == f"device {d}"]
        assert union_s(mine) == pytest.approx(sim.device_busy_s[d], abs=1e-6)
    moved = [ev for ev in events if ev.kind is EventKind.TRANSFER]
    assert sum(ev.end_s - ev.start_s for ev in moved) == pytest.approx(
        sum(b for _, b in sim.link_busy_s), abs=1e-6
    )


@settings(max_examples=60, deadline=None)
@given(cpu_dags())
def test_one_cpu_alone_takes_what_the_in_order_queue_takes(
    case: tuple[CostedGraph, tuple[int, ...]],
) -> None:
    """Processor sharing only moves when tensors leave; on one device the step is the same."""
    c, _ = case
    alone = tuple(0 for _ in c.graph.layers)
    shared = simulate_step(on(c, *["cpu"] * c.topology.num_devices), alone)
    in_order = simulate_step(on(c, *["gpu"] * c.topology.num_devices), alone)
    assert shared.step_time_s == pytest.approx(in_order.step_time_s, abs=1e-9)
    assert shared.device_busy_s == pytest.approx(in_order.device_busy_s)
