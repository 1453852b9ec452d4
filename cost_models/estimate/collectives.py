"""The time of gradient all-reduces over a topology's links.

Data-parallel replicas sum their gradients with an all-reduce, in one of two algorithms
(:class:`AllReduceAlgorithm`), the one the rewrite runs:

**Reduce to one device, then broadcast** (``REDUCE_TO_ONE``): what ``MirroredStrategy`` does on
CPUs or mixed devices (``tf.distribute.ReductionToOneDevice``) and what the hybrid rewrite
(``passes.rewrite.replicate``) does for every stage: every other member sends its whole gradient
to the root (replica 0's device), which sums them and sends the sum back::

    reduce_to_one_s = 2 * max over channels c of (latency_c + bytes carried by c / bandwidth_c)

(the gather, then the broadcast; transfers into or out of the root that share a channel share
its bandwidth).

**Ring** (``RING``): ``MirroredStrategy`` uses NCCL's all-reduce between local GPUs, and
``MultiWorkerMirroredStrategy`` its ring collectives across workers; both are ring
all-reduces (Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009): ``R`` devices in a ring, the tensor cut into ``R`` chunks, ``R - 1``
reduce-scatter steps then ``R - 1`` all-gather steps, each step sending one chunk from every
device to its ring successor at the same time. A step lasts as long as its slowest channel::

    step_s = max over channels c of (latency_c + chunk bytes carried by c / ring_bandwidth_c)
    all_reduce_s = 2 (R - 1) step_s
    ring_bandwidth_c = bandwidth_c * bus_bandwidth_efficiency(link kind of c)

The efficiency is what NCCL achieves over a link kind as nccl-tests' bus bandwidth (``busbw =
2 (R - 1) / R * bytes / time``, the per-link rate of this very formula), divided by the link's
bandwidth: NCCL's protocol overhead on NVLink, the CPU root complexes a PCIe ring crosses. The
catalog gives it per link kind with its published source
(:meth:`~cost_models.devices.catalog.Catalog.ring_efficiency`; 1.0 for kinds without one, e.g.
a topology file's own links); the benchmark ``python -m benchmarks.gpu_fidelity`` checks it.

Transfers that share a channel (:meth:`~partitioner.core.ir.Topology.channel_between`: all
traffic from one host to another shares one NIC) share its bandwidth, so a ring that crosses
hosts several times is slower than one that crosses them once (:func:`ring_order` keeps each
host's devices together). A hybrid strategy all-reduces every stage's gradients among that
stage's replicas at the same time: :func:`concurrent_all_reduce_s` adds the chunks of all the
rings step by step on the channels they share.

**Measured** (``topology.all_reduce``, an :class:`~partitioner.core.ir.AllReduceFit`): when the
topology carries a fit of the runtime's own all-reduce (``latency_s + bytes / bandwidth``,
measured among ``members`` devices, e.g. ``MultiWorkerMirroredStrategy``'s gRPC collective),
it replaces both estimates above for its algorithm (for either when its ``algorithm`` is
``None``). Groups of another size ``R`` scale it as a ring does (``2 (R - 1)`` latencies,
``2 (R - 1) / R`` of the bytes per device)::

    measured_s = latency_s * (R - 1) / (m - 1)
                 + bytes / bandwidth * ((R - 1) / R) / ((m - 1) / m)

and all-reduces running at the same time (a hybrid strategy's stages) add their bytes: they go
through the same runtime's collective executors on the same hosts.

Each gradient tensor is its own transfer and sum, so the all-reduce of a model's ``n`` gradient
tensors costs more than that of the same bytes in a few (measured on two loopback workers, 16
MiB in 8 tensors: 20.5 ms, in 32: 25.7 ms, in 64: 26.8 ms; 4 MiB: 5.3, 11.2, 13.0 ms). A fit
that records its tensor count ``t`` (``tensors``) and a fit of the same all-reduce with more
tensors ``T`` (``many``) prices ``n`` tensors between the two, by ``log n`` (it grows fast, then
levels off), and as the larger beyond ``T``::

    measured_s(n) = measured_s(t) + w (measured_s(T) - measured_s(t)),
    w = min(1, log(n / t) / log(T / t))   for n > t, else 0

**Sparse gradients.** The gradient of a gathered variable (an ``Embedding``'s table) is a
``tf.IndexedSlices`` (:class:`~partitioner.core.ir.SparseGradient`): ``s`` bytes per replica,
its looked-up rows and their indices. Keras 3's optimizer hands it to the replica context's
``all_reduce`` unchanged (``keras/src/backend/tensorflow/optimizer.py``,
``_all_reduce_sum_gradients``), and TensorFlow does not sum it: it gathers every replica's slices.
``MultiWorkerMirroredStrategy`` all-gathers values and indices
(``cross_device_utils.CollectiveReplicaLauncher.all_reduce_indexed_slices``), a ring all-gather
of ``R - 1`` steps, each member passing one member's ``s`` bytes to its successor::

    all_gather_s = (R - 1) * max over channels c of (latency_c + s carried by c / ring_bandwidth_c)

``ReductionToOneDevice`` (``MirroredStrategy`` on CPUs) copies every replica's slices to the root,
which concatenates them (``aggregate_tensors_or_indexed_slices``), and copies the concatenation,
``R s`` bytes, back to every replica; the hybrid rewrite's explicit reduction does the same. A
step's dense gradients and slices travel in the same two phases::

    gather_s    = max over c of (latency_c + (dense + s) carried by c / bandwidth_c)
    broadcast_s = max over c of (latency_c + (dense + R s) carried by c / bandwidth_c)

:func:`gradient_exchange_s` prices a step's dense gradients and slices together: the ring's dense
all-reduce then its all-gather, or reduce-to-one's two phases. A measured all-reduce prices the
slices by the bytes they send: an all-reduce of :func:`all_gather_equivalent_bytes` (``R s / 2``
for a ring, ``(R + 1) s / 2`` for reduce-to-one), a collective of its own after the dense one.
Repeated ids are not merged: the rows are the step's lookups, duplicates included.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence

from cost_models.devices.catalog import catalog
from partitioner.core.errors import PlanError
from partitioner.core.ir import AllReduceFit, Link, Topology

__all__ = [
    "AllReduceAlgorithm",
    "all_gather_equivalent_bytes",
    "all_reduce_s",
    "concurrent_all_gather_s",
    "concurrent_all_reduce_s",
    "concurrent_reduce_to_one_s",
    "gradient_exchange_s",
    "measured_all_reduce_s",
    "ring_bandwidth_bytes_per_s",
    "ring_order",
]


_Channel = tuple[str, int, int]
"""A queue transfers wait in (:meth:`~partitioner.core.ir.Topology.channel_between`)."""


class AllReduceAlgorithm(enum.Enum):
    """How replicas sum their gradients (see the module docstring)."""

    RING = "ring"
    REDUCE_TO_ONE = "reduce_to_one"


def _fit_for(topology: Topology, algorithm: AllReduceAlgorithm) -> AllReduceFit | None:
    """The topology's measured all-reduce when it applies to ``algorithm``."""
    fit = topology.all_reduce
    if fit is None or fit.algorithm not in (None, algorithm.value):
        return None
    return fit


