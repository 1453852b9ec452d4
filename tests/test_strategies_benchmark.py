"""benchmarks.strategies: rows, winners, the table, the records and the README row from
given numbers, the model set, the plan-file reader and planning command on a written plan (no
workers, no TensorFlow); and one end-to-end --quick run on two loopback workers (slow, about
40 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import cluster_zoo as cz
from benchmarks import readme
from benchmarks import strategies as st


def plan(
    family: str, predicted_s: float | None, chosen: str | None = None, error: str | None = None
) -> st.PlanOutcome:
    return st.PlanOutcome(
        family=family,
        path=None if error else f"/tmp/{family}.json",
        wall_s=1.0,
        error=error,
        predicted_step_s=predicted_s,
        chosen_family=chosen or (None if family == st.AUTO else family),
        description=f"{family} plan",
        table_step_s={"single": 0.100, "data-parallel": 0.060} if family == st.AUTO else None,
    )


PLANS = {
    "single": plan("single", 0.100),
    "data-parallel": plan("data-parallel", 0.060),
    "placed": plan("placed", 0.110),
    "pipeline": plan("pipeline", 0.080),
    "auto": plan("auto", 0.060, chosen="data-parallel"),
}
SAMPLES = {
    "single": [0.100, 0.102, 0.098],
    "data-parallel": [0.070, 0.071, 0.069],
    "placed": [0.120, 0.119, 0.121],
    "pipeline": [0.075, 0.074, 0.200],
    "auto": [0.072, 0.070, 0.071],
}


def rows() -> list[st.Row]:
    return st.make_rows("m", PLANS, SAMPLES, {})


def test_rows_take_the_median_and_mark_autos_choice() -> None:
    by = {r.strategy: r for r in rows()}
    assert list(by) == [*st.FAMILIES, st.AUTO]
    assert by["pipeline"].measured_step_s == pytest.approx(0.075)
    assert by["data-parallel"].chosen and by["auto"].chosen and not by["single"].chosen
    assert by["data-parallel"].error_pct == pytest.approx(100 * (0.060 - 0.070) / 0.070)
    assert by["single"].auto_table_step_s == pytest.approx(0.100)
    assert by["placed"].auto_table_step_s is None
    assert all(r.auto_chose == "data-parallel" for r in by.values())


def test_verdict_compares_the_predicted_winner_with_the_measured_one() -> None:
    v = st.verdict(rows())
    assert (v.auto_family, v.predicted_winner, v.measured_winner) == (
        "data-parallel",
        "data-parallel",
        "data-parallel",
    )
    assert v.predicted_is_measured and v.auto_is_measured
    assert v.auto_measured_over_best == pytest.approx(0.071 / 0.070)


def test_a_wrong_prediction_says_no_and_a_failed_family_is_a_row() -> None:
    plans = {**PLANS, "pipeline": plan("pipeline", None, error="partition exit 2: refused")}
    samples = {**SAMPLES, "single": [0.050]}
    got = st.make_rows("m", plans, samples, {"placed": "apply: ValueError: bad"})
    v = st.verdict(got)
    assert v.measured_winner == "single" and v.predicted_is_measured is False
    text = st.format_table(got, "m")
    assert "pipeline: FAILED: partition exit 2: refused" in text
    assert "placed: FAILED: apply: ValueError: bad" in text
    assert "predicted = measured NO" in text and "auto = measured NO" in text


def test_table_and_summary_and_records() -> None:
    text = st.format_table(rows(), "m: a model")
    lines = text.splitlines()
    assert lines[0] == "m: a model" and lines[1].split()[0] == "family"
    dp = next(line for line in lines if line.startswith("data-parallel"))
    assert "60.0" in dp and "70.0" in dp and "-14.3%" in dp and "chosen" in dp
    assert "auto measured / best measured 1.01x" in lines[-1]
    assert "predicted winner = measured winner on 1" in st.summary(rows())
    recs = json.loads(json.dumps(st.records(rows())))
    assert {r["strategy"] for r in recs} == {*st.FAMILIES, st.AUTO}
    first = recs[0]
    for key in ("model", "strategy", "predicted_step_s", "measured_step_s", "chosen", "error_pct"):
        assert key in first
    assert first["samples_s"] == SAMPLES["single"]


def test_no_measurement_gives_no_winner() -> None:
    got = st.make_rows("m", PLANS, {}, {})
    v = st.verdict(got)
    assert v.measured_winner is None and v.predicted_is_measured is None
    assert v.auto_measured_over_best is None
    assert "auto measured / best measured -" in st.format_table(got)


def test_read_plan_and_the_planning_command(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    strategies = [
        {"family": "data_parallel", "step_time_s": 0.5},
        {"family": "single", "step_time_s": 0.9},
    ]
    path.write_text(
        json.dumps(
            {
                "predicted": {"step_time_s": 0.5},
                "strategy": {"family": "data_parallel", "description": "2 replicas"},
                "strategies": strategies,
            }
        )
    )
    got = st.read_plan("auto", path, 3.0)
    assert got.predicted_step_s == 0.5 and got.chosen_family == "data-parallel"
    assert got.table_step_s == {"data-parallel": 0.5, "single": 0.9}
    cmd = st.plan_command(Path("m.py"), Path("t.json"), 64, "pipeline", Path("o.json"))
    tail = cmd[cmd.index("m.py") :]
    assert tail == [
        "m.py", "--topology", "t.json", "--profile-ops", "--batch-size", "64",
        "--optimizer", "sgd", "--strategy", "pipeline", "--out", "o.json",
    ]  # fmt: skip


def test_every_model_source_has_build_model_and_the_options_parse() -> None:
    for spec in st.SPECS.values():
        assert "def build_model():" in spec.source
        compile(spec.source, spec.name, "exec")
    args = st.parse_args(["--quick"])
    assert [s.name for s in args.specs] == list(st.QUICK_MODELS) and args.rounds == 5
    args = st.parse_args([])
    assert [s.name for s in args.specs] == list(st.DEFAULT_MODELS) and args.rounds == 10
    args = st.parse_args(["--models", "conv_net,wide_mlp", "--rounds", "3"])
    assert [s.name for s in args.specs] == ["conv_net", "wide_mlp"] and args.rounds == 3
    with pytest.raises(SystemExit):
        st.parse_args(["--models", "nope"])


@pytest.mark.slow
def test_end_to_end_quick(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    out = tmp_path / "st.json"
    cmd = [
        sys.executable, "-m", "benchmarks.strategies", "--quick", "--rounds", "1",
        "--warmup", "1", "--json", str(out),
    ]  # fmt: skip
    done = subprocess.run(
        cmd, cwd=st.REPO_ROOT, env=st.child_env(), capture_output=True, text=True, timeout=400
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["topology"]["calibration"]["tool"] == "partition calibrate"
    recs = doc["records"]
    assert [r["strategy"] for r in recs] == [*st.FAMILIES, st.AUTO]
    assert all(r["error"] is None for r in recs), recs
    assert all(r["measured_step_s"] > 0 and r["predicted_step_s"] > 0 for r in recs)
    assert sum(r["chosen"] for r in recs) == 2  # auto's row and the family it chose
    assert "auto measured / best measured" in done.stdout


def test_the_default_set_is_the_four_zoo_models_and_three_more() -> None:
    assert st.DEFAULT_MODELS[:4] == st.ZOO_DEFAULT_MODELS == (
        "mlp", "multi_tower", "gpt_tiny", "lstm_nmt",
    )  # fmt: skip
    assert set(st.DEFAULT_MODELS[4:]) == {"conv_net", "recommender", "wide_mlp"}
    assert len(set(st.DEFAULT_MODELS)) == 7
    # the zoo models at their sizes: cluster_zoo's as they are, and the MLP
    assert {k: v for k, v in st.ZOO_SPECS.items() if k != "mlp"} == dict(cz.SPECS)
    assert "mlp_tiny" in st.ZOO_SPECS and "mlp_tiny" in st.SPECS
    mlp = st.ZOO_SPECS["mlp"]
    assert mlp.builder is cz.ZooBuilder.MLP and (mlp.batch_size, mlp.num_microbatches) == (4096, 8)
    assert dict(mlp.kwargs) == {"width": 1024, "depth": 8, "features": 1024}
    for key in st.ZOO_DEFAULT_MODELS:
        spec, zoo = st.SPECS[key], st.ZOO_SPECS[key]
        assert (spec.batch_size, spec.description, spec.input_shape) == (
            zoo.batch_size,
            zoo.label,
            None,
        )
        # the model file builds the zoo model (not called: no TensorFlow)
        namespace: dict[str, object] = {}
        exec(compile(spec.source, f"{key}.py", "exec"), namespace)
        build_model = namespace["build_model"]
        assert callable(build_model)
        assert build_model.__globals__["ZOO_SPECS"] is st.ZOO_SPECS  # type: ignore[attr-defined]
        assert f"ZOO_SPECS[{key!r}].build()" in spec.source
    assert st.QUICK_MODELS == ("small_mlp",)


def test_own_models_get_their_batch_from_the_spec() -> None:
    class Model:
        output_shape = (None, 10)

    x, y = st.batch(st.SPECS["recommender"], Model())
    assert x.shape == (1024, 16) and x.dtype.name == "int32" and x.max() < 200_000
    assert y.shape == (1024, 10)
    x, _ = st.batch(st.SPECS["small_mlp"], Model())
    assert x.shape == (256, 256) and x.dtype.name == "float32" and 0 <= x.min() and x.max() < 1


def doc() -> dict[str, Any]:
    second = {**SAMPLES, "single": [0.050], "auto": [0.080]}
    recs = st.records(rows()) + st.records(st.make_rows("n", PLANS, second, {}))
    out: dict[str, Any] = json.loads(json.dumps({"records": recs, "wall_time_s": 600.0}))
    return out


def test_records_read_back_into_rows() -> None:
    got = [st.row_of_record(rec) for rec in doc()["records"]]
    assert got[: len(rows())] == rows()


def test_readme_row_counts_models_winners_auto_and_errors() -> None:
    row = st.readme_row(doc())
    assert row.startswith(st.README_ROW_START) and row.endswith(" |")
    assert row.count(" | ") == 2
    assert "(10.0 min)" in row
    timed = {**doc(), "calibrate_wall_s": 29.6}
    assert "(10.0 min; `partition calibrate` 30 s)" in st.readme_row(timed)
    result = row.split(" | ")[-1]
    assert "2 models (m, n)" in result
    # m: data-parallel predicted and measured; n: single measured fastest, not predicted
    assert "predicted winner = measured winner on 1 of 2 (m)" in result
    assert "`auto`'s choice on 1 of 2" in result
    # auto over best: m 1.01x, n 0.080 / 0.050 = 1.6x
    assert "within 1.05x of the best measured family on 1 of 2" in result
    # m: single 0%, data-parallel -14%, placed -8%, pipeline +7%; n: single +100%, rest as m
    assert "7 of 8 family rows predicted within 15%" in result
    assert "worst error +100% (n single)" in result and "failed" not in result
    broken = doc()
    broken["records"][1]["error"] = "partition exit 1: refused"
    assert st.readme_row(broken).endswith("; failed: m data-parallel |")


def test_readme_option_prints_the_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "st.json"
    path.write_text(json.dumps(doc()))
    assert st.main(["--readme", str(path)]) == 0
    assert capsys.readouterr().out == st.readme_row(doc()) + "\n"


def test_the_readme_gets_the_row_from_the_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    text = "\n".join(
        [
            "| what | command | result |",
            "|---|---|---|",
            st.README_ROW_START + " x |",
            "| other |",
        ]
    )
    path = tmp_path / "strategies.json"
    path.write_text(json.dumps(doc()))
    monkeypatch.setattr(readme, "STRATEGIES_JSON", path)
    once = readme.with_strategies_row(text)
    lines = once.split("\n")
    assert lines[2] == st.readme_row(doc()) and lines[3] == "| other |"
    assert readme.with_strategies_row(once) == once
    with pytest.raises(ValueError, match="0 rows"):
        readme.with_strategies_row("| other |")


def test_the_readme_row_is_the_recorded_runs() -> None:
    """README.md's row is the one ``benchmarks/results/strategies.json`` gives."""
    text = (st.REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.with_strategies_row(text) == text
