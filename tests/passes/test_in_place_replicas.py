"""Data parallelism in place (issue 36, :func:`passes.rewrite.in_place.replicate_in_place`): the
models of tests/passes/test_in_place.py, written as the keras.io examples write them, trained
data parallel on four logical CPU devices through ``tf.distribute.MirroredStrategy``, the model
itself with its own ``train_step``: every variable mirrored on the four devices, and the weights
after one step of the model's own ``fit`` (or ``train_on_batch``) equal the unreplicated model's
on the same batch, a loss reduced by Keras or by hand (``keras.ops.mean``)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.errors import PartitionError, RewriteError, UsageError
from passes.rewrite.in_place import (
    place_in_place,
    placed_in_place,
    replicate_in_place,
    variable_devices,
)
from tests.passes.test_in_place import CASES, DEVICES, _built, custom_step

ROWS = 8
"""Rows of a step's batch: two per replica on four devices."""


def _batch(case: str) -> tuple[Any, Any]:
    """The case's batch grown to :data:`ROWS` rows (its rows repeated)."""
    _, x, y = CASES[case]
    grow = lambda a: None if a is None else np.concatenate([a, a])[:ROWS]  # noqa: E731
    return grow(x), grow(y)


def _fit(model: keras.Model, x: Any, y: Any) -> None:
    data = (x,) if y is None else (x, y)
    model.fit(*data, batch_size=ROWS, epochs=1, verbose=0, shuffle=False)


def _assert_same_weights(reference: keras.Model, model: keras.Model) -> None:
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_each_case_trains_data_parallel_as_itself(case: str) -> None:
    make = CASES[case][0]
    x, y = _batch(case)
    reference, model = _built(make), _built(make)
    initial = [w.copy() for w in model.get_weights()]
    assert replicate_in_place(model, DEVICES) is model and type(model) is type(reference)
    assert model.distribute_strategy.extended.worker_devices == tuple(DEVICES)
    held = variable_devices(model)
    assert held and all(devices.count("CPU:") == 4 for devices in held.values()), held
    if y is not None:  # the same outputs before any step
        np.testing.assert_allclose(
            model.predict(x, batch_size=ROWS, verbose=0),
            reference.predict(x, batch_size=ROWS, verbose=0),
            rtol=1e-5,
            atol=1e-6,
        )
    for made in (reference, model):
        _fit(made, x, y)
    _assert_same_weights(reference, model)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, model.get_weights()))


class HandMeanModel(keras.Model):
    """keras.io's VAE-style step: the loss reduced by hand, ``keras.ops.mean``, not scaled for
    replicas (Keras's own losses are). Averaged gradients keep it exact."""

    def train_step(self, data: Any) -> Any:
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)  # train_on_batch's (x, y, None)
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(self(x, training=True) - y))
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
        return {"loss": loss}


