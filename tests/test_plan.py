"""The plan file: a JSON round trip, validation of untrusted files, and atomic writes."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import keras
import pytest

import partitioner
from partitioner.core.errors import OutputError, PlanError
from partitioner.core.files import write_atomic
from partitioner.plan.model import (
    SCHEMA_VERSION,
    DevicePrediction,
    Plan,
    PlanDevice,
    SolverInfo,
)
from passes.trace import placement_units


def small_model() -> keras.Model:
    x = keras.Input((16,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="fc1")(x)
    h = keras.layers.Dense(32, activation="relu", name="fc2")(h)
    h = keras.layers.Dense(32, activation="relu", name="fc3")(h)
    y = keras.layers.Dense(4, name="head")(h)
    return keras.Model(x, y, name="small")


@pytest.fixture(scope="module")
def model() -> keras.Model:
    return small_model()


@pytest.fixture(scope="module")
def plan(model: keras.Model) -> Plan:
    return partitioner.partition(model, gpus=2, batch_size=8)


@pytest.fixture()
def plan_file(plan: Plan, tmp_path: Path) -> Path:
    return plan.save(tmp_path / "plan.json")


def edit(path: Path, change: Any) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


# -- round trip -----------------------------------------------------------------------------


def test_round_trip(plan: Plan, plan_file: Path) -> None:
    loaded = partitioner.load_plan(plan_file)
    assert loaded.to_json_dict() == plan.to_json_dict()
    assert loaded == plan
    assert loaded.assignment == plan.assignment
    assert [d.layers for d in loaded.per_device] == [d.layers for d in plan.per_device]
    assert isinstance(loaded, partitioner.Plan)


def test_assignment_maps_layer_names_to_device_indices(plan: Plan, model: keras.Model) -> None:
    names = [u.name for u in placement_units(model)]
    assert sorted(plan.assignment) == sorted(names)
    assert all(isinstance(d, int) and 0 <= d < 2 for d in plan.assignment.values())
    assert plan.assignment == dict(zip(plan.layer_order, plan.device_of_layer))
    for d in plan.per_device:
        assert all(plan.assignment[name] == d.device for name in d.layers)
    with pytest.raises(TypeError):
        plan.assignment["fc1"] = 1  # type: ignore[index]


def test_plan_json_fields(plan: Plan, plan_file: Path) -> None:
    data = json.loads(plan_file.read_text())
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["model"] == "small"
    assert data["batch_size"] == 8
    assert len(data["devices"]) == 2
    assert set(data["predicted"]) >= {"step_time_s", "compute_s", "memory_bytes", "transfer_bytes"}
    assert set(data["solver"]) >= {"name", "status"}
    assert data["predicted"]["transfer_bytes"] == [
        s + r for s, r in zip(data["predicted"]["bytes_sent"], data["predicted"]["bytes_received"])
    ]


# -- bad plan files -------------------------------------------------------------------------


def test_truncated_file(plan_file: Path) -> None:
    text = plan_file.read_text()
    plan_file.write_text(text[: len(text) // 2])
    with pytest.raises(PlanError, match=r"\(plan file\) is not valid JSON \(.* at line \d+") as info:
        partitioner.load_plan(plan_file)
    assert str(plan_file) in str(info.value) and "truncated" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="no such plan file"):
        partitioner.load_plan(tmp_path / "nope.json")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.pop("assignment"), r"field 'assignment' is missing"),
        (lambda d: d.update(batch_size="x"), r"field 'batch_size' must be integer, got string"),
        (lambda d: d.update(batch_size=True), r"field 'batch_size' must be integer, got boolean"),
        (lambda d: d.pop("model"), r"field 'model' is missing"),
        (lambda d: d.pop("devices"), r"field 'devices' is missing"),
        (lambda d: d.update(devices=[]), r"field 'devices' must have at least 1 items"),
        (lambda d: d["assignment"].update(fc1="0"), r"field 'assignment.fc1' must be integer"),
        (
            lambda d: d["assignment"].update(fc1=7),
            r"'assignment' puts layer 'fc1' on device 7.*devices 0\.\.1",
        ),
        (lambda d: d["predicted"].update(step_time_s="fast"), r"field 'predicted.step_time_s' must be number"),
        (lambda d: d["predicted"].update(step_time_s=float("nan")), r"'predicted\.step_time_s' must be a fin"),
        (
            lambda d: d["predicted"].update(compute_s=[1.0]),
            r"predicted\.compute_s has 1 entries for 2 devices",
        ),
        (lambda d: d["solver"].pop("status"), r"field 'solver.status' is missing"),
        (lambda d: d.update(input_shape="16"), r"field 'input_shape' must be array or object or null"),
    ],
)
def test_invalid_fields(plan_file: Path, change: Any, message: str) -> None:
    edit(plan_file, change)
    with pytest.raises(PlanError, match=message) as info:
        partitioner.load_plan(plan_file)
    assert str(info.value).startswith(str(plan_file))


@pytest.mark.parametrize("version", [0, 3, SCHEMA_VERSION + 1])
def test_other_schema_version(plan_file: Path, version: int) -> None:
    edit(plan_file, lambda d: d.update(schema_version=version))
    with pytest.raises(PlanError, match=rf"schema_version {version} is not supported"):
        partitioner.load_plan(plan_file)


def test_not_an_object(tmp_path: Path) -> None:
    path = tmp_path / "plan.json"
    path.write_text("[1, 2]")
    with pytest.raises(PlanError, match=r"\(top level\).*must be object, got array"):
        partitioner.load_plan(path)


def _plan(**overrides: Any) -> Plan:
    fields: dict[str, Any] = {
        "model_name": "m",
        "devices": (PlanDevice(0, "h100", 1 << 30), PlanDevice(1, "h100", 1 << 30)),
        "layer_order": ("a", "b"),
        "device_of_layer": (0, 1),
        "step_time_s": 1.0,
        "lower_bound_s": 0.5,
        "per_device": (
            DevicePrediction(0, ("a",), 0.5, 10, 1 << 30, 4, 0),
            DevicePrediction(1, ("b",), 0.5, 10, 1 << 30, 0, 4),
        ),
        "solver": SolverInfo("even", "heuristic", None, 0.0),
        "link": "pcie5",
        "batch_size": 4,
    }
    fields.update(overrides)
    return Plan(**fields)


def test_plan_validates_itself() -> None:
    assert _plan().assignment == {"a": 0, "b": 1}
    with pytest.raises(PlanError, match="2 layers but 1 device indices"):
        _plan(device_of_layer=(0,))
    with pytest.raises(PlanError, match="names a layer twice"):
        _plan(layer_order=("a", "a"))
    with pytest.raises(PlanError, match="layer 'b' is on device 2"):
        _plan(device_of_layer=(0, 2))


def test_hand_made_plan_round_trips(tmp_path: Path) -> None:
    plan = _plan(input_shape=(3, 5), advice=("split",), phase_times_s=(("trace", 0.1),))
    loaded = partitioner.load_plan(plan.save(tmp_path / "p.json"))
    assert loaded == plan
    assert loaded.to_json_dict() == plan.to_json_dict()


# -- atomic writes --------------------------------------------------------------------------


def test_write_atomic_writes_and_replaces(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    assert write_atomic(target, "one\n") == target
    assert write_atomic(target, "two\n") == target
    assert target.read_text() == "two\n"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    write_atomic("rel.json", "x")
    assert (tmp_path / "rel.json").read_text() == "x"
    assert os.listdir(tmp_path) == ["rel.json"]


def test_write_atomic_failed_rename_leaves_target_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.json"
    target.write_text("sentinel")

    def fail(*_args: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OutputError, match="No space left on device"):
        write_atomic(target, "new")
    assert target.read_text() == "sentinel"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_interrupted_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "out.json"
    target.write_text("sentinel")

    def interrupt(_fd: int) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(target, "new")
    assert target.read_text() == "sentinel"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_bad_targets(tmp_path: Path) -> None:
    with pytest.raises(OutputError, match="it is a directory"):
        write_atomic(tmp_path, "x")
    with pytest.raises(OutputError, match="does not exist"):
        write_atomic(tmp_path / "no" / "out.json", "x")
    with pytest.raises(OutputError, match=r"cannot write /proc/partitioner-test\.json"):
        write_atomic("/proc/partitioner-test.json", "x")
    assert os.listdir(tmp_path) == []


def test_write_atomic_error_while_writing_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("sentinel")
    with pytest.raises(TypeError):
        write_atomic(target, 123)  # type: ignore[arg-type]
    assert target.read_text() == "sentinel"
    assert os.listdir(tmp_path) == ["out.json"]


def test_write_atomic_gives_the_usual_mode_not_0600(tmp_path: Path) -> None:
    from partitioner.core.files import _umask

    new = write_atomic(tmp_path / "new.json", "{}\n")
    assert new.stat().st_mode & 0o777 == 0o666 & ~_umask()
    kept = tmp_path / "kept.json"
    kept.write_text("old\n")
    kept.chmod(0o640)
    write_atomic(kept, "{}\n")
    assert kept.stat().st_mode & 0o777 == 0o640 and kept.read_text() == "{}\n"
