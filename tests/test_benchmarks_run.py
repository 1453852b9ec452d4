"""Smoke test of the benchmark runner's record format on one tiny model (an MLP, 2 devices)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks import run as bench
from benchmarks.realised import EVEN_PIPELINE, GroupResult, even_pipeline
from benchmarks.zoo import mlp, per_replica_batches
from cost_models.estimate.costs import cost_graph
from partitioner.core.ir import CostedGraph, Graph, Schedule
from partitioner.core.strategy import Strategy
from partitioner.simulation.evaluate import evaluate
from partitioner.simulation.pipeline import accumulate_time_s
from partitioner.simulation.strategy import microbatch_costed, simulate_strategy
from partitioner.solvers import get_solver, solver_names
from passes.trace import trace_model

REQUIRED_KEYS = {
    "model",
    "devices",
    "topology",
    "solver",
    "step_time_s",
    "lower_bound_s",
    "solve_time_s",
    "max_memory_fraction",
    "status",
}
TIME_LIMIT_S = 0.5


@pytest.fixture(scope="module")
def graph() -> Graph:
    return trace_model(mlp(), batch_size=16).graph


@pytest.fixture(scope="module")
def records(graph: Graph) -> tuple[bench.Record, ...]:
    return bench.run_config(
        "mlp", graph, device_type="h100", num_devices=2, topology="pcie", time_limit_s=TIME_LIMIT_S
    )


def test_one_record_per_solver_with_the_required_keys(records: tuple[bench.Record, ...]) -> None:
    assert [r.solver for r in records] == list(solver_names())
    for r in records:
        rec = r.to_json()
        assert REQUIRED_KEYS <= set(rec)
        assert (rec["model"], rec["devices"], rec["topology"]) == ("mlp", 2, "pcie")
    text = json.dumps([r.to_json() for r in records])
    assert json.loads(text)[0]["model"] == "mlp"


def test_times_are_at_least_their_lower_bounds(records: tuple[bench.Record, ...]) -> None:
    feasible = [r for r in records if r.step_time_s is not None]
    assert {r.solver for r in feasible} == set(solver_names())  # an MLP fits anywhere
    for r in feasible:
        assert r.lower_bound_s is not None and r.pipelined_lower_bound_s is not None
        assert r.step_time_s is not None
        assert 0 < r.lower_bound_s <= r.step_time_s * (1 + 1e-9), r
        assert r.pipelined_time_s is not None
        assert 0 < r.pipelined_lower_bound_s <= r.pipelined_time_s * (1 + 1e-9), r
        assert r.solve_time_s is not None and r.solve_time_s >= 0
        assert r.status in ("optimal", "feasible", "heuristic")


def test_memory_fraction_is_the_fullest_device_over_its_limit(
    graph: Graph, records: tuple[bench.Record, ...]
) -> None:
    costed = cost_graph(graph, device_type="h100", num_devices=2, link="pcie")
    limit = costed.topology.devices[0].memory_bytes
    by = {r.solver: r for r in records}
    total = sum(m.total_bytes for m in costed.layer_memory)
    assert by["single"].max_memory_fraction == pytest.approx(total / limit)
    even = get_solver("even").solve(costed.problem()).assignment
    used = [0, 0]
    for mem, d in zip(costed.layer_memory, even, strict=True):
        used[d] += mem.total_bytes
    assert by["even"].peak_memory_bytes == max(used)
    assert by["even"].max_memory_fraction == pytest.approx(max(used) / limit)
    assert by["even"].step_time_s == pytest.approx(evaluate(costed, even).step_time_s)
    assert by["even"].memory_limit_bytes == limit


def test_single_is_reported_infeasible_with_the_memory_it_needs(graph: Graph) -> None:
    costed = cost_graph(graph, device_type="h100", num_devices=2, link="pcie")
    total = sum(m.total_bytes for m in costed.layer_memory)
    limit = int(total * 0.8)  # two devices hold it, one does not
    rows = bench.run_config(
        "mlp",
        graph,
        device_type="h100",
        num_devices=2,
        topology="nvlink",
        solvers=("single", "auto"),
        time_limit_s=TIME_LIMIT_S,
        memory_limit_bytes=limit,
    )
    single, auto = rows
    assert single.status == "infeasible" and single.step_time_s is None
    assert single.max_memory_fraction == pytest.approx(total / limit)
    assert auto.step_time_s is not None
    assert auto.max_memory_fraction is not None and auto.max_memory_fraction <= 1.0
    (group,) = bench.summarize(rows).groups
    assert not group.single_fits


def test_summary_and_readme(records: tuple[bench.Record, ...]) -> None:
    summary = bench.summarize(records)
    (group,) = summary.groups
    by = {r.solver: r for r in records}
    assert group.auto_s == by["auto"].pipelined_time_s
    assert group.even_s == by["even"].pipelined_time_s
    baselines = [r for r in records if r.solver not in ("auto", "ilp")]
    best = min(r.pipelined_time_s or math.inf for r in baselines)
    assert group.best_baseline_s == best
    assert group.auto_s is not None and group.even_s is not None
    assert summary.auto_never_slower == (group.auto_s <= best * (1 + 1e-9))
    assert group.gain_over_even == pytest.approx(1 - group.auto_s / group.even_s)
    assert summary.placements == len(records)
    assert 0 < summary.pipelines <= summary.placements


def test_one_f_one_b_column(graph: Graph, records: tuple[bench.Record, ...]) -> None:
    by = {r.solver: r for r in records}
    single = by["single"]
    # One stage: 1F1B over M micro-batches is the sequential step, up to summation order, plus
    # the M - 1 additions of the micro-batches' gradients into the running sums.
    assert single.num_microbatches == min(bench.MICROBATCHES_PER_DEVICE * 2, 16)
    grads = sum(
        m.gradient_bytes for m in cost_graph(graph, device_type="h100", num_devices=1).layer_memory
    )
    adds_s = (single.num_microbatches - 1) * accumulate_time_s("h100", grads)
    assert adds_s > 0
    assert single.pipeline_1f1b_s == pytest.approx(single.step_time_s + adds_s, rel=1e-9)
    for r in records:
        if r.pipeline_1f1b_s is None:
            assert r.note.startswith("1f1b: "), r
        else:  # a pipeline step is never shorter than its slowest stage's share of the work
            assert r.pipelined_lower_bound_s is not None
            assert r.pipeline_1f1b_s >= r.pipelined_lower_bound_s * (1 - 1e-9), r
    info = bench.RunInfo("python -m benchmarks.run --x", "2000-01-01", "abc", "m", 1.0, 0.5, ())
    text = bench.readme_section(records, info)
    assert "`python -m benchmarks.run --x`" in text
    assert "| mlp | 2 | pcie |" in text
    assert "mlp" in bench.record_table(records)


def test_measured_records_are_merged(tmp_path: Path) -> None:
    path = tmp_path / "measured.json"
    path.write_text(
        json.dumps(
            {
                "records": [
                    {
                        "model": "mlp",
                        "devices": 2,
                        "solver": "auto",
                        "measured_time_s": 0.25,
                        "predicted_time_s": 0.2,
                        "note": "1f1b, M=4",
                    }
                ]
            }
        )
    )
    (row,) = bench.load_measured(path)
    assert row.status == bench.MEASURED_STATUS
    assert (row.measured_time_s, row.predicted_time_s, row.topology) == (0.25, 0.2, "localhost")
    assert "0.25" not in bench.record_table([row], bench.MEASURED_COLUMNS)  # shown in ms
    assert "250.000" in bench.record_table([row], bench.MEASURED_COLUMNS)
    path.write_text(json.dumps([{"model": "mlp", "devices": 2}]))
    with pytest.raises(ValueError, match="lacks solver, measured_time_s"):
        bench.load_measured(path)


# --------------------------------------------------------------------------------------------
# The strategy search on the realised objective (issue 16, item 6)
# --------------------------------------------------------------------------------------------


def test_per_replica_batches_are_every_batch_the_search_costs_but_the_whole() -> None:
    # replica shares and micro-batches: on 2 devices 16 -> R = 2 (8), M = 2, 4, 8 (8, 4, 2)
    assert per_replica_batches(16, 2) == (8, 4, 2)
    assert per_replica_batches(32, 8) == (16, 8, 4, 2, 1)
    assert per_replica_batches(12, 4) == (6, 4, 3, 2, 1)
    assert per_replica_batches(7, 1) == ()


@pytest.fixture(scope="module")
def graphs(graph: Graph) -> dict[int, Graph]:
    model = mlp()
    return {16: graph, **{b: trace_model(model, batch_size=b).graph for b in (8, 4, 2)}}


@pytest.fixture(scope="module")
def group(graphs: dict[int, Graph]) -> GroupResult:
    return bench.run_strategies(
        "mlp", graphs.__getitem__, 16, device_type="h100", num_devices=2, topology="pcie",
        time_limit_s=TIME_LIMIT_S,
    )  # fmt: skip


def test_the_group_reports_auto_and_every_family_on_the_simulated_step(
    group: GroupResult, graphs: dict[int, Graph]
) -> None:
    names = [r.name for r in group.results]
    assert names[:2] == ["single", "data_parallel"] and "pipeline" in names
    assert names[-1] == EVEN_PIPELINE
    costed = cost_graph(graphs[16], device_type="h100", num_devices=2, link="pcie")
    single = simulate_strategy(costed, Strategy(((0,),), (0,) * len(costed.layer_memory)))
    assert group.step_s("single") == pytest.approx(single.step_time_s, rel=1e-12)
    data_parallel = group.result("data_parallel")
    assert data_parallel is not None and data_parallel.description == "2 data-parallel replicas"
    # auto is the planner's best: never slower than a family's best nor the even pipeline
    assert group.ok and group.chosen_fits
    assert group.chosen_step_s <= min(r.step_time_s for r in group.results) * (1 + 1e-9)
    assert group.chosen_description in {r.description for r in group.results}
    assert group.gain_over(group.best_replicated_s) == pytest.approx(
        1 - group.chosen_step_s / min(single.step_time_s, data_parallel.step_time_s)
    )


def test_the_even_pipeline_is_evens_split_pipelined_at_its_best_micro_batch_count(
    graphs: dict[int, Graph],
) -> None:
    def costed_at(batch: int) -> CostedGraph:
        return cost_graph(graphs[batch], device_type="h100", num_devices=2, link="pcie")

    even = even_pipeline(costed_at, 16)
    assert even is not None and even.placement == "even" and even.num_microbatches > 1
    costed = costed_at(16)
    stages = get_solver("even", seed=0).solve(costed.problem()).assignment
    steps = [  # each micro-batch count priced at its own micro-batch
        simulate_strategy(
            microbatch_costed(costed, costed_at(16 // m), m),
            Strategy(((0, 1),), stages, m, Schedule.ONE_F_ONE_B),
        ).step_time_s
        for m in (2, 4, 8)
    ]
    assert even.step_time_s == pytest.approx(min(steps), rel=1e-12)
    one_device = cost_graph(graphs[16], device_type="h100", num_devices=1, link="pcie")
    assert even_pipeline(lambda b: one_device, 16) is None


def test_the_readme_headlines_the_realised_step(
    records: tuple[bench.Record, ...], group: GroupResult
) -> None:
    info = bench.RunInfo("python -m benchmarks.run --x", "2000-01-01", "abc", "m", 1.0, 0.5, ())
    text = bench.readme_section(records, info, [group])
    headline, solvers = text.split("### Placement solvers on their own objective (not what runs)")
    assert "predicted step of what would run" in headline
    assert "vs the best of single device and data parallel" in headline
    assert "vs the even-split pipeline" in headline
    assert f"| mlp | 2 | pcie | {group.chosen_description} ({group.chosen_family})" in headline
    assert "pipelined time" not in headline  # the proxy is never a headline
    assert "| mlp | 2 | pcie |" in solvers
    assert "auto's strategy no slower" in "\n".join(bench.strategy_text([group]))


def test_the_json_has_one_record_per_group_and_is_deterministic(
    records: tuple[bench.Record, ...], group: GroupResult
) -> None:
    text = bench.results_json([group], records)
    assert text == bench.results_json([group], records)
    data = json.loads(text)
    (record,) = data["groups"]
    assert {"model", "devices", "topology", "chosen_family", "chosen_description"} <= set(record)
    assert record["chosen_step_s"] == group.chosen_step_s
    assert record["step_s"] == {r.name: r.step_time_s for r in group.results}
    assert len(data["records"]) == len(records)
