"""The targets a training step feeds: ``Graph.target_bytes`` from the trace.

The trace's loss stands in for the user's (no op reads a target), yet a client feeding a step on
a cluster sends a target for every floating-point output (a loss compares each output with a
target of its shape): the simulator prices that feed (``fed_bytes``), so the trace must count it,
at every batch, traced or derived from two traces.
"""

from __future__ import annotations

import keras
import pytest

from partitioner.core.batching import graph_at_batch
from passes.trace import trace_model


def _two_heads() -> keras.Model:
    inputs = keras.Input((6,), name="x")
    hidden = keras.layers.Dense(5, name="hidden")(inputs)
    scores = keras.layers.Dense(3, name="scores")(hidden)
    boxes = keras.layers.Dense(2, name="boxes")(hidden)
    return keras.Model(inputs, [scores, boxes], name="two_heads")


def test_every_float_output_needs_a_target_of_its_size() -> None:
    model = _two_heads()
    graph = trace_model(model, batch_size=8).graph
    assert graph.target_bytes == 4 * 8 * (3 + 2)


def test_a_sequence_output_counts_every_position() -> None:
    inputs = keras.Input((7,), dtype="int32", name="ids")
    embedded = keras.layers.Embedding(50, 4, name="embed")(inputs)
    logits = keras.layers.Dense(50, name="logits")(embedded)
    graph = trace_model(keras.Model(inputs, logits), batch_size=4).graph
    assert graph.target_bytes == 4 * 4 * 7 * 50


@pytest.mark.parametrize("batch", [3, 6, 16])
def test_a_derived_graph_has_the_targets_of_its_batch(batch: int) -> None:
    model = _two_heads()
    low = trace_model(model, batch_size=2).graph
    high = trace_model(model, batch_size=8).graph
    derived = graph_at_batch(low, high, batch)
    assert derived is not None
    assert (
        derived.target_bytes
        == 4 * batch * 5
        == trace_model(model, batch_size=batch).graph.target_bytes
    )
