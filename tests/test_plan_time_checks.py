"""Issue 17, groups 3-5: what no plan could apply to is refused in one line at plan time, layers
that emit no ops join a neighbour, and every plan partition() returns applies."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import keras
import numpy as np
import pytest

import partitioner
from partitioner.core.errors import PartitionError, RewriteError, UsageError
from partitioner.solvers import SOLVERS
from passes.checks import check_applyable, check_model, join_neighbours, opless_layers
from passes.trace import trace_model
from tests import sweep_models

CPUS = [f"/device:CPU:{i}" for i in range(4)]


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message, message
    return message


def _dense_model(name: str = "dense") -> keras.Model:
    inputs = keras.Input((8,), name="x")
    h = keras.layers.Dense(16, name="a")(inputs)
    outputs = keras.layers.Dense(2, name="b")(h)
    return keras.Model(inputs, outputs, name=name)


# -- group 4: a model class with its own step --------------------------------------------------


class OwnTrainStep(keras.Model):
    def train_step(self, data: Any) -> Any:
        return super().train_step(data)


class OwnComputeLoss(keras.Model):
    def compute_loss(self, *args: Any, **kwargs: Any) -> Any:
        return super().compute_loss(*args, **kwargs)


class OwnTestStep(keras.Model):
    def test_step(self, data: Any) -> Any:
        return super().test_step(data)


@pytest.mark.parametrize(
    ("cls", "method"),
    [(OwnTrainStep, "train_step"), (OwnComputeLoss, "compute_loss"), (OwnTestStep, "test_step")],
)
def test_a_model_class_with_its_own_step_is_refused_before_tracing(cls: Any, method: str) -> None:
    """Since issue 36 such a model is planned on whole batches or data-parallel replicas and
    placed in place: what is refused before tracing is a strategy that micro-batches
    (pipeline=True here)."""
    inputs = keras.Input((8,))
    model = cls(inputs, keras.layers.Dense(2)(inputs), name="own")
    with pytest.raises(UsageError) as exc:
        partitioner.partition(model, gpus=2, batch_size=4, pipeline=True)
    message = _one_line(exc)
    assert f"model class {cls.__name__} overrides {method}" in message
    assert "Plan.apply places such a model itself (in place)" in message
    plan = partitioner.partition(model, gpus=2, batch_size=4)
    assert plan.pipeline is None and (plan.strategy is None or plan.strategy.num_microbatches == 1)
    assert plan.strategy is None or plan.strategy.replicas == 1 or plan.strategy.stages == 1


def test_functional_and_sequential_models_pass_the_checks() -> None:
    check_model(_dense_model())
    check_model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))


# -- group 5: layers that cannot be rebuilt ----------------------------------------------------


class NoKwargs(keras.layers.Layer):
    """A custom layer whose __init__ takes no **kwargs: Keras cannot rebuild it from its config."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self.scale = scale

    def call(self, inputs: Any) -> Any:
        return inputs * self.scale


class HoldsALayer(keras.layers.Layer):
    """A custom layer given another layer as an argument, without get_config."""

    def __init__(self, inner: keras.layers.Layer, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, inputs: Any) -> Any:
        return self.inner(inputs)


@pytest.mark.parametrize(
    "make",
    [lambda: NoKwargs(0.5), lambda: HoldsALayer(keras.layers.Dense(8))],
    ids=["no-kwargs", "holds-a-layer"],
)
def test_a_layer_that_cannot_be_rebuilt_is_refused_in_one_line(make: Any) -> None:
    """Since issue 36 such a model is placed in place, as one replica or as data-parallel
    replicas; a strategy that micro-batches (strategy='pipeline' here) is what is refused, in
    one line naming the layer."""
    inputs = keras.Input((8,))
    layer = make()
    outputs = keras.layers.Dense(2)(layer(keras.layers.Dense(8)(inputs)))
    model = keras.Model(inputs, outputs, name="custom")
    with pytest.raises(UsageError) as exc:
        partitioner.partition(model, gpus=2, batch_size=4, strategy="pipeline")
    message = _one_line(exc)
    assert f"layer {layer.name!r} ({type(layer).__name__}) cannot be rebuilt" in message
    assert "Plan.apply places such a model itself (in place)" in message


# -- group 3: layers that emit no ops, and plans that apply ------------------------------------


