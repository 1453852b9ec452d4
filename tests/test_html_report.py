"""The HTML report: one offline file; graph, timeline and memory charts render in headless
Chromium without console errors; names from the model stay text and run nothing.

The browser cases drive Debian's ``chromium`` through Playwright for Python (its own browser
download is not needed: ``executable_path`` points at the system binary); they skip, saying why,
when either is missing.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from report_plans import RICH_MARKUP, XSS_IMG, XSS_SCRIPT, make_plan

from partitioner.core.errors import OutputError
from partitioner.core.files import marked, written_by_partitioner
from partitioner.core.ir import EventKind, TimelineEvent
from partitioner.core.units import format_bytes
from partitioner.plan.model import Plan
from partitioner.report.html import (
    layer_positions,
    merge_events,
    render_html,
    report_data,
    write_html_report,
)

if TYPE_CHECKING:
    from playwright.sync_api import Browser, ConsoleMessage, Dialog, Page, Request

PLAN = make_plan()
NO_TIMELINE = make_plan(pipelined=False, with_timeline=False, over_memory=True)

CHROMIUM = shutil.which("chromium")
CHROMIUM_ARGS = ("--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")
"""No sandbox: the tests may run as root (in CI's container), where Chromium's sandbox cannot."""

needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)",
)


@pytest.fixture(scope="module")
def page_html() -> str:
    return render_html(PLAN)


def _escaped(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def embedded_data(page: str) -> Any:
    match = re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', page, re.S)
    assert match is not None
    return json.loads(match.group(1))


# -- the file ---------------------------------------------------------------------------------


def test_the_page_is_one_file_with_no_external_resources(page_html: str) -> None:
    assert page_html.startswith("<!DOCTYPE html>")
    assert not re.search(r"<script[^>]*\bsrc\s*=", page_html, re.I)
    assert not re.search(r"<link\b", page_html, re.I)
    assert not re.search(r"<iframe\b|<img\b", page_html, re.I)
    assert "Plotly" in page_html and len(page_html) > 1_000_000  # plotly.js is inlined


def test_names_cannot_break_out_of_the_data_element(page_html: str) -> None:
    for name in (XSS_IMG, XSS_SCRIPT):
        assert name not in page_html
    # Three script elements (data, plotly.js, the page's code), so three closing tags.
    assert len(re.findall(r"<script\b", page_html, re.I)) == 3
    assert len(re.findall(r"</script", page_html, re.I)) == 3
    assert "<title>Partition plan: model &lt;img src=x onerror=alert(1)&gt;</title>" in page_html


def test_the_embedded_data_is_the_report_data(page_html: str) -> None:
    data = embedded_data(page_html)
    assert data == json.loads(json.dumps(report_data(PLAN)))
    assert data["layer_names"] == list(PLAN.layer_order)
    assert data["warnings"] == list(PLAN.warnings)


def test_plotly_labels_are_entity_escaped() -> None:
    graph = report_data(PLAN)["figures"]["graph"]
    labels = [t for trace in graph["data"] for t in trace.get("text", [])]
    assert "&lt;img src=x onerror=alert(1)&gt;" in labels
    assert not any("<" in t for t in labels)
    hovers = [h for trace in graph["data"] for h in trace.get("hovertext", [])]
    assert hovers and not any(re.search(r"<(?!br>)", h) for h in hovers)
    assert not any("hovertemplate" in trace for trace in graph["data"])


def test_the_graph_highlights_cross_device_edges_with_their_bytes() -> None:
    graph = report_data(PLAN)["figures"]["graph"]
    traces = {t["name"]: t for t in graph["data"]}
    cross = [
        (a, b, n)
        for a, b, n in PLAN.layer_edges
        if PLAN.device_of_layer[a] != PLAN.device_of_layer[b]
    ]
    assert cross
    marks = traces["bytes across devices"]
    assert len(marks["x"]) == len(cross)
    assert sum(x is None for x in traces["cross-device edge"]["x"]) == len(cross)
    local = len(PLAN.layer_edges) - len(cross)
    assert sum(x is None for x in traces["edge on one device"]["x"]) == local
    for hover, (a, b, nbytes) in zip(marks["hovertext"], cross):
        where = f"from device {PLAN.device_of_layer[a]} to device {PLAN.device_of_layer[b]}"
        assert f"{format_bytes(nbytes, exact=True)} {where}" in hover
        assert _escaped(PLAN.layer_order[b]) in hover
    nodes = [t for t in graph["data"] if t["name"].startswith("device ")]
    assert len(nodes) == PLAN.num_devices
    assert sum(len(t["x"]) for t in nodes) == len(PLAN.layer_order)


def test_layer_positions_follow_the_dataflow() -> None:
    # a diamond 0 -> (1, 2) -> 3, then 3 -> 4 and a skip 0 -> 4
    edges = ((0, 1, 1), (0, 2, 1), (1, 3, 1), (2, 3, 1), (3, 4, 1), (0, 4, 1))
    pos = layer_positions(5, edges)
    assert [p[0] for p in pos] == [0, 1, 1, 2, 3]
    assert pos[1][1] != pos[2][1]
    assert pos[0][1] == pos[3][1] == 0.0
    for a, b, _ in edges:
        assert pos[a][0] < pos[b][0]
    # a cycle (a corrupt plan) or no edges: one row in layer order
    assert layer_positions(3, ((0, 1, 1), (1, 0, 1))) == ((0.0, 0.0), (1.0, 0.0), (2.0, 0.0))
    assert layer_positions(2, ()) == ((0.0, 0.0), (1.0, 0.0))


@given(
    st.integers(min_value=1, max_value=12).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(
                st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)).map(sorted), max_size=30
            ),
        )
    )
)
def test_layer_columns_are_the_longest_path_depths(case: tuple[int, list[list[int]]]) -> None:
    """Any DAG (edges from lower to higher index, repeats and self-loops included): x is the
    longest path from a layer without inputs, each column's rows are centred on 0."""
    n, pairs = case
    edges = tuple((a, b, 1) for a, b in pairs)
    pos = layer_positions(n, edges)
    if not edges:
        assert pos == tuple((float(k), 0.0) for k in range(n))
        return
    depth = [0] * n
    for b in range(n):  # edges run from lower to higher index: a topological order
        depth[b] = max([depth[a] + 1 for a, c in pairs if c == b and a != b], default=0)
    assert [p[0] for p in pos] == depth
    for x in set(depth):
        rows = sorted(p[1] for p in pos if p[0] == x)
        assert rows == [r - (len(rows) - 1) / 2 for r in range(len(rows))]


def test_back_to_back_events_of_one_stage_merge_into_one_bar() -> None:
    f, b, t = EventKind.FORWARD, EventKind.BACKWARD, EventKind.TRANSFER
    events = (
        TimelineEvent("device 0", f, "l1", 0.0, 1.0, 0),
        TimelineEvent("device 0", f, "l2", 1.0, 2.0, 0),
        TimelineEvent("device 0", f, "l3", 2.0, 2.5, 0),
        TimelineEvent("device 0", f, "l1", 2.5, 3.0, 1),  # another micro-batch
        TimelineEvent("device 0", b, "l3", 3.0, 4.0, 1),  # another kind
        TimelineEvent("device 0", b, "l2", 4.5, 5.0, 1),  # a gap
        TimelineEvent("link 0->1", t, "x", 1.0, 2.0, 0),  # another resource
    )
    bars = merge_events(events[::-1])
    assert [(e.resource, e.kind, e.start_s, e.end_s, e.microbatch) for e in bars] == [
        ("device 0", f, 0.0, 2.5, 0),
        ("device 0", f, 2.5, 3.0, 1),
        ("device 0", b, 3.0, 4.0, 1),
        ("device 0", b, 4.5, 5.0, 1),
        ("link 0->1", t, 1.0, 2.0, 0),
    ]
    assert bars[0].label == "l1 … l3 (3)"
    assert merge_events(()) == ()


def test_the_timeline_has_one_bar_per_event_or_per_device_without_one() -> None:
    bars = report_data(PLAN)["figures"]["timeline"]["data"]
    assert len(merge_events(PLAN.timeline)) == len(PLAN.timeline)  # no back-to-back events
    assert sum(len(t["x"]) for t in bars) == len(PLAN.timeline)
    assert {t["name"] for t in bars} == {e.kind.value for e in PLAN.timeline}
    fallback = report_data(NO_TIMELINE)["figures"]["timeline"]
    assert sum(len(t["x"]) for t in fallback["data"]) == NO_TIMELINE.num_devices
    assert "no timeline" in fallback["layout"]["title"]["text"]


def test_memory_marks_devices_over_their_limit() -> None:
    tables = report_data(NO_TIMELINE)["tables"]
    over = [r for r in tables["devices"]["rows"] if r["cls"] == "over"]
    assert [r["cells"][0] for r in over] == [
        str(d.device) for d in NO_TIMELINE.per_device if not d.fits
    ]
    colours = report_data(NO_TIMELINE)["figures"]["memory"]["data"][1]["marker"]["color"]
    assert [c == "#d62728" for c in colours] == [not d.fits for d in NO_TIMELINE.per_device]


def test_comparison_lists_the_plan_every_baseline_and_the_bound() -> None:
    rows = report_data(PLAN)["tables"]["comparison"]["rows"]
    assert rows[0]["cls"] == "this" and rows[-1]["cls"] == "bound"
    assert [r["cells"][0] for r in rows[1:-1]] == [b.solver for b in PLAN.baselines]
    for row, b in zip(rows[1:-1], PLAN.baselines):
        if b.step_time_s is None:
            assert row["cls"] == "nofit"
        else:
            assert row["cells"][2] == f"{b.step_time_s / PLAN.step_time_s:.2f}x"
            assert (row["cls"] == "faster") == (b.step_time_s < PLAN.step_time_s)


def test_the_summary_leads_with_the_strategy_and_its_step() -> None:
    from strategy_report_plans import strategy_plan

    data = report_data(strategy_plan(((0,), (1,))))
    assert data["summary"][0] == [
        "strategy",
        "2 data-parallel replicas, predicted step 2.000 ms, 1.80x one device",
    ]
    assert data["tables"]["strategies"]["rows"][0]["cls"] == "this"
    assert all(row[0] != "strategy" for row in report_data(PLAN)["summary"])


def test_a_data_parallel_plan_does_not_show_replica_devices_as_idle() -> None:
    from strategy_report_plans import strategy_plan

    plan = strategy_plan(((0,), (1,)))
    figures = report_data(plan)["figures"]
    nodes = [t for t in figures["graph"]["data"] if t["mode"].startswith("markers")]
    assert [t["name"] for t in nodes] == ["device 0 (h100); replicas on device 1"]
    assert "replica 0 of 2" in figures["graph"]["layout"]["title"]["text"]
    assert "replica 0 of 2" in figures["timeline"]["layout"]["title"]["text"]
    time = figures["time"]["data"][0]
    assert time["y"] == ["device 0", "device 1 (replica 1, as device 0)"]
    assert time["x"][0] == time["x"][1] > 0  # device 1 computes as device 0 does
    assert figures["memory"]["data"][0]["x"][1] == "device 1 (replica 1, as device 0)"
    fallback = report_data(replace(plan, timeline=()))["figures"]["timeline"]
    assert fallback["data"][0]["y"] == ["device 0", "device 1 (replica 1, as device 0)"]
    devices = report_data(plan)["tables"]["devices"]["rows"]
    assert devices[1]["cells"][4] == "replica 1 (same layers as device 0)"


def test_write_html_report_is_atomic_and_checks_the_path(tmp_path: Path) -> None:
    path = write_html_report(PLAN, tmp_path / "report.html")
    assert path.read_text(encoding="utf-8") == marked(render_html(PLAN), "<!--")
    assert written_by_partitioner(path)
    assert write_html_report(PLAN, path) == path  # its own report: replaced
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]
    with pytest.raises(OutputError, match="does not exist"):
        write_html_report(PLAN, tmp_path / "missing" / "report.html")


