"""The analytic (roofline) cost model: an op's time from its FLOPs, its bytes, and the datasheet.

For an op on a device::

    time_s = dispatch_s + kernel_overhead_s + max(flops / (peak * compute_eff),
                                                  bytes_moved / (memory_bandwidth * memory_eff))
             + max(0, bytes_moved - spill_threshold_bytes) * spill_s_per_byte
             + transposed_bytes * transpose_s_per_byte

where ``peak`` is the catalog figure the op runs at under the precision policy
(:func:`cost_models.estimate.precision.op_peak_key`: matmuls and convolutions on tensor cores,
float32 at TF32 unless the policy is ``fp32``; everything else at fp32), and ``bytes_moved`` is
the op's input bytes (its in-edges) plus its output bytes (less the tensors a fused elementwise
chain keeps on chip, with ``fused_elementwise``). Ops in
:data:`ZERO_WORK_OPS` (metadata, handles, graph plumbing) cost only ``dispatch_s`` (the
executor's per-op cost; 0 unless calibrated). The last term (0 unless calibrated) is a CPU's extra
cost for the bytes beyond what its core's cache holds, and the next (0 unless calibrated) a
CPU matmul's reordering of an operand it reads transposed. ``compute_eff`` is per op
type, and so is ``memory_eff`` where calibrated (else one figure for all); ``kernel_overhead_s`` is
the device's catalog figure unless the model overrides it. A 16-bit op off the tensor cores
runs at ``half_compute_scale`` times the fp32 peak (packed half2 math), and the 16-bit kernels of
the op types in ``half_memory_efficiency_by_type`` reach their own ``memory_eff`` (both calibrated
per GPU family; neutral by default).

Calibrated models: :mod:`cost_models.estimate.calibrate` fits the efficiencies and the per-op overhead to
measured layer times; a fitted model is stored as ``cost_models/data/calibration_<name>.json``
(:func:`roofline_to_dict` / :func:`roofline_from_dict`), and :func:`calibrated_roofline` returns
the packaged one that applies to a device type (its own, or one fitted on a device of the same
family), else :data:`DEFAULT_ROOFLINE`. Packaged: ``cpu`` (the reference 2-core machine),
``volta`` and ``ampere`` (published TensorFlow training throughputs, ``python -m
benchmarks.gpu_fidelity --write-calibration``); :func:`calibration_note` says which apply.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from types import MappingProxyType
from typing import Any

from cost_models.devices.catalog import DeviceType, get_device_type
from cost_models.devices.datafiles import check_schema, parse_json
from cost_models.estimate.precision import (
    FLOAT_DTYPES,
    TENSOR_CORE_OPS,
    PrecisionPolicy,
    bytes_scale,
    op_peak_flops,
    op_peak_key,
    traced_precision,
)
from partitioner.core.errors import CatalogError, UnknownDeviceError
from partitioner.core.ir import Graph

__all__ = [
    "CALIBRATION_SCHEMA_RESOURCE",
    "DEFAULT_ROOFLINE",
    "FUSIBLE_OPS",
    "HALF_DTYPES",
    "MATMUL_LIKE_OPS",
    "MATMUL_OPS",
    "ZERO_WORK_OPS",
    "RooflineModel",
    "RooflineTerms",
    "calibrated_roofline",
    "calibration_note",
    "device_family",
    "estimate_op_times_s",
    "op_memory_shares",
    "read_calibration",
    "roofline_from_dict",
    "roofline_terms",
    "roofline_to_dict",
    "tensor_core_key",
]

logger = logging.getLogger(__name__)

ZERO_WORK_OPS: frozenset[str] = frozenset(
    {
        "Placeholder",
        "PlaceholderWithDefault",
        "Const",
        "HostConst",
        "NoOp",
        "Identity",
        "IdentityN",
        "ReadVariableOp",
        "VarHandleOp",
        "VariableV2",
        "Shape",
        "ShapeN",
        "Size",
        "Rank",
        "StopGradient",
        "PreventGradient",
        "Reshape",
        "Squeeze",
        "ExpandDims",
        "EnsureShape",
        "_Arg",
        "_Retval",
        "Switch",
        "Merge",
        "Enter",
        "Exit",
        "NextIteration",
    }
)
"""Op types that do no device work: they read metadata (shape, size, rank), hand out a resource
handle or constant, or forward a tensor without copying it (identity, reshape-like views, control
flow plumbing). The roofline gives them 0 s and no launch overhead. Ops that write memory
(``ZerosLike``, ``Fill``, ``Snapshot``, ``Transpose``) are *not* here."""

DEPTHWISE_OPS: frozenset[str] = frozenset(
    {
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
    }
)
"""Depthwise convolutions: dense math, but on CUDA cores (not in :data:`TENSOR_CORE_OPS`)."""

MATMUL_OPS: frozenset[str] = frozenset(
    {"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "_FusedMatMul"}
)
"""The matmul class of :data:`TENSOR_CORE_OPS` (cuBLAS GEMMs); the others are convolutions
(cuDNN). The two reach different fractions of a tensor-core peak: TF32 GEMMs run near the TF32
peak, while TF32 convolutions reach a small part of it
(:attr:`RooflineModel.tensor_core_efficiency`)."""


def tensor_core_key(op_type: str, peak_key: str) -> str:
    """The :attr:`RooflineModel.tensor_core_efficiency` key of a tensor-core op running at
    ``peak_key``: ``'matmul:<peak>'`` for :data:`MATMUL_OPS`, else ``'<peak>'``."""
    return f"matmul:{peak_key}" if op_type in MATMUL_OPS else peak_key


MATMUL_LIKE_OPS: frozenset[str] = TENSOR_CORE_OPS | DEPTHWISE_OPS
"""Op types of dense math that reach a good fraction of a peak (tensor-core ops and depthwise
convolutions)."""

FUSIBLE_OPS: frozenset[str] = frozenset(
    {
        "Abs", "Add", "AddN", "AddV2", "BiasAdd", "BiasAddGrad", "BroadcastTo", "Cast",
        "DivNoNan", "Elu", "EluGrad", "Erf", "Exp", "Fill", "LeakyRelu", "LeakyReluGrad", "Log",
        "Max", "Maximum", "Mean", "Min", "Minimum", "Mul", "Neg", "OnesLike", "Pow", "Prod",
        "RealDiv", "Reciprocal", "Relu", "Relu6", "Relu6Grad", "ReluGrad", "Rsqrt", "RsqrtGrad",
        "Select", "SelectV2", "Selu", "Sigmoid", "SigmoidGrad", "Sign", "Sqrt", "Square",
        "SquaredDifference", "Sub", "Sum", "Tanh", "TanhGrad", "Tile", "ZerosLike",
    }
)  # fmt: skip
"""Elementwise ops, broadcasts and reductions that XLA (and grappler's remapper) fuse into
their neighbours: with :attr:`RooflineModel.fused_elementwise`, tensors between them stay on
chip (a batch norm's dozen passes over its input cost one read and one write)."""

HALF_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16"})
"""The 16-bit dtypes :attr:`RooflineModel.half_compute_scale` and
:attr:`RooflineModel.half_memory_efficiency_by_type` apply to."""

_MATMUL_EFFICIENCY = 0.6


def _default_efficiency() -> Mapping[str, float]:
    return MappingProxyType({op: _MATMUL_EFFICIENCY for op in sorted(MATMUL_LIKE_OPS)})


@dataclass(frozen=True)
class RooflineModel:
    """Achieved fractions of the datasheet peaks.

    ``efficiency`` maps an op type to the fraction of peak FLOP/s it achieves; other op types get
    ``default_compute_efficiency``. ``memory_efficiency`` is the achieved fraction of peak memory
    bandwidth (all op types). Every fraction must lie in (0, 1]. ``kernel_overhead_s``, when set,
    replaces the device's catalog launch overhead per op (a calibrated figure); ``overhead_s``
    gives op types their own fixed cost per op (calibrated: on a CPU a small matmul costs far
    more than its FLOPs say).
    """

    efficiency: Mapping[str, float] = field(default_factory=_default_efficiency, compare=False)
    default_compute_efficiency: float = 0.3
    memory_efficiency: float = 0.7
    memory_efficiency_by_type: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )
    """Op types with their own fraction of the memory bandwidth (calibrated); others get
    ``memory_efficiency``."""
    kernel_overhead_s: float | None = None
    overhead_s: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )
    peak_flops_scale: float = 1.0
    """Measured peak over the catalog's figure (calibration: the ``cpu`` entry is nominal)."""
    memory_bandwidth_scale: float = 1.0
    """Measured bandwidth over the catalog's figure (calibration; cache-resident tensors move
    faster than the DRAM figure)."""
    dispatch_overhead_s: float = 0.0
    """The executor's cost per op between kernels, paid by every op including the zero-work
    ones (calibrated on CPUs from the step's wall time less its kernels' times; on a GPU the
    host enqueues ahead of the device, so 0)."""
    spill_threshold_bytes: int = 1 << 18
    """On a CPU, the bytes an op moves beyond this many leave the core's cache (and large
    outputs land in freshly mapped memory, page faults on first touch) ..."""
    spill_s_per_byte: float = 0.0
    """... and each costs this much on top: calibrated; 0 unless fitted."""
    transpose_s_per_byte: float = 0.0
    """Cost per byte of a matmul operand read transposed (a CPU kernel reorders a transposed
    weight on every call: a dense layer's input gradient ``dY @ W^T``): calibrated; 0 unless
    fitted."""
    tensor_core_efficiency: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )
    """Fraction of peak a tensor-core op (:data:`~cost_models.estimate.precision.TENSOR_CORE_OPS`)
    achieves by the peak it runs at (``'fp32'``, ``'tf32'``, ``'fp16'``, ``'bf16'``: TF32 kernels
    reach a smaller fraction of their peak than FP16 ones), and by op class where calibrated:
    a key ``'matmul:<peak>'`` (:func:`tensor_core_key`) prices the matmuls of :data:`MATMUL_OPS`
    at that peak, which otherwise share the ``'<peak>'`` figure with the convolutions. Peaks it
    leaves out use :meth:`compute_efficiency`. Calibrated on GPUs; empty unless fitted."""
    half_compute_scale: float = 1.0
    """16-bit (float16, bfloat16) ops off the tensor cores run at this multiple of the fp32
    CUDA-core peak (packed half2 arithmetic: 2 on Volta, 4 on the A100, whose datasheet gives
    FP16 78 TF non-tensor against FP32 19.5). 1 unless calibrated."""
    half_memory_efficiency_by_type: Mapping[str, float] = field(
        default_factory=lambda: MappingProxyType({}), compare=False
    )
    """Op types whose 16-bit kernels reach their own fraction of the memory bandwidth
    (calibrated; TensorFlow's float16 depthwise filter gradient is a slow kernel of its own,
    tensorflow/tensorflow#41715); others as :meth:`memory_efficiency_of`."""
    fused_elementwise: bool = False
    """Price fusion (XLA, grappler's remapper): a tensor passed between two ops of
    :data:`FUSIBLE_OPS` in the same phase stays on chip, so it costs no memory traffic (an
    output is written only if some consumer is not such a fused read). Off unless calibrated."""

    def __post_init__(self) -> None:
        for what, scale in (
            ("peak_flops_scale", self.peak_flops_scale),
            ("memory_bandwidth_scale", self.memory_bandwidth_scale),
            ("half_compute_scale", self.half_compute_scale),
        ):
            if not (scale > 0 and math.isfinite(scale)):
                raise CatalogError(f"roofline {what}={scale!r} must be a finite number > 0")
        for op_type, value in self.overhead_s.items():
            if not (value >= 0 and math.isfinite(value)):
                raise CatalogError(
                    f"roofline overhead_s[{op_type!r}]={value!r} must be a finite number >= 0"
                )
        for what, amount in (
            ("dispatch_overhead_s", self.dispatch_overhead_s),
            ("spill_s_per_byte", self.spill_s_per_byte),
            ("transpose_s_per_byte", self.transpose_s_per_byte),
        ):
            if not (amount >= 0 and math.isfinite(amount)):
                raise CatalogError(f"roofline {what}={amount!r} must be a finite number >= 0")
        if self.spill_threshold_bytes < 0:
            raise CatalogError(
                f"roofline spill_threshold_bytes={self.spill_threshold_bytes!r} must be >= 0"
            )
        if self.kernel_overhead_s is not None and not (
            self.kernel_overhead_s >= 0 and math.isfinite(self.kernel_overhead_s)
        ):
            raise CatalogError(
                f"roofline kernel_overhead_s={self.kernel_overhead_s!r} must be a finite number >= 0"
            )
        checks = [
            *(
                (f"tensor_core_efficiency[{k!r}]", v)
                for k, v in self.tensor_core_efficiency.items()
            ),
            ("default_compute_efficiency", self.default_compute_efficiency),
            ("memory_efficiency", self.memory_efficiency),
            *(
                (f"half_memory_efficiency_by_type[{k!r}]", v)
                for k, v in self.half_memory_efficiency_by_type.items()
            ),
            *((f"efficiency[{k!r}]", v) for k, v in self.efficiency.items()),
            *(
                (f"memory_efficiency_by_type[{k!r}]", v)
                for k, v in self.memory_efficiency_by_type.items()
            ),
        ]
        for what, value in checks:
            if not (0.0 < value <= 1.0):
                raise CatalogError(f"roofline {what}={value!r} must lie in (0, 1]")

    def compute_efficiency(self, op_type: str) -> float:
        """Fraction of peak FLOP/s that ``op_type`` achieves."""
        return self.efficiency.get(op_type, self.default_compute_efficiency)

    def memory_efficiency_of(self, op_type: str) -> float:
        """Fraction of the (scaled) memory bandwidth that ``op_type`` achieves."""
        return self.memory_efficiency_by_type.get(op_type, self.memory_efficiency)


