"""Arithmetic precision of a training step: which peak an op runs at and how many bytes it moves.

A :class:`PrecisionPolicy` is what a Keras model trains in:

========================  ==================  ======================  ===========================
policy                    matmul / conv       other ops               bytes per element
========================  ==================  ======================  ===========================
``fp32``                  fp32 CUDA cores     fp32 CUDA cores         4 (everything)
``tf32``                  TF32 tensor cores   fp32 CUDA cores         4 (everything)
``mixed_float16``         FP16 tensor cores   fp32 CUDA cores         2 activations; 4 weights,
                                                                      gradients, optimizer slots
``mixed_bfloat16``        BF16 tensor cores   fp32 CUDA cores         as ``mixed_float16``
========================  ==================  ======================  ===========================

* **Tensor cores** run the op types of :data:`TENSOR_CORE_OPS` (dense matmuls and
  convolutions, forward and both backward kernels); depthwise convolutions do not (cuDNN runs
  them on the CUDA cores). Every other op is priced at the fp32 (CUDA-core) peak, whatever its
  dtype: they are memory-bound, and the roofline's bandwidth term decides them.
* **TF32** is TensorFlow's default for float32 matmuls and convolutions on Ampere and newer
  (``tf.config.experimental.enable_tensor_float_32_execution``, on unless turned off): a float32
  model plans as ``tf32``; on devices without TF32 the catalog's ``tf32`` figure is its fp32
  one, so ``tf32`` and ``fp32`` price the same there.
* **Mixed precision** (Keras ``mixed_float16`` / ``mixed_bfloat16``) keeps float32 master
  weights, float32 weight gradients (the variables' dtype) and float32 optimizer slots; the
  activations, and so the saved tensors and the memory traffic, are 16-bit.

The trace records each op's dtypes, so a model traced under a mixed policy is costed at the
16-bit peaks as it stands (:func:`traced_precision` reads the policy back from the graph). A
*different* policy (``precision=``) re-prices the traced graph: float tensors move
:func:`bytes_scale` times the traced bytes and tensor-core ops run at the new policy's peak.
Pure Python: the Keras policy and TensorFlow's TF32 flag are read where the model is traced
(:func:`policy_from_keras` turns them into a policy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

from cost_models.devices.catalog import DeviceType
from partitioner.core.errors import UsageError
from partitioner.core.ir import Graph

__all__ = [
    "FLOAT_DTYPES",
    "TENSOR_CORE_OPS",
    "PrecisionPolicy",
    "bytes_scale",
    "op_peak_flops",
    "op_peak_key",
    "parse_precision",
    "policy_from_keras",
    "traced_precision",
]

TENSOR_CORE_OPS: frozenset[str] = frozenset(
    {
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
        "Conv1D",
        "Conv2D",
        "Conv3D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "Conv3DBackpropInputV2",
        "Conv3DBackpropFilterV2",
        "_FusedMatMul",
        "_FusedConv2D",
    }
)
"""Op types cuBLAS / cuDNN run on tensor cores (TF32, FP16, BF16) when the dtype allows."""

FLOAT_DTYPES: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
"""Dtypes a precision policy changes (float64, ints, bools keep their size)."""


class PrecisionPolicy(enum.Enum):
    """How a model trains: the Keras dtype policy and TensorFlow's TF32 setting, as one."""

    FP32 = "fp32"
    TF32 = "tf32"
    MIXED_FLOAT16 = "mixed_float16"
    MIXED_BFLOAT16 = "mixed_bfloat16"

    @property
    def compute_dtype(self) -> str:
        """The dtype of activations and of the matmul / conv inputs."""
        return _COMPUTE_DTYPE[self]

    @property
    def activation_bytes_per_element(self) -> int:
        """Bytes per element of activations (saved tensors, memory traffic)."""
        return 2 if self.is_mixed else 4

    @property
    def weight_bytes_per_element(self) -> int:
        """Bytes per element of weights, weight gradients and optimizer slots: 4 under every
        policy (mixed precision keeps float32 master weights)."""
        return 4

    @property
    def is_mixed(self) -> bool:
        return self in (PrecisionPolicy.MIXED_FLOAT16, PrecisionPolicy.MIXED_BFLOAT16)

    @property
    def tf32_enabled(self) -> bool:
        """Float32 matmuls / convolutions on TF32 tensor cores (TensorFlow's default)."""
        return self is not PrecisionPolicy.FP32


_COMPUTE_DTYPE: Mapping[PrecisionPolicy, str] = MappingProxyType(
    {
        PrecisionPolicy.FP32: "float32",
        PrecisionPolicy.TF32: "float32",
        PrecisionPolicy.MIXED_FLOAT16: "float16",
        PrecisionPolicy.MIXED_BFLOAT16: "bfloat16",
    }
)

