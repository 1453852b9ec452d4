"""The HTML report of a plan: one self-contained file that works offline.

``partition ... --report report.html`` writes it with :func:`write_html_report`. The page holds

* the layer graph, coloured by device, with cross-device edges highlighted and their bytes,
* the simulated timeline per device and link (a Gantt chart; per-device compute bars when the
  plan records no timeline),
* where the time goes (compute, transfer, idle per device and link),
* memory per device against its limit,
* the solver comparison, the device and stage tables, the advice, and the warnings as a banner.

A plan that applies a strategy leads its summary with it in words, its predicted step and its
speed-up over one device, and shows the families table. The graph and the timeline show replica
0 (the plan's assignment); the devices of the other replicas are labelled as copies of replica
0's (in the legend, the time and memory charts and the device table), never as idle devices; a
device the plan leaves idle (:attr:`~partitioner.plan.model.Plan.idle_devices`) is named so in the
summary, the charts and the device table.

Charts are drawn by plotly.js (the copy shipped with the ``plotly`` Python package, inlined in
the page: no CDN, no network). The layer graph's layout is computed here: layers are placed in
columns by longest-path depth (their topological generation, from networkx) and ordered within a
column by the mean position of their predecessors (one barycenter pass, Sugiyama et al., 1981).

The tables (devices, stages, comparison) are built in :mod:`.tables`, as for the terminal.

Safety: every name comes from the user's model, and Keras accepts any string as a layer name.
The page's data travels as JSON inside ``<script type="application/json">`` with ``<``, ``>``
and ``&`` written as ``\\u003c``/``\\u003e``/``\\u0026``, so no name can close the element; the
page's script builds every table cell with ``textContent``, never ``innerHTML``; text handed to
plotly (which reads a small HTML subset in labels) is entity-escaped first, so ``<b>`` shows as
``<b>``; hover text is passed as plain ``hovertext``, never through a ``hovertemplate``. The one
server-side string in the markup, the title, is HTML-escaped.
"""

from __future__ import annotations

import html
import importlib
import json
import os
import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import networkx as nx

from partitioner.core.errors import OutputError
from partitioner.core.files import marked, write_atomic
from partitioner.core.ir import EventKind, TimelineEvent
from partitioner.core.units import format_bytes, format_seconds
from partitioner.plan.model import Plan
from partitioner.report.tables import (
    Medium,
    Table,
    comparison_table,
    device_table,
    idle_text,
    memory_text,
    replica_roles,
    resource_sort_key,
    stage_table,
    strategies_table,
    strategy_headline,
    time_breakdown,
)

__all__ = [
    "layer_positions",
    "merge_events",
    "plotly_js",
    "render_html",
    "report_data",
    "write_html_report",
]

_PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#d62728",
)
_KIND_COLOUR = {
    EventKind.FORWARD: "#1f77b4",
    EventKind.BACKWARD: "#ff7f0e",
    EventKind.TRANSFER: "#d62728",
    EventKind.UPDATE: "#2ca02c",
}
_CROSS_EDGE_COLOUR = "#d62728"
_MAX_NODE_LABELS = 40
"""Above this many layers the graph labels nodes on hover only."""
_MAX_EDGE_LABELS = 30
_MAX_OUTLINED_BARS = 400
"""Above this many Gantt bars, bars have no outline (it would hide their colour)."""
_MS = 1e3
"""Milliseconds per second: the charts' time axes are in ms."""


