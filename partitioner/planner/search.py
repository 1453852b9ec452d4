"""The strategy planner: every family, scored by the simulated step of what would run.

For ``N`` devices and a global batch ``B`` the planner enumerates strategies of ``R`` replicas x
``S`` stages with ``R * S <= N``, ``R`` dividing ``B`` (replicas take equal shares, as
``tf.distribute`` splits a batch) and ``S`` at most the model's layers (a stage holds one or more
layers). Shapes with ``R * S < N`` leave devices idle, and win when fewer devices are faster (an
all-reduce over fewer replicas, fewer transfers); a model of fewer layers than devices uses them
all only through replicas:

* **device groups**: replica ``r``'s stage ``s`` on a device chosen from the topology, in two
  layouts: stages next to each other on a host (replicas across hosts), or replicas next to each
  other (stages across hosts); both are scored where they differ. On a topology of several device
  types a third layout puts each stage position of every replica on one type (the fastest type
  with enough devices first), when neither of the two already does on the same devices;
* **stage placement** (``S > 1``): the layer placement solvers of :mod:`partitioner.solvers`
  (METIS, PipeDream's DP, time / parameter balance, ...) run on replica 0's devices, with the
  costs of the per-replica batch; a pipeline's stages are made acyclic;
* **micro-batches** (``S > 1``): none (a plain split), or ``M`` dividing ``B / R`` up to
  ``max_microbatches_per_stage * S``, under each schedule asked for.

Every candidate is scored by :func:`~partitioner.simulation.strategy.simulate_strategy`, the step
the rewrite would run, with the costs of its own per-replica batch (``costed_at(B / R)``). The
best candidate that fits in memory wins; when none fits, the one that overflows least is
returned and says so.

**What is not simulated.** Shapes are scored in the order of a lower bound on their step (the
work over their devices, the largest layer, the critical path of a micro-batch; shapes whose
devices cannot hold the model's weights last), and results are listed in enumeration order
whatever order they were scored in. A candidate is not simulated when a lower bound on its step
(:func:`~partitioner.simulation.strategy.strategy_lower_bound_s`: its busiest device, the
critical path, its exact all-reduce) is above the step of a candidate of its family that fits,
or its weights alone overflow a device while one of its family fits (a shape is not even placed
when its bound already says so): exact, the choice and every family's best are those of
simulating everything (``StrategyOptions.prune=False`` does). Past the time limit a shape is
placed by the first solver only, and a shape whose families all have a candidate that fits is
not scored at all: :attr:`StrategySearch.notes` names those shapes and the least step any of
them could reach, against the choice. When the choice leaves devices idle and no candidate on
all of them was simulated, data parallelism over every device is (so the plan can say what using
them all costs: :func:`~partitioner.planner.explain.idle_advice`). The best pipeline or split is
then refined by :func:`~partitioner.planner.refine.refine`, scored the same way. The planner never
returns a strategy slower than a candidate it evaluated, ``single`` included.

Bad input gets one line, never a silent skip: families forced by ``options.families`` (the API's
``strategy=``) that do not fit name the bytes a replica needs, the limit, and what fits (the
smallest hybrid ``R x S`` when data parallelism was forced); forced families that the batch
leaves no replica count (or pipeline no micro-batch count) name the batch sizes that would
work. ``StrategySearch.notes`` says which replica counts the batch ruled out, and when the best
data-parallel or hybrid candidate's replicas run on different device types, each type's replica
time: ``tf.distribute`` gives every replica an equal share, so the slowest paces the step
(uneven shares are not planned: the rewrite does not run them). A share of the batch the
model's own code fails at (a layer that takes only some batches) leaves out the candidates that
need it, and a note names the first failure; when that leaves no candidate, the failure is the
error, naming the share and what changes it (:class:`~partitioner.core.batching.BatchShare`).
Shares that ``costed_at`` only derived from traces at other batches never ran the model's code,
so the best candidate's shares are run for real (``confirm``) before it is returned, and one
that fails there is left out the same way.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

from cost_models.devices.catalog import get_device_type
from partitioner.core.batching import BatchShare, at_share
from partitioner.core.errors import InfeasibleError, PartitionError, PlanError, UsageError
from partitioner.core.ir import CostedGraph, PartitionProblem, Schedule, Topology
from partitioner.core.options import DEFAULT_SCHEDULE
from partitioner.core.strategy import Family, Strategy
from partitioner.core.units import format_bytes, format_seconds
from partitioner.planner.refine import refine
from partitioner.simulation.bounds import LowerBounds, costed_lower_bounds
from partitioner.simulation.strategy import (
    StrategySimulation,
    microbatch_costed,
    simulate_strategy,
    static_overflow,
    strategy_lower_bound_s,
)
from partitioner.solvers import get_solver
from partitioner.solvers.stages import make_acyclic

__all__ = [
    "StrategyCandidate",
    "StrategyOptions",
    "StrategySearch",
    "accepted_replicas",
    "device_layouts",
    "microbatch_choices",
    "search_batches",
    "search_strategies",
    "sub_problem",
    "uneven_share_reason",
    "uses_every_device",
]

logger = logging.getLogger(__name__)

CostedAt = Callable[[int], CostedGraph]
"""The model costed at a per-replica batch size, on the whole topology."""

Confirm = Callable[[int], None]
"""Runs the model's own code at a batch size for real (a trace), raising its
:class:`~partitioner.core.errors.PartitionError` there: ``costed_at`` may only derive a batch's
graph from traces at others (:func:`~partitioner.core.batching.graph_at_batch`)."""


@dataclass(frozen=True)
class StrategyOptions:
    """How the planner searches (see the module docstring)."""

    families: tuple[Family, ...] = tuple(Family)
    placement_solvers: tuple[str, ...] = ("dp", "time", "even", "metis")
    schedules: tuple[Schedule, ...] = (DEFAULT_SCHEDULE,)
    max_microbatches_per_stage: int = 4
    refine: bool = True
    seed: int = 0
    time_limit_s: float = 5.0
    refine_limit_s: float | None = None
    """The refinement's safety cap (None: ``time_limit_s``); its move budget ends it first on
    any model the cap leaves time for (:func:`~partitioner.planner.refine.refine`)."""
    also_score: tuple[tuple[Strategy, str], ...] = ()
    """Strategies placed elsewhere (a plan's own solver's split), each with the name of what placed
    it, scored beside the search's own when their family is asked for."""
    prune: bool = True
    """Skip simulating a candidate whose lower bounds show it cannot be its family's best (exact:
    the choice and every family's best are unchanged; :attr:`StrategySearch.candidates` then
    lists only what was simulated). ``False`` simulates every candidate."""


