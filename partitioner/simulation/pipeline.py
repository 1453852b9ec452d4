"""Discrete-event simulation of one pipelined training step: stages, micro-batches, schedules.

**Stages.** :func:`pipeline_stages` turns a layer placement into pipeline stages: stage ``s`` is
the set of layers on one device. Every op runs on the device of its effective owner layer
(``graph.layer_graph.op_owner``). A cross-device op edge ``u -> v`` (devices ``a != b``) orders
the devices: forward -> forward means ``a`` comes before ``b``, backward -> backward (a gradient
flowing back) means ``b`` comes before ``a``; forward -> backward (an activation re-read by a
gradient op) orders nothing; backward -> forward is not a pipeline and raises
:class:`~partitioner.core.errors.PlanError`. *Fed* ops (:func:`fed_ops`: the model's inputs and
labels, constants, and layer-less glue computed from them alone) order nothing and are never
sent: their values exist before any stage runs, and each stage reads them where it runs, as the
pipelined rewrite (``passes.rewrite.pipeline``) feeds every stage its slice of the model's inputs; the
layer a fed op is merged into for costing is an arbitrary one of its consumers, and must not
order the stages (a model input read by several towers would otherwise chain them). The stage
order is :func:`partitioner.simulation.schedules.order_stages` of these arcs: a topological order,
taking among the available devices the one whose first non-fed op comes first in op order (then:
whose first layer comes first in layer order) -- the order in which the model's call first
reaches the devices, the tie-break the pipelined rewrite uses too (independent branches on
different devices could otherwise be ordered differently by the two, and the rewrite refuses a
plan whose stage order is not its own); for a placement of contiguous layers of a chain, the
order in which devices first appear along the layers. A cycle raises
:class:`~partitioner.core.errors.PlanError`. The stages need not form a chain: a skip edge from
stage 0 to stage 2 is a transfer between those two devices.

Per stage, over the whole batch: the forward time (the sum of its ``Phase.FORWARD`` ops' times
on its device), the backward time (``Phase.BACKWARD`` ops), the static memory (parameters,
gradients and optimizer state of its layers, from ``CostedGraph.layer_memory``), the activation
bytes kept for the backward pass, and its sends: the tensors it produces that another device
reads, each sent once per destination device (the largest size any edge gives it), grouped by
(phase of the producer, destination stage).

**Linear scaling.** With ``M`` micro-batches a micro-batch takes ``1/M`` of every whole-batch
figure: forward and backward times, bytes sent, activation bytes. This is exact for FLOP-bound
ops and optimistic for small micro-batches, where kernels no longer fill the device and
per-transfer latency is paid ``M`` times (it is: every micro-batch's transfer pays the link's
latency).

**Tasks.** For every stage ``s`` and micro-batch ``m``: a forward task ``F(s, m)`` and a
backward task ``B(s, m)`` on the device's compute queue (resource ``"device d"``), and for each
send of ``s`` a transfer task on the channel's queue (``"link a->b"``, or ``"hosts g->h"`` for
a channel shared across hosts, :meth:`~partitioner.core.ir.Topology.channel_between`), which starts
when its producing task ends and feeds the destination stage's forward and/or backward task of
the same micro-batch. ``B(s, m)`` also waits for ``F(s, m)``. Compute and transfers overlap.

**On a measured cluster** (``topology.client_link``: ``partition calibrate``) the client feeds
the batch, and the pipelined rewrite splits it there: every ``F(s, m)`` of a stage that reads
the batch's inputs, and of the last stage (whose loss reads the targets), first receives its
micro-batch's slice over the client's link (``latency + bytes / M / bandwidth``, on the
device's queue: the task's ops wait for it). The stages compute at once once there are
micro-batches, on cores that share a machine's memory bandwidth: with ``M > 1`` and more than
one stage every compute task is stretched by the measured factor of running at once, as for
data-parallel replicas: ``topology.concurrent_factor`` of the stage's memory-bound share
(:attr:`Stage.memory_share`), and of a share of 1 for the gradient sums below. On gpt_tiny
(2 stages over two loopback workers, 8 micro-batches) the tasks' measured busy time was 41.7 ms a micro-batch against the 29.3
simulated without these, and the pipeline was predicted 25% faster than it ran.
Every ``B(s, m)`` but the first the stage runs also adds its weight gradients into the stage's
running sums, as the pipelined rewrite does (:func:`accumulate_time_s`: memory-bound, three
times the gradient bytes over the device's memory bandwidth); with ``M = 1`` nothing is added.

**Schedules** fix the order of each device's compute queue: stage ``s`` of ``K`` runs its
``F`` and ``B`` tasks in the order :func:`partitioner.simulation.schedules.stage_steps` gives,
the one order the pipelined rewrite builds too. ``Schedule.NONE`` runs micro-batches one after
another (gradient accumulation; with ``M = 1`` the plain un-pipelined step, at stage level);
``Schedule.GPIPE`` keeps ``M`` micro-batches of activations alive on every stage, and with ``K``
identical stages and no transfer time its step is ``(M + K - 1)(f + b)``, every stage idling
``(K - 1)/(M + K - 1)`` of it (the bubble); ``Schedule.ONE_F_ONE_B`` keeps at most
``min(M, K - s)`` on stage ``s`` in the same step time.

**Discrete-event core** (:func:`run_tasks`). Tasks with a resource, a duration and
dependencies. A resource with a given order runs its tasks in that order; any other resource
(the link channels) runs its tasks first come, first served by the time they became ready
(ties by task index). A task starts at the latest of: its resource becoming free (its
predecessor in the order ended), and every dependency's end. Events are processed in time order
with a heap: ``O(T log T)`` for ``T`` tasks. A schedule whose orders contradict the
dependencies never finishes, and raises :class:`~partitioner.core.errors.PlanError`.

**Outputs** (:class:`PipelineSimulation`): the step time (the last task's end), the timeline,
per device its busy seconds and its bubble fraction (``1 - busy / step``), per channel its busy
seconds, and per device its peak memory: static bytes plus the per-micro-batch activation bytes
times the most micro-batches whose activations are alive at once, counted from the simulated
order of the device's events (alive from the start of ``F(s, m)`` until the end of ``B(s, m)``).
Buffers for received tensors and the optimizer's update step are not modelled.

Pure Python, no TensorFlow: deriving the stages is one pass over ops and edges, ``O(V + E)``;
the simulation is ``O(K M log(K M))`` in the number of stage tasks.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cost_models.devices.catalog import get_device_type
from partitioner.core.errors import PlanError, UnknownDeviceError, UsageError
from partitioner.core.ir import (
    CostedGraph,
    EventKind,
    Graph,
    Phase,
    Schedule,
    TimelineEvent,
    Topology,
)
from partitioner.simulation.opview import op_view
from partitioner.simulation.schedules import order_stages, stage_steps
from partitioner.simulation.step import channel_resource, device_resource, resolve_layer_devices

__all__ = [
    "PipelineSimulation",
    "SimTask",
    "Stage",
    "StageTransfer",
    "fed_ops",
    "pipeline_stages",
    "run_tasks",
    "simulate_pipeline",
    "simulate_stages",
]


@dataclass(frozen=True)
class StageTransfer:
    """Tensors one stage sends another, per step (whole batch).

    ``phase`` is the phase of the producing ops: ``Phase.FORWARD`` for activations (sent when
    the source stage's forward ends), ``Phase.BACKWARD`` for gradients (sent when its backward
    ends). ``consumers`` names which of the destination stage's tasks read them.
    """

    src_stage: int
    dst_stage: int
    phase: Phase
    batch_bytes: int
    consumers: tuple[Phase, ...]


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: the layers on one device, with whole-batch costs.

    One micro-batch of ``M`` takes ``forward_time_s / M``, ``backward_time_s / M`` and keeps
    ``activation_bytes / M`` alive (the linear-scaling assumption of the module docstring).
    """

    index: int
    device: int
    layers: tuple[str, ...]
    forward_time_s: float
    backward_time_s: float
    static_memory_bytes: int
    """Parameters, gradients and optimizer state of the stage's layers, plus the largest of their
    transients (partial gradients of weight shape: a micro-batch does not shrink them)."""
    activation_bytes: int
    """Forward outputs the backward pass reads, for the whole batch."""
    sends: tuple[StageTransfer, ...] = ()
    accumulate_time_s: float = 0.0
    """Seconds to add one micro-batch's weight gradients into the stage's running sums
    (:func:`accumulate_time_s`); every backward but the first one the stage runs pays it."""
    feed_bytes: int = 0
    """Whole-batch bytes the client feeds this stage: the batch inputs its ops read, and on the
    last stage (where the loss is) the targets. With a measured client link
    (``topology.client_link``) each forward task first receives its micro-batch's slice."""
    memory_share: float = 0.0
    """The part (0..1) of the stage's forward and backward time that is memory traffic
    (:attr:`~partitioner.core.ir.CostedGraph.op_memory_share`), what running at once with the
    other stages costs it (:meth:`~partitioner.core.ir.Topology.concurrent_factor`)."""

    @property
    def forward_send_bytes(self) -> int:
        """Activation bytes this stage sends to later stages per step."""
        return sum(t.batch_bytes for t in self.sends if t.phase is Phase.FORWARD)

    @property
    def backward_send_bytes(self) -> int:
        """Gradient bytes this stage sends to earlier stages per step."""
        return sum(t.batch_bytes for t in self.sends if t.phase is Phase.BACKWARD)


