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
from partitioner.simulation.opview import op_view
from partitioner.simulation.shared import SHARED, SharedRun, op_orders

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
    per_layer = resolve_layer_devices(costed, layer_device)
    orders = op_orders(costed.topology)
    if any(orders[d] is SHARED for d in set(per_layer)):
        return _shared_step(costed, per_layer, orders, timeline)
    run = _StepRun(costed, per_layer, timeline)
    for i in range(len(costed.graph.ops)):
        end = run.compute(i)
        run.send_outputs(i, end)
    return run.result()


class _StepRun:
    """The state of one simulated step: ops run in graph order on their devices' queues, each
    output sent once to every other device that reads it, over the channel's queue."""

    def __init__(self, costed: CostedGraph, per_layer: Sequence[int], timeline: bool) -> None:
        graph = costed.graph
        lg = graph.layer_graph
        n_ops, n_dev = len(graph.ops), costed.topology.num_devices
        self.graph, self.lg, self.topo = graph, lg, costed.topology
        self.times = costed.op_compute_time_s
        self.timeline = timeline
        view = op_view(graph)
        self.inputs, self.outputs = view.inputs, view.outputs
        self.op_layer = view.op_layer
        self.op_device = tuple([per_layer[k] for k in self.op_layer])
        self.start_s = [0.0] * n_ops
        self.end_s = [0.0] * n_ops
        self.device_free = [0.0] * n_dev
        self.device_busy = [0.0] * n_dev
        self.bytes_sent = [0] * n_dev
        self.bytes_received = [0] * n_dev
        self.channel_free: dict[tuple[str, int, int], float] = {}
        self.link_busy: dict[tuple[int, int], float] = {}
        self.links: dict[tuple[int, int], tuple[Link | None, tuple[str, int, int]]] = {}
        self.events: list[TimelineEvent] = []
        # Per device, the open run of back-to-back ops: (layer, phase, start, end) or None.
        self.runs: list[tuple[int, Phase, float, float] | None] = [None] * n_dev
        self.resource_names: dict[tuple[str, int, int], str] = {}
        # (producer position, output index, destination device) -> arrival time
        self.arrival: dict[tuple[int, int, int], float] = {}
        self.finish = 0.0

    def compute(self, i: int) -> float:
        """Run op ``i`` once its device is free and its inputs are there; its end time."""
        op_device, end_s = self.op_device, self.end_s
        d = op_device[i]
        ready = self.device_free[d]
        for j, output_index in self.inputs[i]:
            t = end_s[j] if op_device[j] == d else self.arrival[(j, output_index, d)]
            if t > ready:
                ready = t
        dur = self.times[d][i]
        end = ready + dur
        self.start_s[i] = ready
        end_s[i] = end
        self.device_free[d] = end
        self.device_busy[d] += dur
        if end > self.finish:
            self.finish = end
        if self.timeline:
            self._extend_run(i, d, ready, end)
        return end

    def _extend_run(self, i: int, d: int, ready: float, end: float) -> None:
        """Merge op ``i`` into its device's open run of back-to-back ops of one layer and phase."""
        phase = self.graph.ops[i].phase
        run = self.runs[d]
        if run is not None and run[0] == self.op_layer[i] and run[1] is phase and run[3] == ready:
            self.runs[d] = (run[0], phase, run[2], end)
            return
        if run is not None:
            self.events.append(_run_event(self.lg.nodes[run[0]].name, d, run))
        self.runs[d] = (self.op_layer[i], phase, ready, end)

    def send_outputs(self, i: int, end: float) -> None:
        """Send each output of op ``i`` once to every other device that reads it (the largest
        size any edge gives the tensor), in first-consumer order."""
        op_device = self.op_device
        d = op_device[i]
        sends: dict[tuple[int, int], int] = {}
        for j, output_index, nbytes in self.outputs[i]:
            dst_dev = op_device[j]
            if dst_dev != d:
                key = (output_index, dst_dev)
                sends[key] = max(sends.get(key, 0), nbytes)
        if not sends:
            return
        for (out_index, dst_dev), nbytes in sends.items():
            self._transfer(i, out_index, d, dst_dev, nbytes, end)

    def _transfer(self, i: int, out_index: int, d: int, dst: int, nbytes: int, end: float) -> None:
        pair = (d, dst)
        if pair not in self.links:
            self.links[pair] = (self.topo.link_between(d, dst), self.topo.channel_between(d, dst))
        link, channel = self.links[pair]
        xfer = link.transfer_time_s(nbytes) if link is not None else 0.0
        t0 = max(self.channel_free.get(channel, 0.0), end)
        t1 = t0 + xfer
        self.channel_free[channel] = t1
        self.link_busy[pair] = self.link_busy.get(pair, 0.0) + xfer
        self.bytes_sent[d] += nbytes
        self.bytes_received[dst] += nbytes
        self.arrival[(i, out_index, dst)] = t1
        if self.timeline and nbytes > 0:
            name = self.resource_names.get(channel)
            if name is None:
                name = self.resource_names[channel] = channel_resource(self.topo, d, dst)
            what = f"{self.graph.ops[i].id}:{out_index}"
            self.events.append(TimelineEvent(name, EventKind.TRANSFER, what, t0, t1))

    def result(self) -> StepSimulation:
        events = self.events
        if self.timeline:
            for d, run in enumerate(self.runs):
                if run is not None:
                    events.append(_run_event(self.lg.nodes[run[0]].name, d, run))
            events.sort(key=lambda ev: (ev.start_s, ev.resource, ev.end_s))
        return _simulation(self, self.op_device, tuple(events))


