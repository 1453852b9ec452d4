"""Training memory per layer and per device."""

from __future__ import annotations

import pytest
from cost_model_graphs import act, mlp

from cost_models.memory import Optimizer, layer_memory, parse_optimizer, peak_memory_bytes
from partitioner.errors import PartitionError


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
