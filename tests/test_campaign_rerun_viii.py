"""Hostile input III (issue 34), campaign 34i: the defects its rerun found, each at its
mechanism.

- A pipeline plan file whose micro-batch count was edited (in both blocks, so they agree) kept
  the simulated timeline of the old count: shown with those predictions, applied with the new
  count. The timeline must simulate the micro-batches the plan runs.
- A plan file's device memory or memory limit of 0 bytes was shown and applied, where the planner
  refuses a memory of 0 (topology files, ``--memory-limit``).
- ``partition calibrate --timeout 1e-320`` was accepted and blamed the running workers; a
  timeout shorter than any task can answer in is refused, naming the flag, and a connect that
  ran out of time on tasks that all take connections says so instead of blaming them.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from partitioner.core.errors import PlanError, UsageError
from partitioner.plan.model import Plan, load_plan
from tests.test_plan_consistency_vii import _written


@pytest.fixture(scope="module")
def pipelined(mlp: Any) -> Plan:
    """A pipeline of 2 micro-batches over two devices, with its simulated timeline."""
    import partitioner

    return partitioner.partition(
        mlp,
        gpus=2,
        batch_size=16,
        solver="even",
        compare_strategies=False,
        pipeline=True,
        num_microbatches=2,
    )


def _microbatches(count: int) -> Any:
    def change(data: dict[str, Any]) -> None:
        data["strategy"]["num_microbatches"] = count
        data["pipeline"]["num_microbatches"] = count

    return change


def test_a_timeline_of_other_micro_batches_than_the_plan_runs_is_refused(
    pipelined: Plan, tmp_path: Path
) -> None:
    assert pipelined.pipeline is not None and pipelined.pipeline.num_microbatches == 2
    assert {e.microbatch for e in pipelined.timeline} == {0, 1}
    assert load_plan(pipelined.save(tmp_path / "same.json")).timeline == pipelined.timeline
    path = _written(pipelined, tmp_path, _microbatches(4))
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert message.startswith(f"{path}: field 'timeline' simulates micro-batches 0, 1 (2 of them)")
    assert "the plan runs 4 micro-batch(es)" in message and "\n" not in message
    # without a timeline there is nothing to disagree with
    bare = _written(pipelined, tmp_path, lambda d: (_microbatches(4)(d), d.pop("timeline")), "b")
    assert load_plan(bare).pipeline.num_microbatches == 4  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda d: d["devices"][1].update(memory_bytes=0), "devices[1].memory_bytes"),
        (lambda d: d["predicted"].update(memory_limit_bytes=[0, 0]),
         "predicted.memory_limit_bytes[0]"),
    ],
)  # fmt: skip
def test_a_memory_of_zero_bytes_in_a_plan_file_is_refused(
    plan: Plan, tmp_path: Path, edit: Any, field: str
) -> None:
    path = _written(plan, tmp_path, edit)
    with pytest.raises(PlanError, match=re.escape(f"field '{field}' must be >= 1, got 0")):
        load_plan(path)
    assert json.loads(path.read_text())["devices"][0]["memory_bytes"] > 0


def test_a_timeout_too_short_to_answer_in_is_refused_by_name() -> None:
    from passes.cluster.calibrate import MIN_TIMEOUT_S, CalibrationOptions, check_timeout_s

    for value in (1e-320, 0.001, MIN_TIMEOUT_S / 2):
        with pytest.raises(UsageError, match=r"timeout_s=.* is less than 0\.1 seconds"):
            check_timeout_s("timeout_s", value)
    assert check_timeout_s("timeout_s", MIN_TIMEOUT_S) == MIN_TIMEOUT_S
    with pytest.raises(UsageError, match="step_timeout_s"):
        CalibrationOptions(step_timeout_s=0.01).check()


def test_a_connect_out_of_time_on_answering_tasks_names_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every task takes a connection but the devices did not come in time: the message names
    the bound, not the tasks."""
    from passes.cluster import runtime
    from passes.cluster.runtime import ClusterError

    spec = runtime.load_cluster({"worker": ["127.0.0.1:1", "127.0.0.1:2"]})
    monkeypatch.setattr(runtime, "probe_tasks", lambda _spec: ())
    monkeypatch.setattr(runtime, "_bounded", lambda *_args: None)
    monkeypatch.setattr(runtime.tf.config, "experimental_connect_to_cluster", lambda _spec: None)
    with pytest.raises(ClusterError) as info:
        runtime._connect_and_list(spec, 0.2)
    message = str(info.value)
    assert "accepts connections" in message and "timeout_s=0.2 s" in message
    assert "check that every task" not in message


