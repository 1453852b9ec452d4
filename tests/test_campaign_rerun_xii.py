"""Hostile input III (issue 34), campaign 34u (round 21): the defects found, each at its
mechanism."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.errors import CatalogError, PlanError, UsageError
from partitioner.core.files import default_cache_dir

REPO = Path(__file__).resolve().parents[1]
MNIST = REPO / "examples" / "mnist_mlp.py"
DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _partition(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Any:
    """``partition ARGS`` as a user runs it, in ``tmp_path``, with a cache of its own."""
    environment = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PARTITIONER_CACHE_DIR": str(tmp_path / "cache"),
    }
    environment.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "partitioner", *args],
        capture_output=True, text=True, env=environment, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip


def _mlp(hidden_dtype: str | None = None) -> keras.Model:
    inputs = keras.Input((16,), name="x")
    hidden = keras.layers.Dense(32, name="a", dtype=hidden_dtype)(inputs)
    return keras.Model(inputs, keras.layers.Dense(4, name="b")(hidden), name="mlp")


@pytest.mark.parametrize("job", ["my job", "w'\"\n);x", "1worker"])
def test_a_topology_job_tensorflow_cannot_use_is_refused(job: str) -> None:
    """Campaign 34u a (D1): a topology file's ``job`` was checked only for ``/`` and ``:``; a job
    with a space or quotes planned with exit 0 and the emitted module failed in TensorFlow with a
    traceback ("unknown device"). It is checked as a cluster's jobs are (row 96)."""
    from cost_models.devices.topology import parse_topology

    data = {"job": job, "devices": [{"type": "cpu"}, {"type": "cpu"}]}
    with pytest.raises(CatalogError, match="is not a TensorFlow job name"):
        parse_topology(data, origin="topology t.json")
    assert (
        parse_topology({**data, "job": " trainer_2 "}, origin="t")
        .devices[0]
        .name.startswith("/job:trainer_2/")
    )


