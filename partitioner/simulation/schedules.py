"""Pipeline schedules, defined once: each stage's order of micro-batch steps, and the stage order.

Both the pipeline simulator (:mod:`partitioner.simulation.pipeline`) and the pipeline rewrite
(:mod:`passes.rewrite.pipeline`) read this module, so what is simulated is what is built
(``tests/simulation/test_schedule_agreement.py`` checks it).

**Steps.** With ``K`` stages and ``M`` micro-batches, stage ``s`` runs ``2 M`` steps, a forward
``F(m)`` and a backward ``B(m)`` of every micro-batch ``m``, in the order its schedule's rule
gives (:func:`stage_steps`):

* ``Schedule.NONE``: ``F0 B0 F1 B1 ...``: micro-batches one after another (gradient
  accumulation); it does not pipeline, and the rewrite refuses it.
* ``Schedule.GPIPE`` (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using
  Pipeline Parallelism", NeurIPS 2019): all forwards in micro-batch order, then all backwards in
  *reverse* micro-batch order. Every stage keeps ``M`` micro-batches of activations alive.
* ``Schedule.ONE_F_ONE_B`` (PipeDream-Flush; Narayanan et al., "Memory-Efficient
  Pipeline-Parallel DNN Training", ICML 2021): a warm-up of ``w = min(K - s - 1, M)`` forwards,
  then ``M - w`` pairs ``F(w + i), B(i)``, then a cool-down of the ``w`` remaining backwards.
  Stage ``s`` keeps at most ``min(M, K - s)`` micro-batches of activations alive.

**A new schedule** is a member of :class:`~partitioner.core.ir.Schedule`, one
:class:`ScheduleRule` in :data:`_RULES` here, and its case in ``tests/simulation/test_schedules.py``;
the simulator, the rewrite, the CLI's choices and the plan schema read the rules.

**Stage order** (:func:`order_stages`). The stages are the devices that hold layers, in a
topological order of the dataflow arcs between them (``a -> b``: device ``a``'s stage must run
before device ``b``'s); among the devices whose predecessors are all placed, the one with the
smallest key comes first. Both consumers key a device by where the model's call first reaches
it, so independent branches on different devices are ordered alike. A cycle leaves the devices
on it (and after it) unordered; :class:`StageOrder` says which, with one cycle for the message.

Pure Python (and networkx), no TensorFlow.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

import networkx as nx

from partitioner.core.errors import UsageError
from partitioner.core.ir import Phase, Schedule

__all__ = [
    "ScheduleRule",
    "StageOrder",
    "Step",
    "order_stages",
    "peak_live_microbatches",
    "pipeline_schedules",
    "schedule_rule",
    "schedule_steps",
    "stage_steps",
]

D = TypeVar("D", bound=Hashable)


class Step(NamedTuple):
    """One step of a stage: the forward or the backward of one micro-batch."""

    phase: Phase
    microbatch: int


StepsRule = Callable[[int, int, int], tuple[Step, ...]]
"""``(num_stages, stage, num_microbatches) -> the stage's steps in order``."""

PeakLiveRule = Callable[[int, int, int], int]
"""``(num_stages, stage, num_microbatches) -> micro-batches of activations alive at once``."""


@dataclass(frozen=True)
class ScheduleRule:
    """What a schedule means: its steps per stage and its closed-form activation peak."""

    schedule: Schedule
    pipelines: bool
    """Whether stages overlap (the rewrite builds only these); ``NONE`` runs micro-batches in turn."""
    steps: StepsRule
    peak_live: PeakLiveRule


# -- the rules ---------------------------------------------------------------------------------


def _forwards(microbatches: Iterable[int]) -> tuple[Step, ...]:
    return tuple(Step(Phase.FORWARD, m) for m in microbatches)


def _backwards(microbatches: Iterable[int]) -> tuple[Step, ...]:
    return tuple(Step(Phase.BACKWARD, m) for m in microbatches)


def _none_steps(num_stages: int, stage: int, num_microbatches: int) -> tuple[Step, ...]:
    """``F0 B0 F1 B1 ...``: one micro-batch after another."""
    return tuple(
        x
        for m in range(num_microbatches)
        for x in (Step(Phase.FORWARD, m), Step(Phase.BACKWARD, m))
    )