@dataclass(frozen=True)
class SimTask:
    """A task of the discrete-event core: ``duration_s`` on ``resource`` after ``deps`` end."""

    resource: str
    duration_s: float
    deps: tuple[int, ...] = ()
    kind: EventKind = EventKind.FORWARD
    label: str = ""
    microbatch: int = 0


@dataclass(frozen=True)
class PipelineSimulation:
    """The simulated pipelined step.

    Per-device tuples follow the topology's devices (a device with no stage is idle: busy 0,
    bubble 1, memory 0); ``link_busy_s`` is ``(channel resource, seconds)`` for every channel
    that carried a transfer, sorted; ``peak_live_microbatches[s]`` is the most micro-batches
    whose activations stage ``s`` held at once; ``timeline`` is sorted by start time.
    """

    schedule: Schedule
    num_microbatches: int
    stages: tuple[Stage, ...]
    step_time_s: float
    timeline: tuple[TimelineEvent, ...]
    device_busy_s: tuple[float, ...]
    bubble_fraction: tuple[float, ...]
    link_busy_s: tuple[tuple[str, float], ...]
    peak_memory_bytes: tuple[int, ...]
    peak_live_microbatches: tuple[int, ...]

    @property
    def stage_devices(self) -> tuple[int, ...]:
        """The device of each stage, in stage order."""
        return tuple(st.device for st in self.stages)


