"""The terminal report of a plan, rendered with ``rich`` to a console the caller owns.

:func:`render_plan` prints, from the :class:`~partitioner.plan.model.Plan` alone (so ``partition
show`` of a saved plan prints exactly what the run that made it printed):

* a table per device (layers, compute, memory against the limit, bytes sent and received),
* a table per pipeline stage when the plan pipelines (with each stage's bubble),
* the predicted step time against the lower bound, and a comparison with each baseline,
* where the time goes: per device and link, compute vs transfer vs idle (the pipeline bubble),
  from the simulated timeline when the plan records one, else from the per-device loads,
* the solver's notes, the advice, and the warnings (bold red).

:class:`PhaseProgress` shows the phases of a run (tracing, profiling, solving...) as progress
bars on a stderr console; it is the ``progress`` callback the API takes.

Every name that comes from the model is escaped before it reaches ``rich`` markup.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType

from rich.console import Console, JustifyMethod
from rich.markup import escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from partitioner.core.ir import EventKind
from partitioner.core.units import format_bytes, format_seconds
from partitioner.plan.model import Plan

__all__ = ["PhaseProgress", "ResourceTime", "render_plan", "resource_sort_key", "time_breakdown"]

_BAR_WIDTH = 12


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
    total = 0.0
    end = float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def time_breakdown(plan: Plan) -> tuple[ResourceTime, ...]:
    """Where the step's time goes, per device and link (see :class:`ResourceTime`).

    From ``plan.timeline`` when recorded (busy time is the union of the resource's events, so
    overlapping transfers on one channel count once); otherwise per device from
    ``plan.per_device`` (compute only: without a timeline link time is unknown).
    """
    step = plan.step_time_s
    if not plan.timeline:
        return tuple(
            ResourceTime(
                resource=f"device {d.device}",
                compute_s=d.compute_s,
                transfer_s=0.0,
                idle_s=max(0.0, step - d.compute_s),
            )
            for d in plan.per_device
        )
    by_resource: dict[str, list[tuple[float, float, EventKind]]] = {}
    for e in plan.timeline:
        by_resource.setdefault(e.resource, []).append((e.start_s, e.end_s, e.kind))
    span = max(step, max(e.end_s for e in plan.timeline))
    out = []
    for resource in sorted(by_resource, key=resource_sort_key):
        events = by_resource[resource]
        compute = _union_length([(a, b) for a, b, k in events if k is not EventKind.TRANSFER])
        transfer = _union_length([(a, b) for a, b, k in events if k is EventKind.TRANSFER])
        busy = _union_length([(a, b) for a, b, _ in events])
        out.append(
            ResourceTime(
                resource=resource,
                compute_s=compute,
                transfer_s=transfer,
                idle_s=max(0.0, span - busy),
            )
        )
    return tuple(out)


def _layers_cell(layers: tuple[str, ...], limit: int = 3) -> str:
    if not layers:
        return "(none)"
    shown = ", ".join(escape(n) for n in layers[:limit])
    more = f" +{len(layers) - limit} more" if len(layers) > limit else ""
    return f"{len(layers)}: {shown}{more}"


def _span_cell(layers: tuple[str, ...]) -> str:
    if not layers:
        return "(none)"
    if len(layers) == 1:
        return f"1: {escape(layers[0])}"
    return f"{len(layers)}: {escape(layers[0])} … {escape(layers[-1])}"


def _memory_cell(used: int, limit: int) -> str:
    share = ""
    if limit > 0:
        ratio = used / limit
        share = " (<1%)" if 0 < ratio < 0.005 else f" ({ratio:.0%})"
    text = f"{format_bytes(used)} / {format_bytes(limit)}{share}"
    return f"[bold red]{text}[/bold red]" if used > limit else text


def _bar(share: float) -> str:
    filled = round(max(0.0, min(1.0, share)) * _BAR_WIDTH)
    return "█" * filled + "░" * (_BAR_WIDTH - filled)


def _title(plan: Plan) -> str:
    # ``link`` describes the whole topology ("2 hosts x 8 x h100, nvlink4 within hosts, ...");
    # plans written before topologies named only the link ("pcie5").
    if plan.device_type in plan.link:
        where = escape(plan.link)
    else:
        where = f"{plan.num_devices} x {escape(plan.device_type)} ({escape(plan.link)})"
    return (
        f"Plan for [bold]{escape(plan.model_name)}[/bold] on {where}, batch {plan.batch_size}, "
        f"solver {escape(plan.solver.name)} ({escape(plan.solver.status)})"
    )


def _device_table(plan: Plan) -> Table:
    hosts = len({d.host for d in plan.devices}) > 1
    names = any(d.name for d in plan.devices)
    table = Table(title=_title(plan), title_justify="left")
    table.add_column("device", justify="right")
    if hosts:
        table.add_column("host", justify="right")
    if names:
        table.add_column("TF device")
    table.add_column("layers")
    table.add_column("compute", justify="right")
    table.add_column("memory / limit", justify="right")
    table.add_column("sent", justify="right")
    table.add_column("received", justify="right")
    for d in plan.per_device:
        extra = []
        if hosts:
            extra.append(str(plan.devices[d.device].host))
        if names:
            extra.append(escape(plan.devices[d.device].name) or "(local)")
        table.add_row(
            str(d.device),
            *extra,
            _layers_cell(d.layers),
            format_seconds(d.compute_s),
            _memory_cell(d.memory_bytes, d.memory_limit_bytes),
            format_bytes(d.bytes_sent),
            format_bytes(d.bytes_received),
        )
    return table


def _stage_table(plan: Plan) -> Table | None:
    pipe = plan.pipeline
    if pipe is None:
        return None
    table = Table(
        title=f"Pipeline: {pipe.schedule.value} schedule, {pipe.num_microbatches} micro-batches "
        f"of {plan.batch_size / pipe.num_microbatches:g}, {len(pipe.stage_devices)} stages",
        title_justify="left",
    )
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("stage", "right"),
        ("device", "right"),
        ("layers", "left"),
        ("compute", "right"),
        ("memory / limit", "right"),
        ("bytes in", "right"),
        ("bytes out", "right"),
        ("bubble", "right"),
    )
    for column, justify in columns:
        table.add_column(column, justify=justify)
    for s, d in enumerate(pipe.stage_devices):
        load = plan.per_device[d]
        bubble = f"{pipe.bubble_fraction[d]:.0%}" if d < len(pipe.bubble_fraction) else "-"
        table.add_row(
            str(s),
            str(d),
            _span_cell(load.layers),
            format_seconds(load.compute_s),
            _memory_cell(load.memory_bytes, load.memory_limit_bytes),
            format_bytes(load.bytes_received),
            format_bytes(load.bytes_sent),
            bubble,
        )
    return table


def _comparison_table(plan: Plan) -> Table:
    table = Table(title="Compared with", title_justify="left")
    table.add_column("plan")
    table.add_column("step time", justify="right")
    table.add_column("vs this plan", justify="right")
    table.add_column("vs lower bound", justify="right")
    table.add_column("note")

    def bound_ratio(t: float) -> str:
        return f"{t / plan.lower_bound_s:.2f}x" if plan.lower_bound_s > 0 else "-"

    table.add_row(
        f"[bold]{escape(plan.solver.name)}[/bold] (this plan)",
        format_seconds(plan.step_time_s),
        "1.00x",
        bound_ratio(plan.step_time_s),
        "",
    )
    for b in plan.baselines:
        if b.step_time_s is None:
            table.add_row(escape(b.solver), "does not fit", "-", "-", escape(b.note))
            continue
        if plan.step_time_s > 0:
            ratio = b.step_time_s / plan.step_time_s
            verdict = "slower" if ratio > 1.0005 else "faster" if ratio < 0.9995 else "same"
            versus = f"{ratio:.2f}x ({verdict})"
            if verdict == "faster":
                versus = f"[bold red]{versus}[/bold red]"
        else:
            versus = "-"
        table.add_row(
            escape(b.solver),
            format_seconds(b.step_time_s),
            versus,
            bound_ratio(b.step_time_s),
            escape(b.note),
        )
    return table


def _time_table(plan: Plan) -> Table:
    rows = time_breakdown(plan)
    pipelined = plan.pipeline is not None and plan.pipeline.num_microbatches > 1
    source = "from the simulated timeline" if plan.timeline else "no timeline: from the loads"
    table = Table(
        title=f"Where the time goes (step {format_seconds(plan.step_time_s)})",
        title_justify="left",
        caption=source,
        caption_justify="left",
    )
    table.add_column("resource")
    table.add_column("compute", justify="right")
    table.add_column("transfer", justify="right")
    table.add_column("idle (bubble)" if pipelined else "idle", justify="right")
    table.add_column("busy", justify="left")
    for r in rows:
        total = r.busy_s + r.idle_s
        share = r.busy_s / total if total > 0 else 0.0
        table.add_row(
            escape(r.resource),
            "-" if r.is_link else format_seconds(r.compute_s),
            format_seconds(r.transfer_s) if r.is_link or r.transfer_s else "-",
            format_seconds(r.idle_s),
            f"{_bar(share)} {share:.0%}",
        )
    return table


def render_plan(plan: Plan, console: Console, *, verbose: bool = False) -> None:
    """Print the plan's tables to ``console`` (a function of ``plan`` alone, see the module)."""
    console.print(_device_table(plan))
    stages = _stage_table(plan)
    if stages is not None:
        console.print(stages)

    ratio = plan.step_time_s / plan.lower_bound_s if plan.lower_bound_s > 0 else float("nan")
    console.print(
        f"Predicted step time: [bold]{format_seconds(plan.step_time_s)}[/bold]  "
        f"(lower bound {format_seconds(plan.lower_bound_s)}, ratio {ratio:.2f}x)"
    )
    if plan.baselines:
        console.print(_comparison_table(plan))
    console.print(_time_table(plan))
    if plan.solver.notes:
        label = (
            "Candidates (pipelined time per batch: the slowest device with its transfers)"
            if plan.solver.name == "auto"
            else f"Solver {escape(plan.solver.name)}"
        )
        console.print(f"{label}: " + "; ".join(escape(n) for n in plan.solver.notes))
    if plan.cost_notes:
        console.print("Costs: " + "; ".join(escape(n) for n in plan.cost_notes))
    for line in plan.advice:
        console.print(f"[yellow]Advice:[/yellow] {escape(line)}")
    for line in plan.warnings:
        console.print(f"[bold red]WARNING: {escape(line)}[/bold red]")
    if verbose and plan.phase_times_s:
        console.print(
            "Phases: "
            + ", ".join(f"{escape(k)} {format_seconds(v)}" for k, v in plan.phase_times_s)
        )


