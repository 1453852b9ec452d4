"""The roofline's 16-bit terms: the CUDA-core half rate and the slow 16-bit kernels' bandwidth."""

from __future__ import annotations

import pytest
from cost_model_graphs import op, single_op_graph

from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import (
    RooflineModel,
    estimate_op_times_s,
    roofline_from_dict,
    roofline_to_dict,
)
from partitioner.core.errors import CatalogError

V100 = get_device_type("v100")
BASE = RooflineModel(kernel_overhead_s=0.0, default_compute_efficiency=1.0, memory_efficiency=1.0)


def test_16_bit_ops_off_the_tensor_cores_run_at_the_half_rate() -> None:
    flops = 10**12
    half = single_op_graph(op("s", "Sigmoid", "l", shape=(8,), dtype="float16", flops=flops))
    single = single_op_graph(op("s", "Sigmoid", "l", shape=(8,), flops=flops))
    model = RooflineModel(
        kernel_overhead_s=0.0, default_compute_efficiency=1.0, half_compute_scale=2.0
    )
    fp32_s = flops / V100.peak_flops_per_s["fp32"]
    assert estimate_op_times_s(single, V100, model)[-1] == pytest.approx(fp32_s)
    assert estimate_op_times_s(half, V100, model)[-1] == pytest.approx(fp32_s / 2)
    assert estimate_op_times_s(half, V100, BASE)[-1] == pytest.approx(fp32_s)


def test_slow_16_bit_kernels_get_their_own_memory_fraction() -> None:
    kind = "DepthwiseConv2dNativeBackpropFilter"
    n = 1 << 20
    half = single_op_graph(op("f", kind, "l", shape=(n,), dtype="float16"))
    single = single_op_graph(op("f", kind, "l", shape=(n,)))
    model = RooflineModel(
        kernel_overhead_s=0.0, memory_efficiency=1.0, half_memory_efficiency_by_type={kind: 0.1}
    )
    bandwidth = V100.memory_bandwidth_bytes_per_s
    assert estimate_op_times_s(half, V100, model)[-1] == pytest.approx(2 * n / bandwidth / 0.1)
    assert estimate_op_times_s(single, V100, model)[-1] == pytest.approx(4 * n / bandwidth)


def test_the_terms_round_trip_and_are_checked() -> None:
    model = RooflineModel(
        half_compute_scale=4.0,
        half_memory_efficiency_by_type={"DepthwiseConv2dNativeBackpropFilter": 0.03},
    )
    back = roofline_from_dict(roofline_to_dict(model))
    assert back.half_compute_scale == 4.0
    assert dict(back.half_memory_efficiency_by_type) == {
        "DepthwiseConv2dNativeBackpropFilter": 0.03
    }
    with pytest.raises(CatalogError, match="half_compute_scale"):
        RooflineModel(half_compute_scale=0.0)
    with pytest.raises(CatalogError, match="half_memory_efficiency_by_type"):
        RooflineModel(half_memory_efficiency_by_type={"X": 1.5})
