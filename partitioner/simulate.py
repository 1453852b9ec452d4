"""Discrete-event simulation of one training step at op level.

Model (in-order list scheduling):

* op ``i`` runs on the device of its effective owner layer
  (``graph.layer_graph.op_owner[op.id]``) and takes ``op_compute_time_s[device][i]``;
* ops are dispatched in graph (topological) order; each device runs one op at a time, in that
  order (an in-order queue per device);
* ``start(i) = max(free time of its device, arrival of every input on its device)`` and
  ``end(i) = start(i) + time(i)``;
* a tensor produced on device ``a`` and read on device ``b != a`` is sent once per destination
  device as soon as its producer ends, over the link ``a -> b``; transfers on the same directed
  pair are serialised in producer order (one FIFO queue per directed link) and take
  ``link.transfer_time_s(bytes)``; later consumers on ``b`` reuse the copy.

The step time is the latest op end (or transfer arrival). One pass over ops and edges: O(V + E).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from partitioner.errors import PlanError
from partitioner.ir import CostedGraph, Link

__all__ = ["StepSimulation", "resolve_layer_devices", "simulate_step"]


@dataclass(frozen=True)
class StepSimulation:
    """The simulated schedule of one training step; per-op tuples follow the graph's op order."""

    step_time_s: float
    device_busy_s: tuple[float, ...]
    device_idle_s: tuple[float, ...]
    link_busy_s: tuple[tuple[tuple[int, int], float], ...]
    """``((src, dst), seconds)`` for every directed device pair that carried traffic, sorted."""
    bytes_sent: tuple[int, ...]
    bytes_received: tuple[int, ...]
    op_start_s: tuple[float, ...]
    op_end_s: tuple[float, ...]
    op_device: tuple[int, ...] = ()

    @property
    def link_busy_map(self) -> Mapping[tuple[int, int], float]:
        """:attr:`link_busy_s` as a read-only mapping."""
        return MappingProxyType(dict(self.link_busy_s))


def resolve_layer_devices(
    costed: CostedGraph, layer_device: Mapping[str, int] | Sequence[int]
) -> tuple[int, ...]:
    """The device of every layer (layer order), from a name->device mapping or a sequence."""
    layers = costed.graph.layer_graph.nodes
    n_dev = costed.topology.num_devices
    if isinstance(layer_device, Mapping):
        missing = [n.name for n in layers if n.name not in layer_device]
        if missing:
            raise PlanError(f"placement names no device for layers {missing[:5]}")
        devices = tuple(int(layer_device[n.name]) for n in layers)
    else:
        devices = tuple(int(d) for d in layer_device)
        if len(devices) != len(layers):
            raise PlanError(
                f"placement has {len(devices)} devices for the {len(layers)} layers of the model"
            )
    for node, d in zip(layers, devices, strict=True):
        if not 0 <= d < n_dev:
            raise PlanError(
                f"layer {node.name!r} placed on device {d}; the topology has devices 0..{n_dev - 1}"
            )
    return devices


def simulate_step(
    costed: CostedGraph, layer_device: Mapping[str, int] | Sequence[int]
) -> StepSimulation:
    """Simulate one training step of ``costed`` under the layer placement ``layer_device``."""
    graph = costed.graph
    lg = graph.layer_graph
    topo = costed.topology
    n_dev = topo.num_devices
    per_layer = resolve_layer_devices(costed, layer_device)
    op_device = tuple(per_layer[lg.index[lg.op_owner[op.id]]] for op in graph.ops)

    op_index = graph.op_index
    in_edges = graph.in_edges
    out_edges = graph.out_edges
    times = costed.op_compute_time_s

    n_ops = len(graph.ops)
    start_s = [0.0] * n_ops
    end_s = [0.0] * n_ops
    device_free = [0.0] * n_dev
    device_busy = [0.0] * n_dev
    bytes_sent = [0] * n_dev
    bytes_received = [0] * n_dev
    link_free: dict[tuple[int, int], float] = {}
    link_busy: dict[tuple[int, int], float] = {}
    links: dict[tuple[int, int], Link | None] = {}
    # (producer position, output index, destination device) -> arrival time
    arrival: dict[tuple[int, int, int], float] = {}
    finish = 0.0

    for i in range(n_ops):
        d = op_device[i]
        ready = device_free[d]
        for e in in_edges[i]:
            j = op_index[e.src]
            if op_device[j] == d:
                t = end_s[j]
            else:
                t = arrival[(j, e.output_index, d)]
            if t > ready:
                ready = t
        dur = times[d][i]
        end = ready + dur
        start_s[i] = ready
        end_s[i] = end
        device_free[d] = end
        device_busy[d] += dur
        if end > finish:
            finish = end
        # Send each output once to every other device that reads it (the largest size any
        # edge gives the tensor), in first-consumer order.
        sends: dict[tuple[int, int], int] = {}
        for e in out_edges[i]:
            dst_dev = op_device[op_index[e.dst]]
            if dst_dev != d:
                key2 = (e.output_index, dst_dev)
                sends[key2] = max(sends.get(key2, 0), e.bytes)
        for (out_index, dst_dev), nbytes in sends.items():
            pair = (d, dst_dev)
            if pair not in links:
                links[pair] = topo.link_between(d, dst_dev)
            link = links[pair]
            xfer = link.transfer_time_s(nbytes) if link is not None else 0.0
            t0 = max(link_free.get(pair, 0.0), end)
            t1 = t0 + xfer
            link_free[pair] = t1
            link_busy[pair] = link_busy.get(pair, 0.0) + xfer
            bytes_sent[d] += nbytes
            bytes_received[dst_dev] += nbytes
            arrival[(i, out_index, dst_dev)] = t1

    step = finish
    return StepSimulation(
        step_time_s=step,
        device_busy_s=tuple(device_busy),
        device_idle_s=tuple(max(0.0, step - b) for b in device_busy),
        link_busy_s=tuple(sorted(link_busy.items())),
        bytes_sent=tuple(bytes_sent),
        bytes_received=tuple(bytes_received),
        op_start_s=tuple(start_s),
        op_end_s=tuple(end_s),
        op_device=op_device,
    )
