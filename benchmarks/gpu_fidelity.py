"""GPU cost fidelity: the roofline's GPU predictions against published TensorFlow results.

    python -m benchmarks.gpu_fidelity [--write-calibration] [--json PATH]

This machine has no GPU: every prediction is the roofline over the device catalog
(``cost_models/data/devices.json``), for the model traced on the CPU by the library
(:func:`passes.trace.trace_model` under the row's Keras dtype policy; TensorFlow's TF32 flag
read with ``tf.config.experimental.tensor_float_32_execution_enabled()``), costed by
:func:`cost_models.estimate.costs.cost_graph` on one device of the row's catalog type and
simulated by :func:`partitioner.simulation.evaluate.evaluate` (the step the planner predicts
for ``solver='single'``).

The reference is ``benchmarks/data/gpu_published.json``: published single-GPU training
throughputs (NVIDIA DeepLearningExamples, TensorFlow, each with its URL and conditions: images/s
for ResNet-50 and EfficientNet-B0, sequences/s for BERT-large pretraining at sequence length 128
(phase 1) and 512 (phase 2), a weightless :func:`benchmarks.zoo.transformer_lm`) and nccl-tests
all-reduce bus bandwidths. TensorFlow's FLOP registry is wrong for two op families the rows run,
and the trace counts them itself (``passes.trace._own_count``): an adjoint batch matmul (the
BERT weight gradients, counted ``d_model / seq`` times over) and the depthwise convolutions'
gradients (no count: 0 FLOPs).

Rows marked ``calibration`` fit the GPU roofline's efficiencies by coordinate descent minimising
their root mean square log error; ``validation`` rows are only predicted, and no configuration
is both. The parameters: the tensor-core efficiency by peak (fp32 on Volta's CUDA cores, tf32,
fp16; :data:`cost_models.estimate.precision.TENSOR_CORE_OPS`), and at the TF32 peak by op class
(:data:`_MATMUL_PEAKS`: cuBLAS matmuls ``'matmul:tf32'``, cuDNN convolutions ``'tf32'``), the
memory fraction, the other ops' compute fraction, the depthwise convolutions' compute fraction,
and the memory fraction of TensorFlow's slow float16 depthwise filter-gradient kernel on Volta
(16-bit ops off the tensor cores run at the datasheet half rate of their family,
:data:`_HALF_COMPUTE_SCALE`, not fitted). Eight parameters on ten calibration rows: ResNet-50
(V100 16 GB and A100, FP32/TF32 and AMP), EfficientNet-B0 (A100 TF32, V100 AMP) and BERT-large
phase 2 (V100 and A100, FP32/TF32 and AMP). So the calibration errors show the model can fit;
the validation rows -- ResNet-50 and EfficientNet-B0 on other GPUs and batches, and the four
BERT-large phase-1 rows -- whether it predicts. The phase-2 rows are the matmul-heavy rows the
per-class TF32 efficiency is fitted on: the same architecture as the phase-1 rows, at another
sequence length (4x the attention per token), batch and accumulation, which makes the BERT
validation a test of transfer across sequence length and batch, not across architectures (no
other matmul-heavy TensorFlow row with steady-state TF32 and AMP figures was found: NVIDIA's
ELECTRA-base SQuAD fine-tuning rows are epoch averages, run TF32 without XLA, and reach about a
third of the phase-1 rows' FLOP rate on an A100: 104 sequences/s of ~212 GF, ~22 TF/s, against
283/s of ~240 GF, ~68 TF/s). One TF32 efficiency for both classes cannot fit both families: fitted on the
convolution rows (0.22 of the TF32 peak, TensorFlow's TF32 convolutions reach a small part of
it) it predicted BERT-large phase 1 on an A100 at 108/s against the published 283/s; matmuls
come out near 0.8. Splitting the FP32 and FP16 peaks by class as well is not supported by
the data: the phase-2 V100 FP32 and AMP rows fit within 5% with the shared figures, and a
separate ``'matmul:fp16'`` (tried: nine parameters) runs to its bound, 1.0, with the
convolutions at 0.84, for a validation median of 8.0% against 8.6%. The shared FP16 figure
runs to its bound too: the mixed-precision rows spend most of their predicted time on memory
traffic and the other ops (Keras 3 keeps float32 copies around its batch and layer norms and
softmax), so the fit has little hold on it. The depthwise fraction comes out near 3% of
the CUDA-core peak: GPU depthwise kernels, forward and both gradients, reach a small fraction of
the GPU (Qin et al., "Diagonalwise Refactorization: An Efficient Training Method for Depthwise
Convolutions", https://arxiv.org/abs/1803.09926: they "cannot fully utilize the GPU capacity"),
which is what makes EfficientNet-B0 in TF32 on an A100 slower per image than its memory
traffic says, and 2.9x slower than in float16 (half2 math at 4x the fp32 rate). All-reduce rows
compare the ring model at the catalog's per-link-kind bus-bandwidth efficiency with nccl-tests.

``--write-calibration`` stores the fit as ``cost_models/data/calibration_<family>.json`` for the
families the rows cover (volta, ampere); they are packaged, so
:func:`cost_models.estimate.analytic.calibrated_roofline` makes them the planner's roofline for
every device of those families (V100 16/32 GB, A100 40/80 GB), and the single-device plan of a
row's model predicts what the row's prediction here says (ResNet-50:
``tests/cost_models/test_gpu_calibration.py``). Families without published rows (turing, ada,
hopper) keep the datasheet roofline, so a topology mixing a calibrated family with an
uncalibrated one compares two different models
(:func:`cost_models.estimate.analytic.calibration_note` says so).

Besides the table it checks the issue's targets: calibration rows within 15%, validation rows
within 25%; ResNet-50 fp32 at batch 256 fits a 32 GB V100 in the memory model; each BERT row's
published batch fits its GPU in the memory model (NVIDIA trained each on one card: the
memory model's peak of the single-device plan, :mod:`cost_models.estimate.memory`, against the
catalog's memory; the other rows that do not fit are named); planning ``mixed_float16`` on an
A100 predicts at least 2x the fp32 (TF32) throughput of ResNet-50.
Results go to ``benchmarks/results/gpu_fidelity.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import os
import pickle
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.devices.catalog import get_device_type
from cost_models.devices.topology import load_topology
from cost_models.estimate.analytic import (
    DEPTHWISE_OPS,
    HALF_DTYPES,
    RooflineModel,
    roofline_terms,
    roofline_to_dict,
    tensor_core_key,
)
from cost_models.estimate.collectives import all_reduce_s
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.precision import TENSOR_CORE_OPS, PrecisionPolicy, policy_from_keras
from partitioner.core.files import write_atomic
from partitioner.core.ir import Graph, peak_bytes
from partitioner.simulation.evaluate import evaluate
from partitioner.solvers.base import device_memory_bytes

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "benchmarks" / "data" / "gpu_published.json"
RESULTS = REPO / "benchmarks" / "results" / "gpu_fidelity.json"
CALIBRATION_TOLERANCE = 0.15
VALIDATION_TOLERANCE = 0.25
_GRID_EFFICIENCY = tuple(round(0.10 + 0.01 * i, 2) for i in range(91))  # 0.10 .. 1.00
_GRID_MEMORY = tuple(round(0.10 + 0.02 * i, 2) for i in range(46))  # 0.10 .. 1.00
_GRID_LOW = tuple(round(0.005 * 1.12**i, 4) for i in range(47))  # 0.005 .. ~1.0, log-spaced
_SWEEPS = 6
_OTHER_STARTS = (0.01, 0.03, 0.1, 0.3)
_HALF_COMPUTE_SCALE = {"volta": 2.0, "ampere": 4.0}
"""16-bit over fp32 CUDA-core rate (datasheets, not fitted): V100 FP16 31.4 TF vs FP32 15.7
(Tesla V100 whitepaper, 2017); A100 FP16 non-tensor 78 TF vs FP32 19.5 (A100 datasheet)."""
_HALF_SLOW_OPS = frozenset({"DepthwiseConv2dNativeBackpropFilter"})
"""TensorFlow's float16 depthwise filter gradient is a slow kernel of its own
(https://github.com/tensorflow/tensorflow/issues/41715: slow in fp16, fast in fp32; forward
and input gradient unaffected) ..."""
_HALF_SLOW_FAMILIES = ("volta",)
"""... fitted on Volta only: the A100 mixed-precision rows run 2.9x (EfficientNet) their TF32
rows, so no such kernel shows there."""
_PEAKS = ("fp32", "tf32", "fp16", "bf16")
_MATMUL_PEAKS = ("tf32",)
"""The peaks at which matmuls (:data:`cost_models.estimate.analytic.MATMUL_OPS`) get their own
tensor-core efficiency (``'matmul:<peak>'``); at the others they share the convolutions'. TF32
only: one more parameter, which the matmul-heavy TF32 calibration row pins; FP32 and FP16 fit
the matmul-heavy rows within 5% shared (module docstring)."""
_TC_KEYS = (*_PEAKS, *(f"matmul:{p}" for p in _PEAKS))
_DEPTHWISE_START = 0.3
"""Where the fit of the depthwise convolutions' fraction of the CUDA-core peak starts."""
_TRACED: dict[tuple[str, int, str], Graph] = {}


