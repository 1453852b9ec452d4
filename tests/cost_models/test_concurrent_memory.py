"""Devices computing at once slow memory-bound work more than matrix products (issue 33): a
calibrated topology's two measured factors, mixed per op by its memory-bound share, stretch
data-parallel replicas and overlapping pipeline stages."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from cost_model_graphs import mlp
from test_calibrated_topology import _calibrated

from cost_models.devices.topology import links_note, parse_topology
from cost_models.estimate.costs import cost_graph, with_update_time
from partitioner.core.errors import CatalogError, InvalidGraphError
from partitioner.core.ir import CostedGraph, Schedule, Topology
from partitioner.core.strategy import Strategy
from partitioner.simulation.evaluate import client_s
from partitioner.simulation.pipeline import EventKind, pipeline_stages, simulate_stages
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


def test_matrix_products_are_compute_bound_and_elementwise_ops_memory_bound() -> None:
    costed = cost_graph(mlp(), topology=_topology())
    share = dict(zip((op.op_type + ":" + op.id for op in costed.graph.ops), costed.op_memory_share))
    assert share["Placeholder:x"] == 0.0  # no work: the executor's cost only
    assert share["MatMul:d1/mm"] < 0.5 < share["Relu:d1/relu"]
    assert share["ReluGrad:g/d1/relu"] > 0.9
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
        durations: dict[EventKind, list[float]] = {}
        for ev in sim.timeline:
            if ev.resource == f"device {st.device}":
                durations.setdefault(ev.kind, []).append(ev.end_s - ev.start_s)
        assert durations[EventKind.FORWARD] == pytest.approx(
            [feed_s + st.forward_time_s / m * stretch] * m
        )
        backward = sorted(durations[EventKind.BACKWARD])
        assert backward[0] == pytest.approx(st.backward_time_s / m * stretch)
        # every later backward adds into the gradient sums: memory traffic, at x1.5
        assert backward[-1] == pytest.approx(
            st.backward_time_s / m * stretch + 1.5 * st.accumulate_time_s
        )
