"""The report's tables, built once from a :class:`~partitioner.plan.model.Plan` as plain data.

Both reports show the same tables: the devices, the pipeline stages, the comparison with the
baselines, where the time goes, and memory against each limit. Each is built here as a
:class:`Table` of already formatted cells; :mod:`.terminal` renders it with ``rich`` and
:mod:`.html` sends it to the page as JSON. Cells hold raw text (names from the model unescaped):
each renderer escapes for its own medium.

The two media differ in room, so a builder takes the :class:`Medium` it builds for and the
differences are written where the table is built: the page always shows the device type, host
and TF device columns and lists more layers; the terminal shows a host or TF device column only
when it tells devices apart, a stage's layers as a span, and a verdict beside each baseline's
ratio; the page adds the lower bound as the comparison's last row.

Emphasis travels two ways, one per renderer: a cell's spans carry a :class:`Style` (the terminal
draws bold and bold red), and a row carries a :class:`RowKind` (the page's CSS class for it).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum

from partitioner.core.ir import EventKind
from partitioner.core.strategy import Family
from partitioner.core.units import format_bytes, format_seconds
from partitioner.plan.model import BaselineResult, DevicePrediction, PipelineInfo, Plan
from partitioner.planner.explain import FamilyRow, devices_text

__all__ = [
    "Align",
    "Cell",
    "Column",
    "Medium",
    "ResourceTime",
    "Row",
    "RowKind",
    "Span",
    "Style",
    "Table",
    "bound_ratio",
    "cell",
    "comparison_table",
    "device_table",
    "idle_text",
    "layers_text",
    "memory_text",
    "replica_roles",
    "resource_sort_key",
    "stage_table",
    "strategies_table",
    "strategy_headline",
    "time_breakdown",
    "time_table",
]


class Medium(Enum):
    """What a table is built for: the terminal (narrow) or the HTML page."""

    TERMINAL = "terminal"
    PAGE = "page"


_BAR_WIDTH = 12
"""Characters in the busy bar of the time table."""
_LAYERS_SHOWN = {Medium.TERMINAL: 3, Medium.PAGE: 6}
"""How many layers a device's cell names (the rest are counted)."""
_SAME_SPEED = 0.0005
"""Step-time ratios within this of 1 are "same" in the terminal's verdict."""


class Style(Enum):
    """How a span of a cell is drawn in the terminal."""

    PLAIN = "plain"
    BOLD = "bold"
    ALERT = "alert"
    """Bold red: over a memory limit, a baseline faster than the plan."""


class Align(Enum):
    """Where a column's cells sit (the terminal right-aligns numbers)."""

    LEFT = "left"
    RIGHT = "right"


class RowKind(Enum):
    """What a row is, for the page's CSS (the value is the class name)."""

    NORMAL = ""
    OVER = "over"
    """A device over its memory limit."""
    THIS = "this"
    """The plan itself, in the comparison."""
    FASTER = "faster"
    """A baseline faster than the plan."""
    NOFIT = "nofit"
    """A baseline that does not fit in memory."""
    BOUND = "bound"
    """The lower bound, in the comparison."""


@dataclass(frozen=True)
class Span:
    """A run of text in one style."""

    text: str
    style: Style = Style.PLAIN


@dataclass(frozen=True)
class Cell:
    """Formatted text, raw (unescaped), as spans of styles."""

    spans: tuple[Span, ...]

    @property
    def text(self) -> str:
        """The cell's text without styles."""
        return "".join(s.text for s in self.spans)


def cell(text: str, style: Style = Style.PLAIN) -> Cell:
    """A cell of one span."""
    return Cell((Span(text, style),))


@dataclass(frozen=True)
class Column:
    """A column's header and alignment."""

    header: str
    align: Align = Align.LEFT


@dataclass(frozen=True)
class Row:
    """One row: a cell per column, and what the row is."""

    cells: tuple[Cell, ...]
    kind: RowKind = RowKind.NORMAL


