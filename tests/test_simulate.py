"""The op-level step simulator: hand-computed schedules and schedule invariants."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from partitioner.core.errors import PlanError
from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    EventKind,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    TimelineEvent,
    Topology,
)
from partitioner.simulation.step import channel_resource, simulate_step

# latency 0.5 s + bytes / 100 B/s: 100 bytes take exactly 1.5 s.
SLOW_LINK = Link("test", latency_s=0.5, bandwidth_bytes_per_s=100.0)


def costed(
    ops: Sequence[tuple[str, str | None, float]],
    edges: list[tuple[str, str, int] | tuple[str, str, int, int]],
    layers: list[str],
    n_dev: int = 2,
    link: Link = SLOW_LINK,
) -> CostedGraph:
    """ops: (id, layer, seconds on every device); edges: (src, dst, bytes[, output_index])."""
    graph = Graph(
        name="g",
        ops=tuple(Op(i, "X", layer, Phase.FORWARD) for i, layer, _ in ops),
        edges=tuple(Edge(e[0], e[1], e[2], e[3] if len(e) > 3 else 0) for e in edges),
        layers=tuple(LayerInfo(name, "Dense") for name in layers),
    )
    topo = Topology(tuple(Device(d, "gpu", 1 << 30) for d in range(n_dev)), link)
    times = tuple(tuple(t for _, _, t in ops) for _ in range(n_dev))
    memory = tuple(LayerMemory(name, 1, 0, 0, 0) for name in layers)
    return CostedGraph(graph, topo, times, memory)


def test_two_device_chain_with_transfer_exact_times() -> None:
    c = costed(
        [("a", "A", 1.0), ("b", "B", 2.0), ("c", "B", 1.0), ("d", "A", 0.25)],
        [("a", "b", 100), ("a", "c", 100), ("a", "d", 100)],
        ["A", "B"],
    )
    sim = simulate_step(c, {"A": 0, "B": 1})
    # a on dev0 [0, 1]; tensor a -> dev1 over [1, 2.5] (sent once, reused by c);
    # d on dev0 [1, 1.25]; b on dev1 [2.5, 4.5]; c on dev1 [4.5, 5.5].
    assert sim.op_start_s == (0.0, 2.5, 4.5, 1.0)
    assert sim.op_end_s == (1.0, 4.5, 5.5, 1.25)
    assert sim.step_time_s == 5.5
    assert sim.device_busy_s == (1.25, 3.0)
    assert sim.device_idle_s == (4.25, 2.5)
    assert sim.link_busy_s == (((0, 1), 1.5),)
    assert sim.link_busy_map[(0, 1)] == 1.5
    assert sim.bytes_sent == (100, 0)
    assert sim.bytes_received == (0, 100)
    assert sim.op_device == (0, 1, 1, 0)


def test_transfers_on_one_link_are_serialised() -> None:
    c = costed(
        [("a1", "A", 1.0), ("a2", "A", 1.0), ("b", "B", 1.0)],
        [("a1", "b", 100), ("a2", "b", 100)],
        ["A", "B"],
    )
    sim = simulate_step(c, (0, 1))
    # a1 [0,1] -> link [1, 2.5]; a2 [1,2] -> link waits: [2.5, 4.0]; b [4, 5].
    assert sim.op_end_s == (1.0, 2.0, 5.0)
    assert sim.link_busy_s == (((0, 1), 3.0),)
    assert sim.bytes_sent == (200, 0)


def test_same_device_has_no_transfer_and_glue_ops_follow_their_layer() -> None:
    c = costed(
        [("in", None, 0.0), ("a", "A", 1.0), ("b", "B", 2.0)],
        [("in", "a", 10), ("a", "b", 100)],
        ["A", "B"],
    )
    sim = simulate_step(c, (0, 0))
    assert sim.step_time_s == 3.0
    assert sim.link_busy_s == ()
    assert sim.bytes_sent == (0, 0)
    assert sim.device_idle_s == (0.0, 3.0)


def test_bad_placements_raise_plan_error() -> None:
    c = costed([("a", "A", 1.0)], [], ["A"])
    with pytest.raises(PlanError):
        simulate_step(c, (0, 1))
    with pytest.raises(PlanError):
        simulate_step(c, (2,))
    with pytest.raises(PlanError):
        simulate_step(c, {"B": 0})


@st.composite
def random_dags(draw: st.DrawFn) -> tuple[CostedGraph, tuple[int, ...]]:
    n_layers = draw(st.integers(1, 5))
    n_ops = draw(st.integers(1, 25))
    n_dev = draw(st.integers(1, 4))
    layers = [f"L{k}" for k in range(n_layers)]
    ops = [
        (f"op{i}", draw(st.sampled_from([*layers, None])), draw(st.floats(0.0, 5.0)))
        for i in range(n_ops)
    ]
    edges: list[tuple[str, str, int] | tuple[str, str, int, int]] = []
    seen = set()
    sizes = {(i, out): draw(st.integers(0, 1000)) for i in range(n_ops) for out in (0, 1)}
    for j in range(1, n_ops):
        for i in draw(st.lists(st.integers(0, j - 1), max_size=3, unique=True)):
            out = draw(st.integers(0, 1))
            if (i, j, out) not in seen:
                seen.add((i, j, out))
                edges.append((f"op{i}", f"op{j}", sizes[(i, out)], out))
    link = Link("l", draw(st.floats(0.0, 1.0)), draw(st.floats(1.0, 1e4)))
    c = costed(ops, edges, layers, n_dev, link)
    assignment = tuple(
        draw(st.lists(st.integers(0, n_dev - 1), min_size=n_layers, max_size=n_layers))
    )
    return c, assignment


@settings(max_examples=100, deadline=None)
@given(random_dags())
def test_schedule_invariants(case: tuple[CostedGraph, tuple[int, ...]]) -> None:
    c, assignment = case
    sim = simulate_step(c, assignment)
    g = c.graph
    eps = 1e-9
    assert sim.step_time_s >= max(sim.device_busy_s) - eps
    assert all(idle >= 0 for idle in sim.device_idle_s)
    # ops on one device never overlap
    for d in range(c.topology.num_devices):
        spans = sorted(
            (sim.op_start_s[i], sim.op_end_s[i]) for i in range(len(g.ops)) if sim.op_device[i] == d
        )
        for (_, e0), (s1, _) in itertools.pairwise(spans):
            assert s1 >= e0 - eps
    # every op starts after its inputs end (plus the transfer when remote)
    for e in g.edges:
        i, j = g.op_index[e.src], g.op_index[e.dst]
        need = sim.op_end_s[i]
        if sim.op_device[i] != sim.op_device[j]:
            need += c.topology.link.transfer_time_s(e.bytes)
        assert sim.op_start_s[j] >= need - eps
    assert sum(sim.bytes_sent) == sum(sim.bytes_received)
    assert simulate_step(c, assignment) == sim  # deterministic
    # the coarse timeline covers exactly the busy time, and never overlaps on one resource
    with_timeline = simulate_step(c, assignment, timeline=True)
    assert with_timeline.step_time_s == sim.step_time_s and sim.timeline == ()
    events = with_timeline.timeline
    assert list(events) == sorted(events, key=lambda ev: (ev.start_s, ev.resource, ev.end_s))
    for d in range(c.topology.num_devices):
        mine = [ev for ev in events if ev.resource == f"device {d}"]
        assert sum(ev.end_s - ev.start_s for ev in mine) == pytest.approx(
            sim.device_busy_s[d], abs=1e-6
        )
        for a, b in itertools.pairwise(mine):
            assert b.start_s >= a.end_s - eps
    moved = [ev for ev in events if ev.kind is EventKind.TRANSFER]
    assert sum(ev.end_s - ev.start_s for ev in moved) == pytest.approx(
        sum(b for _, b in sim.link_busy_s), abs=1e-6
    )


def test_coarse_timeline_merges_back_to_back_ops_of_a_layer() -> None:
    c = costed(
        [("a", "A", 1.0), ("b", "B", 2.0), ("c", "B", 1.0), ("d", "A", 0.25)],
        [("a", "b", 100), ("a", "c", 100), ("a", "d", 100)],
        ["A", "B"],
    )
    sim = simulate_step(c, {"A": 0, "B": 1}, timeline=True)
    # a [0,1] and d [1,1.25] run back to back on device 0 (layer A); b [2.5,4.5] and
    # c [4.5,5.5] on device 1 (layer B); the tensor a:0 crosses over [1, 2.5].
    assert sim.timeline == (
        TimelineEvent("device 0", EventKind.FORWARD, "A", 0.0, 1.25),
        TimelineEvent("link 0->1", EventKind.TRANSFER, "a:0", 1.0, 2.5),
        TimelineEvent("device 1", EventKind.FORWARD, "B", 2.5, 5.5),
    )


def test_coarse_timeline_splits_at_gaps_layers_and_phases() -> None:
    ops = (
        Op("a1", "X", "A", Phase.FORWARD),
        Op("b1", "X", "B", Phase.FORWARD),
        Op("a2", "X", "A", Phase.FORWARD),
        Op("a3", "X", "A", Phase.FORWARD),
        Op("ga", "X", "A", Phase.BACKWARD),
        Op("gb", "X", "B", Phase.BACKWARD),
    )
    edges = (Edge("a1", "b1", 100), Edge("b1", "a3", 100), Edge("a3", "ga", 4))
    graph = Graph("g", ops, edges, (LayerInfo("A", "Dense"), LayerInfo("B", "Dense")))
    topo = Topology(tuple(Device(d, "gpu", 1 << 30) for d in range(2)), SLOW_LINK)
    times = ((1.0, 1.0, 1.0, 1.0, 1.0, 1.0),) * 2
    c = CostedGraph(
        graph, topo, times, (LayerMemory("A", 0, 0, 0, 0), LayerMemory("B", 0, 0, 0, 0))
    )
    sim = simulate_step(c, (0, 1), timeline=True)
    # dev0: a1 [0,1], a2 [1,2] merge; a3 waits for b1's output: b1 [2.5,3.5] on dev1, back over
    # [3.5,5]; a3 [5,6] (a gap: a new event); ga [6,7] (backward: a new event).
    # dev1: b1 [2.5,3.5], gb [3.5,4.5] (another phase).
    dev0 = [(ev.kind, ev.start_s, ev.end_s) for ev in sim.timeline if ev.resource == "device 0"]
    assert dev0 == [
        (EventKind.FORWARD, 0.0, 2.0),
        (EventKind.FORWARD, 5.0, 6.0),
        (EventKind.BACKWARD, 6.0, 7.0),
    ]
    dev1 = [(ev.kind, ev.start_s, ev.end_s) for ev in sim.timeline if ev.resource == "device 1"]
    assert dev1 == [(EventKind.FORWARD, 2.5, 3.5), (EventKind.BACKWARD, 3.5, 4.5)]
    assert [(ev.resource, ev.label) for ev in sim.timeline if ev.kind is EventKind.TRANSFER] == [
        ("link 0->1", "a1:0"),
        ("link 1->0", "b1:0"),
    ]


def test_transfers_between_hosts_share_one_channel() -> None:
    # devices 0, 1 on host 0 and 2, 3 on host 1; a (dev0) -> c (dev2), b (dev1) -> d (dev3)
    ops = [("a", "A", 1.0), ("b", "B", 1.0), ("c", "C", 1.0), ("d", "D", 1.0)]
    graph = Graph(
        "g",
        tuple(Op(i, "X", layer, Phase.FORWARD) for i, layer, _ in ops),
        (Edge("a", "c", 100), Edge("b", "d", 100)),
        tuple(LayerInfo(x, "Dense") for x in "ABCD"),
    )
    devices = tuple(Device(d, "gpu", 1 << 30, host=d // 2) for d in range(4))
    net = Link("net", latency_s=0.0, bandwidth_bytes_per_s=50.0)  # 100 bytes: 2 s
    topo = Topology(devices, SLOW_LINK, inter_host_link=net)
    times = ((1.0, 1.0, 1.0, 1.0),) * 4
    c = CostedGraph(graph, topo, times, tuple(LayerMemory(x, 0, 0, 0, 0) for x in "ABCD"))
    sim = simulate_step(c, (0, 1, 2, 3), timeline=True)
    # a and b end at 1; a's tensor uses hosts 0->1 over [1,3], b's waits for it: [3,5];
    # c [3,4], d [5,6]. Per device pair the busy time is 2 s each.
    assert sim.op_end_s == (1.0, 1.0, 4.0, 6.0)
    assert sim.link_busy_s == (((0, 2), 2.0), ((1, 3), 2.0))
    moved = [
        (ev.resource, ev.start_s, ev.end_s) for ev in sim.timeline if ev.kind is EventKind.TRANSFER
    ]
    assert moved == [("hosts 0->1", 1.0, 3.0), ("hosts 0->1", 3.0, 5.0)]
    assert channel_resource(topo, 0, 1) == "link 0->1"
    assert channel_resource(topo, 3, 0) == "hosts 1->0"
