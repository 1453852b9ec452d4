"""benchmarks.strategies: the predicted terms, the records, the winners and auto's place on given
numbers (no TensorFlow workers), the calibration's JSON, and one tiny end-to-end run (slow)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import collective_fit as cf
from benchmarks import strategies as st
from cost_models.estimate.collectives import all_reduce_s
from partitioner.core.errors import CatalogError
from partitioner.core.ir import AllReduceFit, EventKind, Schedule, TimelineEvent
from partitioner.core.strategy import Family, Strategy

REPO_ROOT = Path(__file__).resolve().parents[1]
FAMILIES = {f.value for f in Family}
TERMS = st.StepTerms(
    all_update_s=0.010,
    device_update_s={0: 0.004, 1: 0.006},
    client_s=0.003,
)


def row(
    key: str, strategy: str, predicted_s: float, measured_s: float | None, chosen: bool = False
) -> st.StrategyRow:
    return st.StrategyRow(
        model="m", key=key, strategy=strategy, label=key,
        predicted=st.Prediction(predicted_s, 0.0, 0.0, 0.0),
        measured_step_s=measured_s, chosen=chosen,
    )  # fmt: skip


def four_rows(auto: str = "data_parallel") -> list[st.StrategyRow]:
    rows = [
        row("single", "single", 1.00, 1.02),
        row("data_parallel", "data_parallel", 0.60, 0.62),
        row("placed", "placed", 1.05, 1.10),
        row("1f1b", "pipeline", 0.70, 0.66),
    ]
    return [r if r.key != auto else st.StrategyRow(**{**r.__dict__, "chosen": True}) for r in rows]


def test_prediction_is_the_sum_of_its_terms() -> None:
    p = st.Prediction(0.1, 0.02, 0.003, 0.005, linear_s=0.2)
    assert p.step_s == pytest.approx(0.128)


def test_one_stage_rows_update_everything_and_have_no_client() -> None:
    single = Strategy(((0,),), (0, 0, 0))
    dp = Strategy(((0,), (1,)), (0, 0, 0))
    assert st.predict_terms(single, 0.2, 0.0, TERMS) == st.Prediction(0.2, 0.0, 0.010, 0.0)
    assert st.predict_terms(dp, 0.1, 0.03, TERMS) == st.Prediction(0.1, 0.03, 0.010, 0.0)


def test_stage_rows_wait_for_the_slower_worker_and_the_client() -> None:
    placed = Strategy(((0, 1),), (0, 1, 1))
    pipe = Strategy(((0, 1),), (0, 1, 1), 4, Schedule.ONE_F_ONE_B)
    assert st.predict_terms(placed, 0.2, 0.0, TERMS) == st.Prediction(0.2, 0.0, 0.006, 0.003)
    p = st.predict_terms(pipe, 0.15, 0.0, TERMS)
    assert (p.replica_s, p.update_s, p.client_s) == pytest.approx((0.15, 0.006, 0.003))


def test_the_worker_scale_scales_the_core_terms_and_keeps_the_client_s() -> None:
    p = st.Prediction(0.2, 0.0, 0.01, 0.005, linear_s=0.3)
    scaled = p.on_workers(1.1)
    assert scaled.step_s == pytest.approx(1.1 * 0.21 + 0.005)
    assert scaled.linear_s == pytest.approx(1.1 * (0.3 - 0.005) + 0.005)
    assert scaled.on_workers(1.0) == st.Prediction(0.2, 0.0, 0.01, 0.005, linear_s=0.3)


def test_contention_slows_the_time_both_devices_compute() -> None:
    p = st.Prediction(0.2, 0.0, 0.01, 0.005, linear_s=0.3, both_busy_s=0.08)
    assert p.step_s == pytest.approx(0.215)  # no contention measured: the plain sum
    scaled = p.on_workers(1.1, 0.05)
    assert scaled.step_s == pytest.approx(1.1 * (0.21 + 0.05 * 0.08) + 0.005)
    assert scaled.linear_s == pytest.approx(1.1 * (0.3 - 0.005 + 0.05 * 0.08) + 0.005)
    assert scaled.on_workers(1.0, 0.0) == p


def test_contention_is_the_workers_together_over_the_slower_alone() -> None:
    rows: dict[str, st.Measured] = {}
    assert st.contention(st.ClusterMeasurement(rows, (0.40, 0.44), 0.462)) == pytest.approx(0.05)
    assert st.contention(st.ClusterMeasurement(rows, (0.40, 0.44), 0.43)) == 0.0
    assert st.contention(st.ClusterMeasurement(rows, (0.40, 0.44))) == 0.0


def test_both_busy_counts_compute_on_two_devices_at_once() -> None:
    fwd, bwd, send = EventKind.FORWARD, EventKind.BACKWARD, EventKind.TRANSFER
    timeline = [
        TimelineEvent("device 0", fwd, "a", 0.0, 4.0),
        TimelineEvent("device 0", bwd, "a", 1.0, 2.0),  # inside device 0's busy time
        TimelineEvent("link 0->1", send, "t", 1.0, 3.0),  # a link is no device
        TimelineEvent("device 1", fwd, "b", 2.0, 6.0),
        TimelineEvent("device 0", bwd, "a", 5.0, 5.5),
    ]
    assert st.both_busy_s(timeline) == pytest.approx(2.5)
    assert st.both_busy_s(timeline[:3]) == 0.0


def test_a_simulated_pipeline_has_both_stages_computing_at_once() -> None:
    from partitioner.core import ir
    from partitioner.simulation.strategy import simulate_strategy

    f, b = ir.Phase.FORWARD, ir.Phase.BACKWARD
    ops = (ir.Op("a/f", "X", "a", f), ir.Op("c/f", "X", "c", f), ir.Op("c/b", "X", "c", b))
    ops += (ir.Op("a/b", "X", "a", b),)
    edges = (ir.Edge("a/f", "c/f", 8), ir.Edge("c/f", "c/b", 8), ir.Edge("c/b", "a/b", 8))
    layers = (ir.LayerInfo("a", "Dense"), ir.LayerInfo("c", "Dense"))
    devices = tuple(ir.Device(d, "cpu", 1 << 30) for d in (0, 1))
    topo = ir.Topology(devices, ir.Link("free", 0.0, 1e15))
    memory = tuple(ir.LayerMemory(x, 0, 0, 0, 0) for x in "ac")
    costed = ir.CostedGraph(ir.Graph("two", ops, edges, layers, 8), topo, ((1.0,) * 4,) * 2, memory)
    pipe = simulate_strategy(costed, Strategy(((0, 1),), (0, 1), 4, Schedule.ONE_F_ONE_B))
    busy = st.both_busy_s(st._timeline(pipe, costed))
    assert 0 < busy < max(pipe.replica_step_s)
    plain = simulate_strategy(costed, Strategy(((0, 1),), (0, 1)))
    assert st.both_busy_s(st._timeline(plain, costed)) == 0.0  # a chain: one stage at a time


def test_the_worker_scale_is_the_references_over_the_single_prediction() -> None:
    single = st.Prediction(0.40, 0.0, 0.02, 0.0)
    # the whole model alone on the workers took 0.47 and 0.49 s, 0.01 s of it the client's
    assert st.worker_scale(single, 0.01, (0.47, 0.49)) == pytest.approx(0.47 / 0.42)
    assert st.worker_scale(single, 0.01, ()) == 1.0


def test_assembled_rows_scale_the_workers_rows_and_the_data_parallel_row_apart() -> None:
    pred = st.Prediction(0.4, 0.0, 0.02, 0.0)
    dp = st.Prediction(0.2, 0.1, 0.02, 0.0)
    pipe = st.Prediction(0.25, 0.0, 0.01, 0.01)
    scal = st.StrategyCalibration(
        zoo_json="{}",
        rows=(
            st.PlannedRow("single", "single", "1", 1, "none", (("a", 0),), pred),
            st.PlannedRow("data_parallel", "data_parallel", "dp", 1, "none", (("a", 0),), dp),
            st.PlannedRow("1f1b", "pipeline", "p", 4, "1f1b", (("a", 1),), pipe),
        ),
        auto_key="1f1b", auto_words="x", search_step_s=0.2,
    )  # fmt: skip
    measured = {k: st.Measured(0.5, (0.5,), (1.0,)) for k in ("single", "1f1b")}
    # one replica's step alone in the data-parallel processes: 0.33 s against 0.22 predicted
    measured["data_parallel"] = st.Measured(0.5, (0.5,), (1.0,), reference_s=(0.33,))
    cluster = st.ClusterMeasurement({"1f1b": measured["1f1b"]}, (0.43, 0.45), 0.45)
    rows = st.assemble_rows(st.SPECS["mlp_tiny"], scal, measured, cluster)
    scale = (0.44 - 0.01) / 0.42
    assert [r.predicted.worker_scale for r in rows] == pytest.approx([1.0, 1.5, scale])
    assert [r.predicted.contention for r in rows] == [0.0, 0.0, 0.0]  # together = the slower
    assert rows[1].predicted_step_s == pytest.approx(1.5 * 0.32)
    assert rows[2].predicted_step_s == pytest.approx(scale * 0.26 + 0.01)
    assert [r.worker_reference_s for r in rows] == [(), (0.33,), (0.43, 0.45)]
    assert st.records(rows)[2]["predicted_terms_s"]["worker_scale"] == pytest.approx(scale)
    table = st.format_table(rows)
    assert "in their rounds: 330.0 ms; that row scales its core terms by 1.500" in table
    assert "alone on each worker, timed in the workers' rounds: 430.0 and 450.0 ms" in table


def test_the_data_parallel_scale_leaves_the_all_reduce_out_of_the_reference() -> None:
    dp = st.Prediction(0.2, 0.1, 0.02, 0.0)
    assert st.dp_scale(dp, (0.242,)) == pytest.approx(1.1)
    assert st.dp_scale(dp, ()) == 1.0


def test_interleaved_timing_runs_every_step_once_a_round() -> None:
    calls: list[str] = []
    steps = {k: (lambda k=k: calls.append(k)) for k in ("a", "b")}
    timed = st.time_interleaved(steps, rounds=3, warmup=1, pids=[os.getpid()])
    assert calls == ["a", "b"] * 4
    assert [len(m.samples_s) for m in timed.values()] == [3, 3]
    assert all(m.step_s >= 0 and len(m.cpu_share) == 1 for m in timed.values())


def test_interleaved_timing_settles_untimed_before_every_step() -> None:
    calls: list[str] = []
    steps = {k: (lambda k=k: calls.append(k)) for k in ("a", "b")}

    def settle() -> None:
        calls.append("|")
        time.sleep(0.05)

    timed = st.time_interleaved(steps, rounds=2, warmup=1, pids=[os.getpid()], before_each=settle)
    assert calls == ["|", "a", "|", "b"] * 3
    assert all(t < 0.05 for m in timed.values() for t in m.samples_s)


def test_winners_agree_and_auto_is_measured_against_the_best() -> None:
    v = st.verdict(four_rows())
    assert (v.predicted_winner, v.measured_winner, v.winners_agree) == (
        "data_parallel", "data_parallel", True,
    )  # fmt: skip
    assert v.auto_label == "data_parallel" and v.auto_over_best == pytest.approx(1.0)
    assert v.worst_error == pytest.approx(abs(0.70 - 0.66) / 0.66)


def test_winners_disagree_and_auto_can_be_slower() -> None:
    rows = four_rows(auto="1f1b")
    rows[1] = row("data_parallel", "data_parallel", 0.80, 0.50)
    v = st.verdict(rows)
    assert (v.predicted_winner, v.measured_winner, v.winners_agree) == (
        "1f1b", "data_parallel", False,
    )  # fmt: skip
    assert v.auto_over_best == pytest.approx(0.66 / 0.50)
    text = st.format_table(rows, ["model: m"])
    assert "the same: NO" in text and "OUTSIDE the 1.05x target" in text


def test_unmeasured_rows_do_not_win_and_two_chosen_rows_are_refused() -> None:
    rows = [row("single", "single", 1.0, 1.0), row("auto", "pipeline", 0.5, None, chosen=True)]
    v = st.verdict(rows)
    assert v.measured_winner == "single" and v.auto_over_best is None
    assert v.winners_agree is False
    assert st.verdict([row("single", "single", 1.0, None)]).winners_agree is None
    with pytest.raises(ValueError, match="2 rows are marked chosen"):
        st.verdict([row("a", "single", 1, 1, True), row("b", "placed", 1, 1, True)])


def test_records_have_the_issue_keys_and_are_json() -> None:
    recs = st.records(four_rows())
    assert len(recs) == 4
    for rec in recs:
        assert {"model", "strategy", "predicted_step_s", "measured_step_s", "chosen"} <= set(rec)
        assert rec["strategy"] in FAMILIES
    assert [r["chosen"] for r in recs] == [False, True, False, False]
    assert recs[3]["error"] == pytest.approx((0.70 - 0.66) / 0.66)
    assert json.loads(json.dumps(recs)) == recs


def test_table_lists_every_row_with_speed_up_and_auto_mark() -> None:
    text = st.format_table(four_rows(), ["model: m"])
    lines = text.splitlines()
    assert lines[0] == "model: m"
    dp = next(line for line in lines if line.startswith("data_parallel"))
    assert "600.0" in dp and "620.0" in dp and "-3.2%" in dp and "1.65x" in dp
    assert dp.rstrip().endswith("auto")
    assert "the same: yes" in text and "within the 1.05x target" in text


def test_calibration_json_round_trip() -> None:
    pred = st.Prediction(0.1, 0.0, 0.01, 0.003, linear_s=0.12)
    cal = st.StrategyCalibration(
        zoo_json="{}",
        rows=(st.PlannedRow("1f1b", "pipeline", "x", 4, "1f1b", (("a", 0), ("b", 1)), pred),),
        auto_key="1f1b", auto_words="2 stages, 1F1B, 4 micro-batches", search_step_s=0.09,
        family_best=(("pipeline", 0.09, "2 stages"),),
        step_calibration=((4096, 1.12, 0.5), (512, 1.3, 0.07)),
    )  # fmt: skip
    assert st.StrategyCalibration.from_json(cal.to_json()) == cal


def test_auto_matches_a_row_by_how_it_runs() -> None:
    pipe = Strategy(((0, 1),), (0, 1), 4, Schedule.ONE_F_ONE_B)
    assert st.same_realisation(pipe, Strategy(((0, 1),), (0, 1), 4, Schedule.ONE_F_ONE_B))
    assert not st.same_realisation(pipe, Strategy(((0, 1),), (0, 1), 2, Schedule.ONE_F_ONE_B))
    assert not st.same_realisation(pipe, Strategy(((0, 1),), (0, 1), 4, Schedule.GPIPE))
    assert not st.same_realisation(pipe, Strategy(((0, 1),), (0, 0), 4, Schedule.ONE_F_ONE_B))
    assert st.same_realisation(Strategy(((0,),), (0, 0)), Strategy(((1,),), (0, 0)))
    assert not st.same_realisation(Strategy(((0,),), (0, 0)), Strategy(((0,), (1,)), (0, 0)))


def test_fixed_rows_from_a_two_device_plan() -> None:
    spec = st.SPECS["mlp_tiny"]
    plan = SimpleNamespace(pipeline=object(), num_devices=2, assignment={"a": 0, "b": 1})
    rows = st.row_strategies(spec, plan, ["a", "b"])
    assert [k for k, _, _ in rows] == ["single", "data_parallel", "placed", "gpipe", "1f1b"]
    assert [s.family for _, _, s in rows] == [
        Family.SINGLE, Family.DATA_PARALLEL, Family.PLACED, Family.PIPELINE, Family.PIPELINE,
    ]  # fmt: skip
    assert rows[4][2].num_microbatches == spec.num_microbatches
    assert rows[4][2].layer_devices(0) == (0, 1)
    unpiped = SimpleNamespace(pipeline=None, num_devices=2, assignment={"a": 0, "b": 1})
    assert [k for k, _, _ in st.row_strategies(spec, unpiped, ["a", "b"])] == [
        "single", "data_parallel",
    ]  # fmt: skip


def test_specs_cover_the_issue_models() -> None:
    assert set(st.DEFAULT_MODELS) <= set(st.SPECS)
    mlp = st.SPECS["mlp"]
    assert (mlp.batch_size, dict(mlp.kwargs)["depth"], dict(mlp.kwargs)["width"]) == (
        4096, 8, 1024,
    )  # fmt: skip
    assert all(s.batch_size % 2 == 0 for s in st.SPECS.values())  # two replicas split it


def test_the_collective_fit_recovers_a_line_and_round_trips() -> None:
    points = [(b, 2e-3 + b / 2e8) for b in cf.SIZES_BYTES]
    latency, bandwidth = cf.fit_latency_bandwidth(points)
    assert (latency, bandwidth) == pytest.approx((2e-3, 2e8))
    through_origin = cf.fit_latency_bandwidth([(1000, 1e-3), (2000, 4e-3)])
    assert through_origin[0] == 0.0 and through_origin[1] > 0  # a negative intercept is refitted
    with pytest.raises(CatalogError, match="2 or more sizes"):
        cf.fit_latency_bandwidth([(1000, 1e-3), (1000, 2e-3)])
    # a curve bending up at the largest size (as measured here): the relative fit keeps the
    # worst relative error below ordinary least squares', which the largest point drives
    bent = [(10**5, 4e-3), (10**6, 5.5e-3), (4 * 10**6, 18e-3), (16 * 10**6, 50e-3),
            (32 * 10**6, 115e-3), (64 * 10**6, 310e-3)]  # fmt: skip
    ols = statistics.linear_regression([b for b, _ in bent], [t for _, t in bent])
    lat, bw = cf.fit_latency_bandwidth(bent)

    def worst(a: float, per_byte: float) -> float:
        return max(abs((a + b * per_byte) / t - 1) for b, t in bent)

    assert worst(lat, 1 / bw) < worst(max(ols.intercept, 0.0), ols.slope)
    fit = cf.CollectiveFit(latency, bandwidth, tuple(points), ((1.0, 2.0),) * 6, "measured")
    assert cf.CollectiveFit.from_json_dict(json.loads(json.dumps(fit.to_json_dict()))) == fit
    assert fit.to_ir() == AllReduceFit(latency, bandwidth, 2, "measured")


def test_the_strategy_topology_carries_the_fit_into_the_all_reduce() -> None:
    link = st.LinkFit(1e-5, 1e10, 1e-4, ())
    fit = AllReduceFit(3e-3, 1e8, 2, "measured")
    assert st.strategy_topology(link, None).all_reduce is None
    topology = st.strategy_topology(link, fit)
    assert all_reduce_s(topology, (0, 1), 10**7) == pytest.approx(3e-3 + 0.1)
    assert all_reduce_s(st.strategy_topology(link, None), (0, 1), 10**7) < 0.01


@pytest.mark.slow
def test_end_to_end_tiny_mlp(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    out = tmp_path / "strategies.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "benchmarks.strategies", "--models", "mlp_tiny", "--steps", "2",
        "--warmup", "1", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    recs = doc["records"]
    fit = doc["all_reduce_fit"]
    assert fit["latency_s"] >= 0 and fit["bandwidth_bytes_per_s"] > 0
    assert [b for b, _ in fit["points"]] == list(cf.SIZES_BYTES)
    keys = [r["key"] for r in recs]
    # the plan's rows exist when partition() made a two-device pipeline of the tiny model
    # (noisy profiles on a busy machine can put it on one device)
    fixed = ["single", "data_parallel", "placed", "gpipe", "1f1b"]
    assert keys[:5] == fixed or (keys[:2] == fixed[:2] and "1f1b" not in keys), done.stdout
    assert sum(r["chosen"] for r in recs) == 1
    assert all(r["strategy"] in FAMILIES for r in recs)
    assert all(r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 for r in recs)
    # the data-parallel processes timed a replica's step alone beside their own
    dp = recs[1]
    assert len(dp["worker_reference_s"]) == 1 and dp["worker_reference_s"][0] > 0
    assert dp["predicted_terms_s"]["worker_scale"] == pytest.approx(
        st.dp_scale(st.Prediction(**dp["predicted_terms_s"]), dp["worker_reference_s"])
    )
    for r in recs:  # (the tiny model's stages may never compute at once: the link dominates)
        terms = r["predicted_terms_s"]
        assert 0 <= terms["both_busy_s"] <= terms["replica_s"] and terms["contention"] >= 0
    assert "predicted winner:" in done.stdout


def test_the_readme_row_is_the_json_s_verdicts() -> None:
    rows = four_rows(auto="1f1b")
    doc = {"records": st.records(rows), "wall_time_s": 90.0}
    assert [st.row_of_record(r) for r in doc["records"]] == [
        st.StrategyRow(**{**r.__dict__, "samples_s": (), "cpu_share": ()}) for r in rows
    ]
    line = st.readme_row(doc)
    assert line.startswith(st.README_ROW_START) and "(1.5 min)" in line
    # data parallel wins by prediction (0.60) and by measurement (0.62)
    assert "predicted winner = measured winner on 1 of 1 (m)" in line
    assert "within 1.05x of the best measured row on 0 of 1: m 1.06x (1f1b)" in line
    assert "data parallel -3.2%; placed -4.5%; pipeline +6.1%; 4 of 4 rows within 15%" in line