@dataclass(frozen=True)
class Table:
    """A titled table of formatted cells (``caption`` is shown under it, if any)."""

    title: Cell
    columns: tuple[Column, ...]
    rows: tuple[Row, ...]
    caption: str = ""


# -- formatting of cells ----------------------------------------------------------------------


def layers_text(layers: Sequence[str], limit: int) -> str:
    """``n: a, b, c +k more``: how many layers, the first ``limit`` by name."""
    if not layers:
        return "(none)"
    more = f" +{len(layers) - limit} more" if len(layers) > limit else ""
    return f"{len(layers)}: {', '.join(layers[:limit])}{more}"


def _span_text(layers: Sequence[str]) -> str:
    """``n: first … last``: a pipeline stage's layers, which are contiguous."""
    if not layers:
        return "(none)"
    if len(layers) == 1:
        return f"1: {layers[0]}"
    return f"{len(layers)}: {layers[0]} … {layers[-1]}"


def memory_text(used: int, limit: int) -> str:
    """``used / limit (share)``, e.g. ``20.00 MiB / 64.00 MiB (31%)``."""
    share = ""
    if limit > 0:
        ratio = used / limit
        share = " (<1%)" if 0 < ratio < 0.005 else f" ({ratio:.0%})"
    return f"{format_bytes(used)} / {format_bytes(limit)}{share}"


def _memory_cell(load: DevicePrediction) -> Cell:
    """The memory against the limit, in bold red when over it."""
    text = memory_text(load.memory_bytes, load.memory_limit_bytes)
    return cell(text, Style.PLAIN if load.fits else Style.ALERT)


def _fits_kind(load: DevicePrediction) -> RowKind:
    return RowKind.NORMAL if load.fits else RowKind.OVER


def bound_ratio(plan: Plan, time_s: float) -> str:
    """``time_s`` as a multiple of the plan's lower bound (``-`` without a bound)."""
    return f"{time_s / plan.lower_bound_s:.2f}x" if plan.lower_bound_s > 0 else "-"


def _versus(plan: Plan, time_s: float) -> str:
    """``time_s`` as a multiple of the plan's step time (``-`` for a zero step)."""
    return f"{time_s / plan.step_time_s:.2f}x" if plan.step_time_s > 0 else "-"


def _bar(share: float) -> str:
    filled = round(max(0.0, min(1.0, share)) * _BAR_WIDTH)
    return "█" * filled + "░" * (_BAR_WIDTH - filled)


# -- the strategy -----------------------------------------------------------------------------


def _speedup_over_single(plan: Plan) -> float | None:
    """One device's step over the plan's: the families table's single-device row, else the
    ``single`` baseline (None when neither was scored or fits)."""
    steps = [r.step_time_s for r in plan.strategies if r.family is Family.SINGLE and r.fits]
    steps += [b.step_time_s for b in plan.baselines if b.solver == "single" and b.step_time_s]
    if not steps or plan.step_time_s <= 0:
        return None
    return steps[0] / plan.step_time_s


def strategy_headline(plan: Plan) -> str | None:
    """``2 data-parallel replicas, predicted step 41.200 ms, 1.80x one device``: the strategy
    the plan applies in words with its step (and its speed-up when one device was scored), and
    the devices it leaves idle (:func:`idle_text`); None for a plan without a strategy."""
    if plan.strategy is None:
        return None
    text = f"{plan.strategy.describe()}, predicted step {format_seconds(plan.step_time_s)}"
    speedup = _speedup_over_single(plan)
    if speedup is not None and plan.strategy.family is not Family.SINGLE:
        text += f", {speedup:.2f}x one device"
    idle = idle_text(plan)
    return f"{text}; {idle}" if idle else text


def idle_text(plan: Plan) -> str:
    """``uses 2 of the 8 devices, devices 2-7 idle``, or ``""`` when the plan uses them all."""
    idle = plan.idle_devices
    if not idle:
        return ""
    used = plan.num_devices - len(idle)
    return f"uses {used} of the {plan.num_devices} devices, {devices_text(idle)} idle"


