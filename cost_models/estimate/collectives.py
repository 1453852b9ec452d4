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

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from cost_models.devices.catalog import catalog
from partitioner.core.errors import PlanError
from partitioner.core.ir import AllReduceFit, Link, Topology

__all__ = [
    "AllReduceAlgorithm",
    "all_reduce_s",
    "concurrent_all_reduce_s",
    "concurrent_reduce_to_one_s",
    "measured_all_reduce_s",
    "ring_bandwidth_bytes_per_s",
    "ring_order",
]


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


def measured_all_reduce_s(fit: AllReduceFit, members: int, num_bytes: float) -> float:
    """Seconds of an all-reduce of ``num_bytes`` among ``members`` devices by a measured fit,
    scaled from the fit's group size as a ring (see the module docstring)."""
    if members < 2 or num_bytes <= 0:
        return 0.0
    m = fit.members
    latency_scale = (members - 1) / (m - 1)
    bytes_scale = ((members - 1) / members) / ((m - 1) / m)
    return fit.latency_s * latency_scale + num_bytes * bytes_scale / fit.bandwidth_bytes_per_s


def _measured_concurrent_s(fit: AllReduceFit, groups: Sequence[tuple[Sequence[int], int]]) -> float:
    """All-reduces at the same time by the measured fit: their bytes add (module docstring)."""
    active = [(len(g), b) for g, b in groups if len(g) > 1 and b > 0]
    if not active:
        return 0.0
    return measured_all_reduce_s(fit, max(n for n, _ in active), sum(b for _, b in active))


def ring_bandwidth_bytes_per_s(link: Link) -> float:
    """The bandwidth a ring all-reduce achieves over ``link``: its bandwidth times its kind's
    bus-bandwidth efficiency from the catalog (see the module docstring)."""
    return link.bandwidth_bytes_per_s * catalog().ring_efficiency(link.kind)


def ring_order(topology: Topology, group: Sequence[int]) -> tuple[int, ...]:
    """``group``'s devices in ring order: host by host, so the ring crosses each host once."""
    return tuple(sorted(group, key=lambda d: (topology.devices[d].host, d)))


def concurrent_all_reduce_s(
    topology: Topology, rings: Sequence[tuple[Sequence[int], int]]
) -> float:
    """Seconds for ring all-reduces of ``(group, num_bytes)`` running at the same time.

    Every ring has the same number of members (replicas); a ring of one device, or of no bytes,
    costs nothing. See the module docstring for the model."""
    fit = _fit_for(topology, AllReduceAlgorithm.RING)
    if fit is not None:
        return _measured_concurrent_s(fit, rings)
    active = [(ring_order(topology, g), b) for g, b in rings if len(g) > 1 and b > 0]
    if not active:
        return 0.0
    sizes = {len(g) for g, _ in active}
    if len(sizes) != 1:
        raise PlanError(f"rings of different sizes {sorted(sizes)} cannot step together")
    members = sizes.pop()
    load: dict[tuple[str, int, int], float] = {}
    latency: dict[tuple[str, int, int], float] = {}
    bandwidth: dict[tuple[str, int, int], float] = {}
    for group, num_bytes in active:
        chunk = num_bytes / members
        for i, src in enumerate(group):
            dst = group[(i + 1) % members]
            link = topology.link_between(src, dst)
            if link is None:  # pragma: no cover - a ring's members are distinct devices
                continue
            channel = topology.channel_between(src, dst)
            load[channel] = load.get(channel, 0.0) + chunk
            latency[channel] = max(latency.get(channel, 0.0), link.latency_s)
            ring_bw = ring_bandwidth_bytes_per_s(link)
            bandwidth[channel] = min(bandwidth.get(channel, ring_bw), ring_bw)
    step_s = max(latency[c] + load[c] / bandwidth[c] for c in load)
    return 2 * (members - 1) * step_s


def concurrent_reduce_to_one_s(
    topology: Topology, groups: Sequence[tuple[Sequence[int], int]]
) -> float:
    """Seconds for reduce-to-one-then-broadcast all-reduces of ``(group, num_bytes)`` at once;
    each group's root is its first device. See the module docstring for the model."""
    fit = _fit_for(topology, AllReduceAlgorithm.REDUCE_TO_ONE)
    if fit is not None:
        return _measured_concurrent_s(fit, groups)
    load: dict[tuple[str, int, int], float] = {}
    latency: dict[tuple[str, int, int], float] = {}
    bandwidth: dict[tuple[str, int, int], float] = {}
    for group, num_bytes in groups:
        root = group[0]
        for member in group[1:]:
            link = topology.link_between(member, root)
            if link is None or num_bytes <= 0:
                continue
            channel = topology.channel_between(member, root)
            load[channel] = load.get(channel, 0.0) + num_bytes
            latency[channel] = max(latency.get(channel, 0.0), link.latency_s)
            bandwidth[channel] = min(
                bandwidth.get(channel, link.bandwidth_bytes_per_s), link.bandwidth_bytes_per_s
            )
    if not load:
        return 0.0
    return 2 * max(latency[c] + load[c] / bandwidth[c] for c in load)


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
