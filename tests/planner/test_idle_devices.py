"""More devices than layers, and strategies that leave devices idle (pure Python, milliseconds).

The layers bound the number of stages only: data parallelism and hybrids use every device, and
the planner also scores shapes on a subset of the devices, choosing one when fewer devices are
faster (here: an all-reduce whose per-step latency grows with the replicas). The plan of such a
strategy keeps every device of the topology, names the idle ones, and survives its JSON schema;
the terminal and HTML reports say which devices are idle.
"""

from __future__ import annotations

import pytest

from partitioner.core.errors import InfeasibleError
from partitioner.core.ir import CostedGraph, Link, PartitionProblem
from partitioner.core.strategy import Family
from partitioner.plan.model import Plan
from partitioner.plan.schema import validate_plan_data
from partitioner.plan.strategic import plan_from_candidate
from partitioner.planner.explain import devices_text, family_rows, idle_advice
from partitioner.planner.search import (
    StrategyOptions,
    StrategySearch,
    search_batches,
    search_strategies,
    uses_every_device,
)
from partitioner.report.html import report_data
from partitioner.report.tables import (
    IDLE_DEVICE,
    Medium,
    device_table,
    idle_text,
    strategy_headline,
)
from partitioner.solvers.base import validate_problem_for
from tests.planner.strategy_graphs import FAST_LINK, chain_costs, uniform_topology

BATCH = 64
# A link whose every message costs 1 s: a ring all-reduce over R replicas takes 2 (R - 1) s,
# so 8 replicas (14 s of all-reduce) lose to 2 (2 s) on a 3 x 3 s step.
LATENT_LINK = Link("latent", latency_s=1.0, bandwidth_bytes_per_s=1e6)


def chain(n_layers: int, n_devices: int, link: Link, act_bytes: int = 100) -> object:
    return chain_costs(
        BATCH,
        fwd_s=[1.0] * n_layers,
        weight_bytes=[1000] * n_layers,
        act_bytes=act_bytes,
        topology=uniform_topology(n_devices, link),
    )


def search(costs: object, *families: Family) -> StrategySearch:
    options = StrategyOptions(families=families or tuple(Family))
    return search_strategies(costs, BATCH, options)  # type: ignore[arg-type]


# -- the layers bound the stages, not the devices -------------------------------------------------


def test_three_layers_on_eight_devices_scores_every_family_without_refusals() -> None:
    found = search(chain(3, 8, FAST_LINK))
    assert found.rejected == ()  # no stage count above the layers is even tried
    assert max(c.strategy.stages for c in found.candidates) == 3
    assert found.best.strategy.devices == tuple(range(8))  # cheap all-reduce: every device
    assert found.best.strategy.family is Family.DATA_PARALLEL
    assert idle_advice(found) == ""
    assert {Family.SINGLE, Family.DATA_PARALLEL, Family.PIPELINE, Family.HYBRID} <= set(
        found.best_per_family()
    )


def test_search_batches_follow_the_stage_bound() -> None:
    # one layer: one stage, so no micro-batch is priced, only each replica count's share
    assert search_batches(8, BATCH, num_layers=1) == (64, 32, 16, 8)
    assert set(search_batches(8, BATCH, num_layers=3)) <= set(search_batches(8, BATCH))


def test_a_one_layer_model_cannot_be_forced_into_stages() -> None:
    with pytest.raises(
        InfeasibleError,
        match=r"strategy='pipeline' splits the model into 2 or more stages and it has 1 layer: "
        r"use strategy='data_parallel' or strategy='auto'",
    ):
        search(chain(1, 4, FAST_LINK), Family.PIPELINE)
    assert search(chain(1, 4, FAST_LINK)).best.strategy.stages == 1


def test_a_placement_solver_still_refuses_more_devices_than_layers_with_the_way_out() -> None:
    costed = chain(3, 4, FAST_LINK)(BATCH)  # type: ignore[operator]
    assert isinstance(costed, CostedGraph)
    problem: PartitionProblem = costed.problem()
    with pytest.raises(InfeasibleError) as caught:
        validate_problem_for(problem)
    message = str(caught.value)
    assert message.startswith(
        "gpus=4 is more than the 3 layers of the model; use at most 3 devices for a placement"
    )
    assert "partitioner.partition()" in message and "\n" not in message


# -- fewer devices, when fewer are faster -----------------------------------------------------------


