"""Models whose inputs are not dense numbers (issue 34): strings and sparse tensors.

A model that takes strings (``StringLookup`` on a ``dtype="string"`` input):

Before, such a model planned with exit 0 and then every realisation failed: ``plan.apply`` raised
Keras's raw ``ValueError`` ("Failed to convert a NumPy array to a Tensor (Unsupported object
type int)", numpy's object zeros are the int 0) and the emitted module could not build
(``np.zeros(shape, dtype="string")``). Each strategy family now applies and trains as the
original does on the same batch, and the emitted module builds and computes the same outputs.

A model with a sparse input (``keras.Input(sparse=True)``): placed on devices it trains as the
original; a strategy that splits each batch (replicas, micro-batches) failed in training with
TensorFlow's raw "Failed to convert elements of SparseTensor", and is now refused in one line
when planned or applied, while ``auto`` plans a strategy that applies.
"""

from __future__ import annotations

from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PartitionError, RewriteError
from passes.rewrite.codegen import emit_plan_module
from tests.emitted import import_emitted

CPU = [f"/device:CPU:{i}" for i in range(2)]
BATCH = 8
WORDS = ["red", "green", "blue", "cyan"]


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


def sparse_model(sparse: bool = True) -> keras.Model:
    keras.utils.set_random_seed(0)
    features = keras.Input(shape=(20,), sparse=sparse, name="features")
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(features)
    out = keras.layers.Dense(2, name="out")(hidden)
    model = keras.Model(features, out, name="sparse_model")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", jit_compile=False)
    return model


def sparse_batch() -> tuple[tf.SparseTensor, np.ndarray]:
    rng = np.random.default_rng(3)
    dense = (rng.random((BATCH, 20)) < 0.2) * rng.standard_normal((BATCH, 20))
    return tf.sparse.from_dense(dense.astype("float32")), rng.standard_normal((BATCH, 2)).astype(
        "float32"
    )


def test_a_sparse_input_model_placed_trains_as_the_original_and_auto_applies() -> None:
    x, y = sparse_batch()
    for family in ("placed", None):
        plan = partitioner.partition(sparse_model(), gpus=2, batch_size=BATCH, strategy=family)
        strategy = plan.strategy
        assert strategy is None or (strategy.replicas, strategy.num_microbatches) == (1, 1)
        applied = plan.apply(sparse_model(), devices=CPU)
        reference = sparse_model()
        applied.train_on_batch(x, y)
        reference.train_on_batch(x, y)
        for got, want in zip(weights(applied), weights(reference), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("family", "shares"), [("data-parallel", "2 replicas"), ("pipeline", "2 micro-batches")]
)
def test_a_batch_split_of_a_sparse_input_is_refused_when_planned_and_applied(
    family: str, shares: str
) -> None:
    # planned: refused before the trace ("into replicas"); applied: the plan's "2 replicas"
    words = ["'features' (sparse)", f"{shares.split()[-1]}, which", "strategy='placed'"]
    with pytest.raises(PartitionError) as planned:  # refused before the trace
        partitioner.partition(sparse_model(), gpus=2, batch_size=BATCH, strategy=family)
    # the same plan, made for the dense twin of the model, applied to the sparse one
    plan = partitioner.partition(sparse_model(False), gpus=2, batch_size=BATCH, strategy=family)
    with pytest.raises(RewriteError) as applied:
        plan.apply(sparse_model(), devices=CPU)
    for info in (planned, applied):
        text = str(info.value)
        assert "\n" not in text and all(w in text for w in words), text