@dataclass(frozen=True)
class StrategyCandidate:
    """One strategy the planner scored, with the solver that placed its stages."""

    simulation: StrategySimulation
    placement: str
    """The solver that placed the layers on the stages (``"-"`` for one stage)."""
    replica_device_types: tuple[str, ...] = ()
    """The device type(s) of each replica's stages (``"a100-80gb+v100"`` for a mixed replica);
    empty when not known."""

    @property
    def strategy(self) -> Strategy:
        return self.simulation.strategy

    @property
    def step_time_s(self) -> float:
        return self.simulation.step_time_s

    def rank(self) -> tuple[bool, float, float]:
        """Sort key: fitting first, then the predicted step, then the memory overflow."""
        over = sum(need - limit for _, need, limit in self.simulation.over_memory)
        return (not self.simulation.fits, self.step_time_s if self.simulation.fits else over, self.step_time_s)


@dataclass(frozen=True)
class StrategySearch:
    """What the planner scored, and its choice."""

    best: StrategyCandidate
    candidates: tuple[StrategyCandidate, ...]
    rejected: tuple[tuple[str, str], ...] = ()
    """``(what, why)`` of every candidate that could not be scored."""
    notes: tuple[str, ...] = field(default=())
    refused: tuple[Family, ...] = ()
    """The families asked for that have no candidate because the model's own code fails at every
    share of the batch they would run (a replica's, a micro-batch): advice must not name them."""

    def best_per_family(self) -> dict[Family, StrategyCandidate]:
        """The best candidate of each family that was scored."""
        out: dict[Family, StrategyCandidate] = {}
        for c in sorted(self.candidates, key=StrategyCandidate.rank):
            out.setdefault(c.strategy.family, c)
        return out


