"""The terminal report of a plan, rendered with ``rich`` to a console the caller owns.

:func:`render_plan` prints, from the :class:`~partitioner.plan.model.Plan` alone (so ``partition
show`` of a saved plan prints exactly what the run that made it printed):

* the strategy the plan applies, in words, with its predicted step and speed-up over one device
  (when the plan records one),
* a table per device (layers, compute, memory against the limit, bytes sent and received; the
  devices of data-parallel replicas 1..R-1 are named as copies of replica 0's),
* a table per pipeline stage when the plan pipelines (with each stage's bubble),
* the predicted step time against the lower bound, and a comparison with each baseline,
* where the time goes: per device and link, compute vs transfer vs idle (the pipeline bubble),
  from the simulated timeline when the plan records one, else from the per-device loads,
* the solver's notes, the advice, and the warnings (bold red).

:class:`PhaseProgress` shows the phases of a run (tracing, profiling, solving...) as progress
bars on a stderr console; it is the ``progress`` callback the API takes.

The tables are built in :mod:`.tables` (the HTML page shows the same ones); this module draws
them. Every text that comes from the model or a plan file reaches ``rich`` through :func:`_text`:
its control characters escaped (``\x1b``, ``\u202e``: a name cannot drive the terminal, see
:func:`partitioner.core.errors.escape_control`), then its markup. On a console that is not UTF-8
(``LC_ALL=C``) rich draws ASCII boxes and the progress spinner is ASCII too.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table as RichTable

from partitioner.core.errors import escape_control
from partitioner.core.units import format_seconds
from partitioner.plan.model import Plan
from partitioner.report.tables import (
    Cell,
    Medium,
    Style,
    Table,
    comparison_table,
    device_table,
    stage_table,
    strategies_table,
    strategy_headline,
    time_table,
)

__all__ = ["PhaseProgress", "escape", "render_plan"]

_MARKUP = {Style.PLAIN: "", Style.BOLD: "bold", Style.ALERT: "bold red"}


def escape(text: str) -> str:
    """``text`` as literal ``rich`` markup with its control characters escaped."""
    return _markup_escape(escape_control(text))


def _markup(cell: Cell) -> str:
    """The cell as ``rich`` markup: its text escaped, each styled span in its style."""
    out = []
    for span in cell.spans:
        tag = _MARKUP[span.style]
        out.append(f"[{tag}]{escape(span.text)}[/{tag}]" if tag else escape(span.text))
    return "".join(out)


def _rich_table(table: Table) -> RichTable:
    """A :class:`~partitioner.report.tables.Table` as a ``rich`` table."""
    out = RichTable(
        title=_markup(table.title),
        title_justify="left",
        caption=escape(table.caption) if table.caption else None,
        caption_justify="left",
    )
    for column in table.columns:
        out.add_column(escape(column.header), justify=column.align.value)
    for row in table.rows:
        out.add_row(*(_markup(c) for c in row.cells))
    return out


def _summary_line(plan: Plan) -> str:
    """The predicted step time against the lower bound (no ratio to a bound of 0: "nanx",
    campaign 34v)."""
    bound = f"lower bound {format_seconds(plan.lower_bound_s)}"
    if plan.lower_bound_s > 0:
        bound += f", ratio {plan.step_time_s / plan.lower_bound_s:.2f}x"
    return f"Predicted step time: [bold]{format_seconds(plan.step_time_s)}[/bold]  ({bound})"


def _print_tables(plan: Plan, console: Console) -> None:
    """The strategy, the devices, the stages, the step time, the comparison and where the time
    goes."""
    headline = strategy_headline(plan)
    if headline is not None:
        console.print(f"[bold]Strategy:[/bold] {escape(headline)}")
    console.print(_rich_table(device_table(plan, Medium.TERMINAL)))
    stages = stage_table(plan, Medium.TERMINAL)
    if stages is not None:
        console.print(_rich_table(stages))
    console.print(_summary_line(plan))
    if plan.baselines:
        console.print(_rich_table(comparison_table(plan, Medium.TERMINAL)))
    strategies = strategies_table(plan)
    if strategies is not None:
        console.print(_rich_table(strategies))
    console.print(_rich_table(time_table(plan)))


def _print_messages(
    plan: Plan, console: Console, *, verbose: bool, spell: Callable[[str], str]
) -> None:
    """The solver's and the cost model's notes, the advice, the warnings (and the phases),
    each through ``spell`` (the command line spells the library's arguments as its flags)."""
    if plan.solver.notes:
        label = (
            "Candidates (pipelined time per batch: the slowest device with its transfers)"
            if plan.solver.name == "auto"
            else f"Solver {escape(plan.solver.name)}"
        )
        console.print(f"{label}: " + "; ".join(escape(spell(n)) for n in plan.solver.notes))
    if plan.cost_notes:
        console.print("Costs: " + "; ".join(escape(spell(n)) for n in plan.cost_notes))
    for line in plan.advice:
        console.print(f"[yellow]Advice:[/yellow] {escape(spell(line))}")
    for line in plan.warnings:
        console.print(f"[bold red]WARNING: {escape(spell(line))}[/bold red]")
    if verbose and plan.phase_times_s:
        console.print(
            "Phases: "
            + ", ".join(f"{escape(k)} {format_seconds(v)}" for k, v in plan.phase_times_s)
        )


def render_plan(
    plan: Plan, console: Console, *, verbose: bool = False, spell: Callable[[str], str] = str
) -> None:
    """Print the plan's tables to ``console`` (a function of ``plan`` alone, see the module);
    its notes, advice and warnings through ``spell`` (the command line's
    :func:`~partitioner.cli.main.cli_message`: ``strategy='auto'`` -> ``--strategy auto``)."""
    _print_tables(plan, console)
    _print_messages(plan, console, verbose=verbose, spell=spell)


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
        utf8 = (console.encoding or "").lower().replace("-", "").startswith("utf")
        self._progress = Progress(
            SpinnerColumn(
                "dots" if utf8 else "line", finished_text="[green]✓[/green]" if utf8 else "+"
            ),
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