@dataclass(frozen=True)
class Fit:
    """The fitted efficiencies: tensor-core ops by the peak they run at, memory traffic, the
    other ops' compute, the depthwise convolutions' compute (fraction of the CUDA-core peak,
    times the family's half rate when 16-bit), and per family the 16-bit depthwise filter
    gradient's memory fraction."""

    tensor_core: Mapping[str, float]
    memory: float
    other_compute: float
    half_slow_memory: Mapping[str, float]
    kernel_overhead_s: float | None = None
    """Per-kernel launch cost: ``None`` keeps the catalog's (5 us on the GPUs), so a small
    model on a calibrated GPU pays its launches as on any other."""
    depthwise: float = _DEPTHWISE_START

    def roofline(self, family: str) -> RooflineModel:
        """The roofline of GPUs of ``family`` (its datasheet half rate, its slow kernels)."""
        tensor_core = dict(self.tensor_core)
        for fp16, bf16 in (("fp16", "bf16"), ("matmul:fp16", "matmul:bf16")):
            if fp16 in tensor_core:  # no bf16 rows: BF16 tensor cores run as fast as FP16 ones
                tensor_core.setdefault(bf16, tensor_core[fp16])
        slow = self.half_slow_memory.get(family)
        return RooflineModel(
            efficiency=dict.fromkeys(DEPTHWISE_OPS, self.depthwise),
            tensor_core_efficiency=tensor_core,
            default_compute_efficiency=self.other_compute,
            memory_efficiency=self.memory,
            kernel_overhead_s=self.kernel_overhead_s,
            half_compute_scale=_HALF_COMPUTE_SCALE.get(family, 1.0),
            half_memory_efficiency_by_type={}
            if slow is None
            else dict.fromkeys(_HALF_SLOW_OPS, slow),
            fused_elementwise=True,
        )


