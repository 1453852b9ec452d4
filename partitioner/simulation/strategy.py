"""The predicted step of a strategy: what the rewrite would run, replicas and all-reduce included.

A :class:`~partitioner.core.strategy.Strategy` of ``R`` replicas x ``S`` stages runs, in every
replica, the model's forward and backward on ``batch / R`` samples: the op-level simulation of a
plain placement (:func:`~partitioner.simulation.evaluate.evaluate`) when there are no
micro-batches, else the pipeline simulation under the strategy's schedule
(:func:`~partitioner.simulation.evaluate.evaluate_pipeline`). The costed graph given here must be
costed at that per-replica batch (the caller traces or scales it; costs do not scale linearly
with the batch, so the planner re-costs rather than divides). Every replica is simulated on its
own devices (they may differ in type); synchronous data parallelism waits for the slowest one.

Then each stage's gradients are summed across the replicas holding that stage, all stages at once,
sharing channels (:mod:`cost_models.estimate.collectives`), with the algorithm the rewrite runs:
a ring (NCCL) when every device is a GPU and the model is not split, else a reduction to replica
0's device and a broadcast (``MirroredStrategy``'s ``ReductionToOneDevice`` on CPUs, and the
hybrid rewrite's explicit sum) -- :func:`all_reduce_algorithm`. Keras's
``train_step`` under ``tf.distribute`` all-reduces the gradients after the whole backward (one
batched all-reduce inside ``optimizer.apply``), so the all-reduce is **not** overlapped with
the backward here::

    step_s = max over replicas (replica step) + all_reduce_s + other_shares_feed_s

(on a measured cluster the client feeds the whole batch: each replica's step pays its own share,
``other_shares_feed_s`` the rest, through the client's one link). Replicas compute at once for
their whole step, on cores that may share a machine's memory bandwidth and caches: a topology
measured by ``partition calibrate`` carries how much slower two reference steps run on every
device at once than alone, one of matrix products (``concurrent_compute_factor``; x1.00-1.05 on
two loopback workers of the two-core test machine) and one of memory traffic
(``concurrent_memory_factor``; x1.24-1.28 there), and each replica's step, its client part
aside, is stretched by their mix over the model's ops by each op's memory-bound share
(:meth:`~partitioner.core.ir.CostedGraph.concurrent_factor`; an optimizer's update counts as
memory traffic). Measured on those workers, each model's own step at half its batch slowed
x1.04 (an MLP), x1.06 (a conv net, a small GPT) and x1.09 (a recommender whose table's update
is a fifth of its step) when both ran at once. A plain split's stages take turns, so a single
such replica is not stretched; a pipeline's stages compute at once between its bubbles, and
the pipeline simulation stretches their tasks itself (:mod:`partitioner.simulation.pipeline`),
so pipelined replicas are not stretched again.

An embedding's gradient is ``tf.IndexedSlices`` (the rows a replica looked up): the replicas
all-gather it rather than all-reduce the table
(:func:`~cost_models.estimate.collectives.gradient_exchange_s`) where the rewrite keeps it
sparse (Keras's own ``train_step``: one device, a plain split, data-parallel replicas). The
pipeline rewrite (pipelined stages, every hybrid) sums micro-batch gradients densely, so there
the gradient is the table's size, in the exchange and in memory (:func:`keeps_sparse_gradients`).

Memory per device is the replica's simulated peak on that device: a replica holds whole copies of
its stages' weights, gradients and optimizer slots, plus the activations of ``batch / R``
samples (of the micro-batches the schedule keeps alive, for a pipeline).

Pure Python, no TensorFlow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cost_models.devices.catalog import DeviceKind, get_device_type
from cost_models.estimate.collectives import AllReduceAlgorithm, gradient_exchange_s
from partitioner.core.errors import PlanError
from partitioner.core.ir import CostedGraph, LayerMemory, Link, Topology
from partitioner.core.strategy import Strategy
from partitioner.simulation.bounds import LowerBounds, costed_lower_bounds
from partitioner.simulation.evaluate import (
    PlanEvaluation,
    client_s,
    evaluate,
    evaluate_pipeline,
    fed_bytes,
)

__all__ = [
    "StrategySimulation",
    "all_reduce_algorithm",
    "dense_gradient_tensors",
    "gradient_bytes_per_stage",
    "keeps_sparse_gradients",
    "microbatch_costed",
    "other_shares_feed_s",
    "simulate_strategy",
    "sparse_gradient_bytes_per_stage",
    "static_overflow",
    "strategy_lower_bound_s",
]


@dataclass(frozen=True)
class StrategySimulation:
    """The simulated step of a strategy (see the module docstring)."""

    strategy: Strategy
    replica_step_s: tuple[float, ...]
    """Each replica's forward and backward (plain or pipelined), seconds."""
    all_reduce_s: float
    algorithm: AllReduceAlgorithm
    gradient_bytes: tuple[int, ...]
    """Bytes of gradients each stage exchanges per replica (dense and sparse)."""
    peak_memory_bytes: tuple[int, ...]
    """Per topology device (0 where the strategy uses none)."""
    memory_limit_bytes: tuple[int, ...]
    replica: PlanEvaluation
    """The evaluation of replica 0 (per-device loads, timeline)."""
    sparse_gradient_bytes: tuple[int, ...] = ()
    """Of ``gradient_bytes``, the ``IndexedSlices`` each stage's replica all-gathers (empty:
    none)."""
    other_shares_feed_s: float = 0.0
    """On a measured cluster, the client's feed of every replica's share but the first (whose
    feed a replica's step has): :func:`other_shares_feed_s`."""

    @property
    def step_time_s(self) -> float:
        """The predicted training step: the slowest replica, then the all-reduce, and the
        client's feed of the other replicas' shares."""
        return max(self.replica_step_s) + self.all_reduce_s + self.other_shares_feed_s

    @property
    def over_memory(self) -> tuple[tuple[int, int, int], ...]:
        """``(device, peak bytes, limit bytes)`` of every device that does not fit."""
        return tuple(
            (d, need, limit)
            for d, (need, limit) in enumerate(zip(self.peak_memory_bytes, self.memory_limit_bytes))
            if need > limit
        )

    @property
    def fits(self) -> bool:
        return not self.over_memory


