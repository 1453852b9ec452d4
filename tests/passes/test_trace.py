"""passes.trace: every example model traces into an IR with an exact op-to-layer map.

The map is made by recording which placement unit is on the call stack while each op is created
(forward) and by following gradient colocation (backward); these tests pin it down on the example
models, including the cases that name scopes get wrong (a shared layer's second call, subclassed
sublayers whose scopes are suffixed).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace
from functools import cache

import keras
import pytest
from example_models import EXAMPLE_NAMES, build_example

from partitioner.core.errors import TraceError
from partitioner.core.ir import Graph, Op, Phase
from passes.trace import TraceResult, placement_units, trace_model

BATCH = 8


@cache
def traced_model(name: str) -> tuple[keras.Model, TraceResult]:
    model = build_example(name)
    return model, trace_model(model, batch_size=BATCH)


def traced(name: str) -> TraceResult:
    return traced_model(name)[1]


def owned(graph: Graph, layer: str | None, op_type: str, phase: Phase = Phase.FORWARD) -> list[Op]:
    return [
        op for op in graph.ops if op.layer == layer and op.op_type == op_type and op.phase is phase
    ]


def op_by_id(graph: Graph, op_id: str) -> Op:
    return graph.ops[graph.op_index[op_id]]


def producers(graph: Graph, op: Op) -> list[Op]:
    return [op_by_id(graph, e.src) for e in graph.in_edges[graph.op_index[op.id]]]


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_every_unit_is_a_layer_of_the_graph(name: str) -> None:
    model, result = traced_model(name)
    unit_names = [u.name for u in placement_units(model)]
    assert [layer.name for layer in result.graph.layers] == unit_names
    assert [u.name for u in result.units] == unit_names
    forward_owners = {op.layer for op in result.graph.ops if op.phase is Phase.FORWARD}
    backward_owners = {op.layer for op in result.graph.ops if op.phase is Phase.BACKWARD}
    for unit in unit_names:  # every unit computes something, and everything it computes is its own
        assert unit in forward_owners, f"{name}: {unit} owns no forward op"
    params = {layer.name for layer in result.graph.layers if layer.trainable_params}
    assert params <= backward_owners, f"{name}: layers with weights but no gradient ops"


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_backward_ops_are_owned_through_colocation(name: str) -> None:
    """A gradient op ``gradients/<forward op>_grad/...`` belongs to its forward op's layer."""
    graph = traced(name).graph
    pattern = re.compile(r"^gradients/(.+?)_grad/")
    checked = 0
    for op in graph.ops:
        if op.phase is not Phase.BACKWARD or op.op_type not in (
            "MatMul",
            "Conv2DBackpropInput",
            "Conv2DBackpropFilter",
            "BiasAddGrad",
            "ReluGrad",
        ):
            continue
        match = pattern.match(op.id)
        assert match, op.id
        forward = op_by_id(graph, match.group(1))
        assert forward.phase is Phase.FORWARD
        assert forward.layer is not None
        assert op.layer == forward.layer, f"{op.id} owned by {op.layer}, forward by {forward.layer}"
        checked += 1
    assert checked >= 3


def test_mlp_op_map_is_exact() -> None:
    graph = traced("mnist_mlp").graph
    dims = {"dense_in": (784, 512), "dense_hidden": (512, 512), "dense_out": (512, 10)}
    for layer, (n_in, n_out) in dims.items():
        (matmul,) = owned(graph, layer, "MatMul")
        assert matmul.output_shapes == ((BATCH, n_out),)
        (info,) = [info for info in graph.layers if info.name == layer]
        assert info.trainable_params == n_in * n_out + n_out
        # a Dense owns its forward MatMul and both backward MatMuls (dx and dW)
        assert len(owned(graph, layer, "MatMul", Phase.BACKWARD)) == 2
        assert len(owned(graph, layer, "BiasAdd")) == 1
    for dropout in ("dropout_in", "dropout_hidden"):
        assert not [op for op in graph.ops if op.layer == dropout and op.op_type == "MatMul"]
    # the first Dense reads the input; each later Dense reads the previous layer's output
    (first,) = owned(graph, "dense_in", "MatMul")
    assert producers(graph, first)[0].op_type == "Placeholder"
    (hidden,) = owned(graph, "dense_hidden", "MatMul")
    assert producers(graph, hidden)[0].layer == "dropout_in"
    # the loss is glue: owned by no layer
    assert [op.layer for op in graph.ops if op.op_type == "Square"] == [None]