def _ptext(text: str) -> str:
    """``text`` for a plotly label: its HTML subset is entity-escaped so it shows literally."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _device_label(plan: Plan, d: int) -> str:
    device = plan.devices[d]
    host = f", host {device.host}" if len({x.host for x in plan.devices}) > 1 else ""
    copies = sorted(e for e, (_, _, first) in replica_roles(plan).items() if first == d)
    also = f"; replicas on device {', '.join(map(str, copies))}" if copies else ""
    return f"device {d} ({device.device_type}{host}){also}"


def _resource_name(plan: Plan, d: int) -> str:
    """``device 2``, ``device 2 (replica 1, as device 0)`` for a device of another replica, or
    ``device 7 (idle)`` for a device the plan leaves idle."""
    role = replica_roles(plan).get(d)
    if role is not None:
        return f"device {d} (replica {role[0]}, as device {role[2]})"
    return f"device {d} (idle)" if d in plan.idle_devices else f"device {d}"


def _replicas_note(plan: Plan) -> str:
    """`` (replica 0 of 2; the others run the same layers on their own devices)`` or ``""``."""
    if plan.strategy is None or plan.strategy.replicas == 1:
        return ""
    return (
        f" (replica 0 of {plan.strategy.replicas}; the others run the same layers on their own "
        "devices)"
    )


def _colour(d: int) -> str:
    return _PALETTE[d % len(_PALETTE)]


def _depths(num_layers: int, edges: Sequence[tuple[int, int, int]]) -> list[int] | None:
    """Each layer's longest-path depth from a layer without inputs (its topological
    generation); None when the edges have a cycle (a corrupt plan)."""
    graph: nx.DiGraph[int] = nx.DiGraph()
    graph.add_nodes_from(range(num_layers))
    graph.add_edges_from((a, b) for a, b, _ in edges if a != b)
    if not nx.is_directed_acyclic_graph(graph):
        return None
    depth = [0] * num_layers
    for x, generation in enumerate(nx.topological_generations(graph)):
        for k in generation:
            depth[k] = x
    return depth


def _rows_by_barycenter(
    num_layers: int, edges: Sequence[tuple[int, int, int]], depth: Sequence[int]
) -> list[float]:
    """Each layer's row in its column: column by column, left to right, layers are ordered by
    the mean row of their inputs (then by index) and centred on 0 (one barycenter pass)."""
    preds: list[list[int]] = [[] for _ in range(num_layers)]
    for a, b, _ in edges:
        if a != b:
            preds[b].append(a)
    columns: dict[int, list[int]] = {}
    for k in range(num_layers):
        columns.setdefault(depth[k], []).append(k)
    y = [0.0] * num_layers

    def barycenter(k: int) -> tuple[float, int]:
        ys = [y[p] for p in preds[k]]
        return (sum(ys) / len(ys) if ys else 0.0, k)

    for x in sorted(columns):
        members = sorted(columns[x], key=barycenter)
        for row, k in enumerate(members):
            y[k] = row - (len(members) - 1) / 2
    return y


def layer_positions(
    num_layers: int, edges: Sequence[tuple[int, int, int]]
) -> tuple[tuple[float, float], ...]:
    """``(x, y)`` of each layer for drawing: x is the longest-path depth, y the row in its column.

    Layers without edges, or a graph with a cycle (a corrupt plan), fall back to one row in
    layer order.
    """
    depth = _depths(num_layers, edges) if edges else None
    if depth is None:
        return tuple((float(k), 0.0) for k in range(num_layers))
    y = _rows_by_barycenter(num_layers, edges, depth)
    return tuple((float(depth[k]), y[k]) for k in range(num_layers))


def _edge_midpoint(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """Where an edge bends: halfway, lowered for an edge that skips columns so it does not run
    over the layers between its ends (node labels sit above the nodes)."""
    span = abs(b[0] - a[0])
    bend = 0.0 if span <= 1 else 0.2 + 0.12 * min(span, 8.0)
    return ((a[0] + b[0]) / 2, (a[1] + b[1]) / 2 - bend)


_Point = tuple[float, float]


def _edge_lines(
    plan: Plan, pos: Sequence[_Point], *, cross: bool
) -> tuple[list[float | None], list[float | None]]:
    """The x and y of the edges within one device (or, with ``cross``, across devices), each a
    bent line through its midpoint, separated by ``None``."""
    dev = plan.device_of_layer
    xs: list[float | None] = []
    ys: list[float | None] = []
    for a, b, _ in plan.layer_edges:
        if (dev[a] != dev[b]) == cross:
            mx, my = _edge_midpoint(pos[a], pos[b])
            xs += [pos[a][0], mx, pos[b][0], None]
            ys += [pos[a][1], my, pos[b][1], None]
    return xs, ys


def _line_trace(name: str, plan: Plan, pos: Sequence[_Point], *, cross: bool) -> dict[str, Any]:
    """The edges within one device (grey) or across devices (red, thicker) as one trace."""
    xs, ys = _edge_lines(plan, pos, cross=cross)
    line = (
        {"color": _CROSS_EDGE_COLOUR, "width": 2.5, "shape": "spline"}
        if cross
        else {"color": "#b0b0b0", "width": 1, "shape": "spline"}
    )
    return {
        "type": "scatter",
        "mode": "lines",
        "name": name,
        "x": xs,
        "y": ys,
        "line": line,
        "hoverinfo": "skip",
    }


def _bytes_trace(plan: Plan, pos: Sequence[_Point]) -> dict[str, Any]:
    """A marker on each cross-device edge's midpoint with the bytes it carries."""
    dev, names = plan.device_of_layer, plan.layer_order
    cross = [(a, b, n) for a, b, n in plan.layer_edges if dev[a] != dev[b]]
    mids = [_edge_midpoint(pos[a], pos[b]) for a, b, _ in cross]
    hover = [
        _ptext(
            f"{names[a]} → {names[b]}: {format_bytes(n, exact=True)} "
            f"from device {dev[a]} to device {dev[b]}"
        )
        for a, b, n in cross
    ]
    return {
        "type": "scatter",
        "mode": "markers+text" if len(mids) <= _MAX_EDGE_LABELS else "markers",
        "name": "bytes across devices",
        "x": [m[0] for m in mids],
        "y": [m[1] for m in mids],
        "text": [format_bytes(n) for _, _, n in cross],
        "textposition": "bottom center",
        "textfont": {"color": _CROSS_EDGE_COLOUR, "size": 10},
        "marker": {"symbol": "diamond", "size": 9, "color": _CROSS_EDGE_COLOUR},
        "hovertext": hover,
        "hoverinfo": "text",
    }