# -- in the browser ---------------------------------------------------------------------------

READY = "(function(){var s=document.getElementById('report-status');return s&&s.textContent?JSON.parse(s.textContent):null;})()"

PAGE_FACTS = """JSON.stringify((function () {
  function box(sel) {
    var n = document.querySelector(sel);
    if (!n) { return null; }
    var r = n.getBoundingClientRect();
    return {w: r.width, h: r.height};
  }
  return {
    graph: box('#graph .main-svg'),
    timeline: box('#timeline .main-svg'),
    memory: box('#memory .main-svg'),
    graphPoints: document.querySelectorAll('#graph .scatterlayer .point').length,
    timelineBars: document.querySelectorAll('#timeline .barlayer .point').length,
    graphText: document.querySelector('#graph').textContent,
    bodyText: document.body.innerText,
    imgs: document.querySelectorAll('img').length,
    scripts: document.querySelectorAll('script').length,
    banner: !document.getElementById('warnings').hidden,
    bannerText: document.getElementById('warnings').textContent,
    deviceRows: document.querySelectorAll('#devices tbody tr').length,
    comparisonRows: document.querySelectorAll('#comparison tbody tr').length
  };
})())"""


@pytest.fixture(scope="module")
def chromium() -> Iterator[Browser]:
    """Debian's headless Chromium, driven by Playwright, shared by the module's browser cases."""
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="playwright is not installed (pip install playwright; the dev extra has it)",
    )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS)
        )
        yield browser
        browser.close()


