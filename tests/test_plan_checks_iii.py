"""Hostile input III (issue 34): a plan checks what it is applied to, and a plan file is checked
for consistency.

A plan records the model it was made for (its inputs and each layer's weight shapes) and
``plan.apply`` refuses a model that differs, before anything is built; every device string must
be a device TensorFlow sees here (soft placement would run a missing device's layers on CPU:0,
silently); a plan file whose strategy, pipeline, devices or keys disagree is refused in one line
naming the file, the field and the value.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PlanError, UsageError
from partitioner.plan.model import Plan, load_plan

REPO = Path(__file__).resolve().parents[1]
CPUS = ["/device:CPU:0", "/device:CPU:1"]
NEXT_STEP = "re-plan this model: partition(model, ...)"


def mlp_like(input_dim: int = 784, hidden: int = 512) -> keras.Model:
    """examples/mnist_mlp.py's model, its name and layer names, with other widths."""
    return keras.Sequential(
        [
            keras.Input(shape=(input_dim,)),
            keras.layers.Dense(512, activation="relu", name="dense_in"),
            keras.layers.Dropout(0.2, name="dropout_in"),
            keras.layers.Dense(hidden, activation="relu", name="dense_hidden"),
            keras.layers.Dropout(0.2, name="dropout_hidden"),
            keras.layers.Dense(10, activation="softmax", name="dense_out"),
        ],
        name="mnist_mlp",
    )


