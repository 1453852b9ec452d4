"""Training memory per layer and per device."""

from __future__ import annotations

import pytest
from cost_model_graphs import act, mlp

from cost_models.estimate.memory import Optimizer, layer_memory, parse_optimizer, peak_memory_bytes
from partitioner.core.errors import PartitionError


def test_slots() -> None:
    expected = {"sgd": 0, "momentum": 1, "adam": 2, "adamw": 2, "rmsprop": 1, "adagrad": 1}
    assert {o.value: o.slots_per_param for o in Optimizer} == expected


def test_parse_optimizer() -> None:
    assert parse_optimizer("Adam") is Optimizer.ADAM
    assert parse_optimizer("RMSProp") is Optimizer.RMSPROP
    assert parse_optimizer("adam_w") is Optimizer.ADAMW
    with pytest.raises(PartitionError, match=r"'lion'; known: sgd, momentum, adam"):
        parse_optimizer("lion")


def test_layer_memory_adam() -> None:
    g = mlp()
    mems = layer_memory(g)
    assert [m.layer for m in mems] == ["dense1", "dense2"]
    d1, d2 = mems
    w1 = g.layers[0].param_bytes
    assert (d1.param_bytes, d1.gradient_bytes, d1.optimizer_bytes) == (w1, w1, 2 * w1)
    # dense2 is frozen: weights only, no gradients or optimizer state.
    assert (d2.param_bytes, d2.gradient_bytes, d2.optimizer_bytes) == (
        g.layers[1].param_bytes,
        0,
        0,
    )


def test_activation_bytes_come_from_the_graph() -> None:
    g = mlp()
    d1, d2 = layer_memory(g, Optimizer.SGD)
    nodes = g.layer_graph.nodes
    assert (d1.activation_bytes, d2.activation_bytes) == (
        nodes[0].activation_bytes,
        nodes[1].activation_bytes,
    )
    # dense1 keeps x (merged in as glue) and relu's output; counted once each.
    assert d1.activation_bytes == act(32, 64) + act(32, 128)
    assert d1.optimizer_bytes == 0


def test_peak_memory_per_device() -> None:
    mems = layer_memory(mlp())
    assert peak_memory_bytes(mems, (0, 0), 2) == (mems[0].total_bytes + mems[1].total_bytes, 0)
    assert peak_memory_bytes(mems, (1, 0), 2) == (mems[1].total_bytes, mems[0].total_bytes)
    with pytest.raises(PartitionError, match=r"device 2; devices are 0\.\.1"):
        peak_memory_bytes(mems, (0, 2), 2)
    with pytest.raises(PartitionError, match="1 entries for 2 layers"):
        peak_memory_bytes(mems, (0,), 2)


def shared_weight_graph(steps: int) -> tuple[object, int]:
    """A layer using one 64x64 weight at ``steps`` places: one partial gradient per use, summed
    by tf.gradients' AddN (as an unrolled RNN does)."""
    from cost_model_graphs import op

    from partitioner.core.ir import Edge, Graph, LayerInfo, Phase

    w = act(64, 64)
    ops = [op("x", "Placeholder", None, shape=(8, 64))]
    edges = []
    for t in range(steps):
        ops.append(op(f"rnn/mm{t}", "MatMul", "rnn", shape=(8, 64), flops=2 * 8 * 64 * 64))
        edges.append(Edge("x" if t == 0 else f"rnn/mm{t - 1}", f"rnn/mm{t}", act(8, 64)))
    for t in range(steps):
        ops.append(op(f"g/dw{t}", "MatMul", "rnn", shape=(64, 64), phase=Phase.BACKWARD))
        edges.append(Edge(f"rnn/mm{t}", f"g/dw{t}", act(8, 64)))
    ops.append(op("g/AddN", "AddN", None, shape=(64, 64), phase=Phase.BACKWARD))
    edges += [Edge(f"g/dw{t}", "g/AddN", w) for t in range(steps)]
    layers = (LayerInfo("rnn", "SimpleRNN", param_bytes=w, trainable_param_bytes=w),)
    return Graph("shared", tuple(ops), tuple(edges), layers), w


def test_partial_gradients_are_a_transient_counted_once_per_device() -> None:
    from partitioner.core.ir import LayerMemory, peak_bytes

    graph, w = shared_weight_graph(steps=6)
    (mem,) = layer_memory(graph, Optimizer.SGD)
    assert mem.transient_bytes == 6 * w  # all six partials alive until the AddN
    assert mem.footprint_bytes == mem.total_bytes + 6 * w
    # Two such layers on one device: resident bytes add up, the transient is the larger one
    # (one layer's backward runs at a time), and the solvers' per-layer footprint never says less.
    other = LayerMemory("b", 100, 100, 0, 50, transient_bytes=2 * w)
    assert peak_bytes([mem, other]) == mem.total_bytes + other.total_bytes + 6 * w
    assert peak_memory_bytes((mem, other), (0, 0), 1) == (peak_bytes([mem, other]),)
    assert peak_memory_bytes((mem, other), (0, 1), 2) == (mem.footprint_bytes, other.footprint_bytes)
    assert mem.footprint_bytes + other.footprint_bytes >= peak_bytes([mem, other])
    # One use: no AddN, no transient.
    (single,) = layer_memory(shared_weight_graph(steps=1)[0], Optimizer.SGD)
    assert single.transient_bytes == 0