def replica_roles(plan: Plan) -> dict[int, tuple[int, int, int]]:
    """Device -> ``(replica, stage, replica 0's device of that stage)`` for the devices of
    replicas 1..R-1 of the plan's strategy (empty without replicas): they run the same layers
    as replica 0's device, which the assignment names."""
    if plan.strategy is None:
        return {}
    first = plan.strategy.device_groups[0]
    return {
        d: (r, s, first[s])
        for r, group in enumerate(plan.strategy.device_groups)
        if r > 0
        for s, d in enumerate(group)
    }


def _replica_text(plan: Plan, role: tuple[int, int, int]) -> str:
    """``replica 1 of stage 0 (same layers as device 0)``."""
    replica, stage, first = role
    where = (
        f"replica {replica} of stage {stage}"
        if plan.strategy and plan.strategy.stages > 1
        else f"replica {replica}"
    )
    return f"{where} (same layers as device {first})"


# -- the devices ------------------------------------------------------------------------------

_DeviceColumn = tuple[Column, Callable[[DevicePrediction], Cell]]

IDLE_DEVICE = "idle (runs nothing)"
"""The layers cell of a device the plan leaves idle."""


def _device_columns(plan: Plan, medium: Medium) -> tuple[_DeviceColumn, ...]:
    """The device table's columns, each with how it fills a device's cell."""
    page = medium is Medium.PAGE
    limit = _LAYERS_SHOWN[medium]
    several_hosts = len({d.host for d in plan.devices}) > 1
    named = any(d.name for d in plan.devices)
    columns: list[_DeviceColumn] = [
        (Column("device", Align.RIGHT), lambda d: cell(str(d.device))),
    ]
    if page:
        columns.append((Column("type"), lambda d: cell(plan.devices[d.device].device_type)))
    if page or several_hosts:
        columns.append(
            (Column("host", Align.RIGHT), lambda d: cell(str(plan.devices[d.device].host)))
        )
    if page or named:
        columns.append(
            (Column("TF device"), lambda d: cell(plan.devices[d.device].name or "(local)"))
        )
    roles = replica_roles(plan)
    idle = set(plan.idle_devices)

    def layers(d: DevicePrediction) -> Cell:
        if d.device in roles and not d.layers:
            return cell(_replica_text(plan, roles[d.device]))
        if d.device in idle:
            return cell(IDLE_DEVICE)
        return cell(layers_text(d.layers, limit))

    columns += [
        (Column("layers"), layers),
        (Column("compute", Align.RIGHT), lambda d: cell(format_seconds(d.compute_s))),
        (Column("memory / limit", Align.RIGHT), _memory_cell),
        (Column("sent", Align.RIGHT), lambda d: cell(format_bytes(d.bytes_sent))),
        (Column("received", Align.RIGHT), lambda d: cell(format_bytes(d.bytes_received))),
    ]
    return tuple(columns)


def _plan_title(plan: Plan) -> Cell:
    """``Plan for <model> on <devices>, batch <n>, solver <name> (<status>)``."""
    # ``link`` describes the whole topology ("2 hosts x 8 x h100, nvlink4 within hosts, ...");
    # plans written before topologies named only the link ("pcie5").
    if plan.device_type in plan.link:
        where = plan.link
    else:
        where = f"{plan.num_devices} x {plan.device_type} ({plan.link})"
    return Cell(
        (
            Span("Plan for "),
            Span(plan.model_name, Style.BOLD),
            Span(
                f" on {where}, batch {plan.batch_size}, "
                f"solver {plan.solver.name} ({plan.solver.status})"
            ),
        )
    )


def device_table(plan: Plan, medium: Medium) -> Table:
    """A row per device: its layers, compute, memory against the limit, bytes sent, received."""
    columns = _device_columns(plan, medium)
    return Table(
        title=_plan_title(plan),
        columns=tuple(c for c, _ in columns),
        rows=tuple(
            Row(tuple(fill(d) for _, fill in columns), _fits_kind(d)) for d in plan.per_device
        ),
    )


