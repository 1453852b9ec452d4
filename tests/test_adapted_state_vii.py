"""Preprocessing layers adapted in the builder keep what ``adapt()`` made in every rewrite.

``Normalization``'s mean and variance (constants derived from its variables when they are
loaded) and a lookup layer's vocabulary (a table, saved by Keras as an asset) were lost by
``Plan.apply`` and ``--emit``: the copy normalized with mean 0 / variance 1, or raised
TensorFlow's "Table not initialized" (34h c D1). README bad-input row 119.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.test_hostile_input_iii_paths import run_cli

DEVICES = ["/device:CPU:0", "/device:CPU:1"]

NORM = """\
import keras, numpy as np


def build_model():
    norm = keras.layers.Normalization(name="norm")
    norm.adapt(np.arange(40, dtype="float32").reshape(10, 4) * 7.0 + 100.0)
    i = keras.Input(shape=(4,))
    h = keras.layers.Dense(8, name="d1")(norm(i))
    return keras.Model(i, keras.layers.Dense(2, name="d2")(h), name="nm")
"""

INTLOOKUP = """\
import keras, numpy as np


def build_model():
    il = keras.layers.IntegerLookup(output_mode="one_hot", name="il")
    il.adapt(np.array([3, 7, 7, 9, 11, 3, 3]))
    i = keras.Input(shape=(1,), dtype="int64")
    h = keras.layers.Flatten(name="fl")(il(i))
    h = keras.layers.Dense(8, name="d1")(h)
    return keras.Model(i, keras.layers.Dense(2, name="d2")(h), name="ilm")
"""

TEXTVEC = """\
import keras, numpy as np


def build_model():
    tv = keras.layers.TextVectorization(max_tokens=20, output_mode="multi_hot", name="tv")
    tv.adapt(np.array(["the cat sat", "the dog ran", "a bird flew high"]))
    i = keras.Input(shape=(), dtype="string")
    h = keras.layers.Dense(8, name="d1")(tv(i))
    return keras.Model(i, keras.layers.Dense(2, name="d2")(h), name="tvm")
"""

SAMPLES = {
    "norm": np.arange(32, dtype="float32").reshape(8, 4) * 5.0 + 90.0,
    "int": np.array([[3], [7], [9], [11], [3], [5], [7], [9]], "int64"),
    "text": np.array(["the cat sat", "a dog", "bird high", "the the", "cat", "x", "y z", "ran"]),
}
CASES = [("norm", NORM), ("int", INTLOOKUP), ("text", TEXTVEC)]


def _built(source: str) -> Any:
    namespace: dict[str, Any] = {}
    exec(source, namespace)
    return namespace["build_model"]()


@pytest.mark.parametrize("strategy", ["placed", "data_parallel", "pipeline"])
@pytest.mark.parametrize(("kind", "source"), CASES, ids=[k for k, _ in CASES])
def test_an_applied_plan_computes_what_the_adapted_original_does(
    kind: str, source: str, strategy: str
) -> None:
    import partitioner

    model = _built(source)
    x = SAMPLES[kind]
    plan = partitioner.partition(model, gpus=2, device_type="cpu", strategy=strategy, batch_size=8)
    copy = plan.apply(model, devices=DEVICES)
    np.testing.assert_array_equal(np.asarray(copy(x)), np.asarray(model(x)))


def test_an_adapted_normalizations_variables_stay_on_its_device() -> None:
    from passes.rewrite.device_placement import place_model

    model = _built(NORM)
    devices = {"norm": DEVICES[1], "d1": DEVICES[0], "d2": DEVICES[0]}
    placed = place_model(model, devices, [SAMPLES["norm"]])
    norm = next(layer for layer in placed.inner.layers if layer.name == "norm")
    assert norm.weights
    assert all(w.value.device.endswith("CPU:1") for w in norm.weights)
    x = SAMPLES["norm"]
    np.testing.assert_array_equal(np.asarray(placed(x)), np.asarray(model(x)))


BUILD_AND_COMPARE = """\
import sys, numpy as np, tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
from pathlib import Path
from tests.emitted import import_emitted
from m import build_model
x = np.load("x.npy")
original = build_model()
module = import_emitted(Path("emitted.py"))
model = module.build_model()
module.load_original_weights(model, original)
print("maxdiff", float(np.max(np.abs(np.asarray(model(x)) - np.asarray(original(x))))))
"""


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "source"), CASES, ids=[k for k, _ in CASES])
def test_an_emitted_module_of_an_adapted_model_computes_what_it_does(
    tmp_path: Path, kind: str, source: str
) -> None:
    """Built in a fresh interpreter on 2 logical CPUs, the original's weights loaded."""
    (tmp_path / "m.py").write_text(source)
    np.save(tmp_path / "x.npy", SAMPLES[kind])
    args = ["m.py", "--gpus", "2", "--device-type", "cpu", "--batch-size", "8"]
    proc = run_cli(
        [*args, "--strategy", "placed", "--emit", "emitted.py", "--out", "p.json"], tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "build.py").write_text(BUILD_AND_COMPARE)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, str(tmp_path)])}
    built = subprocess.run(
        [sys.executable, "build.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    assert built.stdout.strip().splitlines()[-1] == "maxdiff 0.0", built.stdout


def test_state_that_emitted_code_cannot_carry_is_refused_in_one_line() -> None:
    """A tf-idf lookup's adapted vocabulary (with its weights) is not written as code."""
    import keras

    from partitioner.core.errors import RewriteError
    from passes.rewrite.codegen import emit_placed_module

    il = keras.layers.IntegerLookup(output_mode="tf_idf", name="il")
    il.adapt(np.array([3, 7, 7, 9]))
    i = keras.Input(shape=(1,), dtype="int64")
    model = keras.Model(i, keras.layers.Dense(2, name="d")(il(i)), name="tf")
    with pytest.raises(RewriteError, match=r"layer 'il' \(IntegerLookup\).*tf-idf") as info:
        emit_placed_module(model, {"il": DEVICES[0], "d": DEVICES[1]})
    assert "\n" not in str(info.value)
