"""How many gradient tensors each layer has (``LayerInfo.trainable_tensors``): replicas
all-reduce one tensor per trainable variable, and a measured all-reduce is priced by that count
(:func:`cost_models.estimate.collectives.measured_all_reduce_s`)."""

from __future__ import annotations

import keras

from passes.trace import trace_model


def test_each_trainable_variable_is_one_gradient_tensor() -> None:
    inputs = keras.Input((5,), dtype="int32", name="ids")
    embedded = keras.layers.Embedding(40, 8, name="embed")(inputs)
    flat = keras.layers.Flatten(name="flat")(embedded)
    hidden = keras.layers.Dense(6, name="hidden")(flat)
    normed = keras.layers.BatchNormalization(name="norm")(hidden)
    frozen = keras.layers.Dense(3, name="frozen")
    outputs = frozen(normed)
    frozen.trainable = False
    graph = trace_model(keras.Model(inputs, outputs), batch_size=4).graph
    layers = {info.name: info for info in graph.layers}
    assert layers["embed"].trainable_tensors == 1
    assert layers["embed"].dense_gradient_tensors == 0  # its gradient is IndexedSlices
    assert layers["hidden"].trainable_tensors == layers["hidden"].dense_gradient_tensors == 2
    assert layers["norm"].trainable_tensors == 2  # gamma, beta; not the moving statistics
    assert layers["flat"].trainable_tensors == 0 and layers["frozen"].trainable_tensors == 0