def measured_all_reduce_s(
    fit: AllReduceFit, members: int, num_bytes: float, tensors: int = 0
) -> float:
    """Seconds of an all-reduce of ``num_bytes`` in ``tensors`` tensors among ``members``
    devices by a measured fit, scaled from the fit's group size as a ring, and from the fit's
    tensor count towards its fit of more tensors (see the module docstring)."""
    if members < 2 or num_bytes <= 0:
        return 0.0
    m = fit.members
    latency_scale = (members - 1) / (m - 1)
    bytes_scale = ((members - 1) / members) / ((m - 1) / m)
    base = fit.latency_s * latency_scale + num_bytes * bytes_scale / fit.bandwidth_bytes_per_s
    many = fit.many
    if many is None or tensors <= fit.tensors:
        return base
    weight = min(1.0, math.log(tensors / fit.tensors) / math.log(many.tensors / fit.tensors))
    more = many.latency_s * latency_scale + num_bytes * bytes_scale / many.bandwidth_bytes_per_s
    return base + weight * (more - base)


def _measured_concurrent_s(
    fit: AllReduceFit, groups: Sequence[tuple[Sequence[int], int]], tensors: int = 0
) -> float:
    """All-reduces at the same time by the measured fit: their bytes (and ``tensors``, their
    tensors in all) add (module docstring)."""
    active = [(len(g), b) for g, b in groups if len(g) > 1 and b > 0]
    if not active:
        return 0.0
    members = max(n for n, _ in active)
    return measured_all_reduce_s(fit, members, sum(b for _, b in active), tensors)