# -- the pipeline stages ----------------------------------------------------------------------

_STAGE_COLUMNS = (
    Column("stage", Align.RIGHT),
    Column("device", Align.RIGHT),
    Column("layers"),
    Column("compute", Align.RIGHT),
    Column("memory / limit", Align.RIGHT),
    Column("bytes in", Align.RIGHT),
    Column("bytes out", Align.RIGHT),
    Column("bubble", Align.RIGHT),
)


def _microbatches_text(plan: Plan, pipe: PipelineInfo) -> str:
    """``4 micro-batches of 8``; a hybrid's replica runs its share of the batch in them:
    ``2 micro-batches of 4 per replica`` (the batch of 16 over 2 replicas)."""
    replicas = plan.strategy.replicas if plan.strategy is not None else 1
    size = plan.batch_size / (replicas * pipe.num_microbatches)
    each = " per replica" if replicas > 1 else ""
    return f"{pipe.num_microbatches} micro-batches of {size:g}{each}"


def stage_table(plan: Plan, medium: Medium) -> Table | None:
    """A row per pipeline stage, with its device's loads and bubble; None without a pipeline."""
    pipe = plan.pipeline
    if pipe is None:
        return None
    rows = []
    for s, d in enumerate(pipe.stage_devices):
        load = plan.per_device[d]
        if medium is Medium.TERMINAL:
            layers = _span_text(load.layers)
        else:
            layers = layers_text(load.layers, _LAYERS_SHOWN[medium])
        bubble = f"{pipe.bubble_fraction[d]:.0%}" if d < len(pipe.bubble_fraction) else "-"
        texts = (str(s), str(d), layers, format_seconds(load.compute_s))
        tail = (format_bytes(load.bytes_received), format_bytes(load.bytes_sent), bubble)
        cells = (*map(cell, texts), _memory_cell(load), *map(cell, tail))
        rows.append(Row(cells, _fits_kind(load)))
    title = (
        f"Pipeline: {pipe.schedule.value} schedule, {_microbatches_text(plan, pipe)}, "
        f"{len(pipe.stage_devices)} stages"
    )
    return Table(title=cell(title), columns=_STAGE_COLUMNS, rows=tuple(rows))


# -- the comparison with the baselines --------------------------------------------------------

_COMPARISON_COLUMNS = (
    Column("plan"),
    Column("step time", Align.RIGHT),
    Column("vs this plan", Align.RIGHT),
    Column("vs lower bound", Align.RIGHT),
    Column("note"),
)


def _this_plan_row(plan: Plan, medium: Medium) -> Row:
    """The plan itself: 1.00x of itself; the page adds its status and solve time."""
    name = plan.solver.name
    if medium is Medium.TERMINAL:
        label = Cell((Span(name, Style.BOLD), Span(" (this plan)")))
        note = ""
    else:
        label = cell(f"{name} (this plan, {plan.solver.status})")
        note = f"solved in {format_seconds(plan.solver.solve_time_s)}"
    times = (format_seconds(plan.step_time_s), "1.00x", bound_ratio(plan, plan.step_time_s))
    return Row((label, *map(cell, times), cell(note)), RowKind.THIS)


def _terminal_versus(plan: Plan, time_s: float) -> Cell:
    """``1.23x (slower)``: the ratio to the plan with a verdict, bold red when faster."""
    if plan.step_time_s <= 0:
        return cell("-")
    ratio = time_s / plan.step_time_s
    if ratio > 1 + _SAME_SPEED:
        verdict = "slower"
    elif ratio < 1 - _SAME_SPEED:
        verdict = "faster"
    else:
        verdict = "same"
    text = f"{ratio:.2f}x ({verdict})"
    return cell(text, Style.ALERT if verdict == "faster" else Style.PLAIN)


