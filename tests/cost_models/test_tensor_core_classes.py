"""Tensor-core efficiency by op class: matmuls (cuBLAS) may reach another fraction of a
tensor-core peak than convolutions (cuDNN), keyed 'matmul:<peak>' in
RooflineModel.tensor_core_efficiency; without that key they share the peak's figure."""

from __future__ import annotations

import pytest
from cost_model_graphs import op, single_op_graph

from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import (
    MATMUL_OPS,
    RooflineModel,
    estimate_op_times_s,
    roofline_from_dict,
    roofline_to_dict,
    tensor_core_key,
)
from cost_models.estimate.precision import TENSOR_CORE_OPS, PrecisionPolicy

FLOPS = 10**12
A100 = get_device_type("a100-80gb")


def _time_s(op_type: str, model: RooflineModel) -> float:
    graph = single_op_graph(op("o", op_type, "l", shape=(4,), flops=FLOPS))
    return estimate_op_times_s(graph, A100, model, PrecisionPolicy.TF32)[-1]


def test_matmuls_are_a_class_of_the_tensor_core_ops() -> None:
    assert MATMUL_OPS < TENSOR_CORE_OPS
    assert tensor_core_key("BatchMatMulV2", "tf32") == "matmul:tf32"
    assert tensor_core_key("Conv2DBackpropFilter", "tf32") == "tf32"


def test_a_matmul_uses_its_class_figure_and_a_convolution_the_peaks() -> None:
    model = RooflineModel(
        tensor_core_efficiency={"tf32": 0.2, "matmul:tf32": 0.6}, kernel_overhead_s=0.0
    )
    peak = A100.peak_flops_per_s["tf32"]
    assert _time_s("MatMul", model) == pytest.approx(FLOPS / (peak * 0.6))
    assert _time_s("Conv2D", model) == pytest.approx(FLOPS / (peak * 0.2))


def test_without_a_class_figure_matmuls_share_the_peaks() -> None:
    model = RooflineModel(tensor_core_efficiency={"tf32": 0.2}, kernel_overhead_s=0.0)
    assert _time_s("Einsum", model) == pytest.approx(_time_s("Conv2D", model))


def test_class_figures_survive_the_calibration_file() -> None:
    model = RooflineModel(tensor_core_efficiency={"tf32": 0.2, "matmul:tf32": 0.6})
    back = roofline_from_dict(roofline_to_dict(model))
    assert dict(back.tensor_core_efficiency) == {"tf32": 0.2, "matmul:tf32": 0.6}
