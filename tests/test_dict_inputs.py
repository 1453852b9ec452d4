"""Models that take and return dicts, lists and nested structures (issue 17, groups 1 and 2).

A keras_hub text backbone takes ``{"token_ids": ..., "padding_mask": ...}`` and returns a dict;
the tests build such a model in Keras's functional form (keras_hub is not a dependency) and check
that it traces, plans (per-input shapes for its dynamic dims), and applies placed, pipelined and
data-parallel with the user's structure kept and equal outputs, gradients and updated weights.
"""

from __future__ import annotations

import json
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import partitioner
from cost_models.measure.op_profile import random_inputs, step_inputs
from partitioner.cli.main import _options, _parse_shape, build_parser, cli_message
from partitioner.core.errors import PartitionError, TraceError, UsageError
from partitioner.core.options import TargetOptions
from partitioner.plan.model import Plan, load_plan
from passes.rewrite.device_placement import place_model
from passes.trace import input_names, input_specs, integer_input_bounds, model_input, trace_model

CPU = [f"/device:CPU:{i}" for i in range(4)]
VOCAB = 50
SEQ = 6
BATCH = 8
REL_TOL = 1e-5
SHAPES: dict[str, Any] = {"token_ids": (SEQ,), "padding_mask": (SEQ,)}


def text_encoder(seq: int | None = None, mask_dtype: str = "bool") -> keras.Model:
    """A small keras_hub-style encoder: dict in (token ids, padding mask), dict out. (Keras
    names its functional ops by a global count: cleared, so every build names its cast alike.)"""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    ids = keras.Input(shape=(seq,), dtype="int32", name="token_ids")
    mask = keras.Input(shape=(seq,), dtype=mask_dtype, name="padding_mask")
    x = keras.layers.Embedding(VOCAB, 8, name="embed")(ids)
    m = keras.layers.Reshape((-1, 1), name="mask_r")(keras.ops.cast(mask, "float32"))
    x = keras.layers.Multiply(name="masked")([x, m])
    x = keras.layers.Dense(16, activation="tanh", name="d1")(x)
    seq_out = keras.layers.Dense(4, name="d2")(x)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(keras.layers.Dense(8, name="d3")(x))
    return keras.Model(
        {"token_ids": ids, "padding_mask": mask},
        {"sequence_output": seq_out, "pooled_output": pooled},
        name="text_encoder",
    )


def list_model() -> keras.Model:
    """Two inputs as a list, outputs nested: ``(a, [b, c])``."""
    keras.utils.set_random_seed(1)
    a = keras.Input((5,), name="a")
    b = keras.Input((3,), name="b")
    h = keras.layers.Concatenate(name="cat")([keras.layers.Dense(4, name="da")(a), b])
    h = keras.layers.Dense(6, activation="relu", name="dh")(h)
    out_1 = keras.layers.Dense(2, name="o1")(h)
    out_2 = keras.layers.Dense(3, name="o2")(h)
    return keras.Model([a, b], (out_1, [out_2, h]), name="listy")


def text_batch(rows: int = BATCH, seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    rng = np.random.default_rng(seed)
    mask = np.ones((rows, SEQ), bool)
    mask[:, -2:] = rng.random((rows, 2)) < 0.5
    x = {"token_ids": rng.integers(0, VOCAB, (rows, SEQ)).astype("int32"), "padding_mask": mask}
    y = {
        "sequence_output": rng.standard_normal((rows, SEQ, 4)).astype("float32"),
        "pooled_output": rng.standard_normal((rows, 8)).astype("float32"),
    }
    return x, y


def compiled(model: keras.Model) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.1),
        loss={"sequence_output": "mse", "pooled_output": "mse"},
    )
    return model


def relative_error(actual: Any, expected: Any) -> float:
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = float(np.linalg.norm(expected))
    diff = float(np.linalg.norm(actual - expected))
    return diff / scale if scale > 0 else diff


def assert_same_structure_and_values(got: Any, want: Any) -> None:
    assert tf.nest.map_structure(lambda _: 0, got) == tf.nest.map_structure(lambda _: 0, want)
    for g, w in zip(tf.nest.flatten(got), tf.nest.flatten(want)):
        assert relative_error(g, w) <= REL_TOL


