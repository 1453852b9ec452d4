"""One training step on devices that run their ready ops side by side (a CPU's inter-op threads).

TensorFlow's executor hands every op whose inputs are ready to the device's inter-op thread
pool. On a GPU the kernels then queue on one stream, in order, which
:mod:`partitioner.simulation.step`'s in-order queue models. On a CPU they run at once and share
its cores: two ready ops of 10 ms each both end at 20 ms, not one at 10 and one at 20. Which op
ends first decides when a tensor leaves for another device: a layer's input gradient (sent to the
previous layer's device) and its weight gradient become ready together, so on a CPU the input
gradient leaves only when both are done, and a plain split gains nothing from the next device
working meanwhile. Measured on two one-core ``partition worker`` processes (issue 33): a wide MLP
split layer by layer across them, simulated in order at 0.45 s, ran at 0.54 s, the sum of the two
workers' compute and the transfers, as this model predicts.

Model (processor sharing; Kleinrock, *Queueing Systems* vol. 2, 1976, sec. 4.4):

* a device whose op order is :data:`SHARED` splits its time equally among its running ops: with
  ``k`` ops running, each advances at ``1/k`` of its own speed (``op_compute_time_s`` is an op's
  time alone on the device). An op starts when its last input is there;
* an :data:`IN_ORDER` device (a GPU stream) runs one op at a time in graph order, as in
  :mod:`partitioner.simulation.step`;
* a tensor read on another device is sent once per destination when its producer ends; transfers
  that share a channel queue in the order their producers end (ties: graph order);
* while another device computes too, a :data:`SHARED` device runs slower by its measured factor
  of computing at once (:meth:`~partitioner.core.ir.CostedGraph.concurrent_factor` of the ops
  placed on it: cores of one machine share its memory bus; 1 unless ``partition calibrate``
  measured it). A multi-tower model split tower by tower over two one-core loopback workers
  computes on both at once for most of its step.

Event-driven: ``O((V + E) log V)`` per step. The per-device clock of processor sharing is the
work each running op has received (``virtual_s``): an op admitted at ``virtual_s = v`` ends when
the clock reaches ``v + time``, so no running op needs updating when another starts or ends.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from cost_models.devices.catalog import DeviceKind, get_device_type
from partitioner.core.errors import UnknownDeviceError
from partitioner.core.ir import CostedGraph, Link, Topology

__all__ = ["IN_ORDER", "SHARED", "SharedRun", "op_orders"]

IN_ORDER = False
"""A device that runs one op at a time, in graph order (a GPU stream)."""
SHARED = True
"""A device that runs its ready ops side by side, sharing its time (a CPU)."""

_EPS_S = 1e-12
# Event kinds, in the order events of one instant are handled.
_ARRIVAL, _DONE, _CHECK = 0, 1, 2


def _together_factors(
    costed: CostedGraph, op_device: Sequence[int], orders: Sequence[bool]
) -> dict[int, float]:
    """Per :data:`SHARED` device with ops, its factor of computing at once (over the ops
    placed on it) where that factor is above 1; empty when nothing slows."""
    placed: dict[int, list[int]] = {}
    for i, d in enumerate(op_device):
        placed.setdefault(d, []).append(i)
    if len(placed) < 2:
        return {}
    factors = {
        d: costed.concurrent_factor(d, ops) for d, ops in placed.items() if orders[d] is SHARED
    }
    return {d: f for d, f in factors.items() if f > 1.0}


def op_orders(topology: Topology) -> tuple[bool, ...]:
    """Per device, :data:`SHARED` for a CPU of the catalog, else :data:`IN_ORDER` (a GPU, or a
    device type the catalog does not know)."""
    kinds = {}
    for name in {d.device_type for d in topology.devices}:
        try:
            kinds[name] = get_device_type(name).kind is DeviceKind.CPU
        except UnknownDeviceError:
            kinds[name] = IN_ORDER
    return tuple(kinds[d.device_type] for d in topology.devices)


@dataclass
class _Shared:
    """A processor-sharing device: its clock of work per running op, and its running ops."""

    virtual_s: float = 0.0
    updated_s: float = 0.0
    running: list[tuple[float, int]] = field(default_factory=list)
    version: int = 0
    slow: float = 1.0
    """How much slower than alone it runs now (another device computing at once)."""

    def advance(self, now_s: float) -> None:
        if self.running:
            self.virtual_s += (now_s - self.updated_s) / (len(self.running) * self.slow)
        self.updated_s = now_s

    def next_end_s(self) -> float:
        remaining = self.running[0][0] - self.virtual_s
        return self.updated_s + remaining * len(self.running) * self.slow


class SharedRun:
    """One simulated step with :data:`SHARED` devices; :meth:`run` fills ``start_s``/``end_s``,
    the arrivals, the byte counts and the link busy times (the fields ``step``'s result reads)."""

    def __init__(
        self,
        costed: CostedGraph,
        op_device: Sequence[int],
        inputs: Sequence[Sequence[tuple[int, int]]],
        outputs: Sequence[Sequence[tuple[int, int, int]]],
        orders: Sequence[bool],
    ) -> None:
        n_ops, n_dev = len(op_device), costed.topology.num_devices
        self.topo, self.times = costed.topology, costed.op_compute_time_s
        self.op_device, self.inputs, self.outputs, self.orders = op_device, inputs, outputs, orders
        self.start_s = [0.0] * n_ops
        self.end_s = [0.0] * n_ops
        self.device_busy = [0.0] * n_dev
        self.bytes_sent = [0] * n_dev
        self.bytes_received = [0] * n_dev
        self.link_busy: dict[tuple[int, int], float] = {}
        self.transfers: list[tuple[int, int, int, int, int, float, float]] = []
        """``(op, output index, source, destination, bytes, start_s, end_s)`` of each transfer."""
        self.finish = 0.0
        self._channel_free: dict[tuple[str, int, int], float] = {}
        self._links: dict[tuple[int, int], tuple[Link | None, tuple[str, int, int]]] = {}
        self._events: list[tuple[float, int, int, int, int]] = []
        self._shared = [_Shared() for _ in range(n_dev)]
        self._queue: list[list[int]] = [[] for _ in range(n_dev)]
        self._head = [0] * n_dev
        self._idle_at = [0.0] * n_dev
        self._busy = [False] * n_dev
        self._ready = [False] * n_ops
        self._waiting = [len(edges) for edges in inputs]
        self._together = _together_factors(costed, op_device, orders)

    def run(self) -> None:
        """Simulate to the end of the step."""
        for i, d in enumerate(self.op_device):
            if self.orders[d] is IN_ORDER:
                self._queue[d].append(i)
        for i, waiting in enumerate(self._waiting):
            if waiting == 0:
                self._on_ready(i, 0.0)
        self._busy_changed(0.0)
        while self._events:
            t, kind, _, a, b = heapq.heappop(self._events)
            if kind == _ARRIVAL:
                self._input_there(a, t)
            elif kind == _DONE:
                self._busy[b] = False
                self._ended(a, t)
                self._start_next(b, t)
            else:
                self._check(a, b, t)
            self._busy_changed(t)

    def _push(self, t: float, kind: int, a: int, b: int) -> None:
        heapq.heappush(self._events, (t, kind, a if kind != _CHECK else -1, a, b))

    def _input_there(self, i: int, t: float) -> None:
        self._waiting[i] -= 1
        if self._waiting[i] == 0:
            self._on_ready(i, t)

    def _on_ready(self, i: int, t: float) -> None:
        d = self.op_device[i]
        self._ready[i] = True
        if self.orders[d] is IN_ORDER:
            self._start_next(d, t)
            return
        dev = self._shared[d]
        dev.advance(t)
        self.start_s[i] = t
        self.device_busy[d] += self.times[d][i]
        heapq.heappush(dev.running, (dev.virtual_s + self.times[d][i], i))
        self._reschedule(d)

    def _busy_changed(self, t: float) -> None:
        """After a device started or stopped computing: each :data:`SHARED` device runs at its
        factor of computing at once while another device computes, else alone."""
        if not self._together:
            return
        busy = [bool(dev.running) or self._busy[d] for d, dev in enumerate(self._shared)]
        computing = sum(busy)
        for d, factor in self._together.items():
            dev = self._shared[d]
            slow = factor if computing - busy[d] > 0 else 1.0
            if slow != dev.slow:
                dev.advance(t)
                dev.slow = slow
                self._reschedule(d)

    def _reschedule(self, d: int) -> None:
        dev = self._shared[d]
        dev.version += 1
        if dev.running:
            self._push(dev.next_end_s(), _CHECK, d, dev.version)

    def _check(self, d: int, version: int, t: float) -> None:
        dev = self._shared[d]
        if version != dev.version:
            return
        dev.advance(t)
        done = []
        while dev.running and dev.next_end_s() <= t + _EPS_S:
            done.append(heapq.heappop(dev.running)[1])
        for i in sorted(done):
            self._ended(i, t)
        self._reschedule(d)

    def _start_next(self, d: int, t: float) -> None:
        """An in-order device starts its next op in graph order once that op is ready."""
        queue, head = self._queue[d], self._head[d]
        if self._busy[d] or head >= len(queue) or not self._ready[queue[head]]:
            return
        i = queue[head]
        self._head[d] = head + 1
        start = max(t, self._idle_at[d])
        end = start + self.times[d][i]
        self.start_s[i] = start
        self.device_busy[d] += self.times[d][i]
        self._busy[d] = True
        self._idle_at[d] = end
        self._push(end, _DONE, i, d)

    def _ended(self, i: int, t: float) -> None:
        """Op ``i`` ended at ``t``: same-device readers get its outputs, others are sent."""
        self.end_s[i] = t
        self.finish = max(self.finish, t)
        d = self.op_device[i]
        sends: dict[tuple[int, int], tuple[int, list[int]]] = {}
        for j, out_index, nbytes in self.outputs[i]:
            dst = self.op_device[j]
            if dst == d:
                self._input_there(j, t)
                continue
            size, readers = sends.get((out_index, dst), (0, []))
            sends[(out_index, dst)] = (max(size, nbytes), [*readers, j])
        for (out_index, dst), (nbytes, readers) in sends.items():
            arrival = self._transfer(i, out_index, d, dst, nbytes, t)
            for j in readers:
                self._push(arrival, _ARRIVAL, j, 0)

    def _transfer(self, i: int, out_index: int, d: int, dst: int, nbytes: int, t: float) -> float:
        pair = (d, dst)
        if pair not in self._links:
            self._links[pair] = (self.topo.link_between(d, dst), self.topo.channel_between(d, dst))
        link, channel = self._links[pair]
        xfer = link.transfer_time_s(nbytes) if link is not None else 0.0
        t0 = max(self._channel_free.get(channel, 0.0), t)
        t1 = t0 + xfer
        self._channel_free[channel] = t1
        self.link_busy[pair] = self.link_busy.get(pair, 0.0) + xfer
        self.bytes_sent[d] += nbytes
        self.bytes_received[dst] += nbytes
        self.finish = max(self.finish, t1)
        self.transfers.append((i, out_index, d, dst, nbytes, t0, t1))
        return t1
