"""A topology file written by ``partition calibrate``: its figures are the fits of its raw points.

The reader (:mod:`cost_models.devices.topology`) refits every measured link and the all-reduce
from the ``calibration`` table's points and refuses a file whose figures were edited away from
them, whose points cannot make a fit, or whose figures are nonsense, with one line naming the
field and the next step. :mod:`cost_models.devices.fits` is the fit both sides use.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cost_models.devices.fits import fit_latency_bandwidth
from cost_models.devices.topology import load_topology, parse_topology
from partitioner.core.errors import CatalogError
from partitioner.core.ir import EventKind, TimelineEvent

SIZES = (1 << 18, 1 << 20, 1 << 22, 1 << 24)


def _line(latency_s: float, bandwidth: float) -> list[list[float]]:
    return [[b, latency_s + b / bandwidth] for b in SIZES]


def task_durations(timeline: Iterable[TimelineEvent], device: int) -> dict[EventKind, list[float]]:
    """The durations of ``device``'s timeline events, by kind, in timeline order."""
    durations: dict[EventKind, list[float]] = {}
    for ev in timeline:
        if ev.resource == f"device {device}":
            durations.setdefault(ev.kind, []).append(ev.end_s - ev.start_s)
    return durations


def _calibrated() -> dict[str, Any]:
    link_points = _line(8e-4, 1.2e9)
    reduce_points = _line(1.5e-3, 8e8)
    link = fit_latency_bandwidth([(int(b), s) for b, s in link_points], "link")
    reduce = fit_latency_bandwidth([(int(b), s) for b, s in reduce_points], "all-reduce")
    table = {"latency_s": link.latency_s, "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s}
    return {
        "name": "calibrated: 2 tasks",
        "job": "worker",
        "hosts": [{"devices": [{"type": "cpu"}]}, {"devices": [{"type": "cpu"}]}],
        "inter_host_link": {**table, "name": "measured (slowest pair)"},
        "links": [{"devices": [0, 1], "link": {**table, "name": "measured 0<->1"}}],
        "all_reduce": {
            "latency_s": reduce.latency_s,
            "bandwidth_bytes_per_s": reduce.bandwidth_bytes_per_s,
            "members": 2,
            "algorithm": "reduce_to_one",
            "source": "partition calibrate (test)",
        },
        "calibration": {
            "tool": "partition calibrate",
            "when": "2026-11-26T00:00:00+00:00",
            "where": "2 tasks of cluster file 'c.json'",
            "tensorflow": "2.21.0",
            "cluster": ["127.0.0.1:1", "127.0.0.1:2"],
            "links": [{"devices": [0, 1], "points": link_points}],
            "all_reduce": {"points": reduce_points},
            "matmul_flops_per_s": [2e11, 1e11],
            "client": {"step_s": 4e-3, "link_points": _line(2e-3, 2e9)},
        },
    }


def test_fit_recovers_a_line_and_refuses_what_is_no_line() -> None:
    fit = fit_latency_bandwidth([(int(b), s) for b, s in _line(1e-3, 2e9)], "x")
    assert fit.latency_s == pytest.approx(1e-3, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert fit.predict_s(1 << 20) == pytest.approx(1e-3 + (1 << 20) / 2e9)
    # a busy machine's outlier (a 16 MiB copy timed below the 4 MiB one) is raised to it
    noisy = [(1 << 18, 1.05e-3), (1 << 20, 1.12e-3), (1 << 22, 7.8e-3), (1 << 24, 1.2e-4),
             (1 << 26, 4.6e-2)]  # fmt: skip
    assert fit_latency_bandwidth(noisy, "x").bandwidth_bytes_per_s > 0
    assert fit_latency_bandwidth(noisy, "x").points == tuple(noisy)  # the raw points kept
    with pytest.raises(CatalogError, match="needs points at 2 or more sizes"):
        fit_latency_bandwidth([(1024, 1e-3)], "x")
    with pytest.raises(CatalogError, match="do not grow with the size"):
        fit_latency_bandwidth([(1024, 2e-3), (1 << 20, 1e-3)], "x")
    with pytest.raises(CatalogError, match="finite number of seconds > 0"):
        fit_latency_bandwidth([(1024, 0.0), (1 << 20, 1e-3)], "x")


def test_a_calibrated_file_plans_with_its_measured_figures(tmp_path: Path) -> None:
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(_calibrated()))
    topo = load_topology(str(path))
    assert topo.num_devices == 2 and topo.num_hosts == 2
    assert [d.name for d in topo.devices] == [
        "/job:worker/replica:0/task:0/device:CPU:0",
        "/job:worker/replica:0/task:1/device:CPU:0",
    ]
    link = topo.link_between(0, 1)
    assert link is not None and link.kind == "measured 0<->1"
    assert link.latency_s == pytest.approx(8e-4) and link.bandwidth_bytes_per_s == pytest.approx(
        1.2e9
    )
    fit = topo.all_reduce
    assert fit is not None and fit.algorithm == "reduce_to_one" and fit.members == 2
    assert fit.bandwidth_bytes_per_s == pytest.approx(8e8)
    assert topo.device_flops_per_s == (2e11, 1e11)
    assert topo.cluster_addresses == ("127.0.0.1:1", "127.0.0.1:2")
    assert topo.client_step_s == 4e-3 and topo.client_link is not None
    assert topo.client_link.bandwidth_bytes_per_s == pytest.approx(2e9)


def test_every_step_on_a_measured_cluster_pays_the_clients_cost() -> None:
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import cost_graph
    from partitioner.core.ir import Schedule
    from partitioner.simulation.evaluate import client_s, evaluate, evaluate_pipeline, input_bytes

    measured = cost_graph(mlp(), topology=parse_topology(_calibrated(), origin="t"))
    bare = replace(
        measured, topology=replace(measured.topology, client_step_s=0.0, client_link=None)
    )
    fed = input_bytes(measured)
    assert fed > 0
    assert client_s(measured) == pytest.approx(4e-3 + 2e-3 + fed / 2e9)
    assert client_s(bare) == 0.0
    split = [0] * (len(measured.layer_memory) // 2) + [1] * (
        len(measured.layer_memory) - len(measured.layer_memory) // 2
    )
    assert evaluate(measured, split).step_time_s == pytest.approx(
        evaluate(bare, split).step_time_s + client_s(measured)
    )
    piped = evaluate_pipeline(measured, split, schedule=Schedule.GPIPE, num_microbatches=2)
    assert piped.pipeline is not None  # the feed is inside the stages' tasks (next test)
    assert piped.step_time_s == pytest.approx(piped.pipeline.step_time_s + 4e-3)


def test_a_pipeline_feeds_each_micro_batch_to_the_stage_that_reads_it() -> None:
    """The pipelined rewrite splits the batch on the client: every forward task of the stage
    that reads the inputs (and of the last stage, which reads the targets for the loss) first
    receives its micro-batch's slice over the client's link, latency and all, on its device's
    queue. Without a measured client link, no feed."""
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import cost_graph
    from partitioner.core.ir import Phase, Schedule
    from partitioner.simulation.evaluate import input_bytes
    from partitioner.simulation.pipeline import EventKind, pipeline_stages, simulate_stages

    graph = replace(mlp(), target_bytes=4096)
    measured = cost_graph(graph, topology=parse_topology(_calibrated(), origin="t"))
    half = len(measured.layer_memory) // 2
    split = [0] * half + [1] * (len(measured.layer_memory) - half)
    stages = pipeline_stages(measured, split)
    assert [st.feed_bytes for st in stages] == [input_bytes(measured), 4096]
    link = measured.topology.client_link
    assert link is not None
    m = 4
    sim = simulate_stages(stages, measured.topology, schedule=Schedule.GPIPE, num_microbatches=m)
    for st in stages:
        forwards = [
            ev for ev in sim.timeline
            if ev.kind is EventKind.FORWARD and ev.resource == f"device {st.device}"
        ]  # fmt: skip
        assert len(forwards) == m
        feed_s = link.transfer_time_s(st.feed_bytes / m)
        for ev in forwards:
            assert ev.end_s - ev.start_s == pytest.approx(st.forward_time_s / m + feed_s)
    local = replace(measured.topology, client_link=None, client_step_s=0.0)
    bare = simulate_stages(stages, local, schedule=Schedule.GPIPE, num_microbatches=m)
    assert bare.step_time_s < sim.step_time_s
    assert Phase.FORWARD in {t.phase for st in stages for t in st.sends}


def test_the_client_feeds_targets_and_every_replicas_share() -> None:
    """A step's feed is its inputs and its targets (``Graph.target_bytes``); data-parallel
    replicas each pay their own share, and the step the rest of the batch's feed, serially
    through the client's one link."""
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import cost_graph
    from partitioner.core.strategy import Strategy
    from partitioner.simulation.evaluate import client_s, fed_bytes, input_bytes
    from partitioner.simulation.strategy import other_shares_feed_s, simulate_strategy

    graph = mlp()
    targeted = replace(graph, target_bytes=3 << 20)
    topo = parse_topology(_calibrated(), origin="t")
    measured, with_targets = cost_graph(graph, topology=topo), cost_graph(targeted, topology=topo)
    assert fed_bytes(with_targets) == input_bytes(with_targets) + (3 << 20)
    assert client_s(with_targets) - client_s(measured) == pytest.approx((3 << 20) / 2e9)
    layers = len(with_targets.layer_memory)
    one = Strategy(((0,),), (0,) * layers)
    two = Strategy(((0,), (1,)), (0,) * layers)
    assert other_shares_feed_s(with_targets, one) == 0.0
    share = fed_bytes(with_targets)
    assert other_shares_feed_s(with_targets, two) == pytest.approx(share / 2e9)
    sim = simulate_strategy(with_targets, two)
    assert sim.other_shares_feed_s == pytest.approx(share / 2e9)
    assert sim.step_time_s == pytest.approx(
        max(sim.replica_step_s) + sim.all_reduce_s + share / 2e9
    )
    local = replace(with_targets, topology=replace(topo, client_step_s=0.0, client_link=None))
    assert other_shares_feed_s(local, two) == 0.0


def test_profiled_op_times_move_to_each_devices_measured_speed() -> None:
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import SAME_SPEED_BAND, cost_graph, scale_to_device_speeds

    topo = parse_topology(_calibrated(), origin="t")
    costed = cost_graph(mlp(), topology=topo)
    scaled, factors = scale_to_device_speeds(costed, [0, 1], 3e11)
    band = 1 + SAME_SPEED_BAND  # devices 1.5x and 3x slower: the part beyond the noise band
    assert factors == {0: pytest.approx(1.5 / band), 1: pytest.approx(3.0 / band)}
    for d, factor in factors.items():
        assert scaled.op_compute_time_s[d] == pytest.approx(
            [t * factor for t in costed.op_compute_time_s[d]]
        )
    plain = cost_graph(mlp(), topology=parse_topology(
        {"devices": [{"type": "cpu", "count": 2}]}, origin="t"
    ))  # fmt: skip
    assert scale_to_device_speeds(plain, [0, 1], 3e11) == (plain, {})


def test_a_device_within_the_measurements_spread_is_taken_as_this_speed() -> None:
    """One core measured 174-201 GFLOP/s across processes: a ratio within SAME_SPEED_BAND of 1
    is no evidence of another speed, so the profiled times are kept; beyond it they scale by
    the part beyond the band, so that the factor has no jump at the band's edge."""
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import SAME_SPEED_BAND, cost_graph, scale_to_device_speeds

    data = _calibrated()
    data["calibration"]["matmul_flops_per_s"] = [1.9e11, 1.5e11]
    costed = cost_graph(mlp(), topology=parse_topology(data, origin="t"))
    here = 2.0e11  # device 0 is 5% slower (the same speed), device 1 33% slower
    scaled, factors = scale_to_device_speeds(costed, [0, 1], here)
    band = 1 + SAME_SPEED_BAND
    assert factors == {0: 1.0, 1: pytest.approx(here / 1.5e11 / band)}
    assert scaled.op_compute_time_s[0] == costed.op_compute_time_s[0]
    assert scaled.op_compute_time_s[1] == pytest.approx(
        tuple(t * here / 1.5e11 / band for t in costed.op_compute_time_s[1])
    )
    for side in (1.001, 1 / 1.001):  # just outside the band, either way: barely moved
        edge = 1.9e11 * band**side if side > 1 else 1.9e11 / band * side
        factor = scale_to_device_speeds(costed, [0], edge)[1][0]
        assert factor != 1.0 and factor == pytest.approx(1.0, abs=0.01)
    faster = scale_to_device_speeds(costed, [0], 1.9e11 / 2)[1][0]  # device 0 twice as fast
    assert faster == pytest.approx(0.5 * band)


def _edit(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    data = copy.deepcopy(_calibrated())
    node: Any = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return data


@pytest.mark.parametrize(
    ("path", "value", "needle"),
    [
        (("links", 0, "link", "bandwidth_bytes_per_s"), 5e9,
         "links[0].link: differs from the fit of its calibration points"),
        (("all_reduce", "latency_s"), 0.0, "all_reduce: differs from the fit"),
        (("links", 0, "link", "bandwidth_bytes_per_s"), -1.0, "links[0].link"),
        (("all_reduce", "bandwidth_bytes_per_s"), -5.0, "bytes per second in 1e3..1e15"),
        (("calibration", "links", 0, "points"), [[1024, 0.001]],
         "must hold 2 or more [bytes, seconds] points"),
        (("calibration", "all_reduce", "points"), [[1024, 0.002], [4096, 0.001]],
         "do not grow with the size"),
        (("calibration", "links", 0, "devices"), [0, 5], "which no [[links]] table sets"),
        (("calibration", "measured_devices"), ["a", "b", "c"], "names 3 devices"),
    ],
)  # fmt: skip
def test_an_edited_calibrated_file_fails_with_one_line(
    path: tuple[Any, ...], value: Any, needle: str
) -> None:
    with pytest.raises(CatalogError) as info:
        parse_topology(_edit(path, value), origin="topology file 'c.json'")
    message = str(info.value)
    assert needle in message and "\n" not in message
    assert message.startswith("topology file 'c.json'")


def test_a_calibration_needs_its_all_reduce() -> None:
    data = _calibrated()
    del data["all_reduce"]
    with pytest.raises(CatalogError, match="all_reduce: is missing, though the calibration"):
        parse_topology(data, origin="t")


def _with_many_tensors() -> dict[str, Any]:
    """:func:`_calibrated` with the all-reduce measured again at 64 tensors (as calibrate does)."""
    data = _calibrated()
    many_points = _line(4.5e-3, 6e8)
    many = fit_latency_bandwidth([(int(b), s) for b, s in many_points], "many")
    data["all_reduce"]["tensors"] = 8
    data["all_reduce"]["many_tensors"] = {
        "tensors": 64,
        "latency_s": many.latency_s,
        "bandwidth_bytes_per_s": many.bandwidth_bytes_per_s,
    }
    data["calibration"]["all_reduce"]["tensors"] = 8
    data["calibration"]["all_reduce"]["many_tensors"] = {"tensors": 64, "points": many_points}
    return data


def test_a_gradient_list_is_priced_by_its_tensor_count() -> None:
    from cost_models.estimate.collectives import measured_all_reduce_s

    fit = parse_topology(_with_many_tensors(), origin="t").all_reduce
    assert fit is not None and fit.tensors == 8 and fit.many is not None
    assert fit.many.tensors == 64 and fit.many.bandwidth_bytes_per_s == pytest.approx(6e8)
    size = 1 << 24
    few, many = 1.5e-3 + size / 8e8, 4.5e-3 + size / 6e8
    assert measured_all_reduce_s(fit, 2, size) == pytest.approx(few)  # count not known
    assert measured_all_reduce_s(fit, 2, size, 3) == pytest.approx(few)  # fewer than measured
    assert measured_all_reduce_s(fit, 2, size, 8) == pytest.approx(few)
    assert measured_all_reduce_s(fit, 2, size, 64) == pytest.approx(many)
    assert measured_all_reduce_s(fit, 2, size, 500) == pytest.approx(many)  # levels off
    # between the two by log n: 16 tensors is a third of the way from 8 to 64 (2 = 8^(1/3))
    assert measured_all_reduce_s(fit, 2, size, 16) == pytest.approx(few + (many - few) / 3)
    without = replace(fit, tensors=0, many=None)
    assert measured_all_reduce_s(without, 2, size, 64) == pytest.approx(few)


def test_the_strategy_all_reduces_the_models_gradient_tensors() -> None:
    from cost_model_graphs import mlp

    from cost_models.estimate.collectives import AllReduceAlgorithm, gradient_exchange_s
    from cost_models.estimate.costs import cost_graph
    from partitioner.core.strategy import Strategy
    from partitioner.simulation.strategy import dense_gradient_tensors, simulate_strategy

    topo = parse_topology(_with_many_tensors(), origin="t")
    graph = mlp()
    layers = tuple(replace(info, trainable_tensors=20) for info in graph.layers)
    costed = cost_graph(replace(graph, layers=layers), topology=topo)
    two = Strategy(((0,), (1,)), (0,) * len(layers))
    assert dense_gradient_tensors(costed, two) == 20 * len(layers) > 8
    sim = simulate_strategy(costed, two)
    group = [((0, 1), sim.gradient_bytes[0], 0)]
    algorithm = AllReduceAlgorithm.REDUCE_TO_ONE
    assert sim.all_reduce_s == pytest.approx(
        gradient_exchange_s(topo, group, algorithm, dense_tensors=20 * len(layers))
    )
    assert sim.all_reduce_s > gradient_exchange_s(topo, group, algorithm)


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["all_reduce"]["many_tensors"].update(latency_s=0.5),
         "all_reduce.many_tensors: differs from the fit of its calibration points"),
        (lambda d: d["all_reduce"].pop("tensors"),
         "all_reduce.tensors: differs from the calibration's tensor counts [8, 64]"),
        (lambda d: (d["all_reduce"].pop("tensors"), d.pop("calibration")),
         "all_reduce.tensors: is missing; beside many_tensors.tensors = 64"),
        (lambda d: (d["all_reduce"].update(tensors=64), d.pop("calibration")),
         "from 1 to fewer than that"),
        (lambda d: d["calibration"]["all_reduce"].pop("many_tensors"),
         "calibration.all_reduce: is missing beside the other's many_tensors"),
        (lambda d: d["all_reduce"].pop("many_tensors"),
         "all_reduce.many_tensors: is missing beside the other's many_tensors"),
        (lambda d: d["all_reduce"]["many_tensors"].update(tensors=32),
         "differs from the calibration's tensor counts [8, 64]"),
        (lambda d: d["all_reduce"]["many_tensors"].update(tensors=0), "(>= 2), got 0"),
    ],
)  # fmt: skip
def test_an_edited_tensor_count_fit_fails_with_one_line(edit: Any, needle: str) -> None:
    data = _with_many_tensors()
    edit(data)
    with pytest.raises(CatalogError) as info:
        parse_topology(data, origin="topology file 'c.json'")
    message = str(info.value)
    assert needle in message and "\n" not in message, message