def one_line(error: PartitionError) -> str:
    text = str(error)
    assert "\n" not in text
    return text


# -- tracing, specs and input values -----------------------------------------------------------


def test_a_dict_input_model_traces_with_every_layer_owning_ops() -> None:
    model = text_encoder(SEQ)
    traced = trace_model(model, batch_size=4)
    owners = {op.layer for op in traced.graph.ops}
    assert {"embed", "d1", "d2", "d3", "pool"} <= owners
    assert input_names(model) == ["padding_mask", "token_ids"]  # model.inputs order
    assert traced.input_bounds == (None, VOCAB)
    values = step_inputs(traced, seed=3)
    ids = np.asarray(values[1])
    assert values[0].dtype == tf.bool and bool(np.all(values[0]))
    assert ids.min() >= 0 and ids.max() < VOCAB and len(np.unique(ids)) > 1


def test_integer_bounds_follow_casts_into_nested_embeddings() -> None:
    inner = text_encoder(SEQ, mask_dtype="int32")
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    seg = keras.Input((SEQ,), dtype="int32", name="segments")
    mask = keras.Input((SEQ,), dtype="int32", name="mask")
    out = inner({"token_ids": ids, "padding_mask": mask})
    seg_emb = keras.layers.Embedding(3, 4, name="seg_embed")(keras.ops.cast(seg, "int64"))
    pooled = keras.layers.Concatenate(name="join")(
        [out["pooled_output"], keras.layers.Flatten(name="flat")(seg_emb)]
    )
    outer = keras.Model({"ids": ids, "segments": seg, "mask": mask}, pooled, name="task")
    bounds = dict(zip(input_names(outer), integer_input_bounds(outer)))
    # a nested model's smallest table bounds what reaches it; the mask reaches only a cast
    assert bounds == {"ids": VOCAB, "mask": VOCAB, "segments": 3}
    specs = input_specs(outer, 2)
    values = random_inputs(specs, 0, integer_input_bounds(outer))
    assert all(int(np.max(v)) < b for v, b in zip(values, integer_input_bounds(outer)) if b)
    outer(model_input(outer, values))  # every lookup in range


def test_unknown_dims_are_one_line_naming_each_input_and_the_argument() -> None:
    with pytest.raises(TraceError) as info:
        input_specs(text_encoder(), 4)
    text = one_line(info.value)
    assert "padding_mask bool (?, ?)" in text and "token_ids int32 (?, ?)" in text
    assert "input_shape={'padding_mask': (128,), 'token_ids': (128,)}" in text
    assert cli_message(text).endswith(
        "e.g. --input-shape padding_mask=128 --input-shape token_ids=128"
    )


def test_per_input_shapes_fill_the_dynamic_dims() -> None:
    model = text_encoder()
    specs = input_specs(model, 4, {"token_ids": (SEQ,), "padding_mask": [SEQ]})
    assert [(tuple(s.shape), s.dtype) for s in specs] == [
        ((4, SEQ), tf.bool),
        ((4, SEQ), tf.int32),
    ]


@pytest.mark.parametrize(
    ("shape", "words"),
    [
        ((SEQ,), "gives one shape but model 'text_encoder' has 2 inputs; give one per input"),
        (
            {"token_id": (SEQ,)},
            "model 'text_encoder' has no input named 'token_id' (its inputs are ['padding_mask', "
            "'token_ids']); key the shapes by those names, e.g. input_shape={'padding_mask':",
        ),
        (
            {"token_ids": (SEQ, 2), "padding_mask": (SEQ,)},
            "'token_ids' of model 'text_encoder' 2 dims but it has 1",
        ),
    ],
)
def test_bad_per_input_shapes_are_one_line(shape: Any, words: str) -> None:
    with pytest.raises(TraceError) as info:
        input_specs(text_encoder(), 4, shape)
    assert words in one_line(info.value)


