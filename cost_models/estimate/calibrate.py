"""Calibration: fit the roofline's efficiency factors to measured layer times (least squares).

Formulation
-----------
For an op ``o`` on a device with peak FLOP/s ``P(dtype)`` and memory bandwidth ``B``, the
roofline of :mod:`cost_models.estimate.analytic` is::

    t(o) = h[g(o)] + max(theta[g(o)] * flops(o) / P,  theta_mem[g(o)] * bytes(o) / B)
           + theta_spill * max(0, bytes(o) - L) + theta_T * transposed(o)

with ``g(o)`` the op's class (:class:`OpClass`: matmul, convolution, its two backprops,
depthwise, einsum, random, other), ``theta = 1 / efficiency`` (of the peak FLOP/s, and of the memory
bandwidth: a skinny matmul streaming its weights moves bytes slower than an element-wise op on a
cache-resident tensor) and ``h`` the class's fixed cost per op (launch
overhead, and on a CPU the poor efficiency of small kernels: an efficiency that ramps up with
size, ``flops / (flops + f0)``, is exactly a fixed cost plus a constant efficiency), and
``theta_spill`` the extra cost per byte an op moves beyond ``L`` (on a CPU: beyond what the core's
cache holds; a large output also lands in freshly mapped memory), and ``theta_T`` the cost per
byte of a matmul operand read transposed (oneDNN reorders a transposed weight on every call). A sample is one
layer's measured forward (or backward) time ``y``; its prediction is the sum of ``t(o)`` over the
layer's working ops of that phase. The fit minimises the squared relative error::

    sum_samples ((prediction - y) / y) ** 2

over ``x = (theta_matmul, ..., theta_other, theta_mem_matmul, ..., theta_mem_other, h_matmul, ...,
h_other, theta_spill, theta_T)``. The ``max`` makes this piecewise
linear: fixing, for every op, which branch is the larger gives a linear least-squares problem.
The fit alternates the two (an active-set iteration for piecewise-linear least squares, as in
the alternating fits of Lawson & Hanson, *Solving Least Squares Problems*, 1974): assign the
branches at the current ``x``, solve the bounded linear problem (efficiencies in (0, 1], ``h >=
0``; variables that leave their bounds are fixed there and the rest re-solved), and stop when the
assignment repeats or the objective stops falling. Classes that no sample exercises keep their
starting value. The fit error is reported as the RMS and median of the per-sample relative error.

Samples are kernel times. The executor's cost per op between kernels (``dispatch``, paid by every
op of a step, zero-work ones too) is fitted apart, from whole steps
(:func:`fit_dispatch_overhead`).

Pure Python and numpy; never imports TensorFlow.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from cost_models.devices.catalog import DeviceType
from cost_models.devices.datafiles import read_text
from cost_models.estimate.analytic import (
    DEFAULT_ROOFLINE,
    MATMUL_LIKE_OPS,
    ZERO_WORK_OPS,
    RooflineModel,
    device_family,
    read_calibration,
    roofline_to_dict,
)
from partitioner.core.errors import CatalogError, PartitionError
from partitioner.core.ir import Graph, Phase

__all__ = [
    "OPAQUE_OPS",
    "Calibration",
    "FitStats",
    "LayerSample",
    "OpClass",
    "OpWork",
    "fit_dispatch_overhead",
    "fit_roofline",
    "layer_samples",
    "load_calibration",
    "op_class",
    "predict_sample_s",
    "save_calibration",
]

logger = logging.getLogger(__name__)

CALIBRATION_SCHEMA = 1


OPAQUE_OPS: frozenset[str] = frozenset(
    {
        "While",
        "StatelessWhile",
        "If",
        "StatelessIf",
        "Case",
        "StatelessCase",
        "PartitionedCall",
        "StatefulPartitionedCall",
    }
)
"""Ops whose work lives in a function body that TF's profiler does not count (a ``tf.while_loop``
LSTM, a nested ``tf.function``): the roofline cannot see it, so a sample holding one is left out
of the fit (its time would be blamed on the other ops)."""


class OpClass(enum.Enum):
    """The op classes that get their own fitted compute efficiency."""

    MATMUL = "matmul"
    CONV = "conv"
    CONV_BACKPROP_INPUT = "conv_backprop_input"
    CONV_BACKPROP_FILTER = "conv_backprop_filter"
    DEPTHWISE = "depthwise"
    EINSUM = "einsum"
    """TF's CPU einsum transposes and reshapes around a batched matmul: far below a matmul."""
    RANDOM = "random"
    """Random number generation (dropout's masks): compute-bound per element, but TF's profiler
    counts no FLOPs for it, so it gets its own cost per byte."""
    OTHER = "other"
    """Every other op type: it gets the model's ``default_compute_efficiency``."""