# -- stages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _OpPlacement:
    """Where every op runs: the device of each layer, and per op its owner layer and device."""

    layer_devices: tuple[int, ...]
    op_layer: tuple[int, ...]
    op_device: tuple[int, ...]
    fed: tuple[bool, ...]
    """Per op: whether it is fed (:func:`fed_ops`)."""


_Arcs = dict[tuple[int, int], tuple[int, int]]
"""Arcs between devices (earlier -> later), each with an example op edge ``(i, j)`` for messages."""

_Tensors = dict[tuple[int, int, int], tuple[int, set[Phase]]]
"""``(producer op, output index, destination device) -> (bytes, consumer phases)``."""


def pipeline_stages(
    costed: CostedGraph, layer_device: Mapping[str, int] | Sequence[int]
) -> tuple[Stage, ...]:
    """The pipeline stages of a placement, in dataflow order (see the module docstring)."""
    graph = costed.graph
    place = _op_placement(costed, layer_device)
    used, first_key = _first_reached(
        place, costed.topology.num_devices, op_view(graph).first_unfed_op
    )
    arcs, tensors = _cross_device_edges(graph, place)
    order = _stage_device_order(used, first_key, arcs, costed)
    stage_of = {d: s for s, d in enumerate(order)}
    fwd_s, bwd_s, memory_s = _phase_times_s(costed, place.op_device)
    sends = _stage_sends(tensors, place, graph, stage_of)
    feeds = _stage_feeds(costed, place, order)
    times = [(fwd_s[d], bwd_s[d], memory_s[d]) for d in order]
    return tuple(
        _make_stage(costed, s, d, place.layer_devices, times[s], sends[s], feeds[s])
        for s, d in enumerate(order)
    )


def _stage_feeds(costed: CostedGraph, place: _OpPlacement, order: Sequence[int]) -> list[int]:
    """Per stage (in ``order``, devices), the whole-batch bytes the client feeds it: every fed
    tensor its ops read (once per device), and the targets on the last stage."""
    view = op_view(costed.graph)
    stage_of = {d: s for s, d in enumerate(order)}
    read: dict[tuple[int, int, int], int] = {}
    for j, ins in enumerate(view.inputs):
        if view.fed[j]:
            continue
        for i, out in ins:
            if view.fed[i] and place.op_device[j] in stage_of:
                nbytes = costed.graph.ops[i].output_bytes
                read[(i, out, place.op_device[j])] = nbytes
    feeds = [0] * len(order)
    for (_, _, d), nbytes in read.items():
        feeds[stage_of[d]] += nbytes
    if feeds:
        feeds[-1] += costed.graph.target_bytes
    return feeds


def _op_placement(
    costed: CostedGraph, layer_device: Mapping[str, int] | Sequence[int]
) -> _OpPlacement:
    """Every op on the device of its effective owner layer (``LayerGraph.op_owner``)."""
    view = op_view(costed.graph)
    per_layer = resolve_layer_devices(costed, layer_device)
    op_device = tuple([per_layer[k] for k in view.op_layer])
    return _OpPlacement(per_layer, view.op_layer, op_device, view.fed)


