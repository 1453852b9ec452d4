"""Hostile input III (issue 34, campaign 34f): a plan file is checked for consistency, not only
shape.

A plan file whose ``strategy`` and ``pipeline`` blocks disagree (schedule, or a pipelined
strategy without its pipeline), whose fingerprint leaves out a layer it places, whose batch does
not divide by its replicas and micro-batches, or whose devices are one TensorFlow device spelled
twice is refused when it is loaded (``load_plan``, ``partition show``), in one line naming the
file, the fields and both values. ``Plan.save`` refuses to replace a binary file, as the CLI does.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from partitioner.core.errors import OutputError
from partitioner.plan.model import Plan, load_plan, plan_digest
from tests.test_campaign_rerun_v_plans import _refused, _show

cli = importlib.import_module("partitioner.cli.main")  # the module, not its main()

Edit = Callable[[dict[str, Any]], None]


def _written(plan: Plan, tmp_path: Path, change: Edit, name: str = "edited") -> Path:
    """``plan`` saved, read back as JSON, changed by ``change`` and written to ``name``.json
    with the digest of the change (a file written so: what is checked is its figures, and an
    edit the specific checks miss is refused by the digest instead)."""
    saved = plan.save(tmp_path / "saved.json")
    data = json.loads(saved.read_text(encoding="utf-8"))
    change(data)
    data["digest"] = plan_digest(data)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def _pipelined(schedule: str = "1f1b", micro: int = 2) -> Edit:
    """The two-stage split as a pipeline of ``micro`` micro-batches in both blocks (without the
    split's simulated timeline: a timeline of one micro-batch is refused, campaign 34i)."""

    def change(data: dict[str, Any]) -> None:
        data.pop("timeline", None)
        stages = data["strategy"]["device_groups"][0]
        data["strategy"].update(family="pipeline", num_microbatches=micro, schedule=schedule)
        data["pipeline"] = {
            "schedule": schedule,
            "num_microbatches": micro,
            "stage_devices": stages,
            "bubble_fraction": [0.0] * len(data["devices"]),
        }

    return change


def _then(*changes: Edit) -> Edit:
    def change(data: dict[str, Any]) -> None:
        for one in changes:
            one(data)

    return change


@pytest.fixture()
def two_stages(plan: Plan) -> Plan:
    """The conftest plan: a plain split of two stages on devices 0 and 1 (what edits assume)."""
    assert plan.strategy is not None and plan.strategy.device_groups == ((0, 1),)
    assert plan.pipeline is None
    return plan


# -- the strategy and the pipeline blocks agree (P2, P47) ---------------------------------------


def test_a_consistent_pipelined_edit_loads(two_stages: Plan, tmp_path: Path) -> None:
    loaded = load_plan(_written(two_stages, tmp_path, _pipelined()))
    assert loaded.pipeline is not None and loaded.strategy is not None
    assert loaded.pipeline.schedule is loaded.strategy.schedule


def test_a_pipeline_schedule_other_than_the_strategys_is_refused(
    two_stages: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P2: strategy 1F1B, pipeline GPipe: shown as 1F1B, applied as GPipe."""
    path = _written(
        two_stages,
        tmp_path,
        _then(_pipelined("1f1b"), lambda d: d["pipeline"].update(schedule="gpipe")),
    )
    message = _refused(path)
    assert "field 'pipeline'" in message and "field 'strategy'" in message
    assert "'gpipe'" in message and "'1f1b'" in message
    code, err = _show(path, capsys)
    assert code != 0 and "'gpipe'" in err and "'1f1b'" in err


def test_a_pipelined_strategy_without_a_pipeline_block_is_refused(
    two_stages: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P47: strategy 1F1B x 2 micro-batches, ``"pipeline": null``: applied unpipelined."""
    path = _written(
        two_stages, tmp_path, _then(_pipelined(), lambda d: d.__setitem__("pipeline", None))
    )
    message = _refused(path)
    assert "field 'pipeline' is null" in message
    assert "field 'strategy'" in message and "2 micro-batches" in message and "'1f1b'" in message
    code, err = _show(path, capsys)
    assert code != 0 and "field 'pipeline' is null" in err


def test_a_pipeline_block_beside_an_unpipelined_strategy_is_refused(
    two_stages: Plan, tmp_path: Path
) -> None:
    """The reverse: a plain split's strategy beside a pipeline of one micro-batch."""
    block = {"schedule": "gpipe", "num_microbatches": 1, "stage_devices": [0, 1]}
    path = _written(two_stages, tmp_path, lambda d: d.__setitem__("pipeline", block))
    message = _refused(path)
    assert "'gpipe'" in message and "'none'" in message


# -- the fingerprint covers every layer the plan places (P25, A1) -------------------------------


def test_a_fingerprint_leaving_out_a_placed_layer_is_refused(
    two_stages: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert two_stages.fingerprint is not None
    layer = two_stages.layer_order[2]
    assert layer in two_stages.fingerprint.weights_of
    path = _written(two_stages, tmp_path, lambda d: d["fingerprint"]["layer_weights"].pop(layer))
    message = _refused(path)
    assert "field 'fingerprint.layer_weights'" in message and repr(layer) in message
    code, err = _show(path, capsys)
    assert code != 0 and repr(layer) in err


def test_a_plan_without_a_fingerprint_still_loads(two_stages: Plan, tmp_path: Path) -> None:
    """A plan of an earlier release records none: applied unchecked, with a warning."""
    path = _written(two_stages, tmp_path, lambda d: d.__setitem__("fingerprint", None))
    assert load_plan(path).fingerprint is None


# -- the batch divides by replicas x micro-batches (P12, P27) -----------------------------------


def _data_parallel(batch: int) -> Edit:
    def change(data: dict[str, Any]) -> None:
        layers = len(data["assignment"])
        data["strategy"].update(
            family="data_parallel", device_groups=[[0], [1]], stage_of_layer=[0] * layers
        )
        data["assignment"] = dict.fromkeys(data["assignment"], 0)
        data["batch_size"] = batch

    return change


def test_micro_batches_not_dividing_the_batch_are_refused(
    two_stages: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P12: 3 micro-batches at batch 16."""
    assert two_stages.batch_size == 16
    path = _written(two_stages, tmp_path, _pipelined(micro=3))
    message = _refused(path)
    assert "batch_size=16" in message and "3 micro-batch" in message
    assert "not divisible" in message
    code, err = _show(path, capsys)
    assert code != 0 and "not divisible" in err


def test_replicas_not_dividing_the_batch_are_refused(
    two_stages: Plan, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """P27: data parallel over 2 replicas at batch 15."""
    assert load_plan(_written(two_stages, tmp_path, _data_parallel(16), "even")).strategy
    path = _written(two_stages, tmp_path, _data_parallel(15))
    message = _refused(path)
    assert "batch_size=15" in message and "2 replica(s)" in message
    code, err = _show(path, capsys)
    assert code != 0 and "2 replica(s)" in err


def test_a_pipeline_without_a_strategy_must_divide_the_batch(
    two_stages: Plan, tmp_path: Path
) -> None:
    """A plan file of the older form (a pipeline block, no strategy) is held to it too."""
    path = _written(
        two_stages,
        tmp_path,
        _then(_pipelined(micro=3), lambda d: d.__setitem__("strategy", None)),
    )
    message = _refused(path)
    assert "field 'pipeline.num_microbatches' is 3" in message and "batch_size=16" in message


# -- one device is not named twice (P38) --------------------------------------------------------


def _named(first: str, second: str) -> Edit:
    def change(data: dict[str, Any]) -> None:
        data["devices"][0]["name"] = first
        data["devices"][1]["name"] = second

    return change


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1"),
        ("/device:CPU:1", "/device:CPU:1"),
        ("CPU:1", "/device:CPU:1"),
        ("/cpu:0", "/job:localhost/device:CPU:0"),
        ("/job:worker/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:gpu:0"),
    ],
    ids=["job-prefixed", "same-spelling", "bare", "legacy-lowercase", "remote-task"],
)
def test_one_device_spelled_twice_is_refused(
    two_stages: Plan, tmp_path: Path, first: str, second: str
) -> None:
    message = _refused(_written(two_stages, tmp_path, _named(first, second)))
    assert "field 'devices[1].name'" in message and "'devices[0].name'" in message
    assert repr(first) in message and repr(second) in message


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("/device:CPU:0", "/device:CPU:1"),
        ("/job:worker/replica:0/task:0/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"),
        ("", ""),
    ],
    ids=["two-cpus", "two-tasks", "chosen-at-apply"],
)
def test_distinct_devices_load(two_stages: Plan, tmp_path: Path, first: str, second: str) -> None:
    loaded = load_plan(_written(two_stages, tmp_path, _named(first, second)))
    assert [d.name for d in loaded.devices] == [first, second]


# -- Plan.save refuses to replace a binary file (L13) -------------------------------------------


def test_save_refuses_to_replace_a_binary_file(two_stages: Plan, tmp_path: Path) -> None:
    target = tmp_path / "user.db"
    data = b"SQLite format 3\x00" + bytes(range(256))
    target.write_bytes(data)
    with pytest.raises(OutputError) as info:
        two_stages.save(target)
    message = str(info.value)
    assert "\n" not in message and "binary data" in message and "user.db" in message
    assert target.read_bytes() == data


def test_save_replaces_a_plan_file(two_stages: Plan, tmp_path: Path) -> None:
    target = tmp_path / "plan.json"
    target.write_text(two_stages.to_json().replace("\n", "\n ", 1))  # reformatted, same data
    two_stages.save(target)  # a plan partitioner wrote (its digest): replaced
    assert load_plan(target) == two_stages