def test_shared_layer_owns_both_calls() -> None:
    graph = traced("branchy").graph
    forward = owned(graph, "shared_proj", "MatMul")
    assert len(forward) == 2
    assert len(owned(graph, "shared_proj", "MatMul", Phase.BACKWARD)) == 4
    # TF gives each call its own suffixed name scope; neither is the layer's plain name
    scopes = {op.id.split("/")[-2] for op in forward}
    assert len(scopes) == 2
    assert any("shared_proj/" not in op.id for op in forward)
    # one call reads tower 1x1 (average-pooled), the other tower 3x3 (max-pooled)
    assert {producers(graph, op)[0].layer for op in forward} == {"pool_a", "pool_b"}
    # the functional-API keras.ops.add is a unit of its own (auto-named "add", "add_1", ...),
    # owning the AddV2 of the two calls
    (add_unit,) = [layer.name for layer in graph.layers if layer.class_name == "Add"]
    (add,) = owned(graph, add_unit, "AddV2")
    assert {p.layer for p in producers(graph, add)} == {"shared_proj"}
    assert len(owned(graph, "merge", "ConcatV2")) == 1
    # the nested Sequential's layers are units of their own
    for layer, n_out in (("head_hidden", 64), ("head_out", 10)):
        (matmul,) = owned(graph, layer, "MatMul")
        assert matmul.output_shapes == ((BATCH, n_out),)
    for conv in ("stem", "tower_1x1", "tower_3x3"):
        assert len(owned(graph, conv, "Conv2D")) == 1
        assert len(owned(graph, conv, "Conv2DBackpropFilter", Phase.BACKWARD)) == 1


def test_subclassed_model_traces_with_exact_map() -> None:
    model, result = traced_model("subclassed")
    graph = result.graph
    # sublayers are auto-named (dense, dense_1, ... depending on what was built before)
    units = [u.name for u in result.units]
    assert [type(u.operation).__name__ for u in result.units] == [
        "Dense",
        "Dense",
        "LayerNormalization",
        "Dense",
    ]
    assert [u.operation for u in result.units] == [
        model.encode,
        model.block,
        model.norm,
        model.classify,
    ]
    encode_name, block_name, norm_name, classify_name = units
    (encode,) = owned(graph, encode_name, "MatMul")
    (block,) = owned(graph, block_name, "MatMul")
    (classify,) = owned(graph, classify_name, "MatMul")
    assert producers(graph, encode)[0].op_type == "Placeholder"
    assert producers(graph, block)[0].layer == encode_name
    assert classify.output_shapes == ((BATCH, 10),)
    # the residual add is written in the model's own call(): glue, owned by no layer
    (residual,) = [op for op in graph.ops if op.op_type == "AddV2" and op.layer is None]
    assert {p.layer for p in producers(graph, residual)} == {encode_name, block_name}
    assert graph.layer_graph.op_owner[residual.id] in (encode_name, block_name)
    assert len(owned(graph, norm_name, "Rsqrt")) == 1


def test_ownership_does_not_follow_name_scopes() -> None:
    """Layers named ``dense`` and ``dense_1``: TF scopes their ops ``dense_1`` and ``dense_1_2``."""
    inputs = keras.Input((3,))
    hidden = keras.layers.Dense(4, name="dense")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(4, name="dense_1")(hidden), name="scopes")
    graph = trace_model(model, batch_size=2).graph
    (first,) = owned(graph, "dense", "MatMul")
    (second,) = owned(graph, "dense_1", "MatMul")
    assert producers(graph, first)[0].op_type == "Placeholder"
    assert producers(graph, second)[0].layer == "dense"
    # whatever TF calls the scopes, the op in scope "dense_1" is not necessarily layer dense_1's
    assert first.id.split("/")[-2] != "dense" or second.id.split("/")[-2] != "dense_1"