def test_target_options_take_a_shape_per_input_name() -> None:
    target = TargetOptions(input_shape={"token_ids": [128], "padding_mask": 128})  # type: ignore[dict-item]
    assert target.input_shape == {"token_ids": (128,), "padding_mask": (128,)}
    assert TargetOptions(input_shape=[32, 32, 3]).input_shape == (32, 32, 3)  # type: ignore[arg-type]
    for bad in ({"token_ids": (0,)}, {}, {"": (3,)}):
        with pytest.raises(UsageError) as info:
            TargetOptions(input_shape=bad)  # type: ignore[arg-type]
        assert "input_shape=" in one_line(info.value)


def test_the_cli_flag_takes_one_shape_or_one_per_name() -> None:
    assert _parse_shape(None) is None
    assert _parse_shape(["32,32,3"]) == (32, 32, 3)
    assert _parse_shape(["token_ids=128", "padding_mask=128"]) == {
        "token_ids": (128,),
        "padding_mask": (128,),
    }
    args = build_parser().parse_args(
        ["m.py", "--gpus", "2", "--input-shape", "token_ids=6", "--input-shape", "padding_mask=6"]
    )
    assert _options(args)[0].input_shape == SHAPES
    args = build_parser().parse_args(["m.py", "--gpus", "2", "--input-shape", "32x32x3"])
    assert _options(args)[0].input_shape == (32, 32, 3)
    for bad in (["32,32", "token_ids=4"], ["a=1", "a=2"], ["a=x"], ["32", "32"]):
        with pytest.raises(UsageError) as info:
            _parse_shape(bad)
        assert "--input-shape" in one_line(info.value)


# -- the plan file ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def placed_plan() -> Plan:
    return partitioner.partition(
        text_encoder(),
        gpus=2,
        device_type="cpu",
        batch_size=BATCH,
        solver="metis",
        input_shape=SHAPES,
    )


def test_the_plan_file_keeps_the_shapes_per_input(placed_plan: Plan, tmp_path: Any) -> None:
    assert placed_plan.input_shape == SHAPES
    data = placed_plan.to_json_dict()
    assert data["input_shape"] == {"token_ids": [SEQ], "padding_mask": [SEQ]}
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert load_plan(path).input_shape == SHAPES
    data["input_shape"] = [32, 32, 3]  # one shape, as version 2 files have it
    data["fingerprint"] = None  # (which a fingerprint of two inputs would contradict)
    del data["digest"]  # a file of an earlier release: no digest either
    path.write_text(json.dumps(data))
    assert load_plan(path).input_shape == (32, 32, 3)
    data["input_shape"] = {"token_ids": [0]}
    path.write_text(json.dumps(data))
    with pytest.raises(PartitionError) as info:
        load_plan(path)
    assert "input_shape" in one_line(info.value)


# -- applying: the user's structure, equal outputs, gradients and weights ---------------------


def check_one_step(model: keras.Model, copy: keras.Model, what: str) -> None:
    """Equal outputs (as a dict), and after one SGD step equal weights (the gradients times the
    learning rate) to the original trained alike; the original is untouched."""
    x, y = text_batch()
    assert_same_structure_and_values(copy(x, training=False), model(x, training=False))
    before = model.get_weights()
    copy.train_on_batch(x, y)
    assert all(np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    reference = compiled(text_encoder())
    reference.set_weights(before)
    reference.train_on_batch(x, y)
    after = reference.get_weights()
    index = {v.path: k for k, v in enumerate(reference.weights)}
    replicas = getattr(copy, "replicas", [copy])  # a replicated pipeline: every copy
    weights = [v for replica in replicas for v in replica.weights]
    for v in weights:  # matched by layer/variable path (a copy's may have a prefix)
        k = next(index[p] for p in index if v.path == p or v.path.endswith(f"/{p}"))
        got = np.asarray(v) - before[k]
        assert relative_error(got, after[k] - before[k]) <= REL_TOL, f"{what}: update of {v.path}"
    assert len(weights) == len(replicas) * len(reference.weights)


def test_a_placed_dict_model_keeps_its_structure_and_gradients(placed_plan: Plan) -> None:
    model = compiled(text_encoder())
    copy = placed_plan.apply(model, devices=CPU[:2])
    assert len(set(placed_plan.assignment.values())) == 2
    x, y = text_batch()

    @tf.function(autograph=False)  # type: ignore[untyped-decorator]
    def grads_of_copy() -> Any:
        out = copy(x, training=True)
        return copy.gradients(copy.compute_loss(x=x, y=y, y_pred=out, training=True))

    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x, training=True), training=True)
    want = [
        np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(loss, model.trainable_weights)
    ]
    got = [np.asarray(tf.convert_to_tensor(g)) for g in grads_of_copy()]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert relative_error(g, w) <= REL_TOL
    check_one_step(model, copy, "placed")


