"""The optimizer's update of a step: timed as Keras runs it (cost_models.measure.update) and
given to the layers' backward ops by their weights and slots (cost_models.estimate.costs)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from cost_model_graphs import mlp

from cost_models.devices.topology import parse_topology
from cost_models.estimate.costs import cost_graph, with_update_time
from partitioner.core.ir import Phase


def _costed() -> object:
    topology = parse_topology({"devices": [{"type": "cpu", "count": 2}]}, origin="t")
    return cost_graph(mlp(), topology=topology)


def test_the_update_goes_to_each_layers_backward_by_its_weights() -> None:
    costed = _costed()
    updated = with_update_time(costed, [1], 0.010)
    assert updated.op_compute_time_s[0] == costed.op_compute_time_s[0]  # row 0 not asked
    before, after = costed.op_compute_time_s[1], updated.op_compute_time_s[1]
    assert sum(after) - sum(before) == pytest.approx(0.010)
    weights = {m.layer: m.param_bytes + m.optimizer_bytes for m in costed.layer_memory}
    total = sum(weights.values())
    for layer, weight in weights.items():
        ops = [
            i for i, op in enumerate(costed.graph.ops)
            if op.layer == layer and op.phase is Phase.BACKWARD
        ]  # fmt: skip
        if ops:
            added = sum(after[i] - before[i] for i in ops)
            assert added == pytest.approx(0.010 * weight / total)
    forward = [i for i, op in enumerate(costed.graph.ops) if op.phase is Phase.FORWARD]
    assert all(after[i] == before[i] for i in forward)
    assert with_update_time(costed, [1], 0.0) is costed


def test_the_update_is_timed_on_a_clone_and_the_model_is_untouched() -> None:
    from cost_models.measure.op_profile import step_inputs
    from cost_models.measure.update import update_time_s
    from passes.trace import trace_model

    inputs = keras.Input((256,))
    h = keras.layers.Dense(512, name="wide")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(8, name="head")(h))
    weights = [w.copy() for w in model.get_weights()]
    traced = trace_model(model, batch_size=32)
    seconds = update_time_s(
        model, traced.step_function, step_inputs(traced), keras.optimizers.SGD, rounds=3
    )
    assert seconds is not None and 0.0 <= seconds < 1.0
    assert all(np.array_equal(a, b) for a, b in zip(weights, model.get_weights()))
    assert not model.compiled  # nothing compiled onto the user's model


def test_a_model_keras_cannot_clone_is_not_timed() -> None:
    from cost_models.measure.update import update_time_s

    class Opaque(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(2)

        def call(self, x: object) -> object:
            return self.dense(x)

    model = Opaque()
    model(np.zeros((2, 3), np.float32))
    assert update_time_s(model, None, [np.zeros((2, 3), np.float32)], keras.optimizers.SGD) is None