def _first_reached(
    place: _OpPlacement, n_dev: int, first_unfed_op: Sequence[int]
) -> tuple[list[int], list[tuple[int, int]]]:
    """The devices that hold layers, and every device's tie-break key for the stage order.

    The key is the device's first non-fed op, then its first layer: the order in which the
    model's call reaches the devices, which the pipelined rewrite also breaks ties by.
    """
    n_layers = len(place.layer_devices)
    first_layer = [n_layers] * n_dev
    for k, d in enumerate(place.layer_devices):
        first_layer[d] = min(first_layer[d], k)
    used = [d for d in range(n_dev) if first_layer[d] < n_layers]
    first_op = [len(place.op_device)] * n_dev
    for k, d in enumerate(place.layer_devices):  # a device's first op is its layers' first
        first_op[d] = min(first_op[d], first_unfed_op[k])
    return used, [(first_op[d], first_layer[d]) for d in range(n_dev)]


def _cross_device_edges(graph: Graph, place: _OpPlacement) -> tuple[_Arcs, _Tensors]:
    """The arcs the cross-device op edges put between devices, and the tensors they send.

    Fed ops' edges order nothing and send nothing; a backward op feeding another device's
    forward op raises PlanError.
    """
    arcs: _Arcs = {}
    tensors: _Tensors = {}
    ops, op_dev = graph.ops, place.op_device
    # the other edges join two ops of one layer (one device) or leave a fed op: they send nothing
    for i, j, output_index, nbytes in op_view(graph).cross_layer_edges:
        a, b = op_dev[i], op_dev[j]
        if a == b:
            continue
        pi, pj = ops[i].phase, ops[j].phase
        if pi is Phase.BACKWARD and pj is Phase.FORWARD:
            raise _backward_feeds_forward(graph, place, i, j)
        if pi is Phase.FORWARD and pj is Phase.FORWARD:
            arcs.setdefault((a, b), (i, j))
        elif pi is Phase.BACKWARD and pj is Phase.BACKWARD:
            arcs.setdefault((b, a), (i, j))
        key = (i, output_index, b)
        old = tensors.get(key)
        if old is None:
            tensors[key] = (nbytes, {pj})
        else:
            old[1].add(pj)
            if nbytes > old[0]:
                tensors[key] = (nbytes, old[1])
    return arcs, tensors


def _backward_feeds_forward(graph: Graph, place: _OpPlacement, i: int, j: int) -> PlanError:
    """The error for backward op ``i`` feeding forward op ``j`` on another device."""
    nodes = graph.layer_graph.nodes
    a, b = place.op_device[i], place.op_device[j]
    return PlanError(
        f"backward op {graph.ops[i].id!r} (layer {nodes[place.op_layer[i]].name!r}, device {a}) "
        f"feeds forward op {graph.ops[j].id!r} (layer {nodes[place.op_layer[j]].name!r}, device "
        f"{b}): a pipeline stage's forward cannot wait for another stage's backward; place both "
        "layers on one device"
    )


def _phase_times_s(costed: CostedGraph, op_device: Sequence[int]) -> tuple[list[float], ...]:
    """Per device: the seconds of its forward ops, of its backward ops (whole batch), and the
    memory-bound seconds among both (:attr:`~partitioner.core.ir.CostedGraph.op_memory_share`)."""
    n_dev = costed.topology.num_devices
    fwd_s = [0.0] * n_dev
    bwd_s = [0.0] * n_dev
    memory_s = [0.0] * n_dev
    rows, shares = costed.op_compute_time_s, costed.op_memory_share
    for i, (d, forward) in enumerate(zip(op_device, op_view(costed.graph).forward)):
        if forward:
            fwd_s[d] += rows[d][i]
        else:
            bwd_s[d] += rows[d][i]
        if shares:
            memory_s[d] += rows[d][i] * shares[i]
    return fwd_s, bwd_s, memory_s


def _stage_sends(
    tensors: _Tensors, place: _OpPlacement, graph: Graph, stage_of: Mapping[int, int]
) -> list[list[StageTransfer]]:
    """Per stage, its sends: the tensors grouped by (producer phase, destination stage)."""
    groups: dict[tuple[int, Phase, int], tuple[int, set[Phase]]] = {}
    for (i, _, b), (nbytes, consumers) in tensors.items():
        gkey = (place.op_device[i], graph.ops[i].phase, b)
        old = groups.get(gkey)
        if old is None:
            groups[gkey] = (nbytes, set(consumers))
        else:
            groups[gkey] = (old[0] + nbytes, old[1] | consumers)
    sends: list[list[StageTransfer]] = [[] for _ in stage_of]
    for (a, phase, b), (nbytes, consumers) in groups.items():
        sends[stage_of[a]].append(
            StageTransfer(
                src_stage=stage_of[a],
                dst_stage=stage_of[b],
                phase=phase,
                batch_bytes=nbytes,
                consumers=tuple(p for p in (Phase.FORWARD, Phase.BACKWARD) if p in consumers),
            )
        )
    return sends