@pytest.mark.parametrize(
    ("alone", "together", "factor"),
    [([0.128, 0.127], 0.136, 0.136 / 0.128), ([0.128, 0.127], 0.120, 1.0)],
)
def test_replicas_computing_at_once_are_stretched_by_the_measured_factor(
    alone: list[float], together: float, factor: float
) -> None:
    """``calibration.concurrent_compute``: the reference step on every device at once over the
    slowest alone (never below 1); data-parallel replicas' steps, their client part aside, are
    stretched by it, a single replica is not."""
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import cost_graph
    from partitioner.core.strategy import Strategy
    from partitioner.simulation.evaluate import client_s
    from partitioner.simulation.strategy import simulate_strategy

    data = _calibrated()
    data["calibration"]["concurrent_compute"] = {"alone_s": alone, "together_s": together}
    topo = parse_topology(data, origin="t")
    assert topo.concurrent_compute_factor == pytest.approx(factor)
    costed = cost_graph(mlp(), topology=topo)
    plain = replace(costed, topology=replace(topo, concurrent_compute_factor=1.0))
    layers = len(costed.layer_memory)
    two, one = Strategy(((0,), (1,)), (0,) * layers), Strategy(((0,),), (0,) * layers)
    fixed = client_s(costed)
    stretched = simulate_strategy(costed, two).replica_step_s
    as_alone = simulate_strategy(plain, two).replica_step_s
    assert stretched == pytest.approx(tuple(fixed + (s - fixed) * factor for s in as_alone))
    assert simulate_strategy(costed, one).step_time_s == simulate_strategy(plain, one).step_time_s