def _bert_large(seq: int = 128) -> Any:
    """BERT-large (24 post-LN blocks, 1024 wide, 16 heads, FFN 4096) at sequence length ``seq``
    (128: pretraining phase 1, 512: phase 2), built without its weights
    (:mod:`passes.weightless`: the trace needs shapes, not values). Its LM head covers all
    ``seq`` positions (NVIDIA's MLM head gathers the ~20 / ~80 masked ones)."""
    from benchmarks.zoo import transformer_lm
    from passes.weightless import build_without_weights

    return build_without_weights(
        lambda: transformer_lm(
            name="bert_large",
            blocks=24,
            d_model=1024,
            heads=16,
            ffn=4096,
            seq=seq,
            vocab=30522,
            causal=False,
            pre_norm=False,
        )
    )


def _keras_model(name: str) -> Any:
    import keras

    if name == "bert_large":
        return _bert_large()
    if name == "bert_large_seq512":
        return _bert_large(512)
    build = {
        "resnet50": keras.applications.ResNet50,
        "efficientnetb0": keras.applications.EfficientNetB0,
    }
    return build[name](weights=None)


_CACHE_DIR: list[Path] = []
"""``--trace-cache DIR``: traced graphs pickled there and reused (development runs)."""


def traced_graph(model: str, batch_size: int, policy: str) -> Graph:
    """One training step of ``model`` traced under the Keras dtype policy ``policy`` (cached)."""
    key = (model, batch_size, policy)
    if key not in _TRACED:
        cached = _CACHE_DIR[0] / f"{model}_{batch_size}_{policy}.pkl" if _CACHE_DIR else None
        if cached is not None and cached.exists():
            _TRACED[key] = pickle.loads(cached.read_bytes())
            return _TRACED[key]
        import keras

        from passes.trace import trace_model

        keras.mixed_precision.set_global_policy(policy)
        try:
            _TRACED[key] = trace_model(_keras_model(model), batch_size=batch_size).graph
        finally:
            keras.mixed_precision.set_global_policy("float32")
        if cached is not None:
            cached.write_bytes(pickle.dumps(_TRACED[key]))
    return _TRACED[key]