@pytest.mark.parametrize(
    ("name", "layer", "n_in", "n_out"),
    [("mnist_mlp", "dense_in", 784, 512), ("two_device_dense", "hidden_1", 1024, 1024)],
)
def test_dense_flops_params_and_activations(name: str, layer: str, n_in: int, n_out: int) -> None:
    graph = traced(name).graph
    (matmul,) = owned(graph, layer, "MatMul")
    assert matmul.flops == 2 * BATCH * n_in * n_out  # as TF's profiler counts a MatMul
    node = graph.layer_graph.nodes[graph.layer_graph.index[layer]]
    assert node.forward_flops >= matmul.flops
    assert node.backward_flops >= 2 * matmul.flops  # dW and dx
    assert node.param_bytes == (n_in * n_out + n_out) * 4
    assert node.activation_bytes > 0
    assert matmul.output_bytes == BATCH * n_out * 4


def test_conv_flops() -> None:
    graph = traced("cnn").graph
    (conv,) = owned(graph, "conv_1", "Conv2D")
    assert conv.flops == 2 * BATCH * 32 * 32 * 32 * (3 * 3 * 3)
    assert conv.output_shapes == ((BATCH, 32, 32, 32),)


def _sequence_model(kind: str) -> keras.Model:
    inputs = keras.Input((None, 8))
    if kind == "lstm":
        h = keras.layers.LSTM(4, name="lstm")(inputs)
    else:
        h = keras.layers.GlobalAveragePooling1D(name="gap")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3, name="out")(h))


@pytest.mark.parametrize("kind", ["gap", "lstm"])
def test_unknown_dimension_needs_input_shape(kind: str) -> None:
    model = _sequence_model(kind)
    with pytest.raises(TraceError, match="input_shape"):
        trace_model(model, batch_size=BATCH)
    result = trace_model(model, batch_size=BATCH, input_shape=(5, 8))
    graph = result.graph
    assert [layer.name for layer in graph.layers] == [kind, "out"]
    (placeholder,) = [op for op in graph.ops if op.op_type == "Placeholder" and op.layer is None]
    assert placeholder.output_shapes == ((BATCH, 5, 8),)
    owners = Counter((op.layer, op.phase) for op in graph.ops)
    assert owners[("out", Phase.BACKWARD)] > 0
    if kind == "lstm":
        # the loop is the LSTM's, and its gradient loop too (the graph is re-sorted
        # topologically: the gradient adds accumulator inputs to the forward While)
        assert [op.layer for op in graph.ops if op.op_type in ("While", "StatelessWhile")] == [
            "lstm",
            "lstm",
        ]
        assert owners[("lstm", Phase.BACKWARD)] > 0


def test_bad_batch_size_and_input_shape() -> None:
    model = build_example("mnist_mlp")
    with pytest.raises(TraceError, match="batch_size"):
        trace_model(model, batch_size=0)
    with pytest.raises(TraceError, match="input_shape"):
        trace_model(model, batch_size=2, input_shape=(0,))


def test_recurrent_loops_get_their_body_flops_times_the_steps() -> None:
    """TF's profiler gives a while loop 0 FLOPs; the trace counts its body once per step."""
    batch, steps, features, units = 8, 16, 32, 64
    model = keras.Sequential(
        [keras.Input((steps, features)), keras.layers.LSTM(units, return_sequences=True)]
    )
    graph = trace_model(model, batch_size=batch).graph
    loops = {o.phase: o.flops for o in graph.ops if o.op_type in ("While", "StatelessWhile")}
    matmuls = 2 * batch * steps * (features + units) * 4 * units  # the four gates' matmuls
    assert matmuls <= loops[Phase.FORWARD] <= 1.1 * matmuls
    # Backward: a gradient matmul for each input and each weight, about twice the forward.
    assert 1.8 * loops[Phase.FORWARD] <= loops[Phase.BACKWARD] <= 2.5 * loops[Phase.FORWARD]