def microbatch_costed(
    costed: CostedGraph, micro: CostedGraph, num_microbatches: int
) -> CostedGraph:
    """``costed`` (a replica's batch) with each op's time that of ``micro`` (the same model costed
    at the micro-batch, ``batch / num_microbatches``) times ``num_microbatches``.

    The pipeline simulation runs each stage's ops once per micro-batch at ``1 / M`` of the
    graph's op times; a micro-batch is not ``1 / M`` of a batch (a kernel's fixed cost and its
    lower efficiency on small operands stay), so a pipeline is priced on the ops the rewrite runs,
    at the micro-batch. Memory and the tensors between stages stay ``costed``'s (the simulator
    divides them by ``M``, which is exact for tensors with a batch dimension). Ops are matched by
    id (a model traced at two batch sizes names its ops alike); an op the micro-batch graph does
    not have keeps ``costed``'s time, and two graphs on different topologies raise PlanError."""
    if num_microbatches == 1:
        return costed
    if micro.topology.num_devices != costed.topology.num_devices:
        raise PlanError(
            f"the micro-batch graph is costed on {micro.topology.num_devices} devices, the "
            f"replica's on {costed.topology.num_devices}: cost both on one topology"
        )
    index = micro.graph.op_index
    where = tuple(index.get(op.id) for op in costed.graph.ops)
    made: dict[tuple[int, int], tuple[float, ...]] = {}
    rows = []
    for row, micro_row in zip(costed.op_compute_time_s, micro.op_compute_time_s):
        key = (id(row), id(micro_row))  # devices of one type share their rows: price them once
        if key not in made:
            made[key] = tuple(
                micro_row[i] * num_microbatches if i is not None else t for i, t in zip(where, row)
            )
        rows.append(made[key])
    return replace(costed, op_compute_time_s=tuple(rows))