def tf32_enabled() -> bool:
    import tensorflow as tf

    return bool(tf.config.experimental.tensor_float_32_execution_enabled())


def _row_policy(row: Mapping[str, Any]) -> PrecisionPolicy:
    return policy_from_keras(str(row["precision"]), tf32_enabled())


@dataclass(frozen=True)
class _Terms:
    """One row's roofline terms at full peak (numpy arrays over its working ops)."""

    compute_s: Mapping[str, Any]
    """Compute seconds of the tensor-core ops at each peak (``'matmul:<peak>'`` for the matmuls
    at a peak of :data:`_MATMUL_PEAKS`; 0 elsewhere), ``depthwise`` and
    ``other`` (the rest) at the fp32 peak, over the family's half rate where 16-bit."""
    memory_s: Any
    slow: Any
    """The ops priced by the family's slow 16-bit kernel fraction (a boolean mask)."""
    launches_s: float = 0.0
    """The working ops' launch cost at the catalog's kernel overhead (the fit keeps it)."""

    def step_s(self, fit: Fit, family: str) -> float:
        import numpy as np

        compute = self.compute_s["other"] / fit.other_compute
        compute = compute + self.compute_s["depthwise"] / fit.depthwise
        for key in _TC_KEYS:
            compute = compute + self.compute_s[key] / fit.tensor_core.get(key, 1.0)
        memory = self.memory_s / fit.memory
        slow = fit.half_slow_memory.get(family)
        if slow is not None:
            memory = np.where(self.slow, self.memory_s / slow, memory)
        return self.launches_s + float(np.maximum(compute, memory).sum())


def _tc_key(op_type: str, peak: str) -> str:
    """The fit's tensor-core key of an op at ``peak``: its class's where :data:`_MATMUL_PEAKS`
    splits that peak by class, else the peak's."""
    return tensor_core_key(op_type, peak) if peak in _MATMUL_PEAKS else peak


def _terms(row: Mapping[str, Any]) -> _Terms:
    import numpy as np

    graph = traced_graph(row["model"], row["batch_size"], row["precision"])
    device = get_device_type(row["device"])
    t = roofline_terms(graph, device, _row_policy(row), fused_elementwise=True)
    compute = np.array(t.compute_s)
    tc = np.array([op in TENSOR_CORE_OPS for op in t.op_types])
    half = np.array([d in HALF_DTYPES for d in t.dtypes])
    keys = np.array([_tc_key(op, peak) for op, peak in zip(t.op_types, t.peak_keys, strict=True)])
    parts = {key: compute * (tc & (keys == key)) for key in _TC_KEYS}
    scale = np.where(half, _HALF_COMPUTE_SCALE.get(device.family, 1.0), 1.0)
    depthwise = np.array([op in DEPTHWISE_OPS for op in t.op_types])
    parts["other"] = compute * ~(tc | depthwise) / scale
    parts["depthwise"] = compute * depthwise / scale
    slow = half & np.array([op in _HALF_SLOW_OPS for op in t.op_types])
    launches_s = len(t.op_types) * device.kernel_overhead_s
    return _Terms(parts, np.array(t.memory_s), slow, launches_s)