def _gpipe_steps(num_stages: int, stage: int, num_microbatches: int) -> tuple[Step, ...]:
    """All forwards in micro-batch order, then all backwards in reverse micro-batch order."""
    return _forwards(range(num_microbatches)) + _backwards(reversed(range(num_microbatches)))


def _one_f_one_b_steps(num_stages: int, stage: int, num_microbatches: int) -> tuple[Step, ...]:
    """Warm-up forwards, then one forward and one backward in turn, then the last backwards."""
    m = num_microbatches
    warmup = min(num_stages - stage - 1, m)
    steady = tuple(
        x
        for k in range(m - warmup)
        for x in (Step(Phase.FORWARD, warmup + k), Step(Phase.BACKWARD, k))
    )
    return _forwards(range(warmup)) + steady + _backwards(range(m - warmup, m))


_RULES: tuple[ScheduleRule, ...] = (
    ScheduleRule(Schedule.NONE, False, _none_steps, lambda k, s, m: 1),
    ScheduleRule(Schedule.GPIPE, True, _gpipe_steps, lambda k, s, m: m),
    ScheduleRule(Schedule.ONE_F_ONE_B, True, _one_f_one_b_steps, lambda k, s, m: min(m, k - s)),
)


def schedule_rule(schedule: Schedule) -> ScheduleRule:
    """The rule of ``schedule``; UsageError for anything that is not a :class:`Schedule`."""
    for rule in _RULES:
        if rule.schedule is schedule:
            return rule
    raise UsageError(
        f"schedule={schedule!r} is not a Schedule; use one of {[s.value for s in Schedule]}"
    )


def pipeline_schedules() -> tuple[Schedule, ...]:
    """The schedules that pipeline (the rewrite builds them; ``pipeline=True`` takes them)."""
    return tuple(rule.schedule for rule in _RULES if rule.pipelines)


def stage_steps(
    schedule: Schedule, num_stages: int, stage: int, num_microbatches: int
) -> tuple[Step, ...]:
    """The order of stage ``stage``'s steps under ``schedule`` (see the module docstring)."""
    return schedule_rule(schedule).steps(num_stages, stage, num_microbatches)


def schedule_steps(
    schedule: Schedule, num_stages: int, num_microbatches: int
) -> tuple[tuple[Step, ...], ...]:
    """Every stage's steps, stage 0 first."""
    steps = schedule_rule(schedule).steps
    return tuple(steps(num_stages, s, num_microbatches) for s in range(num_stages))


def peak_live_microbatches(
    schedule: Schedule, num_stages: int, stage: int, num_microbatches: int
) -> int:
    """Micro-batches of activations stage ``stage`` holds at once, by the schedule's closed form."""
    return schedule_rule(schedule).peak_live(num_stages, stage, num_microbatches)


# -- the stage order ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StageOrder(Generic[D]):
    """The devices in stage order, or, when the dataflow has a cycle, what blocks it."""

    order: tuple[D, ...]
    """Every device, when ``blocked`` is empty."""
    blocked: tuple[D, ...] = ()
    """The devices on a cycle or after one (no topological order places them), in input order."""
    cycle: tuple[tuple[D, D], ...] = ()
    """The arcs of one cycle among the blocked devices (``a -> b``, ``b -> ...``, ``... -> a``)."""


def order_stages(
    devices: Sequence[D], arcs: Iterable[tuple[D, D]], key: Callable[[D], Any]
) -> StageOrder[D]:
    """The devices in a topological order of ``arcs``, the smallest ``key`` first among the ready.

    ``key`` must tell the devices apart (it is the only tie-break). On a cycle the order is
    empty and :attr:`StageOrder.blocked` / :attr:`StageOrder.cycle` say why.
    """
    graph: nx.DiGraph[D] = nx.DiGraph()
    graph.add_nodes_from(devices)
    graph.add_edges_from(arcs)
    if nx.is_directed_acyclic_graph(graph):
        return StageOrder(tuple(nx.lexicographical_topological_sort(graph, key=key)))
    on_cycles: set[D] = {
        d for part in nx.strongly_connected_components(graph) if len(part) > 1 for d in part
    }
    after: set[D] = set().union(*(nx.descendants(graph, d) for d in on_cycles))
    blocked = tuple(d for d in devices if d in on_cycles or d in after)
    start = min(on_cycles, key=key)
    cycle = tuple((a, b) for a, b, *_ in nx.find_cycle(graph, source=start))
    return StageOrder((), blocked, cycle)