def hand_mean() -> keras.Model:
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    model = HandMeanModel(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    return model


def test_a_loss_averaged_by_hand_is_the_whole_batchs() -> None:
    """Under plain MirroredStrategy this step's gradient would be 4 times the single device's
    (the replicas' gradients are summed, and ``ops.mean`` is not scaled by 1/4)."""
    x, y = _batch("own-train-step")
    reference, model = _built(hand_mean), _built(hand_mean)
    replicate_in_place(model, DEVICES)
    for made in (reference, model):
        _fit(made, x, y)
    _assert_same_weights(reference, model)


def test_train_on_batch_gives_each_replica_its_share() -> None:
    """Keras's own ``train_on_batch`` under a strategy hands every replica the whole batch."""
    x, y = _batch("own-train-step")
    reference, model = _built(hand_mean), _built(hand_mean)
    replicate_in_place(model, DEVICES)
    reference.train_on_batch(x, y)
    model.train_on_batch(x, y)
    _assert_same_weights(reference, model)


def test_a_batch_the_replicas_do_not_divide_is_one_line() -> None:
    x, y = _batch("own-train-step")
    model = _built(custom_step)
    replicate_in_place(model, DEVICES)
    before = model.get_weights()
    with pytest.raises(UsageError, match="does not split into 4 replicas") as exc:
        model.fit(x[:6], y[:6], batch_size=6, epochs=1, verbose=0)
    assert "\n" not in str(exc.value)
    _assert_same_weights_equal(before, model.get_weights())


def _assert_same_weights_equal(before: list[Any], after: list[Any]) -> None:
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_later_compile_with_an_optimizer_made_outside_trains_the_same() -> None:
    """``compile`` after the replication runs in the strategy's scope; an optimizer made
    before (outside it) is mirrored and averages too."""
    x, y = _batch("own-train-step")
    reference, model = _built(custom_step), _built(custom_step)
    optimizer = keras.optimizers.SGD(0.02)
    replicate_in_place(model, DEVICES)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True)
    reference.compile(optimizer=keras.optimizers.SGD(0.02), loss="mse")
    assert model.jit_compile is False
    for made in (reference, model):
        _fit(made, x, y)
    _assert_same_weights(reference, model)


def test_a_model_is_replicated_or_placed_once() -> None:
    model = _built(custom_step)
    replicate_in_place(model, DEVICES[:2])
    assert placed_in_place(model) is not None
    for again in (lambda: replicate_in_place(model, DEVICES), lambda: place_in_place(model, {})):
        with pytest.raises(RewriteError, match="already placed in place"):
            again()


def test_a_data_parallel_plan_applies_to_the_model_itself() -> None:
    """``partition(strategy="data_parallel")`` plans a model with its own ``train_step``, and
    ``plan.apply`` replicates the model itself; a pipeline stays refused in one line."""
    x, y = _batch("own-train-step")
    reference, model = _built(custom_step), _built(custom_step)
    plan = partitioner.partition(model, gpus=4, batch_size=ROWS, strategy="data_parallel")
    assert plan.strategy is not None and plan.strategy.replicas >= 2
    assert plan.apply(model, devices=DEVICES) is model
    for made in (reference, model):
        _fit(made, x, y)
    _assert_same_weights(reference, model)
    with pytest.raises(PartitionError, match="in a training step of its own") as exc:
        partitioner.partition(_built(custom_step), gpus=4, batch_size=ROWS, strategy="pipeline")
    assert "\n" not in str(exc.value)


def test_a_loss_summed_over_the_batch_is_named_in_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The one kind of loss the averaged gradients do not keep exact, said where it can be
    seen: a compiled loss with ``reduction="sum"`` gets 1/R of its gradient."""
    model = _built(custom_step)
    model.compile(
        optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.MeanSquaredError(reduction="sum")
    )
    with caplog.at_level("WARNING", logger="passes.rewrite.in_place"):
        replicate_in_place(model, DEVICES)
    assert "sums over the batch" in caplog.text and "1/4 of the whole batch's" in caplog.text
    x, y = _batch("own-train-step")
    reference = _built(custom_step)
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.MeanSquaredError(reduction="sum")
    )
    initial = [w.copy() for w in reference.get_weights()]
    for made in (reference, model):
        _fit(made, x, y)
    for a, b, i in zip(reference.get_weights(), model.get_weights(), initial, strict=True):
        np.testing.assert_allclose(b - i, (a - i) / 4, rtol=1e-4, atol=1e-7)  # as it says


def test_the_device_report_of_a_replicated_model_lists_every_copy() -> None:
    from passes.rewrite.device_report import device_report

    x, _ = _batch("own-train-step")
    model = _built(custom_step)
    replicate_in_place(model, DEVICES)
    report = device_report(model, x)
    assert report.ops == () and report.variables
    for _, devices in report.variables:
        assert [d.rsplit("/", 1)[-1] for d in devices.split(", ")] == [
            f"device:CPU:{i}" for i in range(4)
        ]
