"""The strategy search skips what cannot win: a candidate whose lower bound is above a fitting
candidate of its family is not simulated (exact), and past the time limit shapes whose families
already have a candidate that fits are cut (noted). Pure Python, about a second."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from benchmarks.graph_scale import make_costed, make_topology
from partitioner.core.ir import CostedGraph, Schedule
from partitioner.planner.search import StrategyOptions, StrategySearch, search_strategies
from partitioner.simulation.bounds import costed_lower_bounds
from partitioner.simulation.strategy import (
    microbatch_costed,
    static_overflow,
    strategy_lower_bound_s,
)
from tests.planner.strategy_graphs import SLOW_LINK, chain_costs, uniform_topology

CostedAt = Callable[[int], CostedGraph]


def _transformer(blocks: int = 3, devices: int = 8) -> CostedAt:
    """The graph_scale benchmark's step (about 400 ops for 3 blocks) at any batch."""
    topology = make_topology(devices)
    cache: dict[int, CostedGraph] = {}

    def costed_at(batch: int) -> CostedGraph:
        if batch not in cache:
            cache[batch] = make_costed(blocks, topology, batch=batch)
        return cache[batch]

    return costed_at


def _chain() -> CostedAt:
    topo = uniform_topology(4, SLOW_LINK, hosts=2)
    return chain_costs(32, topology=topo, fwd_s=(1.0, 2.0, 1.0, 3.0), weight_bytes=(100,) * 4, act_bytes=40)


def _summary(found: StrategySearch) -> tuple[object, ...]:
    per_family = {
        f: (c.strategy, c.step_time_s, c.placement) for f, c in found.best_per_family().items()
    }
    return found.best.strategy, found.best.step_time_s, found.best.placement, per_family


def _priced(costed_at: CostedAt, batch: int, replicas: int, m: int) -> CostedGraph:
    costed = costed_at(batch // replicas)
    return microbatch_costed(costed, costed_at(batch // replicas // m), m) if m > 1 else costed


@pytest.mark.parametrize(("costs", "batch"), [(_transformer(), 16), (_chain(), 32)])
def test_pruning_keeps_the_choice_and_every_familys_best(costs: CostedAt, batch: int) -> None:
    options = StrategyOptions(schedules=(Schedule.GPIPE, Schedule.ONE_F_ONE_B), time_limit_s=60)
    every = search_strategies(costs, batch, replace(options, prune=False))
    pruned = search_strategies(costs, batch, options)
    assert _summary(pruned) == _summary(every)
    assert len(pruned.candidates) < len(every.candidates)
    simulated = {c.strategy for c in pruned.candidates}
    assert all(c.strategy in simulated for c in every.best_per_family().values())
    (note,) = [n for n in pruned.notes if "a lower bound on each step" in n]
    assert "the choice and each family's best are those of simulating all" in note
    assert not any("a lower bound on each step" in n for n in every.notes)


@pytest.mark.parametrize(("costs", "batch"), [(_transformer(), 16), (_chain(), 32)])
def test_every_lower_bound_is_below_the_simulated_step(costs: CostedAt, batch: int) -> None:
    options = StrategyOptions(schedules=(Schedule.GPIPE, Schedule.ONE_F_ONE_B), prune=False)
    for c in search_strategies(costs, batch, options).candidates:
        s = c.strategy
        costed = _priced(costs, batch, s.replicas, s.num_microbatches)
        bound = strategy_lower_bound_s(costed, s, costed_lower_bounds(costed))
        assert 0 < bound <= c.step_time_s * (1 + 1e-12)
        assert not static_overflow(costed, s) or not c.simulation.fits


def test_past_the_time_limit_shapes_of_families_that_have_a_fitting_candidate_are_cut() -> None:
    costs = _transformer()
    found = search_strategies(costs, 16, StrategyOptions(time_limit_s=1e-9))
    every = search_strategies(costs, 16, StrategyOptions(prune=False, refine=False))
    assert set(found.best_per_family()) == set(every.best_per_family())
    (note,) = [n for n in found.notes if n.startswith("past the time limit")]
    assert "(time_limit_s=1e-09) shapes " in note and "not scored, their families having" in note
    assert found.best.step_time_s <= min(c.step_time_s for c in found.candidates if c.simulation.fits)
