"""The library API: ``partitioner.partition(model, gpus=N) -> Plan`` and ``plan.apply(model)``."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

import partitioner
from partitioner.api import prepare
from partitioner.cli.loader import load_model
from partitioner.core.errors import (
    PartitionError,
    PlanError,
    RewriteError,
    SolverError,
    UnknownDeviceError,
    UsageError,
)
from partitioner.core.options import MeasureOptions, SearchOptions, TargetOptions
from partitioner.plan.model import Plan
from passes.trace import placement_units

REPO = Path(__file__).resolve().parents[1]
CPUS = ["/device:CPU:0", "/device:CPU:1"]


@pytest.fixture(scope="module")
def mlp() -> keras.Model:
    """The MNIST MLP of examples/mnist_mlp.py (compiled, with dropout)."""
    return load_model(str(REPO / "examples" / "mnist_mlp.py"))


@pytest.fixture(scope="module")
def plan(mlp: keras.Model) -> Plan:
    return partitioner.partition(mlp, gpus=2, device_type="h100", batch_size=16, solver="metis")


def test_partition_returns_a_plan(plan: Plan, mlp: keras.Model) -> None:
    assert isinstance(plan, Plan)
    assert plan.num_devices == 2 and plan.device_type == "h100"
    assert plan.batch_size == 16
    assert plan.solver.name == "metis" and plan.solver.status
    assert sorted(plan.assignment) == sorted(u.name for u in placement_units(mlp))
    assert set(plan.assignment.values()) == {0, 1}
    assert plan.step_time_s > 0 and 0 < plan.lower_bound_s <= plan.step_time_s
    assert [d.device for d in plan.per_device] == [0, 1]
    assert {b.solver for b in plan.baselines} >= {"single", "even"}


@pytest.mark.parametrize("solver", ["even", "single"])
def test_baseline_solvers(mlp: keras.Model, solver: str) -> None:
    plan = partitioner.partition(mlp, gpus=2, batch_size=16, solver=solver)
    assert plan.solver.name == solver
    used = set(plan.assignment.values())
    assert used == ({0} if solver == "single" else {0, 1})
    assert solver not in {b.solver for b in plan.baselines}


@pytest.mark.parametrize("gpus", [0, -1, True, 2.0, "2"])
def test_bad_gpus(mlp: keras.Model, gpus: object) -> None:
    with pytest.raises(UsageError, match=r"gpus=.* must be a positive integer"):
        partitioner.partition(mlp, gpus=gpus)  # type: ignore[arg-type]


def test_option_objects_plan_as_the_keywords_do(mlp: keras.Model, plan: Plan) -> None:
    grouped = partitioner.partition(
        mlp,
        target=TargetOptions(gpus=2, device_type="h100", batch_size=16),
        search=SearchOptions(solver="metis"),
        measure=MeasureOptions(),
    )
    assert grouped.assignment == plan.assignment
    assert grouped.step_time_s == pytest.approx(plan.step_time_s)


def test_option_objects_and_keywords_do_not_mix(mlp: keras.Model) -> None:
    with pytest.raises(UsageError, match="got target= and also batch_size=16"):
        partitioner.partition(mlp, target=TargetOptions(gpus=2), batch_size=16)
    with pytest.raises(UsageError, match="got search= and also pipeline=True"):
        partitioner.partition(mlp, gpus=2, search=SearchOptions(), pipeline=True)


def test_prepare_checks_options_in_api_terms_without_a_model() -> None:
    prepared = prepare(TargetOptions(gpus=2, device_type="a100"), SearchOptions(pipeline=True))
    assert prepared.topology.num_devices == 2 and prepared.num_microbatches == 8
    assert prepared.solver.name == "auto" and prepared.schedule is not None
    with pytest.raises(UsageError) as info:
        prepare(TargetOptions(gpus=2), SearchOptions(pipeline=True, num_microbatches=3))
    assert "batch_size=32 is not divisible by num_microbatches=3" in str(info.value)
    with pytest.raises(UsageError) as info:
        prepare(TargetOptions(gpus=2), measure=MeasureOptions(profile_ops=True))
    assert "device_type='cpu'" in str(info.value) and "--" not in str(info.value)


def test_unknown_device_type(mlp: keras.Model) -> None:
    with pytest.raises(UnknownDeviceError, match="'nope'") as info:
        partitioner.partition(mlp, gpus=2, device_type="nope")
    assert "h100" in str(info.value) and "v100" in str(info.value)
    assert isinstance(info.value, PartitionError)


def test_unknown_solver(mlp: keras.Model) -> None:
    with pytest.raises(SolverError, match="'nope'") as info:
        partitioner.partition(mlp, gpus=2, solver="nope")
    assert "metis" in str(info.value) and "even" in str(info.value)


def test_slower_device_predicts_slower_step(mlp: keras.Model, plan: Plan) -> None:
    v100 = partitioner.partition(mlp, gpus=2, device_type="v100", batch_size=16, solver="metis")
    assert v100.device_type == "v100"
    assert v100.step_time_s > plan.step_time_s


def test_advice_for_a_model_that_fits_one_device(plan: Plan) -> None:
    assert any("--pipeline" in line for line in plan.advice), plan.advice


def test_apply_on_cpu_devices_matches_and_trains(mlp: keras.Model, plan: Plan) -> None:
    placed = plan.apply(mlp, devices=CPUS)
    assert set(placed.layer_devices.values()) == set(CPUS)
    assert {n: CPUS[d] for n, d in plan.assignment.items()} == placed.layer_devices

    x = np.random.default_rng(0).random((8, 784), dtype=np.float32)
    expected = mlp(x, training=False).numpy()
    got = np.asarray(placed(x, training=False))
    assert got.shape == expected.shape
    assert float(np.max(np.abs(got - expected))) <= 1e-5

    y = np.eye(10, dtype=np.float32)[np.arange(32) % 10]
    xs = np.random.default_rng(1).random((32, 784), dtype=np.float32)
    history = placed.fit(xs, y, batch_size=16, epochs=1, verbose=0)
    loss = history.history["loss"][0]
    assert math.isfinite(loss)


def test_apply_without_devices_needs_gpus(mlp: keras.Model, plan: Plan) -> None:
    with pytest.raises(RewriteError, match="devices="):
        plan.apply(mlp)


def test_apply_with_wrong_number_of_devices(mlp: keras.Model, plan: Plan) -> None:
    with pytest.raises(PlanError, match="2 devices but devices= names 3"):
        plan.apply(mlp, devices=[*CPUS, "/device:CPU:2"])


def test_apply_to_another_model(plan: Plan) -> None:
    other = keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, name="dense_in"),
            keras.layers.Dense(10, name="other_out"),
        ],
        name="other",
    )
    with pytest.raises(PlanError, match="made for model 'mnist_mlp' and not for 'other'") as info:
        plan.apply(other, devices=CPUS)
    message = str(info.value)
    assert "other_out" in message  # in the model, not the plan
    assert "dense_out" in message and "dense_hidden" in message  # in the plan, not the model


def test_pure_parts_import_without_tensorflow() -> None:
    code = (
        "import partitioner, partitioner.core.ir, partitioner.solvers, partitioner.simulation.evaluate, "
        "cost_models.estimate.costs\n"
        "import sys\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'\n"
        "assert 'keras' not in sys.modules, 'keras was imported'\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr


def test_the_plan_compares_every_strategy_by_its_predicted_step(plan: Plan) -> None:
    from partitioner.core.strategy import Family

    rows = plan.strategies
    families = {r.family for r in rows}
    assert {Family.SINGLE, Family.DATA_PARALLEL, Family.PIPELINE, Family.PLACED} <= families
    assert [r.step_time_s for r in rows if r.fits] == sorted(r.step_time_s for r in rows if r.fits)
    (chosen,) = [r for r in rows if r.chosen]
    assert chosen.step_time_s == min(r.step_time_s for r in rows if r.fits)
    assert all(r.why_not for r in rows if not r.chosen)
    single = next(r for r in rows if r.family is Family.SINGLE)
    assert single.speedup_over_single == pytest.approx(1.0)
    # the advice comes from that table first
    assert plan.advice[0].startswith(f"Fastest predicted strategy: {chosen.description}")
    # saved and read back whole
    assert Plan.from_json_dict(plan.to_json_dict()).strategies == rows


def test_comparing_strategies_can_be_left_out(mlp: keras.Model) -> None:
    plan = partitioner.partition(
        mlp, gpus=2, batch_size=16, solver="even", compare_strategies=False
    )
    assert plan.strategies == ()
    assert "strategies" not in dict(plan.phase_times_s)