def _log_rms(rows: Sequence[Mapping[str, Any]], terms: Sequence[_Terms], fit: Fit) -> float:
    """Root mean square of log(predicted / published) throughput over ``rows``."""
    logs = [
        math.log(
            row["batch_size"] / term.step_s(fit, _family(row)) / row["published_samples_per_s"]
        )
        for row, term in zip(rows, terms, strict=True)
    ]
    return math.sqrt(sum(x * x for x in logs) / len(logs))


def _with(fit: Fit, name: str, value: float) -> Fit:
    """``fit`` with one parameter (``tc:<peak>``, ``memory``, ``other``, ``depthwise``,
    ``slow:<family>``) set."""
    kind, _, key = name.partition(":")
    if kind == "depthwise":
        return dataclasses.replace(fit, depthwise=value)
    if kind == "tc":
        return dataclasses.replace(fit, tensor_core={**fit.tensor_core, key: value})
    if kind == "slow":
        return dataclasses.replace(fit, half_slow_memory={**fit.half_slow_memory, key: value})
    if kind == "memory":
        return dataclasses.replace(fit, memory=value)
    return dataclasses.replace(fit, other_compute=value)


def fit_efficiencies(rows: Sequence[Mapping[str, Any]]) -> Fit:
    """Coordinate descent (:data:`_SWEEPS` sweeps, a grid per parameter) minimising the root mean
    square log(predicted / published) throughput over ``rows``: each tensor-core peak the rows
    use, the memory fraction, the other ops' compute fraction, the depthwise convolutions'
    compute fraction (when the rows have any), and the slow 16-bit kernel's memory fraction of
    each family in :data:`_HALF_SLOW_FAMILIES` whose rows run 16-bit."""
    terms = [_terms(r) for r in rows]
    grids: dict[str, tuple[float, ...]] = {
        f"tc:{k}": _GRID_EFFICIENCY
        for k in _TC_KEYS
        if any(float(t.compute_s[k].sum()) > 0 for t in terms)
    }
    grids.update({"memory": _GRID_MEMORY, "other": _GRID_LOW})
    if any(float(t.compute_s["depthwise"].sum()) > 0 for t in terms):
        grids["depthwise"] = _GRID_LOW
    for family in _HALF_SLOW_FAMILIES:
        if any(
            _family(r) == family and bool(t.slow.any()) for r, t in zip(rows, terms, strict=True)
        ):
            grids[f"slow:{family}"] = _GRID_LOW
    fits = [_descend(rows, terms, grids, other) for other in _OTHER_STARTS]
    return min(fits, key=lambda f: _log_rms(rows, terms, f))


def _descend(
    rows: Sequence[Mapping[str, Any]],
    terms: Sequence[_Terms],
    grids: Mapping[str, tuple[float, ...]],
    other: float,
) -> Fit:
    """One coordinate descent of ``grids``' parameters from the other ops' fraction ``other``
    (it trades off against the memory fraction: one start alone stops in a local minimum)."""
    fit = Fit({k.partition(":")[2]: 0.5 for k in grids if k.startswith("tc:")}, 0.7, other, {})
    for name in grids:
        fit = _with(fit, name, 0.3) if name.startswith("slow:") else fit
    for _sweep, name in itertools.product(range(_SWEEPS), grids):
        value = min(grids[name], key=lambda v: _log_rms(rows, terms, _with(fit, name, v)))
        fit = _with(fit, name, value)
    return fit