def _edge_traces(plan: Plan, pos: Sequence[_Point]) -> list[dict[str, Any]]:
    """The edges within a device; the cross-device edges and their bytes, if there are any."""
    traces = [_line_trace("edge on one device", plan, pos, cross=False)]
    dev = plan.device_of_layer
    if any(dev[a] != dev[b] for a, b, _ in plan.layer_edges):
        traces.append(_line_trace("cross-device edge", plan, pos, cross=True))
        traces.append(_bytes_trace(plan, pos))
    return traces


def _node_trace(plan: Plan, pos: Sequence[_Point], d: int) -> dict[str, Any]:
    """The layers on device ``d``, in its colour, labelled unless the graph is large."""
    members = [k for k in range(len(plan.layer_order)) if plan.device_of_layer[k] == d]
    hover = []
    for k in members:
        time = (
            f"<br>compute {format_seconds(plan.layer_compute_s[k])}" if plan.layer_compute_s else ""
        )
        hover.append(f"{_ptext(plan.layer_order[k])}<br>device {d}{time}")
    show_labels = len(plan.layer_order) <= _MAX_NODE_LABELS
    return {
        "type": "scatter",
        "mode": "markers+text" if show_labels else "markers",
        "name": _ptext(_device_label(plan, d)),
        "x": [pos[k][0] for k in members],
        "y": [pos[k][1] for k in members],
        "text": [_ptext(plan.layer_order[k]) for k in members],
        "textposition": "top center",
        "textfont": {"size": 10},
        "marker": {"size": 12, "color": _colour(d), "line": {"color": "#333", "width": 1}},
        "hovertext": hover,
        "hoverinfo": "text",
    }