@dataclass
class WatchedPage:
    """A page with what went wrong on it: console errors, uncaught exceptions, failed loads and
    JavaScript dialogs (a dialog is accepted at once, so a page that opens one never hangs)."""

    page: Page
    seen: list[str] = field(default_factory=list)

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type in ("error", "assert"):
            self.seen.append(f"console.{message.type}: {message.text} {message.location}")

    def on_dialog(self, dialog: Dialog) -> None:
        self.seen.append(f"dialog: {dialog.message}")
        dialog.accept()

    def on_request_failed(self, request: Request) -> None:
        self.seen.append(f"request failed: {request.url} {request.failure}")

    def open(self, path: Path) -> Any:
        """Load a local file and wait until its script reports it is done; returns the report."""
        self.page.goto(path.resolve().as_uri())
        return self.page.wait_for_function(READY, polling=100, timeout=60_000).json_value()

    def problems(self) -> list[str]:
        """Everything that went wrong so far (events that arrived meanwhile included)."""
        self.page.evaluate("1")
        return list(self.seen)


@pytest.fixture
def browser_page(chromium: Browser) -> Iterator[WatchedPage]:
    """A fresh page (in its own context) whose problems are recorded."""
    context = chromium.new_context(viewport={"width": 1280, "height": 1600})
    watched = WatchedPage(context.new_page())
    watched.page.on("console", watched.on_console)
    watched.page.on("pageerror", lambda error: watched.seen.append(f"exception: {error}"))
    watched.page.on("requestfailed", watched.on_request_failed)
    watched.page.on("dialog", watched.on_dialog)
    yield watched
    context.close()


