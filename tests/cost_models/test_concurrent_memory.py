"""Devices computing at once slow memory-bound work more than matrix products (issue 33): a
calibrated topology's two measured factors, mixed per op by its memory-bound share, stretch
data-parallel replicas and overlapping pipeline stages."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from cost_model_graphs import act, mlp, op
from test_calibrated_topology import _calibrated, task_durations

from cost_models.devices.topology import links_note, parse_topology
from cost_models.estimate.costs import cost_graph, with_update_time
from partitioner.core.errors import CatalogError, InvalidGraphError
from partitioner.core.ir import CostedGraph, Edge, Graph, LayerInfo, Schedule, Topology
from partitioner.core.strategy import Strategy
from partitioner.simulation.evaluate import client_s
from partitioner.simulation.pipeline import EventKind, pipeline_stages, simulate_stages
from partitioner.simulation.step import simulate_step
from partitioner.simulation.strategy import simulate_strategy


def _topology(compute: float = 1.02, memory: float | None = 1.25) -> Topology:
    data = _calibrated()
    data["calibration"]["concurrent_compute"] = {"alone_s": [0.1, 0.1], "together_s": 0.1 * compute}
    if memory is not None:
        data["calibration"]["concurrent_memory"] = {
            "alone_s": [0.08, 0.07],
            "together_s": 0.08 * memory,
        }
    return parse_topology(data, origin="t")


def _memory_share(costed: CostedGraph, device: int = 0) -> float:
    row = costed.op_compute_time_s[device]
    return math.fsum(t * x for t, x in zip(row, costed.op_memory_share)) / math.fsum(row)


def test_the_file_gives_both_factors_and_the_mix_is_by_memory_share() -> None:
    topo = _topology()
    assert topo.concurrent_compute_factor == pytest.approx(1.02)
    assert topo.concurrent_memory_factor == pytest.approx(1.25)
    assert topo.concurrent_factor(0.0) == pytest.approx(1.02)
    assert topo.concurrent_factor(1.0) == pytest.approx(1.25)
    assert topo.concurrent_factor(0.4) == pytest.approx(1.02 + 0.4 * 0.23)
    # a file calibrated before the memory reference: memory traffic slows as the compute step
    old = _topology(memory=None)
    assert old.concurrent_memory_factor is None
    assert old.concurrent_factor(1.0) == pytest.approx(1.02)
    note = links_note(topo)
    assert "x1.02 slower on matrix products, x1.25 on memory traffic" in note


def test_a_memory_table_of_another_device_count_or_a_factor_below_one_fails() -> None:
    data = _calibrated()
    data["calibration"]["concurrent_memory"] = {"alone_s": [0.1], "together_s": 0.11}
    with pytest.raises(CatalogError, match=r"concurrent_memory\.alone_s: gives 1 times"):
        parse_topology(data, origin="t")
    data["calibration"]["concurrent_memory"] = {"alone_s": [0.1, 0.1], "together_s": -1}
    with pytest.raises(CatalogError, match="concurrent_memory"):
        parse_topology(data, origin="t")
    with pytest.raises(InvalidGraphError, match=r"concurrent_memory_factor=0\.9 must be >= 1"):
        replace(_topology(), concurrent_memory_factor=0.9)


def _wide_then_elementwise() -> Graph:
    """A layer of one large matrix product and its ReLU, then a layer of elementwise ops."""
    b, n = 1024, 1024
    ops = (
        op("x", "Placeholder", None, shape=(b, n)),
        op("wide/mm", "MatMul", "wide", shape=(b, n), flops=2 * b * n * n),
        op("wide/relu", "Relu", "wide", shape=(b, n), flops=b * n),
        op("scale/mul", "Mul", "scale", shape=(b, n), flops=b * n),
        op("scale/add", "AddV2", "scale", shape=(b, n), flops=b * n),
    )
    edges = (
        Edge("x", "wide/mm", act(b, n)),
        Edge("wide/mm", "wide/relu", act(b, n)),
        Edge("wide/relu", "scale/mul", act(b, n)),
        Edge("scale/mul", "scale/add", act(b, n)),
    )
    layers = (LayerInfo("wide", "Dense", n * n, n * n, 4 * n * n, 4 * n * n),
              LayerInfo("scale", "Rescaling"))  # fmt: skip
    return Graph("wide", ops, edges, layers, batch_size=b)


def test_a_layers_ops_share_its_memory_bound_part() -> None:
    """Per layer and phase: a matrix-product layer is compute-bound, an elementwise one memory
    bound, and every op of a layer carries the layer's share, so a profile that gives a fused
    kernel's time (matrix product, bias, ReLU) to the ReLU does not make the layer
    memory-bound."""
    costed = cost_graph(_wide_then_elementwise(), topology=_topology(compute=1.0, memory=1.5))
    share = dict(zip((o.id for o in costed.graph.ops), costed.op_memory_share))
    assert share["x"] == 0.0  # no work: the executor's cost only
    assert share["wide/mm"] == share["wide/relu"] < 0.2
    assert share["scale/mul"] == share["scale/add"] > 0.9
    on_relu = tuple(
        tuple(sum(row[1:3]) if i == 2 else 0.0 if i == 1 else t for i, t in enumerate(row))
        for row in costed.op_compute_time_s
    )
    fused = replace(costed, op_compute_time_s=on_relu)
    wide = [1, 2]
    assert fused.concurrent_factor(0, wide) == pytest.approx(costed.concurrent_factor(0, wide))
    assert fused.concurrent_factor(0, wide) == pytest.approx(1 + 0.5 * share["wide/mm"])
    assert costed.concurrent_factor(0, [3, 4]) > 1.45
    with pytest.raises(InvalidGraphError, match="op_memory_share must be"):
        replace(costed, op_memory_share=(2.0,) * len(costed.graph.ops))


def test_an_optimizers_update_counts_as_memory_traffic() -> None:
    costed = cost_graph(mlp(), topology=_topology())
    update_s = 0.5 * math.fsum(costed.op_compute_time_s[0])
    updated = with_update_time(costed, [0, 1], update_s)
    before = math.fsum(t * x for t, x in zip(costed.op_compute_time_s[0], costed.op_memory_share))
    after = math.fsum(t * x for t, x in zip(updated.op_compute_time_s[0], updated.op_memory_share))
    assert after == pytest.approx(before + update_s)
    assert _memory_share(updated) > _memory_share(costed)


def test_replicas_are_stretched_by_the_mix_of_their_ops() -> None:
    costed = cost_graph(mlp(), topology=_topology(compute=1.0, memory=1.3))
    share = _memory_share(costed)
    assert 0.0 < share < 1.0
    plain = replace(costed, topology=replace(costed.topology, concurrent_memory_factor=None))
    layers = len(costed.layer_memory)
    two = Strategy(((0,), (1,)), (0,) * layers)
    fixed = client_s(costed)
    alone = simulate_strategy(plain, two).replica_step_s
    stretched = simulate_strategy(costed, two).replica_step_s
    assert stretched == pytest.approx(tuple(fixed + (s - fixed) * (1 + 0.3 * share) for s in alone))
    # the more of a model's time is memory traffic, the more running at once costs it
    heavier = with_update_time(costed, [0, 1], math.fsum(costed.op_compute_time_s[0]))
    assert heavier.concurrent_factor(0) > costed.concurrent_factor(0) > 1.0


def test_pipeline_stages_are_stretched_by_their_own_memory_share() -> None:
    costed = cost_graph(mlp(), topology=_topology(compute=1.0, memory=1.5))
    topo = costed.topology
    half = len(costed.layer_memory) // 2
    stages = pipeline_stages(costed, [0] * half + [1] * (len(costed.layer_memory) - half))
    assert all(0.0 < st.memory_share < 1.0 for st in stages)
    assert stages[0].memory_share != stages[1].memory_share
    link = topo.client_link
    assert link is not None
    m = 4
    sim = simulate_stages(stages, topo, schedule=Schedule.GPIPE, num_microbatches=m)
    for st in stages:
        stretch = 1.0 + 0.5 * st.memory_share
        feed_s = link.transfer_time_s(st.feed_bytes / m)
        durations = task_durations(sim.timeline, st.device)
        assert durations[EventKind.FORWARD] == pytest.approx(
            [feed_s + st.forward_time_s / m * stretch] * m
        )
        backward = sorted(durations[EventKind.BACKWARD])
        assert backward[0] == pytest.approx(st.backward_time_s / m * stretch)
        # every later backward adds into the gradient sums: memory traffic, at x1.5
        assert backward[-1] == pytest.approx(
            st.backward_time_s / m * stretch + 1.5 * st.accumulate_time_s
        )


def _two_towers() -> Graph:
    """Two independent layers of one large matrix product each, reading one input."""
    b, n = 512, 1024
    ops = (
        op("x", "Placeholder", None, shape=(b, n)),
        op("a/mm", "MatMul", "a", shape=(b, n), flops=2 * b * n * n),
        op("b/mm", "MatMul", "b", shape=(b, n), flops=2 * b * n * n),
    )
    edges = (Edge("x", "a/mm", act(b, n)), Edge("x", "b/mm", act(b, n)))
    layers = (LayerInfo("a", "Dense", n * n, n * n, 4 * n * n, 4 * n * n),
              LayerInfo("b", "Dense", n * n, n * n, 4 * n * n, 4 * n * n))  # fmt: skip
    return Graph("towers", ops, edges, layers, batch_size=b)


def test_towers_on_two_cpus_run_slower_while_both_compute() -> None:
    """A plain split whose devices compute at once (towers): each CPU runs at its factor of
    computing at once while the other computes too, and alone at full speed."""
    costed = cost_graph(_two_towers(), topology=_topology(compute=1.2, memory=1.2))
    alone = replace(
        costed,
        topology=replace(
            costed.topology, concurrent_compute_factor=1.0, concurrent_memory_factor=None
        ),
    )
    apart, together = simulate_step(alone, [0, 1]), simulate_step(costed, [0, 1])
    a, b = 1, 2
    # tower b starts later (its input crosses the link); while both run each is 1.2x slower
    overlap = apart.op_end_s[a] - apart.op_start_s[b]
    assert 0 < overlap < apart.op_end_s[a] - apart.op_start_s[a]
    assert together.op_start_s[b] == pytest.approx(apart.op_start_s[b])
    assert together.op_end_s[a] == pytest.approx(apart.op_end_s[a] + 0.2 * overlap)
    # once tower a ends, tower b runs alone: it lost 0.2 / 1.2 of the overlap's work
    assert together.op_end_s[b] == pytest.approx(apart.op_end_s[b] + 0.2 * overlap)
    # one device: nothing runs at once, nothing slows
    assert simulate_step(costed, [0, 0]).step_time_s == simulate_step(alone, [0, 0]).step_time_s