def _graph_figure(plan: Plan) -> dict[str, Any]:
    """The layer graph: layers in dataflow columns coloured by device, edges between them."""
    pos = layer_positions(len(plan.layer_order), plan.layer_edges)
    traces = _edge_traces(plan, pos)
    roles = replica_roles(plan)
    traces += [_node_trace(plan, pos, d) for d in range(plan.num_devices) if d not in roles]
    height = max(320, min(900, 70 * (1 + max((abs(p[1]) for p in pos), default=0) * 2) + 160))
    return {
        "data": traces,
        "layout": {
            "title": {
                "text": "Layers by device (left to right in dataflow order)" + _replicas_note(plan)
            },
            "height": height,
            "showlegend": True,
            "hovermode": "closest",
            "xaxis": {"visible": False},
            "yaxis": {"visible": False},
            "margin": {"l": 20, "r": 20, "t": 50, "b": 20},
        },
    }


def merge_events(events: Sequence[TimelineEvent]) -> tuple[TimelineEvent, ...]:
    """The timeline as Gantt bars: back-to-back events of one kind and micro-batch on one
    resource become one bar labelled ``first … last (n)``, so a stage's layers draw as one.
    """
    out: list[TimelineEvent] = []
    counts: list[int] = []
    firsts: list[str] = []
    for e in sorted(events, key=lambda e: (e.resource, e.start_s, e.end_s)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.resource == e.resource
            and last.kind is e.kind
            and last.microbatch == e.microbatch
            and abs(e.start_s - last.end_s) <= 1e-12 + 1e-9 * e.start_s
        ):
            counts[-1] += 1
            label = f"{firsts[-1]} … {e.label} ({counts[-1]})"
            out[-1] = replace(last, label=label, end_s=max(last.end_s, e.end_s))
        else:
            out.append(e)
            counts.append(1)
            firsts.append(e.label)
    return tuple(out)


def _kind_trace(kind: EventKind, bars: Sequence[TimelineEvent], outline: float) -> dict[str, Any]:
    """The Gantt bars of one kind of event (forward, backward, transfer, update), in ms."""
    return {
        "type": "bar",
        "orientation": "h",
        "name": kind.value,
        "y": [_ptext(e.resource) for e in bars],
        "base": [e.start_s * _MS for e in bars],
        "x": [(e.end_s - e.start_s) * _MS for e in bars],
        "marker": {"color": _KIND_COLOUR[kind], "line": {"color": "#ffffff", "width": outline}},
        "hovertext": [
            _ptext(
                f"{e.label} ({kind.value}, micro-batch {e.microbatch}) on "
                f"{e.resource}: {format_seconds(e.start_s)} → {format_seconds(e.end_s)}"
            )
            for e in bars
        ],
        "hoverinfo": "text",
    }


def _event_traces(plan: Plan) -> list[dict[str, Any]]:
    """The recorded timeline as Gantt bars, one trace per kind of event."""
    bars = merge_events(plan.timeline)
    outline = 0.5 if len(bars) <= _MAX_OUTLINED_BARS else 0.0
    traces = []
    for kind in EventKind:
        of_kind = [b for b in bars if b.kind is kind]
        if of_kind:
            traces.append(_kind_trace(kind, of_kind, outline))
    return traces


def _compute_trace(plan: Plan) -> dict[str, Any]:
    """Without a timeline: one bar per device, its compute time from zero."""
    resources = [_ptext(_resource_name(plan, d.device)) for d in plan.per_device]
    return {
        "type": "bar",
        "orientation": "h",
        "name": "compute",
        "y": resources,
        "base": [0.0] * len(resources),
        "x": [d.compute_s * _MS for d in plan.per_device],
        "marker": {"color": _KIND_COLOUR[EventKind.FORWARD]},
        "hovertext": [
            f"{r}: compute {format_seconds(d.compute_s)}"
            for r, d in zip(resources, plan.per_device)
        ],
        "hoverinfo": "text",
    }