def _make_stage(
    costed: CostedGraph,
    index: int,
    device: int,
    layer_devices: Sequence[int],
    times_s: tuple[float, float, float],
    sends: Sequence[StageTransfer],
    feed_bytes: int,
) -> Stage:
    """Stage ``index``: the layers on ``device``, their (forward, backward, memory-bound) times
    and memory."""
    on_d = [k for k, x in enumerate(layer_devices) if x == device]
    mems = [costed.layer_memory[k] for k in on_d]
    nodes = costed.graph.layer_graph.nodes
    return Stage(
        index=index,
        device=device,
        layers=tuple(nodes[k].name for k in on_d),
        forward_time_s=times_s[0],
        backward_time_s=times_s[1],
        static_memory_bytes=sum(m.param_bytes + m.gradient_bytes + m.optimizer_bytes for m in mems)
        + max((m.transient_bytes for m in mems), default=0),
        activation_bytes=sum(m.activation_bytes for m in mems),
        sends=tuple(sorted(sends, key=lambda t: (t.phase is Phase.BACKWARD, t.dst_stage))),
        accumulate_time_s=accumulate_time_s(
            costed.topology.devices[device].device_type, sum(m.gradient_bytes for m in mems)
        ),
        feed_bytes=feed_bytes,
        memory_share=times_s[2] / busy_s if (busy_s := times_s[0] + times_s[1]) > 0 else 0.0,
    )


def accumulate_time_s(device_type: str, gradient_bytes: int) -> float:
    """Seconds to add ``gradient_bytes`` of one micro-batch's gradients into running sums of the
    same size on a ``device_type`` device: memory-bound, ``3 x gradient_bytes`` (read the sum and
    the new gradient, write the sum) over the device's memory bandwidth (the catalog's figure;
    0 for a device type the catalog does not know). The pipelined rewrite does this on every
    stage in every backward but the first one it runs (:mod:`passes.rewrite.pipeline`)."""
    try:
        bandwidth = get_device_type(device_type).memory_bandwidth_bytes_per_s
    except UnknownDeviceError:
        return 0.0
    return 3.0 * gradient_bytes / bandwidth if bandwidth > 0 else 0.0


def fed_ops(graph: Graph) -> tuple[bool, ...]:
    """Per op: whether it is *fed* -- outside every layer and computed from fed ops alone.

    The model's inputs and labels (placeholders with no inputs), constants, and layer-less glue
    computed only from them: their values exist before any stage runs, and each stage reads them
    where it runs (the pipelined rewrite feeds every stage its slice of the model's inputs), so
    they order no stages and are not sent between stages. The layer they are merged into for
    costing (``LayerGraph.op_owner``) may be any of their consumers'.
    """
    return op_view(graph).fed


def _stage_device_order(
    used: list[int],
    first_key: Sequence[tuple[int, int]],
    arcs: Mapping[tuple[int, int], tuple[int, int]],
    costed: CostedGraph,
) -> list[int]:
    """The used devices in stage order, earliest ``first_key`` first; PlanError on a cycle."""
    found = order_stages(used, arcs, key=lambda d: (first_key[d], d))
    if not found.blocked:
        return list(found.order)
    left = sorted(found.blocked)
    a, b = next((a, b) for (a, b) in sorted(arcs) if a in left and b in left)
    i, j = arcs[(a, b)]
    ops = costed.graph.ops
    owner = costed.graph.layer_graph.op_owner
    what = "forward" if ops[j].phase is Phase.FORWARD else "the gradient"
    raise PlanError(
        f"the placement's devices {left} depend on each other in a cycle, e.g. device {a} "
        f"must run before device {b} because op {ops[i].id!r} (layer "
        f"{owner[ops[i].id]!r}) feeds {what} op {ops[j].id!r} (layer {owner[ops[j].id]!r}), and "
        f"device {b} before device {a} elsewhere: a pipeline needs data to flow one way; "
        "keep each device's layers contiguous (partitioner.solvers.stages.make_acyclic)"
    )


# -- the discrete-event core -------------------------------------------------------------------