def device_layouts(topology: Topology, replicas: int, stages: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The distinct device groupings of ``replicas`` x ``stages`` (see the module docstring)."""
    order = sorted(range(topology.num_devices), key=lambda d: (topology.devices[d].host, d))
    used = order[: replicas * stages]
    stages_together = tuple(tuple(used[r * stages : (r + 1) * stages]) for r in range(replicas))
    replicas_together = tuple(
        tuple(used[s * replicas + r] for s in range(stages)) for r in range(replicas)
    )
    layouts = [stages_together]
    if replicas_together != stages_together:
        layouts.append(replicas_together)
    alike = _alike_layout(topology, order, replicas, stages)
    if alike is not None and not any(_same_alike(topology, x, alike) for x in layouts):
        layouts.append(alike)
    return tuple(layouts)


def _same_alike(
    topology: Topology, layout: tuple[tuple[int, ...], ...], alike: tuple[tuple[int, ...], ...]
) -> bool:
    """``layout`` already keeps each stage position on one device type, on ``alike``'s devices."""
    types = [{topology.devices[g[s]].device_type for g in layout} for s in range(len(layout[0]))]
    used = {d for g in layout for d in g}
    return all(len(t) == 1 for t in types) and used == {d for g in alike for d in g}


def _alike_layout(
    topology: Topology, order: list[int], replicas: int, stages: int
) -> tuple[tuple[int, ...], ...] | None:
    """Replicas whose stage ``s`` all run on one device type (the fastest type with ``replicas``
    devices left first), so that no replica paces the others; ``None`` for one replica or when
    the topology has too few alike devices."""
    if replicas == 1:
        return None
    left: dict[str, list[int]] = {}
    for d in order:
        left.setdefault(topology.devices[d].device_type, []).append(d)
    speed = {name: _peak_flops(name) for name in left}
    positions = []
    for _ in range(stages):
        enough = [name for name in left if len(left[name]) >= replicas]
        if not enough:
            return None
        name = max(enough, key=lambda n: speed[n])  # max keeps the first of equals: host order
        positions.append(left[name][:replicas])
        left[name] = left[name][replicas:]
    return tuple(tuple(positions[s][r] for s in range(stages)) for r in range(replicas))


def _peak_flops(device_type: str) -> float:
    """The catalog's fp32 peak of ``device_type`` (0 when the catalog does not know it)."""
    try:
        return get_device_type(device_type).peak_flops("fp32")
    except PartitionError:
        return 0.0


def microbatch_choices(batch_per_replica: int, stages: int, most_per_stage: int) -> tuple[int, ...]:
    """Micro-batch counts to try: 1 (no pipelining) and the divisors of the batch among
    ``stages``, ``2 * stages``, ..., up to ``most_per_stage * stages`` (the largest divisor up to
    that when none of them divides)."""
    if stages == 1:
        return (1,)
    limit = min(batch_per_replica, most_per_stage * stages)
    wanted = [m for m in range(stages, limit + 1, stages) if batch_per_replica % m == 0]
    if not wanted:
        wanted = [m for m in range(2, limit + 1) if batch_per_replica % m == 0][-1:]
    return (1, *sorted(set(wanted)))


def search_batches(
    num_devices: int,
    batch_size: int,
    options: StrategyOptions | None = None,
    num_layers: int | None = None,
) -> tuple[int, ...]:
    """Every batch :func:`search_strategies` costs the model at on ``num_devices`` devices
    (descending): ``batch_size`` itself, each replica count's share, each micro-batch.
    ``num_layers`` (the model's placement units) bounds the stages; ``None``: one per device,
    a superset of the batches priced."""
    options = options or StrategyOptions()
    max_stages = num_devices if num_layers is None else num_layers
    shapes = list(_shapes(num_devices, batch_size, options.families, max_stages))
    batches = {batch_size} | {
        batch_size // (r * m) for r, m in _priced_keys(batch_size, shapes, options)
    }
    return tuple(sorted(batches, reverse=True))


def _priced_keys(
    batch_size: int, shapes: list[tuple[int, int]], options: StrategyOptions
) -> Iterator[tuple[int, int]]:
    """``(R, M)``: each replica count of ``shapes`` with each micro-batch count it is scored at
    (micro-batches only when a pipelining family is asked for: a plain split runs whole
    batches, and a model with a fixed batch cannot be traced at a micro-batch)."""
    pipelines = bool({Family.PIPELINE, Family.HYBRID} & set(options.families))
    for replicas, stages in shapes:
        per_replica = batch_size // replicas
        most = options.max_microbatches_per_stage
        for m in microbatch_choices(per_replica, stages, most) if pipelines else (1,):
            yield replicas, m


def sub_problem(problem: PartitionProblem, devices: tuple[int, ...]) -> PartitionProblem:
    """``problem`` on ``devices`` only, renumbered ``0..len(devices)-1`` in that order."""
    topo = problem.topology
    index = {d: i for i, d in enumerate(devices)}
    links = tuple(
        (min(index[a], index[b]), max(index[a], index[b]), link)
        for a, b, link in topo.links
        if a in index and b in index
    )
    sub_topology = Topology(
        devices=tuple(replace(topo.devices[d], index=i) for i, d in enumerate(devices)),
        link=topo.link,
        inter_host_link=topo.inter_host_link if len({topo.devices[d].host for d in devices}) > 1 else None,
        links=links,
    )
    return replace(
        problem,
        compute_time_s=tuple(problem.compute_time_s[d] for d in devices),
        topology=sub_topology,
    )


def _stage_placements(
    costed: CostedGraph,
    group: tuple[int, ...],
    solvers: tuple[str, ...],
    options: StrategyOptions,
    pipelined: bool,
) -> Iterator[tuple[str, tuple[int, ...]] | tuple[str, PartitionError]]:
    """``(solver, stage of each layer)`` from each of ``solvers`` on ``group``'s devices."""
    problem = sub_problem(costed.problem(), group)
    seen: set[tuple[int, ...]] = set()
    for name in solvers:
        solver = get_solver(name, seed=options.seed, time_limit_s=options.time_limit_s)
        try:
            stages = solver.solve(problem).assignment
            if pipelined:
                stages = make_acyclic(stages, problem)
        except PartitionError as exc:
            yield name, exc
            continue
        if stages not in seen:
            seen.add(stages)
            yield name, stages


def _shapes(
    num_devices: int, batch_size: int, families: tuple[Family, ...], max_stages: int
) -> Iterator[tuple[int, int]]:
    """``(R, S)`` pairs worth scoring for the families asked for: ``R`` divides the batch."""
    for replicas, stages in _all_shapes(num_devices, families, max_stages):
        if batch_size % replicas == 0:
            yield replicas, stages


def _all_shapes(
    num_devices: int, families: tuple[Family, ...], max_stages: int
) -> Iterator[tuple[int, int]]:
    """``(R, S)`` pairs of the families asked for with ``R * S <= num_devices`` and
    ``S <= max_stages`` (the model's layers: each stage holds one or more), any batch."""
    for replicas in range(1, num_devices + 1):
        for stages in range(1, min(num_devices // replicas, max_stages) + 1):
            kinds = _families_of(replicas, stages)
            if any(f in families for f in kinds):
                yield replicas, stages


_SPLITS = (Family.DATA_PARALLEL, Family.PIPELINE, Family.HYBRID)
"""The families that run shares of the batch (replicas' shares, micro-batches)."""


def _families_of(replicas: int, stages: int) -> tuple[Family, ...]:
    if replicas == 1 and stages == 1:
        return (Family.SINGLE,)
    if stages == 1:
        return (Family.DATA_PARALLEL,)
    if replicas > 1:
        return (Family.HYBRID,)
    return (Family.PIPELINE, Family.PLACED)


PRUNE_SLACK = 1e-9
"""Relative slack before a lower bound prunes a candidate: the simulators add the same times in
another order, so a bound may exceed the simulated step by rounding."""


@dataclass(frozen=True)
class _Item:
    """One device layout of one ``R x S`` shape: the unit the search orders and prunes."""

    order: int
    """Its position in the enumeration (shapes by ``R`` then ``S``, then layouts): results are
    listed in this order whatever order they were scored in, so ties resolve as before."""
    replicas: int
    stages: int
    groups: tuple[tuple[int, ...], ...]
    bound_s: tuple[tuple[Family, float], ...]
    """Per family it can yield: a lower bound on the step of any of its candidates."""
    overflows: bool
    """Replica 0's devices cannot hold the model's weights, gradients and optimizer slots."""

    def key(self) -> tuple[bool, float, int]:
        """Scoring order: what may fit first, then the smallest bound, then enumeration."""
        return (self.overflows, self.least_s, self.order)

    @property
    def least_s(self) -> float:
        return min(b for _, b in self.bound_s)

    def describe(self) -> str:
        return f"{self.replicas} x {self.stages}"


class _Scorer:
    """Scores strategies, remembering the costed graph of each batch (a replica's, a
    micro-batch's) and the lower bounds of each graph a strategy is simulated on; skips a
    candidate that a lower bound shows cannot be its family's best (:meth:`prunable`)."""

    def __init__(
        self, costed_at: CostedAt, batch_size: int, deadline: float, prune: bool = True
    ) -> None:
        self._costed_at = costed_at
        self.prune = prune
        self.batch_size = batch_size
        self._costed: dict[int, CostedGraph] = {}
        self._priced: dict[tuple[int, int], tuple[CostedGraph, LowerBounds]] = {}
        self.deadline = deadline
        self.candidates: list[StrategyCandidate] = []
        self.rejected: list[tuple[str, str]] = []
        self.best_fit_s: dict[Family, float] = {}
        """Per family, the fastest simulated step of a candidate that fits."""
        self.pruned = 0
        self.unplaced: list[_Item] = []
        self.cut: list[_Item] = []
        self.position = (0, 0)
        self._keys: list[tuple[int, int]] = []
        self._rejected_keys: list[tuple[int, int]] = []
        self.failed: dict[int, PartitionError] = {}
        """Each share of the batch the model could not be costed at (its own code fails there:
        a layer that takes only some batches), with the error, worded as that share."""
        self.confirmed: set[int] = {batch_size}
        """The batches the model's code was run at for real (:meth:`confirms`)."""

    def at(self, share: BatchShare) -> CostedGraph:
        """The model costed at ``share`` of the batch (``costed_at``, once per batch); an error
        there says which share it was (:func:`at_share`), and is kept: the shapes that need
        that batch are not scored (:meth:`usable`)."""
        batch = share.size
        if batch in self.failed:
            raise self.failed[batch]
        if batch not in self._costed:
            try:
                self._costed[batch] = self._costed_at(batch)
            except PartitionError as exc:
                if batch == self.batch_size:
                    raise
                self.failed[batch] = at_share(exc, share)
                raise self.failed[batch] from exc
        return self._costed[batch]

    def usable(self, replicas: int, num_microbatches: int = 1) -> bool:
        """Whether the model was costed, or may be, at the batch of ``replicas`` and
        ``num_microbatches`` (and at the replica's share it is cut from)."""
        share = self.batch_size // replicas
        return share not in self.failed and share // num_microbatches not in self.failed

    def confirms(self, strategy: Strategy, confirm: Confirm) -> bool:
        """Whether the model's code runs for real at the shares ``strategy`` runs (a replica's,
        its micro-batch), each run once by ``confirm``; a share it fails at is kept in
        :attr:`failed`, worded as that share (:meth:`usable` then leaves out what needs it)."""
        counts = sorted({1, strategy.num_microbatches})
        for share in (BatchShare(self.batch_size, strategy.replicas, m) for m in counts):
            if share.size in self.confirmed:
                continue
            try:
                confirm(share.size)
            except PartitionError as exc:
                self.failed[share.size] = at_share(exc, share)
                return False
            self.confirmed.add(share.size)
        return True

    def again(self) -> _Scorer:
        """A scorer for scoring every shape again, keeping this one's costs, failures, confirmed
        shares and deadline (the time limit bounds every round together)."""
        fresh = _Scorer(self._costed_at, self.batch_size, self.deadline, self.prune)
        fresh._costed, fresh._priced = self._costed, self._priced
        fresh.failed, fresh.confirmed = self.failed, self.confirmed
        return fresh

    def microbatches(self, replicas: int, stages: int, options: StrategyOptions) -> tuple[int, ...]:
        """:func:`microbatch_choices` of a replica's share, but those the model fails at."""
        most = options.max_microbatches_per_stage
        choices = microbatch_choices(self.batch_size // replicas, stages, most)
        return tuple(m for m in choices if self.usable(replicas, m))

    def costed(self, replicas: int) -> CostedGraph:
        return self.at(BatchShare(self.batch_size, replicas))

    def priced(self, replicas: int, num_microbatches: int) -> tuple[CostedGraph, LowerBounds]:
        """The graph a strategy of ``replicas`` and ``num_microbatches`` is simulated on (a
        replica's batch, its ops priced at the micro-batch: :func:`microbatch_costed`) and its
        lower bounds, each computed once."""
        key = (replicas, num_microbatches)
        if key not in self._priced:
            costed = self.costed(replicas)
            if num_microbatches > 1:
                micro = self.at(BatchShare(self.batch_size, replicas, num_microbatches))
                costed = microbatch_costed(costed, micro, num_microbatches)
            self._priced[key] = (costed, costed_lower_bounds(costed))
        return self._priced[key]

    def prunable(self, family: Family, bound_s: float, overflows: bool) -> bool:
        """Whether a candidate of ``family`` whose step is at least ``bound_s`` (and which surely
        does not fit, when ``overflows``) cannot be its family's best: a candidate of the family
        that fits is already faster, or as fast and listed first. Exact: a candidate that does
        not fit ranks after every one that fits."""
        best = self.best_fit_s.get(family)
        return best is not None and (overflows or bound_s * (1 - PRUNE_SLACK) > best)

    def score(self, strategy: Strategy, placement: str, *, prune: bool = True) -> StrategyCandidate | None:
        """Simulate ``strategy`` unless ``prune`` and its lower bounds show it cannot be its
        family's best (counted in :attr:`pruned`)."""
        self.position = (self.position[0], self.position[1] + 1)
        try:
            costed, bounds = self.priced(strategy.replicas, strategy.num_microbatches)
            if prune and self.prune and self.prunable(
                strategy.family,
                strategy_lower_bound_s(costed, strategy, bounds),
                static_overflow(costed, strategy),
            ):
                self.pruned += 1
                return None
            sim = simulate_strategy(costed, strategy, bounds=bounds)
        except PartitionError as exc:
            self.reject(f"{strategy.describe()} ({placement})", str(exc))
            return None
        candidate = _candidate(sim, placement, costed.topology)
        self.candidates.append(candidate)
        self._keys.append(self.position)
        if sim.fits:
            family = strategy.family
            self.best_fit_s[family] = min(self.best_fit_s.get(family, math.inf), sim.step_time_s)
        return candidate

    def reject(self, what: str, why: str) -> None:
        self.rejected.append((what, why))
        self._rejected_keys.append(self.position)

    def in_enumeration_order(self) -> None:
        """List the candidates and rejections in enumeration order, not scoring order."""
        pairs = sorted(zip(self._keys, self.candidates), key=lambda kv: kv[0])
        self.candidates = [c for _, c in pairs]
        self._keys = [k for k, _ in pairs]
        done = sorted(zip(self._rejected_keys, self.rejected), key=lambda kv: kv[0])
        self.rejected = [r for _, r in done]
        self._rejected_keys = [k for k, _ in done]


def _candidate(sim: StrategySimulation, placement: str, topology: Topology) -> StrategyCandidate:
    types = tuple(
        "+".join(dict.fromkeys(topology.devices[d].device_type for d in group))
        for group in sim.strategy.device_groups
    )
    return StrategyCandidate(simulation=sim, placement=placement, replica_device_types=types)


def _items(
    scorer: _Scorer, shapes: list[tuple[int, int]], options: StrategyOptions
) -> list[_Item]:
    """Every (shape, layout) with its lower bounds, in the order they are scored."""
    items: list[_Item] = []
    for replicas, stages in shapes:
        costed = scorer.costed(replicas)
        for groups in device_layouts(costed.topology, replicas, stages):
            bound_s = _item_bounds(scorer, replicas, groups, options)
            if not bound_s:
                continue
            static = sum(
                m.param_bytes + m.gradient_bytes + m.optimizer_bytes for m in costed.layer_memory
            )
            room = sum(costed.topology.devices[d].memory_bytes for d in groups[0])
            bounds = tuple(bound_s.items())
            items.append(_Item(len(items), replicas, stages, groups, bounds, static > room))
    return sorted(items, key=_Item.key)


def _item_bounds(
    scorer: _Scorer,
    replicas: int,
    groups: tuple[tuple[int, ...], ...],
    options: StrategyOptions,
) -> dict[Family, float]:
    """Per family ``groups`` can yield, a lower bound on the step of any of its candidates:
    the least over its micro-batch counts ``M`` of the largest of the work over ``S`` devices
    (each layer at its fastest device's time), the largest layer and the critical path of one
    micro-batch; with one stage, :func:`strategy_lower_bound_s` itself (all-reduce included)."""
    stages = len(groups[0])
    out: dict[Family, float] = {}
    if stages == 1:
        n_layers = len(scorer.costed(replicas).layer_memory)
        strategy = Strategy(device_groups=groups, stage_of_layer=(0,) * n_layers)
        if strategy.family in options.families:
            costed, bounds = scorer.priced(replicas, 1)
            out[strategy.family] = strategy_lower_bound_s(costed, strategy, bounds)
        return out
    for m in scorer.microbatches(replicas, stages, options):
        family = Family.PLACED if m == 1 else (Family.PIPELINE if replicas == 1 else Family.HYBRID)
        if family not in options.families or (m == 1 and replicas > 1):
            continue
        costed, bounds = scorer.priced(replicas, m)
        work_s = bounds.work_s * costed.topology.num_devices / stages
        bound = max(work_s, bounds.largest_layer_s, bounds.critical_path_s / m)
        out[family] = min(out.get(family, math.inf), bound)
    return out


def _score_item(scorer: _Scorer, item: _Item, options: StrategyOptions) -> None:
    """Score ``item``'s candidates, unless bounds show that none can be its family's best
    (then it is not even placed) or, past the time limit, its families already have a
    candidate that fits (noted as cut)."""
    scorer.position = (item.order, 0)
    if scorer.prune and all(scorer.prunable(f, b, item.overflows) for f, b in item.bound_s):
        scorer.unplaced.append(item)
        return
    late = time.monotonic() > scorer.deadline
    if scorer.prune and late and all(f in scorer.best_fit_s for f, _ in item.bound_s):
        scorer.cut.append(item)
        return
    if item.stages == 1:
        n_layers = len(scorer.costed(item.replicas).layer_memory)
        scorer.score(Strategy(device_groups=item.groups, stage_of_layer=(0,) * n_layers), "-")
        return
    micro = scorer.microbatches(item.replicas, item.stages, options)
    _score_placements(scorer, item.groups, micro, options, item.replicas)


def _score_placements(
    scorer: _Scorer,
    groups: tuple[tuple[int, ...], ...],
    micro: tuple[int, ...],
    options: StrategyOptions,
    replicas: int,
) -> None:
    costed = scorer.costed(replicas)
    # replicas of a plain split: the rewrite runs a hybrid's replicas as pipelines only
    want_plain = Family.PLACED in options.families and replicas == 1
    pipelined_counts = [m for m in micro if m > 1]
    for pipelined in (False, True):
        counts = pipelined_counts if pipelined else ([1] if want_plain else [])
        if not counts:
            continue
        # Past the time limit a shape is scored with the first placement solver only.
        solvers = options.placement_solvers
        if time.monotonic() > scorer.deadline:
            solvers = solvers[:1]
        for name, found in _stage_placements(costed, groups[0], solvers, options, pipelined):
            if isinstance(found, PartitionError):
                scorer.reject(f"{len(groups)} x {len(groups[0])} by {name}", str(found))
                continue
            for m in counts:
                for schedule in options.schedules if m > 1 else (Schedule.NONE,):
                    strategy = Strategy(groups, found, m, schedule)
                    if strategy.family in options.families:
                        scorer.score(strategy, name)


def search_strategies(
    costed_at: CostedAt,
    batch_size: int,
    options: StrategyOptions | None = None,
    *,
    confirm: Confirm | None = None,
) -> StrategySearch:
    """Score every strategy family and return the best (see the module docstring).

    The costs of every per-replica batch are computed first; ``options.time_limit_s`` bounds the
    search and the refinement, not the costing. With ``confirm``, the model's code is run for
    real at the shares of the batch the best candidate runs before it is returned; a share it
    fails at is left out and every shape scored again (a bound may have skipped the next best
    because of the candidate that failed), until a best runs or none is left (the error)."""
    options = options or StrategyOptions()
    if batch_size < 1:
        raise UsageError(f"batch_size={batch_size} must be >= 1")
    first = costed_at(batch_size)
    num_devices, num_layers = first.topology.num_devices, first.problem().num_layers
    shapes = _checked_shapes(num_devices, batch_size, options, num_layers)
    scorer = _Scorer(costed_at, batch_size, deadline=0.0, prune=options.prune)
    best = _scored_best(scorer, shapes, options, num_devices)
    while confirm is not None and not scorer.confirms(best.strategy, confirm):
        scorer = scorer.again()
        best = _scored_best(scorer, shapes, options, num_devices)
    if not best.simulation.fits and set(options.families) != set(Family):
        raise InfeasibleError(_forced_family_message(costed_at, batch_size, options, best))
    best, refined = _refined(scorer, best, options)
    skipped = _skipped_note(
        num_devices, batch_size, options.families, num_layers, scorer.usable
    )
    failed, refused = _failed_notes(scorer, options)
    return StrategySearch(
        best=best,
        candidates=tuple(scorer.candidates),
        rejected=tuple(scorer.rejected),
        notes=(
            *skipped,
            *failed,
            *_pruned_notes(scorer, best, options),
            *refined,
            *_uneven_notes(scorer.candidates),
        ),
        refused=refused,
    )


def _scored_best(
    scorer: _Scorer, shapes: list[tuple[int, int]], options: StrategyOptions, num_devices: int
) -> StrategyCandidate:
    """Score ``shapes`` but the shares the model fails at (:meth:`_Scorer.usable`), the
    strategies of ``options.also_score`` too; the best candidate. The time limit starts at the
    first round's scoring, after its costing."""
    shapes = _cost_first(scorer, shapes, options)
    items = _items(scorer, shapes, options)
    if not scorer.deadline:
        scorer.deadline = time.monotonic() + options.time_limit_s
    for item in items:
        _score_item(scorer, item, options)
    scorer.in_enumeration_order()
    scorer.position = (len(items), 0)
    for strategy, placement in options.also_score:
        if strategy.family in options.families and strategy not in _scored(scorer):
            scorer.score(strategy, placement, prune=False)
    _check_scored(scorer, options, num_devices)
    best = min(scorer.candidates, key=StrategyCandidate.rank)
    if _score_all_devices(scorer, best, num_devices, options):
        best = min(scorer.candidates, key=StrategyCandidate.rank)
    return best


def _check_scored(scorer: _Scorer, options: StrategyOptions, num_devices: int) -> None:
    """A one-line error when no candidate was scored: the model's own failure at a share of the
    batch when that is why (it says which share, and what changes it), else the rejections."""
    if scorer.candidates:
        return
    if scorer.failed:
        raise next(iter(scorer.failed.values()))
    if not scorer.rejected:  # accepted_replicas said there would be
        raise PlanError(
            f"no strategy of strategy={_forced(options)!r} was scored at "
            f"batch_size={scorer.batch_size} on {num_devices} devices (accepted_replicas "
            "disagrees with the search: a bug)"
        )
    why = "; ".join(f"{what}: {reason}" for what, reason in scorer.rejected[:4])
    raise PlanError(f"no strategy of the families asked for could be scored ({why})")


def _score_all_devices(
    scorer: _Scorer, best: StrategyCandidate, num_devices: int, options: StrategyOptions
) -> bool:
    """When ``best`` leaves devices idle and no candidate simulated so far uses them all,
    simulate data parallelism over every device (when asked for and the batch splits over them):
    the plan then says what using them all costs (:func:`uses_every_device`). Whether it did."""
    if len(best.strategy.devices) == num_devices or uses_every_device(scorer.candidates):
        return False
    if Family.DATA_PARALLEL not in options.families or scorer.batch_size % num_devices:
        return False
    if not scorer.usable(num_devices):
        return False
    costed = scorer.costed(num_devices)
    groups = device_layouts(costed.topology, num_devices, 1)[0]
    for items in (scorer.unplaced, scorer.cut):  # its shape is scored now: no note says it is not
        items[:] = [i for i in items if (i.replicas, i.stages) != (num_devices, 1)]
    strategy = Strategy(device_groups=groups, stage_of_layer=(0,) * len(costed.layer_memory))
    return scorer.score(strategy, "-", prune=False) is not None


def uses_every_device(candidates: Iterable[StrategyCandidate]) -> StrategyCandidate | None:
    """The best of ``candidates`` (fitting first, then the step) that uses every device of the
    topology; ``None`` when none does."""
    every = [
        c for c in candidates if len(c.strategy.devices) == len(c.simulation.memory_limit_bytes)
    ]
    return min(every, key=StrategyCandidate.rank, default=None)


def _scored(scorer: _Scorer) -> set[Strategy]:
    return {c.strategy for c in scorer.candidates}


def _cost_first(
    scorer: _Scorer, shapes: list[tuple[int, int]], options: StrategyOptions
) -> list[tuple[int, int]]:
    """Cost every batch the shapes will be scored at (a replica's, each micro-batch's) before the
    search's time limit starts: the limit bounds the search, not the costing. The shapes left
    to score: not those whose replica's share the model's own code fails at
    (:attr:`_Scorer.failed`; the micro-batches it fails at are left out by
    :meth:`_Scorer.microbatches`)."""
    for replicas, m in _priced_keys(scorer.batch_size, shapes, options):
        if not scorer.usable(replicas, m):
            continue
        try:
            scorer.priced(replicas, m)
        except PartitionError:
            if scorer.usable(replicas, m):  # not the model failing at a share: a real error
                raise
    return [(r, s) for r, s in shapes if scorer.usable(r)]


def _failed_notes(
    scorer: _Scorer, options: StrategyOptions
) -> tuple[tuple[str, ...], tuple[Family, ...]]:
    """What the model's failures at shares of the batch left unscored: a note with the first
    failure, and the families asked for that got no candidate for it."""
    if not scorer.failed:
        return (), ()
    scored = {c.strategy.family for c in scorer.candidates}
    refused = tuple(f for f in options.families if f not in scored and f in _SPLITS)
    sizes = _words(sorted(scorer.failed, reverse=True), "and")
    first = next(iter(scorer.failed.values()))
    names = f" ({', '.join(f.value for f in refused)} not compared)" if refused else ""
    note = f"strategies on shares of the batch of {sizes} not scored{names}: {first}"
    return (note,), refused


def _pruned_notes(
    scorer: _Scorer, best: StrategyCandidate, options: StrategyOptions
) -> tuple[str, ...]:
    """What was not simulated: exactly (a bound), and what the time limit cut."""
    notes = []
    parts = []
    if scorer.pruned:
        parts.append(f"{scorer.pruned} candidate{'s' if scorer.pruned > 1 else ''} not simulated")
    if scorer.unplaced:
        parts.append(f"shapes {_words(_shapes_of(scorer.unplaced), 'and')} not placed")
    if parts:
        notes.append(
            " and ".join(parts)
            + ": a lower bound on each step (the busiest device, the critical path, the "
            "all-reduce) is above a candidate of its family that fits, or its weights alone "
            "overflow a device; the choice and each family's best are those of simulating all"
        )
    if scorer.cut:
        least = min(item.least_s for item in scorer.cut)
        verdict = (
            "none of them could have been chosen"
            if least * (1 - PRUNE_SLACK) > best.step_time_s
            else f"one might have been faster than the {format_seconds(best.step_time_s)} chosen"
        )
        notes.append(
            f"past the time limit (time_limit_s={options.time_limit_s:g}) shapes "
            f"{_words(_shapes_of(scorer.cut), 'and')} not scored, their families having a "
            f"candidate that fits: their steps are at least {format_seconds(least)}, so {verdict}"
        )
    return tuple(notes)


def _shapes_of(items: list[_Item]) -> list[str]:
    """``R x S`` of each item's shape, each once, in enumeration order (the first six, then
    how many more)."""
    shapes = list(dict.fromkeys(i.describe() for i in sorted(items, key=lambda i: i.order)))
    if len(shapes) > 8:
        return [*shapes[:6], f"{len(shapes) - 6} more"]
    return shapes


def _refined(
    scorer: _Scorer, best: StrategyCandidate, options: StrategyOptions
) -> tuple[StrategyCandidate, tuple[str, ...]]:
    """``best`` improved by :func:`~partitioner.planner.refine.refine`, when it has stages. The
    chain's move budget, not the time left, ends it, so a run gives the same plan on a busy
    machine as on a quiet one; ``time_limit_s`` caps it only for safety, and a plan it cut says
    so."""
    if not options.refine or best.strategy.stages == 1:
        return best, ()
    cap = options.refine_limit_s or options.time_limit_s
    run = refine(
        scorer.priced(best.strategy.replicas, best.strategy.num_microbatches)[0],
        best.simulation,
        seed=options.seed,
        time_limit_s=cap,
    )
    cut = (
        (
            f"the refinement by the simulated step stopped at time_limit_s={cap:g}"
            f" after {run.moves} moves: a run on a busier machine may stop elsewhere and plan "
            "otherwise; raise time_limit_s for the same plan every run",
        )
        if run.cut_by_time
        else ()
    )
    refined = run.best
    if refined.step_time_s >= best.step_time_s or refined.fits < best.simulation.fits:
        return best, cut
    note = (
        f"refined by the simulated step from {best.step_time_s:.6g} s to "
        f"{refined.step_time_s:.6g} s"
    )
    best = replace(best, simulation=refined, placement=f"{best.placement}+refine")
    scorer.candidates.append(best)
    return best, (note, *cut)


def _forced_family_message(
    costed_at: CostedAt, batch_size: int, options: StrategyOptions, best: StrategyCandidate
) -> str:
    """One line: what the closest strategy of the forced families needs, against the limit, and
    what fits instead (:func:`_what_fits`)."""
    device, need, limit = max(best.simulation.over_memory, key=lambda o: o[1] - o[2])
    forced = ", ".join(f.value for f in options.families)
    head = (
        f"strategy={forced!r} does not fit: with {best.strategy.describe()}, device {device} "
        f"needs {format_bytes(need, exact=True)} (a replica holds its stages' weights, "
        f"gradients and optimizer slots) and its limit is {format_bytes(limit, exact=True)}"
    )
    # every candidate: the smallest hybrid that fits need not be its family's fastest
    everything = replace(options, families=tuple(Family), refine=False, prune=False)
    try:
        found = search_strategies(costed_at, batch_size, everything)
    except PartitionError:
        return head + "; no strategy of any family fits: use more or larger devices"
    return f"{head}; {_what_fits(found, options)}"


def _what_fits(found: StrategySearch, options: StrategyOptions) -> str:
    """The smallest hybrid that fits when data parallelism was forced (it keeps the replicas),
    else the strategy with the fewest stages (then the fastest) of any family that fits."""
    fitting = [c for c in found.candidates if c.simulation.fits]
    if not fitting:
        return "no strategy of any family fits: use more or larger devices"
    hybrids = [c for c in fitting if c.strategy.family is Family.HYBRID]
    if Family.DATA_PARALLEL in options.families and hybrids:
        best = min(hybrids, key=lambda c: (c.strategy.stages, c.step_time_s))
        shape = f"{best.strategy.replicas} x {best.strategy.stages}"
        return (
            f"the smallest hybrid that fits is {shape} ({best.strategy.describe()}, "
            f"{format_seconds(best.step_time_s)} per step): strategy='hybrid'"
        )
    smallest = min(fitting, key=lambda c: (c.strategy.stages, c.step_time_s))
    return (
        f"the smallest strategy that fits is {smallest.strategy.describe()} "
        f"(strategy={smallest.strategy.family.value!r})"
    )


# -- batches that do not divide, replicas of different speeds ----------------------------------


def _words(items: list[int] | list[str], last: str = "or") -> str:
    """``1``, ``1 or 2``, ``1, 2 or 3`` (``last`` joins the last two)."""
    text = [str(i) for i in items]
    return text[0] if len(text) == 1 else f"{', '.join(text[:-1])} {last} {text[-1]}"


def _forced(options: StrategyOptions) -> str:
    return ", ".join(f.value for f in options.families)


def _checked_shapes(
    num_devices: int, batch_size: int, options: StrategyOptions, num_layers: int
) -> list[tuple[int, int]]:
    """The shapes to score; a one-line error when the families asked for leave none, or when
    none of them yields a candidate at this batch (:func:`accepted_replicas`)."""
    shapes = list(_shapes(num_devices, batch_size, options.families, num_layers))
    if shapes and accepted_replicas(num_devices, batch_size, options, num_layers):
        return shapes
    if shapes:
        raise UsageError(_microbatch_message(batch_size, num_devices, options, num_layers))
    counts = sorted({r for r, _ in _all_shapes(num_devices, options.families, num_layers)})
    if counts:
        message = _divisibility_message(batch_size, counts, num_devices, options, num_layers)
        raise UsageError(message)
    if not options.families:
        raise UsageError("StrategyOptions(families=()) asks for no strategy: name one or more")
    fewest = next(
        (n for n in range(1, 5) if any(_all_shapes(n, options.families, num_layers))), None
    )
    if fewest is None:
        raise InfeasibleError(
            f"strategy={_forced(options)!r} splits the model into 2 or more stages and it has "
            f"{num_layers} layer{'s' if num_layers != 1 else ''}: use strategy='data_parallel' "
            "or strategy='auto'"
        )
    raise InfeasibleError(
        f"strategy={_forced(options)!r} needs {fewest} or more devices and the topology has "
        f"{num_devices}: use {fewest} or more devices or strategy='auto'"
    )


def accepted_replicas(
    num_devices: int, batch_size: int, options: StrategyOptions, num_layers: int
) -> tuple[int, ...]:
    """The replica counts ``R`` with which :func:`search_strategies` scores a candidate of
    ``options.families`` at ``batch_size`` on ``num_devices`` devices (``num_layers``, the
    model's placement units, bound the stages): ``R`` divides the batch and, with stages, the
    families get a micro-batch count of the per-replica batch (:func:`microbatch_choices`:
    ``M > 1`` for a pipeline or hybrid, none for a plain split). Empty: the search refuses the
    batch, and its advice names the nearest batch sizes for which this is not empty."""
    shapes = _stages_by_replicas(num_devices, options, num_layers)
    found = {r for r, stages in shapes.items() if _accepts(batch_size, r, stages, options)}
    found |= {s.replicas for s, _ in options.also_score if s.family in options.families}
    return tuple(sorted(found))


def _stages_by_replicas(
    num_devices: int, options: StrategyOptions, num_layers: int
) -> dict[int, list[int]]:
    """Each replica count of the families asked for, with its stage counts (any batch)."""
    out: dict[int, list[int]] = {}
    for replicas, stages in _all_shapes(num_devices, options.families, num_layers):
        out.setdefault(replicas, []).append(stages)
    return out


def _accepts(batch_size: int, replicas: int, stages: list[int], options: StrategyOptions) -> bool:
    """Whether ``replicas`` replicas of one of ``stages`` stages yield a candidate of the families
    asked for at ``batch_size`` (the families :func:`_item_bounds` and :func:`_score_placements`
    score: one stage is data parallel or single; with stages, ``M = 1`` is a plain split of one
    replica, ``M > 1`` a pipeline, or a hybrid of several replicas)."""
    if batch_size % replicas:
        return False
    wanted = set(options.families)
    for s in stages:
        if s == 1:
            found = set(_families_of(replicas, 1))
        else:
            per_replica = batch_size // replicas
            micro = microbatch_choices(per_replica, s, options.max_microbatches_per_stage)
            found = {Family.PLACED} if replicas == 1 else set()
            if any(m > 1 for m in micro):
                found.add(Family.PIPELINE if replicas == 1 else Family.HYBRID)
        if found & wanted:
            return True
    return False


ADVICE_REACH = 64
"""How many multiples of a replica count on each side of a refused batch the advice tries."""


def _nearest_batches(
    batch_size: int, num_devices: int, options: StrategyOptions, num_layers: int, most: int = 3
) -> list[tuple[int, list[int]]]:
    """The batch sizes nearest ``batch_size`` that the search accepts (:func:`_accepts`, the rule
    :func:`accepted_replicas` applies), with the replica counts that accept each: for each
    replica count, its nearest accepted multiple below the batch and above it."""
    shapes = _stages_by_replicas(num_devices, options, num_layers)
    near: set[int] = set()
    for r, stages in shapes.items():
        base = batch_size // r * r
        below = range(base, max(0, base - ADVICE_REACH * r), -r)
        above = range(base + r, base + (ADVICE_REACH + 1) * r, r)
        for side in (below, above):
            ok = (m for m in side if m != batch_size and _accepts(m, r, stages, options))
            found = next(ok, None)
            if found is not None:
                near.add(found)
    chosen = sorted(near, key=lambda m: (abs(m - batch_size), m))[:most]
    return [(m, [r for r, st in shapes.items() if _accepts(m, r, st, options)]) for m in chosen]


def _advice(near: list[str]) -> str:
    return f"use batch_size={_words(near)}, or strategy='auto'" if near else "use strategy='auto'"


def _divisibility_message(
    batch_size: int,
    counts: list[int],
    num_devices: int,
    options: StrategyOptions,
    num_layers: int,
) -> str:
    """No replica count of the families asked for divides the batch."""
    nearest = _nearest_batches(batch_size, num_devices, options, num_layers)
    near = [f"{m} ({_words(rs)} replicas)" for m, rs in nearest]
    return (
        f"batch_size={batch_size} cannot be split evenly over {_words(counts)} data-parallel "
        f"replicas (tf.distribute gives each an equal share), the replica counts "
        f"strategy={_forced(options)!r} can use on {num_devices} devices: {_advice(near)}"
    )


def _microbatch_message(
    batch_size: int, num_devices: int, options: StrategyOptions, num_layers: int
) -> str:
    """Replica counts divide the batch, but no shape of the families asked for gets a
    micro-batch count of its per-replica batch (only a pipeline or hybrid is refused so)."""
    per_stage = options.max_microbatches_per_stage
    shapes = _stages_by_replicas(num_devices, options, num_layers)
    dividing = {r: max(st) for r, st in shapes.items() if batch_size % r == 0}
    nearest = _nearest_batches(batch_size, num_devices, options, num_layers)
    forced = _forced(options)
    if set(dividing) == {1}:
        most = per_stage * dividing[1]
        return (
            f"batch_size={batch_size} has no divisor from 2 to {most} to split into equal "
            f"micro-batches (at most {per_stage} per stage, up to {dividing[1]} stages), so "
            f"strategy={forced!r} cannot pipeline it: {_advice([str(m) for m, _ in nearest])}"
        )
    parts = []
    for r, stages in sorted(dividing.items()):
        share = batch_size // r
        samples = f"{share} sample{'s' if share > 1 else ''}"
        whose = f"{r} replicas get {samples} each" if r > 1 else f"one replica gets {samples}"
        parts.append(
            f"{whose}, too few to split into micro-batches"
            if share == 1
            else f"{whose}, which has no divisor from 2 to {per_stage * stages}"
        )
    near = [f"{m} ({_words(rs)} replicas)" for m, rs in nearest]
    return (
        f"batch_size={batch_size} cannot be split into equal micro-batches for "
        f"strategy={forced!r} on {num_devices} devices: {'; '.join(parts)} (tf.distribute gives "
        f"each replica an equal share; at most {per_stage} micro-batches per stage): "
        f"{_advice(near)}"
    )


def _skipped_note(
    num_devices: int,
    batch_size: int,
    families: tuple[Family, ...],
    num_layers: int,
    usable: Callable[[int], bool] = lambda replicas: True,
) -> tuple[str, ...]:
    """Which replica counts the batch ruled out, when some were scored (those ``usable`` says
    the model's own code failed at are not: :func:`_failed_notes` says why)."""
    wanted = sorted({r for r, _ in _all_shapes(num_devices, families, num_layers)})
    skipped = [r for r in wanted if batch_size % r]
    if not skipped:
        return ()
    scored = [r for r in wanted if batch_size % r == 0 and usable(r)]
    largest = skipped[-1]
    below, above = batch_size // largest * largest, (batch_size // largest + 1) * largest
    sizes = _words([b for b in (below, above) if b >= largest])
    return (
        f"{_words(skipped, 'and')} replicas not scored: batch_size={batch_size} does not split "
        "evenly over them (tf.distribute gives each replica an equal share); scored "
        f"{_words(scored, 'and')}; for {largest} replicas use batch_size={sizes}",
    )


def uneven_share_reason(candidate: StrategyCandidate) -> str:
    """Why replicas on different device types pace the step, with each type's replica time;
    ``""`` when every replica runs on the same types."""
    types = candidate.replica_device_types
    if len(set(types)) < 2:
        return ""
    slowest: dict[str, float] = {}
    count: dict[str, int] = {}
    for name, step_s in zip(types, candidate.simulation.replica_step_s):
        slowest[name] = max(slowest.get(name, 0.0), step_s)
        count[name] = count.get(name, 0) + 1
    parts = [
        (
            f"the {name} replica takes"
            if count[name] == 1
            else f"the {count[name]} {name} replicas take"
        )
        + f" {format_seconds(step_s)}"
        for name, step_s in sorted(slowest.items(), key=lambda kv: kv[1])
    ]
    return (
        "replicas take equal shares of the batch (tf.distribute splits it evenly): "
        f"{', '.join(parts)}, and the step waits for the slowest"
    )


def _uneven_notes(candidates: list[StrategyCandidate]) -> tuple[str, ...]:
    """:func:`uneven_share_reason` of the best data-parallel and hybrid candidates."""
    notes = []
    best: dict[Family, StrategyCandidate] = {}
    for c in sorted(candidates, key=StrategyCandidate.rank):
        best.setdefault(c.strategy.family, c)
    for family in (Family.DATA_PARALLEL, Family.HYBRID):
        reason = uneven_share_reason(best[family]) if family in best else ""
        if reason:
            notes.append(f"{family.label} ({best[family].strategy.describe()}): {reason}")
    return tuple(notes)