def _vertical_line(time_s: float, line: dict[str, Any]) -> dict[str, Any]:
    """A plotly shape: a vertical line across the plot at ``time_s`` (in ms on the axis)."""
    x = time_s * _MS
    return {"type": "line", "x0": x, "x1": x, "yref": "paper", "y0": 0, "y1": 1, "line": line}


def _timeline_layout(plan: Plan, title: str, resources: Sequence[str]) -> dict[str, Any]:
    """One row per resource, in order; the step time (solid) and lower bound (dashed) marked."""
    categories = [_ptext(r) for r in resources]
    shapes = [
        _vertical_line(plan.step_time_s, {"color": "#000", "width": 1.5}),
        _vertical_line(plan.lower_bound_s, {"color": "#888", "width": 1, "dash": "dash"}),
    ]
    return {
        "title": {
            "text": f"{title}: step {format_seconds(plan.step_time_s)} (solid), "
            f"lower bound {format_seconds(plan.lower_bound_s)} (dashed)"
        },
        "barmode": "overlay",
        "height": max(260, 60 + 38 * len(categories)),
        "xaxis": {"title": {"text": "time (ms)"}, "rangemode": "tozero"},
        "yaxis": {
            "type": "category",
            "categoryorder": "array",
            "categoryarray": categories,
            "autorange": "reversed",
        },
        "shapes": shapes,
        "hovermode": "closest",
        "margin": {"l": 110, "r": 20, "t": 50, "b": 50},
    }


def _timeline_figure(plan: Plan) -> dict[str, Any]:
    """The simulated step per device and link; per-device compute bars without a timeline."""
    if plan.timeline:
        resources = sorted({e.resource for e in plan.timeline}, key=resource_sort_key)
        traces = _event_traces(plan)
        title = "Simulated step per device and link" + _replicas_note(plan)
    else:
        resources = [_resource_name(plan, d.device) for d in plan.per_device]
        traces = [_compute_trace(plan)]
        title = "Compute per device (the plan records no timeline)"
    return {"data": traces, "layout": _timeline_layout(plan, title, resources)}


def _memory_limit_trace(plan: Plan, names: list[str], scale: int) -> dict[str, Any]:
    """Each device's memory limit, a wide grey bar behind its predicted memory."""
    return {
        "type": "bar",
        "name": "memory limit",
        "x": names,
        "y": [d.memory_limit_bytes / scale for d in plan.per_device],
        "marker": {"color": "rgba(120,120,120,0.25)", "line": {"color": "#666", "width": 1}},
        "hovertext": [format_bytes(d.memory_limit_bytes) for d in plan.per_device],
        "hoverinfo": "text",
    }


def _memory_used_trace(plan: Plan, names: list[str], scale: int) -> dict[str, Any]:
    """Each device's predicted memory, labelled against its limit, red when over it."""
    loads = plan.per_device
    return {
        "type": "bar",
        "name": "predicted memory",
        "x": names,
        "y": [d.memory_bytes / scale for d in loads],
        "width": 0.5,
        "text": [memory_text(d.memory_bytes, d.memory_limit_bytes) for d in loads],
        "textposition": "outside",
        "constraintext": "none",
        "textfont": {"size": 11},
        "cliponaxis": False,
        "marker": {"color": ["#d62728" if not d.fits else _colour(d.device) for d in loads]},
        "hovertext": [
            f"{format_bytes(d.memory_bytes)} of {format_bytes(d.memory_limit_bytes)}"
            + (" (over the limit)" if not d.fits else "")
            for d in loads
        ],
        "hoverinfo": "text",
    }