def open_report(
    plan: Plan, tmp_path: Path, name: str, browser: WatchedPage
) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    report = write_html_report(plan, tmp_path / f"{name}.html")
    status = browser.open(report)
    facts = json.loads(browser.page.evaluate(PAGE_FACTS))
    shot = tmp_path / f"{name}.png"
    browser.page.screenshot(path=shot, full_page=True)
    problems = browser.problems()
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    return status, facts, problems


@pytest.mark.slow
@needs_chromium
def test_the_report_renders_in_chromium_and_names_stay_text(
    tmp_path: Path, browser_page: WatchedPage
) -> None:
    status, facts, problems = open_report(PLAN, tmp_path, "report", browser_page)
    assert problems == []
    assert status["done"] and status["errors"] == []
    for plot in ("graph", "timeline", "time", "memory"):
        assert status["plots"][plot]["width"] > 0 and status["plots"][plot]["height"] > 0, plot
        assert status["plots"][plot]["svg"] >= 1, plot
    for plot in ("graph", "timeline", "memory"):
        assert facts[plot]["w"] > 0 and facts[plot]["h"] > 0, plot
    cross = sum(PLAN.device_of_layer[a] != PLAN.device_of_layer[b] for a, b, _ in PLAN.layer_edges)
    assert facts["graphPoints"] == len(PLAN.layer_order) + cross
    assert facts["timelineBars"] == len(PLAN.timeline)
    # The hostile names are on the page as text, in the tables and in the graph's labels ...
    for name in (XSS_IMG, XSS_SCRIPT, RICH_MARKUP):
        assert name in facts["bodyText"]
    assert XSS_IMG in facts["graphText"]
    # ... and ran nothing: no element was made of them, no dialog opened (problems is empty).
    assert facts["imgs"] == 0
    assert facts["scripts"] == 3
    assert facts["banner"] and PLAN.warnings[0] in facts["bannerText"]
    assert facts["deviceRows"] == PLAN.num_devices
    assert facts["comparisonRows"] == len(PLAN.baselines) + 2


@pytest.mark.slow
@needs_chromium
def test_a_plan_without_timeline_or_pipeline_renders(
    tmp_path: Path, browser_page: WatchedPage
) -> None:
    plan = replace(NO_TIMELINE, warnings=(), layer_edges=())
    status, facts, problems = open_report(plan, tmp_path, "plain", browser_page)
    assert problems == []
    assert status["errors"] == []
    assert facts["timelineBars"] == plan.num_devices
    assert facts["graphPoints"] == len(plan.layer_order)
    assert not facts["banner"]


@pytest.mark.slow
@needs_chromium
def test_the_browser_check_sees_an_injected_handler(
    tmp_path: Path, browser_page: WatchedPage
) -> None:
    """The harness itself: a page whose markup does run a name is caught (dialog, img, error)."""
    page = tmp_path / "bad.html"
    page.write_text(
        f"<!DOCTYPE html><html><body><p>{XSS_IMG}</p><pre id='report-status'>{{\"done\": true}}</pre></body></html>"
    )
    browser_page.open(page)
    browser_page.page.wait_for_timeout(500)
    problems = browser_page.problems()
    imgs = browser_page.page.evaluate("document.querySelectorAll('img').length")
    assert imgs == 1
    assert any(p.startswith("dialog:") for p in problems), problems