def test_recurrent_loops_keep_their_per_step_tensors_as_activations() -> None:
    """A while-loop RNN saves per-step tensors for its gradient in variant tensor lists; the trace
    sizes them (element x steps), leaving out the lists of weight reads (no copy)."""
    batch, steps, features, units = 8, 16, 32, 64
    model = keras.Sequential(
        [keras.Input((steps, features)), keras.layers.LSTM(units, name="lstm")]
    )
    graph = trace_model(model, batch_size=batch).graph
    (node,) = [n for n in graph.layer_graph.nodes if n.name == "lstm"]
    per_step_state = 4 * batch * units  # one float32 (batch, units) tensor
    # The cell's gates, states and inputs of every step: several state-sized tensors per step,
    # far less than a weight copy per step would be (the kernel alone is 4 x 32 x 64 floats).
    assert 4 * steps * per_step_state <= node.activation_bytes <= 16 * steps * per_step_state


def test_unrolled_rnn_partial_weight_gradients_are_a_transient() -> None:
    """tf.gradients sums a weight's per-step partial gradients with one AddN, so all of them are
    alive together: the layer's transient holds at least one kernel-sized partial per step."""
    steps, features, units = 10, 16, 32
    model = keras.Sequential(
        [keras.Input((steps, features)), keras.layers.SimpleRNN(units, unroll=True, name="rnn")]
    )
    graph = trace_model(model, batch_size=4).graph
    (node,) = [n for n in graph.layer_graph.nodes if n.name == "rnn"]
    kernel, recurrent = 4 * features * units, 4 * units * units
    assert node.gradient_partial_bytes >= steps * (kernel + recurrent)
    assert (
        node.gradient_partial_bytes <= 2 * steps * (kernel + recurrent) + 4 * steps * 4 * units * 4
    )


def test_einsum_gets_its_flops() -> None:
    """TF's profiler gives Einsum no FLOPs; Keras's attention scores are einsums."""
    batch, seq, d_model, heads, key_dim = 2, 6, 16, 2, 8
    tokens = keras.Input((seq, d_model))
    out = keras.layers.MultiHeadAttention(heads, key_dim, name="mha")(tokens, tokens)
    graph = trace_model(keras.Model(tokens, out), batch_size=batch).graph
    einsums = [o for o in graph.ops if o.op_type == "Einsum" and o.phase is Phase.FORWARD]
    assert einsums and all(o.flops > 0 for o in einsums)
    # Scores q.k and the weighted sum of values: a multiply-add per (batch, head, query, key,
    # key_dim) point each.
    assert {o.flops for o in einsums} == {2 * batch * heads * seq * seq * key_dim}


def test_matmuls_record_the_operands_they_read_transposed() -> None:
    """A dense layer's input gradient is dY @ W^T: the kernel reads the weight transposed."""
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, name="a"), keras.layers.Dense(8, name="b")]
    )
    graph = trace_model(model, batch_size=4).graph
    matmuls = [o for o in graph.ops if o.op_type == "MatMul"]
    assert all(o.transposed_bytes == 0 for o in matmuls if o.phase is Phase.FORWARD)
    backward_b = {
        o.transposed_bytes for o in matmuls if o.phase is Phase.BACKWARD and o.layer == "b"
    }
    # dX reads b's kernel (32 x 8 floats) transposed; dW reads a's output (4 x 32) transposed.
    assert backward_b == {4 * 32 * 8, 4 * 4 * 32}
    assert all(o.transposed_bytes == 0 for o in graph.ops if o.op_type != "MatMul")


