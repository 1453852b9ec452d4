"""benchmarks.cluster_zoo: stage (de)serialisation, the predictions from given costs, the records
(and that benchmarks.run merges them), and one end-to-end run of a tiny MLP on two workers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import cluster_zoo as cz
from benchmarks.cluster_pipeline import LinkFit
from benchmarks.run import load_measured
from partitioner.core.ir import Phase, Schedule
from partitioner.simulation.pipeline import Stage, StageTransfer

REPO_ROOT = Path(__file__).resolve().parents[1]
FREE_LINK = LinkFit(latency_s=0.0, bandwidth_bytes_per_s=1e30, dispatch_s=0.0, samples=())


def two_stages(fwd_s: float, bwd_s: float, nbytes: int = 1000) -> tuple[Stage, Stage]:
    """Two identical stages, activations 0 -> 1 and gradients 1 -> 0 (whole-step times)."""
    return (
        Stage(0, 0, ("a",), fwd_s, bwd_s, 0, nbytes,
              (StageTransfer(0, 1, Phase.FORWARD, nbytes, (Phase.FORWARD,)),)),
        Stage(1, 1, ("b",), fwd_s, bwd_s, 0, nbytes,
              (StageTransfer(1, 0, Phase.BACKWARD, nbytes, (Phase.BACKWARD,)),)),
    )  # fmt: skip


def calibration(**over: object) -> cz.ZooCalibration:
    stages = two_stages(0.04, 0.08)
    base = cz.ZooCalibration(
        plan_json="{}", plan_solver="dp", plan_step_time_s=0.1, single_step_s=0.25,
        single_step_samples_s=(0.25, 0.26), single_cpu_share=0.99, single_compute_s=0.2,
        placed_compute_s=0.21, full_stages=stages, micro_stages=stages,
        device_update_s=(0.003, 0.005), device_accumulate_s=(0.001, 0.002), all_update_s=0.007,
        feed_bytes=4_000_000, profiled_layers=2, total_layers=2,
    )  # fmt: skip
    return replace(base, **over)  # type: ignore[arg-type]


def test_stage_round_trip_keeps_every_field() -> None:
    for stage in two_stages(0.5, 1.25, nbytes=12345):
        data = json.loads(json.dumps(cz.stage_to_dict(stage)))
        assert cz.stage_from_dict(data) == stage


def test_calibration_json_round_trip() -> None:
    cal = calibration()
    assert cz.calibration_from_json(cz.calibration_to_json(cal)) == cal


@pytest.mark.parametrize("schedule", [Schedule.GPIPE, Schedule.ONE_F_ONE_B])
def test_pipelined_prediction_is_the_two_stage_formula(schedule: Schedule) -> None:
    # identical stages, free link: (M + K - 1)(f + b) per step, plus update and client terms
    m, fwd, bwd = 4, 0.04, 0.08
    link = replace(FREE_LINK, dispatch_s=0.002)
    step, busy = cz.predict_pipelined(
        two_stages(fwd, bwd), link, schedule=schedule, num_microbatches=m,
        update_s=(0.003, 0.005), accumulate_s=(0.0, 0.0), feed_bytes=0,
    )  # fmt: skip
    assert step == pytest.approx((m + 1) * (fwd + bwd) / m + 0.005 + 0.002)
    assert busy == pytest.approx((fwd + bwd + 0.003, fwd + bwd + 0.005))


def test_accumulation_and_link_add_to_the_pipelined_step() -> None:
    m, fwd, bwd = 4, 0.04, 0.08

    def predict(
        link: LinkFit, accumulate_s: tuple[float, float], feed_bytes: int
    ) -> tuple[float, tuple[float, ...]]:
        return cz.predict_pipelined(
            two_stages(fwd, bwd), link, schedule=Schedule.GPIPE, num_microbatches=m,
            update_s=(0.0, 0.0), accumulate_s=accumulate_s, feed_bytes=feed_bytes,
        )  # fmt: skip

    free, _ = predict(FREE_LINK, (0.0, 0.0), 0)
    acc, busy = predict(FREE_LINK, (0.001, 0.001), 0)
    # each backward grows by (M - 1) additions: a whole stage's worth per device
    assert busy[0] == pytest.approx(fwd + bwd + (m - 1) * 0.001)
    assert acc > free
    slow = LinkFit(latency_s=1e-3, bandwidth_bytes_per_s=1e9, dispatch_s=0.0, samples=())
    linked, _ = predict(slow, (0.0, 0.0), 10**9)
    assert linked > free + 1.0  # feeding 1 GB at 1 GB/s alone takes a second


def test_predict_pipelined_needs_two_devices() -> None:
    with pytest.raises(ValueError, match="two devices"):
        cz.predict_pipelined(
            two_stages(0.1, 0.1), FREE_LINK, schedule=Schedule.GPIPE, num_microbatches=2,
            update_s=(0.1,), accumulate_s=(0.0, 0.0), feed_bytes=0,
        )  # fmt: skip


def test_single_and_placed_predictions() -> None:
    cal = calibration()
    link = LinkFit(latency_s=1e-4, bandwidth_bytes_per_s=2e9, dispatch_s=0.0015, samples=())
    assert cz.predict_single(cal) == pytest.approx(0.2 + 0.007)
    feed = 1e-4 + 4_000_000 / 2e9
    assert cz.predict_placed(cal, link) == pytest.approx(0.21 + 0.005 + feed + 0.0015)


def test_records_have_the_cluster_pipeline_shape_and_merge(tmp_path: Path) -> None:
    spec = cz.SPECS["lstm_nmt"]
    cal = calibration()
    rows = tuple(
        cz.Row(name, sched, m, measured, (measured,), predicted, None, (0.9, 0.8), (0.9, 0.8), 0.1)
        for name, sched, m, measured, predicted in (
            ("2 workers, placed", Schedule.NONE, 1, 0.3, 0.28),
            ("2 workers, GPipe M=4", Schedule.GPIPE, 4, 0.2, 0.19),
        )
    )
    recs = cz.records(cz.ModelResult(spec, cal, rows))
    pipeline_keys = {
        "model", "devices", "solver", "topology", "device_type", "batch_size",
        "num_microbatches", "measured_time_s", "predicted_time_s", "note",
    }  # fmt: skip
    assert set(recs[0]) == pipeline_keys - {"num_microbatches"}
    assert all(set(r) == pipeline_keys for r in recs[1:])
    assert [r["devices"] for r in recs] == [1, 2, 2]
    assert [r["solver"] for r in recs] == ["single", "dp", "dp"]
    assert recs[0]["predicted_time_s"] == pytest.approx(cz.predict_single(cal))
    assert all(r["model"] == spec.label and r["batch_size"] == spec.batch_size for r in recs)
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps({"records": recs}))
    merged = load_measured(path)
    assert [(r.model, r.devices, r.num_microbatches) for r in merged] == [
        (spec.label, 1, None),
        (spec.label, 2, 1),
        (spec.label, 2, 4),
    ]
    assert [r.measured_time_s for r in merged] == [0.25, 0.3, 0.2]


def test_specs_are_valid_and_label_their_size() -> None:
    for key, spec in cz.SPECS.items():
        assert spec.key == key
        assert spec.batch_size % spec.num_microbatches == 0
        assert spec.label.split()[0] == spec.builder.value
    with pytest.raises(ValueError, match="not divisible"):
        replace(cz.SPECS["mlp_tiny"], batch_size=33)


def test_make_data_token_ids_are_in_range() -> None:
    spec = replace(
        cz.SPECS["gpt_tiny"],
        kwargs=(("name", "t"), ("blocks", 1), ("d_model", 16), ("heads", 2), ("ffn", 32),
                ("seq", 8), ("vocab", 50), ("causal", True), ("pre_norm", True)),
    )  # fmt: skip
    model = spec.build()
    xs, y = cz.make_data(model, 3)
    assert [x.shape for x in xs] == [(3, 8), (3, 8)]
    assert all(0 <= x.min() and x.max() < 8 for x in xs)
    assert y.shape == (3, 8, 50)


def test_end_to_end_tiny_mlp_on_two_workers(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    out = tmp_path / "tiny.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "benchmarks.cluster_zoo", "--models", "mlp_tiny", "--steps", "2",
        "--warmup", "1", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    recs = json.loads(out.read_text())["records"]
    assert [r["note"] for r in recs] == [
        "1 process, 1 core",
        "2 workers, placed",
        "2 workers, GPipe M=2",
        "2 workers, 1F1B M=2",
    ]
    assert all(r["measured_time_s"] > 0 and r["predicted_time_s"] > 0 for r in recs)
    assert "2 workers, 1F1B M=2" in done.stdout


def test_the_readme_row_is_generated_from_the_json() -> None:
    """Each two-worker row's speed-up over one process and its prediction's error, per model;
    the README carries exactly the row the committed JSON gives (python -m benchmarks.readme)."""

    def rec(note: str, devices: int, measured: float, predicted: float) -> dict[str, object]:
        return {"model": "tiny 2 x Dense", "devices": devices, "note": note,
                "measured_time_s": measured, "predicted_time_s": predicted}  # fmt: skip

    doc = {"records": [
        rec("1 process, 1 core", 1, 0.200, 0.210),
        rec("2 workers, placed", 2, 0.250, 0.200),
        rec("2 workers, 1F1B M=4", 2, 0.125, 0.150),
    ]}  # fmt: skip
    line = cz.readme_row(doc)
    assert line.startswith(cz.README_ROW_START)
    assert "tiny placed 0.80x (-20%), 1F1B M=4 1.60x (+20%)" in line
    assert "one process predicted within 5%" in line
    repo = Path(__file__).resolve().parents[1]
    committed = json.loads((repo / "benchmarks/results/cluster_zoo.json").read_text("utf-8"))
    assert cz.readme_row(committed) in (repo / "README.md").read_text("utf-8").splitlines()
