"""A model that takes strings (``StringLookup`` on a ``dtype="string"`` input), issue 34.

Before, such a model planned with exit 0 and then every realisation failed: ``plan.apply`` raised
Keras's raw ``ValueError`` ("Failed to convert a NumPy array to a Tensor (Unsupported object
type int)", numpy's object zeros are the int 0) and the emitted module could not build
(``np.zeros(shape, dtype="string")``). Each strategy family now applies and trains as the
original does on the same batch, and the emitted module builds and computes the same outputs.
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import keras
import numpy as np
import pytest

import partitioner
from passes.rewrite.codegen import emit_plan_module

CPU = [f"/device:CPU:{i}" for i in range(2)]
BATCH = 8
WORDS = ["red", "green", "blue", "cyan"]
_counter = itertools.count()


def string_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    words = keras.Input(shape=(3,), dtype="string", name="words")
    ids = keras.layers.StringLookup(vocabulary=WORDS, name="lookup")(words)
    x = keras.layers.Embedding(len(WORDS) + 1, 8, name="embed")(ids)
    x = keras.layers.Flatten(name="flat")(x)
    x = keras.layers.Dense(16, activation="relu", name="hidden")(x)
    out = keras.layers.Dense(2, name="logits")(x)
    model = keras.Model(words, out, name="string_model")
    return compiled(model)


def compiled(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    return model


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    words = np.array([*WORDS, "unknown"], dtype=object)[rng.integers(0, 5, (BATCH, 3))]
    return words, rng.integers(0, 2, (BATCH,)).astype("int32")


def import_emitted(path: Path) -> ModuleType:
    name = f"emitted_string_model_{next(_counter)}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in sorted(model.trainable_variables, key=lambda v: v.path)]


@pytest.mark.parametrize("family", ["placed", "pipeline", "data-parallel"])
def test_a_string_input_model_applies_and_trains_as_the_original(family: str) -> None:
    x, y = batch()
    original = string_model()
    plan = partitioner.partition(original, gpus=2, batch_size=BATCH, strategy=family)
    applied = plan.apply(original, devices=CPU)
    reference = string_model()
    np.testing.assert_allclose(np.asarray(applied(x)), np.asarray(reference(x)), rtol=1e-5)
    applied.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    for got, want in zip(weights(applied), weights(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("family", ["placed", "data-parallel"])
def test_the_emitted_module_of_a_string_input_model_builds(tmp_path: Path, family: str) -> None:
    original = string_model()
    plan = partitioner.partition(original, gpus=2, batch_size=BATCH, strategy=family)
    path = tmp_path / f"placed_{family.replace('-', '_')}.py"
    path.write_text(emit_plan_module(original, plan, devices=CPU), encoding="utf-8")
    module = import_emitted(path)
    sample = module.sample_batch() if hasattr(module, "sample_batch") else module.sample_inputs()
    assert np.asarray(sample).dtype == object  # empty strings, not numpy's int 0
    if family == "placed":
        built = module.build_model()
        module.load_original_weights(built, original)
        x, _ = batch()
        np.testing.assert_allclose(np.asarray(built(x)), np.asarray(original(x)), rtol=1e-5)
