"""passes.weightless: a model built without its weights traces to the same graph, plans, and
applies with its weights created on their devices; the strategy search's other batch sizes come
exactly from two traces (partitioner.core.batching)."""

from __future__ import annotations

import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from partitioner.core.batching import graph_at_batch
from partitioner.core.ir import Graph
from partitioner.core.strategy import Family
from passes.trace import trace_model
from passes.weightless import (
    WeightlessBuildError,
    build_without_weights,
    deferred_variables,
    is_weightless,
    materialize,
)

CPU = [f"/device:CPU:{i}" for i in range(4)]
LOOPS = {"While", "StatelessWhile"}
BATCH = 8
REL_TOL = 1e-5


def decoder() -> keras.Model:
    """Two pre-norm causal blocks (embedding, attention, FFN, head): the shapes of a GPT."""
    tokens = keras.Input((16,), dtype="int32", name="tokens")
    x = keras.layers.Embedding(300, 32, name="embed")(tokens)
    for b in range(2):
        h = keras.layers.RMSNormalization(name=f"norm_{b}")(x)
        h = keras.layers.MultiHeadAttention(2, 16, name=f"attn_{b}")(h, h, use_causal_mask=True)
        x = keras.layers.Add(name=f"add_{b}")([x, h])
        h = keras.layers.Dense(64, activation="gelu", name=f"ffn_in_{b}")(x)
        x = keras.layers.Add(name=f"res_{b}")([x, keras.layers.Dense(32, name=f"ffn_out_{b}")(h)])
    return keras.Model(tokens, keras.layers.Dense(300, name="head")(x), name="decoder")


def cnn() -> keras.Model:
    """Convolutions with BatchNorm (non-trainable statistics) and a dense head."""
    x = keras.Input((16, 16, 3), name="image")
    h = keras.layers.Conv2D(8, 3, name="conv")(x)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(keras.layers.ReLU(name="relu")(h))
    return keras.Model(x, keras.layers.Dense(4, name="head")(h), name="cnn")


