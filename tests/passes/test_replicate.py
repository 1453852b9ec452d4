"""passes.rewrite.replicate: data-parallel replicas train exactly like one device on the global batch.

On the 4 logical CPU devices of tests/conftest.py, for the strategies R=2 x S=1 (MirroredStrategy),
R=1 x S=2 (the pipeline rewrite) and R=2 x S=2 (replicated pipelines), all made by
``realise_strategy``: one step (``train_on_batch``) and one epoch of ``fit`` update the weights as
the original model does on one device with the same global batches (relative difference <= 1e-5,
SGD, float32), ``predict`` gives the original's outputs, the replicas stay identical and the
original is untouched. Also the one-line errors for bad batches and bad device lists.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

from partitioner.core.errors import PartitionError, RewriteError, UsageError
from partitioner.core.ir import Schedule
from passes.rewrite.pipeline import PipelinedModel
from passes.rewrite.replicate import (
    ReplicatedModel,
    ReplicatedPipeline,
    check_replica_devices,
    realise_strategy,
    replicate_model,
    replicate_pipeline,
)

CPU = [f"/device:CPU:{i}" for i in range(4)]
REL_TOL = 1e-5
BATCH = 8
LAYERS = ("d1", "d2", "d3")

Plan = dict[str, str]

# name -> (placement per replica, micro-batches, schedule)
STRATEGIES: dict[str, tuple[list[Plan], int, Schedule]] = {
    "R2xS1": (
        [dict.fromkeys(LAYERS, CPU[0]), dict.fromkeys(LAYERS, CPU[1])],
        1,
        Schedule.NONE,
    ),
    "R1xS2": ([{"d1": CPU[0], "d2": CPU[0], "d3": CPU[1]}], 2, Schedule.ONE_F_ONE_B),
    "R2xS2": (
        [
            {"d1": CPU[0], "d2": CPU[0], "d3": CPU[1]},
            {"d1": CPU[2], "d2": CPU[2], "d3": CPU[3]},
        ],
        2,
        Schedule.ONE_F_ONE_B,
    ),
    "R2xS2-gpipe-M1": (
        [
            {"d1": CPU[1], "d2": CPU[2], "d3": CPU[2]},
            {"d1": CPU[3], "d2": CPU[0], "d3": CPU[0]},
        ],
        1,
        Schedule.GPIPE,
    ),
}
EXPECTED_TYPE = {
    "R2xS1": ReplicatedModel,
    "R1xS2": PipelinedModel,
    "R2xS2": ReplicatedPipeline,
    "R2xS2-gpipe-M1": ReplicatedPipeline,
}


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu", name="d1")(inputs)
    h = keras.layers.Dense(8, activation="tanh", name="d2")(h)
    outputs = keras.layers.Dense(3, name="d3")(h)
    model = keras.Model(inputs, outputs, name="mlp")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse", metrics=["mae"])
    return model


def data(rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, 6)).astype(np.float32)
    y = rng.standard_normal((rows, 3)).astype(np.float32)
    return x, y


def realise(name: str, model: keras.Model) -> keras.Model:
    plans, m, schedule = STRATEGIES[name]
    x, _ = data(1)
    copy = realise_strategy(model, plans, num_microbatches=m, schedule=schedule, sample_inputs=[x])
    assert isinstance(copy, EXPECTED_TYPE[name])
    return copy


def copies_of(copy: keras.Model) -> list[list[np.ndarray]]:
    """The weights of each replica's copy of the model (one list for one replica)."""
    if isinstance(copy, ReplicatedPipeline):
        return [r.get_weights() for r in copy.replicas]
    return [copy.get_weights()]


