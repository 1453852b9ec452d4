"""Hostile input, round three (issue 34, D4): a subclassed model whose layers are not built.

``model.build((None, 784))`` on a subclassed ``keras.Model`` whose ``build`` does not build the
layers its ``__init__`` made marks the model built and leaves its layers unbuilt; Keras builds
them on the first call. Before, that first call was the traced step: the layers' variables were
created inside it, TensorFlow traced the step a second time, and the op-to-layer record of both
traces was read against the second graph (three layers at 0 s, initializer ops charged to the
layers, no backward pass), so two ``partition()`` calls on one instance gave different plans.
Now the trace builds such layers first, by one symbolic call outside the step (without weights
for a model that has none), and a retrace starts the record afresh.
"""

from __future__ import annotations

import collections
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import pytest

import partitioner
from partitioner.cli.loader import load_model
from partitioner.core.ir import Graph
from passes import trace, weightless

SHAPE = (784,)
BATCH = 32


class DefaultBuildMLP(keras.Model):  # type: ignore[misc]
    """Four Dense layers made in ``__init__``, and Keras's default ``build`` (which warns and
    builds none of them)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**{"name": "mlp", **kwargs})
        self.d1 = keras.layers.Dense(256, activation="relu", name="d1")
        self.d2 = keras.layers.Dense(128, activation="relu", name="d2")
        self.d3 = keras.layers.Dense(64, activation="relu", name="d3")
        self.d4 = keras.layers.Dense(10, name="d4")

    def call(self, x: Any) -> Any:
        return self.d4(self.d3(self.d2(self.d1(x))))


class PartlyBuiltMLP(DefaultBuildMLP):
    """The same, with a ``build`` that builds its first two layers only."""

    def build(self, input_shape: Any) -> None:
        self.d1.build(input_shape)
        self.d2.build(self.d1.compute_output_shape(input_shape))


def called() -> keras.Model:
    model = DefaultBuildMLP()
    model(np.zeros((2, *SHAPE), "float32"))
    return model


def default_build() -> keras.Model:
    model = DefaultBuildMLP()
    with pytest.warns(UserWarning, match="unbuilt state"):
        model.build((None, *SHAPE))
    return model


def partly_built() -> keras.Model:
    model = PartlyBuiltMLP()
    model.build((None, *SHAPE))
    return model


def never_built() -> keras.Model:
    return DefaultBuildMLP()


VARIANTS: dict[str, Callable[[], keras.Model]] = {
    "model.build, default": default_build,
    "model.build, builds 2 of 4": partly_built,
    "never built": never_built,
}


def attribution(graph: Graph) -> dict[str, Any]:
    """Per layer (glue as None): its ops (phase, type) and FLOPs; and the edges between layers
    with their bytes."""
    layer_of = {op.id: op.layer for op in graph.ops}
    ops: dict[str | None, list[tuple[str, str]]] = collections.defaultdict(list)
    flops: collections.Counter[str | None] = collections.Counter()
    for op in graph.ops:
        ops[op.layer].append((op.phase.value, op.op_type))
        flops[op.layer] += op.flops
    edges = collections.Counter(
        (layer_of[e.src], layer_of[e.dst], e.bytes)
        for e in graph.edges
        if layer_of[e.src] != layer_of[e.dst]
    )
    return {
        "layers": [info.name for info in graph.layers],
        "params": [info.num_params for info in graph.layers],
        "ops": {layer: sorted(found) for layer, found in ops.items()},
        "flops": dict(flops),
        "edges": edges,
    }


def traced(model: keras.Model) -> dict[str, Any]:
    return attribution(trace.trace_model(model, batch_size=BATCH, input_shape=SHAPE).graph)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return traced(called())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_trace_charges_ops_as_for_a_called_model(variant: str, reference: dict[str, Any]) -> None:
    model = VARIANTS[variant]()
    first, second = traced(model), traced(model)
    assert first == reference
    assert second == reference
    assert trace.unbuilt_layers(model) == []
    assert all(reference["ops"][name] for name in ("d1", "d2", "d3", "d4"))
    backward = [p for p, _ in reference["ops"]["d4"]]
    assert "backward" in backward and "forward" in backward


def test_a_layer_built_inside_the_step_is_still_charged_right(
    monkeypatch: pytest.MonkeyPatch, reference: dict[str, Any]
) -> None:
    """A layer the symbolic build cannot build is built in the step: TensorFlow traces the step
    again, and the record of the discarded first trace is not read against the second."""
    monkeypatch.setattr(trace, "build_sublayers", lambda model, specs=None, given=None: model)
    model = default_build()
    assert trace.unbuilt_layers(model) == ["d1", "d2", "d3", "d4"]
    assert traced(model) == reference


def test_a_model_without_weights_keeps_them_deferred(reference: dict[str, Any]) -> None:
    with weightless.without_weights():
        model = partly_built()
    assert weightless.is_weightless(model)
    result = trace.trace_model(model, batch_size=BATCH)
    assert result.weightless
    assert len(model.variables) == 8
    assert len(weightless.deferred_variables(model)) == 8  # nothing allocated
    found = attribution(result.graph)
    # a weightless trace has a variable argument where an ordinary one has a read op
    assert found["layers"] == reference["layers"] and found["params"] == reference["params"]
    for name in ("d1", "d2", "d3", "d4"):
        assert [t for t in found["ops"][name] if t[0] == "backward"] == [
            t for t in reference["ops"][name] if t[0] == "backward"
        ]
        assert found["flops"][name] == reference["flops"][name]


def test_the_cli_loader_builds_the_layers_without_weights(tmp_path: Path) -> None:
    path = tmp_path / "net.py"
    path.write_text(
        "import keras\n\n"
        "class Net(keras.Model):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.a = keras.layers.Dense(16)\n"
        "        self.b = keras.layers.Dense(4)\n\n"
        "    def call(self, x):\n"
        "        return self.b(self.a(x))\n\n"
        "def build_model():\n"
        "    m = Net()\n"
        "    m.build((None, 8))\n"
        "    return m\n"
    )
    with pytest.warns(UserWarning, match="unbuilt state"):
        model = load_model(str(path), weightless=True)
    assert trace.unbuilt_layers(model) == []
    assert len(weightless.deferred_variables(model)) == 4


def plan_of(model: keras.Model) -> dict[str, Any]:
    """The plan's JSON without its timings of the planner itself."""
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, input_shape=SHAPE)
    data: dict[str, Any] = json.loads(json.dumps(plan.to_json_dict()))
    data.pop("phase_times_s")
    data.pop("digest")  # of the timings too
    data["solver"].pop("solve_time_s")
    return data


def test_two_partitions_give_the_plan_of_a_called_model() -> None:
    model = default_build()
    first, second, expected = plan_of(model), plan_of(model), plan_of(called())
    assert first == expected
    assert second == expected
    assert all(t > 0 for t in first["layer_compute_s"])