def _memory_figure(plan: Plan) -> dict[str, Any]:
    """Memory per device against its limit, in GiB or MiB."""
    names = [_ptext(_resource_name(plan, d.device)) for d in plan.per_device]
    top = max(max(d.memory_limit_bytes, d.memory_bytes) for d in plan.per_device)
    unit, scale = ("GiB", 2**30) if top >= 2**30 else ("MiB", 2**20)
    return {
        "data": [
            _memory_limit_trace(plan, names, scale),
            _memory_used_trace(plan, names, scale),
        ],
        "layout": {
            "title": {"text": "Memory per device against its limit"},
            "barmode": "overlay",
            "height": 340,
            "yaxis": {"title": {"text": unit}, "rangemode": "tozero"},
            "margin": {"l": 60, "r": 20, "t": 50, "b": 40},
        },
    }


def _time_figure(plan: Plan) -> dict[str, Any]:
    """Where the time goes: compute, transfer and idle per device and link, stacked."""
    rows = time_breakdown(plan)
    names = [_ptext(r.resource) for r in rows]
    replicated = plan.strategy is not None and plan.strategy.replicas > 1
    parts = (
        ("compute", [r.compute_s * _MS for r in rows], "#1f77b4"),
        ("transfer", [r.transfer_s * _MS for r in rows], "#d62728"),
        ("idle + all-reduce" if replicated else "idle", [r.idle_s * _MS for r in rows], "#d9d9d9"),
    )
    return {
        "data": [
            {
                "type": "bar",
                "orientation": "h",
                "name": name,
                "y": names,
                "x": values,
                "marker": {"color": colour},
                "hovertext": [f"{name} {format_seconds(v / _MS)}" for v in values],
                "hoverinfo": "text",
            }
            for name, values, colour in parts
        ],
        "layout": {
            "title": {"text": "Where the time goes"},
            "barmode": "stack",
            "height": max(220, 60 + 34 * len(rows)),
            "xaxis": {"title": {"text": "time (ms)"}},
            "yaxis": {"type": "category", "autorange": "reversed"},
            "margin": {"l": 110, "r": 20, "t": 50, "b": 50},
        },
    }


def _table_data(table: Table) -> dict[str, Any]:
    """A table for the page's script: headers, and per row its cells' text and CSS class."""
    return {
        "columns": [c.header for c in table.columns],
        "rows": [{"cells": [c.text for c in r.cells], "cls": r.kind.value} for r in table.rows],
    }


def _tables(plan: Plan) -> dict[str, Any]:
    """The device, stage (None without a pipeline), comparison and strategies (None when the
    plan compared none) tables."""
    stages = stage_table(plan, Medium.PAGE)
    strategies = strategies_table(plan)
    return {
        "devices": _table_data(device_table(plan, Medium.PAGE)),
        "stages": None if stages is None else _table_data(stages),
        "comparison": _table_data(comparison_table(plan, Medium.PAGE)),
        "strategies": None if strategies is None else _table_data(strategies),
    }


def _cross_device_bytes(plan: Plan) -> int:
    """Bytes carried by the edges across devices (the bytes sent, for a plan without edges)."""
    dev = plan.device_of_layer
    if plan.layer_edges:
        return sum(n for a, b, n in plan.layer_edges if dev[a] != dev[b])
    return sum(d.bytes_sent for d in plan.per_device)


def _summary(plan: Plan) -> list[tuple[str, str]]:
    """The page's summary: what was planned, the step time against the bound, the traffic."""
    bound = format_seconds(plan.lower_bound_s)
    if plan.lower_bound_s > 0:
        bound += f" (this plan is {plan.step_time_s / plan.lower_bound_s:.2f}x the bound)"
    headline = strategy_headline(plan)
    summary = [] if headline is None else [("strategy", headline)]
    summary += [
        ("model", plan.model_name),
        ("devices", f"{plan.num_devices} x {plan.device_type} ({plan.link})"),
        *([("idle devices", idle_text(plan))] if plan.idle_devices else []),
        ("batch size", str(plan.batch_size)),
        ("layers", str(len(plan.layer_order))),
        ("solver", f"{plan.solver.name} ({plan.solver.status})"),
        ("predicted step time", format_seconds(plan.step_time_s)),
        ("lower bound", bound),
        ("cross-device bytes", format_bytes(_cross_device_bytes(plan))),
    ]
    if plan.pipeline is not None:
        pipe = plan.pipeline
        summary.append(
            (
                "pipeline",
                f"{pipe.schedule.value}, {pipe.num_microbatches} micro-batches, "
                f"{len(pipe.stage_devices)} stages",
            )
        )
    return summary