def _opless_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    x = keras.Input((8,), name="x")
    h = keras.layers.Identity(name="id_in")(x)
    h = keras.layers.Dense(16, name="a")(h)
    h = keras.layers.Identity(name="id1")(h)
    h2 = keras.layers.Dense(16, name="b")(h)
    h = keras.layers.Add(name="add")([h, h2])
    h = keras.layers.Identity(name="id2")(h)
    h = keras.layers.Dense(16, name="c")(h)
    out = keras.layers.Dense(2, name="out")(h)
    return keras.Model(x, out, name="opless")


def test_layers_without_ops_join_the_layer_feeding_them_else_the_one_they_feed() -> None:
    model = _opless_model()
    graph = trace_model(model, batch_size=4).graph
    opless = opless_layers(graph)
    assert opless == {"id_in", "id1", "id2"}
    labels = {"id_in": 3, "a": 1, "id1": 0, "b": 2, "add": 2, "id2": 0, "c": 3, "out": 3}
    joined = join_neighbours(model, labels, opless)
    assert joined == {**labels, "id_in": 1, "id1": 1, "id2": 2}


def _train_one_step(copy: Any, x: np.ndarray, y: np.ndarray) -> None:
    copy.compile(optimizer="sgd", loss="mse")
    history = copy.fit(x, y, batch_size=len(x), epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])


def test_a_pipelined_plan_of_a_model_with_opless_layers_applies() -> None:
    model = _opless_model()
    plan = partitioner.partition(model, gpus=4, batch_size=8, solver="even", pipeline=True)
    assert plan.pipeline is not None
    devices = plan.assignment
    assert devices["id1"] == devices["a"] and devices["id2"] == devices["add"]
    copy = plan.apply(model, devices=CPUS)
    _train_one_step(copy, np.ones((8, 8), "float32"), np.ones((8, 2), "float32"))


def test_a_plan_the_pipeline_rewrite_refuses_is_refused_by_the_plan_time_check_alike() -> None:
    model = _dense_model("chain")
    plan = partitioner.partition(model, gpus=2, batch_size=8, solver="even", pipeline=True)
    assert plan.pipeline is not None
    check_applyable(model, plan)
    swapped = replace(plan, pipeline=replace(plan.pipeline, stage_devices=(1, 0)))
    with pytest.raises(RewriteError) as exc:
        check_applyable(model, swapped)
    assert "stage order" in _one_line(exc)
    with pytest.raises(PartitionError, match="stage order"):
        swapped.apply(model, devices=CPUS[:2])


def _applies(name: str, solver: str, pipeline: bool) -> None:
    with sweep_models.dtype_policy(sweep_models.sweep_model(name).dtype):
        model = sweep_models.build(name)
        try:
            # A named solver's plan applies its own split whether or not the families are
            # compared: compare them (and retrace at each replica's batch) only where the plan
            # applies the comparison's choice.
            plan = partitioner.partition(
                model, gpus=4, batch_size=4, solver=solver, pipeline=pipeline, time_limit_s=0.5,
                compare_strategies=solver == "auto" and not pipeline,
            )  # fmt: skip
        except PartitionError as exc:  # refused: in one line, at plan time
            assert "\n" not in str(exc), str(exc)
            return
        copy = plan.apply(model, devices=CPUS)
        x = sweep_models.random_inputs(model, 4)
        y = np.asarray(model(x if len(x) > 1 else x[0]))
        copy.compile(optimizer="sgd", loss="mse")
        copy.fit(x if len(x) > 1 else x[0], np.zeros_like(y), batch_size=4, epochs=1, verbose=0)


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["split", "pipeline"])
@pytest.mark.parametrize("solver", ["auto", "round-robin"])
def test_every_plan_of_gpt2_tiny_applies(solver: str, pipeline: bool) -> None:
    _applies("gpt2_tiny", solver, pipeline)


_MODELS = [m.name for m in sweep_models.SWEEP_MODELS if not m.heavy]
_PAIRS = [
    (_MODELS[(i + k * 3) % len(_MODELS)], solver)
    for i, solver in enumerate(SOLVERS)
    for k in range(3)
]
"""Every registered solver on three of the sweep's models, the models taken in turn so each is
planned by several solvers (the whole product, 9 models x 10 solvers x 2, took about 14 minutes
of CI: each case plans, applies and trains)."""


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", [False, True], ids=["split", "pipeline"])
@pytest.mark.parametrize(("name", "solver"), _PAIRS)
def test_every_plan_partition_returns_applies(name: str, solver: str, pipeline: bool) -> None:
    """Property: for the sweep's models and every registered solver, the plan partition()
    returns applies on 4 devices and trains one step, or partition() refuses in one line."""
    _applies(name, solver, pipeline)
