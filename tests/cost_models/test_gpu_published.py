"""The published results the GPU fidelity benchmark compares with: every row sourced and known."""

from __future__ import annotations

import json

from cost_model_graphs import act, op

from benchmarks.gpu_fidelity import (
    DATA,
    RESULTS,
    fix_batch_matmul_flops,
    readme_block,
    recount_flops,
)
from cost_models.devices.catalog import get_device_type
from cost_models.estimate.precision import policy_from_keras
from partitioner.core.ir import Edge, Graph, LayerInfo, Phase


def test_every_published_row_has_its_source_conditions_and_a_known_device() -> None:
    data = json.loads(DATA.read_text(encoding="utf-8"))
    rows = data["throughput"]
    assert {r["role"] for r in rows} == {"calibration", "validation"}
    for row in [*rows, *data["all_reduce"]]:
        assert row["source"].startswith("https://") and row["conditions"], row["id"]
        get_device_type(row["device"])
    for row in rows:
        assert row["published_samples_per_s"] > 0 and row["batch_size"] > 0
        assert row["precision"] in ("float32", "mixed_float16", "mixed_bfloat16")
        policy_from_keras(row["precision"])
    assert len({r["id"] for r in rows}) == len(rows)


def test_the_readme_block_renders_from_the_results() -> None:
    block = readme_block(RESULTS)
    assert "| resnet50 | a100-40gb | tf32 | 256 | 909 |" in block
    assert "calibration:" in block and "validation:" in block


def test_adjoint_batch_matmuls_are_recounted_and_others_kept() -> None:
    """TensorFlow counts x^T dy (x: (b, s, d) adjoint, output (b, d, d)) with k = d, not s."""
    b, s, d = 4, 16, 64
    wgrad_tf_count = 2 * b * d * d * d  # k = d (the registry's reading of a.shape[-1])
    forward = 2 * b * s * d * d
    ops = (
        op("x", "Placeholder", None, shape=(b, s, d)),
        op("w", "Placeholder", None, shape=(d, d)),
        op("dy", "Placeholder", None, shape=(b, s, d)),
        op("fwd", "BatchMatMulV2", "l", shape=(b, s, d), flops=forward),
        op("wgrad", "BatchMatMulV2", "l", shape=(b, d, d), flops=wgrad_tf_count,
           phase=Phase.BACKWARD),
    )  # fmt: skip
    edges = (
        Edge("x", "fwd", act(b, s, d)),
        Edge("w", "fwd", act(d, d)),
        Edge("x", "wgrad", act(b, s, d)),
        Edge("dy", "wgrad", act(b, s, d)),
    )
    graph = Graph("g", ops, edges, (LayerInfo("l", "EinsumDense"),))
    fixed = {o.id: o.flops for o in fix_batch_matmul_flops(graph).ops}
    assert fixed["fwd"] == forward
    assert fixed["wgrad"] == 2 * b * d * d * s
    assert fix_batch_matmul_flops(fix_batch_matmul_flops(graph)) == fix_batch_matmul_flops(graph)


def test_depthwise_gradients_get_their_forward_flops() -> None:
    """TensorFlow counts no FLOPs for the depthwise gradients; each does the forward's work."""
    forward = 2 * 3 * 3 * 8 * 14 * 14 * 32
    ops = (
        op("x", "Placeholder", None, shape=(8, 14, 14, 32)),
        op("dw", "DepthwiseConv2dNative", "l", shape=(8, 14, 14, 32), flops=forward),
        op("din", "DepthwiseConv2dNativeBackpropInput", "l", shape=(8, 14, 14, 32),
           phase=Phase.BACKWARD),
        op("dfilter", "DepthwiseConv2dNativeBackpropFilter", "l", shape=(3, 3, 32, 1),
           phase=Phase.BACKWARD),
        op("dw2", "DepthwiseConv2dNative", "twice", shape=(8, 14, 14, 32), flops=forward),
        op("dw3", "DepthwiseConv2dNative", "twice", shape=(8, 14, 14, 32), flops=forward),
        op("din2", "DepthwiseConv2dNativeBackpropInput", "twice", shape=(8, 14, 14, 32),
           phase=Phase.BACKWARD),
    )  # fmt: skip
    edges = (Edge("x", "dw", act(8, 14, 14, 32)), Edge("dw", "din", act(8, 14, 14, 32)))
    layers = (LayerInfo("l", "DepthwiseConv2D"), LayerInfo("twice", "DepthwiseConv2D"))
    fixed = {o.id: o.flops for o in recount_flops(Graph("g", ops, edges, layers)).ops}
    assert fixed["din"] == fixed["dfilter"] == forward
    assert fixed["din2"] == 0  # a layer called twice: which forward is not known
