"""partition() applies a training strategy: the fastest predicted family (``strategy="auto"``, the
default with ``solver="auto"``) or a forced one, and ``plan.apply`` realises it.

The plan's predicted step is the chosen strategy's simulated step (its all-reduce included), no
family row and no solver's own split is faster on that objective, the plan file round-trips the
strategy, and applying a data-parallel or hybrid plan on the logical CPU devices of
tests/conftest.py trains one step exactly like the original model on one device.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import partitioner
from partitioner.api import STRATEGY_SOLVERS
from partitioner.core.errors import PartitionError, UsageError
from partitioner.core.ir import Schedule
from partitioner.core.strategy import Family
from partitioner.plan.model import Plan
from passes.rewrite.pipeline import PipelinedModel
from passes.rewrite.replicate import ReplicatedModel, ReplicatedPipeline

CPU = [f"/device:CPU:{i}" for i in range(4)]
BATCH = 16
REL_TOL = 1e-5


def mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,), name="x")
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(64, activation="relu", name=f"fc{i}")(h)
    outputs = keras.layers.Dense(4, name="head")(h)
    return keras.Model(inputs, outputs, name="mlp")


@pytest.fixture(scope="module")
def model() -> keras.Model:
    return mlp()


@pytest.fixture(scope="module")
def auto(model: keras.Model) -> Plan:
    return partitioner.partition(model, gpus=4, batch_size=BATCH)


def test_default_plan_applies_the_fastest_family(auto: Plan) -> None:
    assert auto.strategy is not None
    chosen = [r for r in auto.strategies if r.chosen]
    assert len(chosen) == 1 and chosen[0].family is auto.strategy.family
    assert auto.step_time_s == pytest.approx(chosen[0].step_time_s)
    fitting = [r.step_time_s for r in auto.strategies if r.fits]
    assert auto.step_time_s <= min(fitting) * (1 + 1e-9)
    assert auto.device_of_layer == auto.strategy.layer_devices(0)
    assert auto.advice[0].startswith("Fastest predicted strategy: " + auto.strategy.describe())


def test_auto_is_never_slower_than_a_solvers_own_split(model: keras.Model, auto: Plan) -> None:
    """Each solver's plain split, scored by the same simulator, is no faster than auto's plan."""
    for solver in (*STRATEGY_SOLVERS, "auto"):
        split = partitioner.partition(
            model, gpus=4, batch_size=BATCH, solver=solver, compare_strategies=False
        )
        assert split.strategy is not None and split.strategy.replicas == 1
        assert auto.step_time_s <= split.step_time_s * (1 + 1e-9), solver


@pytest.mark.parametrize(
    ("family", "kind"),
    [
        (Family.DATA_PARALLEL, ReplicatedModel),
        (Family.HYBRID, ReplicatedPipeline),
        (Family.PIPELINE, PipelinedModel),
    ],
)
def test_forced_family_is_planned_saved_and_applied_exactly(
    model: keras.Model, family: Family, kind: type, tmp_path: object
) -> None:
    plan = partitioner.partition(model, gpus=4, batch_size=BATCH, strategy=family.value)
    assert plan.strategy is not None and plan.strategy.family is family
    row = next(r for r in plan.strategies if r.family is family)
    assert row.chosen and plan.step_time_s == pytest.approx(row.step_time_s)
    assert partitioner.Plan.from_json_dict(plan.to_json_dict()) == plan
    placed = plan.apply(model, devices=CPU)
    assert isinstance(placed, kind)
    _same_step_as_one_device(model, placed)


def _same_step_as_one_device(model: keras.Model, placed: keras.Model) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 32)).astype("float32")
    y = rng.normal(size=(BATCH, 4)).astype("float32")
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    for m in (reference, placed):
        m.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    want = reference.train_on_batch(x, y)
    got = placed.train_on_batch(x, y)
    assert got == pytest.approx(want, rel=REL_TOL)
    for a, b in zip(reference.get_weights(), _replica0_weights(placed, len(model.weights))):
        np.testing.assert_allclose(b, a, rtol=REL_TOL, atol=1e-7)


def _replica0_weights(placed: keras.Model, count: int) -> list[np.ndarray]:
    """The placed model's weights in the original's order (replica 0's copy)."""
    return [np.asarray(w) for w in placed.get_weights()[:count]]


def test_strategy_option_errors_name_the_way_out(model: keras.Model) -> None:
    with pytest.raises(UsageError, match=r"strategy='replicas' is not a strategy; known: auto"):
        partitioner.partition(model, gpus=2, strategy="replicas")
    with pytest.raises(UsageError, match=r"it needs compare_strategies=True"):
        partitioner.partition(model, gpus=2, strategy="auto", compare_strategies=False)
    with pytest.raises(UsageError, match=r"pipeline=True.*Use one"):
        partitioner.partition(model, gpus=2, strategy="pipeline", pipeline=True)


def test_named_solver_keeps_its_split_and_compares(model: keras.Model) -> None:
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, solver="even")
    assert plan.solver.name == "even"
    assert plan.strategy is not None and plan.strategy.replicas == 1
    assert set(plan.device_of_layer) == {0, 1}
    assert plan.strategies


def test_pipeline_flag_plan_records_its_schedule(model: keras.Model) -> None:
    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, pipeline=True)
    assert plan.strategy is not None and plan.pipeline is not None
    assert plan.strategy.schedule is Schedule.ONE_F_ONE_B
    assert plan.strategy.device_groups == (plan.pipeline.stage_devices,)