class PhaseProgress:
    """Progress bars for the phases of a run, as the API's ``progress`` callback.

    Use as a context manager around the run, on a stderr console::

        with PhaseProgress(err_console) as progress:
            plan = partition(model, gpus=2, progress=progress)

    Each call with a new ``message`` finishes the current phase's bar and starts the next;
    ``completed``/``total`` make the bar determinate (e.g. ops profiled, seconds of the solver's
    budget), otherwise it pulses. Finished phases stay on screen with their elapsed time. With
    ``enabled=False`` (not a terminal, or quiet) nothing is drawn.
    """

    def __init__(self, console: Console, *, enabled: bool = True) -> None:
        self._progress = Progress(
            SpinnerColumn(finished_text="[green]✓[/green]"),
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
        )
        self._task: TaskID | None = None
        self._message = ""

    def __enter__(self) -> PhaseProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._finish()
        self._progress.stop()

    def _finish(self) -> None:
        if self._task is not None:
            task = self._progress.tasks[-1]
            total = task.total if task.total is not None else 1.0
            self._progress.update(self._task, total=total, completed=total)
            self._progress.stop_task(self._task)

    def __call__(
        self, message: str, completed: float | None = None, total: float | None = None
    ) -> None:
        if message != self._message or self._task is None:
            self._finish()
            self._message = message
            self._task = self._progress.add_task(escape(message), total=total)
        if completed is not None or total is not None:
            self._progress.update(self._task, completed=completed, total=total)

    @property
    def phases(self) -> tuple[str, ...]:
        """The phases seen so far, in order."""
        return tuple(str(t.description) for t in self._progress.tasks)
