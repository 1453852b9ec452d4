"""A Sequential model with ``Masking`` (issue 34): Keras runs it as a functional graph that
also holds the mask's ``not_equal`` and ``any`` ops, which a Sequential's ``layers`` omit.

Before, the plan named only the layers, so ``--emit`` failed with "layer 'not_equal' is not a
placement unit" and a pipeline with "layer 'not_equal' ... has no device in the plan". The mask
ops are placement units now, as in a functional model: every family applies and trains as the
original, and the emitted module computes the same outputs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import partitioner
from passes.rewrite.codegen import emit_plan_module
from passes.trace import placement_units
from tests.emitted import import_emitted

CPU = [f"/device:CPU:{i}" for i in range(2)]
BATCH = 8


def masked_sequential(built: bool = True) -> keras.Model:
    keras.utils.set_random_seed(0)
    layers: list[Any] = [
        keras.layers.Masking(name="mask"),
        keras.layers.LSTM(8, name="lstm"),
        keras.layers.Dense(2, name="out"),
    ]
    model = keras.Sequential(([keras.Input((10, 4))] if built else []) + layers, name="seq")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return model


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(2)
    x = rng.standard_normal((BATCH, 10, 4)).astype("float32")
    x[:, 6:, :] = 0.0  # masked time steps
    return x, rng.standard_normal((BATCH, 2)).astype("float32")


def weights(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v) for v in sorted(model.trainable_variables, key=lambda v: v.path)]


def test_the_mask_ops_are_units_of_a_built_sequential_only() -> None:
    names = [u.name for u in placement_units(masked_sequential())]
    assert {"mask", "lstm", "out"} <= set(names) and len(names) > 3
    assert [u.name for u in placement_units(masked_sequential(built=False))] == [
        "mask",
        "lstm",
        "out",
    ]
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="d")])
    assert [u.name for u in placement_units(plain)] == ["d"]


@pytest.mark.parametrize("family", ["placed", "pipeline"])
def test_a_masked_sequential_applies_and_trains_as_the_original(family: str) -> None:
    x, y = batch()
    original = masked_sequential()
    plan = partitioner.partition(original, gpus=2, batch_size=BATCH, strategy=family)
    assert set(plan.assignment) == {u.name for u in placement_units(original)}
    applied = plan.apply(original, devices=CPU)
    reference = masked_sequential()
    np.testing.assert_allclose(np.asarray(applied(x)), np.asarray(reference(x)), rtol=1e-5)
    applied.train_on_batch(x, y)
    reference.train_on_batch(x, y)
    for got, want in zip(weights(applied), weights(reference), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)



def test_the_emitted_module_of_a_masked_sequential_computes_the_same(tmp_path: Path) -> None:
    original = masked_sequential()
    plan = partitioner.partition(original, gpus=2, batch_size=BATCH, strategy="placed")
    path = tmp_path / "placed_masked.py"
    path.write_text(emit_plan_module(original, plan, devices=CPU), encoding="utf-8")
    module = import_emitted(path)
    built = module.build_model()
    module.load_original_weights(built, original)
    x, _ = batch()
    np.testing.assert_allclose(np.asarray(built(x)), np.asarray(original(x)), rtol=1e-5)