_CLASS_OF: Mapping[str, OpClass] = MappingProxyType(
    {
        "MatMul": OpClass.MATMUL,
        "BatchMatMul": OpClass.MATMUL,
        "BatchMatMulV2": OpClass.MATMUL,
        "BatchMatMulV3": OpClass.MATMUL,
        "Einsum": OpClass.EINSUM,
        "_FusedMatMul": OpClass.MATMUL,
        "Conv1D": OpClass.CONV,
        "Conv2D": OpClass.CONV,
        "Conv3D": OpClass.CONV,
        "_FusedConv2D": OpClass.CONV,
        "Conv2DBackpropInput": OpClass.CONV_BACKPROP_INPUT,
        "Conv3DBackpropInputV2": OpClass.CONV_BACKPROP_INPUT,
        "Conv2DBackpropFilter": OpClass.CONV_BACKPROP_FILTER,
        "Conv3DBackpropFilterV2": OpClass.CONV_BACKPROP_FILTER,
        "DepthwiseConv2dNative": OpClass.DEPTHWISE,
        "DepthwiseConv2dNativeBackpropInput": OpClass.DEPTHWISE,
        "DepthwiseConv2dNativeBackpropFilter": OpClass.DEPTHWISE,
        "RandomUniform": OpClass.RANDOM,
        "RandomStandardNormal": OpClass.RANDOM,
        "TruncatedNormal": OpClass.RANDOM,
        "StatelessRandomUniformV2": OpClass.RANDOM,
        "StatelessRandomNormalV2": OpClass.RANDOM,
        "StatelessTruncatedNormalV2": OpClass.RANDOM,
        "StatelessRandomUniform": OpClass.RANDOM,
        "StatelessRandomNormal": OpClass.RANDOM,
    }
)


def op_class(op_type: str) -> OpClass:
    """The fitted class of a TF op type (``OTHER`` for anything not dense math)."""
    return _CLASS_OF.get(op_type, OpClass.OTHER)


_CLASSES = tuple(OpClass)
_N_CLASSES = len(_CLASSES)
_COL_MEM = _N_CLASSES
"""The first of the per-class memory columns (inverse fractions of the bandwidth)."""
_COL_OVERHEAD = 2 * _N_CLASSES
"""The first of the per-class overhead columns."""
_COL_SPILL = 3 * _N_CLASSES
"""Seconds per byte moved beyond the spill threshold."""
_COL_TRANSPOSE = 3 * _N_CLASSES + 1
"""Seconds per byte of a matmul operand read transposed."""
_N_COLS = 3 * _N_CLASSES + 2


@dataclass(frozen=True)
class OpWork:
    """What the roofline needs of one op: its type, FLOPs, bytes moved and dtype."""

    op_type: str
    flops: int
    bytes_moved: int
    dtype: str = "float32"
    output_bytes: int = 0
    transposed_bytes: int = 0


@dataclass(frozen=True)
class LayerSample:
    """One measured time: a layer's forward or backward ops and what they took."""

    model: str
    layer: str
    phase: Phase
    ops: tuple[OpWork, ...]
    measured_time_s: float

    def __post_init__(self) -> None:
        if not (self.measured_time_s > 0 and math.isfinite(self.measured_time_s)):
            raise PartitionError(
                f"sample {self.model}/{self.layer} ({self.phase.value}): measured_time_s="
                f"{self.measured_time_s!r} must be a finite number > 0"
            )


