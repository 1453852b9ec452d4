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
order the stages (a model input read by several towers would otherwise chain them). The stage order is a topological order of these arcs
(Kahn), taking among the available devices the one whose first non-fed op comes first in op
order (then: whose first layer comes first in layer order) -- the order in which the model's
call first reaches the devices, the tie-break the pipelined rewrite uses too (independent
branches on different devices could otherwise be ordered differently by the two, and the
rewrite refuses a plan whose stage order is not its own); for a placement of contiguous layers
of a chain, the order in which devices first appear along the layers. A cycle raises :class:`~partitioner.core.errors.PlanError`. The stages need not form a chain:
a skip edge from stage 0 to stage 2 is a transfer between those two devices.

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

**Schedules** fix the order of each device's compute queue (``K`` stages, stage ``s``):

* ``Schedule.NONE``: ``F0 B0 F1 B1 ...``: micro-batches one after another (gradient
  accumulation); with ``M = 1`` the plain un-pipelined step, run at stage level.
* ``Schedule.GPIPE`` (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", NeurIPS 2019): all forwards in micro-batch order, then all backwards in
  *reverse* micro-batch order (the last micro-batch's backward first, as in the paper's
  schedule figure). Every stage keeps ``M`` micro-batches of activations alive. With ``K``
  identical stages and no transfer time the step is ``(M + K - 1)(f + b)`` and every stage idles
  ``(K - 1)/(M + K - 1)`` of it (the bubble).
* ``Schedule.ONE_F_ONE_B`` (PipeDream-Flush; Narayanan et al., "Memory-Efficient
  Pipeline-Parallel DNN Training", ICML 2021): a warm-up of ``w = min(K - s - 1, M)`` forwards,
  then ``M - w`` pairs of one forward and one backward, then a cool-down of the ``w`` remaining
  backwards, both in micro-batch order. Stage ``s`` keeps at most ``min(M, K - s)`` micro-batches
  of activations alive; the step time equals GPipe's for identical stages.

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

from partitioner.core.errors import PlanError, UsageError
from partitioner.core.ir import (
    CostedGraph,
    EventKind,
    Graph,
    Phase,
    Schedule,
    TimelineEvent,
    Topology,
)
from partitioner.simulation.step import channel_resource, device_resource, resolve_layer_devices

__all__ = [
    "PipelineSimulation",
    "SimTask",
    "Stage",
    "StageTransfer",
    "fed_ops",
    "peak_live_formula",
    "pipeline_stages",
    "run_tasks",
    "simulate_pipeline",
    "simulate_stages",
    "stage_order",
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


def pipeline_stages(
    costed: CostedGraph, layer_device: Mapping[str, int] | Sequence[int]
) -> tuple[Stage, ...]:
    """The pipeline stages of a placement, in dataflow order (see the module docstring)."""
    graph = costed.graph
    lg = graph.layer_graph
    per_layer = resolve_layer_devices(costed, layer_device)
    op_layer = [lg.index[lg.op_owner[op.id]] for op in graph.ops]
    op_dev = [per_layer[k] for k in op_layer]
    op_index = graph.op_index
    ops = graph.ops
    n_dev = costed.topology.num_devices

    first_layer = [len(per_layer)] * n_dev
    for k, d in enumerate(per_layer):
        if first_layer[d] > k:
            first_layer[d] = k
    used = [d for d in range(n_dev) if first_layer[d] < len(per_layer)]
    fed = fed_ops(graph)
    # Ties between devices go to the one whose first (non-fed) op runs first: the order in which
    # the model's call reaches them, which the pipelined rewrite also breaks ties by.
    first_op = [len(ops)] * n_dev
    for i in range(len(ops)):
        if not fed[i] and first_op[op_dev[i]] > i:
            first_op[op_dev[i]] = i
    first_key = [(first_op[d], first_layer[d]) for d in range(n_dev)]

    # Arcs between devices (earlier -> later), each with an example op edge for messages.
    arcs: dict[tuple[int, int], tuple[int, int]] = {}
    # (producer op, output index, destination device) -> (bytes, consumer phases)
    tensors: dict[tuple[int, int, int], tuple[int, set[Phase]]] = {}
    for e in graph.edges:
        i, j = op_index[e.src], op_index[e.dst]
        a, b = op_dev[i], op_dev[j]
        if a == b or fed[i]:
            continue
        pi, pj = ops[i].phase, ops[j].phase
        if pi is Phase.BACKWARD and pj is Phase.FORWARD:
            raise PlanError(
                f"backward op {e.src!r} (layer {lg.nodes[op_layer[i]].name!r}, device {a}) feeds "
                f"forward op {e.dst!r} (layer {lg.nodes[op_layer[j]].name!r}, device {b}): a "
                "pipeline stage's forward cannot wait for another stage's backward; place both "
                "layers on one device"
            )
        if pi is Phase.FORWARD and pj is Phase.FORWARD:
            arcs.setdefault((a, b), (i, j))
        elif pi is Phase.BACKWARD and pj is Phase.BACKWARD:
            arcs.setdefault((b, a), (i, j))
        key = (i, e.output_index, b)
        old = tensors.get(key)
        if old is None:
            tensors[key] = (e.bytes, {pj})
        else:
            old[1].add(pj)
            if e.bytes > old[0]:
                tensors[key] = (e.bytes, old[1])

    order = _stage_device_order(used, first_key, arcs, costed)
    stage_of = {d: s for s, d in enumerate(order)}

    fwd_s = [0.0] * n_dev
    bwd_s = [0.0] * n_dev
    for i, op in enumerate(ops):
        d = op_dev[i]
        t = costed.op_compute_time_s[d][i]
        if op.phase is Phase.FORWARD:
            fwd_s[d] += t
        else:
            bwd_s[d] += t

    groups: dict[tuple[int, Phase, int], tuple[int, set[Phase]]] = {}
    for (i, _, b), (nbytes, consumers) in tensors.items():
        gkey = (op_dev[i], ops[i].phase, b)
        old = groups.get(gkey)
        if old is None:
            groups[gkey] = (nbytes, set(consumers))
        else:
            groups[gkey] = (old[0] + nbytes, old[1] | consumers)
    sends: list[list[StageTransfer]] = [[] for _ in order]
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

    stages = []
    for s, d in enumerate(order):
        on_d = [k for k, x in enumerate(per_layer) if x == d]
        mems = [costed.layer_memory[k] for k in on_d]
        stages.append(
            Stage(
                index=s,
                device=d,
                layers=tuple(lg.nodes[k].name for k in on_d),
                forward_time_s=fwd_s[d],
                backward_time_s=bwd_s[d],
                static_memory_bytes=sum(
                    m.param_bytes + m.gradient_bytes + m.optimizer_bytes for m in mems
                )
                + max((m.transient_bytes for m in mems), default=0),
                activation_bytes=sum(m.activation_bytes for m in mems),
                sends=tuple(
                    sorted(sends[s], key=lambda t: (t.phase is Phase.BACKWARD, t.dst_stage))
                ),
            )
        )
    return tuple(stages)


def fed_ops(graph: Graph) -> tuple[bool, ...]:
    """Per op: whether it is *fed* -- outside every layer and computed from fed ops alone.

    The model's inputs and labels (placeholders with no inputs), constants, and layer-less glue
    computed only from them: their values exist before any stage runs, and each stage reads them
    where it runs (the pipelined rewrite feeds every stage its slice of the model's inputs), so
    they order no stages and are not sent between stages. The layer they are merged into for
    costing (``LayerGraph.op_owner``) may be any of their consumers'.
    """
    fed: list[bool] = []
    for i, op in enumerate(graph.ops):
        fed.append(op.layer is None and all(fed[graph.op_index[e.src]] for e in graph.in_edges[i]))
    return tuple(fed)


def _stage_device_order(
    used: list[int],
    first_key: Sequence[tuple[int, int]],
    arcs: Mapping[tuple[int, int], tuple[int, int]],
    costed: CostedGraph,
) -> list[int]:
    """Kahn's order of the used devices, earliest ``first_key`` first; PlanError on a cycle."""
    succ: dict[int, list[int]] = {d: [] for d in used}
    indeg = dict.fromkeys(used, 0)
    for a, b in arcs:
        succ[a].append(b)
        indeg[b] += 1
    heap = [(first_key[d], d) for d in used if indeg[d] == 0]
    heapq.heapify(heap)
    order: list[int] = []
    while heap:
        _, d = heapq.heappop(heap)
        order.append(d)
        for e in succ[d]:
            indeg[e] -= 1
            if indeg[e] == 0:
                heapq.heappush(heap, (first_key[e], e))
    if len(order) < len(used):
        left = sorted(d for d in used if indeg[d] > 0)
        a, b = next((a, b) for (a, b) in sorted(arcs) if indeg[a] > 0 and indeg[b] > 0)
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
    return order


# -- schedules ---------------------------------------------------------------------------------


def stage_order(
    schedule: Schedule, num_stages: int, stage: int, num_microbatches: int
) -> tuple[tuple[Phase, int], ...]:
    """The order of ``(phase, micro-batch)`` tasks on stage ``stage`` under ``schedule``."""
    m = num_microbatches
    if schedule is Schedule.NONE:
        return tuple(x for mb in range(m) for x in ((Phase.FORWARD, mb), (Phase.BACKWARD, mb)))
    if schedule is Schedule.GPIPE:
        return tuple((Phase.FORWARD, mb) for mb in range(m)) + tuple(
            (Phase.BACKWARD, mb) for mb in reversed(range(m))
        )
    warmup = min(num_stages - stage - 1, m)
    seq = [(Phase.FORWARD, mb) for mb in range(warmup)]
    for k in range(m - warmup):
        seq += [(Phase.FORWARD, warmup + k), (Phase.BACKWARD, k)]
    seq += [(Phase.BACKWARD, mb) for mb in range(m - warmup, m)]
    return tuple(seq)


def peak_live_formula(
    schedule: Schedule, num_stages: int, stage: int, num_microbatches: int
) -> int:
    """Micro-batches of activations a stage holds at once by the schedule's closed form."""
    if schedule is Schedule.NONE:
        return 1
    if schedule is Schedule.GPIPE:
        return num_microbatches
    return min(num_microbatches, num_stages - stage)


# -- the discrete-event core -------------------------------------------------------------------


def run_tasks(
    tasks: Sequence[SimTask], orders: Mapping[str, Sequence[int]]
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Simulate ``tasks``; return every task's start and end (see the module docstring).

    ``orders[r]`` lists, in order, every task on resource ``r``; resources without an entry
    serve their tasks first come, first served.
    """
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

    missing = [0] * n
    dependents: list[list[int]] = [[] for _ in range(n)]
    for i, t in enumerate(tasks):
        for j in set(t.deps):
            if not 0 <= j < n or j == i:
                raise PlanError(f"task {i} ({t.label!r}) depends on task {j}, not another task")
            missing[i] += 1
            dependents[j].append(i)

    start = [0.0] * n
    end = [0.0] * n
    ready_at = [0.0] * n
    ran = [False] * n
    busy: dict[str, bool] = dict.fromkeys(counts, False)
    position = dict.fromkeys(orders, 0)
    fifo: dict[str, list[tuple[float, int]]] = {r: [] for r in counts if r not in orders}
    events: list[tuple[float, int]] = []
    done = 0

    def dispatch(r: str, now: float) -> None:
        if busy[r]:
            return
        if r in orders:
            seq = orders[r]
            p = position[r]
            if p >= len(seq) or missing[seq[p]] > 0:
                return
            position[r] = p + 1
            i = seq[p]
        else:
            queue = fifo[r]
            if not queue:
                return
            i = heapq.heappop(queue)[1]
        busy[r] = True
        start[i] = now
        end[i] = now + tasks[i].duration_s
        heapq.heappush(events, (end[i], i))

    for i in range(n):
        if missing[i] == 0 and tasks[i].resource in fifo:
            heapq.heappush(fifo[tasks[i].resource], (0.0, i))
    for r in sorted(counts):
        dispatch(r, 0.0)
    while events:
        now = events[0][0]
        touched: set[str] = set()
        while events and events[0][0] == now:
            _, i = heapq.heappop(events)
            done += 1
            ran[i] = True
            r = tasks[i].resource
            busy[r] = False
            touched.add(r)
            for k in dependents[i]:
                missing[k] -= 1
                if now > ready_at[k]:
                    ready_at[k] = now
                if missing[k] == 0:
                    rk = tasks[k].resource
                    if rk in fifo:
                        heapq.heappush(fifo[rk], (ready_at[k], k))
                    touched.add(rk)
        for r in sorted(touched):
            dispatch(r, now)
    if done < n:
        stuck = next(i for i in range(n) if not ran[i])
        raise PlanError(
            f"the schedule deadlocks: {n - done} of {n} tasks never ran (first: "
            f"{tasks[stuck].label!r} on {tasks[stuck].resource}); its orders contradict the "
            "dependencies"
        )
    return tuple(start), tuple(end)


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
    k_stages = len(stages)
    m = num_microbatches
    n_dev = topology.num_devices
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

    # Compute tasks, then transfer tasks; idx[(stage, is_backward, micro-batch)] -> task index.
    idx: dict[tuple[int, bool, int], int] = {}
    specs: list[tuple[str, float, list[int], EventKind, str, int]] = []
    for s, st in enumerate(stages):
        res = device_resource(st.device)
        for mb in range(m):
            idx[(s, False, mb)] = len(specs)
            specs.append((res, st.forward_time_s / m, [], EventKind.FORWARD, f"stage {s}", mb))
            idx[(s, True, mb)] = len(specs)
            deps = [idx[(s, False, mb)]]
            specs.append((res, st.backward_time_s / m, deps, EventKind.BACKWARD, f"stage {s}", mb))
    for s, st in enumerate(stages):
        for t in st.sends:
            dst_device = stages[t.dst_stage].device
            seconds = _transfer_time_s(topology, st.device, dst_device, t.batch_bytes / m)
            res = channel_resource(topology, st.device, dst_device)
            label = f"stage {s}->{t.dst_stage} " + (
                "activations" if t.phase is Phase.FORWARD else "gradients"
            )
            for mb in range(m):
                ti = len(specs)
                specs.append(
                    (res, seconds, [idx[(s, t.phase is Phase.BACKWARD, mb)]],
                     EventKind.TRANSFER, label, mb)
                )  # fmt: skip
                for phase in t.consumers:
                    specs[idx[(t.dst_stage, phase is Phase.BACKWARD, mb)]][2].append(ti)
    tasks = [
        SimTask(r, sec, tuple(deps), kind, label, mb) for r, sec, deps, kind, label, mb in specs
    ]

    orders: dict[str, tuple[int, ...]] = {}
    for s, st in enumerate(stages):
        seq = stage_order(schedule, k_stages, s, m)
        orders[device_resource(st.device)] = tuple(
            idx[(s, phase is Phase.BACKWARD, mb)] for phase, mb in seq
        )
    start, end = run_tasks(tasks, orders)
    step = max(end, default=0.0)

    timeline = tuple(
        sorted(
            (
                TimelineEvent(t.resource, t.kind, t.label, start[i], end[i], t.microbatch)
                for i, t in enumerate(tasks)
            ),
            key=lambda ev: (ev.start_s, ev.resource, ev.end_s, ev.microbatch),
        )
    )
    device_busy = [0.0] * n_dev
    for st in stages:
        device_busy[st.device] = sum(
            tasks[i].duration_s for i in orders[device_resource(st.device)]
        )
    link_busy: dict[str, float] = {}
    for task in tasks:
        if task.kind is EventKind.TRANSFER:
            link_busy[task.resource] = link_busy.get(task.resource, 0.0) + task.duration_s
    bubble = tuple(0.0 if step <= 0 else max(0.0, 1.0 - b / step) for b in device_busy)

    peak_live: list[int] = []
    peak_mem = [0] * n_dev
    for st in stages:
        # The device's events in the order they ran (start time; ties in queue order).
        queue = orders[device_resource(st.device)]
        ran_order = sorted(range(len(queue)), key=lambda p: (start[queue[p]], p))
        live = best = 0
        for i in (queue[p] for p in ran_order):
            if tasks[i].kind is EventKind.FORWARD:
                live += 1
                best = max(best, live)
            else:
                live -= 1
        peak_live.append(best)
        peak_mem[st.device] = st.static_memory_bytes + math.ceil(best * st.activation_bytes / m)

    return PipelineSimulation(
        schedule=schedule,
        num_microbatches=m,
        stages=stages,
        step_time_s=step,
        timeline=timeline,
        device_busy_s=tuple(device_busy),
        bubble_fraction=bubble,
        link_busy_s=tuple(sorted(link_busy.items())),
        peak_memory_bytes=tuple(peak_mem),
        peak_live_microbatches=tuple(peak_live),
    )