def assert_same_weights(copy: keras.Model, expected: list[np.ndarray], what: str) -> None:
    replicas = copies_of(copy)
    for r, weights in enumerate(replicas):
        assert len(weights) == len(expected)
        for k, (got, want) in enumerate(zip(weights, expected)):
            err = float(np.linalg.norm(got - want)) / float(np.linalg.norm(want))
            assert err <= REL_TOL, f"{what}: replica {r}, weight {k}: relative difference {err}"
    for other in replicas[1:]:  # every replica applied the same update: bitwise equal copies
        assert all(np.array_equal(a, b) for a, b in zip(replicas[0], other))


# -- exactness --------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_one_step_matches_the_single_device_step(name: str) -> None:
    model = mlp()
    original = model.get_weights()
    x, y = data(BATCH)
    copy = realise(name, model)
    np.testing.assert_allclose(
        copy.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    copy.train_on_batch(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), original))
    reference = mlp()
    reference.train_on_batch(x, y)
    assert_same_weights(copy, reference.get_weights(), f"{name} train_on_batch")


@pytest.mark.slow
@pytest.mark.parametrize("name", STRATEGIES)
def test_fit_for_one_epoch_matches_and_predicts_alike(name: str) -> None:
    x, y = data(2 * BATCH, seed=1)
    copy = realise(name, mlp())
    history = copy.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    reference = mlp()
    ref_history = reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert_same_weights(copy, reference.get_weights(), f"{name} fit")
    assert history.history["loss"][0] == pytest.approx(ref_history.history["loss"][0], rel=1e-5)
    # predict runs any number of rows, also ones the replicas do not divide
    x_odd, _ = data(5, seed=2)
    np.testing.assert_allclose(
        copy.predict(x_odd, verbose=0), reference.predict(x_odd, verbose=0), rtol=1e-5, atol=1e-6
    )
    loss, mae = copy.evaluate(x, y, verbose=0)
    ref_loss, ref_mae = reference.evaluate(x, y, verbose=0)
    assert (loss, mae) == pytest.approx((ref_loss, ref_mae), rel=1e-5)


