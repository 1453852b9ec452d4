"""The layers that are not exact under micro-batching: one table, read alike by its two consumers.

The planner (``partitioner.api``) warns by the traced layers' class names, the pipeline rewrite
(``passes.rewrite.pipeline``) by the built model's Keras layers; both must name every class of
``partitioner.core.microbatch.INEXACT_LAYERS``.
"""

from __future__ import annotations

from typing import Any

import keras
import pytest

from partitioner import api
from partitioner.core.microbatch import (
    INEXACT_LAYERS,
    INEXACT_UNDER_MICROBATCHES,
    InexactKind,
    inexact_class_names,
)
from passes.rewrite import pipeline as rewrite

# A layer of each class that does what makes it inexact (a rate above 0).
BUILD: dict[str, Any] = {
    "BatchNormalization": lambda: keras.layers.BatchNormalization(),
    "Dropout": lambda: keras.layers.Dropout(0.5),
    "SpatialDropout1D": lambda: keras.layers.SpatialDropout1D(0.5),
    "SpatialDropout2D": lambda: keras.layers.SpatialDropout2D(0.5),
    "SpatialDropout3D": lambda: keras.layers.SpatialDropout3D(0.5),
    "GaussianDropout": lambda: keras.layers.GaussianDropout(0.5),
    "GaussianNoise": lambda: keras.layers.GaussianNoise(0.5),
    "AlphaDropout": lambda: keras.layers.AlphaDropout(0.5),
    "Masking": lambda: keras.layers.Masking(),
}


def test_the_table_names_keras_layer_classes_once() -> None:
    names = [layer.class_name for layer in INEXACT_LAYERS]
    assert len(names) == len(set(names)) == len(INEXACT_UNDER_MICROBATCHES)
    assert set(names) == set(BUILD)
    for name in names:
        assert issubclass(getattr(keras.layers, name), keras.layers.Layer)


def test_the_planner_reads_the_table() -> None:
    assert api.INEXACT_UNDER_MICROBATCHES is INEXACT_UNDER_MICROBATCHES


@pytest.mark.parametrize("layer", INEXACT_LAYERS, ids=lambda x: x.class_name)
def test_the_rewrite_flags_every_class_of_the_table(layer: Any) -> None:
    built = BUILD[layer.class_name]()
    assert type(built).__name__ == layer.class_name
    statistics = rewrite._uses_batch_statistics(built)
    random = rewrite._draws_randomness(built)
    assert statistics == (layer.kind is InexactKind.BATCH_STATISTICS)
    assert random == (layer.kind is InexactKind.RANDOMNESS)


def test_the_rewrite_flags_batch_statistics_by_the_table_alone() -> None:
    assert rewrite._BATCH_STATISTICS == inexact_class_names(InexactKind.BATCH_STATISTICS)
    assert not rewrite._uses_batch_statistics(keras.layers.LayerNormalization())
    assert not rewrite._draws_randomness(keras.layers.Dropout(0.0))


@pytest.mark.parametrize("layer", INEXACT_LAYERS, ids=lambda x: x.class_name)
def test_a_model_with_an_inexact_layer_is_warned_about_it(layer: Any) -> None:
    shape = {"SpatialDropout1D": (6, 3), "SpatialDropout3D": (4, 4, 4, 3)}.get(
        layer.class_name, (4, 4, 3)
    )
    inputs = keras.Input(shape=shape)
    model = keras.Model(inputs, BUILD[layer.class_name]()(inputs))
    warned = rewrite.pipeline_warnings(model, 2)
    assert len(warned) == 1 and model.layers[1].name in warned[0], warned
    assert rewrite.pipeline_warnings(model, 1) == ()


# -- nested layers and exact ones (issue 17, group 6) -------------------------------------------


class Block(keras.layers.Layer):
    """A block holding a Dense and a layer of the table in attributes."""

    def __init__(self, inner: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(4)
        self.inner = inner if inner is not None else keras.layers.Dropout(0.5)

    def call(self, inputs: Any, training: Any = None) -> Any:
        return self.inner(self.dense(inputs), training=training)


def _frozen_batchnorm() -> Any:
    layer = keras.layers.BatchNormalization()
    layer.trainable = False
    return layer


def _model(kind: str) -> keras.Model:
    inputs = keras.Input((4,))
    if kind == "block-dropout":
        h = Block(name="block")(inputs)
    elif kind == "block-batchnorm":
        h = Block(keras.layers.BatchNormalization(), name="block")(inputs)
    elif kind == "nested-model":
        inner = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dropout(0.5, name="drop")],
            name="inner",
        )
        h = inner(inputs)
    elif kind == "rate-0":
        h = keras.layers.Dropout(0.0)(inputs)
    elif kind == "noise-0":
        h = keras.layers.GaussianNoise(0.0)(inputs)
    elif kind == "frozen-batchnorm":
        h = _frozen_batchnorm()(inputs)
    elif kind == "block-frozen-batchnorm":
        h = Block(_frozen_batchnorm(), name="block")(inputs)
    else:
        raise KeyError(kind)
    return keras.Model(inputs, keras.layers.Dense(2)(h), name=kind.replace("-", "_"))


INEXACT = {
    "block-dropout": ("Dropout", "block/dropout"),
    "block-batchnorm": ("BatchNormalization", "block/batch_normalization"),
    "nested-model": ("Dropout", "drop"),
}
EXACT = ("rate-0", "noise-0", "frozen-batchnorm", "block-frozen-batchnorm")


@pytest.mark.parametrize("kind", list(INEXACT))
def test_nested_inexact_layers_are_found_by_the_planner_and_the_rewrite(kind: str) -> None:
    from passes.checks import inexact_layers

    keras.backend.clear_session()
    model = _model(kind)
    found = [(why.class_name, name) for why, name in inexact_layers(model)]
    cls, name = INEXACT[kind]
    assert len(found) == 1 and found[0][0] == cls and found[0][1].startswith(name.split("/")[0])
    warned = api._microbatch_warnings(inexact_layers(model), 2)
    assert len(warned) == 1 and warned[0].startswith(f"NOT EXACT: {cls} (")
    rewrite_warned = rewrite.pipeline_warnings(model, 2)
    assert len(rewrite_warned) == 1, rewrite_warned


@pytest.mark.parametrize("kind", EXACT)
def test_exact_layers_are_warned_about_by_neither(kind: str) -> None:
    from passes.checks import inexact_layers

    model = _model(kind)
    assert inexact_layers(model) == ()
    assert api._microbatch_warnings(inexact_layers(model), 4, 2) == ()
    assert rewrite.pipeline_warnings(model, 2) == ()