@pytest.fixture()
def nothing_built(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every call of the placement rewrite (there must be none)."""
    calls: list[Any] = []
    monkeypatch.setattr("passes.apply.place_model", lambda *a, **k: calls.append(a))
    return calls


def weights_of(model: keras.Model) -> list[np.ndarray]:
    return [np.array(w) for w in model.get_weights()]


# -- the fingerprint ----------------------------------------------------------------------------


def test_the_fingerprint_is_recorded_and_round_trips(plan: Plan, tmp_path: Path) -> None:
    fingerprint = plan.fingerprint
    assert fingerprint is not None
    assert [(i.shape, i.dtype) for i in fingerprint.inputs] == [((784,), "float32")]
    assert fingerprint.weights_of["dense_in"] == ((784, 512), (512,))
    assert fingerprint.weights_of["dense_out"] == ((512, 10), (10,))
    assert fingerprint.weights_of["dropout_in"] == ()
    path = plan.save(tmp_path / "plan.json")
    data = json.loads(path.read_text())
    assert data["fingerprint"]["layer_weights"]["dense_hidden"] == [[512, 512], [512]]
    assert data["fingerprint"]["inputs"][0]["shape"] == [784]
    loaded = load_plan(path)
    assert loaded.fingerprint == fingerprint
    assert loaded.to_json_dict() == plan.to_json_dict()


def test_the_same_architecture_built_again_applies(plan: Plan) -> None:
    # Another instance (its input and its tensors named apart by Keras) is the same model.
    placed = plan.apply(mlp_like(), devices=CPUS)
    assert set(placed.layer_devices) == set(plan.assignment)


def test_a_model_with_other_inputs_is_refused_naming_the_input(
    plan: Plan, nothing_built: list[Any]
) -> None:
    other = mlp_like(input_dim=10)
    before = weights_of(other)
    with pytest.raises(PlanError) as info:
        plan.apply(other, devices=CPUS)
    message = str(info.value)
    assert "\n" not in message
    assert "input '" in message
    assert "is (10,) float32 here, but the plan was made for (784,) float32" in message
    assert NEXT_STEP in message
    assert not nothing_built
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(other)))


def test_a_changed_dense_width_is_refused_naming_the_layer(
    plan: Plan, nothing_built: list[Any]
) -> None:
    with pytest.raises(PlanError) as info:
        plan.apply(mlp_like(hidden=64), devices=CPUS)
    message = str(info.value)
    assert "layer 'dense_hidden' has weights of shapes [(512, 64), (64,)] here" in message
    assert "made for [(512, 512), (512,)]" in message
    assert NEXT_STEP in message
    assert not nothing_built


def chain(order: list[str]) -> keras.Model:
    """``x -> order[0] -> ... -> out``: four Dense(8) named alike, wired in ``order``."""
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name="x")
    h = x
    for name in order:
        h = keras.layers.Dense(8, name=name)(h)
    return keras.Model(x, keras.layers.Dense(2, name="out")(h), name="chain")


def test_the_same_layers_wired_otherwise_are_refused_naming_the_layer(
    tmp_path: Path, nothing_built: list[Any]
) -> None:
    """Names and weight shapes alike, the graph another (the campaign's rerun, issue 34): the
    fingerprint records each layer's feeding layers, and the check reads them back from file."""
    made = partitioner.partition(
        chain(["d1", "d2", "d3", "d4"]), gpus=2, batch_size=16, solver="even",
        compare_strategies=False,
    )  # fmt: skip
    assert made.fingerprint is not None
    assert made.fingerprint.inputs_of["d3"] == ("d2",)
    assert made.fingerprint.inputs_of["d1"] == ("<input 0>",)  # fed by the model's input
    loaded = load_plan(made.save(tmp_path / "plan.json"))
    assert loaded.fingerprint == made.fingerprint
    with pytest.raises(PlanError) as info:
        loaded.apply(chain(["d4", "d3", "d2", "d1"]), devices=CPUS)
    message = str(info.value)
    assert "layer 'd1' is fed by ['d2'] here, but in the plan's model by ['<input 0>']" in message
    assert "wired otherwise" in message and NEXT_STEP in message and "\n" not in message
    assert not nothing_built
    loaded.apply(chain(["d1", "d2", "d3", "d4"]), devices=CPUS)  # the same wiring applies


def test_an_old_plan_without_a_fingerprint_still_applies_with_a_warning(
    plan: Plan, mlp: keras.Model, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = plan.to_json_dict()
    del data["fingerprint"], data["digest"]  # a file of an earlier release
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    old = load_plan(path)
    assert old.fingerprint is None
    with caplog.at_level(logging.WARNING, logger="passes.apply"):
        placed = old.apply(mlp, devices=CPUS)
    assert any("records no model fingerprint" in r.getMessage() for r in caplog.records)
    x = np.random.default_rng(0).random((4, 784), dtype=np.float32)
    expected = mlp(x, training=False).numpy()
    assert float(np.max(np.abs(np.asarray(placed(x, training=False)) - expected))) <= 1e-5


def test_an_old_plan_applies_unchecked_to_a_differing_model(plan: Plan) -> None:
    old = replace(plan, fingerprint=None)
    # unchecked: the other width is not refused by the plan (the rewrite builds it as it is)
    placed = old.apply(mlp_like(hidden=64), devices=CPUS)
    assert set(placed.layer_devices) == set(plan.assignment)


# -- devices ------------------------------------------------------------------------------------


@pytest.mark.skipif(
    bool(tf.config.list_logical_devices("GPU")), reason="TensorFlow sees a GPU here"
)
def test_gpus_this_machine_does_not_have_are_refused(
    plan: Plan, mlp: keras.Model, nothing_built: list[Any]
) -> None:
    before = weights_of(mlp)
    with pytest.raises(UsageError) as info:
        plan.apply(mlp, devices=["/device:GPU:0", "/device:GPU:1"])
    message = str(info.value)
    assert "devices[0]='/device:GPU:0' is not a device TensorFlow sees here" in message
    assert "/device:CPU:0" in message  # the devices it sees
    assert "\n" not in message
    assert not nothing_built
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(mlp)))


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (["/device:CPU:0", "/device:CPU:99"], "devices[1]='/device:CPU:99' is not a device"),
        ([None, None], "devices[0] is None, not a device string"),
        (["/device:CPU:0", 1], "devices[1] is 1, not a device string"),
        (["/device:CPU:0", ""], "devices[1] is '', not a device string"),
        ("/device:CPU:0", "devices='/device:CPU:0' must be a list"),
        (["/device:CPU:0", "/job:localhost"], "devices[1]='/job:localhost' names no device"),
        (["/device:CPU:0", "/device:CPU:x"], "devices[1]='/device:CPU:x' is not a TensorFlow"),
    ],
)
def test_bad_device_strings_are_refused_before_building(
    plan: Plan, mlp: keras.Model, nothing_built: list[Any], devices: Any, expected: str
) -> None:
    before = weights_of(mlp)
    with pytest.raises(UsageError) as info:
        plan.apply(mlp, devices=devices)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)
    assert not nothing_built
    assert all(np.array_equal(a, b) for a, b in zip(before, weights_of(mlp)))


def test_device_strings_are_matched_in_any_spelling(plan: Plan, mlp: keras.Model) -> None:
    devices = ["/CPU:0", "/job:localhost/replica:0/task:0/device:CPU:1"]
    placed = plan.apply(mlp, devices=devices)
    assert set(placed.layer_devices.values()) == set(devices)


def test_a_plan_naming_a_device_not_here_is_refused(
    plan: Plan, mlp: keras.Model, nothing_built: list[Any]
) -> None:
    named = replace(
        plan, devices=tuple(replace(d, name=f"/device:CPU:{90 + d.index}") for d in plan.devices)
    )
    with pytest.raises(PlanError, match=r"the plan's device 0 is named '/device:CPU:90'.*devices="):
        named.apply(mlp)
    assert not nothing_built