DEFAULT_ROOFLINE = RooflineModel()
"""Matmul-like ops at 60% of peak, other compute at 30%, memory traffic at 70% of bandwidth."""


def _retyping(
    graph: Graph, precision: PrecisionPolicy | None
) -> tuple[PrecisionPolicy, bool, float]:
    """The policy ``graph`` is priced under (``precision``, else the one it was traced in),
    whether its float ops change dtype, and the factor on their bytes: re-priced under another
    policy, float ops compute in its dtype and move
    :func:`~cost_models.estimate.precision.bytes_scale` times their traced bytes."""
    traced = traced_precision(graph)
    policy = traced if precision is None else precision
    return policy, policy.compute_dtype != traced.compute_dtype, bytes_scale(traced, policy)


class _Rates(dict[tuple[str, str], float]):
    """Achieved FLOP/s (peak * efficiency) by ``(op type, dtype)``, computed on first use: few
    distinct pairs in practice."""

    def __init__(self, device: DeviceType, model: RooflineModel, policy: PrecisionPolicy) -> None:
        super().__init__()
        self._device, self._model, self._policy = device, model, policy

    def __missing__(self, key: tuple[str, str]) -> float:
        op_type, dtype = key
        peak_key = op_peak_key(self._device, op_type, dtype, self._policy)
        eff = self._model.compute_efficiency(op_type)
        if op_type in TENSOR_CORE_OPS:
            by_peak = self._model.tensor_core_efficiency
            eff = by_peak.get(tensor_core_key(op_type, peak_key), by_peak.get(peak_key, eff))
        rate = self._device.peak_flops_per_s[peak_key] * self._model.peak_flops_scale * eff
        if op_type not in TENSOR_CORE_OPS and dtype in HALF_DTYPES:
            rate *= self._model.half_compute_scale
        self[key] = rate
        return rate


