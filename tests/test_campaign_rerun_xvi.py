"""Hostile input III (issue 34), campaign 34ag (round 33) and what 34af left: a functional
model holding a subclassed model that cannot be rebuilt from its config."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

import partitioner
from passes.checks import in_place_reason

DEVICES = [f"/device:CPU:{i}" for i in range(4)]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(8, 6)).astype("float32")
Y = RNG.normal(size=(8, 2)).astype("float32")


class Block(keras.Model):
    """keras.io's style: a subclassed block with a required argument and no ``get_config``."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.first = keras.layers.Dense(units, activation="relu")
        self.second = keras.layers.Dense(units)

    def call(self, x: Any) -> Any:
        return self.second(self.first(x))


def _functional_with_block() -> keras.Model:
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2)(Block(8)(hidden)))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model


def test_a_nested_subclassed_model_without_config_is_placed_in_place() -> None:
    """34af c: the functional model was copied, which rebuilds the nested ``Block`` from its
    config, and ``plan.apply`` failed with Keras's 22-line text on ``get_config``. The nested
    model is named as the reason, the model is placed in place, and one step trains it as the
    unplaced model."""
    model = _functional_with_block()
    reason = in_place_reason(model)
    assert reason is not None and "'block'" in reason and "(Block)" in reason
    reference = _functional_with_block()
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    placed = plan.apply(model, devices=DEVICES[:2])
    assert placed is model
    devices = {v.value.device.rsplit("/", 1)[-1] for v in model.weights}
    assert devices == {"device:CPU:0", "device:CPU:1"}, devices
    loss = placed.train_on_batch(X, Y)
    expected = reference.train_on_batch(X, Y)
    np.testing.assert_allclose(loss, expected, rtol=1e-5)
    for got, want in zip(placed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_pipeline_advice_asks_for_more_micro_batches_only_where_they_divide_the_batch() -> None:
    """34ag b (D2): a batch of 7 over 3 stages ran as 7 micro-batches of 1, and the advice
    asked for more micro-batches, which the batch refuses. It names the batch instead; a batch
    with a larger divisor still gets the advice."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((32,))
    hidden = inputs
    for _ in range(3):
        hidden = keras.layers.Dense(64, activation="relu")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(4)(hidden))

    def bubbles(batch: int, microbatches: int) -> str:
        plan = partitioner.partition(
            model, gpus=3, batch_size=batch, pipeline=True, num_microbatches=microbatches
        )
        return next(a for a in plan.advice if a.startswith("Bubbles reach"))

    assert "no more micro-batches divide the batch of 7 (7 micro-batches of 1 row)" in bubbles(7, 7)
    assert "more micro-batches (--microbatches, now 2) shrink them" in bubbles(8, 2)
