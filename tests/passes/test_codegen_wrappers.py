"""passes.rewrite.codegen: wrapper layers (a sublayer serialized in their config) emit code that builds.

Issue 34 (D9): ``--emit`` of any model with ``keras.layers.TimeDistributed`` wrote a module whose
``build_model()`` raised ``KeyError: 'layer'``. The emitter checked that ``from_config`` rebuilt the
layer by calling it on the very config dict it then wrote out, and ``Wrapper.from_config`` pops
``"layer"`` from the dict it is given. A wrapper is now written as a call that makes its sublayers
from their own class and config (``TimeDistributed(layer=keras.layers.Dense(...))``), every probe
gets a copy, and a wrapper that cannot be rebuilt is refused in one line that names it.

Each model is emitted for a ``placed`` and a ``pipeline`` plan over two logical CPU devices, the
module is imported from its file, built, given the original's weights and must compute the
original's outputs on a random batch.
"""

from __future__ import annotations

import itertools
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import partitioner
from partitioner.cli.loader import load_model
from partitioner.core.errors import RewriteError
from passes.rewrite.codegen import emit_placed_module, emit_plan_module, write_placed_module
from passes.trace import placement_units
from tests.emitted import import_emitted

CPU = ["/device:CPU:0", "/device:CPU:1"]
BATCH = 8
TOL = 1e-5
_counter = itertools.count()


def compiled(inputs: Any, outputs: Any, name: str) -> keras.Model:
    model = keras.Model(inputs, outputs, name=name)
    model.compile(optimizer="adam", loss="mse", jit_compile=False)
    return model


def td_dense() -> keras.Model:
    inp = keras.Input(shape=(10, 4), name="x")
    h = keras.layers.TimeDistributed(
        keras.layers.Dense(8, activation="relu", name="inner"), name="td"
    )(inp)
    h = keras.layers.Flatten(name="flat")(h)
    h = keras.layers.Dense(8, name="d1")(h)
    return compiled(inp, keras.layers.Dense(2, name="d2")(h), "td_dense")


def td_conv() -> keras.Model:
    inp = keras.Input(shape=(4, 8, 8, 3), name="frames")
    conv = keras.layers.Conv2D(6, 3, padding="same", activation="relu")
    h = keras.layers.TimeDistributed(conv, name="td_conv")(inp)
    h = keras.layers.TimeDistributed(keras.layers.GlobalAveragePooling2D(), name="td_pool")(h)
    h = keras.layers.LSTM(8, name="lstm")(h)
    return compiled(inp, keras.layers.Dense(3, name="head")(h), "td_conv")


def bidirectional_lstm() -> keras.Model:
    inp = keras.Input(shape=(7, 5), name="seq")
    h = keras.layers.Bidirectional(
        keras.layers.LSTM(6, return_sequences=True), merge_mode="sum", name="bi"
    )(inp)
    backward = keras.layers.GRU(4, go_backwards=True)
    h = keras.layers.Bidirectional(keras.layers.GRU(4), backward_layer=backward, name="bi2")(h)
    return compiled(inp, keras.layers.Dense(2, name="out")(h), "bidirectional_lstm")


def masking_td() -> keras.Model:
    inp = keras.Input(shape=(10, 4), name="x")
    h = keras.layers.Masking(mask_value=0.0, name="mask")(inp)
    h = keras.layers.TimeDistributed(keras.layers.Dense(8), name="td")(h)
    h = keras.layers.GRU(8, name="gru")(h)
    h = keras.layers.Dense(8, name="d1")(h)
    return compiled(inp, keras.layers.Dense(2, name="d2")(h), "masking_td")


def rnn_of_a_cell() -> keras.Model:
    inp = keras.Input(shape=(6, 3), name="x")
    h = keras.layers.RNN(keras.layers.LSTMCell(5), name="rnn")(inp)
    return compiled(inp, keras.layers.Dense(2, name="out")(h), "rnn_of_a_cell")


MODELS: dict[str, Callable[[], keras.Model]] = {
    "td_dense": td_dense,
    "td_conv": td_conv,
    "bidirectional_lstm": bidirectional_lstm,
    "masking_td": masking_td,
    "rnn_of_a_cell": rnn_of_a_cell,
}