def _moved_bytes(graph: Graph, fused: bool = False) -> list[int]:
    """Bytes each op moves, by op position: its in-edges plus its output. With ``fused``
    (:attr:`RooflineModel.fused_elementwise`), an edge between two :data:`FUSIBLE_OPS` of the
    same phase is not read, and an output only such edges read is not written."""
    index, ops = graph.op_index, graph.ops
    reads = [0] * len(ops)
    written = [not fused] * len(ops)
    for e in graph.edges:
        si, di = index[e.src], index[e.dst]
        if (
            fused
            and ops[si].op_type in FUSIBLE_OPS
            and ops[di].op_type in FUSIBLE_OPS
            and ops[si].phase is ops[di].phase
        ):
            continue
        reads[di] += e.bytes
        written[si] = True
    return [r + (op.output_bytes if w else 0) for r, w, op in zip(reads, written, ops, strict=True)]


def estimate_op_times_s(
    graph: Graph,
    device: DeviceType,
    model: RooflineModel | None = None,
    precision: PrecisionPolicy | None = None,
) -> tuple[float, ...]:
    """Roofline time in seconds of every op of ``graph`` on ``device``, aligned with ``graph.ops``.

    An op's dtype is its first output dtype (``'float32'`` when it has no outputs); its peak is
    :func:`~cost_models.estimate.precision.op_peak_flops`. ``precision`` re-prices the graph
    under another policy than the one it was traced in (:func:`_retyping`).
    """
    m = DEFAULT_ROOFLINE if model is None else model
    policy, retype, scale = _retyping(graph, precision)
    moved_bytes = _moved_bytes(graph, m.fused_elementwise)
    default_overhead_s = m.kernel_overhead_s
    if default_overhead_s is None:
        default_overhead_s = device.kernel_overhead_s
    overheads = m.overhead_s
    dispatch_s = m.dispatch_overhead_s
    spill_bytes, spill_s_per_byte, transpose_s_per_byte = (
        m.spill_threshold_bytes, m.spill_s_per_byte, m.transpose_s_per_byte
    )  # fmt: skip
    bandwidth = device.memory_bandwidth_bytes_per_s * m.memory_bandwidth_scale
    inv_bandwidth = 1.0 / (bandwidth * m.memory_efficiency)
    by_type, half_by_type = m.memory_efficiency_by_type, m.half_memory_efficiency_by_type
    rates = _Rates(device, m, policy)
    times: list[float] = []
    append = times.append  # (a hot loop: one bound method, no helper calls per op)
    for op, moved in zip(graph.ops, moved_bytes, strict=True):
        op_type = op.op_type
        if op_type in ZERO_WORK_OPS:
            append(dispatch_s)
            continue
        dtype = op.output_dtypes[0] if op.output_dtypes else "float32"
        if retype and dtype in FLOAT_DTYPES:
            dtype = policy.compute_dtype
            moved = int(moved * scale)
        if half_by_type and op_type in half_by_type and dtype in HALF_DTYPES:
            memory_s = moved / (bandwidth * half_by_type[op_type])
        elif by_type and op_type in by_type:
            memory_s = moved / (bandwidth * by_type[op_type])
        else:
            memory_s = moved * inv_bandwidth
        overhead_s = dispatch_s + (
            overheads.get(op_type, default_overhead_s) if overheads else default_overhead_s
        )
        if spill_s_per_byte and moved > spill_bytes:
            overhead_s += (moved - spill_bytes) * spill_s_per_byte
        if transpose_s_per_byte and op.transposed_bytes:
            overhead_s += op.transposed_bytes * transpose_s_per_byte
        if op.flops:
            compute_s = op.flops / rates[(op_type, dtype)]
            append(overhead_s + (compute_s if compute_s > memory_s else memory_s))
        else:
            append(overhead_s + memory_s)
    return tuple(times)