def layer_samples(
    graph: Graph,
    measured_s: Mapping[str, tuple[float, float]],
    *,
    model: str | None = None,
    min_time_s: float = 0.0,
) -> tuple[LayerSample, ...]:
    """Samples from a traced graph and measured ``{layer: (forward_s, backward_s)}``.

    A layer's ops are those it owns exactly (``op.layer``); ops in
    :data:`~cost_models.estimate.analytic.ZERO_WORK_OPS` are left out (the roofline gives them 0 s). A
    phase with no working ops, one with an op of :data:`OPAQUE_OPS`, or one measured at or below
    ``min_time_s`` gives no sample.
    """
    name = graph.name if model is None else model
    input_bytes = [0] * len(graph.ops)
    index = graph.op_index
    for e in graph.edges:
        input_bytes[index[e.dst]] += e.bytes
    by_layer: dict[tuple[str, Phase], list[OpWork]] = {}
    for op, in_bytes in zip(graph.ops, input_bytes, strict=True):
        if op.layer is None or op.op_type in ZERO_WORK_OPS:
            continue
        dtype = op.output_dtypes[0] if op.output_dtypes else "float32"
        by_layer.setdefault((op.layer, op.phase), []).append(
            OpWork(
                op.op_type, op.flops, in_bytes + op.output_bytes, dtype, op.output_bytes,
                op.transposed_bytes,
            )
        )
    samples: list[LayerSample] = []
    for info in graph.layers:
        times = measured_s.get(info.name)
        if times is None:
            continue
        for phase, t in zip((Phase.FORWARD, Phase.BACKWARD), times, strict=True):
            ops = by_layer.get((info.name, phase))
            if (
                ops
                and t > min_time_s
                and math.isfinite(t)
                and not any(o.op_type in OPAQUE_OPS for o in ops)
            ):
                samples.append(LayerSample(name, info.name, phase, tuple(ops), t))
    return tuple(samples)


def predict_sample_s(sample: LayerSample, device: DeviceType, model: RooflineModel) -> float:
    """The roofline's time for a sample (the sum of its ops, as :func:`estimate_op_times_s`)."""
    default = device.kernel_overhead_s if model.kernel_overhead_s is None else model.kernel_overhead_s
    bw = device.memory_bandwidth_bytes_per_s * model.memory_bandwidth_scale
    peak_scale = model.peak_flops_scale
    threshold, per_byte = model.spill_threshold_bytes, model.spill_s_per_byte
    total = 0.0
    for op in sample.ops:
        overhead = model.overhead_s.get(op.op_type, default)
        if per_byte and op.bytes_moved > threshold:
            overhead += (op.bytes_moved - threshold) * per_byte
        overhead += op.transposed_bytes * model.transpose_s_per_byte
        memory_s = op.bytes_moved / (bw * model.memory_efficiency_of(op.op_type))
        if op.flops:
            rate = device.peak_flops(op.dtype) * peak_scale * model.compute_efficiency(op.op_type)
            compute_s = op.flops / rate
            total += overhead + max(compute_s, memory_s)
        else:
            total += overhead + memory_s
    return total


@dataclass(frozen=True)
class FitStats:
    """How well a model fits samples: relative errors ``(predicted - measured) / measured``."""

    num_samples: int
    rms_relative_error: float
    median_abs_relative_error: float
    max_abs_relative_error: float


