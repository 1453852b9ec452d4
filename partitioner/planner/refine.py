"""Refine a strategy's stage placement by the simulated step itself (MCMC).

METIS, the ILP and the contiguous solvers optimise linear stand-ins for the step (the slowest
stage's compute plus transfers); the step that runs has bubbles, transfer latency per
micro-batch, all-reduces and memory limits. This search improves the best candidate by moving
layers between stages and scoring each move with
:func:`~partitioner.simulation.strategy.simulate_strategy`: the Markov chain Monte Carlo search of
FlexFlow (Jia, Zaharia and Aiken, "Beyond Data and Model Parallelism for Deep Neural Networks",
SysML 2019), which is also the "iterative placement improvement rewarded by step time" of the
learned-placement work (Mirhoseini et al., "Device Placement Optimization with Reinforcement
Learning", ICML 2017).

A move takes a layer on a stage boundary (one whose neighbour in layer order sits on another
stage) to that neighbour's stage, unless that empties a stage. Metropolis-Hastings acceptance: a move that shortens the step
is taken; one that lengthens it by ``delta`` is taken with probability
``exp(-beta * delta / step)``. A move that breaks the pipeline (a cycle between stages) or the
memory limits is rejected. The chain starts from the given strategy, keeps the best it saw,
and stops after ``max_moves`` moves, or after ``patience`` moves in a row that did not improve
on the best; the random moves come from a ``random.Random(seed)``, so a run is reproducible:
the same start and seed give the same strategy on any machine. ``time_limit_s`` is a safety
cap only; a chain it cuts (:attr:`Refinement.cut_by_time`) depends on the machine's speed, and
the planner says so.

Pure Python, no TensorFlow.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace

from partitioner.core.errors import PartitionError
from partitioner.core.ir import CostedGraph
from partitioner.core.strategy import Strategy
from partitioner.simulation.bounds import LowerBounds, costed_lower_bounds
from partitioner.simulation.strategy import StrategySimulation, simulate_strategy

__all__ = ["Refinement", "boundary_moves", "refine"]

BETA = 20.0
"""Metropolis inverse temperature: a move 5% slower is taken with probability e^-1."""


def boundary_moves(stage_of_layer: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """``(layer, new stage)`` for every layer next (in layer order) to a layer of another stage."""
    moves = set()
    for k in range(len(stage_of_layer) - 1):
        a, b = stage_of_layer[k], stage_of_layer[k + 1]
        if a != b:
            moves.add((k, b))
            moves.add((k + 1, a))
    return tuple(sorted(moves))


def _try(
    costed: CostedGraph, strategy: Strategy, move: tuple[int, int], bounds: LowerBounds
) -> StrategySimulation | None:
    layer, stage = move
    stages = list(strategy.stage_of_layer)
    if stages.count(stages[layer]) == 1:
        return None  # the move would empty a stage: another family, scored by the search
    stages[layer] = stage
    try:
        sim = simulate_strategy(
            costed, replace(strategy, stage_of_layer=tuple(stages)), bounds=bounds
        )
    except PartitionError:
        return None
    return sim if sim.fits else None


@dataclass(frozen=True)
class Refinement:
    """What :func:`refine` found: the best strategy, the moves tried, and whether the safety
    time limit (not the move budget) stopped the chain."""

    best: StrategySimulation
    moves: int
    cut_by_time: bool


def refine(
    costed: CostedGraph,
    start: StrategySimulation,
    *,
    seed: int = 0,
    time_limit_s: float = 1.0,
    max_moves: int = 2000,
    patience: int = 200,
) -> Refinement:
    """The chain from ``start`` (see the module docstring), with how it ended."""
    rng = random.Random(seed)
    deadline = time.monotonic() + time_limit_s
    current = best = start
    since_best = 0
    bounds = costed_lower_bounds(costed)
    for move in range(max_moves):
        if since_best >= patience:
            return Refinement(best, move, cut_by_time=False)
        if time.monotonic() > deadline:
            return Refinement(best, move, cut_by_time=True)
        since_best += 1
        moves = boundary_moves(current.strategy.stage_of_layer)
        if not moves:
            return Refinement(best, move, cut_by_time=False)
        candidate = _try(costed, current.strategy, rng.choice(moves), bounds)
        if candidate is None:
            continue
        delta = candidate.step_time_s - current.step_time_s
        scale = max(current.step_time_s, 1e-12)
        if delta <= 0 or rng.random() < math.exp(-BETA * delta / scale):
            current = candidate
            if current.step_time_s < best.step_time_s:
                best, since_best = current, 0
    return Refinement(best, max_moves, cut_by_time=False)
