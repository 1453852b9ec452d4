"""Placement in place (issue 36, :mod:`passes.rewrite.in_place`): models the copying rewrites
cannot take, written as the keras.io examples write them, placed on four logical CPU devices;
outputs, gradients and the weights after one step of the model's own training equal the
unplaced model's, every variable lives on its layer's device, and the backward ops of a layer
run where its forward ops do, whichever step takes the gradients."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from partitioner.core.errors import RewriteError
from passes.rewrite.in_place import (
    in_place_reason,
    place_in_place,
    placed_in_place,
    variable_devices,
)
from passes.trace import placement_units

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]


class TokenAndPositionEmbedding(keras.layers.Layer):
    """keras.io "Text classification with Transformer", verbatim in kind: no get_config."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int) -> None:
        super().__init__()
        self.token_emb = keras.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = keras.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x: Any) -> Any:
        maxlen = keras.ops.shape(x)[-1]
        positions = keras.ops.arange(start=0, stop=maxlen, step=1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, rate: float = 0.1) -> None:
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs: Any, training: bool | None = None) -> Any:
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


def text_classifier() -> keras.Model:
    inputs = keras.layers.Input(shape=(12,), dtype="int32")
    x = TokenAndPositionEmbedding(12, 50, 16)(inputs)
    x = TransformerBlock(16, 2, 16, rate=0.0)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="sparse_categorical_crossentropy")
    return model


class ActivityRegularized(keras.layers.Layer):
    """A loss added inside a layer (keras.io "Making new layers and models via subclassing")."""

    def __init__(self, rate: float = 1e-2) -> None:
        super().__init__()
        self.rate = rate

    def call(self, inputs: Any) -> Any:
        self.add_loss(self.rate * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


class BranchingModel(keras.Model):
    """A subclassed model whose call branches on ``training``, with a shared layer and a loss
    added by a layer."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = keras.layers.Dense(8, activation="tanh")
        self.left = keras.layers.Dense(8)
        self.reg = ActivityRegularized()
        self.head = keras.layers.Dense(1)

    def call(self, x: Any, training: bool | None = None) -> Any:
        h = self.shared(x)
        h = self.shared(self.left(h))  # the shared layer, twice
        if training:
            h = self.reg(h)
        return self.head(h)


def branching() -> keras.Model:
    model = BranchingModel()
    model(np.zeros((2, 8), "float32"))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


class CustomModel(keras.Model):
    """keras.io "Customizing what happens in fit()": its own train_step."""

    def train_step(self, data: Any) -> Any:
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


def custom_step() -> keras.Model:
    inputs = keras.Input(shape=(8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h = keras.layers.Dense(16, activation="relu")(h)
    model = CustomModel(inputs, keras.layers.Dense(1)(h))
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    return model


class GAN(keras.Model):
    """keras.io "DCGAN"-style: two optimizers, its own train_step (no labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.generator = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(8)],
            name="generator",
        )
        self.discriminator = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)],
            name="discriminator",
        )

    def call(self, z: Any, training: bool | None = None) -> Any:
        return self.discriminator(self.generator(z))

    def compile(self, d_optimizer: Any, g_optimizer: Any) -> None:  # type: ignore[override]
        super().compile()
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = keras.losses.BinaryCrossentropy(from_logits=True)

    def train_step(self, real: Any) -> Any:
        z = tf.ones((tf.shape(real)[0], 4)) * 0.5
        fake = self.generator(z)
        with tf.GradientTape() as tape:
            logits = self.discriminator(tf.concat([fake, real], axis=0))
            labels = tf.concat(
                [tf.ones((tf.shape(real)[0], 1)), tf.zeros_like(logits[: tf.shape(real)[0]])], 0
            )
            d_loss = self.loss_fn(labels, logits)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((tf.shape(real)[0], 1)), self(z))
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        return {"d_loss": d_loss, "g_loss": g_loss}


def gan() -> keras.Model:
    model = GAN()
    model(np.zeros((2, 4), "float32"))
    model.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    return model