@dataclass(frozen=True)
class Calibration:
    """A fitted roofline for a device type, with its fit error and provenance."""

    device_type: str
    roofline: RooflineModel
    fit: FitStats
    class_efficiency: Mapping[str, float]
    """Fitted compute efficiency per :class:`OpClass` value (the classes the samples exercised)."""
    class_overhead_s: Mapping[str, float]
    """Fitted fixed seconds per op per :class:`OpClass` value."""
    iterations: int
    models: tuple[str, ...]
    """The models whose layers were the samples."""
    source: str = ""
    class_memory_efficiency: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Fitted fraction of the (scaled) memory bandwidth per :class:`OpClass` value."""

    @property
    def family(self) -> str:
        return device_family(self.device_type)


def fit_stats(samples: Sequence[LayerSample], device: DeviceType, model: RooflineModel) -> FitStats:
    """Relative-error statistics of ``model`` on ``samples``."""
    if not samples:
        raise PartitionError("no samples to measure a fit on; profile at least one layer")
    errs = [
        (predict_sample_s(s, device, model) - s.measured_time_s) / s.measured_time_s
        for s in samples
    ]
    return FitStats(
        num_samples=len(errs),
        rms_relative_error=math.sqrt(sum(e * e for e in errs) / len(errs)),
        median_abs_relative_error=statistics.median(abs(e) for e in errs),
        max_abs_relative_error=max(abs(e) for e in errs),
    )


_Feature = tuple[np.ndarray, np.ndarray, np.ndarray, float, float]


def _features(
    samples: Sequence[LayerSample], device: DeviceType, spill_threshold_bytes: int
) -> list[_Feature]:
    """Per sample: each working op's class index, compute seconds at 100%, memory seconds at
    100%, and the sample's bytes moved beyond the spill threshold."""
    out = []
    for s in samples:
        cls = np.array([_CLASSES.index(op_class(o.op_type)) for o in s.ops], dtype=np.int64)
        comp = np.array(
            [o.flops / device.peak_flops(o.dtype) for o in s.ops], dtype=np.float64
        )
        mem = np.array(
            [o.bytes_moved / device.memory_bandwidth_bytes_per_s for o in s.ops], dtype=np.float64
        )
        spill = float(sum(max(0, o.bytes_moved - spill_threshold_bytes) for o in s.ops))
        out.append((cls, comp, mem, spill, float(sum(o.transposed_bytes for o in s.ops))))
    return out


def _design(feats: Sequence[_Feature], x: np.ndarray) -> tuple[np.ndarray, bytes]:
    """The linear system's rows for the branch each op takes at ``x``, and the branch pattern."""
    a = np.zeros((len(feats), _N_COLS))
    pattern = []
    for r, (cls, comp, mem, spill, transposed) in enumerate(feats):
        a[r, _COL_SPILL] = spill
        a[r, _COL_TRANSPOSE] = transposed
        compute_wins = (comp > 0) & (x[cls] * comp >= x[_COL_MEM + cls] * mem)
        np.add.at(a[r], cls[compute_wins], comp[compute_wins])
        np.add.at(a[r], _COL_MEM + cls[~compute_wins], mem[~compute_wins])
        np.add.at(a[r], _COL_OVERHEAD + cls, 1.0)
        pattern.append(np.packbits(compute_wins).tobytes())
    return a, b"|".join(pattern)


def _predict(feats: Sequence[_Feature], x: np.ndarray) -> np.ndarray:
    out = np.empty(len(feats))
    for r, (cls, comp, mem, spill, transposed) in enumerate(feats):
        out[r] = (x[_COL_OVERHEAD + cls] + np.maximum(x[cls] * comp, x[_COL_MEM + cls] * mem)).sum()
        out[r] += x[_COL_SPILL] * spill + x[_COL_TRANSPOSE] * transposed
    return out