def test_replicated_plan_on_a_down_cluster_names_the_task(model: keras.Model) -> None:
    """Replicas run on a cluster from the client (tests/passes/test_cluster_replicas.py); a
    cluster that is down fails within the timeout, naming the task, before anything runs."""
    from passes.cluster.runtime import ClusterError

    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, strategy="data_parallel")
    with pytest.raises(ClusterError, match=r"worker task 0 \(127\.0\.0\.1:1\) is down"):
        plan.apply(model, cluster={"worker": ["127.0.0.1:1", "127.0.0.1:2"]}, timeout_s=0.5)


# -- more devices than layers ---------------------------------------------------------------------


def mnist_like() -> keras.Model:
    """examples/mnist_mlp.py's model: 5 layers (Dense, Dropout, Dense, Dropout, Dense)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu", name="dense_in"),
            keras.layers.Dropout(0.2, name="dropout_in"),
            keras.layers.Dense(512, activation="relu", name="dense_hidden"),
            keras.layers.Dropout(0.2, name="dropout_hidden"),
            keras.layers.Dense(10, activation="softmax", name="dense_out"),
        ],
        name="mnist_like",
    )


def three_layer_mlp() -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((32,), name="x")
    h = keras.layers.Dense(64, activation="relu", name="fc0")(inputs)
    h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(h), name="mlp3")


def _idle_is_stated(plan: Plan) -> None:
    """Every device is in the plan; the idle ones are those outside the strategy, and the advice
    names them; the plan survives its JSON file."""
    assert plan.strategy is not None
    assert set(plan.idle_devices) == set(range(plan.num_devices)) - set(plan.strategy.devices)
    if plan.idle_devices:
        assert any(
            "idle" in line and f"of the {plan.num_devices} devices" in line for line in plan.advice
        )
    assert partitioner.Plan.from_json_dict(plan.to_json_dict()) == plan


def test_more_devices_than_layers_plans() -> None:
    """README row 21: `partition examples/mnist_mlp.py --gpus 8` (5 layers) plans under auto and
    data parallelism: the layers bound the stages, not the devices."""
    model = mnist_like()
    auto = partitioner.partition(model, gpus=8, batch_size=32)
    assert auto.num_devices == 8 and auto.strategy is not None
    assert auto.strategy.stages <= 5
    assert auto.step_time_s <= min(r.step_time_s for r in auto.strategies if r.fits) * (1 + 1e-9)
    _idle_is_stated(auto)
    data_parallel = partitioner.partition(model, gpus=8, batch_size=32, strategy="data_parallel")
    strategy = data_parallel.strategy
    assert strategy is not None and strategy.family is Family.DATA_PARALLEL
    assert strategy.replicas in (2, 4, 8)
    _idle_is_stated(data_parallel)
    if strategy.replicas < 8:  # fewer replicas won: the advice says what all 8 would cost
        assert any(
            "the fastest strategy on all 8, 8 data-parallel replicas" in a
            for a in data_parallel.advice
        )


@pytest.mark.parametrize("strategy", [None, "data_parallel"])
def test_a_three_layer_mlp_plans_on_four_devices_and_applies(strategy: str | None) -> None:
    """Whatever devices the plan leaves idle, it applies on the four devices and trains one step
    as the model does on one."""
    model = three_layer_mlp()
    plan = partitioner.partition(model, gpus=4, batch_size=BATCH, strategy=strategy)
    assert plan.num_devices == 4
    _idle_is_stated(plan)
    _same_step_as_one_device(model, plan.apply(model, devices=CPU))


def test_a_named_solver_places_on_as_many_devices_as_layers_and_says_so() -> None:
    """A placement puts each layer on one device: with more devices than layers it uses as many
    as there are layers, the rest idle, and the plan says so (and still applies)."""
    model = three_layer_mlp()
    plan = partitioner.partition(
        model, gpus=4, batch_size=BATCH, solver="ilp", compare_strategies=False
    )
    assert plan.solver.name == "ilp"
    assert sorted(set(plan.device_of_layer)) == [0, 1, 2] and plan.idle_devices == (3,)
    line = (
        "A placement puts each layer on one device and the model has 3 layers: this ilp plan uses "
        "3 of the 4 devices, device 3 idle (strategy='data_parallel' can use them all, as "
        "data-parallel replicas)."
    )
    assert line in plan.advice
    assert plan.per_device[3].layers == () and plan.per_device[3].compute_s == 0
    even = next(b for b in plan.baselines if b.solver == "even")
    assert even.step_time_s is not None and even.note == "on 3 of the 4 devices"
    _same_step_as_one_device(model, plan.apply(model, devices=CPU))


def test_a_plan_measured_on_one_cluster_refuses_another(model: keras.Model) -> None:
    """A plan keeps the addresses of the cluster its topology was calibrated on; applied to
    another cluster it names the differing tasks before connecting."""
    import dataclasses

    from partitioner.plan.model import Plan

    plan = partitioner.partition(model, gpus=2, batch_size=BATCH, strategy="data_parallel")
    measured = dataclasses.replace(plan, cluster_addresses=("127.0.0.1:1", "127.0.0.1:2"))
    assert Plan.from_json_dict(json.loads(measured.to_json())).cluster_addresses == (
        "127.0.0.1:1",
        "127.0.0.1:2",
    )
    with pytest.raises(
        PartitionError, match=r"task 1: 127\.0\.0\.1:2 in the plan, 127\.0\.0\.1:3 here"
    ):
        measured.apply(model, cluster={"worker": ["127.0.0.1:1", "127.0.0.1:3"]}, timeout_s=0.5)