def test_plan_save_refuses_the_cache_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign 34u a (D2): ``plan.save("cache/layers")`` made a file where the profile cache's
    folder belongs (every later profiled run: "not a directory", nothing cached), and
    ``plan.save("cache/traces/x.json")`` wrote among the trace cache's entries. ``Plan.save``
    refuses them as ``--out`` does (rows 168, 184): one check,
    :func:`partitioner.core.files.check_outside_kept_files`."""
    monkeypatch.setenv("PARTITIONER_CACHE_DIR", str(tmp_path / "pc"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pc" / "traces").mkdir(parents=True)
    plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, compare_strategies=False)
    for path in ("pc/layers", "pc/traces/x.json", tmp_path / "pc" / "layers"):
        with pytest.raises(UsageError, match=r"is in the (profile|trace) cache .*give a path"):
            plan.save(path)
    assert not (tmp_path / "pc" / "layers").exists()
    assert plan.save("pc/plan.json").is_file()  # the cache directory itself holds other files


def test_a_home_that_does_not_exist_is_not_made_for_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Campaign 34u a (D3): with ``HOME`` a directory that does not exist (a service account's
    ``/nonexistent``), ``--profile`` made the home and ``.cache/partitioner/layers`` under it,
    every parent, without a word. There is no default cache then: the run measures and says the
    cache is not written."""
    from cost_models.measure.profiled import cache_write_problem

    monkeypatch.delenv("PARTITIONER_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "nohome" / "deep"))
    with pytest.raises(RuntimeError, match="does not exist"):
        default_cache_dir()
    problem = cache_write_problem(None)
    assert problem is not None and "set PARTITIONER_CACHE_DIR" in problem
    monkeypatch.setenv("HOME", "")  # no home either (it was /.cache)
    with pytest.raises(RuntimeError):
        default_cache_dir()
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "partitioner"


@pytest.mark.slow
def test_a_profiled_run_without_a_home_makes_no_directory(tmp_path: Path) -> None:
    """The same through the command line: a plan, a warning, and no cache directory made (the
    cache is decided before Keras is imported, which makes the home for its ``~/.keras``)."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("PARTITIONER_CACHE_DIR", "XDG_CACHE_HOME")
    }
    env.update(HOME=str(tmp_path / "nohome" / "deep"), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "partitioner", str(MNIST), "--gpus", "2", "--device-type", "cpu",
         "--profile", "--batch-size", "8", "--no-strategies", "--out", "p.json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "does not exist; set PARTITIONER_CACHE_DIR to cache" in done.stderr
    # Keras's import makes ~/.keras (and the home with it); the run adds nothing there.
    assert not (tmp_path / "nohome" / "deep" / ".cache").exists()


@pytest.mark.parametrize("policy", ["float64", "mixed_float16"])
def test_a_plan_refuses_a_layer_in_another_precision(policy: str) -> None:
    """Campaign 34u b (A): a float32 plan applied, without a word, to the model with one layer
    in ``float64`` (its weights twice the bytes) or under ``mixed_float16`` (another compute
    precision): the fingerprint records each layer's dtype policy."""
    plan = partitioner.partition(_mlp(), gpus=2, batch_size=8, compare_strategies=False)
    again = type(plan).from_json_dict(json.loads(plan.to_json()))
    for made in (plan, again):
        with pytest.raises(
            PlanError, match=rf"layer 'a' runs in {policy} here, but the plan was made for float32"
        ):
            made.apply(_mlp(policy), devices=DEVICES)
    assert plan.apply(_mlp(), devices=DEVICES) is not None


def test_a_strategy_asked_for_is_not_called_the_fastest() -> None:
    """Campaign 34u b (B): ``--strategy data-parallel`` on the MNIST MLP said "Fastest predicted
    strategy: 2 data-parallel replicas (465.7 us)" beside one device at 350.6 us and the even
    split at 338.2 us. The strategy asked for is called that, and the faster plan is named."""
    from examples.mnist_mlp import build_model

    plan = partitioner.partition(build_model(), gpus=2, batch_size=32, strategy="data-parallel")
    advice = " ".join(plan.advice)
    assert "Fastest predicted strategy" not in advice
    assert "Strategy asked for: 2 data-parallel replicas" in advice
    faster = min(b.step_time_s for b in plan.baselines if b.step_time_s is not None)
    assert faster < plan.step_time_s  # the case of the campaign: one device or a split is faster
    assert "Predicted faster than the strategy asked for" in advice
    auto = partitioner.partition(build_model(), gpus=2, batch_size=32)
    assert "Strategy asked for" not in " ".join(auto.advice)


def test_the_lower_bound_is_below_every_plan_the_report_lists() -> None:
    """Campaign 34u b (C): ``--pipeline`` on the MNIST MLP printed "lower bound 1.395 ms" (the
    micro-batched configuration's) above the unpipelined split (338.2 us) and one device
    (350.6 us) it listed, ratios 0.24x "vs lower bound". The plan's bound holds for every row."""
    from examples.mnist_mlp import build_model

    for options in ({"pipeline": True}, {"strategy": "pipeline"}, {}):
        plan = partitioner.partition(build_model(), gpus=2, batch_size=32, **options)
        steps = [b.step_time_s for b in plan.baselines if b.step_time_s is not None]
        steps += [r.step_time_s for r in plan.strategies if r.fits]
        assert plan.lower_bound_s <= min([plan.step_time_s, *steps]), options
        assert plan.lower_bound_s > 0


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_reported_after_the_model_printed(tmp_path: Path) -> None:
    """Campaign 34u c (D1): once the model's code had printed a line, ``partition ... >/dev/full``
    exited 0 with nothing on stderr: the failed flush of the model's line pointed the saved
    stdout at /dev/null, and the report went there. The model's prints go through a copy of
    their own; the report's failure is one line, status 2 (row 68)."""
    model = tmp_path / "printing.py"
    model.write_text(
        "import keras\nprint('hello from the model')\n\ndef build_model():\n"
        "    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, name='d')])\n"
    )
    with open("/dev/full", "w") as full:
        environment = {**os.environ, "PYTHONPATH": str(REPO)}
        environment["PARTITIONER_CACHE_DIR"] = str(tmp_path / "cache")
        done = subprocess.run(
            [sys.executable, "-m", "partitioner", str(model), "--gpus", "2", "--out", "p.json"],
            stdout=full, stderr=subprocess.PIPE, text=True, env=environment, cwd=tmp_path,
            timeout=600, check=False,
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "cannot print the report on stdout (No space left on device)" in done.stderr
    assert (tmp_path / "p.json").is_file()