STRATEGIES: dict[str, tuple[int, dict[str, Any], str]] = {
    "pipeline": (2, {"pipeline": True, "num_microbatches": 2}, "PipelinedModel"),
    "data_parallel": (2, {"strategy": "data_parallel"}, "ReplicatedModel"),
    "hybrid": (4, {"strategy": "hybrid"}, "ReplicatedPipeline"),
}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_dict_model_pipelines_and_replicates(name: str) -> None:
    gpus, options, kind = STRATEGIES[name]
    model = compiled(text_encoder())
    plan = partitioner.partition(
        model, gpus=gpus, device_type="cpu", batch_size=BATCH, input_shape=SHAPES, **options
    )
    assert plan.input_shape == SHAPES
    copy = plan.apply(model, devices=CPU[:gpus])
    assert type(copy).__name__ == kind
    check_one_step(model, copy, name)


def test_a_dict_model_is_profiled_with_token_ids_in_range(tmp_path: Any) -> None:
    plan = partitioner.partition(
        text_encoder(),
        gpus=2,
        device_type="cpu",
        batch_size=BATCH,
        input_shape=SHAPES,
        profile=True,
        profile_ops=True,
        cache_dir=str(tmp_path),
    )
    assert plan.input_shape == SHAPES and plan.step_time_s > 0


def test_list_inputs_and_nested_outputs_keep_their_structure() -> None:
    model = list_model()
    units = {"da": CPU[0], "cat": CPU[0], "dh": CPU[1], "o1": CPU[1], "o2": CPU[0]}
    sample = [np.zeros((1, 5), "float32"), np.zeros((1, 3), "float32")]
    copy = place_model(model, units, sample)
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((4, 5)).astype("float32"), rng.standard_normal((4, 3)).astype("f4")]
    assert_same_structure_and_values(copy(x), model(x))
    traced = trace_model(model, batch_size=4)
    assert {"da", "dh", "o1", "o2"} <= {op.layer for op in traced.graph.ops}


class DictEncoder(keras.Model):  # type: ignore[misc]
    """A subclassed model taking a dict: Keras records its shapes but not its dtypes."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(VOCAB, 8)
        self.dense = keras.layers.Dense(4)

    def call(self, inputs: Any) -> Any:
        mask = keras.ops.cast(inputs["padding_mask"], "float32")[..., None]
        return {"out": self.dense(self.embed(inputs["token_ids"]) * mask)}


def test_a_subclassed_dict_model_is_refused_in_one_line_and_its_functional_wrap_applies() -> None:
    keras.utils.set_random_seed(2)
    model = DictEncoder(name="dict_encoder")
    x, _ = text_batch(4)
    model(x)
    with pytest.raises(TraceError) as info:
        trace_model(model, batch_size=4, input_shape=SHAPES)
    assert "dtypes Keras does not record; wrap it in a functional model" in one_line(info.value)
    ids = keras.Input((SEQ,), dtype="int32", name="token_ids")
    mask = keras.Input((SEQ,), dtype="bool", name="padding_mask")
    inputs = {"token_ids": ids, "padding_mask": mask}
    wrapped = keras.Model(inputs, model(inputs), name="wrapped")
    plan = partitioner.partition(wrapped, gpus=2, device_type="cpu", batch_size=4, solver="metis")
    copy = plan.apply(wrapped, devices=CPU[:2])
    assert_same_structure_and_values(copy(x), wrapped(x))