def _nnls(a: np.ndarray, b: np.ndarray, max_iterations: int = 200) -> np.ndarray:
    """Non-negative least squares ``min |a z - b|, z >= 0`` (Lawson & Hanson's active set)."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    z = np.zeros(n)
    scale = max(float(np.abs(a).max()), 1e-300) * max(float(np.abs(b).max()), 1e-300)
    tol = 1e-12 * scale * max(a.shape)
    grad = a.T @ (b - a @ z)
    for _ in range(max_iterations):
        candidates = np.where(~passive, grad, -np.inf)
        j = int(np.argmax(candidates))
        if passive.all() or candidates[j] <= tol:
            break
        passive[j] = True
        for _ in range(max_iterations):
            trial = np.zeros(n)
            trial[passive], *_ = np.linalg.lstsq(a[:, passive], b, rcond=None)
            if (trial[passive] > 0).all():
                break
            blocked = passive & (trial <= 0)
            step = np.min(z[blocked] / np.maximum(z[blocked] - trial[blocked], 1e-300))
            z = z + step * (trial - z)
            passive &= z > 1e-15 * max(1.0, float(np.abs(z).max()))
            z[~passive] = 0.0
        else:
            break
        z = np.where(passive, trial, 0.0)
        grad = a.T @ (b - a @ z)
    return z


def _bounded_lstsq(a: np.ndarray, y: np.ndarray, lower: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Least squares ``min |a x - y|`` with ``x >= lower`` on the ``free`` columns.

    Columns not ``free`` stay at their value in ``lower``. Solved as NNLS in ``z = x - lower``.
    Columns are scaled to unit norm first (seconds per FLOP and per op differ by 10 orders).
    """
    x = lower.copy()
    if not free.any():
        return x
    rhs = y - a @ lower
    sub = a[:, free]
    norms = np.linalg.norm(sub, axis=0)
    norms[norms == 0] = 1.0
    z = _nnls(sub / norms, rhs) / norms
    x[free] = lower[free] + z
    return x


def fit_roofline(
    samples: Sequence[LayerSample],
    device: DeviceType,
    *,
    start: RooflineModel | None = None,
    max_iterations: int = 50,
    fit_overhead: bool = True,
    weight_floor: float = 0.0,
    max_scale: float = 1.0,
    fit_byte_terms: bool = True,
    source: str = "",
) -> Calibration:
    """Fit per-class compute efficiencies, the memory efficiency and the per-op overhead.

    Samples should come from one device type (``device``). Raises PartitionError without samples.
    ``max_scale > 1`` lets the fit find the device faster than its catalog figures (peak FLOP/s
    and bandwidth up to ``max_scale`` times them): the fitted model then carries
    ``peak_flops_scale`` (the largest fitted efficiency, when above 1) and
    ``memory_bandwidth_scale``, with the efficiencies divided by them so each stays in (0, 1].
    ``fit_byte_terms`` fits the spill and transposed-operand costs per byte (else they keep
    ``start``'s values).
    """
    if not (max_scale >= 1 and math.isfinite(max_scale)):
        raise PartitionError(f"max_scale={max_scale!r} must be a finite number >= 1")
    if not samples:
        raise PartitionError("no samples to calibrate on; profile at least one layer first")
    base = DEFAULT_ROOFLINE if start is None else start
    feats = _features(samples, device, base.spill_threshold_bytes)
    y = np.array([s.measured_time_s for s in samples])
    # Relative error, with times below ``weight_floor`` (a fraction of the median sample) weighted
    # as if they were that long: tiny, noise-dominated layers must not steer the fit.
    w = 1.0 / np.maximum(y, weight_floor * float(np.median(y)))
    used = _used_columns(feats, fit_overhead=fit_overhead, fit_byte_terms=fit_byte_terms)
    start_x = _start_point(base, device)
    lower = _lower_bounds(used, start_x, max_scale)
    best_x, iterations = _alternate(feats, y, w, start_x, lower, used, max_iterations)
    fitted = _fitted(best_x, used, base)
    stats = fit_stats(samples, device, fitted.roofline)
    logger.debug(
        "calibrated %s on %d samples in %d iterations: rms %.3f, median |err| %.3f",
        device.name, stats.num_samples, iterations, stats.rms_relative_error,
        stats.median_abs_relative_error,
    )
    return Calibration(
        device_type=device.name,
        roofline=fitted.roofline,
        fit=stats,
        class_efficiency=MappingProxyType(fitted.class_efficiency),
        class_memory_efficiency=MappingProxyType(fitted.class_memory_efficiency),
        class_overhead_s=MappingProxyType(fitted.class_overhead_s),
        iterations=iterations,
        models=tuple(dict.fromkeys(s.model for s in samples)),
        source=source,
    )