@pytest.mark.slow
def test_data_parallel_variables_are_mirrored_and_each_replica_gets_its_share() -> None:
    seen: list[int | None] = []

    class Probe(keras.layers.Layer):
        def call(self, inputs: Any) -> Any:
            seen.append(inputs.shape[0])  # at trace time, once per replica
            return inputs

    keras.utils.set_random_seed(0)
    inputs = keras.Input((6,))
    outputs = keras.layers.Dense(3, name="head")(Probe(name="probe")(inputs))
    model = keras.Model(inputs, outputs, name="probed")
    model.compile(optimizer="sgd", loss="mse")
    x, y = data(BATCH)
    copy = replicate_model(model, CPU[2:4], [x[:1]])
    assert copy.num_replicas == 2
    assert copy.replica_devices == (
        "/job:localhost/replica:0/task:0/device:CPU:2",
        "/job:localhost/replica:0/task:0/device:CPU:3",
    )
    for variable in copy.weights:
        assert isinstance(variable.value, tf.distribute.DistributedValues)
    seen.clear()
    copy.train_on_batch(x, y)
    # Keras builds the metrics once on the whole batch; the step itself runs per replica
    assert seen.count(BATCH // 2) == 2, seen


@pytest.mark.slow
def test_an_uncompiled_model_compiled_after_replication_trains_alike() -> None:
    model = mlp()
    uncompiled = keras.Model(
        model.inputs[0], model.outputs[0], name="plain"
    )  # same layers, no compile
    x, y = data(BATCH)
    copy = replicate_model(uncompiled, CPU[:2], [x[:1]])
    copy.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")  # made outside
    assert copy.optimizer._distribution_strategy is copy.distribute_strategy
    copy.train_on_batch(x, y)
    model.train_on_batch(x, y)
    assert_same_weights(copy, model.get_weights(), "compiled after replication")


@pytest.mark.slow
def test_each_replica_stage_lives_on_its_own_device() -> None:
    plans, m, schedule = STRATEGIES["R2xS2"]
    x, _ = data(1)
    hybrid = replicate_pipeline(
        mlp(), plans, num_microbatches=m, schedule=schedule, sample_inputs=[x]
    )
    assert hybrid.stage_devices == ((CPU[0], CPU[1]), (CPU[2], CPU[3]))
    for replica, plan in zip(hybrid.replicas, plans):
        for layer in replica.inner.layers[1:]:
            for variable in layer.weights:
                spec = tf.DeviceSpec.from_string(variable.value.device)
                assert f"/device:CPU:{spec.device_index}" == plan[layer.name]


# -- bad input --------------------------------------------------------------------------------


def one_line(error: PartitionError) -> str:
    message = str(error)
    assert "\n" not in message
    return message


@pytest.mark.slow
def test_a_batch_the_replicas_do_not_divide_is_refused_naming_valid_counts() -> None:
    x, y = data(BATCH + 1)
    copy = realise("R2xS1", mlp())
    with pytest.raises(UsageError) as caught:
        copy.train_on_batch(x[:7], y[:7])
    assert "global batch 7 does not split into 2 replicas" in one_line(caught.value)
    assert "e.g. 6 or 8" in str(caught.value)
    with pytest.raises(UsageError) as caught:
        copy.fit(x[:9], y[:9], batch_size=9, verbose=0)
    assert "multiple of 2" in one_line(caught.value)


@pytest.mark.slow
def test_a_batch_the_replicas_times_microbatches_do_not_divide_is_refused() -> None:
    x, y = data(BATCH)
    copy = realise("R2xS2", mlp())
    with pytest.raises(UsageError) as caught:
        copy.fit(x[:6], y[:6], batch_size=6, verbose=0)  # dynamic batch: the in-graph check
    message = one_line(caught.value)
    assert "global batch 6 does not split into 2 replicas x 2 micro-batches" in message
    assert "multiple of 4, e.g. 4 or 8" in message
    with pytest.raises(UsageError, match="global batch 2 does not split"):
        copy.train_on_batch(x[:2], y[:2])


@pytest.mark.parametrize(
    ("devices", "words"),
    [
        (["/device:GPU:7", CPU[0]], "is not one TensorFlow sees here"),
        ([CPU[0], "not a device at all"], "not a TensorFlow device string"),
        ([CPU[0], "/device:CPU:0"], "is named twice"),
        (["/job:worker/task:1/device:CPU:0"], "on another process"),
    ],
)
def test_unknown_or_repeated_devices_are_refused(devices: list[str], words: str) -> None:
    with pytest.raises(RewriteError) as caught:
        check_replica_devices(devices)
    assert words in one_line(caught.value)


def test_an_unknown_device_is_refused_before_any_copy() -> None:
    model = mlp()
    with pytest.raises(RewriteError, match="is not one TensorFlow sees here"):
        replicate_model(model, [CPU[0], "/device:GPU:0"], [data(1)[0]])


def test_replica_device_lists_of_different_lengths_are_refused() -> None:
    plans = [
        {"d1": CPU[0], "d2": CPU[0], "d3": CPU[1]},
        {"d1": CPU[2], "d2": CPU[2], "d3": CPU[2]},
    ]
    with pytest.raises(RewriteError) as caught:
        replicate_pipeline(
            mlp(), plans, num_microbatches=2, schedule=Schedule.GPIPE, sample_inputs=[data(1)[0]]
        )
    assert "different lengths [2, 1]" in one_line(caught.value)


@pytest.mark.parametrize(
    ("second", "words"),
    [
        ({"d1": CPU[2], "d2": CPU[3], "d3": CPU[3]}, "splits the layers into other stages"),
        ({"d1": CPU[1], "d2": CPU[1], "d3": CPU[2]}, "is in replicas 0 and 1"),
        ({"d1": CPU[2], "d2": CPU[2], "d4": CPU[3]}, "places other layers than replica 0"),
    ],
)
def test_replicas_must_be_the_same_pipeline_on_devices_of_their_own(
    second: Plan, words: str
) -> None:
    plans = [{"d1": CPU[0], "d2": CPU[0], "d3": CPU[1]}, second]
    with pytest.raises(RewriteError) as caught:
        realise_strategy(
            mlp(), plans, num_microbatches=2, schedule=Schedule.GPIPE, sample_inputs=[data(1)[0]]
        )
    assert words in one_line(caught.value)


def test_microbatches_without_stages_are_refused() -> None:
    plans, _, _ = STRATEGIES["R2xS1"]
    with pytest.raises(UsageError, match="no micro-batches"):
        realise_strategy(
            mlp(), plans, num_microbatches=2, schedule=Schedule.GPIPE, sample_inputs=[data(1)[0]]
        )


# -- data parallelism by the explicit all-reduce (what runs on a cluster) ---------------------


def embedding_mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(50, 6, name="emb")(inputs)
    h = keras.layers.Flatten(name="flat")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(inputs, outputs, name="emb_mlp")
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.5), loss="mse")
    return model


