"""Discrete-event simulation of one training step at op level.

Model (in-order list scheduling):

* op ``i`` runs on the device of its effective owner layer
  (``graph.layer_graph.op_owner[op.id]``) and takes ``op_compute_time_s[device][i]``;
* ops are dispatched in graph (topological) order; each device runs one op at a time, in that
  order (an in-order queue per device);
* ``start(i) = max(free time of its device, arrival of every input on its device)`` and
  ``end(i) = start(i) + time(i)``;
* a tensor produced on device ``a`` and read on device ``b != a`` is sent once per destination
  device as soon as its producer ends, over the link ``a -> b``, and takes
  ``link.transfer_time_s(bytes)``; transfers that share a channel
  (:meth:`~partitioner.core.ir.Topology.channel_between`: each directed device pair within a host,
  all traffic from one host to another across hosts) are serialised in dispatch (op) order, one
  FIFO queue per channel; later consumers on ``b`` reuse the copy.

The step time is the latest op end (or transfer arrival). One pass over ops and edges: O(V + E).

With ``timeline=True`` the result also carries a coarse timeline for a Gantt chart: one
:class:`~partitioner.core.ir.TimelineEvent` per run of back-to-back ops of one layer and phase on a
device (a run ends at the first idle gap or at another layer's op) and one per transfer of a
non-empty tensor, on the resource strings of :func:`channel_resource`. Still O(V + E), plus
sorting the events.

Pipelined schedules (micro-batches, GPipe, 1F1B) are simulated at stage level by
:mod:`partitioner.simulation.pipeline`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from partitioner.core.errors import PlanError
from partitioner.core.ir import CostedGraph, EventKind, Link, Phase, TimelineEvent, Topology

__all__ = [
    "StepSimulation",
    "channel_resource",
    "device_resource",
    "resolve_layer_devices",
    "simulate_step",
]


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
    timeline: tuple[TimelineEvent, ...] = ()
    """The coarse timeline, sorted by start, when asked for (``simulate_step(..., timeline=True)``)."""

    @property
    def link_busy_map(self) -> Mapping[tuple[int, int], float]:
        """:attr:`link_busy_s` as a read-only mapping."""
        return MappingProxyType(dict(self.link_busy_s))


def device_resource(device: int) -> str:
    """The timeline resource name of a device's compute queue: ``"device 0"``."""
    return f"device {device}"


def channel_resource(topology: Topology, src: int, dst: int) -> str:
    """The timeline resource name of the channel a transfer ``src -> dst`` queues on.

    ``"link 0->1"`` for a point-to-point channel between two devices, ``"hosts 0->1"`` for the
    channel shared by all traffic from one host to another.
    """
    kind, a, b = topology.channel_between(src, dst)
    return f"hosts {a}->{b}" if kind == "host" else f"link {a}->{b}"


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
    costed: CostedGraph,
    layer_device: Mapping[str, int] | Sequence[int],
    *,
    timeline: bool = False,
) -> StepSimulation:
    """Simulate one training step of ``costed`` under the layer placement ``layer_device``.

    ``timeline=True`` also records the coarse timeline (see the module docstring).
    """
    graph = costed.graph
    lg = graph.layer_graph
    topo = costed.topology
    n_dev = topo.num_devices
    per_layer = resolve_layer_devices(costed, layer_device)
    op_layer = tuple(lg.index[lg.op_owner[op.id]] for op in graph.ops)
    op_device = tuple(per_layer[k] for k in op_layer)

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
    channel_free: dict[tuple[str, int, int], float] = {}
    link_busy: dict[tuple[int, int], float] = {}
    links: dict[tuple[int, int], tuple[Link | None, tuple[str, int, int]]] = {}
    events: list[TimelineEvent] = []
    # Per device, the open run of back-to-back ops: [layer, phase, start, end] or None.
    runs: list[tuple[int, Phase, float, float] | None] = [None] * n_dev
    resource_names: dict[tuple[str, int, int], str] = {}
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
        if timeline:
            phase = graph.ops[i].phase
            run = runs[d]
            if run is not None and run[0] == op_layer[i] and run[1] is phase and run[3] == ready:
                runs[d] = (run[0], phase, run[2], end)
            else:
                if run is not None:
                    events.append(_run_event(lg.nodes[run[0]].name, d, run))
                runs[d] = (op_layer[i], phase, ready, end)
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
                links[pair] = (topo.link_between(d, dst_dev), topo.channel_between(d, dst_dev))
            link, channel = links[pair]
            xfer = link.transfer_time_s(nbytes) if link is not None else 0.0
            t0 = max(channel_free.get(channel, 0.0), end)
            t1 = t0 + xfer
            channel_free[channel] = t1
            link_busy[pair] = link_busy.get(pair, 0.0) + xfer
            bytes_sent[d] += nbytes
            bytes_received[dst_dev] += nbytes
            arrival[(i, out_index, dst_dev)] = t1
            if timeline and nbytes > 0:
                name = resource_names.get(channel)
                if name is None:
                    name = resource_names[channel] = channel_resource(topo, d, dst_dev)
                events.append(
                    TimelineEvent(
                        name, EventKind.TRANSFER, f"{graph.ops[i].id}:{out_index}", t0, t1
                    )
                )

    if timeline:
        for d, run in enumerate(runs):
            if run is not None:
                events.append(_run_event(lg.nodes[run[0]].name, d, run))
        events.sort(key=lambda ev: (ev.start_s, ev.resource, ev.end_s))
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
        timeline=tuple(events),
    )


def _run_event(layer: str, device: int, run: tuple[int, Phase, float, float]) -> TimelineEvent:
    kind = EventKind.FORWARD if run[1] is Phase.FORWARD else EventKind.BACKWARD
    return TimelineEvent(device_resource(device), kind, layer, run[2], run[3])