def predict(row: Mapping[str, Any], roofline: RooflineModel) -> dict[str, Any]:
    """The planner's prediction for one published row: step, throughput, memory."""
    graph = traced_graph(row["model"], row["batch_size"], row["precision"])
    costed = cost_graph(
        graph,
        device_type=row["device"],
        num_devices=1,
        roofline=roofline,
        precision=_row_policy(row),
    )
    step_s = evaluate(costed, (0,) * len(costed.layer_memory)).step_time_s
    predicted = row["batch_size"] / step_s
    solver_view = device_memory_bytes((0,) * len(costed.layer_memory), costed.problem())[0]
    limit = get_device_type(row["device"]).memory_bytes
    return {
        **{
            k: row[k]
            for k in ("id", "model", "batch_size", "precision", "device", "role", "source")
        },
        "planned_precision": _row_policy(row).value,
        "published_samples_per_s": row["published_samples_per_s"],
        "predicted_samples_per_s": round(predicted, 1),
        "predicted_step_s": step_s,
        "error": predicted / row["published_samples_per_s"] - 1.0,
        "peak_memory_bytes": peak_bytes(costed.layer_memory),
        "solver_memory_bytes": solver_view,
        "device_memory_bytes": limit,
        "fits": solver_view <= limit,
    }


def memory_check(roofline: RooflineModel) -> dict[str, Any]:
    """ResNet-50 fp32 at batch 256 on one 32 GB V100: the memory model's peak and whether the
    single-device plan fits (what the solvers' memory check counts)."""
    graph = traced_graph("resnet50", 256, "float32")
    costed = cost_graph(graph, device_type="v100", num_devices=1, roofline=roofline)
    peak = peak_bytes(costed.layer_memory)
    solver_view = device_memory_bytes((0,) * len(costed.layer_memory), costed.problem())[0]
    limit = get_device_type("v100").memory_bytes
    return {
        "case": "resnet50 float32 batch 256 on v100 (32 GB)",
        "peak_memory_bytes": peak,
        "solver_memory_bytes": solver_view,
        "activation_bytes": sum(m.activation_bytes for m in costed.layer_memory),
        "device_memory_bytes": limit,
        "fits": solver_view <= limit,
    }


def mixed_speedup(roofline: RooflineModel) -> dict[str, Any]:
    """Predicted ResNet-50 throughput on an A100 at batch 256, mixed_float16 over float32 (TF32)."""
    base = {"model": "resnet50", "batch_size": 256, "device": "a100-80gb", "role": "check"}
    fp32 = predict(
        {**base, "id": "tf32", "precision": "float32", "source": "", "published_samples_per_s": 1},
        roofline,
    )
    amp = predict(
        {
            **base,
            "id": "amp",
            "precision": "mixed_float16",
            "source": "",
            "published_samples_per_s": 1,
        },
        roofline,
    )
    return {
        "tf32_images_per_s": fp32["predicted_samples_per_s"],
        "mixed_float16_images_per_s": amp["predicted_samples_per_s"],
        "speedup": amp["predicted_samples_per_s"] / fp32["predicted_samples_per_s"],
    }