def ring_bandwidth_bytes_per_s(link: Link) -> float:
    """The bandwidth a ring all-reduce achieves over ``link``: its bandwidth times its kind's
    bus-bandwidth efficiency from the catalog (see the module docstring)."""
    return link.bandwidth_bytes_per_s * catalog().ring_efficiency(link.kind)


def ring_order(topology: Topology, group: Sequence[int]) -> tuple[int, ...]:
    """``group``'s devices in ring order: host by host, so the ring crosses each host once."""
    return tuple(sorted(group, key=lambda d: (topology.devices[d].host, d)))


def _ring_step_s(topology: Topology, rings: Sequence[tuple[tuple[int, ...], float]]) -> float:
    """Seconds of one ring step: every member of every ``(ordered group, chunk bytes)`` ring
    sends one chunk to its successor at once, chunks sharing a channel sharing its bandwidth."""
    load: dict[tuple[str, int, int], float] = {}
    latency: dict[tuple[str, int, int], float] = {}
    bandwidth: dict[tuple[str, int, int], float] = {}
    for group, chunk in rings:
        for i, src in enumerate(group):
            dst = group[(i + 1) % len(group)]
            link = topology.link_between(src, dst)
            if link is None:  # pragma: no cover - a ring's members are distinct devices
                continue
            channel = topology.channel_between(src, dst)
            load[channel] = load.get(channel, 0.0) + chunk
            latency[channel] = max(latency.get(channel, 0.0), link.latency_s)
            ring_bw = ring_bandwidth_bytes_per_s(link)
            bandwidth[channel] = min(bandwidth.get(channel, ring_bw), ring_bw)
    return max(latency[c] + load[c] / bandwidth[c] for c in load)


def _active_rings(
    topology: Topology, rings: Sequence[tuple[Sequence[int], int]]
) -> tuple[int, list[tuple[tuple[int, ...], int]]]:
    """The rings with two members or more and some bytes, in ring order, and their common size
    (0 when none); rings of different sizes raise PlanError."""
    active = [(ring_order(topology, g), b) for g, b in rings if len(g) > 1 and b > 0]
    sizes = {len(g) for g, _ in active}
    if len(sizes) > 1:
        raise PlanError(f"rings of different sizes {sorted(sizes)} cannot step together")
    return (sizes.pop() if sizes else 0), active


def concurrent_all_reduce_s(
    topology: Topology, rings: Sequence[tuple[Sequence[int], int]]
) -> float:
    """Seconds for ring all-reduces of ``(group, num_bytes)`` running at the same time.

    Every ring has the same number of members (replicas); a ring of one device, or of no bytes,
    costs nothing. See the module docstring for the model."""
    fit = _fit_for(topology, AllReduceAlgorithm.RING)
    if fit is not None:
        return _measured_concurrent_s(fit, rings)
    members, active = _active_rings(topology, rings)
    if not active:
        return 0.0
    step_s = _ring_step_s(topology, [(g, b / members) for g, b in active])
    return 2 * (members - 1) * step_s


def concurrent_all_gather_s(
    topology: Topology, groups: Sequence[tuple[Sequence[int], int]]
) -> float:
    """Seconds for ring all-gathers of ``(group, bytes each member contributes)`` at once:
    ``R - 1`` steps, each member passing one member's slices to its successor (module
    docstring, "Sparse gradients"). A topology's measured ring all-reduce prices it by the bytes
    it sends (:func:`all_gather_equivalent_bytes`)."""
    fit = _fit_for(topology, AllReduceAlgorithm.RING)
    if fit is not None:
        return _measured_concurrent_s(
            fit,
            [
                (g, all_gather_equivalent_bytes(len(g), b, AllReduceAlgorithm.RING))
                for g, b in groups
            ],
        )
    members, active = _active_rings(topology, groups)
    if not active:
        return 0.0
    return (members - 1) * _ring_step_s(topology, [(g, float(b)) for g, b in active])


def all_gather_equivalent_bytes(
    members: int, slices_bytes: int, algorithm: AllReduceAlgorithm
) -> int:
    """The bytes of a dense all-reduce among ``members`` that sends as many bytes as the
    exchange of ``slices_bytes`` per member (module docstring, "Sparse gradients"): a ring
    all-gather sends ``(R - 1) s`` per member where a ring all-reduce of ``B`` sends
    ``2 (R - 1) / R B``, so ``B = R s / 2``; reduce-to-one gathers ``(R - 1) s`` and broadcasts
    ``(R - 1) R s`` where it moves ``2 (R - 1) B``, so ``B = (R + 1) s / 2``."""
    if members < 2 or slices_bytes <= 0:
        return 0
    factor = members if algorithm is AllReduceAlgorithm.RING else members + 1
    return round(factor * slices_bytes / 2)