def _used_columns(
    feats: Sequence[_Feature], *, fit_overhead: bool, fit_byte_terms: bool
) -> np.ndarray:
    """Which columns of ``x`` the samples exercise at all (the others keep their start)."""
    used = np.zeros(_N_COLS, dtype=bool)
    for cls, comp, _, spill, transposed in feats:
        used[np.unique(cls[comp > 0])] = True
        used[_COL_MEM + np.unique(cls)] = True
        if fit_overhead:
            used[_COL_OVERHEAD + np.unique(cls)] = True
        if fit_byte_terms and spill > 0:
            used[_COL_SPILL] = True
        if fit_byte_terms and transposed > 0:
            used[_COL_TRANSPOSE] = True
    return used


def _start_point(base: RooflineModel, device: DeviceType) -> np.ndarray:
    """``x`` of the starting model: inverse efficiencies, overheads and per-byte costs."""
    start_x = np.empty(_N_COLS)
    default_overhead = (
        device.kernel_overhead_s if base.kernel_overhead_s is None else base.kernel_overhead_s
    )
    for i, c in enumerate(_CLASSES):
        op_type = _representative_op(c)
        start_x[i] = 1.0 / (base.compute_efficiency(op_type) * base.peak_flops_scale)
        start_x[_COL_OVERHEAD + i] = base.overhead_s.get(op_type, default_overhead)
        start_x[_COL_MEM + i] = 1.0 / (
            base.memory_efficiency_of(op_type) * base.memory_bandwidth_scale
        )
    start_x[_COL_SPILL] = base.spill_s_per_byte
    start_x[_COL_TRANSPOSE] = base.transpose_s_per_byte
    return start_x


def _lower_bounds(used: np.ndarray, start_x: np.ndarray, max_scale: float) -> np.ndarray:
    """Bounds of the fitted columns; unused columns are pinned at their start."""
    # theta = 1 / (efficiency * scale) >= 1 / max_scale: a catalog figure may understate the
    # machine (the nominal cpu entry) by up to max_scale; overheads >= 0; efficiencies are kept
    # >= 1e-4 at the end.
    lower = np.where(used, 1.0 / max_scale, start_x)
    lower[_COL_OVERHEAD:] = np.where(used[_COL_OVERHEAD:], 0.0, start_x[_COL_OVERHEAD:])
    # (the spill and transposed-operand columns are among them: seconds per byte >= 0)
    return lower


def _alternate(
    feats: Sequence[_Feature],
    y: np.ndarray,
    w: np.ndarray,
    start_x: np.ndarray,
    lower: np.ndarray,
    used: np.ndarray,
    max_iterations: int,
) -> tuple[np.ndarray, int]:
    """The active-set iteration (module docstring): the best ``x`` and the iterations run."""

    def objective(x: np.ndarray) -> float:
        return float((((_predict(feats, x) - y) * w) ** 2).sum())

    x = start_x.copy()
    best_x, best_obj = x.copy(), objective(x)
    seen: set[bytes] = set()
    iterations = 0
    while iterations < max_iterations:
        a, pattern = _design(feats, x)
        if pattern in seen:
            break
        iterations += 1
        seen.add(pattern)
        x_new = _bounded_lstsq(a * w[:, None], y * w, lower, used)
        x_new[:_COL_OVERHEAD] = np.minimum(x_new[:_COL_OVERHEAD], 1.0e4)
        obj = objective(x_new)
        if obj < best_obj:
            best_x, best_obj = x_new.copy(), obj
        x = x_new
    return best_x, iterations


@dataclass(frozen=True)
class _Fitted:
    """A fitted ``x`` read back as a model and as per-class figures."""

    roofline: RooflineModel
    class_efficiency: dict[str, float]
    class_memory_efficiency: dict[str, float]
    class_overhead_s: dict[str, float]