def keeps_sparse_gradients(strategy: Strategy) -> bool:
    """Whether the rewrite of ``strategy`` hands ``IndexedSlices`` gradients to the optimizer
    (and its all-reduce) as they are: Keras's own ``train_step`` does (one device, a plain
    split, ``MirroredStrategy`` replicas). The pipeline rewrite, which runs every pipelined
    strategy and every hybrid, adds each micro-batch's gradient into a dense sum
    (``passes/rewrite/pipeline.py``, ``_accumulate``): there the gradients are dense."""
    return strategy.stages == 1 or (strategy.replicas == 1 and strategy.num_microbatches == 1)


def _stage_memory(costed: CostedGraph, strategy: Strategy) -> tuple[LayerMemory, ...]:
    """The layers' memory as ``strategy``'s rewrite holds it (:func:`keeps_sparse_gradients`)."""
    return _as_run(costed, strategy).layer_memory


_DENSIFIED: dict[int, tuple[CostedGraph, CostedGraph]] = {}
"""``id(costed)`` -> (``costed``, ``costed`` with densified gradients): a search simulates many
strategies of one costed graph; a few entries (the replica's and the micro-batch's graphs)."""


def _as_run(costed: CostedGraph, strategy: Strategy) -> CostedGraph:
    """``costed`` with the layers' memory as ``strategy``'s rewrite holds it: its
    ``IndexedSlices`` gradients dense where the rewrite densifies them
    (:meth:`~partitioner.core.ir.LayerMemory.densified`)."""
    if keeps_sparse_gradients(strategy) or not any(
        m.sparse_gradient_dense_bytes for m in costed.layer_memory
    ):
        return costed
    held = _DENSIFIED.get(id(costed))
    if held is None or held[0] is not costed:
        if len(_DENSIFIED) >= 8:
            _DENSIFIED.clear()
        dense = tuple(m.densified() for m in costed.layer_memory)
        held = (costed, replace(costed, layer_memory=dense))
        _DENSIFIED[id(costed)] = held
    return held[1]


def gradient_bytes_per_stage(costed: CostedGraph, strategy: Strategy) -> tuple[int, ...]:
    """The bytes of gradients of each stage's layers, per replica: dense gradients in full,
    ``IndexedSlices`` as the rows one replica gathers where the rewrite keeps them
    (:func:`keeps_sparse_gradients`), else as their variables' size."""
    per_stage = [0] * strategy.stages
    for memory, stage in zip(_stage_memory(costed, strategy), strategy.stage_of_layer):
        per_stage[stage] += memory.gradient_bytes
    return tuple(per_stage)


def sparse_gradient_bytes_per_stage(costed: CostedGraph, strategy: Strategy) -> tuple[int, ...]:
    """Of :func:`gradient_bytes_per_stage`, the ``IndexedSlices`` bytes (all-gathered, not
    all-reduced); zeros where the rewrite densifies them."""
    per_stage = [0] * strategy.stages
    for memory, stage in zip(_stage_memory(costed, strategy), strategy.stage_of_layer):
        per_stage[stage] += memory.sparse_gradient_bytes
    return tuple(per_stage)


def _computing_together(
    costed: CostedGraph, strategy: Strategy, replica_step_s: tuple[float, ...]
) -> tuple[float, ...]:
    """Each replica's step, its client part aside, stretched by the measured factor of running
    at once (:meth:`~partitioner.core.ir.CostedGraph.concurrent_factor`: the model's ops by
    their memory-bound shares) when there are replicas: they compute at once for their whole
    step, on cores that share a machine's memory bandwidth (module docstring). One replica is
    left as simulated, and so are pipelined replicas (their simulation stretched their tasks)."""
    if strategy.replicas == 1 or strategy.num_microbatches > 1:
        return replica_step_s
    fixed = client_s(costed)
    return tuple(
        fixed + (step - fixed) * costed.concurrent_factor(strategy.device_groups[r][0])
        for r, step in enumerate(replica_step_s)
    )


def other_shares_feed_s(costed: CostedGraph, strategy: Strategy) -> float:
    """The client feeds the whole batch, every replica's share of inputs and targets, through
    its one link (``topology.client_link``, serially); a replica's simulated step pays for its
    own share (:func:`~partitioner.simulation.evaluate.client_s`), this is the rest. 0 without a
    measured client link or with one replica."""
    link = costed.topology.client_link
    if link is None or strategy.replicas == 1:
        return 0.0
    share = fed_bytes(costed)
    return link.transfer_time_s(share * strategy.replicas) - link.transfer_time_s(share)


