"""The API's pipelined plans, topology files, and what ``Plan.apply`` / ``load_plan`` refuse."""

from __future__ import annotations

import json
from pathlib import Path

import keras
import numpy as np
import pytest

import partitioner
from partitioner.cli.loader import load_model
from partitioner.core.errors import PlanError, UsageError
from partitioner.core.ir import EventKind, Schedule
from partitioner.plan.model import Plan, load_plan

REPO = Path(__file__).resolve().parents[1]
CPUS = ["/device:CPU:0", "/device:CPU:1"]


@pytest.fixture(scope="module")
def mlp() -> keras.Model:
    return load_model(str(REPO / "examples" / "mnist_mlp.py"))


@pytest.fixture(scope="module")
def pipelined(mlp: keras.Model) -> Plan:
    return partitioner.partition(
        mlp, gpus=2, batch_size=16, solver="dp", pipeline=True, schedule="1f1b"
    )


def test_pipelined_plan_records_schedule_stages_and_timeline(pipelined: Plan) -> None:
    info = pipelined.pipeline
    assert info is not None
    assert info.schedule is Schedule.ONE_F_ONE_B
    # Default M: the most micro-batches up to 4 x devices that divide the batch.
    assert info.num_microbatches == 8
    assert sorted(info.stage_devices) == [0, 1]
    assert len(info.bubble_fraction) == 2 and all(0 <= b < 1 for b in info.bubble_fraction)
    kinds = {e.kind for e in pipelined.timeline}
    assert {EventKind.FORWARD, EventKind.BACKWARD} <= kinds
    assert {e.microbatch for e in pipelined.timeline} == set(range(8))
    assert max(e.end_s for e in pipelined.timeline) == pytest.approx(pipelined.step_time_s)
    assert pipelined.lower_bound_s <= pipelined.step_time_s


def test_a_pipeline_is_priced_at_its_micro_batch_not_at_a_share_of_the_batch(
    pipelined: Plan,
) -> None:
    # 8 micro-batches of 2 samples: every kernel's fixed cost is paid 8 times, so this small
    # MLP's pipeline is slower than its own plain split (a linear 1/8 share would hide it)
    plain = next(b for b in pipelined.baselines if b.solver == "dp without pipelining")
    assert plain.step_time_s is not None and pipelined.step_time_s > plain.step_time_s
    assert "micro-batch cost" in dict(pipelined.phase_times_s)


def test_dropout_is_warned_loudly_under_microbatches(pipelined: Plan) -> None:
    assert any("NOT EXACT" in w and "Dropout" in w for w in pipelined.warnings)


def test_plain_plan_has_a_timeline_and_no_pipeline(mlp: keras.Model) -> None:
    plan = partitioner.partition(mlp, gpus=2, batch_size=16, solver="dp")
    assert plan.pipeline is None and plan.warnings == ()
    assert plan.timeline and max(e.end_s for e in plan.timeline) == pytest.approx(plan.step_time_s)
    assert len(plan.layer_edges) >= len(plan.layer_order) - 1
    assert len(plan.layer_compute_s) == len(plan.layer_order)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpus": 2, "pipeline": True, "num_microbatches": 3}, "not divisible by num_microbatches=3"),
        ({"gpus": 2, "pipeline": True, "num_microbatches": 0}, "num_microbatches=0 must be"),
        ({"gpus": 1, "pipeline": True}, "needs at least 2 devices"),
        ({"gpus": 2, "pipeline": True, "schedule": "zigzag"}, "known: gpipe, 1f1b"),
        ({"gpus": 2, "num_microbatches": 4}, "needs pipeline=True"),
    ],
)
def test_bad_pipeline_options(mlp: keras.Model, kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        partitioner.partition(mlp, batch_size=16, **kwargs)


def test_pipelined_plan_applies_as_a_pipeline_that_trains_like_the_original(
    pipelined: Plan, mlp: keras.Model, tmp_path: Path
) -> None:
    pipelined.save(tmp_path / "p.json")
    plan = load_plan(tmp_path / "p.json")
    assert plan.pipeline == pipelined.pipeline
    model = plan.apply(mlp, devices=CPUS)
    assert type(model).__name__ == "PipelinedModel"
    assert model.warnings  # dropout
    x = np.random.default_rng(0).normal(size=(16, 784)).astype("float32")
    np.testing.assert_allclose(model.predict(x, verbose=0), mlp.predict(x, verbose=0), atol=1e-5)


def test_topology_file_gives_the_faster_device_more_work() -> None:
    """Eight identical layers on an H100 + V100 machine: the H100 takes more of them."""
    inputs = keras.Input((2048,))
    x = inputs
    for k in range(8):
        x = keras.layers.Dense(2048, name=f"dense_{k}")(x)
    model = keras.Model(inputs, x, name="chain")
    plan = partitioner.partition(
        model,
        gpus=None,
        batch_size=256,
        topology=str(REPO / "examples" / "topologies" / "two_gpu_types.toml"),
        solver="ilp",
        pipeline=True,
    )
    assert [d.device_type for d in plan.devices] == ["h100", "v100"]
    assert "h100" in plan.link and "v100" in plan.link
    on = [len([n for n in d.layers if n.startswith("dense_")]) for d in plan.per_device]
    assert on[0] > on[1] >= 1, on
    # the pipeline starts on the device the solver gave the first layer, whichever index it has
    assert plan.pipeline is not None
    assert plan.pipeline.stage_devices[0] == plan.assignment["dense_0"]
    placed = plan.apply(model, devices=CPUS)
    reference = keras.models.clone_model(model)
    reference.set_weights(model.get_weights())
    x = np.random.default_rng(0).normal(size=(256, 2048)).astype("float32")
    for m in (placed, reference):
        m.compile(optimizer="sgd", loss="mse")
        m.train_on_batch(x, np.zeros((256, 2048), "float32"))
    for got, want in zip(placed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_plan_for_another_model_is_refused_naming_layers(pipelined: Plan) -> None:
    other = keras.Sequential(
        [keras.Input((784,)), keras.layers.Dense(10, name="only_layer")], name="other"
    )
    with pytest.raises(PlanError, match="missing layers") as info:
        pipelined.apply(other, devices=CPUS)
    assert "only_layer" in str(info.value) and "\n" not in str(info.value)


def test_load_plan_validates_against_the_schema(pipelined: Plan, tmp_path: Path) -> None:
    data = json.loads(pipelined.to_json())
    data["predicted"]["step_time_s"] = "fast"
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=r"predicted\.step_time_s"):
        load_plan(bad)
    del data["predicted"]
    bad.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="predicted"):
        load_plan(bad)