def random_batch(model: keras.Model) -> np.ndarray:
    rng = np.random.default_rng(3)
    shape = (BATCH, *model.inputs[0].shape[1:])
    x = rng.standard_normal(shape).astype("float32")
    if model.name == "masking_td":
        x[: BATCH // 2, 6:] = 0.0  # masked steps
    return x


def emit_build_compare(model: keras.Model, strategy: str, tmp_path: Path, **kwargs: Any) -> str:
    """Emit ``model``'s module for a ``strategy`` plan, build it and compare its outputs."""
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, strategy=strategy)
    source = emit_plan_module(model, plan, devices=CPU, **kwargs)
    module = import_emitted(write_placed_module(tmp_path / f"placed_{next(_counter)}.py", source))
    built = module.build_model()
    module.load_original_weights(built, model)
    x = random_batch(model)
    got = np.asarray(built(x, training=False))
    want = np.asarray(model(x, training=False))
    assert np.max(np.abs(got - want)) < TOL
    return source


@pytest.mark.parametrize("strategy", ["placed", "pipeline"])
@pytest.mark.parametrize("name", list(MODELS))
def test_a_wrapper_model_emits_a_module_that_builds_and_computes_the_same(
    tmp_path: Path, name: str, strategy: str
) -> None:
    model = MODELS[name]()
    source = emit_build_compare(model, strategy, tmp_path)
    # The sublayers are written as calls of their own class, not as a from_config dict.
    assert ".from_config(" not in source.split("def make_layers")[1].split("class PlacedModel")[0]


def test_the_emitted_wrapper_names_its_sublayer(tmp_path: Path) -> None:
    source = emit_build_compare(td_dense(), "placed", tmp_path)
    assert "keras.layers.TimeDistributed(" in source
    assert "layer=keras.layers.Dense(name='inner', units=8, activation='relu')" in source


def test_emitting_leaves_the_wrapper_config_whole(tmp_path: Path) -> None:
    """The probes get copies: the layer's config is what it was (``layer`` not popped)."""
    model = td_dense()
    before = model.get_layer("td").get_config()
    emit_build_compare(model, "placed", tmp_path)
    assert model.get_layer("td").get_config() == before


CUSTOM_MODEL = '''
import keras


@keras.saving.register_keras_serializable(package="wrapped_test")
class Scale(keras.layers.Layer):
    def __init__(self, factor, **kwargs):
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * self.factor

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "factor": self.factor}


class Repeat(keras.layers.Wrapper):
    """A wrapper whose config leaves out an argument: it cannot be rebuilt."""

    def __init__(self, layer, times, **kwargs):
        super().__init__(layer, **kwargs)
        self.times = times

    def call(self, x):
        for _ in range(self.times):
            x = self.layer(x)
        return x

    def compute_output_shape(self, input_shape):
        return self.layer.compute_output_shape(input_shape)


def build_model():
    inp = keras.Input(shape=(5, 3), name="x")
    h = keras.layers.TimeDistributed(Scale(2.5, name="scale"), name="td")(inp)
    h = keras.layers.TimeDistributed(keras.layers.Dense(4), name="td_dense")(h)
    h = {WRAP}
    h = keras.layers.Flatten(name="flat")(h)
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(h), name="custom_wrapped")
    model.compile(optimizer="adam", loss="mse")
    return model
'''


def custom_model(tmp_path: Path, wrap: str) -> tuple[keras.Model, Path]:
    path = tmp_path / f"custom_wrapped_{next(_counter)}.py"
    path.write_text(textwrap.dedent(CUSTOM_MODEL).replace("{WRAP}", wrap), encoding="utf-8")
    return load_model(str(path)), path


def test_a_sublayer_of_the_users_class_is_made_from_the_model_file(tmp_path: Path) -> None:
    model, path = custom_model(tmp_path, "h")
    source = emit_build_compare(model, "placed", tmp_path, model_source=path)
    assert "layer=model_source().Scale(name='scale', factor=2.5)" in source


def test_a_wrapper_that_cannot_be_rebuilt_is_refused_in_one_line(tmp_path: Path) -> None:
    model, path = custom_model(tmp_path, 'Repeat(keras.layers.Dense(4), 2, name="rep")(h)')
    # partition() refuses it already (plan.apply would fail); the emitter refuses it on its own.
    layer_devices = {u.name: CPU[k % 2] for k, u in enumerate(placement_units(model))}
    with pytest.raises(RewriteError, match="layer 'rep'") as error:
        emit_placed_module(model, layer_devices, model_source=path)
    assert "\n" not in str(error.value)