def report_data(plan: Plan) -> dict[str, Any]:
    """Everything the page shows, as JSON-ready data (names raw; plotly labels entity-escaped)."""
    return {
        "title": f"Plan for {plan.model_name}",
        "summary": [list(kv) for kv in _summary(plan)],
        "warnings": list(plan.warnings),
        "advice": list(plan.advice),
        "notes": list(plan.solver.notes),
        "tables": _tables(plan),
        "figures": {
            "graph": _graph_figure(plan),
            "timeline": _timeline_figure(plan),
            "time": _time_figure(plan),
            "memory": _memory_figure(plan),
        },
        "layer_names": list(plan.layer_order),
    }


def _json_for_script(data: Any) -> str:
    """JSON that cannot end its ``<script>`` element or open a comment: ``<>&`` as escapes."""
    text = json.dumps(data, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return (
        text.replace("&", "\\u0026")
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def plotly_js() -> str:
    """plotly.js as shipped in the ``plotly`` package, safe to inline in a ``<script>``."""
    try:
        offline = importlib.import_module("plotly.offline")
    except ImportError:
        raise OutputError(
            "the HTML report needs the 'plotly' package (pip install plotly); it is a "
            "dependency of partitioner: reinstall it"
        ) from None
    source = str(offline.get_plotlyjs())
    if "<!--" in source:
        raise OutputError(
            "this plotly.js cannot be inlined (it holds '<!--'); install another plotly"
        )
    return re.sub(r"</(script)", r"<\\/\1", source, flags=re.IGNORECASE)


_STYLE = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0 auto;
       max-width: 1280px; padding: 16px 24px; color: #222; }
h1 { font-size: 22px; margin: 8px 0; } h2 { font-size: 17px; margin: 22px 0 8px; }
table { border-collapse: collapse; margin: 6px 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
tr.over td, tr.faster td { color: #b00020; font-weight: 600; }
tr.this td { font-weight: 600; } tr.bound td, tr.nofit td { color: #777; }
.banner { background: #fde8e8; border: 2px solid #b00020; color: #b00020; padding: 10px 14px;
          margin: 10px 0; font-weight: 600; }
.banner ul { margin: 4px 0 0 18px; padding: 0; }
.plot { width: 100%; min-height: 220px; }
.error { color: #b00020; font-weight: 600; }
#summary td:first-child { color: #555; }
"""

_APP_JS = """
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("plan-data").textContent);
  var status = { errors: [], plots: {} };

  function el(tag, text, cls) {
    var node = document.createElement(tag);
    if (text !== undefined && text !== null) { node.textContent = String(text); }
    if (cls) { node.className = cls; }
    return node;
  }
  function fillTable(id, table) {
    var node = document.getElementById(id);
    if (!node || !table) { return; }
    var head = el("tr");
    table.columns.forEach(function (c) { head.appendChild(el("th", c)); });
    node.appendChild(el("thead")).appendChild(head);
    var body = node.appendChild(el("tbody"));
    table.rows.forEach(function (row) {
      var tr = el("tr", null, row.cls);
      row.cells.forEach(function (c) { tr.appendChild(el("td", c)); });
      body.appendChild(tr);
    });
  }
  function fillList(id, items) {
    var node = document.getElementById(id);
    items.forEach(function (item) { node.appendChild(el("li", item)); });
  }

  document.getElementById("model-name").textContent = data.summary[0][1];
  var summary = document.getElementById("summary");
  data.summary.forEach(function (kv) {
    var tr = el("tr");
    tr.appendChild(el("td", kv[0]));
    tr.appendChild(el("td", kv[1]));
    summary.appendChild(tr);
  });
  if (data.warnings.length) {
    var banner = document.getElementById("warnings");
    banner.appendChild(el("div", data.warnings.length === 1 ? "Warning" : "Warnings"));
    var list = banner.appendChild(el("ul"));
    data.warnings.forEach(function (w) { list.appendChild(el("li", w)); });
    banner.hidden = false;
  }
  fillTable("devices", data.tables.devices);
  if (data.tables.stages) {
    fillTable("stages", data.tables.stages);
    document.getElementById("stages-section").hidden = false;
  }
  fillTable("comparison", data.tables.comparison);
  fillTable("strategies", data.tables.strategies);
  fillList("notes", data.notes);
  fillList("advice", data.advice);
  if (!data.advice.length) { document.getElementById("advice-section").hidden = true; }
  if (!data.notes.length) { document.getElementById("notes-section").hidden = true; }

  var names = Object.keys(data.figures);
  var config = { responsive: true, displaylogo: false };
  var pending = names.map(function (name) {
    var node = document.getElementById(name);
    var fig = data.figures[name];
    if (typeof Plotly === "undefined") {
      node.appendChild(el("p", "The chart library did not load.", "error"));
      return Promise.reject(new Error("Plotly is not defined"));
    }
    return Plotly.newPlot(node, fig.data, fig.layout, config).then(function () {
      var box = node.getBoundingClientRect();
      status.plots[name] = {
        width: box.width,
        height: box.height,
        svg: node.querySelectorAll("svg.main-svg").length,
        traces: fig.data.length
      };
    });
  });
  Promise.all(pending).catch(function (err) {
    status.errors.push(String(err && err.message ? err.message : err));
  }).then(function () {
    status.done = true;
    document.getElementById("report-status").textContent = JSON.stringify(status);
  });
})();
"""


def render_html(plan: Plan) -> str:
    """The report as one self-contained HTML document (see the module docstring)."""
    title = html.escape(f"Partition plan: {plan.model_name}")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{_STYLE}</style>
</head>
<body>
<h1>Plan for <span id="model-name"></span></h1>
<div id="warnings" class="banner" role="alert" hidden></div>
<table id="summary"></table>
<section><h2>Layer graph</h2><div id="graph" class="plot"></div></section>
<section><h2>Timeline</h2><div id="timeline" class="plot"></div></section>
<section><h2>Where the time goes</h2><div id="time" class="plot"></div></section>
<section><h2>Memory</h2><div id="memory" class="plot"></div></section>
<section><h2>Strategies (the predicted step of what each would run)</h2><table id="strategies"></table></section>
<section><h2>Solver comparison</h2><table id="comparison"></table></section>
<section id="notes-section"><h2>Solver notes</h2><ul id="notes"></ul></section>
<section><h2>Devices</h2><table id="devices"></table></section>
<section id="stages-section" hidden><h2>Pipeline stages</h2><table id="stages"></table></section>
<section id="advice-section"><h2>Advice</h2><ul id="advice"></ul></section>
<pre id="report-status" hidden></pre>
<script type="application/json" id="plan-data">{_json_for_script(report_data(plan))}</script>
<script>{plotly_js()}</script>
<script>{_APP_JS}</script>
</body>
</html>
"""


def write_html_report(plan: Plan, path: str | os.PathLike[str]) -> Path:
    """Write :func:`render_html` of ``plan`` to ``path``, atomically; returns the path."""
    # a later run may replace it (its mark); a file of the user's is never replaced (34am)
    return write_atomic(path, marked(render_html(plan), "<!--"), only_ours=True)