def test_adjoint_batch_matmuls_count_their_contracted_dimension() -> None:
    """TensorFlow's registry counts the weight gradient x^T dy of an EinsumDense over (b, s, d)
    with k = d instead of k = s; the trace counts 2 * b * d * d * s."""
    b, s, d = 4, 16, 64
    x = keras.Input((s, d))
    model = keras.Model(x, keras.layers.EinsumDense("bsd,de->bse", (s, d), name="proj")(x))
    graph = trace_model(model, batch_size=b).graph
    matmuls = [o for o in graph.ops if o.layer == "proj" and "BatchMatMul" in o.op_type]
    assert sorted(o.flops for o in matmuls) == sorted([2 * b * s * d * d] * len(matmuls)), [
        (o.id, o.output_shapes, o.flops) for o in matmuls
    ]


def test_depthwise_gradients_count_the_forward_multiply_adds() -> None:
    """TensorFlow registers no count for DepthwiseConv2dNativeBackpropInput/Filter (0)."""
    x = keras.Input((14, 14, 32))
    model = keras.Model(x, keras.layers.DepthwiseConv2D(3, padding="same", name="dw")(x))
    graph = trace_model(model, batch_size=8).graph
    forward = 2 * 3 * 3 * 8 * 14 * 14 * 32
    counts = {o.op_type: o.flops for o in graph.ops if o.op_type.startswith("DepthwiseConv2d")}
    assert counts["DepthwiseConv2dNative"] == forward
    assert counts["DepthwiseConv2dNativeBackpropFilter"] == forward
    # the input gradient is not needed for the first layer's input; where made, it counts alike
    assert counts.get("DepthwiseConv2dNativeBackpropInput", forward) == forward


# -- sparse gradients -----------------------------------------------------------------------------


def _recommender(table: int = 1000, width: int = 8, ids: int = 16) -> keras.Model:
    x = keras.Input((ids,), dtype="int32")
    e = keras.layers.Embedding(table, width, name="emb")(x)
    return keras.Model(x, keras.layers.Dense(1, name="head")(keras.layers.Flatten()(e)))


class _TiedLookup(keras.layers.Layer):
    """Looks its table up and multiplies by it (a tied output projection): a dense read."""

    def build(self, shape: object) -> None:
        self.table = self.add_weight(shape=(100, 8), name="table")

    def call(self, ids: object) -> object:
        rows = keras.ops.mean(keras.ops.take(self.table, ids, axis=0), axis=1)
        return keras.ops.matmul(rows, keras.ops.transpose(self.table))


def test_an_embeddings_gradient_is_recorded_as_its_looked_up_rows() -> None:
    graph = trace_model(_recommender(), batch_size=4).graph
    emb, head = graph.layers[0], graph.layers[-1]
    (g,) = emb.sparse_gradients
    # 4 examples x 16 ids, duplicates included; 8 float32 values and one int32 index per row
    assert (g.variable, g.rows_per_step, g.row_bytes, g.index_bytes) == (
        "emb/embeddings",
        64,
        32,
        4,
    )
    assert g.dense_bytes == 1000 * 8 * 4 and emb.dense_gradient_bytes == 0
    assert head.sparse_gradients == () and head.dense_gradient_bytes == head.trainable_param_bytes


def test_two_lookups_of_one_table_concatenate_and_a_dense_read_densifies() -> None:
    x = keras.Input((16,), dtype="int32")
    emb = keras.layers.Embedding(1000, 8, name="emb")
    both = keras.layers.Concatenate(axis=1)([emb(x), emb(x[:, :4])])
    shared = keras.Model(x, keras.layers.Dense(1)(keras.layers.Flatten()(both)))
    layers = {info.name: info for info in trace_model(shared, batch_size=4).graph.layers}
    (g,) = layers["emb"].sparse_gradients
    assert g.rows_per_step == 4 * 16 + 4 * 4
    tied = keras.Model(x, _TiedLookup(name="tied")(x))
    assert all(not info.sparse_gradients for info in trace_model(tied, batch_size=4).graph.layers)


def test_a_weightless_trace_records_the_same_sparse_gradients() -> None:
    from passes.weightless import without_weights

    with without_weights():
        model = _recommender()

    def sparse(m: keras.Model) -> list[object]:
        return [info.sparse_gradients for info in trace_model(m, batch_size=4).graph.layers]

    assert sparse(model) == sparse(_recommender()) and any(sparse(model))


