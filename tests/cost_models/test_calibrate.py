"""Calibration: the least-squares fit recovers known roofline factors and reports its error."""

from __future__ import annotations

import json
import random

import pytest
from cost_model_graphs import mlp

from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import (
    DEFAULT_ROOFLINE,
    RooflineModel,
    calibrated_roofline,
    device_family,
    estimate_op_times_s,
)
from cost_models.estimate.calibrate import (
    LayerSample,
    OpClass,
    OpWork,
    fit_roofline,
    fit_stats,
    layer_samples,
    load_calibration,
    op_class,
    predict_sample_s,
    save_calibration,
)
from partitioner.core.errors import CatalogError, PartitionError
from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase

CPU = get_device_type("cpu")
TRUE = RooflineModel(
    efficiency={"MatMul": 0.8, "Conv2D": 0.5, "Conv2DBackpropFilter": 0.25},
    default_compute_efficiency=0.05,
    memory_efficiency=0.4,
    kernel_overhead_s=5e-6,
)
DENSE_TYPES = ("MatMul", "Conv2D", "Conv2DBackpropFilter")


def synthetic_samples(model: RooflineModel, n: int, seed: int, noise: float = 0.0) -> list[LayerSample]:
    rng = random.Random(seed)
    samples = []
    for i in range(n):
        ops = []
        for _ in range(rng.randint(1, 6)):
            op_type = rng.choice((*DENSE_TYPES, "Relu", "AddV2", "Mean"))
            dense = op_type in DENSE_TYPES
            flops = int(10 ** rng.uniform(4, 9)) if dense else int(10 ** rng.uniform(3, 7))
            ops.append(OpWork(op_type, flops, int(10 ** rng.uniform(3, 8))))
        probe = LayerSample("m", f"l{i}", Phase.FORWARD, tuple(ops), 1.0)
        t = predict_sample_s(probe, CPU, model) * (1 + rng.uniform(-noise, noise))
        samples.append(LayerSample("m", f"l{i}", Phase.FORWARD, tuple(ops), t))
    return samples


def test_fit_recovers_known_factors() -> None:
    cal = fit_roofline(synthetic_samples(TRUE, 80, seed=1), CPU)
    assert cal.class_efficiency["matmul"] == pytest.approx(0.8, rel=1e-6)
    assert cal.class_efficiency["conv"] == pytest.approx(0.5, rel=1e-6)
    assert cal.class_efficiency["conv_backprop_filter"] == pytest.approx(0.25, rel=1e-6)
    assert cal.roofline.default_compute_efficiency == pytest.approx(0.05, rel=1e-6)
    assert cal.roofline.memory_efficiency == pytest.approx(0.4, rel=1e-6)
    assert cal.roofline.kernel_overhead_s == pytest.approx(5e-6, rel=1e-6)
    # Per-op-type factors follow their class; classes the data never saw keep the start value.
    assert cal.roofline.compute_efficiency("BatchMatMulV2") == pytest.approx(0.8, rel=1e-6)
    assert cal.roofline.compute_efficiency("DepthwiseConv2dNative") == DEFAULT_ROOFLINE.compute_efficiency(
        "DepthwiseConv2dNative"
    )
    assert "depthwise" not in cal.class_efficiency
    assert cal.fit.rms_relative_error < 1e-6 and cal.fit.num_samples == 80


def test_fit_error_is_reported_for_noisy_data() -> None:
    samples = synthetic_samples(TRUE, 200, seed=2, noise=0.2)
    cal = fit_roofline(samples, CPU)
    # Uniform +-20% noise: the fit cannot beat the noise, and it lands near the true factors.
    assert 0.03 < cal.fit.rms_relative_error < 0.2
    assert cal.class_efficiency["matmul"] == pytest.approx(0.8, rel=0.15)
    # The default model fits these samples far worse than the calibrated one.
    assert fit_stats(samples, CPU, DEFAULT_ROOFLINE).rms_relative_error > 2 * cal.fit.rms_relative_error


def test_fit_needs_samples_and_positive_times() -> None:
    with pytest.raises(PartitionError, match="no samples"):
        fit_roofline([], CPU)
    with pytest.raises(PartitionError, match="measured_time_s"):
        LayerSample("m", "l", Phase.FORWARD, (OpWork("MatMul", 1, 1),), 0.0)


def test_prediction_matches_the_analytic_model() -> None:
    g = mlp()
    times = estimate_op_times_s(g, CPU, TRUE)
    per_layer: dict[tuple[str, Phase], float] = {}
    for op, t in zip(g.ops, times):
        if op.layer is not None:
            key = (op.layer, op.phase)
            per_layer[key] = per_layer.get(key, 0.0) + t
    samples = layer_samples(g, {"dense1": (1.0, 2.0), "dense2": (3.0, 4.0)})
    assert {(s.layer, s.phase) for s in samples} == set(per_layer)
    for s in samples:
        assert predict_sample_s(s, CPU, TRUE) == pytest.approx(per_layer[(s.layer, s.phase)])
        assert s.measured_time_s == {"dense1": (1.0, 2.0), "dense2": (3.0, 4.0)}[s.layer][
            0 if s.phase is Phase.FORWARD else 1
        ]


