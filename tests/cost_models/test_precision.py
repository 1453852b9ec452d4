"""Precision policies: which peak an op runs at, the bytes it moves, the memory it keeps."""

from __future__ import annotations

import pytest
from cost_model_graphs import mlp, op, single_op_graph

from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import DEFAULT_ROOFLINE, estimate_op_times_s
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import layer_memory
from cost_models.estimate.precision import (
    TENSOR_CORE_OPS,
    PrecisionPolicy,
    bytes_scale,
    op_peak_flops,
    parse_precision,
    policy_from_keras,
    traced_precision,
)
from partitioner.core.errors import UsageError

N = 8192


def _matmul(dtype: str = "float32") -> tuple[float, float]:
    """(time of a compute-bound 8192^3 matmul on an a100, its FLOPs)."""
    g = single_op_graph(op("mm", "MatMul", "l", shape=(N, N), dtype=dtype, flops=2 * N**3))
    a100 = get_device_type("a100")
    return estimate_op_times_s(g, a100)[-1] - a100.kernel_overhead_s, 2.0 * N**3


@pytest.mark.parametrize(
    ("name", "policy"),
    [
        ("fp32", PrecisionPolicy.FP32),
        ("TF32", PrecisionPolicy.TF32),
        ("fp16", PrecisionPolicy.MIXED_FLOAT16),
        ("mixed_float16", PrecisionPolicy.MIXED_FLOAT16),
        ("bf16", PrecisionPolicy.MIXED_BFLOAT16),
        ("mixed-bfloat16", PrecisionPolicy.MIXED_BFLOAT16),
    ],
)
def test_parse_precision(name: str, policy: PrecisionPolicy) -> None:
    assert parse_precision(name) is policy


def test_unknown_precision_is_one_line() -> None:
    with pytest.raises(UsageError, match=r"precision='fp8'.*fp32, tf32, mixed_float16"):
        parse_precision("fp8")


def test_keras_policy_and_tf32_flag() -> None:
    assert policy_from_keras("float32") is PrecisionPolicy.TF32
    assert policy_from_keras("float32", tf32_enabled=False) is PrecisionPolicy.FP32
    assert policy_from_keras("mixed_float16") is PrecisionPolicy.MIXED_FLOAT16
    assert policy_from_keras("mixed_bfloat16") is PrecisionPolicy.MIXED_BFLOAT16


def test_tensor_core_ops_get_the_tensor_core_peaks() -> None:
    a100, v100 = get_device_type("a100"), get_device_type("v100")
    assert op_peak_flops(a100, "Conv2D", "float32", PrecisionPolicy.TF32) == 156e12
    assert op_peak_flops(a100, "Conv2D", "float32", PrecisionPolicy.FP32) == 19.5e12
    assert op_peak_flops(a100, "MatMul", "float16", PrecisionPolicy.MIXED_FLOAT16) == 312e12
    assert op_peak_flops(a100, "MatMul", "bfloat16", PrecisionPolicy.MIXED_BFLOAT16) == 312e12
    assert op_peak_flops(v100, "MatMul", "float32", PrecisionPolicy.TF32) == 15.7e12  # no TF32
    assert op_peak_flops(v100, "Conv2DBackpropFilter", "float16", PrecisionPolicy.MIXED_FLOAT16) == 125e12
    # elementwise and depthwise ops run on the CUDA cores whatever their dtype
    assert op_peak_flops(a100, "Relu", "float16", PrecisionPolicy.MIXED_FLOAT16) == 19.5e12
    assert "DepthwiseConv2dNative" not in TENSOR_CORE_OPS


def test_float32_traces_price_as_tf32_and_16_bit_traces_as_mixed() -> None:
    t32, flops = _matmul("float32")
    t16, _ = _matmul("float16")
    eff = DEFAULT_ROOFLINE.compute_efficiency("MatMul")
    assert t32 == pytest.approx(flops / (156e12 * eff))
    assert t16 == pytest.approx(flops / (312e12 * eff))
    assert traced_precision(mlp()) is PrecisionPolicy.TF32


def test_precision_reprices_a_float32_graph() -> None:
    g = mlp()
    a100 = get_device_type("a100")
    base = estimate_op_times_s(g, a100)
    fp32 = estimate_op_times_s(g, a100, precision=PrecisionPolicy.FP32)
    mixed = estimate_op_times_s(g, a100, precision=PrecisionPolicy.MIXED_FLOAT16)
    assert sum(fp32) > sum(base) > sum(mixed)
    assert estimate_op_times_s(g, a100, precision=PrecisionPolicy.TF32) == base


def test_mixed_precision_halves_activations_not_weights() -> None:
    g = mlp()
    fp32 = layer_memory(g)
    mixed = layer_memory(g, precision=PrecisionPolicy.MIXED_FLOAT16)
    assert bytes_scale(PrecisionPolicy.TF32, PrecisionPolicy.MIXED_BFLOAT16) == 0.5
    for a, b in zip(fp32, mixed, strict=True):
        assert b.activation_bytes == round(a.activation_bytes / 2)
        assert (b.param_bytes, b.gradient_bytes, b.optimizer_bytes) == (
            a.param_bytes,
            a.gradient_bytes,
            a.optimizer_bytes,
        )
    costed = cost_graph(g, device_type="a100", num_devices=1, precision="fp16")
    assert costed.layer_memory == mixed