@pytest.mark.slow
def test_the_priced_slices_are_the_ones_tensorflow_exchanges(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keras's ``fit`` under ``MirroredStrategy`` with ``ReductionToOneDevice`` (data parallel on
    CPUs) hands the replica context's ``all_reduce`` each replica's ``IndexedSlices`` of the
    bytes the cost model prices per replica (values and int32 indices of batch x ids rows), and
    gets back their concatenation (R times that: what the root broadcasts); the dense gradients
    are the rest of the layer memory's gradient bytes."""
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.distribute import distribute_lib

    from cost_models.estimate.memory import Optimizer, layer_memory

    def nbytes(t: tf.Tensor) -> int:
        return int(np.prod(t.shape)) * t.dtype.size

    def sizes(values: list[object]) -> tuple[int, int]:
        sparse = [v for v in values if isinstance(v, tf.IndexedSlices)]
        dense = [v for v in values if not isinstance(v, tf.IndexedSlices)]
        return (
            sum(nbytes(v.values) + nbytes(v.indices) for v in sparse),
            sum(nbytes(v) for v in dense),  # type: ignore[arg-type]
        )

    exchanged: list[tuple[tuple[int, int], tuple[int, int]]] = []
    original = distribute_lib.ReplicaContext.all_reduce

    def recording(self: object, reduce_op: object, value: object, options: object = None) -> object:
        out = original(self, reduce_op, value, options)  # type: ignore[arg-type]
        exchanged.append((sizes(list(value)), sizes(list(out))))  # type: ignore[call-overload]
        return out

    monkeypatch.setattr(distribute_lib.ReplicaContext, "all_reduce", recording)
    replicas, batch = 2, 32
    strategy = tf.distribute.MirroredStrategy(
        [f"/cpu:{r}" for r in range(replicas)],
        cross_device_ops=tf.distribute.ReductionToOneDevice(),
    )
    with strategy.scope():
        model = _recommender()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    ids = np.random.default_rng(0).integers(0, 1000, (batch, 16)).astype("int32")
    model.fit(ids, np.zeros((batch, 1), "float32"), batch_size=batch, epochs=1, verbose=0)

    graph = trace_model(_recommender(), batch_size=batch // replicas).graph
    memory = layer_memory(graph, Optimizer.SGD)
    slices = sum(m.sparse_gradient_bytes for m in memory)
    dense = sum(m.dense_gradient_bytes for m in memory)
    assert exchanged and slices == 16 * 16 * (8 * 4 + 4)
    for sent, received in exchanged:
        assert sent == (slices, dense)
        assert received == (replicas * slices, dense)


def test_skipped_blocks_take_their_twins_sparse_gradients() -> None:
    """A weightless trace of repeated blocks makes no gradient for blocks 2.. (their variables
    are not arguments); their layers get block 1's records, renamed."""
    from partitioner.core.ir import LayerInfo, SparseGradient
    from passes.blocks import Repeat
    from passes.trace import _skipped_sparse

    names = ("in", "e0", "e1", "e2", "e3", "out")
    record = SparseGradient("e1/embeddings", 64, 32, 4, 3200)
    layers = tuple(
        LayerInfo(n, "Embedding", sparse_gradients=(replace(record, variable=f"{n}/embeddings"),))
        if n in ("e0", "e1")
        else LayerInfo(n, "X")
        for n in names
    )
    ops = (Op("a", "X", "in", Phase.FORWARD),)
    graph = Graph("g", ops, (), layers, 4)
    out = _skipped_sparse(graph, Repeat(start=1, period=1, count=4, unit_names=names))
    got = {info.name: [g.variable for g in info.sparse_gradients] for info in out.layers}
    assert got == {
        "in": [],
        "e0": ["e0/embeddings"],
        "e1": ["e1/embeddings"],
        "e2": ["e2/embeddings"],
        "e3": ["e3/embeddings"],
        "out": [],
    }