def _per_type(by_class: Mapping[str, float]) -> dict[str, float]:
    """Every known dense-math op type whose class has a figure in ``by_class``, with it."""
    out: dict[str, float] = {}
    for op_type in sorted(set(_CLASS_OF) | set(MATMUL_LIKE_OPS)):
        c = op_class(op_type)
        if c is not OpClass.OTHER and c.value in by_class:
            out[op_type] = by_class[c.value]
    return out


def _peak_scale(best_x: np.ndarray, used: np.ndarray, base: RooflineModel) -> float:
    """The measured peak over the catalog's: the largest raw compute efficiency, when above 1."""
    if not used[:_N_CLASSES].any():
        return base.peak_flops_scale
    raw_eff = 1.0 / best_x[:_N_CLASSES]
    return max(1.0, float(raw_eff[used[:_N_CLASSES]].max()))


def _memory_efficiencies(best_x: np.ndarray, used: np.ndarray) -> tuple[float, dict[str, float]]:
    """The bandwidth scale and the fitted memory efficiency per class (relative to it)."""
    mem_used = used[_COL_MEM:_COL_OVERHEAD]
    raw_mem = 1.0 / best_x[_COL_MEM:_COL_OVERHEAD]
    bw_scale = max(1.0, float(raw_mem[mem_used].max())) if mem_used.any() else 1.0
    by_class = {
        c.value: min(1.0, float(raw_mem[i] / bw_scale)) for i, c in enumerate(_CLASSES) if mem_used[i]
    }
    return bw_scale, by_class


def _overheads(
    best_x: np.ndarray, used: np.ndarray, base: RooflineModel
) -> tuple[dict[str, float], dict[str, float]]:
    """Fitted fixed seconds per op: by op type (over the base's) and by class."""
    per_type: dict[str, float] = dict(base.overhead_s)
    for op_type, c in _CLASS_OF.items():
        col = _COL_OVERHEAD + _CLASSES.index(c)
        if used[col]:
            per_type[op_type] = float(best_x[col])
    by_class = {
        c.value: float(best_x[_COL_OVERHEAD + i])
        for i, c in enumerate(_CLASSES)
        if used[_COL_OVERHEAD + i]
    }
    return per_type, by_class


def _fitted(best_x: np.ndarray, used: np.ndarray, base: RooflineModel) -> _Fitted:
    """The model of the fitted ``x``: efficiencies relative to the fitted scales."""
    peak_scale = _peak_scale(best_x, used, base)
    bw_scale, memory_efficiency = _memory_efficiencies(best_x, used)
    raw_eff = 1.0 / best_x[:_N_CLASSES]
    efficiency = {
        c.value: float(raw_eff[i] / peak_scale) for i, c in enumerate(_CLASSES) if used[i]
    }
    per_type = {
        k: min(1.0, v * base.peak_flops_scale / peak_scale) for k, v in base.efficiency.items()
    }
    per_type.update(_per_type(efficiency))
    overheads, class_overhead = _overheads(best_x, used, base)
    other = _CLASSES.index(OpClass.OTHER)
    other_col = _COL_OVERHEAD + other
    roofline = RooflineModel(
        efficiency=MappingProxyType(dict(sorted(per_type.items()))),
        default_compute_efficiency=efficiency[OpClass.OTHER.value]
        if used[other]
        else min(1.0, base.default_compute_efficiency * base.peak_flops_scale / peak_scale),
        memory_efficiency=memory_efficiency.get(
            OpClass.OTHER.value, min(1.0, base.memory_efficiency * base.memory_bandwidth_scale / bw_scale)
        ),
        memory_efficiency_by_type=MappingProxyType(_per_type(memory_efficiency)),
        peak_flops_scale=peak_scale,
        memory_bandwidth_scale=bw_scale,
        kernel_overhead_s=float(best_x[other_col]) if used[other_col] else base.kernel_overhead_s,
        overhead_s=MappingProxyType(dict(sorted(overheads.items()))),
        dispatch_overhead_s=base.dispatch_overhead_s,
        spill_threshold_bytes=base.spill_threshold_bytes,
        spill_s_per_byte=float(best_x[_COL_SPILL]),
        transpose_s_per_byte=float(best_x[_COL_TRANSPOSE]),
    )
    return _Fitted(roofline, efficiency, memory_efficiency, class_overhead)