def run_tasks(
    tasks: Sequence[SimTask], orders: Mapping[str, Sequence[int]]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Simulate ``tasks``; return every task's start and end (see the module docstring).

    ``orders[r]`` lists, in order, every task on resource ``r``; resources without an entry
    serve their tasks first come, first served.
    """
    n = len(tasks)
    counts = _check_orders(tasks, orders)
    missing, dependents = _dependencies(tasks)
    loop = _EventLoop(tasks, orders, counts, missing, dependents)
    loop.run()
    if loop.done < n:
        stuck = next(i for i in range(n) if not loop.ran[i])
        raise PlanError(
            f"the schedule deadlocks: {n - loop.done} of {n} tasks never ran (first: "
            f"{tasks[stuck].label!r} on {tasks[stuck].resource}); its orders contradict the "
            "dependencies"
        )
    return tuple(loop.start), tuple(loop.end)


def _check_orders(tasks: Sequence[SimTask], orders: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """The number of tasks on each resource; PlanError unless each order lists exactly its tasks."""
    n = len(tasks)
    for r, seq in orders.items():
        if len(set(seq)) != len(seq) or any(not 0 <= i < n or tasks[i].resource != r for i in seq):
            raise PlanError(f"the order of resource {r!r} lists a task twice or one not on it")
    counts: dict[str, int] = {}
    for t in tasks:
        counts[t.resource] = counts.get(t.resource, 0) + 1
    for r, seq in orders.items():
        if len(seq) != counts.get(r, 0):
            raise PlanError(f"the order of resource {r!r} leaves out some of its tasks")
    return counts


def _dependencies(tasks: Sequence[SimTask]) -> tuple[list[int], list[list[int]]]:
    """Per task: how many distinct tasks it waits for, and which tasks wait for it."""
    n = len(tasks)
    missing = [0] * n
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for j in set(t.deps):
            if not 0 <= j < n or j == i:
                raise PlanError(f"task {i} ({t.label!r}) depends on task {j}, not another task")
            missing[i] += 1
            dependents[j].append(i)
    return missing, dependents


class _EventLoop:
    """The state of :func:`run_tasks`: resources, their queues, and the heap of task ends."""

    def __init__(
        self,
        tasks: Sequence[SimTask],
        orders: Mapping[str, Sequence[int]],
        counts: Mapping[str, int],
        missing: list[int],
        dependents: Sequence[Sequence[int]],
    ) -> None:
        n = len(tasks)
        self.tasks, self.orders = tasks, orders
        self.missing, self.dependents = missing, dependents
        self.start = [0.0] * n
        self.end = [0.0] * n
        self.ready_at = [0.0] * n
        self.ran = [False] * n
        self.done = 0
        self.busy: dict[str, bool] = dict.fromkeys(counts, False)
        self.position = dict.fromkeys(orders, 0)
        self.fifo: dict[str, list[tuple[float, int]]] = {r: [] for r in counts if r not in orders}
        self.events: list[tuple[float, int]] = []

    def run(self) -> None:
        """Start what is ready at time 0, then process task ends in time order."""
        for i, task in enumerate(self.tasks):
            if self.missing[i] == 0 and task.resource in self.fifo:
                heapq.heappush(self.fifo[task.resource], (0.0, i))
        for r in sorted(self.busy):
            self._dispatch(r, 0.0)
        while self.events:
            now = self.events[0][0]
            for r in sorted(self._finish_at(now)):
                self._dispatch(r, now)

    def _next_task(self, r: str) -> int | None:
        """The task resource ``r`` runs next, if it is ready (taking it off the queue)."""
        if r in self.orders:
            seq = self.orders[r]
            p = self.position[r]
            if p >= len(seq) or self.missing[seq[p]] > 0:
                return None
            self.position[r] = p + 1
            return seq[p]
        queue = self.fifo[r]
        return heapq.heappop(queue)[1] if queue else None

    def _dispatch(self, r: str, now: float) -> None:
        """Start resource ``r``'s next task at ``now`` if ``r`` is free and the task ready."""
        if self.busy[r]:
            return
        i = self._next_task(r)
        if i is None:
            return
        self.busy[r] = True
        self.start[i] = now
        self.end[i] = now + self.tasks[i].duration_s
        heapq.heappush(self.events, (self.end[i], i))

    def _finish_at(self, now: float) -> set[str]:
        """End every task that ends at ``now``; the resources that may start a task now."""
        touched: set[str] = set()
        while self.events and self.events[0][0] == now:
            _, i = heapq.heappop(self.events)
            self.done += 1
            self.ran[i] = True
            r = self.tasks[i].resource
            self.busy[r] = False
            touched.add(r)
            for k in self.dependents[i]:
                self.missing[k] -= 1
                self.ready_at[k] = max(self.ready_at[k], now)
                if self.missing[k] == 0:
                    rk = self.tasks[k].resource
                    if rk in self.fifo:
                        heapq.heappush(self.fifo[rk], (self.ready_at[k], k))
                    touched.add(rk)
        return touched


# -- the pipelined step ------------------------------------------------------------------------


def _transfer_time_s(topology: Topology, src: int, dst: int, num_bytes: float) -> float:
    """Seconds to move ``num_bytes`` (a micro-batch's share, so possibly fractional)."""
    link = topology.link_between(src, dst)
    if link is None or num_bytes <= 0:
        return 0.0
    return link.latency_s + num_bytes / link.bandwidth_bytes_per_s


def _check_options(schedule: Schedule, num_microbatches: int) -> None:
    if not isinstance(schedule, Schedule):
        raise UsageError(
            f"schedule={schedule!r} is not a Schedule; use one of {[s.value for s in Schedule]}"
        )
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int):
        raise UsageError(f"num_microbatches={num_microbatches!r} must be an integer >= 1")
    if num_microbatches < 1:
        raise UsageError(
            f"num_microbatches={num_microbatches} must be >= 1; use 1 for no micro-batching"
        )