@dataclass(frozen=True)
class RooflineTerms:
    """The roofline's two terms of every op that does work, at full peak (efficiency 1): what a
    fit of the efficiencies scales (:mod:`benchmarks.gpu_fidelity`)."""

    op_types: tuple[str, ...]
    dtypes: tuple[str, ...]
    """The dtype each op is priced in (its first output's, re-typed under ``precision``)."""
    peak_keys: tuple[str, ...]
    """The catalog peak each op runs at (:func:`~cost_models.estimate.precision.op_peak_key`)."""
    compute_s: tuple[float, ...]
    """FLOPs over the op's dense peak (:func:`~cost_models.estimate.precision.op_peak_flops`)."""
    memory_s: tuple[float, ...]
    """Bytes moved over the catalog's memory bandwidth."""


def roofline_terms(
    graph: Graph,
    device: DeviceType,
    precision: PrecisionPolicy | None = None,
    fused_elementwise: bool = False,
) -> RooflineTerms:
    """The compute and memory terms of the ops of ``graph`` that do work (not
    :data:`ZERO_WORK_OPS`) on ``device``, priced as :func:`estimate_op_times_s` prices them."""
    policy, retype, scale = _retyping(graph, precision)
    types: list[str] = []
    dtypes: list[str] = []
    peak_keys: list[str] = []
    compute: list[float] = []
    memory: list[float] = []
    for op, moved in zip(graph.ops, _moved_bytes(graph, fused_elementwise), strict=True):
        if op.op_type in ZERO_WORK_OPS:
            continue
        dtype = op.output_dtypes[0] if op.output_dtypes else "float32"
        if retype and dtype in FLOAT_DTYPES:
            dtype, moved = policy.compute_dtype, int(moved * scale)
        types.append(op.op_type)
        dtypes.append(dtype)
        peak_keys.append(op_peak_key(device, op.op_type, dtype, policy))
        compute.append(op.flops / op_peak_flops(device, op.op_type, dtype, policy))
        memory.append(moved / device.memory_bandwidth_bytes_per_s)
    return RooflineTerms(
        tuple(types), tuple(dtypes), tuple(peak_keys), tuple(compute), tuple(memory)
    )