def _reduce_to_one_loads(
    topology: Topology, groups: Sequence[tuple[Sequence[int], int, int]]
) -> tuple[dict[_Channel, float], dict[_Channel, float], dict[_Channel, tuple[float, float]]]:
    """Per channel, the bytes a reduce-to-one exchange of ``(group, dense, slices)`` carries in
    the gather (member -> root: the dense gradient and the member's slices) and in the broadcast
    (root -> member: the dense sum and the ``R``-fold concatenation of the slices), and each
    channel's (latency, bandwidth)."""
    gather: dict[_Channel, float] = {}
    scatter: dict[_Channel, float] = {}
    links: dict[_Channel, tuple[float, float]] = {}
    for group, dense, slices in groups:
        root = group[0]
        for member in group[1:]:
            link = topology.link_between(member, root)
            if link is None or dense + slices <= 0:
                continue
            for loads, channel, nbytes in (
                (gather, topology.channel_between(member, root), dense + slices),
                (scatter, topology.channel_between(root, member), dense + len(group) * slices),
            ):
                loads[channel] = loads.get(channel, 0.0) + nbytes
                lat, bw = links.get(channel, (0.0, link.bandwidth_bytes_per_s))
                links[channel] = (max(lat, link.latency_s), min(bw, link.bandwidth_bytes_per_s))
    return gather, scatter, links


def _reduce_to_one_exchange_s(
    topology: Topology, groups: Sequence[tuple[Sequence[int], int, int]]
) -> float:
    """The gather, then the broadcast, each as long as its slowest channel (module docstring)."""
    gather, scatter, links = _reduce_to_one_loads(topology, groups)
    return sum(
        max((links[c][0] + n / links[c][1] for c, n in phase.items()), default=0.0)
        for phase in (gather, scatter)
    )


def concurrent_reduce_to_one_s(
    topology: Topology, groups: Sequence[tuple[Sequence[int], int]]
) -> float:
    """Seconds for reduce-to-one-then-broadcast all-reduces of ``(group, num_bytes)`` at once;
    each group's root is its first device. See the module docstring for the model."""
    fit = _fit_for(topology, AllReduceAlgorithm.REDUCE_TO_ONE)
    if fit is not None:
        return _measured_concurrent_s(fit, groups)
    return _reduce_to_one_exchange_s(topology, [(g, b, 0) for g, b in groups])


def gradient_exchange_s(
    topology: Topology,
    groups: Sequence[tuple[Sequence[int], int, int]],
    algorithm: AllReduceAlgorithm,
    *,
    dense_tensors: int = 0,
) -> float:
    """Seconds for every group of ``(group, dense bytes, slices bytes per member)`` to exchange
    its gradients at once: the dense ones all-reduced, the ``IndexedSlices`` all-gathered, as
    TensorFlow does (module docstring, "Sparse gradients"). ``dense_tensors``: how many dense
    gradient tensors the groups hold in all, which a measured fit prices (0: as measured)."""
    dense = [(g, d) for g, d, _ in groups]
    sparse = [(g, s) for g, _, s in groups]
    fit = _fit_for(topology, algorithm)
    if fit is not None:
        equivalent = [(g, all_gather_equivalent_bytes(len(g), s, algorithm)) for g, s in sparse]
        reduced = _measured_concurrent_s(fit, dense, dense_tensors)
        return reduced + _measured_concurrent_s(fit, equivalent)
    if algorithm is AllReduceAlgorithm.RING:
        return concurrent_all_reduce_s(topology, dense) + concurrent_all_gather_s(topology, sparse)
    return _reduce_to_one_exchange_s(topology, groups)


def all_reduce_s(
    topology: Topology,
    group: Sequence[int],
    num_bytes: int,
    algorithm: AllReduceAlgorithm = AllReduceAlgorithm.RING,
) -> float:
    """Seconds for one all-reduce of ``num_bytes`` among ``group``'s devices."""
    if algorithm is AllReduceAlgorithm.REDUCE_TO_ONE:
        return concurrent_reduce_to_one_s(topology, [(group, num_bytes)])
    return concurrent_all_reduce_s(topology, [(group, num_bytes)])
