"""partitioner.core.batching on real traces of a CNN with BatchNormalization: the graph derived
from two traces equals a real trace at a third batch, op for op (batches 2 and up; at batch 1
TensorFlow folds BatchNormalization's gradient reductions to other constants, a few bytes each,
noted in issue 35)."""

from __future__ import annotations

import keras
import pytest

from partitioner.core.batching import graph_at_batch
from partitioner.core.ir import Graph
from passes.trace import trace_model


def _small_cnn() -> keras.Model:
    inputs = keras.Input(shape=(12, 12, 3), name="image")
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv_1")(inputs)
    h = keras.layers.BatchNormalization(name="bn_1")(h)
    h = keras.layers.ReLU(name="relu_1")(h)
    h = keras.layers.MaxPooling2D(2, name="pool_1")(h)
    h = keras.layers.Conv2D(16, 3, padding="same", name="conv_2")(h)
    h = keras.layers.BatchNormalization(name="bn_2")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    outputs = keras.layers.Dense(5, activation="softmax", name="classifier")(h)
    model = keras.Model(inputs, outputs, name="bn_cnn")
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    return model


@pytest.fixture(scope="module")
def traces() -> dict[int, Graph]:
    model = _small_cnn()
    return {batch: trace_model(model, batch_size=batch).graph for batch in (2, 3, 8, 16)}


def test_a_derived_graph_equals_a_real_trace_at_a_third_batch(traces: dict[int, Graph]) -> None:
    a, b = traces[16], traces[8]
    for batch in (2, 3):
        derived = graph_at_batch(a, b, batch)
        real = traces[batch]
        assert derived is not None
        assert derived.ops == real.ops  # every op's FLOPs, bytes, shapes, dtypes
        assert derived.edges == real.edges
        assert derived == real
    assert graph_at_batch(traces[2], traces[3], 16) == traces[16]

