"""The plan of a training strategy: what :func:`partitioner.api.partition` applies.

A plan records the strategy it applies (:attr:`partitioner.plan.model.Plan.strategy`): the
strategy planner's choice (:mod:`partitioner.planner.search`), or the solver's own split written
as one replica. :func:`strategy_of_split` writes a layer placement as that one-replica strategy;
:func:`plan_from_candidate` builds the plan of a scored strategy from its simulation, so the plan
reports the step that strategy runs (the slowest replica, then the gradient all-reduce):

* the assignment is replica 0's layer devices, the predictions replica 0's simulation on the
  graph costed at the per-replica batch;
* the devices of the other replicas carry the same load as replica 0's device of the same stage
  (replicas are copies; their layers are listed once, under replica 0);
* a pipelined strategy records its schedule, micro-batches and stage devices.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from partitioner.core.ir import CostedGraph, Schedule, SolverResult, SolveStatus
from partitioner.core.strategy import Strategy
from partitioner.plan.model import PipelineInfo, Plan, plan_from_solution
from partitioner.planner.search import StrategyCandidate
from partitioner.simulation.evaluate import DeviceLoad

__all__ = ["plan_from_candidate", "replicated_loads", "strategy_of_split"]


def strategy_of_split(
    assignment: tuple[int, ...],
    stage_devices: tuple[int, ...] = (),
    num_microbatches: int = 1,
    schedule: Schedule = Schedule.NONE,
) -> Strategy:
    """A layer placement (device of each layer) as one replica whose stages are its devices:
    ``stage_devices`` in pipeline order, else the devices it uses in index order."""
    group = stage_devices or tuple(sorted(set(assignment)))
    stage = {d: s for s, d in enumerate(group)}
    return Strategy(
        device_groups=(group,),
        stage_of_layer=tuple(stage[d] for d in assignment),
        num_microbatches=num_microbatches,
        schedule=schedule if num_microbatches > 1 else Schedule.NONE,
    )


def replicated_loads(loads: tuple[DeviceLoad, ...], strategy: Strategy) -> tuple[DeviceLoad, ...]:
    """Replica 0's per-device loads with every other replica's device carrying the load of
    replica 0's device of the same stage (its layers listed under replica 0 only)."""
    out = list(loads)
    first = strategy.device_groups[0]
    for group in strategy.device_groups[1:]:
        for stage, device in enumerate(group):
            out[device] = replace(loads[first[stage]], device=device, layers=())
    return tuple(out)


def plan_from_candidate(
    costed: CostedGraph,
    candidate: StrategyCandidate,
    *,
    solver: str,
    solve_time_s: float,
    link: str,
    batch_size: int,
    notes: tuple[str, ...] = (),
    **extra: Any,
) -> Plan:
    """The plan applying ``candidate`` (see the module docstring); ``costed`` is the graph at the
    candidate's per-replica batch, ``notes`` the search's notes, ``extra`` the remaining plan
    fields (baselines, advice, ...)."""
    strategy, sim = candidate.strategy, candidate.simulation
    step_s = sim.step_time_s
    evaluation = replace(
        sim.replica,
        step_time_s=step_s,
        lower_bound_s=min(sim.replica.lower_bound_s, step_s),
        per_device=replicated_loads(sim.replica.per_device, strategy),
    )
    result = SolverResult(
        solver=solver,
        assignment=strategy.layer_devices(0),
        status=SolveStatus.HEURISTIC,
        objective=step_s,
        solve_time_s=solve_time_s,
        notes=(
            f"strategy: {strategy.describe()}, stages placed by {candidate.placement}, "
            f"predicted step {step_s:.6g} s (all-reduce {sim.all_reduce_s:.6g} s)",
            *notes,
        ),
    )
    pipeline = None
    if strategy.num_microbatches > 1 and sim.replica.pipeline is not None:
        pipeline = PipelineInfo(
            schedule=strategy.schedule,
            num_microbatches=strategy.num_microbatches,
            stage_devices=strategy.device_groups[0],
            bubble_fraction=sim.replica.pipeline.bubble_fraction,
        )
    return plan_from_solution(
        costed,
        result,
        evaluation,
        link=link,
        batch_size=batch_size,
        pipeline=pipeline,
        strategy=strategy,
        **extra,
    )