def test_profile_measures_once_then_reads_the_cache(mlp: keras.Model, tmp_path: Path) -> None:
    kwargs = {"gpus": 2, "device_type": "cpu", "batch_size": 16, "solver": "dp", "profile": True}
    first = partitioner.partition(mlp, cache_dir=str(tmp_path), **kwargs)
    second = partitioner.partition(mlp, cache_dir=str(tmp_path), **kwargs)
    assert set(first.measured_layers) == set(first.layer_order)
    assert second.measured_layers == first.measured_layers
    # (Identical layers, like the two dropouts, share one cache entry even in the first run.)
    assert " 0 timings measured" not in first.cost_notes[0], first.cost_notes
    assert " 0 timings measured" in second.cost_notes[0], second.cost_notes
    # Same measured costs, same plan.
    assert second.assignment == first.assignment
    assert second.step_time_s == pytest.approx(first.step_time_s)
    assert any(k == "profile" for k, _ in second.phase_times_s)


def test_profile_refuses_devices_that_are_not_here(mlp: keras.Model, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="none here is a h100"):
        partitioner.partition(
            mlp, gpus=2, device_type="h100", batch_size=16, profile=True, cache_dir=str(tmp_path)
        )


def test_auto_pipelines_the_best_simulated_candidate(mlp: keras.Model) -> None:
    plan = partitioner.partition(mlp, gpus=2, batch_size=16, solver="auto", pipeline=True)
    note = next(n for n in plan.solver.notes if n.startswith("pipelined 1f1b x 8 simulated"))
    for name in ("auto", "dp", "time", "even", "metis"):
        assert f"{name}: " in note
    # No contiguous candidate simulated faster than the plan it kept.
    even = partitioner.partition(mlp, gpus=2, batch_size=16, solver="even", pipeline=True)
    dp = partitioner.partition(mlp, gpus=2, batch_size=16, solver="dp", pipeline=True)
    assert plan.step_time_s <= min(even.step_time_s, dp.step_time_s) * (1 + 1e-9)


def test_profile_ops_times_the_step_and_replaces_cpu_estimates(mlp: keras.Model) -> None:
    estimated = partitioner.partition(mlp, gpus=2, device_type="cpu", batch_size=16, solver="even")
    plan = partitioner.partition(
        mlp, gpus=2, device_type="cpu", batch_size=16, solver="even", profile_ops=True
    )
    assert any("inside the training step" in n for n in plan.cost_notes)
    # Every layer with work (the Dense layers at least) was timed.
    dense = {n for n in plan.layer_order if "dense" in n}
    assert dense and dense <= set(plan.measured_layers) <= set(plan.layer_order)
    assert not estimated.measured_layers
    # The layer times are the measured ones, not the estimates.
    assert plan.layer_compute_s != estimated.layer_compute_s
    assert all(t > 0 for t in plan.layer_compute_s)


def test_profile_ops_refuses_a_plan_without_cpus(mlp: keras.Model) -> None:
    with pytest.raises(UsageError, match="profile_ops=True times ops on this machine's CPU"):
        partitioner.partition(mlp, gpus=2, device_type="h100", batch_size=16, profile_ops=True)