def test_sparse_gradients_are_reduced_sparse_as_tensorflow_aggregates_them() -> None:
    from passes.rewrite.pipeline import sum_gradients as _reduce

    shape = tf.constant([5, 2], dtype=tf.int64)
    a = tf.IndexedSlices(tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([0, 3]), shape)
    b = tf.IndexedSlices(tf.constant([[5.0, 6.0]]), tf.constant([3]), shape)
    mean = _reduce([a, b], 2.0)
    assert isinstance(mean, tf.IndexedSlices)
    assert mean.indices.numpy().tolist() == [0, 3, 3]  # concatenated, repeats kept
    assert mean.values.numpy().tolist() == [[0.5, 1.0], [1.5, 2.0], [2.5, 3.0]]
    dense = (tf.convert_to_tensor(a) + tf.convert_to_tensor(b)) / 2.0
    np.testing.assert_array_equal(tf.convert_to_tensor(mean).numpy(), dense.numpy())
    summed = _reduce([a, b], None)
    assert summed.values.numpy().tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    dense_mean = _reduce([tf.ones((2,)), tf.zeros((2,))], 2.0)
    assert dense_mean.numpy().tolist() == [0.5, 0.5]


@pytest.mark.parametrize("how", ["train_on_batch", "fit"])
def test_explicit_data_parallel_trains_like_one_device_and_keeps_embeddings_sparse(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import passes.rewrite.replicate as replicate

    reduced: list[str] = []
    original_reduce = replicate.sum_gradients

    def spy(values: Any, divisor: Any) -> Any:
        out = original_reduce(values, divisor)
        reduced.append(type(out).__name__)
        return out

    monkeypatch.setattr(replicate, "sum_gradients", spy)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 50, (2 * BATCH, 4)).astype(np.int32)
    y = rng.standard_normal((2 * BATCH, 3)).astype(np.float32)
    model = embedding_mlp()
    layers = ("emb", "flat", "head")
    plans = [dict.fromkeys(layers, CPU[0]), dict.fromkeys(layers, CPU[1])]
    copy = replicate_pipeline(
        model, plans, num_microbatches=1, schedule=Schedule.NONE, sample_inputs=[x[:1]]
    )
    assert isinstance(copy, ReplicatedPipeline) and copy.stage_devices == ((CPU[0],), (CPU[1],))
    reference = embedding_mlp()
    if how == "fit":
        copy.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
        reference.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    else:
        for step in range(2):
            rows = slice(step * BATCH, (step + 1) * BATCH)
            copy.train_on_batch(x[rows], y[rows])
            reference.train_on_batch(x[rows], y[rows])
    assert_same_weights(copy, reference.get_weights(), f"explicit data parallel {how}")
    # the loss, the embedding table's gradient (sparse), the head's kernel and bias (dense)
    assert reduced.count("IndexedSlices") == 1, reduced
    np.testing.assert_allclose(
        copy.predict(x, verbose=0), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