# -- the plan file ------------------------------------------------------------------------------


def refused(tmp_path: Path, text: str) -> str:
    """The one-line PlanError of loading ``text`` as a plan file; it names the file."""
    path = tmp_path / "plan.json"
    path.write_text(text)
    with pytest.raises(PlanError) as info:
        load_plan(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(str(path))
    return message


def edited(plan: Plan, change: Callable[[dict[str, Any]], None]) -> str:
    data = copy.deepcopy(plan.to_json_dict())
    change(data)
    return json.dumps(data, indent=2)


def single_on_device_0(data: dict[str, Any]) -> None:
    data["strategy"].update(
        family="single", device_groups=[[0]], stage_of_layer=[0] * len(data["assignment"])
    )


def microbatches(count: int) -> Callable[[dict[str, Any]], None]:
    def change(data: dict[str, Any]) -> None:
        data["strategy"].update(family="pipeline", num_microbatches=count, schedule="gpipe")

    return change


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            lambda d: d["assignment"].__setitem__("dense_out", 2),
            "field 'assignment' puts layer 'dense_out' on device 2, but the plan has devices 0..1",
        ),
        (
            lambda d: d["devices"][1].__setitem__("index", 0),
            "field 'devices[1].index' is 0, but devices are listed in index order (expected 1)",
        ),
        (
            lambda d: d["strategy"].__setitem__("device_groups", [[0, 5]]),
            "field 'strategy.device_groups' uses device 5, but the plan has devices 0..1",
        ),
        (
            single_on_device_0,
            "on device 1, but field 'strategy' ('single': one device on devices [0]) puts it on "
            "device 0",
        ),
        (
            lambda d: d["strategy"].update(
                device_groups=[[0], [1]], stage_of_layer=[0] * len(d["assignment"])
            ),
            "field 'strategy.family' is 'placed', but its replicas, stages and micro-batches make "
            "it 'data_parallel'",
        ),
        (
            lambda d: d["strategy"].update(stage_of_layer=[0] * len(d["assignment"])),
            "field 'strategy.stage_of_layer' puts no layer on stage 1 of 2",
        ),
        (
            microbatches(32),
            "field 'strategy.num_microbatches' is 32: 1 replica(s) x 32 micro-batch(es) are more "
            "than batch_size=16 samples",
        ),
        (
            lambda d: d["strategy"].update(family="hybrid", device_groups=[[0, 1], [2, 3]]),
            "field 'strategy.device_groups' uses device 2, but the plan has devices 0..1",
        ),
        (
            lambda d: d.__setitem__(
                "pipeline", {"schedule": "gpipe", "num_microbatches": 32, "stage_devices": [0, 1]}
            ),
            "field 'pipeline.num_microbatches' is 32, more than batch_size=16 samples",
        ),
        (
            lambda d: d.__setitem__(
                "pipeline", {"schedule": "gpipe", "num_microbatches": 2, "stage_devices": [0]}
            ),
            "field 'pipeline.stage_devices' is [0], but 'assignment' uses devices [0, 1]",
        ),
        (
            lambda d: d["fingerprint"]["layer_weights"].__setitem__("ghost", [[3]]),
            "field 'fingerprint.layer_weights' names layer 'ghost', which 'assignment' does not "
            "place",
        ),
    ],
    ids=[
        "device-out-of-range",
        "device-index-out-of-order",
        "strategy-device-out-of-range",
        "single-with-two-devices",
        "family-disagrees",
        "stage-without-layer",
        "microbatches-over-batch",
        "replicas-out-of-range",
        "pipeline-microbatches-over-batch",
        "pipeline-stages-not-assignment",
        "fingerprint-stray-layer",
    ],
)
def test_an_inconsistent_plan_file_is_refused_in_one_line(
    plan: Plan, tmp_path: Path, change: Callable[[dict[str, Any]], None], expected: str
) -> None:
    assert plan.strategy is not None and plan.strategy.stages == 2  # what the edits assume
    message = refused(tmp_path, edited(plan, change))
    assert expected in message
    assert message.endswith("make the plan again")


@pytest.mark.parametrize(
    ("key", "duplicate", "expected"),
    [
        ('  "batch_size": 16,\n', '  "batch_size": 64,\n', "key 'batch_size' twice"),
        ('    "dense_in": 0,\n', '    "dense_in": 1,\n', "key 'dense_in' twice"),
    ],
)
def test_a_duplicated_key_is_refused(
    plan: Plan, tmp_path: Path, key: str, duplicate: str, expected: str
) -> None:
    text = plan.to_json()
    assert key in text
    message = refused(tmp_path, text.replace(key, key + duplicate, 1))
    assert expected in message
    assert "keep one of them" in message