def all_reduce_rows(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Predicted ring all-reduce bus bandwidth (nccl-tests' busbw: 2 (n-1)/n bytes / time)."""
    out = []
    for row in rows:
        n = int(row["devices"])
        topo = load_topology(row["link"], device_type=row["device"], num_devices=n)
        seconds = all_reduce_s(topo, tuple(range(n)), int(row["message_bytes"]))
        busbw = 2 * (n - 1) / n * row["message_bytes"] / seconds
        out.append(
            {
                **{
                    k: row[k]
                    for k in ("id", "devices", "device", "link", "message_bytes", "role", "source")
                },
                "published_bus_bandwidth_bytes_per_s": row["published_bus_bandwidth_bytes_per_s"],
                "predicted_bus_bandwidth_bytes_per_s": busbw,
                "error": busbw / row["published_bus_bandwidth_bytes_per_s"] - 1.0,
            }
        )
    return out


def _memory_cell(row: Mapping[str, Any]) -> str:
    """Predicted peak of the row's published batch over the device's memory, and whether the
    single-device plan fits."""
    peak, limit = row["solver_memory_bytes"] / 2**30, row["device_memory_bytes"] / 2**30
    return f"{peak:.1f} / {limit:.0f}{'' if row['fits'] else ' (over)'}"


def published_batches_fit(results: Mapping[str, Any]) -> tuple[list[str], list[str]]:
    """The ids of the BERT rows (the target: NVIDIA trained each at its batch on one GPU) and
    of the other rows whose published batch the memory model says does not fit."""
    rows = results["throughput"]
    bert = [r["id"] for r in rows if str(r["model"]).startswith("bert") and not r["fits"]]
    other = [r["id"] for r in rows if not str(r["model"]).startswith("bert") and not r["fits"]]
    return bert, other


def table(results: Mapping[str, Any]) -> str:
    """The benchmark's table as Markdown (the README block and the terminal)."""
    lines = [
        "| row | device | precision | batch | published /s | predicted /s | error | role | memory GiB |",
        "|---|---|---|---:|---:|---:|---:|---|---:|",
    ]
    for r in results["throughput"]:
        lines.append(
            f"| {r['model']} | {r['device']} | {r['planned_precision']} | {r['batch_size']} | "
            f"{r['published_samples_per_s']:.4g} | {r['predicted_samples_per_s']:.4g} | "
            f"{100 * r['error']:+.1f}% | {r['role']} | {_memory_cell(r)} |"
        )
    for r in results["all_reduce"]:
        lines.append(
            f"| all-reduce {r['message_bytes'] / 2**30:.0f} GiB | {r['devices']}x {r['device']} {r['link']} | "
            f"busbw | - | {r['published_bus_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s | "
            f"{r['predicted_bus_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s | {100 * r['error']:+.1f}% | "
            f"{r.get('role', 'check')} |"
        )
    return "\n".join(lines)


def summary(results: Mapping[str, Any]) -> list[str]:
    """One line per target: met or not, with the figures."""
    lines = [
        f"fit ({family} calibration rows): tensor-core efficiency by peak {fit['tensor_core']}, "
        f"memory {fit['memory']}, other compute {fit['other_compute']} and depthwise convolutions "
        f"{fit['depthwise_compute']} of the fp32 peak (16-bit: "
        f"x{fit['half_compute_scale']} by family, datasheets), 16-bit depthwise filter gradient's "
        f"memory fraction {fit['half_slow_memory']}, elementwise fusion on"
        for family, fit in results["fit"].items()
    ]
    for role, tol in (("calibration", CALIBRATION_TOLERANCE), ("validation", VALIDATION_TOLERANCE)):
        errs = [abs(r["error"]) for r in results["throughput"] if r["role"] == role]
        within = sum(e <= tol for e in errs)
        lines.append(
            f"{role}: {within}/{len(errs)} rows within {tol:.0%} (worst {max(errs):.1%}, "
            f"median {sorted(errs)[len(errs) // 2]:.1%})"
        )
    ar = results["all_reduce"]
    ar_errs = [abs(r["error"]) for r in ar]
    lines.append(
        f"all-reduce bus bandwidth: {sum(e <= CALIBRATION_TOLERANCE for e in ar_errs)}/{len(ar)} rows "
        f"within {CALIBRATION_TOLERANCE:.0%} (worst {max(ar_errs):.1%}; ring at each link kind's "
        "published bus-bandwidth efficiency)"
    )
    mem = results["memory"]
    lines.append(
        f"memory: {mem['case']}: peak {mem['peak_memory_bytes'] / 2**30:.2f} GiB, solver view "
        f"{mem['solver_memory_bytes'] / 2**30:.2f} GiB of {mem['device_memory_bytes'] / 2**30:.0f} GiB: "
        f"{'fits' if mem['fits'] else 'DOES NOT FIT'}"
    )
    bert_over, other_over = published_batches_fit(results)
    n_bert = sum(str(r["model"]).startswith("bert") for r in results["throughput"])
    lines.append(
        f"published batch fits (BERT rows, target): {n_bert - len(bert_over)}/{n_bert}"
        + (f" (over: {', '.join(bert_over)})" if bert_over else "")
        + "; other rows over the device's memory in the model: "
        + (", ".join(other_over) if other_over else "none")
    )
    sp = results["mixed_speedup"]
    lines.append(
        f"A100 ResNet-50 b256: mixed_float16 {sp['mixed_float16_images_per_s']:.0f} img/s vs TF32 "
        f"{sp['tf32_images_per_s']:.0f} img/s = {sp['speedup']:.2f}x (target >= 2x: "
        f"{'met' if sp['speedup'] >= 2 else 'NOT met'})"
    )
    return lines


def readme_block(path: Path = RESULTS) -> str:
    """The README's GPU fidelity table and target lines, from the results file."""
    results = json.loads(path.read_text(encoding="utf-8"))
    lines = [f"- {line}" for line in summary(results)]
    return table(results) + "\n\n" + "\n".join(lines)


def write_calibration_file(
    family: str, fit: Fit, rows: Sequence[Mapping[str, Any]], results: Sequence[Mapping[str, Any]]
) -> None:
    """``cost_models/data/calibration_<family>.json``: ``fit`` (from ``rows``) for ``family``."""
    errs = [abs(r["error"]) for r in results]
    body = {
        "schema": 1,
        "device_type": family,
        "family": family,
        "roofline": roofline_to_dict(fit.roofline(family)),
        "fit": {
            "num_samples": len(errs),
            "rms_relative_error": math.sqrt(sum(e * e for e in errs) / len(errs)),
            "median_abs_relative_error": sorted(errs)[len(errs) // 2],
            "max_abs_relative_error": max(errs),
            "models": sorted({r["model"] for r in rows}),
        },
        "source": (
            "fitted by `python -m benchmarks.gpu_fidelity --write-calibration` on the published "
            "TensorFlow training throughputs of benchmarks/data/gpu_published.json (calibration rows: "
            + ", ".join(
                f"{r['id']} ({r['published_samples_per_s']}/s, {r['source']})" for r in rows
            )
            + "; volta and ampere fitted together; XLA on in the published runs, priced as elementwise "
            "fusion; FLOPs recounted where TensorFlow's registry is wrong: depthwise gradients, "
            "adjoint batch matmuls) at "
            + datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        ),
    }
    path = REPO / "cost_models" / "data" / f"calibration_{family}.json"
    write_atomic(path, json.dumps(body, indent=2) + "\n")


def _family(row: Mapping[str, Any]) -> str:
    return get_device_type(row["device"]).family


def run(write_calibration: bool = False) -> dict[str, Any]:
    """One fit over every calibration row (volta and ampere together: a family's rows alone
    would be fitted exactly and say nothing), every row predicted with it;
    ``write_calibration`` stores it for each family the calibration rows cover."""
    data = json.loads(DATA.read_text(encoding="utf-8"))
    calibration = [r for r in data["throughput"] if r["role"] == "calibration"]
    fit = fit_efficiencies(calibration)
    throughput = [predict(r, fit.roofline(_family(r))) for r in data["throughput"]]
    if write_calibration:
        fitted = [t for t in throughput if t["role"] == "calibration"]
        for family in sorted({_family(r) for r in calibration}):
            write_calibration_file(family, fit, calibration, fitted)
    return {
        "fit": {
            "volta+ampere": {
                "tensor_core": dict(fit.tensor_core),
                "memory": fit.memory,
                "other_compute": fit.other_compute,
                "depthwise_compute": fit.depthwise,
                "half_compute_scale": dict(_HALF_COMPUTE_SCALE),
                "half_slow_memory": dict(fit.half_slow_memory),
                "kernel_overhead_s": fit.kernel_overhead_s,
                "fused_elementwise": True,
            }
        },
        "tf32_enabled": tf32_enabled(),
        "throughput": throughput,
        "all_reduce": all_reduce_rows(data["all_reduce"]),
        "memory": memory_check(fit.roofline("volta")),
        "mixed_speedup": mixed_speedup(fit.roofline("ampere")),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-calibration", action="store_true")
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--trace-cache", default=None, help="reuse traced graphs pickled in DIR")
    args = parser.parse_args(argv)
    if args.trace_cache:
        _CACHE_DIR.append(Path(args.trace_cache))
        _CACHE_DIR[0].mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    results = run(args.write_calibration)
    text = table(results) + "\n\n" + "\n".join(summary(results))
    sys.stdout.write(text + "\n")
    write_atomic(args.json, json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