def test_pipeline_stages_computing_at_once_are_stretched_by_the_measured_factor() -> None:
    """A pipeline's stages overlap once there are micro-batches: each stage's compute task is
    stretched by ``concurrent_compute_factor`` (its feed is not); a plain split (one
    micro-batch: the stages take turns) is not, and a pipelined strategy's step is the
    pipeline's, stretched once (replicas of pipelines are not stretched again)."""
    from cost_model_graphs import mlp

    from cost_models.estimate.costs import cost_graph
    from partitioner.core.ir import Schedule
    from partitioner.core.strategy import Strategy
    from partitioner.simulation.evaluate import evaluate_pipeline
    from partitioner.simulation.pipeline import EventKind, pipeline_stages, simulate_stages
    from partitioner.simulation.strategy import simulate_strategy

    data = _calibrated()
    data["calibration"]["concurrent_compute"] = {"alone_s": [0.1, 0.1], "together_s": 0.12}
    topo = parse_topology(data, origin="t")
    costed = cost_graph(mlp(), topology=topo)
    half = len(costed.layer_memory) // 2
    split = [0] * half + [1] * (len(costed.layer_memory) - half)
    stages = pipeline_stages(costed, split)
    link = topo.client_link
    assert link is not None
    for m, stretch in ((4, 1.2), (1, 1.0)):
        sim = simulate_stages(stages, topo, schedule=Schedule.GPIPE, num_microbatches=m)
        for st in stages:
            feed_s = link.transfer_time_s(st.feed_bytes / m)
            durations = task_durations(sim.timeline, st.device)
            assert durations[EventKind.FORWARD] == pytest.approx(
                [feed_s + st.forward_time_s / m * stretch] * m
            )
            # the first backward a stage runs adds into no running sums (module docstring)
            assert min(durations[EventKind.BACKWARD]) == pytest.approx(
                st.backward_time_s / m * stretch
            )
    plain = replace(costed, topology=replace(topo, concurrent_compute_factor=1.0))
    piped = Strategy(((0, 1),), tuple(split), num_microbatches=4, schedule=Schedule.GPIPE)
    once = evaluate_pipeline(costed, split, schedule=Schedule.GPIPE, num_microbatches=4)
    assert simulate_strategy(costed, piped).replica_step_s == pytest.approx((once.step_time_s,))
    assert once.step_time_s > simulate_strategy(plain, piped).step_time_s


def test_a_concurrent_compute_table_of_another_device_count_fails_in_one_line() -> None:
    data = _calibrated()
    data["calibration"]["concurrent_compute"] = {"alone_s": [0.1], "together_s": 0.11}
    with pytest.raises(CatalogError, match="alone_s: gives 1 times for 2 devices"):
        parse_topology(data, origin="t")
    data["calibration"]["concurrent_compute"] = {"alone_s": [0.1, -1], "together_s": 0.11}
    with pytest.raises(CatalogError, match="concurrent_compute"):
        parse_topology(data, origin="t")