CASES: dict[str, tuple[Callable[[], keras.Model], Any, Any]] = {
    "no-get-config": (
        text_classifier,
        np.random.default_rng(0).integers(0, 50, (6, 12)).astype("int32"),
        np.array([0, 1, 0, 1, 1, 0]),
    ),
    "subclassed-branching": (
        branching,
        np.random.default_rng(1).normal(size=(6, 8)).astype("float32"),
        np.random.default_rng(2).normal(size=(6, 1)).astype("float32"),
    ),
    "own-train-step": (
        custom_step,
        np.random.default_rng(3).normal(size=(6, 8)).astype("float32"),
        np.random.default_rng(4).normal(size=(6, 1)).astype("float32"),
    ),
    "gan-two-optimizers": (
        gan,
        np.random.default_rng(5).normal(size=(6, 8)).astype("float32"),
        None,
    ),
}


def _built(make: Callable[[], keras.Model]) -> keras.Model:
    keras.utils.set_random_seed(7)
    return make()


def _devices_of(model: keras.Model) -> dict[str, str]:
    units = placement_units(model)
    return {u.name: DEVICES[k % len(DEVICES)] for k, u in enumerate(units)}


@pytest.mark.parametrize("case", list(CASES))
def test_the_models_copying_refuses_are_placed_in_place(case: str) -> None:
    make, x, y = CASES[case]
    assert in_place_reason(_built(make)) is not None  # the copying rewrites refuse each
    reference, model = _built(make), _built(make)
    before = model.predict(x[:2] if y is None else x, verbose=0) if y is not None else None
    layer_devices = _devices_of(model)
    placed = place_in_place(model, layer_devices)
    assert placed is model and type(model) is type(reference)
    assert placed_in_place(model) == layer_devices
    if before is not None:
        np.testing.assert_allclose(model.predict(x, verbose=0), before, rtol=1e-6)
    for unit in placement_units(model):
        for variable in unit.operation.weights:
            assert variable.value.device == layer_devices[unit.name], (unit.name, variable.path)
    data = x if y is None else (x, y)
    initial = [w.copy() for w in model.get_weights()]
    for made in (reference, model):
        made.fit(
            *((data,) if y is None else data), batch_size=len(x), epochs=1, verbose=0, shuffle=False
        )
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert any(not np.array_equal(a, b) for a, b in zip(initial, model.get_weights()))  # trained


def test_gradients_are_the_unplaced_models_and_run_on_each_layers_device() -> None:
    """The user's own GradientTape loop: the same gradients, and every gradient op of a layer
    on its device (a tape puts them where ``tape.gradient`` is called without this)."""
    make, x, y = CASES["own-train-step"]
    reference, model = _built(make), _built(make)
    layer_devices = {u.name: DEVICES[1 + k % 3] for k, u in enumerate(placement_units(model))}
    place_in_place(model, layer_devices)

    def grads(made: keras.Model) -> Any:
        @tf.function
        def step(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((made(x, training=True) - y) ** 2)
            return tape.gradient(loss, made.trainable_variables)

        return step, [g.numpy() for g in step(x, y)]

    _, expected = grads(reference)
    step, got = grads(model)
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-8)
    graph = step.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    matmul_grads = Counter(
        op.device for op in graph.get_operations() if op.type == "MatMul" and "gradient" in op.name
    )
    # three Dense layers on CPU:1-3, two gradient matmuls each (the first layer's input
    # gradient is not needed), none left unplaced or on CPU:0
    assert set(matmul_grads) <= {
        d.replace("/job:localhost/replica:0/task:0", "") for d in DEVICES[1:]
    } | set(DEVICES[1:])
    assert "" not in matmul_grads and sum(matmul_grads.values()) >= 5


def test_a_model_placed_in_place_is_not_placed_again() -> None:
    model = _built(custom_step)
    place_in_place(model, _devices_of(model))
    with pytest.raises(RewriteError, match="already placed in place"):
        place_in_place(model, _devices_of(model))
    assert variable_devices(model)