def _baseline_row(plan: Plan, baseline: BaselineResult, medium: Medium) -> Row:
    """A baseline's step time against the plan's and the bound (or that it does not fit)."""
    name, note = cell(baseline.solver), cell(baseline.note)
    if baseline.step_time_s is None:
        return Row((name, *map(cell, ("does not fit", "-", "-")), note), RowKind.NOFIT)
    time_s = baseline.step_time_s
    if medium is Medium.TERMINAL:
        versus = _terminal_versus(plan, time_s)
    else:
        versus = cell(_versus(plan, time_s))
    kind = RowKind.FASTER if time_s < plan.step_time_s else RowKind.NORMAL
    step = cell(format_seconds(time_s))
    return Row((name, step, versus, cell(bound_ratio(plan, time_s)), note), kind)


def _bound_row(plan: Plan) -> Row:
    """The lower bound as a row: no placement is faster."""
    texts = (
        "lower bound",
        format_seconds(plan.lower_bound_s),
        _versus(plan, plan.lower_bound_s),
        "1.00x",
        "no placement is faster",
    )
    return Row(tuple(map(cell, texts)), RowKind.BOUND)


def comparison_table(plan: Plan, medium: Medium) -> Table:
    """The plan, each baseline and (on the page) the lower bound, by step time."""
    rows = [_this_plan_row(plan, medium)]
    rows += [_baseline_row(plan, b, medium) for b in plan.baselines]
    if medium is Medium.PAGE:
        rows.append(_bound_row(plan))
    return Table(title=cell("Compared with"), columns=_COMPARISON_COLUMNS, rows=tuple(rows))


# -- strategies ------------------------------------------------------------------------------

_STRATEGY_COLUMNS = (
    Column("strategy"),
    Column("step time", Align.RIGHT),
    Column("vs one device", Align.RIGHT),
    Column("fullest device", Align.RIGHT),
    Column("why not"),
)


def _strategy_row(row: FamilyRow) -> Row:
    speedup = "-" if row.speedup_over_single is None else f"{row.speedup_over_single:.2f}x"
    name = f"{row.family.label}: {row.description}" + (" (fastest)" if row.chosen else "")
    memory = memory_text(row.peak_memory_bytes, row.memory_limit_bytes)
    cells = (
        cell(name, Style.BOLD if row.chosen else Style.PLAIN),
        cell(format_seconds(row.step_time_s)),
        cell(speedup),
        cell(memory, Style.PLAIN if row.fits else Style.ALERT),
        cell(row.why_not),
    )
    kind = RowKind.THIS if row.chosen else RowKind.NORMAL if row.fits else RowKind.NOFIT
    return Row(cells, kind)


def strategies_table(plan: Plan) -> Table | None:
    """The best strategy of each family by its predicted step, fastest first (None when the
    plan compared none)."""
    if not plan.strategies:
        return None
    return Table(
        title=cell("Strategies (the predicted step of what each would run)"),
        columns=_STRATEGY_COLUMNS,
        rows=tuple(_strategy_row(r) for r in plan.strategies),
        caption="replicas at their own batch, pipelines with their bubbles, the gradient all-reduce",
    )


# -- where the time goes ----------------------------------------------------------------------


@dataclass(frozen=True)
class ResourceTime:
    """How one device or link spends the step: busy computing, busy transferring, idle.

    ``idle_s`` is the step time less the busy time (for a pipelined plan: its bubble).
    """

    resource: str
    compute_s: float
    transfer_s: float
    idle_s: float

    @property
    def busy_s(self) -> float:
        return self.compute_s + self.transfer_s

    @property
    def is_link(self) -> bool:
        return not self.resource.startswith("device")


def resource_sort_key(resource: str) -> tuple[int, tuple[tuple[int, str], ...]]:
    """Devices before links, then natural order (``device 2`` before ``device 10``)."""
    parts = tuple(
        (int(p), "") if p.isdigit() else (-1, p) for p in re.split(r"(\d+)", resource) if p
    )
    return (0 if resource.startswith("device") else 1, parts)


def _union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _load_breakdown(plan: Plan) -> tuple[ResourceTime, ...]:
    """Without a timeline: per device, its compute and the rest of the step idle."""
    return tuple(
        ResourceTime(
            resource=f"device {d.device}",
            compute_s=d.compute_s,
            transfer_s=0.0,
            idle_s=max(0.0, plan.step_time_s - d.compute_s),
        )
        for d in plan.per_device
    )