def simulate_pipeline(
    costed: CostedGraph,
    layer_device: Mapping[str, int] | Sequence[int],
    *,
    schedule: Schedule,
    num_microbatches: int,
) -> PipelineSimulation:
    """Simulate one training step of ``costed`` pipelined under ``schedule`` with ``M`` micro-batches.

    Raises UsageError for ``num_microbatches`` < 1 or above the graph's batch size, PlanError for
    a placement that is not a pipeline (see :func:`pipeline_stages`).
    """
    _check_options(schedule, num_microbatches)
    batch = costed.graph.batch_size
    if num_microbatches > batch:
        raise UsageError(
            f"num_microbatches={num_microbatches} exceeds the batch size {batch}; use at most "
            f"{batch} micro-batches or a larger batch"
        )
    stages = pipeline_stages(costed, layer_device)
    return simulate_stages(
        stages, costed.topology, schedule=schedule, num_microbatches=num_microbatches
    )


def simulate_stages(
    stages: Sequence[Stage],
    topology: Topology,
    *,
    schedule: Schedule,
    num_microbatches: int,
) -> PipelineSimulation:
    """Simulate stages (from :func:`pipeline_stages`, or made by hand) on ``topology``."""
    _check_options(schedule, num_microbatches)
    stages = tuple(stages)
    m = num_microbatches
    n_dev = topology.num_devices
    _check_stages(stages, n_dev)
    tasks, idx = _stage_tasks(stages, topology, m, schedule)
    orders = _device_orders(stages, idx, schedule, m)
    start, end = run_tasks(tasks, orders)
    step = max(end, default=0.0)
    device_busy = [0.0] * n_dev
    for st in stages:
        device_busy[st.device] = sum(
            tasks[i].duration_s for i in orders[device_resource(st.device)]
        )
    link_busy: dict[str, float] = {}
    for task in tasks:
        if task.kind is EventKind.TRANSFER:
            link_busy[task.resource] = link_busy.get(task.resource, 0.0) + task.duration_s
    peak_live = tuple(_peak_live(tasks, orders[device_resource(st.device)], start) for st in stages)
    peak_mem = [0] * n_dev
    for st, live in zip(stages, peak_live, strict=True):
        peak_mem[st.device] = st.static_memory_bytes + math.ceil(live * st.activation_bytes / m)
    return PipelineSimulation(
        schedule=schedule,
        num_microbatches=m,
        stages=stages,
        step_time_s=step,
        timeline=_timeline(tasks, start, end),
        device_busy_s=tuple(device_busy),
        bubble_fraction=tuple(0.0 if step <= 0 else max(0.0, 1.0 - b / step) for b in device_busy),
        link_busy_s=tuple(sorted(link_busy.items())),
        peak_memory_bytes=tuple(peak_mem),
        peak_live_microbatches=peak_live,
    )


def _check_stages(stages: Sequence[Stage], n_dev: int) -> None:
    """PlanError unless the stages are numbered 0..K-1, one per device, sending to each other."""
    k_stages = len(stages)
    if not stages:
        raise PlanError("a pipeline needs at least one stage")
    devices = [st.device for st in stages]
    for s, st in enumerate(stages):
        if st.index != s:
            raise PlanError(f"stage {s} has index {st.index}; stages must be numbered 0..K-1")
        if not 0 <= st.device < n_dev:
            raise PlanError(
                f"stage {s} is on device {st.device}; the topology has devices 0..{n_dev - 1}"
            )
        for t in st.sends:
            if t.src_stage != s or not 0 <= t.dst_stage < k_stages or t.dst_stage == s:
                raise PlanError(f"stage {s} sends to stage {t.dst_stage}, not another stage")
    if len(set(devices)) != len(devices):
        raise PlanError(f"stages sit on devices {devices}; each device may hold one stage")


_TaskIndex = dict[tuple[int, Phase, int], int]
"""``(stage, phase, micro-batch) -> index`` of the stage's compute task."""


