"""Every real model of the zoo traces without its weights to the graph it traces with them
(what the CLI now plans by default): the same computing ops, with the same FLOPs, on the same
layers. The weight reads differ by nature (a variable read in one, an argument in the other),
and so do a loop's plumbing and BatchNormalization's moving-average assignments."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from passes.trace import trace_model
from passes.weightless import build_without_weights, is_weightless
from tests.real_models import zoo

LOOPS = {"While", "StatelessWhile"}


def _computing(graph: Any) -> Counter[tuple[int, str, int]]:
    """(layer position, op type, FLOPs) of every op that computes; layers by position, since
    two builds of one architecture number Keras's automatic layer names apart."""
    position = {layer.name: k for k, layer in enumerate(graph.layers)}
    return Counter(
        (position.get(o.layer, -1), o.op_type, o.flops)
        for o in graph.ops
        if o.flops and o.op_type not in LOOPS
    )


def _flops_by_layer(graph: Any) -> Counter[int]:
    position = {layer.name: k for k, layer in enumerate(graph.layers)}
    totals: Counter[int] = Counter()
    for o in graph.ops:
        totals[position.get(o.layer, -1)] += o.flops
    return totals


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in zoo.CASES if not c.heavy], ids=lambda c: c.name)
def test_the_weightless_trace_is_the_trace_with_weights(case: zoo.Case) -> None:
    with zoo.dtype_policy(case.dtype):
        model = build_without_weights(lambda: case.build()[0])
        assert is_weightless(model)
        without = trace_model(model, batch_size=zoo.BATCH, input_shape=case.input_shape).graph
        weighted = case.build()[0]
        with_weights = trace_model(
            weighted, batch_size=zoo.BATCH, input_shape=case.input_shape
        ).graph
    assert without.layers == with_weights.layers or [
        (a.class_name, a.num_params) for a in without.layers
    ] == [(b.class_name, b.num_params) for b in with_weights.layers]
    assert _computing(without) == _computing(with_weights)
    assert _flops_by_layer(without) == _flops_by_layer(with_weights)