def mlp() -> keras.Model:
    x = keras.Input((12,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="fc0")(x)
    h = keras.layers.LayerNormalization(name="norm")(h)
    h = keras.layers.Dense(32, activation="relu", name="fc1")(h)
    return keras.Model(x, keras.layers.Dense(4, name="head")(h), name="mlp")


def lstm() -> keras.Model:
    x = keras.Input((10, 6), name="seq")
    h = keras.layers.LSTM(16, return_sequences=True, name="lstm")(x)
    return keras.Model(x, keras.layers.Dense(3, name="head")(h), name="lstm")


def _compute_ops(graph: Graph) -> list[tuple[str, str, int, int]]:
    """(type, layer, FLOPs, bytes) of every op that computes, loops aside. The weight reads,
    captures and loop plumbing differ: a variable read in one trace, an argument passed in the
    other; an LSTM's forward loop is a ``While`` reading its variables in one and a
    ``StatelessWhile`` carrying the weights in the other (same FLOPs, compared by layer)."""
    return sorted(
        (op.op_type, op.layer or "", op.flops, op.output_bytes)
        for op in graph.ops
        if op.flops and op.op_type not in LOOPS
    )


def _flops_by_layer(graph: Graph) -> dict[str, int]:
    totals: dict[str, int] = {}
    for op in graph.ops:
        totals[op.layer or ""] = totals.get(op.layer or "", 0) + op.flops
    return totals


@pytest.mark.parametrize("build", [decoder, cnn, lstm])
def test_the_weightless_trace_is_the_ordinary_one_and_allocates_nothing(build: object) -> None:
    ordinary = trace_model(build(), batch_size=BATCH).graph  # type: ignore[operator]
    model = build_without_weights(build)  # type: ignore[arg-type]
    assert is_weightless(model) and len(deferred_variables(model)) == len(model.variables)
    traced = trace_model(model, batch_size=BATCH)
    assert traced.weightless and traced.step_function is None
    assert traced.graph.layers == ordinary.layers
    assert _compute_ops(traced.graph) == _compute_ops(ordinary)
    assert _flops_by_layer(traced.graph) == _flops_by_layer(ordinary)
    weight_reads = {o.layer for o in traced.graph.ops if o.op_type == "ReadVariableOp"}
    assert weight_reads == {o.layer for o in ordinary.ops if o.op_type == "ReadVariableOp"}
    assert len(deferred_variables(model)) == len(model.variables)  # still nothing allocated


@pytest.mark.parametrize("build", [decoder, cnn, lstm])
def test_a_graph_derived_from_two_traces_equals_the_trace_at_that_batch(build: object) -> None:
    model = build_without_weights(build)  # type: ignore[arg-type]
    traces = {b: trace_model(model, batch_size=b).graph for b in (2, 4, 6, 16)}
    for batch in (4, 6):
        derived = graph_at_batch(traces[16], traces[2], batch)
        assert derived is not None and derived == traces[batch]


def test_a_layer_that_assigns_while_it_is_built_is_named() -> None:
    class Doubled(keras.layers.Layer):
        def build(self, shape: tuple[int, ...]) -> None:
            self.w = self.add_weight(shape=(shape[-1], 4), initializer="ones")
            self.w.assign(self.w * 2.0)

        def call(self, x: tf.Tensor) -> tf.Tensor:
            return x @ self.w

    def build() -> keras.Model:
        x = keras.Input((8,))
        return keras.Model(x, Doubled(name="doubled")(x))

    with pytest.raises(WeightlessBuildError, match="layer 'doubled' assigns to doubled/") as err:
        build_without_weights(build)
    assert err.value.layer == "doubled" and err.value.weight_bytes == 8 * 4 * 4
    assert "outside without_weights()" in str(err.value)


def test_keras_initialising_its_pending_variables_leaves_a_weightless_model_alone() -> None:
    model = build_without_weights(decoder)
    other = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # a symbolic build
    other(np.zeros((1, 4), "float32"))
    assert len(deferred_variables(model)) == len(model.variables)


def test_materialize_creates_each_variable_on_its_device() -> None:
    model = build_without_weights(cnn)
    device_of = {id(v): CPU[1] if "head" in v.path else CPU[2] for v in model.variables}
    assert materialize(model, device_of) == len(model.variables)
    assert not is_weightless(model)
    for v in model.variables:
        assert v.value.device.endswith(device_of[id(v)].split("/device:")[-1])


def _train_step(model: keras.Model, x: np.ndarray, y: np.ndarray) -> float:
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return float(model.train_on_batch(x, y))


@pytest.mark.parametrize("family", [Family.PIPELINE, Family.DATA_PARALLEL])
def test_a_weightless_plan_applies_with_weights_born_on_their_devices(family: Family) -> None:
    model = build_without_weights(mlp)
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, strategy=family.value)
    placed = plan.apply(model, devices=CPU[:2])
    assert is_weightless(model)  # the original still holds no weights; the copy made its own
    count = len(model.weights)
    reference = mlp()  # the original as it would be with the copy's weights: one step each
    reference.set_weights(placed.get_weights()[:count])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 12)).astype("float32")
    y = rng.normal(size=(BATCH, 4)).astype("float32")
    assert _train_step(placed, x, y) == pytest.approx(_train_step(reference, x, y), rel=REL_TOL)
    for a, b in zip(reference.get_weights(), placed.get_weights()[:count]):
        np.testing.assert_allclose(b, a, rtol=REL_TOL, atol=1e-6)


def test_without_weights_is_exported_and_plans_a_model_that_never_existed() -> None:
    with partitioner.without_weights():
        model = decoder()
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH)
    assert plan.step_time_s > 0 and is_weightless(model)


def _peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's VmHWM")
def test_a_7b_decoder_is_planned_without_its_28_gb_of_weights() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import decoder

    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS mark starts from here
    before = _peak_rss_bytes()
    with partitioner.without_weights():
        model = decoder.llama_7b()
    plan = partitioner.partition(
        model, gpus=8, device_type="a100-80gb", topology="nvlink", batch_size=8, time_limit_s=1
    )
    grown = _peak_rss_bytes() - before
    assert model.count_params() > 6.5e9 and is_weightless(model)
    assert plan.strategy is not None and plan.step_time_s > 0
    assert grown < 2 * 2**30, f"planning grew the peak resident memory by {grown / 2**30:.1f} GiB"