@dataclass(frozen=True)
class _TaskSpec:
    """A task being built: its dependencies still grow as transfers are added."""

    resource: str
    duration_s: float
    deps: list[int]
    kind: EventKind
    label: str
    microbatch: int


def _stage_tasks(
    stages: Sequence[Stage], topology: Topology, m: int, schedule: Schedule
) -> tuple[list[SimTask], _TaskIndex]:
    """Every stage's ``F`` and ``B`` task per micro-batch, then every send's transfer tasks.
    Every backward but the first the stage runs adds into the gradient sums (module docstring)."""
    idx: _TaskIndex = {}
    specs: list[_TaskSpec] = []
    together = m > 1 and len(stages) > 1
    link = topology.client_link
    for s, st in enumerate(stages):
        stretch = topology.concurrent_factor(st.memory_share) if together else 1.0
        summing = topology.concurrent_factor(1.0) if together else 1.0  # memory traffic
        res = device_resource(st.device)
        steps = stage_steps(schedule, len(stages), s, m)
        first = next(x.microbatch for x in steps if x.phase is Phase.BACKWARD)
        feed_s = link.transfer_time_s(st.feed_bytes / m) if link and st.feed_bytes else 0.0
        for mb in range(m):
            idx[(s, Phase.FORWARD, mb)] = len(specs)
            forward_s = feed_s + st.forward_time_s / m * stretch
            specs.append(_TaskSpec(res, forward_s, [], EventKind.FORWARD, f"stage {s}", mb))
            idx[(s, Phase.BACKWARD, mb)] = len(specs)
            deps = [idx[(s, Phase.FORWARD, mb)]]
            backward_s = stretch * st.backward_time_s / m + (
                summing * st.accumulate_time_s if mb != first else 0.0
            )
            specs.append(_TaskSpec(res, backward_s, deps, EventKind.BACKWARD, f"stage {s}", mb))
    for st in stages:
        for t in st.sends:
            _add_transfers(specs, idx, stages, topology, t, m)
    tasks = [
        SimTask(x.resource, x.duration_s, tuple(x.deps), x.kind, x.label, x.microbatch)
        for x in specs
    ]
    return tasks, idx


def _add_transfers(
    specs: list[_TaskSpec],
    idx: _TaskIndex,
    stages: Sequence[Stage],
    topology: Topology,
    t: StageTransfer,
    m: int,
) -> None:
    """One transfer task per micro-batch for send ``t``, after its producer, before its readers."""
    src_device, dst_device = stages[t.src_stage].device, stages[t.dst_stage].device
    seconds = _transfer_time_s(topology, src_device, dst_device, t.batch_bytes / m)
    res = channel_resource(topology, src_device, dst_device)
    label = f"stage {t.src_stage}->{t.dst_stage} " + (
        "activations" if t.phase is Phase.FORWARD else "gradients"
    )
    for mb in range(m):
        ti = len(specs)
        producer = idx[(t.src_stage, t.phase, mb)]
        specs.append(_TaskSpec(res, seconds, [producer], EventKind.TRANSFER, label, mb))
        for phase in t.consumers:
            specs[idx[(t.dst_stage, phase, mb)]].deps.append(ti)


def _device_orders(
    stages: Sequence[Stage], idx: _TaskIndex, schedule: Schedule, m: int
) -> dict[str, tuple[int, ...]]:
    """Each stage's device queue: its compute tasks in the schedule's order."""
    k_stages = len(stages)
    return {
        device_resource(st.device): tuple(
            idx[(s, step.phase, step.microbatch)] for step in stage_steps(schedule, k_stages, s, m)
        )
        for s, st in enumerate(stages)
    }


def _timeline(
    tasks: Sequence[SimTask], start: Sequence[float], end: Sequence[float]
) -> tuple[TimelineEvent, ...]:
    """Every task as a timeline event, sorted by start time."""
    return tuple(
        sorted(
            (
                TimelineEvent(t.resource, t.kind, t.label, start[i], end[i], t.microbatch)
                for i, t in enumerate(tasks)
            ),
            key=lambda ev: (ev.start_s, ev.resource, ev.end_s, ev.microbatch),
        )
    )


def _peak_live(tasks: Sequence[SimTask], queue: Sequence[int], start: Sequence[float]) -> int:
    """The most micro-batches whose activations a device held at once.

    Counted over the device's events in the order they ran (start time; ties in queue order):
    alive from the start of ``F(s, m)`` until the end of ``B(s, m)``.
    """
    ran_order = sorted(range(len(queue)), key=lambda p: (start[queue[p]], p))
    live = best = 0
    for i in (queue[p] for p in ran_order):
        if tasks[i].kind is EventKind.FORWARD:
            live += 1
            best = max(best, live)
        else:
            live -= 1
    return best
