"""The GPU calibrations fitted by ``python -m benchmarks.gpu_fidelity`` are the planner's roofline
for their families: packaged with their provenance, read by the cost model, and the plan of a
published row's model predicts the benchmark's figure."""

from __future__ import annotations

import json
from importlib import resources

import pytest
from cost_model_graphs import mlp

from benchmarks.gpu_fidelity import RESULTS
from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import (
    DEFAULT_ROOFLINE,
    calibrated_roofline,
    calibration_note,
    estimate_op_times_s,
    read_calibration,
)
from cost_models.estimate.costs import cost_graph

FAMILIES = {"volta": ("v100", "v100-16gb"), "ampere": ("a100-40gb", "a100-80gb")}


def _results() -> dict[str, object]:
    return dict(json.loads(RESULTS.read_text(encoding="utf-8")))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_fitted_family_is_packaged_with_its_provenance(family: str) -> None:
    ref = resources.files("cost_models").joinpath("data", f"calibration_{family}.json")
    raw, model = read_calibration(ref.read_text(encoding="utf-8"), ref.name)
    assert raw["family"] == family
    source = str(raw["source"])
    assert "benchmarks.gpu_fidelity --write-calibration" in source
    assert "https://github.com/NVIDIA/DeepLearningExamples" in source
    fit = _results()["fit"]["volta+ampere"]  # type: ignore[index]
    expected = dict(fit["tensor_core"])
    for fp16, bf16 in (("fp16", "bf16"), ("matmul:fp16", "matmul:bf16")):
        if fp16 in expected:  # BF16 tensor cores priced as the FP16 ones (no bf16 rows)
            expected[bf16] = expected[fp16]
    assert dict(model.tensor_core_efficiency) == expected
    assert model.memory_efficiency == fit["memory"]
    assert model.default_compute_efficiency == fit["other_compute"]
    assert model.half_compute_scale == fit["half_compute_scale"][family]
    for device_type in FAMILIES[family]:
        assert calibrated_roofline(device_type) == model
        assert calibrated_roofline(device_type) is not DEFAULT_ROOFLINE


def test_the_planner_prices_a_calibrated_family_with_its_calibration() -> None:
    graph = mlp()
    costed = cost_graph(graph, device_type="a100-80gb", num_devices=1)
    assert costed.op_compute_time_s[0] == estimate_op_times_s(
        graph, get_device_type("a100-80gb"), calibrated_roofline("a100-80gb")
    )
    plain = cost_graph(graph, device_type="h100", num_devices=1)
    assert plain.op_compute_time_s[0] == estimate_op_times_s(
        graph, get_device_type("h100"), DEFAULT_ROOFLINE
    )


def test_the_note_says_which_families_are_calibrated_and_warns_when_mixed() -> None:
    assert calibration_note(["v100", "a100-40gb"]) == "roofline calibrated for ampere, volta"
    assert calibration_note(["h100"]) == "datasheet roofline (no calibration for hopper)"
    mixed = calibration_note(["v100", "h100"])
    assert "calibrated for volta but not for hopper" in mixed and "with care" in mixed


@pytest.mark.slow
def test_the_default_plan_of_resnet50_predicts_the_benchmarks_figure() -> None:
    """``partition`` with no roofline given (the planner's default) on one A100 40GB at batch
    256: the benchmark's ResNet-50 TF32 row predicted the same step."""
    import keras

    from partitioner.api import partition

    row = next(
        r
        for r in _results()["throughput"]  # type: ignore[attr-defined]
        if r["id"] == "resnet50-a100-tf32-b256"
    )
    plan = partition(
        keras.applications.ResNet50(weights=None),
        gpus=1,
        device_type="a100-40gb",
        batch_size=256,
        solver="single",
        compare_strategies=False,
    )
    assert plan.step_time_s == pytest.approx(row["predicted_step_s"], rel=1e-9)