def test_data_parallel_over_two_of_eight_devices_wins_when_the_all_reduce_costs_more() -> None:
    found = search(chain(3, 8, LATENT_LINK), Family.DATA_PARALLEL)
    best = found.best
    assert best.strategy.replicas == 2 and best.strategy.devices == (0, 1)
    every = uses_every_device(found.candidates)
    assert every is not None and every.strategy.replicas == 8  # simulated to say what it costs
    assert every.step_time_s > 2 * best.step_time_s
    assert best.step_time_s == pytest.approx(6.503, rel=1e-3)  # 9 s / 2 + 2 all-reduce steps
    advice = idle_advice(found)
    assert advice.startswith(
        "The chosen strategy (2 data-parallel replicas) uses 2 of the 8 devices, devices 2-7 "
        "idle: the fastest strategy on all 8, 8 data-parallel replicas, is predicted at "
    )
    assert "2.33x slower; its all-reduce" in advice
    assert not any("8 x 1" in note for note in found.notes)  # it was simulated, not skipped


def test_auto_chooses_a_subset_of_the_devices_when_it_is_faster() -> None:
    # slow activations too: every pipeline and hybrid pays 10 s per transfer
    found = search(chain(3, 8, LATENT_LINK, act_bytes=10**7))
    assert found.best.strategy.describe() == "2 data-parallel replicas"
    assert all(c.step_time_s >= found.best.step_time_s for c in found.candidates)
    assert "devices 2-7 idle: the fastest strategy on all 8" in idle_advice(found)


def test_devices_text() -> None:
    assert devices_text([3]) == "device 3"
    assert devices_text((7, 2, 3, 4, 5, 6)) == "devices 2-7"
    assert devices_text([1, 3, 5, 6, 7]) == "devices 1, 3 and 5-7"
    assert devices_text([1, 2]) == "devices 1-2"


# -- the plan of a strategy that leaves devices idle ------------------------------------------------


@pytest.fixture(scope="module")
def idle_plan() -> Plan:
    costs = chain(3, 8, LATENT_LINK)
    found = search(costs, Family.DATA_PARALLEL)
    costed = costs(BATCH // found.best.strategy.replicas)  # type: ignore[operator]
    return plan_from_candidate(
        costed,
        found.best,
        solver="auto",
        solve_time_s=0.0,
        link="8 x h100 (latent)",
        batch_size=BATCH,
        strategies=family_rows(found),
        advice=(idle_advice(found),),
    )


def test_the_plan_keeps_every_device_and_names_the_idle_ones(idle_plan: Plan) -> None:
    assert idle_plan.num_devices == 8
    assert idle_plan.idle_devices == (2, 3, 4, 5, 6, 7)
    assert [d.device for d in idle_plan.per_device] == list(range(8))
    assert all(d.compute_s == 0 and d.memory_bytes == 0 for d in idle_plan.per_device[2:])
    assert set(idle_plan.device_of_layer) == {0}  # replica 0; device 1 is replica 1


def test_a_plan_with_idle_devices_round_trips_through_its_schema(
    idle_plan: Plan, tmp_path: object
) -> None:
    data = idle_plan.to_json_dict()
    validate_plan_data(data, "idle.json")
    again = Plan.from_json_dict(data)
    assert again == idle_plan and again.idle_devices == (2, 3, 4, 5, 6, 7)
    path = idle_plan.save(tmp_path / "idle.json")  # type: ignore[operator]
    assert Plan.from_json_dict(__import__("json").loads(path.read_text())) == idle_plan


def test_the_reports_say_which_devices_are_idle(idle_plan: Plan) -> None:
    assert idle_text(idle_plan) == "uses 2 of the 8 devices, devices 2-7 idle"
    headline = strategy_headline(idle_plan)
    assert headline is not None and headline.endswith("; uses 2 of the 8 devices, devices 2-7 idle")
    for medium in Medium:
        rows = device_table(idle_plan, medium).rows
        texts = [" ".join(c.text for c in row.cells) for row in rows]
        assert all(IDLE_DEVICE in t for t in texts[2:]), texts
        assert IDLE_DEVICE not in texts[0] and IDLE_DEVICE not in texts[1]
        assert "replica 1" in texts[1]
    data = report_data(idle_plan)
    assert ["idle devices", "uses 2 of the 8 devices, devices 2-7 idle"] in data["summary"]
    assert "device 7 (idle)" in str(data)


def test_a_plan_without_idle_devices_says_nothing_of_them() -> None:
    found = search(chain(3, 8, FAST_LINK))
    costed = chain(3, 8, FAST_LINK)(BATCH // found.best.strategy.replicas)  # type: ignore[operator]
    plan = plan_from_candidate(
        costed, found.best, solver="auto", solve_time_s=0.0, link="fast", batch_size=BATCH
    )
    assert plan.idle_devices == () and idle_text(plan) == ""
    headline = strategy_headline(plan)
    assert headline is not None and "idle" not in headline
