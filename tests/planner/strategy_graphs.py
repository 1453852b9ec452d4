"""Small costed chains for the strategy planner's tests: whole-batch op times that scale with the
batch, per-layer weights (gradients) and activations, on a topology of identical devices."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    Topology,
)

# 0.25 s + bytes / 100 B/s.
SLOW_LINK = Link("slow", latency_s=0.25, bandwidth_bytes_per_s=100.0)
FAST_LINK = Link("fast", latency_s=0.0, bandwidth_bytes_per_s=1e12)


def uniform_topology(
    n_dev: int, link: Link, memory_bytes: int = 1 << 40, hosts: int = 1, device_type: str = "h100"
) -> Topology:
    per_host = n_dev // hosts
    devices = tuple(Device(d, device_type, memory_bytes, host=d // per_host) for d in range(n_dev))
    inter = link if hosts > 1 else None
    return Topology(devices, link, inter_host_link=inter)


def chain_at(
    batch_size: int,
    *,
    full_batch: int,
    fwd_s: Sequence[float],
    weight_bytes: Sequence[int],
    act_bytes: int,
    topology: Topology,
) -> CostedGraph:
    """A chain L0..L{K-1} costed at ``batch_size`` samples: one forward op (``fwd_s`` at
    ``full_batch``) and one backward op (twice the forward) per layer, times and activations
    scaling with the batch; layer k holds ``weight_bytes[k]`` of weights (and as many gradient
    bytes); ``act_bytes`` (at ``full_batch``) flow between neighbours."""
    scale = batch_size / full_batch
    k = len(fwd_s)
    names = [f"L{i}" for i in range(k)]
    ops = [Op(f"{n}/f", "X", n, Phase.FORWARD) for n in names]
    ops += [Op(f"{n}/b", "X", n, Phase.BACKWARD) for n in reversed(names)]
    act = int(act_bytes * scale)
    edges = [Edge(f"L{i}/f", f"L{i + 1}/f", act) for i in range(k - 1)]
    edges += [Edge(f"L{i + 1}/b", f"L{i}/b", act) for i in range(k - 1)]
    edges += [Edge(f"L{i}/f", f"L{i}/b", 8) for i in range(k)]
    layers = tuple(LayerInfo(n, "Dense") for n in names)
    graph = Graph("chain", tuple(ops), tuple(edges), layers, batch_size)
    times = tuple(t * scale for t in fwd_s) + tuple(2 * t * scale for t in reversed(fwd_s))
    memory = tuple(
        LayerMemory(n, weight_bytes[i], weight_bytes[i], 0, act) for i, n in enumerate(names)
    )
    rows = tuple(times for _ in range(topology.num_devices))
    return CostedGraph(graph, topology, rows, memory)


def chain_costs(full_batch: int, **kwargs: object) -> Callable[[int], CostedGraph]:
    """``costed_at`` for the planner: the chain costed at any per-replica batch."""

    def costed_at(batch_size: int) -> CostedGraph:
        return chain_at(batch_size, full_batch=full_batch, **kwargs)  # type: ignore[arg-type]

    return costed_at