def fit_dispatch_overhead(steps: Sequence[tuple[float, float, int]]) -> float:
    """The executor's cost per op from whole steps: ``(wall_s, kernels_s, num_ops)`` per model.

    A step run one op at a time takes its kernels' time plus the executor's work between them
    (finding ready ops, allocating outputs), paid by every op. The estimate is the median over
    the models of ``(wall_s - kernels_s) / num_ops``, at least 0. Raises PartitionError without
    steps.
    """
    if not steps:
        raise PartitionError("no whole-step timings to fit the dispatch overhead on")
    per_op = []
    for wall_s, kernels_s, num_ops in steps:
        if num_ops < 1 or not (wall_s > 0 and math.isfinite(wall_s) and math.isfinite(kernels_s)):
            raise PartitionError(
                f"step timing ({wall_s!r} s wall, {kernels_s!r} s kernels, {num_ops!r} ops) "
                "needs a finite wall time > 0 and at least one op"
            )
        per_op.append((wall_s - kernels_s) / num_ops)
    return max(0.0, statistics.median(per_op))


def _representative_op(c: OpClass) -> str:
    for op_type, cls in _CLASS_OF.items():
        if cls is c:
            return op_type
    return "__other__"


def calibration_to_dict(cal: Calibration) -> dict[str, Any]:
    """The JSON form written by :func:`save_calibration`."""
    return {
        "schema": CALIBRATION_SCHEMA,
        "device_type": cal.device_type,
        "family": cal.family,
        "roofline": roofline_to_dict(cal.roofline),
        "class_efficiency": dict(cal.class_efficiency),
        "class_overhead_s": dict(cal.class_overhead_s),
        "class_memory_efficiency": dict(cal.class_memory_efficiency),
        "fit": {
            "num_samples": cal.fit.num_samples,
            "rms_relative_error": cal.fit.rms_relative_error,
            "median_abs_relative_error": cal.fit.median_abs_relative_error,
            "max_abs_relative_error": cal.fit.max_abs_relative_error,
            "iterations": cal.iterations,
            "models": list(cal.models),
        },
        "source": cal.source,
    }


def save_calibration(cal: Calibration, path: str | os.PathLike[str]) -> Path:
    """Write ``cal`` as JSON, atomically (a temporary file and a rename)."""
    from partitioner.core.files import write_atomic

    return write_atomic(path, json.dumps(calibration_to_dict(cal), indent=2) + "\n")


def load_calibration(path: str | os.PathLike[str]) -> Calibration:
    """Read a file written by :func:`save_calibration` (through the one calibration reader,
    :func:`~cost_models.estimate.analytic.read_calibration`); raises CatalogError naming the
    file and the field."""
    p = Path(path)
    origin = f"calibration {str(p)!r}"
    raw, roofline = read_calibration(read_text(p, origin, CatalogError), origin)
    fit = raw["fit"]
    return Calibration(
        device_type=raw["device_type"],
        roofline=roofline,
        fit=FitStats(
            num_samples=fit["num_samples"],
            rms_relative_error=float(fit["rms_relative_error"]),
            median_abs_relative_error=float(fit["median_abs_relative_error"]),
            max_abs_relative_error=float(fit["max_abs_relative_error"]),
        ),
        class_efficiency=_class_figures(raw, "class_efficiency"),
        class_overhead_s=_class_figures(raw, "class_overhead_s"),
        class_memory_efficiency=_class_figures(raw, "class_memory_efficiency"),
        iterations=fit.get("iterations", 0),
        models=tuple(fit.get("models", ())),
        source=raw.get("source", ""),
    )


def _class_figures(raw: Mapping[str, Any], key: str) -> Mapping[str, float]:
    """A per-class figure mapping of a schema-valid calibration file (empty when absent)."""
    return MappingProxyType({str(k): float(v) for k, v in raw.get(key, {}).items()})
