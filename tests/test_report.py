"""The terminal report: tables from the plan alone, the same after a save and load, names escaped."""

from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
from report_plans import RICH_MARKUP, XSS_IMG, make_plan
from rich.console import Console

from partitioner.core.ir import EventKind, TimelineEvent
from partitioner.core.units import format_seconds
from partitioner.plan.model import Plan, load_plan
from partitioner.plan.schema import validate_plan_data
from partitioner.report.tables import (
    Align,
    Medium,
    RowKind,
    Span,
    Style,
    cell,
    comparison_table,
    device_table,
    resource_sort_key,
    stage_table,
    time_breakdown,
    time_table,
)
from partitioner.report.terminal import PhaseProgress, render_plan


def rendered(plan: Plan, *, verbose: bool = False, styles: bool = False) -> str:
    buffer = io.StringIO()
    console = Console(
        file=buffer,
        width=160,
        force_terminal=styles,
        color_system="standard" if styles else None,
        record=False,
    )
    render_plan(plan, console, verbose=verbose)
    return buffer.getvalue()


PLANS = {
    "pipelined": make_plan(),
    "no timeline": make_plan(pipelined=False, with_timeline=False, over_memory=True),
    "plain": replace(
        make_plan(pipelined=False, with_timeline=False),
        baselines=(),
        warnings=(),
        advice=(),
        layer_edges=(),
        layer_compute_s=(),
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_show_of_a_saved_plan_prints_the_same_tables(name: str, tmp_path: Path) -> None:
    plan = PLANS[name]
    path = plan.save(tmp_path / "plan.json")
    validate_plan_data(json.loads(path.read_text()), str(path))
    loaded = load_plan(path)
    for verbose in (False, True):
        before = rendered(plan, verbose=verbose)
        after = rendered(loaded, verbose=verbose)
        assert after.splitlines() == before.splitlines()
        assert "Predicted step time" in before


def test_device_table_has_every_device_with_its_loads() -> None:
    plan = PLANS["no timeline"]
    text = rendered(plan)
    rows = [ln for ln in text.splitlines() if ln.startswith("│")]
    first_cells = [r.split("│")[1].strip() for r in rows]
    for d in plan.per_device:
        assert str(d.device) in first_cells
        assert format_seconds(d.compute_s) in text
    over = [d for d in plan.per_device if not d.fits]
    assert over, "the fixture should put one device over its limit"
    pct = f"({over[0].memory_bytes / over[0].memory_limit_bytes:.0%})"
    assert pct in text


def test_stage_table_only_when_the_plan_pipelines() -> None:
    pipelined = rendered(PLANS["pipelined"])
    plain = rendered(PLANS["no timeline"])
    pipe = PLANS["pipelined"].pipeline
    assert pipe is not None
    assert (
        f"Pipeline: {pipe.schedule.value} schedule, {pipe.num_microbatches} micro-batches"
        in pipelined
    )
    for d in pipe.stage_devices:
        assert f"{pipe.bubble_fraction[d]:.0%}" in pipelined
    assert "Pipeline:" not in plain
    assert "bubble" not in plain


def test_comparison_names_each_baseline_with_its_ratio() -> None:
    plan = PLANS["pipelined"]
    text = rendered(plan)
    assert "Compared with" in text
    for b in plan.baselines:
        line = next(ln for ln in text.splitlines() if ln.startswith(f"│ {b.solver} "))
        if b.step_time_s is None:
            assert "does not fit" in line
        else:
            ratio = b.step_time_s / plan.step_time_s
            assert f"{ratio:.2f}x" in line
            assert ("slower" if ratio > 1 else "faster") in line
            assert format_seconds(b.step_time_s) in line
    assert f"ratio {plan.step_time_s / plan.lower_bound_s:.2f}x" in text
    assert "Compared with" not in rendered(PLANS["plain"])


def test_where_the_time_goes_from_the_timeline() -> None:
    plan = PLANS["pipelined"]
    text = rendered(plan)
    assert "Where the time goes" in text and "from the simulated timeline" in text
    rows = time_breakdown(plan)
    resources = [r.resource for r in rows]
    assert resources == sorted({e.resource for e in plan.timeline}, key=resource_sort_key)
    span = max(e.end_s for e in plan.timeline)
    for r in rows:
        events = [e for e in plan.timeline if e.resource == r.resource]
        busy = sum(e.end_s - e.start_s for e in events)  # the fixture's events never overlap
        assert r.busy_s == pytest.approx(busy)
        assert r.idle_s == pytest.approx(span - busy)
        if r.is_link:
            assert r.compute_s == 0 and r.transfer_s > 0
        else:
            assert r.transfer_s == 0 and r.compute_s > 0
        assert r.resource in text


def test_where_the_time_goes_counts_overlapping_events_once() -> None:
    base = PLANS["plain"]
    timeline = (
        TimelineEvent("device 0", EventKind.FORWARD, "a", 0.0, 2.0),
        TimelineEvent("device 0", EventKind.BACKWARD, "b", 1.0, 3.0),
        TimelineEvent("link 0->1", EventKind.TRANSFER, "t1", 0.5, 1.5),
        TimelineEvent("link 0->1", EventKind.TRANSFER, "t2", 1.0, 2.0),
        TimelineEvent("device 10", EventKind.FORWARD, "c", 3.0, 4.0),
    )
    plan = replace(base, timeline=timeline, step_time_s=4.0)
    rows = {r.resource: r for r in time_breakdown(plan)}
    assert list(rows) == ["device 0", "device 10", "link 0->1"]
    assert rows["device 0"].compute_s == pytest.approx(3.0)
    assert rows["device 0"].idle_s == pytest.approx(1.0)
    assert rows["link 0->1"].transfer_s == pytest.approx(1.5)
    assert rows["link 0->1"].idle_s == pytest.approx(2.5)
    assert rows["device 10"].idle_s == pytest.approx(3.0)


def test_where_the_time_goes_without_a_timeline_uses_the_loads() -> None:
    plan = PLANS["no timeline"]
    rows = time_breakdown(plan)
    assert [r.resource for r in rows] == [f"device {d.device}" for d in plan.per_device]
    for r, d in zip(rows, plan.per_device):
        assert r.compute_s == d.compute_s
        assert r.idle_s == pytest.approx(max(0.0, plan.step_time_s - d.compute_s))
    assert "no timeline: from the loads" in rendered(plan)


def test_names_from_the_model_are_text_not_markup() -> None:
    text = rendered(PLANS["pipelined"])
    assert RICH_MARKUP in text
    assert XSS_IMG in text
    assert f"model {XSS_IMG}" in text


def test_warnings_are_bold_red_and_advice_is_shown() -> None:
    plan = PLANS["pipelined"]
    styled = rendered(plan, styles=True)
    plain = rendered(plan)
    for w in plan.warnings:
        assert f"WARNING: {w}" in plain
    warning_lines = [ln for ln in styled.splitlines() if "WARNING:" in ln]
    assert warning_lines and all("\x1b[1;31m" in ln for ln in warning_lines)
    assert all(f"Advice: {a}" in plain for a in plan.advice)
    assert "WARNING" not in rendered(PLANS["plain"])


def test_phases_only_when_verbose() -> None:
    plan = PLANS["pipelined"]
    assert "Phases:" not in rendered(plan)
    verbose = rendered(plan, verbose=True)
    assert all(f"{k} {format_seconds(v)}" in verbose for k, v in plan.phase_times_s)


def test_phase_progress_tracks_phases_and_finishes_them() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=100)
    with PhaseProgress(console) as progress:
        progress("tracing")
        progress("profiling ops", 3, 10)
        progress("profiling ops", 7, 10)
        progress("solving with auto")
    assert progress.phases == ("tracing", "profiling ops", "solving with auto")
    tasks = progress._progress.tasks
    assert all(t.finished for t in tasks)
    assert tasks[1].total == 10


def test_phase_progress_leaves_a_failed_phase_unfinished() -> None:
    console = Console(file=io.StringIO(), force_terminal=False, width=100)
    with pytest.raises(RuntimeError), PhaseProgress(console) as progress:
        progress("tracing")
        raise RuntimeError("boom")
    assert not progress._progress.tasks[0].finished


# -- the tables, built once for both reports ------------------------------------------------------


def test_the_device_table_shows_host_and_tf_device_in_the_terminal_only_when_they_differ() -> None:
    plan = PLANS["pipelined"]
    page = device_table(plan, Medium.PAGE)
    terminal = device_table(plan, Medium.TERMINAL)
    headers = ["device", "host", "TF device", "layers", "compute", "memory / limit"]
    assert [c.header for c in terminal.columns] == [*headers, "sent", "received"]
    assert [c.header for c in page.columns] == ["device", "type", *headers[1:], "sent", "received"]
    one_host = replace(plan, devices=tuple(replace(d, host=0, name="") for d in plan.devices))
    columns = [c.header for c in device_table(one_host, Medium.TERMINAL).columns]
    assert "host" not in columns and "TF device" not in columns
    assert [c.header for c in device_table(one_host, Medium.PAGE).columns] == [
        c.header for c in page.columns
    ]
    # The same rows in both, one per device; the terminal names fewer layers.
    assert [r.cells[0].text for r in terminal.rows] == [str(d.device) for d in plan.per_device]
    assert [r.cells[0].text for r in page.rows] == [str(d.device) for d in plan.per_device]


def test_a_device_over_its_limit_is_an_over_row_with_an_alert_cell() -> None:
    plan = PLANS["no timeline"]
    for medium in Medium:
        table = device_table(plan, medium)
        memory = [c.header for c in table.columns].index("memory / limit")
        for row, load in zip(table.rows, plan.per_device):
            assert (row.kind is RowKind.OVER) == (not load.fits)
            styles = {s.style for s in row.cells[memory].spans}
            assert styles == ({Style.PLAIN} if load.fits else {Style.ALERT})


def test_cells_hold_raw_names_and_the_renderers_escape_them() -> None:
    plan = PLANS["pipelined"]
    texts = [c.text for r in device_table(plan, Medium.PAGE).rows for c in r.cells]
    assert any(XSS_IMG in t for t in texts)
    assert any(RICH_MARKUP in t for t in texts)
    title = device_table(plan, Medium.TERMINAL).title
    assert Span(plan.model_name, Style.BOLD) in title.spans
    assert title.text.startswith(f"Plan for {plan.model_name} on ")


def test_the_comparison_marks_the_plan_faster_baselines_and_the_bound() -> None:
    plan = PLANS["pipelined"]
    terminal = comparison_table(plan, Medium.TERMINAL)
    page = comparison_table(plan, Medium.PAGE)
    assert len(terminal.rows) == len(plan.baselines) + 1
    assert len(page.rows) == len(plan.baselines) + 2
    assert terminal.rows[0].kind is page.rows[0].kind is RowKind.THIS
    assert page.rows[-1].kind is RowKind.BOUND
    for row, b in zip(terminal.rows[1:], plan.baselines):
        if b.step_time_s is None:
            assert row.kind is RowKind.NOFIT
        elif b.step_time_s < plan.step_time_s:
            assert row.kind is RowKind.FASTER
            assert row.cells[2] == cell(
                f"{b.step_time_s / plan.step_time_s:.2f}x (faster)", Style.ALERT
            )
    assert stage_table(PLANS["no timeline"], Medium.TERMINAL) is None


def test_the_time_table_has_a_row_per_resource_of_the_breakdown() -> None:
    plan = PLANS["pipelined"]
    table = time_table(plan)
    assert [r.cells[0].text for r in table.rows] == [r.resource for r in time_breakdown(plan)]
    assert table.columns[3].header == "idle (bubble)"
    assert table.caption == "from the simulated timeline"
    assert [c.align for c in table.columns] == [Align.LEFT, *[Align.RIGHT] * 3, Align.LEFT]


def test_strategies_table_shows_each_family_fastest_first_and_why_the_others_lost() -> None:
    from partitioner.core.strategy import Family
    from partitioner.planner.explain import FamilyRow
    from partitioner.report.html import _tables
    from partitioner.report.tables import strategies_table

    rows = (
        FamilyRow(Family.PIPELINE, "2 stages, 1F1B, 8 micro-batches", 0.2, 1.5, 100, 1000, True, True, ""),
        FamilyRow(Family.SINGLE, "one device", 0.3, 1.0, 400, 1000, True, False, "1.50x slower"),
        FamilyRow(Family.DATA_PARALLEL, "2 data-parallel replicas", 0.5, None, 2000, 1000, False, False, "does not fit: device 0 needs 2 KiB of 1000 B"),
    )
    assert strategies_table(make_plan()) is None
    plan = replace(make_plan(), strategies=rows)
    table = strategies_table(plan)
    assert table is not None
    assert [r.cells[0].text for r in table.rows] == [
        "pipeline: 2 stages, 1F1B, 8 micro-batches (fastest)",
        "single device: one device",
        "data parallel: 2 data-parallel replicas",
    ]
    assert [r.cells[2].text for r in table.rows] == ["1.50x", "1.00x", "-"]
    text = rendered(plan)
    assert "Strategies" in text and "does not fit: device 0 needs" in text
    assert _tables(plan)["strategies"]["rows"][0]["cls"] == "this"
    assert _tables(make_plan())["strategies"] is None


# -- plans that apply a strategy ----------------------------------------------------------------


def test_the_report_leads_with_the_strategy_its_step_and_speedup(tmp_path: Path) -> None:
    from strategy_report_plans import strategy_plan

    plan = strategy_plan(((0,), (1,)))
    text = rendered(plan)
    assert text.splitlines()[0] == (
        "Strategy: 2 data-parallel replicas, predicted step 2.000 ms, 1.80x one device"
    )
    assert "Strategies" in text  # the families table stays
    loaded = load_plan(plan.save(tmp_path / "plan.json"))  # partition show: the same lines
    assert rendered(loaded).splitlines() == text.splitlines()


def test_plans_without_a_strategy_have_no_strategy_line() -> None:
    for plan in PLANS.values():
        assert "Strategy:" not in rendered(plan)


def test_replica_devices_are_named_as_copies_not_idle() -> None:
    from strategy_report_plans import strategy_plan

    plan = strategy_plan(((0,), (1,), (2,)))
    table = device_table(plan, Medium.TERMINAL)
    layers = [r.cells[1].text for r in table.rows]
    assert layers[0].startswith("7: input_1")
    assert layers[1:] == [
        "replica 1 (same layers as device 0)",
        "replica 2 (same layers as device 0)",
    ]
    assert "(none)" not in rendered(plan)
    rows = {r.resource: r for r in time_breakdown(plan)}
    assert set(rows) == {
        "device 0",
        "device 1 (replica 1, as device 0)",
        "device 2 (replica 2, as device 0)",
    }
    assert rows["device 2 (replica 2, as device 0)"].compute_s == rows["device 0"].compute_s


def test_a_hybrid_plan_names_replica_and_stage() -> None:
    from strategy_report_plans import strategy_plan

    plan = strategy_plan(((0, 1), (2, 3)), (0, 0, 0, 0, 1, 1, 1), num_microbatches=4)
    text = rendered(plan)
    assert text.splitlines()[0].startswith(
        "Strategy: 2 data-parallel replicas x 2 stages, 1F1B, 4 micro-batches, predicted step"
    )
    layers = [r.cells[1].text for r in device_table(plan, Medium.TERMINAL).rows]
    assert layers[2:] == [
        "replica 1 of stage 0 (same layers as device 0)",
        "replica 1 of stage 1 (same layers as device 1)",
    ]
    resources = [r.resource for r in time_breakdown(plan)]
    assert resources == [
        "device 0",
        "device 1",
        "device 2 (replica 1, as device 0)",
        "device 3 (replica 1, as device 1)",
    ]


def test_the_speedup_falls_back_to_the_single_device_baseline() -> None:
    from strategy_report_plans import STEP_S, strategy_plan

    from partitioner.plan.model import BaselineResult
    from partitioner.report.tables import strategy_headline

    plan = strategy_plan(((0,), (1,)))
    only_chosen = replace(plan, strategies=plan.strategies[:1], baselines=())
    assert strategy_headline(only_chosen) == "2 data-parallel replicas, predicted step 2.000 ms"
    baseline = (BaselineResult("single", 1.5 * STEP_S),)
    assert strategy_headline(replace(only_chosen, baselines=baseline)) == (
        "2 data-parallel replicas, predicted step 2.000 ms, 1.50x one device"
    )
