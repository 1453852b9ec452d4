"""Which forward tensors each op class keeps for the backward, counted once per tensor (the rule
documented in cost_models/estimate/memory.py), on small traced models; and the peak that counts
a device's largest transient once."""

from __future__ import annotations

import keras
import pytest

from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import layer_memory
from partitioner.core.ir import Graph, peak_bytes
from partitioner.solvers.base import device_memory_bytes
from passes.trace import trace_model

B = 8
F32 = 4


def _saved(model: keras.Model) -> dict[str, int]:
    graph = trace_model(model, batch_size=B).graph
    return {m.layer: m.activation_bytes for m in layer_memory(graph)}


def _graph(model: keras.Model) -> Graph:
    return trace_model(model, batch_size=B).graph


@pytest.fixture(scope="module")
def dense_stack() -> dict[str, int]:
    """input (32) -> dense (64) -> relu -> dense (10) -> softmax."""
    x = keras.Input((32,), name="x")
    h = keras.layers.Dense(64, name="dense1")(x)
    h = keras.layers.ReLU(name="relu")(h)
    h = keras.layers.Dense(10, name="dense2")(h)
    y = keras.layers.Softmax(name="softmax")(h)
    return _saved(keras.Model(x, y))


def test_relu_keeps_its_output_once_for_two_readers(dense_stack: dict[str, int]) -> None:
    # ReluGrad reads it, and so does dense2's weight gradient: one tensor, counted once
    assert dense_stack["relu"] == B * 64 * F32


def test_matmul_keeps_its_input_and_bias_add_nothing(dense_stack: dict[str, int]) -> None:
    # dense1's output feeds the ReLU, whose gradient reads the ReLU's output, not its input;
    # dense1 holds only the model input x (a glue op merged into its first consumer), which
    # its weight gradient reads
    assert dense_stack["dense1"] == B * 32 * F32
    assert dense_stack["dense2"] == 0


def test_softmax_keeps_its_output(dense_stack: dict[str, int]) -> None:
    assert dense_stack["softmax"] >= B * 10 * F32


@pytest.fixture(scope="module")
def conv_stack() -> dict[str, int]:
    """input 8x8x3 -> conv 3x3x4 (no bias) -> batch norm -> add (with itself) -> max pool."""
    x = keras.Input((8, 8, 3), name="x")
    c = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv")(x)
    n = keras.layers.BatchNormalization(name="bn")(c)
    a = keras.layers.Add(name="add")([n, n])
    p = keras.layers.MaxPooling2D(2, name="pool")(a)
    y = keras.layers.Flatten(name="flat")(p)
    return _saved(keras.Model(x, y))


def test_conv_output_is_kept_for_the_batch_norm(conv_stack: dict[str, int]) -> None:
    # the batch norm's gradient reads its input (the conv's output): once, in the conv layer,
    # beside the model input the conv's filter gradient reads (merged into the conv layer)
    assert conv_stack["conv"] == B * 8 * 8 * 4 * F32 + B * 8 * 8 * 3 * F32


def test_add_keeps_nothing_and_max_pool_keeps_input_and_output(conv_stack: dict[str, int]) -> None:
    assert conv_stack["add"] == B * 8 * 8 * 4 * F32  # MaxPoolGrad reads the pool's input
    assert conv_stack["pool"] == B * 4 * 4 * 4 * F32  # ... and its output


def test_batch_norm_transients_count_once_per_device() -> None:
    x = keras.Input((8, 8, 3), name="x")
    h = x
    for i in range(3):
        h = keras.layers.Conv2D(4, 3, padding="same", name=f"conv{i}")(h)
        h = keras.layers.BatchNormalization(name=f"bn{i}")(h)
    costed = cost_graph(_graph(keras.Model(x, h)), device_type="v100", num_devices=1)
    mem = costed.layer_memory
    transients = [m.transient_bytes for m in mem]
    assert sum(1 for t in transients if t > 0) >= 2  # each batch norm adds partial gradients
    peak = peak_bytes(mem)
    assert peak == sum(m.total_bytes for m in mem) + max(transients)
    assert device_memory_bytes((0,) * len(mem), costed.problem()) == [peak]


def test_gelu_keeps_three_intermediates_not_its_input() -> None:
    """Keras's exact GELU, ``0.5 x erfc(-x / sqrt 2)``: its backward reads ``0.5 x``,
    ``-x / sqrt 2`` and the ``erfc``; ``x`` itself and the ``Neg`` are read only by the
    gradients of the constants, which TensorFlow prunes (cost_models/estimate/memory.py)."""
    x = keras.Input((32,), name="x")
    h = keras.layers.Dense(16, activation="gelu", name="ffn")(x)
    y = keras.layers.Dense(4, name="out")(h)
    graph = _graph(keras.Model(x, y))
    saved = {m.layer: m.activation_bytes for m in layer_memory(graph)}
    # the model input (ffn's weight gradient), the three GELU tensors, and the GELU's output
    # (read by out's weight gradient; kept in the layer that produced it)
    assert saved["ffn"] == B * 32 * F32 + 3 * B * 16 * F32 + B * 16 * F32
    # its output, which the (synthetic) loss's gradient reads, and the scalar loss (fetched)
    assert saved["out"] == B * 4 * F32 + F32
    # the IR's raw count also has x and -x, read by the pruned branches
    raw = {n.name: n.activation_bytes for n in graph.layer_graph.nodes}
    assert raw["ffn"] == saved["ffn"] + 2 * B * 16 * F32
