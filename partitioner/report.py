"""The terminal report of a plan: one row per device, the prediction against the bound and the
baselines, and the advice. Renders to a ``rich`` console the caller owns."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from partitioner.plan import Plan
from partitioner.units import format_bytes, format_seconds

__all__ = ["render_plan"]


def _layers_cell(layers: tuple[str, ...], limit: int = 3) -> str:
    if not layers:
        return "(none)"
    shown = ", ".join(escape(n) for n in layers[:limit])
    more = f" +{len(layers) - limit} more" if len(layers) > limit else ""
    return f"{len(layers)}: {shown}{more}"


def render_plan(plan: Plan, console: Console, *, verbose: bool = False) -> None:
    """Print the plan's tables to ``console``."""
    title = (
        f"Plan for [bold]{escape(plan.model_name)}[/bold] on {plan.num_devices} x "
        f"{escape(plan.device_type)} ({escape(plan.link)}), batch {plan.batch_size}, "
        f"solver {escape(plan.solver.name)} ({escape(plan.solver.status)})"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("device", justify="right")
    table.add_column("layers")
    table.add_column("compute", justify="right")
    table.add_column("memory / limit", justify="right")
    table.add_column("sent", justify="right")
    table.add_column("received", justify="right")
    for d in plan.per_device:
        memory = f"{format_bytes(d.memory_bytes)} / {format_bytes(d.memory_limit_bytes)}"
        if d.memory_bytes > d.memory_limit_bytes:
            memory = f"[red]{memory}[/red]"
        table.add_row(
            str(d.device),
            _layers_cell(d.layers),
            format_seconds(d.compute_s),
            memory,
            format_bytes(d.bytes_sent),
            format_bytes(d.bytes_received),
        )
    console.print(table)

    ratio = plan.step_time_s / plan.lower_bound_s if plan.lower_bound_s > 0 else float("nan")
    console.print(
        f"Predicted step time: [bold]{format_seconds(plan.step_time_s)}[/bold]  "
        f"(lower bound {format_seconds(plan.lower_bound_s)}, ratio {ratio:.2f}x)"
    )
    if plan.baselines:
        parts = []
        for b in plan.baselines:
            value = format_seconds(b.step_time_s) if b.step_time_s is not None else "does not fit"
            parts.append(f"{escape(b.solver)} {value}")
        console.print("Baselines: " + ";  ".join(parts))
    if plan.solver.notes:
        label = (
            "Candidates (pipelined time per batch: the slowest device with its transfers)"
            if plan.solver.name == "auto"
            else f"Solver {escape(plan.solver.name)}"
        )
        console.print(f"{label}: " + "; ".join(escape(n) for n in plan.solver.notes))
    for line in plan.advice:
        console.print(f"[yellow]Advice:[/yellow] {escape(line)}")
    if verbose and plan.phase_times_s:
        console.print(
            "Phases: " + ", ".join(f"{escape(k)} {format_seconds(v)}" for k, v in plan.phase_times_s)
        )