def op_memory_shares(
    graph: Graph,
    device: DeviceType,
    precision: PrecisionPolicy | None = None,
    fused_elementwise: bool = False,
) -> tuple[float, ...]:
    """Per op of ``graph`` (aligned with ``graph.ops``), the part of its work that is memory
    traffic: over the ops of its layer and phase, the memory terms of :func:`roofline_terms`
    over both terms. Per layer and phase, not per op: a profile gives a fused kernel's time
    (a Dense layer's matrix product, bias and ReLU in one oneDNN kernel) to one op of the
    fusion, and an MLP whose ReLUs held their matrix products' time was priced as memory-bound
    (a share of 0.38 where its work has 0.04). What
    :attr:`~partitioner.core.ir.CostedGraph.op_memory_share` holds."""
    terms = roofline_terms(graph, device, precision, fused_elementwise)
    working = iter(zip(terms.compute_s, terms.memory_s, strict=True))
    groups: dict[tuple[str | None, object], list[float]] = {}
    keys = []
    for op in graph.ops:
        key = (op.layer, op.phase)
        keys.append(key)
        sums = groups.setdefault(key, [0.0, 0.0])
        if op.op_type not in ZERO_WORK_OPS:
            compute_s, memory_s = next(working)
            sums[0] += compute_s
            sums[1] += memory_s
    share = {k: m / (c + m) if c + m > 0 else 0.0 for k, (c, m) in groups.items()}
    return tuple(share[k] for k in keys)