_ALIASES: Mapping[str, PrecisionPolicy] = MappingProxyType(
    {
        "fp32": PrecisionPolicy.FP32,
        "float32": PrecisionPolicy.FP32,
        "tf32": PrecisionPolicy.TF32,
        "fp16": PrecisionPolicy.MIXED_FLOAT16,
        "float16": PrecisionPolicy.MIXED_FLOAT16,
        "mixed_float16": PrecisionPolicy.MIXED_FLOAT16,
        "mixed_fp16": PrecisionPolicy.MIXED_FLOAT16,
        "amp": PrecisionPolicy.MIXED_FLOAT16,
        "bf16": PrecisionPolicy.MIXED_BFLOAT16,
        "bfloat16": PrecisionPolicy.MIXED_BFLOAT16,
        "mixed_bfloat16": PrecisionPolicy.MIXED_BFLOAT16,
        "mixed_bf16": PrecisionPolicy.MIXED_BFLOAT16,
    }
)


def parse_precision(name: str | PrecisionPolicy) -> PrecisionPolicy:
    """The policy called ``name``: ``fp32``, ``tf32``, ``fp16`` / ``mixed_float16``, ``bf16`` /
    ``mixed_bfloat16`` (case-insensitive, ``-`` as ``_``)."""
    if isinstance(name, PrecisionPolicy):
        return name
    key = str(name).strip().lower().replace("-", "_")
    found = _ALIASES.get(key)
    if found is None:
        known = ", ".join(p.value for p in PrecisionPolicy)
        raise UsageError(f"precision={name!r} is not a precision; use one of {known} (or fp16, bf16)")
    return found


def policy_from_keras(policy_name: str, tf32_enabled: bool = True) -> PrecisionPolicy:
    """The policy of a Keras dtype policy name (``'float32'``, ``'mixed_float16'``, ...) with
    TensorFlow's TF32 flag (``tf.config.experimental.tensor_float_32_execution_enabled()``)."""
    key = policy_name.strip().lower()
    if key == "mixed_float16":
        return PrecisionPolicy.MIXED_FLOAT16
    if key == "mixed_bfloat16":
        return PrecisionPolicy.MIXED_BFLOAT16
    return PrecisionPolicy.TF32 if tf32_enabled else PrecisionPolicy.FP32


def traced_precision(graph: Graph, tf32_enabled: bool = True) -> PrecisionPolicy:
    """The policy ``graph`` was traced under, read from the dtypes of its tensor-core ops (the
    majority by FLOPs): 16-bit -> mixed, float32 -> ``tf32`` (``fp32`` when TF32 is off)."""
    flops = {"float16": 0, "bfloat16": 0, "float32": 0}
    for op in graph.ops:
        if op.op_type in TENSOR_CORE_OPS and op.output_dtypes and op.output_dtypes[0] in flops:
            flops[op.output_dtypes[0]] += max(op.flops, 1)
    dtype = max(flops, key=lambda k: flops[k])
    if flops[dtype] == 0 or dtype == "float32":
        return PrecisionPolicy.TF32 if tf32_enabled else PrecisionPolicy.FP32
    return PrecisionPolicy.MIXED_FLOAT16 if dtype == "float16" else PrecisionPolicy.MIXED_BFLOAT16


def bytes_scale(traced: PrecisionPolicy, target: PrecisionPolicy) -> float:
    """How many times its traced bytes a float activation moves under ``target``."""
    return target.activation_bytes_per_element / traced.activation_bytes_per_element


_PEAK_KEY: Mapping[str, str] = MappingProxyType(
    {"float16": "fp16", "bfloat16": "bf16", "float32": "tf32"}
)


def op_peak_key(device: DeviceType, op_type: str, dtype: str, policy: PrecisionPolicy) -> str:
    """The catalog peak (``'fp32'``, ``'tf32'``, ``'fp16'``, ``'bf16'``) an ``op_type`` op of
    ``dtype`` runs at under ``policy`` on ``device``: tensor-core ops at the tensor-core figure
    of their dtype (float32 at TF32 when the policy enables it), everything else -- and a
    format the device has no tensor cores for (its figure is no faster than fp32) -- at fp32."""
    if op_type not in TENSOR_CORE_OPS:
        return "fp32"
    key = _PEAK_KEY.get(dtype, "fp32")
    if key == "tf32" and not policy.tf32_enabled:
        return "fp32"
    peaks = device.peak_flops_per_s
    return key if peaks[key] > peaks["fp32"] else "fp32"


def op_peak_flops(
    device: DeviceType, op_type: str, dtype: str, policy: PrecisionPolicy
) -> float:
    """Dense peak FLOP/s of an ``op_type`` op of ``dtype`` (as it runs under ``policy``) on
    ``device``: the catalog figure of :func:`op_peak_key`."""
    return device.peak_flops_per_s[op_peak_key(device, op_type, dtype, policy)]
