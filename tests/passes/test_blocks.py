"""passes.blocks: a weightless model's repeated blocks are traced two deep and the others
written from the second; the graph is the full trace's, op for op, and plans the same."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import keras
import pytest

from cost_models.estimate.costs import cost_graph
from partitioner.api import prepare
from partitioner.core.ir import Graph
from partitioner.core.options import TargetOptions
from partitioner.simulation.evaluate import evaluate
from partitioner.solvers import get_solver, solve
from passes import blocks
from passes.trace import placement_units, trace_model
from passes.weightless import build_without_weights

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import decoder


def _sequence(graph: Graph) -> list[tuple[Any, ...]]:
    """Each op as the rest of the pipeline sees it, in graph order (ids aside)."""
    return [
        (o.layer, o.op_type, o.phase, o.output_shapes, o.output_bytes, o.flops, o.transposed_bytes)
        for o in graph.ops
    ]


def _edges(graph: Graph) -> list[tuple[Any, ...]]:
    position = {o.id: k for k, o in enumerate(graph.ops)}
    return sorted((position[e.src], position[e.dst], e.bytes, e.output_index) for e in graph.edges)


def _same_as_the_full_trace(
    model: keras.Model, monkeypatch: pytest.MonkeyPatch, input_shape: Any = None
) -> None:
    expanded = trace_model(model, batch_size=4, input_shape=input_shape).graph
    with monkeypatch.context() as patch:
        patch.setattr(blocks, "MIN_BLOCKS", 10**6)  # no run is long enough: trace it all
        full = trace_model(model, batch_size=4, input_shape=input_shape).graph
    assert _sequence(expanded) == _sequence(full)
    assert _edges(expanded) == _edges(full)
    assert expanded.layers == full.layers
    # and so every cost, solver and simulation downstream is the same
    topology = prepare(TargetOptions(gpus=4, device_type="a100-80gb", batch_size=4)).topology
    costed = [cost_graph(g, topology=topology, optimizer="adam") for g in (expanded, full)]
    result, _ = solve(costed[0], get_solver("metis", seed=0, time_limit_s=5))
    steps = [evaluate(c, result.assignment).step_time_s for c in costed]
    assert steps[0] == steps[1]


@pytest.mark.parametrize("swiglu", [True, False], ids=["llama", "gpt"])
def test_the_expanded_graph_is_the_full_trace_op_for_op(
    swiglu: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    shape = decoder.DecoderShape("tiny", 7, 64, 2, 128, 16, 100, swiglu)
    model = build_without_weights(lambda: decoder.decoder(shape))
    repeat = blocks.find_repeat(model, [u.name for u in placement_units(model)])
    assert repeat is not None and (repeat.period, repeat.count) == (9 if swiglu else 7, 7)
    _same_as_the_full_trace(model, monkeypatch)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["GPT2Backbone", "LlamaBackbone"])
def test_keras_hub_backbones_expand_to_their_full_trace(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One unit per transformer layer, every layer reading the padding mask, dropout seeds;
    Llama's decoder layer has no working get_config (compared by its attributes)."""
    keras_hub = pytest.importorskip("keras_hub")
    sizes = {"vocabulary_size": 500, "num_layers": 6, "hidden_dim": 64, "intermediate_dim": 128}
    if name == "GPT2Backbone":
        sizes |= {"num_heads": 2, "max_sequence_length": 32}
    else:
        sizes |= {"num_query_heads": 2, "num_key_value_heads": 2}
    model = build_without_weights(lambda: getattr(keras_hub.models, name)(**sizes))
    repeat = blocks.find_repeat(model, [u.name for u in placement_units(model)])
    assert repeat is not None and (repeat.period, repeat.count) == (1, 6)
    _same_as_the_full_trace(model, monkeypatch, {"token_ids": (16,), "padding_mask": (16,)})


def test_the_reduced_trace_runs_only_two_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    shape = decoder.DecoderShape("tiny", 6, 32, 2, 64, 8, 50, True)
    model = build_without_weights(lambda: decoder.decoder(shape))
    called: list[str] = []
    original = keras.layers.Layer.__call__

    def counting(layer: Any, *args: Any, **kwargs: Any) -> Any:
        called.append(layer.name)
        return original(layer, *args, **kwargs)

    monkeypatch.setattr(keras.layers.Layer, "__call__", counting)
    graph = trace_model(model, batch_size=2).graph
    assert "attn_1" in called and "attn_2" not in called and "attn_5" not in called
    assert {o.layer for o in graph.ops} >= {"attn_5", "ffn_down_5", "norm_ffn_3"}


def test_no_run_is_found_where_blocks_are_not_alike() -> None:
    def varied() -> keras.Model:
        x = keras.Input((8,))
        h = x
        for width in (16, 16, 32, 32, 64, 64):
            h = keras.layers.Dense(width, activation="relu")(h)
        return keras.Model(x, h)

    model = build_without_weights(varied)
    assert blocks.find_repeat(model, [u.name for u in placement_units(model)]) is None


def test_a_stack_read_in_the_middle_is_not_a_run() -> None:
    def skip() -> keras.Model:
        x = keras.Input((8,))
        hs = [x]
        for k in range(6):
            hs.append(keras.layers.Dense(8, name=f"d{k}")(hs[-1]))
        out = keras.layers.Add(name="sum")([hs[-1], hs[3]])  # reads a middle block
        return keras.Model(x, out)

    model = build_without_weights(skip)
    assert blocks.find_repeat(model, [u.name for u in placement_units(model)]) is None


def test_a_run_holding_little_of_the_model_is_traced_whole() -> None:
    """ResNet-50's one run (five identity blocks of stage 4, ten layers each) holds 30 of its
    176 layers: the reduced trace would save a sixth of the trace, and its blocks' ops differ
    (BatchNormalization's gradients), so the whole model was traced after it, at twice the
    time of tracing it whole at once. A run is traced two blocks deep only where the blocks
    it skips hold a third of the model's layers (each unit with its sublayers)."""
    names = tuple(f"u{k}" for k in range(12))
    four = blocks.Repeat(start=2, period=2, count=4, unit_names=names)  # skips units 6..9
    assert blocks.worth_reducing(four, [1] * 12)  # 4 of 12 layers skipped: a third
    assert not blocks.worth_reducing(four, [3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 3, 3])  # 4 of 20
    assert blocks.worth_reducing(four, [1, 1, 1, 1, 1, 1, 5, 5, 5, 5, 1, 1])  # 20 of 28
    assert not blocks.worth_reducing(four, [10] * 6 + [1] * 4 + [10] * 2)  # 4 of 84
