"""The roofline: compute-bound ops follow peak FLOP/s, memory-bound ops follow bandwidth."""

from __future__ import annotations

import time

import pytest
from cost_model_graphs import mlp, op, single_op_graph

from cost_models.devices.catalog import get_device_type
from cost_models.estimate.analytic import (
    DEFAULT_ROOFLINE,
    MATMUL_LIKE_OPS,
    ZERO_WORK_OPS,
    RooflineModel,
    estimate_op_times_s,
)
from cost_models.estimate.precision import op_peak_flops, traced_precision
from partitioner.core.errors import CatalogError
from partitioner.core.ir import Edge, Graph, LayerInfo, Op, Phase


def big_matmul(dtype: str = "bfloat16") -> Graph:
    n = 8192
    itemsize = 2 if dtype != "float32" else 4
    mm = op("mm", "MatMul", "l", shape=(n, n), dtype=dtype, flops=2 * n**3)
    return single_op_graph(mm, (n * n * itemsize, n * n * itemsize))


def test_compute_bound_time_scales_with_peak() -> None:
    v100, h100 = get_device_type("v100"), get_device_type("h100")
    for dtype in ("float32", "bfloat16", "float16"):
        g = big_matmul(dtype)
        t_v = estimate_op_times_s(g, v100)[-1] - v100.kernel_overhead_s
        t_h = estimate_op_times_s(g, h100)[-1] - h100.kernel_overhead_s
        # A float32 matmul runs on TF32 tensor cores (TensorFlow's default), 16-bit ones on the
        # tensor cores of their format.
        policy = traced_precision(g)
        peak_v = op_peak_flops(v100, "MatMul", dtype, policy)
        peak_h = op_peak_flops(h100, "MatMul", dtype, policy)
        assert t_v / t_h == pytest.approx(peak_h / peak_v)
        flops = g.ops[-1].flops
        expected = flops / (peak_h * DEFAULT_ROOFLINE.compute_efficiency("MatMul"))
        assert t_h == pytest.approx(expected)


def test_memory_bound_time_follows_bandwidth() -> None:
    n_bytes = 64 * 2**20
    add = op("add", "AddV2", "l", shape=(n_bytes // 4,), flops=n_bytes // 4)
    g = single_op_graph(add, (n_bytes, n_bytes))
    moved = 3 * n_bytes
    for name in ("t4", "a100-40gb", "h200", "cpu"):
        d = get_device_type(name)
        t = estimate_op_times_s(g, d)[-1]
        bw = d.memory_bandwidth_bytes_per_s * DEFAULT_ROOFLINE.memory_efficiency
        assert t == pytest.approx(d.kernel_overhead_s + moved / bw)


def test_zero_work_ops_cost_nothing() -> None:
    for op_type in sorted(ZERO_WORK_OPS):
        g = single_op_graph(op("z", op_type, "l", shape=(1024, 1024), flops=10**9), (4 * 2**20,))
        assert estimate_op_times_s(g, get_device_type("h100")) == (0.0, 0.0)
    assert "ZerosLike" not in ZERO_WORK_OPS and "MatMul" in MATMUL_LIKE_OPS


def test_op_without_work_pays_launch_overhead_only() -> None:
    d = get_device_type("l4")
    g = single_op_graph(Op("n", "Fill", "l", Phase.FORWARD))
    assert estimate_op_times_s(g, d) == (d.kernel_overhead_s,)


def test_efficiency_is_configurable_and_validated() -> None:
    g = big_matmul()
    d = get_device_type("a100")
    slow = RooflineModel(efficiency={"MatMul": 0.3})
    fast = RooflineModel(efficiency={"MatMul": 0.6})
    t_slow = estimate_op_times_s(g, d, slow)[-1] - d.kernel_overhead_s
    t_fast = estimate_op_times_s(g, d, fast)[-1] - d.kernel_overhead_s
    assert t_slow == pytest.approx(2 * t_fast)
    with pytest.raises(CatalogError, match=r"memory_efficiency=1\.5"):
        RooflineModel(memory_efficiency=1.5)
    with pytest.raises(CatalogError, match="'MatMul'"):
        RooflineModel(efficiency={"MatMul": 0.0})


def test_times_align_with_ops() -> None:
    g = mlp()
    times = estimate_op_times_s(g, get_device_type("t4"))
    assert len(times) == len(g.ops)
    assert times[0] == 0.0  # Placeholder
    assert all(t > 0 for t in times[1:])


def test_twenty_thousand_ops_is_fast() -> None:
    n = 20_000
    ops = tuple(
        Op(f"o{i}", "MatMul" if i % 3 == 0 else "Relu", "l", Phase.FORWARD, ((256, 256),),
           ("float32",), 256 * 256 * 4, 2 * 256**3)
        for i in range(n)
    )  # fmt: skip
    edges = tuple(Edge(f"o{i}", f"o{i + 1}", 256 * 256 * 4) for i in range(n - 1))
    g = Graph("big", ops, edges, (LayerInfo("l", "Dense"),))
    start = time.perf_counter()
    times = estimate_op_times_s(g, get_device_type("h100"))
    assert time.perf_counter() - start < 0.5
    assert len(times) == n