def test_watching_opens_sees_a_read_no_audit_hook_sees(tmp_path: Path) -> None:
    """Another process (as TensorFlow's C++ file layer) reading a watched file is noted; files
    not opened, and paths that do not exist yet, are not."""
    import subprocess

    from partitioner.cli.watch import watching_opens

    read, left = tmp_path / "vocab.txt", tmp_path / "other.txt"
    read.write_text("a\nb\n")
    left.write_text("c\n")
    seen: set[str] = set()
    with watching_opens([str(read), str(left), str(tmp_path / "new.json")], seen):
        subprocess.run(["cat", str(read)], capture_output=True, check=True)
    assert seen == {os.path.realpath(read)}


MODEL_READING_THROUGH_TF = """
import keras
import tensorflow as tf

WORDS = tf.io.gfile.GFile("vocab.txt").read().split()


def build_model():
    inputs = keras.Input((4,), dtype="string")
    ids = keras.layers.StringLookup(vocabulary="words.txt", output_mode="one_hot")(inputs)
    x = keras.layers.Flatten()(ids)
    return keras.Model(inputs, keras.layers.Dense(2)(keras.layers.Dense(8)(x)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("option", ["--out", "--report"])
def test_an_output_the_model_read_through_tensorflow_is_not_replaced(
    tmp_path: Path, option: str
) -> None:
    """Campaign 34i a (N01, N03): files read by ``tf.io.gfile`` and by a ``StringLookup``'s
    vocabulary (TensorFlow's C++ file layer, which no audit hook sees) are refused as outputs."""
    import subprocess
    import sys

    (tmp_path / "m.py").write_text(MODEL_READING_THROUGH_TF)
    (tmp_path / "vocab.txt").write_text("x y\n")
    (tmp_path / "words.txt").write_text("a\nb\nc\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    for target in ("vocab.txt", "words.txt"):
        before = (tmp_path / target).read_bytes()
        run = subprocess.run(
            [sys.executable, "-m", "partitioner", "m.py", "--gpus", "2", "--batch-size", "8",
             option, target],
            capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
        )  # fmt: skip
        assert run.returncode == 2, run.stderr
        assert f"{option} {target} exists and is not a file partitioner wrote" in run.stderr
        assert (tmp_path / target).read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.py", "vocab.txt", "words.txt"]


def test_a_plan_file_of_too_many_values_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """Campaign 34i a (N16, L7): a plan file under the size bound holding tens of millions of
    numbers took 30-45 s and 2.8 GB before its error; values are counted before parsing."""
    from partitioner.core.jsonfiles import MAX_VALUES

    bomb = tmp_path / "numbers.json"
    bomb.write_text('{"x": [' + "0," * MAX_VALUES + "0]}")
    with pytest.raises(PlanError, match=rf"holds about {MAX_VALUES + 1} values, more than"):
        load_plan(bomb)


def test_too_few_devices_for_a_family_tells_a_cpu_cluster_to_add_tasks(mlp: Any) -> None:
    """Campaign 34i c (D2): one CPU task with --strategy pipeline was told --gpus 2, which a
    CPU task refuses (one device per task): the advice names the tasks too."""
    import partitioner

    with pytest.raises(UsageError) as info:
        partitioner.partition(mlp, gpus=1, batch_size=8, strategy="pipeline")
    message = str(info.value)
    assert "gpus=2 or more" in message and "each task is one device: run 2 tasks" in message