def _shared_step(
    costed: CostedGraph, per_layer: Sequence[int], orders: Sequence[bool], timeline: bool
) -> StepSimulation:
    """:func:`simulate_step` when a used device runs its ready ops side by side
    (:mod:`partitioner.simulation.shared`)."""
    view = op_view(costed.graph)
    op_device = tuple([per_layer[k] for k in view.op_layer])
    run = SharedRun(costed, op_device, view.inputs, view.outputs, orders)
    run.run()
    events = _shared_timeline(costed, run, view.op_layer) if timeline else ()
    return _simulation(run, op_device, events)


def _simulation(
    run: _StepRun | SharedRun, op_device: tuple[int, ...], events: tuple[TimelineEvent, ...]
) -> StepSimulation:
    """The result of either run: its fields as the frozen record."""
    step = run.finish
    return StepSimulation(
        step_time_s=step,
        device_busy_s=tuple(run.device_busy),
        device_idle_s=tuple(max(0.0, step - b) for b in run.device_busy),
        link_busy_s=tuple(sorted(run.link_busy.items())),
        bytes_sent=tuple(run.bytes_sent),
        bytes_received=tuple(run.bytes_received),
        op_start_s=tuple(run.start_s),
        op_end_s=tuple(run.end_s),
        op_device=op_device,
        timeline=events,
    )


def _shared_timeline(
    costed: CostedGraph, run: SharedRun, op_layer: Sequence[int]
) -> tuple[TimelineEvent, ...]:
    """The coarse timeline of a shared-time step: per device, ops of one layer and phase whose
    spans touch or overlap merged into one event (events of a device may overlap: its ops ran
    side by side); one event per transfer of a non-empty tensor."""
    graph, topo = costed.graph, costed.topology
    events: list[TimelineEvent] = []
    order = sorted(range(len(graph.ops)), key=lambda i: (run.op_device[i], run.start_s[i], i))
    open_run: tuple[int, int, Phase, float, float] | None = None
    for i in order:
        key = (run.op_device[i], op_layer[i], graph.ops[i].phase)
        if open_run is not None and open_run[:3] == key and run.start_s[i] <= open_run[4]:
            open_run = (*key, open_run[3], max(open_run[4], run.end_s[i]))
            continue
        if open_run is not None:
            events.append(_open_event(costed, open_run))
        open_run = (*key, run.start_s[i], run.end_s[i])
    if open_run is not None:
        events.append(_open_event(costed, open_run))
    for i, out_index, src, dst, nbytes, t0, t1 in run.transfers:
        if nbytes > 0:
            what = f"{graph.ops[i].id}:{out_index}"
            resource = channel_resource(topo, src, dst)
            events.append(TimelineEvent(resource, EventKind.TRANSFER, what, t0, t1))
    events.sort(key=lambda ev: (ev.start_s, ev.resource, ev.end_s))
    return tuple(events)


def _open_event(
    costed: CostedGraph, open_run: tuple[int, int, Phase, float, float]
) -> TimelineEvent:
    device, layer, phase, start, end = open_run
    return _run_event(
        costed.graph.layer_graph.nodes[layer].name, device, (layer, phase, start, end)
    )


def _run_event(layer: str, device: int, run: tuple[int, Phase, float, float]) -> TimelineEvent:
    kind = EventKind.FORWARD if run[1] is Phase.FORWARD else EventKind.BACKWARD
    return TimelineEvent(device_resource(device), kind, layer, run[2], run[3])