def all_reduce_algorithm(topology: Topology, strategy: Strategy) -> AllReduceAlgorithm:
    """The all-reduce the rewrite runs for ``strategy`` (see the module docstring)."""
    kinds = {get_device_type(topology.devices[d].device_type).kind for d in strategy.devices}
    if strategy.stages == 1 and kinds == {DeviceKind.GPU}:
        return AllReduceAlgorithm.RING
    return AllReduceAlgorithm.REDUCE_TO_ONE


def _replica(
    costed: CostedGraph, strategy: Strategy, replica: int, bounds: LowerBounds
) -> PlanEvaluation:
    assignment = strategy.layer_devices(replica)
    if strategy.num_microbatches > 1:
        return evaluate_pipeline(
            costed,
            assignment,
            schedule=strategy.schedule,
            num_microbatches=strategy.num_microbatches,
            bounds=bounds,
        )
    return evaluate(costed, assignment, bounds=bounds)


_Signature = tuple[tuple[tuple[int, str, int, int], ...], tuple[tuple[Link | None, str], ...]]


def _group_signature(costed: CostedGraph, group: tuple[int, ...]) -> _Signature:
    """What a replica's simulation reads of its devices, position by position: the row of op
    times (by identity), type, memory and host (numbered by first appearance), and the link and
    channel kind of every ordered pair. Two groups of one signature simulate alike, the devices
    renamed."""
    topology = costed.topology
    hosts: dict[int, int] = {}
    devices = tuple(
        (
            id(costed.op_compute_time_s[d]),
            topology.devices[d].device_type,
            topology.devices[d].memory_bytes,
            hosts.setdefault(topology.devices[d].host, len(hosts)),
        )
        for d in group
    )
    pairs = tuple(
        (topology.link_between(a, b), topology.channel_between(a, b)[0] if a != b else "")
        for a in group
        for b in group
    )
    return devices, pairs


def _replicas(
    costed: CostedGraph, strategy: Strategy, bounds: LowerBounds
) -> tuple[tuple[float, ...], list[int], PlanEvaluation]:
    """Every replica's step and every device's peak memory, and replica 0's evaluation.

    A replica whose devices have the signature of an earlier one's (:func:`_group_signature`:
    alike devices, links and host channels, as the replicas of a uniform cluster) is that one
    renamed: its step and its devices' peaks are the earlier replica's, not simulated again."""
    peak = [0] * costed.topology.num_devices
    steps: list[float] = []
    done: dict[_Signature, tuple[PlanEvaluation, tuple[int, ...]]] = {}
    for r, group in enumerate(strategy.device_groups):
        key = _group_signature(costed, group)
        if key not in done:
            done[key] = (_replica(costed, strategy, r, bounds), group)
        evaluation, simulated = done[key]
        steps.append(evaluation.step_time_s)
        for d, twin in zip(group, simulated, strict=True):
            peak[d] = evaluation.per_device[twin].memory_bytes
    first = done[_group_signature(costed, strategy.device_groups[0])][0]
    return tuple(steps), peak, first


def _all_reduce(
    costed: CostedGraph, strategy: Strategy
) -> tuple[tuple[int, ...], tuple[int, ...], AllReduceAlgorithm, float]:
    """Each stage's gradient bytes and sparse part, the algorithm, and the seconds of the
    exchange of every stage's gradients among its replicas, all stages at once (0 for one
    replica): dense ones all-reduced, ``IndexedSlices`` all-gathered."""
    topology = costed.topology
    grads = gradient_bytes_per_stage(costed, strategy)
    sparse = sparse_gradient_bytes_per_stage(costed, strategy)
    algorithm = all_reduce_algorithm(topology, strategy)
    if strategy.replicas == 1:
        return grads, sparse, algorithm, 0.0
    groups = [
        (tuple(group[s] for group in strategy.device_groups), grads[s] - sparse[s], sparse[s])
        for s in range(strategy.stages)
    ]
    tensors = dense_gradient_tensors(costed, strategy)
    exchange_s = gradient_exchange_s(topology, groups, algorithm, dense_tensors=tensors)
    return grads, sparse, algorithm, exchange_s