def device_family(device_type: str) -> str:
    """The family (catalog ``family`` field) of a device type name; the name itself when the
    catalog does not know it."""
    key = device_type.strip().lower()
    try:
        return get_device_type(key).family
    except UnknownDeviceError:
        return key


def roofline_to_dict(model: RooflineModel) -> dict[str, Any]:
    """A JSON-ready form of ``model`` (read back by :func:`roofline_from_dict`)."""
    return {
        "efficiency": dict(sorted(model.efficiency.items())),
        "default_compute_efficiency": model.default_compute_efficiency,
        "memory_efficiency": model.memory_efficiency,
        "memory_efficiency_by_type": dict(sorted(model.memory_efficiency_by_type.items())),
        "kernel_overhead_s": model.kernel_overhead_s,
        "overhead_s": dict(sorted(model.overhead_s.items())),
        "peak_flops_scale": model.peak_flops_scale,
        "memory_bandwidth_scale": model.memory_bandwidth_scale,
        "dispatch_overhead_s": model.dispatch_overhead_s,
        "spill_threshold_bytes": model.spill_threshold_bytes,
        "spill_s_per_byte": model.spill_s_per_byte,
        "transpose_s_per_byte": model.transpose_s_per_byte,
        "tensor_core_efficiency": dict(sorted(model.tensor_core_efficiency.items())),
        "half_compute_scale": model.half_compute_scale,
        "half_memory_efficiency_by_type": dict(
            sorted(model.half_memory_efficiency_by_type.items())
        ),
        "fused_elementwise": model.fused_elementwise,
    }


CALIBRATION_SCHEMA_RESOURCE = "estimate/calibration.schema.json"
"""The JSON Schema of calibration files, next to this reader (package data of ``cost_models``)."""


def _numbers(raw: Mapping[str, Any], key: str) -> Mapping[str, float]:
    return MappingProxyType({str(k): float(v) for k, v in raw.get(key, {}).items()})