def test_layer_samples_skip_opaque_and_unmeasured_layers() -> None:
    ops = (
        Op("x", "Placeholder", None, Phase.FORWARD, ((8,),), ("float32",), 32),
        Op("loop", "While", "rnn", Phase.FORWARD, ((8,),), ("float32",), 32),
        Op("mm", "MatMul", "dense", Phase.FORWARD, ((8,),), ("float32",), 32, 1000),
        Op("id", "Identity", "dense", Phase.FORWARD, ((8,),), ("float32",), 32),
    )
    edges = (Edge("x", "loop", 32), Edge("loop", "mm", 32), Edge("mm", "id", 32))
    g = Graph("g", ops, edges, (LayerInfo("rnn", "LSTM"), LayerInfo("dense", "Dense")))
    samples = layer_samples(g, {"rnn": (1.0, 1.0), "dense": (1.0, 0.0)}, model="mine")
    assert [(s.model, s.layer, s.phase) for s in samples] == [("mine", "dense", Phase.FORWARD)]
    assert [o.op_type for o in samples[0].ops] == ["MatMul"]  # Identity is zero-work
    assert samples[0].ops[0].bytes_moved == 64


def test_op_classes() -> None:
    assert op_class("BatchMatMulV2") is OpClass.MATMUL
    assert op_class("Conv2DBackpropInput") is OpClass.CONV_BACKPROP_INPUT
    assert op_class("DepthwiseConv2dNativeBackpropFilter") is OpClass.DEPTHWISE
    assert op_class("Relu") is OpClass.OTHER


def test_save_and_load_round_trip(tmp_path: object) -> None:
    from pathlib import Path

    cal = fit_roofline(synthetic_samples(TRUE, 30, seed=3), CPU, source="synthetic")
    path = Path(str(tmp_path)) / "cal.json"
    save_calibration(cal, path)
    back = load_calibration(path)
    assert back.device_type == "cpu" and back.family == "cpu" and back.source == "synthetic"
    assert back.fit == cal.fit
    assert dict(back.roofline.efficiency) == dict(cal.roofline.efficiency)
    assert back.roofline.memory_efficiency == cal.roofline.memory_efficiency
    assert back.roofline.kernel_overhead_s == cal.roofline.kernel_overhead_s
    raw = json.loads(path.read_text())
    raw["roofline"]["memory_efficiency"] = 2.0
    path.write_text(json.dumps(raw))
    with pytest.raises(CatalogError, match=r"memory_efficiency=2\.0"):
        load_calibration(path)
    path.write_text("{")
    with pytest.raises(CatalogError, match="not valid JSON"):
        load_calibration(path)


def test_packaged_calibration_applies_to_its_family() -> None:
    assert device_family("h200") == device_family("h100") == "hopper"
    assert device_family("A100-80GB") == "ampere"
    cpu = calibrated_roofline("cpu")
    assert cpu is not DEFAULT_ROOFLINE and cpu.kernel_overhead_s is not None
    # No calibration ships for the GPU families: they keep the datasheet default.
    assert calibrated_roofline("h100") is DEFAULT_ROOFLINE


def test_kernel_overhead_override_is_validated() -> None:
    g = mlp()
    base = estimate_op_times_s(g, CPU, RooflineModel(kernel_overhead_s=0.0))
    more = estimate_op_times_s(g, CPU, RooflineModel(kernel_overhead_s=1e-3))
    working = [i for i, (a, b) in enumerate(zip(base, more)) if b > a]
    assert working and all(more[i] - base[i] == pytest.approx(1e-3) for i in working)
    with pytest.raises(CatalogError, match="kernel_overhead_s=-1"):
        RooflineModel(kernel_overhead_s=-1.0)


def test_fit_finds_a_device_faster_than_its_catalog_figures() -> None:
    fast = RooflineModel(
        efficiency={"MatMul": 1.0, "Conv2D": 0.5, "Conv2DBackpropFilter": 0.25},
        default_compute_efficiency=0.05,
        memory_efficiency=1.0,
        kernel_overhead_s=2e-6,
        peak_flops_scale=3.0,
        memory_bandwidth_scale=2.0,
    )
    samples = synthetic_samples(fast, 80, seed=4)
    capped = fit_roofline(samples, CPU)  # efficiencies <= 1 of the catalog: cannot fit
    free = fit_roofline(samples, CPU, max_scale=8.0)
    assert free.roofline.peak_flops_scale == pytest.approx(3.0, rel=1e-6)
    assert free.roofline.memory_bandwidth_scale == pytest.approx(2.0, rel=1e-6)
    assert free.class_efficiency["conv"] == pytest.approx(0.5, rel=1e-6)
    assert free.fit.rms_relative_error < 1e-6 < capped.fit.rms_relative_error
    with pytest.raises(PartitionError, match="max_scale"):
        fit_roofline(samples, CPU, max_scale=0.5)