def dense_gradient_tensors(costed: CostedGraph, strategy: Strategy) -> int:
    """How many gradient tensors ``strategy``'s replicas all-reduce, every stage's in all: each
    trainable variable's, less the ``IndexedSlices`` ones where the rewrite keeps them sparse
    (:func:`keeps_sparse_gradients`; they are all-gathered)."""
    if keeps_sparse_gradients(strategy):
        return sum(info.dense_gradient_tensors for info in costed.graph.layers)
    return sum(info.trainable_tensors for info in costed.graph.layers)


def strategy_lower_bound_s(costed: CostedGraph, strategy: Strategy, bounds: LowerBounds) -> float:
    """A lower bound on ``simulate_strategy(costed, strategy).step_time_s``, without simulating.

    A device runs its ops one at a time (the step and the pipeline simulators queue them; a
    pipeline runs each of ``M`` micro-batches at ``1 / M`` of the op times), so a replica's step
    is at least its busiest device's layer times; it is at least the op-level critical path of
    one (micro-)batch (``bounds.critical_path_s / M``); the slowest replica paces the step, and
    the all-reduce (computed exactly, as :func:`simulate_strategy` does) follows it."""
    rows = costed.layer_compute_time_s
    per_stage: dict[int, list[float]] = {}  # per distinct row of layer times (alike devices)
    for d in strategy.devices:
        if id(rows[d]) not in per_stage:
            sums = [0.0] * strategy.stages
            for t, s in zip(rows[d], strategy.stage_of_layer):
                sums[s] += t
            per_stage[id(rows[d])] = sums
    busiest = max(
        per_stage[id(rows[d])][s] for group in strategy.device_groups for s, d in enumerate(group)
    )
    path_s = bounds.critical_path_s / strategy.num_microbatches
    return max(busiest, path_s) + _all_reduce(costed, strategy)[3]


def static_overflow(costed: CostedGraph, strategy: Strategy) -> bool:
    """Whether some device of ``strategy`` cannot hold even its stage's weights, gradients,
    optimizer slots and largest transient (a floor under both simulators' peaks), so the
    strategy surely does not fit."""
    static = [0] * strategy.stages
    transient = [0] * strategy.stages
    for m, s in zip(_stage_memory(costed, strategy), strategy.stage_of_layer):
        static[s] += m.param_bytes + m.gradient_bytes + m.optimizer_bytes
        transient[s] = max(transient[s], m.transient_bytes)
    devices = costed.topology.devices
    return any(
        static[s] + transient[s] > devices[d].memory_bytes
        for group in strategy.device_groups
        for s, d in enumerate(group)
    )


def simulate_strategy(
    costed: CostedGraph, strategy: Strategy, *, bounds: LowerBounds | None = None
) -> StrategySimulation:
    """Simulate one training step of ``strategy``; ``costed`` is costed at the per-replica batch.
    ``bounds``: ``costed``'s lower bounds, when a search scoring many strategies of one graph
    has them (:func:`~partitioner.simulation.bounds.costed_lower_bounds`)."""
    if len(strategy.stage_of_layer) != len(costed.layer_memory):
        raise PlanError(
            f"the strategy places {len(strategy.stage_of_layer)} layers, the graph has "
            f"{len(costed.layer_memory)}"
        )
    topology = costed.topology
    bounds = bounds or costed_lower_bounds(costed)
    replica_step_s, peak, first = _replicas(_as_run(costed, strategy), strategy, bounds)
    replica_step_s = _computing_together(costed, strategy, replica_step_s)
    grads, sparse, algorithm, all_reduce_s = _all_reduce(costed, strategy)
    return StrategySimulation(
        strategy=strategy,
        replica_step_s=replica_step_s,
        all_reduce_s=all_reduce_s,
        algorithm=algorithm,
        gradient_bytes=grads,
        peak_memory_bytes=tuple(peak),
        memory_limit_bytes=tuple(d.memory_bytes for d in topology.devices),
        replica=first,
        sparse_gradient_bytes=sparse if any(sparse) else (),
        other_shares_feed_s=other_shares_feed_s(costed, strategy),
    )