def _roofline(raw: Mapping[str, Any]) -> RooflineModel:
    """The model of schema-valid ``raw`` (the ranges are checked by :class:`RooflineModel`)."""
    overhead = raw.get("kernel_overhead_s")
    return RooflineModel(
        overhead_s=_numbers(raw, "overhead_s"),
        efficiency=_numbers(raw, "efficiency"),
        default_compute_efficiency=float(raw["default_compute_efficiency"]),
        memory_efficiency=float(raw["memory_efficiency"]),
        memory_efficiency_by_type=_numbers(raw, "memory_efficiency_by_type"),
        kernel_overhead_s=None if overhead is None else float(overhead),
        peak_flops_scale=float(raw.get("peak_flops_scale", 1.0)),
        memory_bandwidth_scale=float(raw.get("memory_bandwidth_scale", 1.0)),
        dispatch_overhead_s=float(raw.get("dispatch_overhead_s", 0.0)),
        spill_threshold_bytes=int(raw.get("spill_threshold_bytes", 1 << 18)),
        spill_s_per_byte=float(raw.get("spill_s_per_byte", 0.0)),
        transpose_s_per_byte=float(raw.get("transpose_s_per_byte", 0.0)),
        tensor_core_efficiency=_numbers(raw, "tensor_core_efficiency"),
        half_compute_scale=float(raw.get("half_compute_scale", 1.0)),
        half_memory_efficiency_by_type=_numbers(raw, "half_memory_efficiency_by_type"),
        fused_elementwise=bool(raw.get("fused_elementwise", False)),
    )


def roofline_from_dict(raw: Mapping[str, Any], origin: str = "roofline") -> RooflineModel:
    """The model stored by :func:`roofline_to_dict`; raises CatalogError naming ``origin``."""
    check_schema(
        raw,
        "cost_models",
        CALIBRATION_SCHEMA_RESOURCE,
        origin,
        CatalogError,
        ref="#/$defs/roofline",
    )
    return _roofline(raw)


def read_calibration(text: str, origin: str) -> tuple[Mapping[str, Any], RooflineModel]:
    """The one reader of calibration files: ``text`` parsed, checked against
    ``calibration.schema.json``, and its roofline built. Returns the checked data (for the fit
    record :func:`cost_models.estimate.calibrate.load_calibration` builds) and the model; raises
    a one-line :class:`~partitioner.core.errors.CatalogError` naming ``origin`` and the field."""
    raw = parse_json(text, origin, CatalogError, hint="refit it")
    check_schema(raw, "cost_models", CALIBRATION_SCHEMA_RESOURCE, origin, CatalogError)
    try:
        return raw, _roofline(raw["roofline"])
    except CatalogError as exc:
        raise CatalogError(f"{origin}: {exc}") from None


@functools.lru_cache(maxsize=32)
def _packaged_calibration(family: str) -> RooflineModel | None:
    ref = resources.files("cost_models").joinpath("data", f"calibration_{family}.json")
    try:
        text = ref.read_text(encoding="utf-8")
    except (OSError, FileNotFoundError):
        return None
    return read_calibration(text, f"data/calibration_{family}.json")[1]


def calibrated_roofline(device_type: str) -> RooflineModel:
    """The packaged calibrated model for ``device_type``'s family, else :data:`DEFAULT_ROOFLINE`.

    Packaged calibrations are ``cost_models/data/calibration_<family>.json`` (the family is the
    catalog's ``family`` field); the one for ``cpu`` was fitted on the reference 2-core machine,
    ``volta`` and ``ampere`` on published TensorFlow throughputs (:func:`calibration_note`)."""
    found = _packaged_calibration(device_family(device_type))
    return DEFAULT_ROOFLINE if found is None else found


def calibration_note(device_types: Iterable[str]) -> str:
    """One line on the roofline :func:`calibrated_roofline` gives ``device_types`` (for a plan's
    cost notes): calibrated for their families, the datasheet roofline, or -- when a topology
    mixes the two -- a warning that their times come from differently fitted models (the GPU
    calibrations, ``calibration_volta.json`` and ``calibration_ampere.json``, are fitted on
    published TensorFlow throughputs by ``python -m benchmarks.gpu_fidelity``; other GPU
    families keep the datasheet efficiencies, which price a V100 and an H100 differently than
    a fit of both would)."""
    families = {device_family(name) for name in device_types}
    calibrated = sorted(f for f in families if _packaged_calibration(f) is not None)
    plain = sorted(families.difference(calibrated))
    if not plain:
        return "roofline calibrated for " + ", ".join(calibrated)
    if not calibrated:
        return "datasheet roofline (no calibration for " + ", ".join(plain) + ")"
    return (
        "roofline calibrated for "
        + ", ".join(calibrated)
        + " but not for "
        + ", ".join(plain)
        + ": their times come from different models, compare them with care"
    )