def time_breakdown(plan: Plan) -> tuple[ResourceTime, ...]:
    """Where the step's time goes, per device and link (see :class:`ResourceTime`).

    From ``plan.timeline`` when recorded (busy time is the union of the resource's events, so
    overlapping transfers on one channel count once); otherwise per device from
    ``plan.per_device`` (compute only: without a timeline link time is unknown).
    """
    if not plan.timeline:
        return _load_breakdown(plan)
    by_resource: dict[str, list[tuple[float, float, EventKind]]] = {}
    for e in plan.timeline:
        by_resource.setdefault(e.resource, []).append((e.start_s, e.end_s, e.kind))
    span = max(plan.step_time_s, max(e.end_s for e in plan.timeline))
    out = []
    for resource in sorted(by_resource, key=resource_sort_key):
        events = by_resource[resource]
        compute = _union_length([(a, b) for a, b, k in events if k is not EventKind.TRANSFER])
        transfer = _union_length([(a, b) for a, b, k in events if k is EventKind.TRANSFER])
        busy = _union_length([(a, b) for a, b, _ in events])
        out.append(ResourceTime(resource, compute, transfer, max(0.0, span - busy)))
    return _with_replicas(plan, out)


def _with_replicas(plan: Plan, rows: list[ResourceTime]) -> tuple[ResourceTime, ...]:
    """``rows`` (replica 0's simulated step) with a row per device of the other replicas that
    the timeline leaves out, as its stage's replica 0 device spends the step: replicas are
    copies, so they are not idle."""
    by_name = {r.resource: r for r in rows}
    extra = []
    for d, (replica, _, first) in sorted(replica_roles(plan).items()):
        same = by_name.get(f"device {first}")
        if same is not None and f"device {d}" not in by_name:
            name = f"device {d} (replica {replica}, as device {first})"
            extra.append(replace(same, resource=name))
    return tuple(sorted((*rows, *extra), key=lambda r: resource_sort_key(r.resource)))


def _time_row(r: ResourceTime) -> Row:
    """A resource's compute, transfer, idle time and a bar of its busy share."""
    total = r.busy_s + r.idle_s
    share = r.busy_s / total if total > 0 else 0.0
    texts = (
        r.resource,
        "-" if r.is_link else format_seconds(r.compute_s),
        format_seconds(r.transfer_s) if r.is_link or r.transfer_s else "-",
        format_seconds(r.idle_s),
        f"{_bar(share)} {share:.0%}",
    )
    return Row(tuple(map(cell, texts)))


def time_table(plan: Plan) -> Table:
    """Where the time goes, per device and link (rows of :func:`time_breakdown`). The
    timeline is replica 0's step: for replicas, the gradients' all-reduce after it is in the
    idle column, and said so (it read as idle devices, campaign 34ak)."""
    pipelined = plan.pipeline is not None and plan.pipeline.num_microbatches > 1
    replicated = plan.strategy is not None and plan.strategy.replicas > 1
    idle = "idle (bubble)" if pipelined else "idle"
    columns = (
        Column("resource"),
        Column("compute", Align.RIGHT),
        Column("transfer", Align.RIGHT),
        Column(f"{idle} + all-reduce" if replicated else idle, Align.RIGHT),
        Column("busy"),
    )
    caption = "from the simulated timeline" if plan.timeline else "no timeline: from the loads"
    if replicated and plan.timeline:
        tail = max(0.0, plan.step_time_s - max(e.end_s for e in plan.timeline))
        caption += (
            f"; the step's last {format_seconds(tail)} is the replicas' gradient all-reduce "
            "(not in the timeline)"
        )
    return Table(
        title=cell(f"Where the time goes (step {format_seconds(plan.step_time_s)})"),
        columns=columns,
        rows=tuple(_time_row(r) for r in time_breakdown(plan)),
        caption=caption,
    )