CUSTOM_STEP_FILE = """
import keras
import tensorflow as tf


class CustomModel(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def build_model():
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape=(64,))
    h = keras.layers.Dense(256, activation="relu", name="d1")(inputs)
    h = keras.layers.Dense(256, activation="relu", name="d2")(h)
    model = CustomModel(inputs, keras.layers.Dense(1, name="d3")(h))
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model
"""


@pytest.mark.slow
def test_the_command_line_plans_a_model_with_its_own_step_and_apply_places_it(
    tmp_path: Any,
) -> None:
    """Issue 36's done-when, from the command line: ``partition`` on a model whose class
    overrides ``train_step`` writes a plan, placed or data parallel, that ``plan.apply`` uses on
    the model itself, and a program (``--emit``) that makes the model with the file's own
    builder and places it so, run here as written; one step of the model's own ``fit`` equals
    the unplaced model's each time. ``--pipeline`` is one line."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import partitioner
    from tests.emitted import import_emitted

    repo = Path(__file__).resolve().parents[2]
    (tmp_path / "custom.py").write_text(CUSTOM_STEP_FILE)
    env = {**os.environ, "PYTHONPATH": str(repo), "PARTITIONER_CACHE_DIR": str(tmp_path / "c")}

    def run(*args: str) -> Any:
        return subprocess.run(
            [sys.executable, "-m", "partitioner", "custom.py", "--gpus", "2", *args],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600, check=False,
        )  # fmt: skip

    refused = run("--pipeline")
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "overrides train_step: Plan.apply places such a model itself" in refused.stderr
    x = np.random.default_rng(0).normal(size=(32, 64)).astype("float32")
    y = np.random.default_rng(1).normal(size=(32, 1)).astype("float32")
    source = import_emitted(tmp_path / "custom.py")
    for strategy in ("placed", "data-parallel"):
        out, emitted = f"{strategy}.json", f"{strategy}_model.py"
        done = run("--device-type", "cpu", "--strategy", strategy, "--out", out, "--emit", emitted)
        assert done.returncode == 0, done.stderr
        plan = partitioner.load_plan(tmp_path / out)
        module = import_emitted(tmp_path / emitted)
        assert "copied from its layers' configs" in (module.__doc__ or "")
        for model in (source.build_model(), module.build_model()):
            reference = source.build_model()
            if not placed_in_place(model):
                assert plan.apply(model, devices=DEVICES[:2]) is model
            if strategy == "placed":
                assert len(set(placed_in_place(model).values())) == 2  # a real split
            else:
                assert model.distribute_strategy.num_replicas_in_sync == 1  # sees one replica
                assert len(model.distribute_strategy.extended.worker_devices) == 2
            for made in (reference, model):
                made.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
            for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
                np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_an_embeddings_gradient_runs_on_its_device() -> None:
    """A layer with integer inputs (an ``Embedding``) has nothing to differentiate but its
    table: its backward still runs on its device, and its gradient stays ``IndexedSlices``."""
    keras.utils.set_random_seed(0)
    ids = keras.Input((3,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(10, 4, name="emb")(ids))
    model = keras.Model(ids, keras.layers.Dense(2, name="out")(pooled))
    devices = {u.name: DEVICES[2] for u in placement_units(model)}
    devices["emb"] = DEVICES[1]
    place_in_place(model, devices)
    table = model.get_layer("emb").embeddings

    @tf.function
    def step(x: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        gradient = tape.gradient(loss, table.value)
        assert isinstance(gradient, tf.IndexedSlices)
        assert gradient.values.op.device.endswith("CPU:1"), gradient.values.op.device
        return gradient.values

    assert step(tf.constant([[1, 2, 2]])).shape == (3, 4)


class OwnStepModel(keras.Model):
    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


def _critic() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(16, activation="tanh")(inputs)
    h = keras.layers.Dense(16, activation="tanh")(h)
    return OwnStepModel(inputs, keras.layers.Dense(1)(h))


def test_gradients_taken_twice_and_of_second_order_equal_the_unplaced_models() -> None:
    """Campaign 34w b (A): a persistent tape asked twice (keras.io's CycleGAN) and a WGAN-GP
    gradient penalty (a gradient of a gradient) raised "A non-persistent GradientTape can only
    be used to compute one set of gradients" on a model placed in place."""
    reference, model = _critic(), _critic()
    place_in_place(model, {u.name: DEVICES[k % 3] for k, u in enumerate(placement_units(model))})
    x = tf.constant(np.random.default_rng(1).normal(size=(8, 6)).astype("float32"))

    def twice(made: keras.Model) -> list[Any]:
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(made(x, training=True) ** 2)
        first = tape.gradient(loss, made.trainable_variables[:2])
        return [*first, *tape.gradient(loss, made.trainable_variables[2:])]

    def penalty(made: keras.Model) -> list[Any]:
        with tf.GradientTape() as outer:
            with tf.GradientTape() as inner:
                inner.watch(x)
                out = made(x, training=True)
            gp = tf.reduce_mean((tf.norm(inner.gradient(out, x), axis=1) - 1.0) ** 2)
        return outer.gradient(gp, made.trainable_variables)

    for taken in (twice, penalty, tf.function(twice), tf.function(penalty)):
        for a, b in zip(taken(reference), taken(model), strict=True):
            if a is None:  # the last bias: no part in a gradient with respect to the input
                assert b is None or not np.any(b)
                continue
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


class ToComplex(keras.layers.Layer):
    def call(self, x: Any) -> Any:
        return tf.signal.fft(tf.complex(x, 0.5 * x))


class FromComplex(keras.layers.Layer):
    def call(self, c: Any) -> Any:
        return tf.abs(c)


def test_a_gradient_through_a_complex_output_is_kept() -> None:
    """Campaign 34w b (B): a layer returning a complex tensor (``tf.signal.fft``) cut the
    gradient of every layer before it to zero, without a word."""

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((8,))
        h = FromComplex()(ToComplex()(keras.layers.Dense(8, name="d1")(inputs)))
        return OwnStepModel(inputs, keras.layers.Dense(1, name="d2")(h))

    reference, model = build(), build()
    place_in_place(model, _devices_of(model))
    x = np.random.default_rng(0).normal(size=(8, 8)).astype("float32")

    def grads(made: keras.Model) -> list[Any]:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((made(x, training=True) - 1.0) ** 2)
        return tape.gradient(loss, made.trainable_variables)

    expected, got = grads(reference), grads(model)
    assert float(tf.norm(expected[0])) > 1.0  # the case: a real gradient before the fft
    for a, b in zip(expected, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_an_optimizer_built_before_the_placement_still_trains() -> None:
    """Campaign 34w a (D1): a model trained once (its optimizer built), then placed in place:
    the next ``fit`` raised Keras's "Unknown variable" (the optimizer keys its variables by the
    ``tf.Variable`` the move made anew). It trains on, as the unplaced model does."""
    make, x, y = CASES["own-train-step"]
    reference, model = _built(make), _built(make)
    for made in (reference, model):
        made.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    place_in_place(model, _devices_of(model))
    for made in (reference, model):
        made.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


class DoubledPrediction(keras.Model):
    def predict_step(self, data: Any) -> Any:
        return super().predict_step(data) * 2.0


def test_a_model_with_its_own_predict_step_keeps_it() -> None:
    """Campaign 34x c (D1): a model overriding ``predict_step`` (or ``compute_metrics``,
    ``get_metrics_result``) was copied and the copy predicted without the override, without a
    word. Such a model is placed in place, its methods kept."""
    import partitioner

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, activation="relu", name="d1")(inputs)
        return DoubledPrediction(inputs, keras.layers.Dense(4, name="d2")(hidden))

    reference, model = build(), build()
    assert "overrides predict_step" in str(in_place_reason(model))
    plan = partitioner.partition(model, gpus=2, batch_size=8, strategy="placed")
    assert plan.apply(model, devices=DEVICES[:2]) is model
    x = np.random.default_rng(0).normal(size=(8, 16)).astype("float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), reference.predict(x, verbose=0))


class Inner(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.a = keras.layers.Dense(32, activation="relu", name="a")
        self.b = keras.layers.Dense(32, name="b")

    def call(self, x: Any) -> Any:
        return self.b(self.a(x))


class Outer(keras.Model):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = Inner(name="inner")
        self.bn = keras.layers.BatchNormalization(name="bn")
        self.head = keras.layers.Dense(3, name="head")

    def call(self, x: Any, training: bool = False) -> Any:
        return self.head(self.bn(self.inner(x), training=training))

    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


def test_a_model_never_built_is_built_then_placed() -> None:
    """Campaign 34x c (D2): a subclassed model never called, given to ``plan.apply``, came back
    unbuilt; its first call made every variable on the default device while its ops ran on the
    planned ones. It is built on a sample batch first, its state kept, then placed."""
    import partitioner

    planned = Outer(name="outer")
    plan = partitioner.partition(
        planned, gpus=2, batch_size=8, input_shape=(16,), strategy="placed"
    )
    devices = set(plan.assignment.values())
    assert len(devices) == 2  # the case: a real split
    model = Outer(name="outer")
    assert not model.built
    assert plan.apply(model, devices=DEVICES[:2]) is model
    for unit in placement_units(model):
        device = DEVICES[plan.assignment[unit.name]]
        for variable in unit.operation.weights:
            assert variable.value.device == device, (unit.name, variable.path)


def test_xla_asked_for_after_the_placement_is_turned_off_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Campaign 34x b (K): ``compile(jit_compile=True)`` after a placement in place failed at
    the first ``fit`` with TensorFlow's traceback (XLA ignores ``tf.device``). XLA is turned off
    with the copies' warning, and the model trains as the unplaced one does."""
    make, x, y = CASES["own-train-step"]
    reference, model = _built(make), _built(make)
    place_in_place(model, _devices_of(model))
    with caplog.at_level("WARNING", logger="passes.rewrite.in_place"):
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    assert "jit_compile is turned off" in caplog.text and model.jit_compile is False
    for made in (reference, model):
        made.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    for a, b in zip(reference.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    gan_model = _built(gan)  # a model whose own compile takes other arguments
    place_in_place(gan_model, _devices_of(gan_model))
    gan_model.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    assert gan_model.jit_compile is False


@pytest.mark.parametrize("case", list(CASES))
def test_the_device_report_shows_every_layer_forward_and_backward_on_its_device(case: str) -> None:
    """Issue 36's check of every claim: the device report (passes.rewrite.device_report) reads
    the traced step's ops, and every placed layer's forward and backward ops, and every
    variable, are on the layer's device."""
    from passes.rewrite.device_report import device_report

    make, x, _ = CASES[case]
    model = _built(make)
    layer_devices = _devices_of(model)
    place_in_place(model, layer_devices)
    report = device_report(model, x if case != "gan-two-optimizers" else x[:, :4])
    assert report.off_device(layer_devices) == ()
    phases = {(entry.layer, entry.phase) for entry in report.ops}
    trained = [u.name for u in placement_units(model) if u.operation.trainable_weights]
    assert trained and all({(n, "forward"), (n, "backward")} <= phases for n in trained), phases
    held = dict(report.variables)
    for unit in placement_units(model):
        for variable in unit.operation.weights:
            assert held[variable.path] == variable.value.device == layer_devices[unit.name]
    wrong = {name: DEVICES[(DEVICES.index(d) + 1) % 4] for name, d in layer_devices.items()}
    # the check can fail: each group of ops (one device each) is off a wrong device map
    assert len(report.off_device(wrong)) == sum(1 for entry in report.ops if entry.devices)
