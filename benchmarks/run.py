"""The benchmark suite: the strategy auto chooses, and every solver's placement, on the zoo.

    python -m benchmarks.run [--quick] [--json OUT.json] [--table OUT.txt] [--readme OUT.md]
                             [--measured FILE.json ...] [--models a,b] [--devices 2,4,8]
                             [--topologies pcie,nvlink] [--time-limit S]
                             [--strategy-time-limit S] [--no-strategies]

Each model of :data:`benchmarks.zoo.ZOO` is built once and traced at its batch size ``B`` and at
every per-replica batch ``B / R`` the strategy search needs
(:func:`benchmarks.zoo.per_replica_batches`), then freed; it is costed on 2, 4 and 8 devices of its catalog device type, joined by ``pcie`` or
``nvlink`` (the device's own generation of each,
:func:`cost_models.devices.communication.resolve_link`).

**The headline** (issue 16: the number reported is the simulated step of what the rewrite would
execute, never a proxy): per (model, devices, topology) group, :func:`run_strategies` runs the
strategy planner as ``partition`` does (:mod:`benchmarks.realised`: every family, the search
limited to ``--strategy-time-limit``, default :data:`partitioner.api.STRATEGY_SEARCH_LIMIT_S`)
and reports ``auto``'s chosen strategy in words and its predicted step
(:func:`partitioner.simulation.strategy.simulate_strategy`) against one device, the best data
parallel, the even split pipelined (1F1B, the best micro-batch count) and the best pure pipeline,
with ``auto``'s gain over each (only against strategies that fit). One JSON record per group
(``groups`` in the JSON).

**The placement table** (``records`` in the JSON; not what runs): every solver of
:func:`partitioner.solvers.solver_names` places the whole batch on every device
(``time_limit_s`` for the ones that use it: ``ilp`` and ``auto``), scored on its own proxy
objective.

Columns (one row per model, devices, topology, solver; every time is *predicted* by the cost model
and simulator, not measured):

* ``step_s``: the simulated plain training step (:func:`partitioner.simulation.evaluate.evaluate`: one batch
  forward through every device, then backward, no pipelining), ``step/LB`` its ratio to the
  step lower bound (:attr:`partitioner.simulation.bounds.LowerBounds.best_s`: work, op critical path,
  largest layer).
* ``pipe_s``: the pipelined time per batch, :func:`partitioner.solvers.ilp.throughput_objective_s`
  -- the slowest device's compute plus the transfer time of every cut edge it sends or receives,
  i.e. the steady-state time per batch of a pipeline fed with many micro-batches; ``pipe/LB`` its
  ratio to :attr:`~partitioner.simulation.bounds.LowerBounds.throughput_s` (work, largest layer). ``auto``
  and ``ilp`` minimise this figure, so the comparisons below use it.
* ``1f1b_ms``: the simulated 1F1B (PipeDream-Flush) training step of the placement with ``M``
  micro-batches (``M = 4 x devices``, at most the batch size),
  :func:`partitioner.simulation.pipeline.simulate_pipeline`: bubbles, transfers overlapped with
  compute; ``-`` where the placement is not a pipeline (stages that send both ways, as
  round-robin's do).
* ``mem``: the fullest device's training memory (weights, gradients, Adam state, saved
  activations) over its limit; for an infeasible ``single`` row, the fraction one device would
  need.
* ``solve_s``: the solver's wall time on this machine.

The solver summary (printed, and the README's "not what runs" subsection), per group: the
``auto`` solver's pipelined time against the best *baseline* solver (every registered solver
that ignores the time limit, :func:`partitioner.solvers.fast_solver_names`), against ``ilp`` run
on its own, and its gain over ``even`` on that proxy.

``--measured FILE`` merges measured rows (see :func:`load_measured` for the record format, e.g.
the output of ``benchmarks/cluster_pipeline.py``) into a second table and the JSON.

Exit status: 0, or 1 when ``auto``'s strategy is slower than a strategy reported beside it that
fits, a group's strategy search fails, or the ``auto`` solver's pipelined time is worse than a
baseline solver's (regressions: both run the others as candidates); 2 on bad arguments.
"""

import sys

# OR-Tools must load before TensorFlow (google/or-tools#3230) for CP-SAT to run in-process; when
# TensorFlow is already loaded (under pytest), loading OR-Tools now would crash, and the ILP runs
# CP-SAT in a worker process instead.
if "tensorflow" not in sys.modules:
    import ortools.sat.python.cp_model  # noqa: F401

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from benchmarks import realised
from benchmarks.realised import EVEN_PIPELINE, GroupResult, realised_group
from benchmarks.zoo import ZOO, TracedZooModel, per_replica_batches, trace_zoo_model, zoo_model
from cost_models.estimate.costs import cost_graph
from partitioner.api import STRATEGY_SEARCH_LIMIT_S
from partitioner.core.errors import InfeasibleError, PartitionError
from partitioner.core.files import write_atomic
from partitioner.core.ir import CostedGraph, Graph, Schedule
from partitioner.simulation.bounds import costed_lower_bounds
from partitioner.simulation.evaluate import evaluate
from partitioner.simulation.pipeline import simulate_pipeline
from partitioner.solvers import SOLVERS, fast_solver_names, get_solver, solver_names
from partitioner.solvers.ilp import throughput_objective_s

__all__ = [
    "BASELINE_DESCRIPTIONS",
    "GroupSummary",
    "Record",
    "Summary",
    "load_measured",
    "main",
    "readme_section",
    "record_table",
    "run_config",
    "run_strategies",
    "strategy_section",
    "summarize",
    "summary_lines",
]

Topology = Literal["pcie", "nvlink"]
TOPOLOGIES: tuple[Topology, ...] = ("pcie", "nvlink")
DEVICE_COUNTS: tuple[int, ...] = (2, 4, 8)
TIME_LIMIT_S = 5.0
QUICK_TIME_LIMIT_S = 1.0
QUICK_MODELS: tuple[str, ...] = ("mobilenet_v2", "lstm_nmt", "multi_tower", "transformer_1b")
QUICK_DEVICE_COUNTS: tuple[int, ...] = (2, 4)
MICROBATCHES_PER_DEVICE = 4
"""The 1F1B column simulates ``M = 4 x devices`` micro-batches (at most the batch size)."""
TOLERANCE = 1e-9
"""Relative slack when comparing two predicted times (float noise, not a margin)."""
MEASURED_STATUS = "measured"

BASELINE_DESCRIPTIONS: tuple[tuple[str, str], ...] = tuple(
    (name, cls.description) for name, cls in SOLVERS.items()
)
"""What each solver stands for (its ``description``), in registry order: the README's order."""


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """One row: a solver's placement of one model on one device count and topology."""

    model: str
    devices: int
    topology: str
    solver: str
    status: str
    """The solver's status (``optimal``, ``feasible``, ``heuristic``), ``infeasible``,
    ``error: <Type>``, or ``measured`` for a merged measured row."""
    step_time_s: float | None
    pipelined_time_s: float | None
    lower_bound_s: float | None
    pipelined_lower_bound_s: float | None
    solve_time_s: float | None
    max_memory_fraction: float | None
    peak_memory_bytes: int | None
    memory_limit_bytes: int | None
    device_type: str
    link: str
    batch_size: int
    pipeline_1f1b_s: float | None = None
    """The simulated 1F1B step (:func:`partitioner.simulation.pipeline.simulate_pipeline`) with
    ``num_microbatches`` micro-batches; None where the placement is not a pipeline."""
    num_microbatches: int | None = None
    measured_time_s: float | None = None
    predicted_time_s: float | None = None
    note: str = ""

    @property
    def step_ratio(self) -> float | None:
        return _ratio(self.step_time_s, self.lower_bound_s)

    @property
    def pipelined_ratio(self) -> float | None:
        return _ratio(self.pipelined_time_s, self.pipelined_lower_bound_s)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _ratio(x: float | None, lb: float | None) -> float | None:
    if x is None or lb is None or lb <= 0:
        return None
    return x / lb


def _memory(costed: CostedGraph, assignment: Sequence[int]) -> tuple[int, float]:
    """The fullest device's memory and its fraction of that device's limit."""
    from cost_models.estimate.memory import peak_memory_bytes

    used = list(peak_memory_bytes(costed.layer_memory, assignment, costed.topology.num_devices))
    fractions = [u / dev.memory_bytes for u, dev in zip(used, costed.topology.devices, strict=True)]
    worst = max(range(len(used)), key=lambda d: fractions[d])
    return used[worst], fractions[worst]


def _one_f_one_b(costed: CostedGraph, assignment: Sequence[int]) -> tuple[float | None, int, str]:
    """The simulated 1F1B step of ``assignment``, its micro-batch count, and why it is missing."""
    m = min(MICROBATCHES_PER_DEVICE * costed.topology.num_devices, costed.graph.batch_size)
    try:
        sim = simulate_pipeline(
            costed, assignment, schedule=Schedule.ONE_F_ONE_B, num_microbatches=m
        )
    except PartitionError as exc:  # e.g. round-robin: stages that send back and forth
        return None, m, f"1f1b: {str(exc).splitlines()[0][:160]}"
    return sim.step_time_s, m, ""


def run_config(
    model: str,
    graph: Graph,
    *,
    device_type: str,
    num_devices: int,
    topology: Topology,
    solvers: Sequence[str] | None = None,
    time_limit_s: float = TIME_LIMIT_S,
    memory_limit_bytes: int | None = None,
) -> tuple[Record, ...]:
    """Cost ``graph`` on ``num_devices`` x ``device_type`` over ``topology`` (each device's memory
    capped at ``memory_limit_bytes`` if given); place it with each of ``solvers`` (default: every
    registered one) and evaluate each placement."""
    costed = cost_graph(
        graph,
        device_type=device_type,
        num_devices=num_devices,
        link=topology,
        memory_limit_bytes=memory_limit_bytes,
    )
    problem = costed.problem()
    bounds = costed_lower_bounds(costed)
    limit = costed.topology.devices[0].memory_bytes
    common: dict[str, Any] = {
        "model": model,
        "devices": num_devices,
        "topology": topology,
        "lower_bound_s": bounds.best_s,
        "pipelined_lower_bound_s": bounds.throughput_s,
        "memory_limit_bytes": limit,
        "device_type": device_type,
        "link": costed.topology.link.kind,
        "batch_size": graph.batch_size,
    }
    rows = []
    for name in solvers if solvers is not None else solver_names():
        solver = get_solver(name, seed=0, time_limit_s=time_limit_s)
        t0 = time.perf_counter()
        try:
            result = solver.solve(problem)
        except PartitionError as exc:
            elapsed = time.perf_counter() - t0
            infeasible = isinstance(exc, InfeasibleError)
            peak: int | None = None
            fraction: float | None = None
            if infeasible and name == "single":  # its placement is known: all on device 0
                peak, fraction = _memory(costed, [0] * problem.num_layers)
            rows.append(
                Record(
                    solver=name,
                    status="infeasible" if infeasible else f"error: {type(exc).__name__}",
                    step_time_s=None,
                    pipelined_time_s=None,
                    solve_time_s=elapsed,
                    max_memory_fraction=fraction,
                    peak_memory_bytes=peak,
                    note=str(exc).splitlines()[0][:200],
                    **common,
                )
            )
            continue
        elapsed = time.perf_counter() - t0
        ev = evaluate(costed, result.assignment)
        peak, fraction = _memory(costed, result.assignment)
        one_f_one_b_s, microbatches, why = _one_f_one_b(costed, result.assignment)
        rows.append(
            Record(
                solver=name,
                status=result.status.value,
                step_time_s=ev.step_time_s,
                pipelined_time_s=throughput_objective_s(problem, result.assignment),
                solve_time_s=elapsed,
                max_memory_fraction=fraction,
                peak_memory_bytes=peak,
                pipeline_1f1b_s=one_f_one_b_s,
                num_microbatches=microbatches,
                note=why,
                **common,
            )
        )
    return tuple(rows)


def run_strategies(
    model: str,
    graph_at: Callable[[int], Graph],
    batch_size: int,
    *,
    device_type: str,
    num_devices: int,
    topology: Topology,
    time_limit_s: float = STRATEGY_SEARCH_LIMIT_S,
) -> GroupResult:
    """The strategy search of one group on the realised objective
    (:func:`benchmarks.realised.realised_group`); ``graph_at(b)`` is the model traced at batch
    ``b``, costed here on ``num_devices`` x ``device_type`` over ``topology``."""
    costed: dict[int, CostedGraph] = {}

    def costed_at(batch: int) -> CostedGraph:
        if batch not in costed:
            costed[batch] = cost_graph(
                graph_at(batch), device_type=device_type, num_devices=num_devices, link=topology
            )
        return costed[batch]

    return realised_group(model, topology, costed_at, batch_size, time_limit_s=time_limit_s)


# --------------------------------------------------------------------------------------------
# Measured rows
# --------------------------------------------------------------------------------------------

_MEASURED_FLOATS = (
    "measured_time_s",
    "predicted_time_s",
    "step_time_s",
    "pipelined_time_s",
    "pipeline_1f1b_s",
    "lower_bound_s",
    "pipelined_lower_bound_s",
    "solve_time_s",
    "max_memory_fraction",
)


def load_measured(path: str | os.PathLike[str]) -> tuple[Record, ...]:
    """Measured rows from a JSON file: a list of objects, or ``{"records": [...]}``.

    Each object needs ``model``, ``devices`` (int), ``solver`` and ``measured_time_s`` (the
    measured wall time per batch); optional: ``topology`` (default ``"localhost"``),
    ``predicted_time_s`` (the plan's prediction for the same quantity), ``step_time_s``,
    ``pipelined_time_s``, ``pipeline_1f1b_s``, ``device_type``, ``batch_size``,
    ``num_microbatches``, ``note`` (e.g. the schedule). Unknown keys are ignored. Raises
    ``ValueError`` naming the bad entry.
    """
    text = Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    items = data.get("records") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a list of records or {{'records': [...]}}")
    rows = []
    for k, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"{path}: record {k} is not an object")
        missing = [
            key for key in ("model", "devices", "solver", "measured_time_s") if key not in item
        ]
        if missing:
            raise ValueError(f"{path}: record {k} lacks {', '.join(missing)}")
        floats: dict[str, Any] = {}
        for key in _MEASURED_FLOATS:
            value = item.get(key)
            if value is not None and not isinstance(value, (int, float)):
                raise ValueError(f"{path}: record {k} {key}={value!r} is not a number")
            floats[key] = None if value is None else float(value)
        try:
            ints: dict[str, Any] = {
                "devices": int(item["devices"]),
                "batch_size": int(item.get("batch_size", 0)),
                "num_microbatches": (
                    None if item.get("num_microbatches") is None else int(item["num_microbatches"])
                ),
            }
        except (TypeError, ValueError):
            raise ValueError(
                f"{path}: record {k} has a non-integer devices/batch_size/num_microbatches"
            ) from None
        rows.append(
            Record(
                model=str(item["model"]),
                topology=str(item.get("topology", "localhost")),
                solver=str(item["solver"]),
                status=MEASURED_STATUS,
                peak_memory_bytes=None,
                memory_limit_bytes=None,
                device_type=str(item.get("device_type", "cpu")),
                link=str(item.get("link", item.get("topology", "localhost"))),
                note=str(item.get("note", "")),
                **ints,
                **floats,
            )
        )
    return tuple(rows)


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSummary:
    """``auto`` against the others for one (model, devices, topology)."""

    model: str
    devices: int
    topology: str
    auto_s: float | None
    auto_step_s: float | None
    auto_memory_fraction: float | None
    auto_ratio: float | None
    best_baseline: str | None
    best_baseline_s: float | None
    even_s: float | None
    ilp_s: float | None
    single_fits: bool
    single_step_s: float | None
    best_baseline_step_s: float | None
    auto_1f1b_s: float | None = None
    best_baseline_1f1b_s: float | None = None
    even_1f1b_s: float | None = None

    @property
    def auto_ok(self) -> bool:
        """Whether auto is no slower than the best baseline (pipelined time)."""
        if self.best_baseline_s is None:
            return True
        return self.auto_s is not None and self.auto_s <= self.best_baseline_s * (1 + TOLERANCE)

    @property
    def ilp_ok(self) -> bool:
        if self.ilp_s is None:
            return True
        return self.auto_s is not None and self.auto_s <= self.ilp_s * (1 + TOLERANCE)

    @property
    def gain_over_even(self) -> float | None:
        if self.auto_s is None or self.even_s is None or self.even_s <= 0:
            return None
        return 1.0 - self.auto_s / self.even_s

    @property
    def one_f_one_b_ok(self) -> bool:
        """Whether auto's simulated 1F1B step is no slower than every baseline's."""
        if self.best_baseline_1f1b_s is None or self.auto_1f1b_s is None:
            return True
        return self.auto_1f1b_s <= self.best_baseline_1f1b_s * (1 + TOLERANCE)

    @property
    def one_f_one_b_gain_over_even(self) -> float | None:
        if self.auto_1f1b_s is None or self.even_1f1b_s is None or self.even_1f1b_s <= 0:
            return None
        return 1.0 - self.auto_1f1b_s / self.even_1f1b_s

    @property
    def step_ok(self) -> bool:
        """Whether auto's *plain step* is no slower than every baseline's (not what it optimises)."""
        if self.best_baseline_step_s is None or self.auto_step_s is None:
            return True
        return self.auto_step_s <= self.best_baseline_step_s * (1 + TOLERANCE)


@dataclass(frozen=True)
class Summary:
    groups: tuple[GroupSummary, ...]
    placements: int = 0
    """Feasible placements (rows with a step time)."""
    pipelines: int = 0
    """Of those, the ones the 1F1B simulator accepted (data flowing one way between devices)."""

    @property
    def auto_never_slower(self) -> bool:
        return all(g.auto_ok for g in self.groups)

    def gains(
        self,
        *,
        min_devices: int = 4,
        needs_memory_split: bool | None = None,
        one_f_one_b: bool = False,
    ) -> list[float]:
        """``auto``'s gains over ``even`` at ``>= min_devices`` devices, optionally only where the
        model does (True) or does not (False) fit one device; on the pipelined time per batch,
        or with ``one_f_one_b`` on the simulated 1F1B step."""
        out = []
        for g in self.groups:
            if g.devices < min_devices:
                continue
            if needs_memory_split is not None and needs_memory_split == g.single_fits:
                continue
            gain = g.one_f_one_b_gain_over_even if one_f_one_b else g.gain_over_even
            if gain is not None:
                out.append(gain)
        return out


def summarize(records: Iterable[Record]) -> Summary:
    """Per (model, devices, topology): auto against the best baseline, ilp, even and single."""
    groups: dict[tuple[str, int, str], list[Record]] = {}
    for r in records:
        if r.status != MEASURED_STATUS:
            groups.setdefault((r.model, r.devices, r.topology), []).append(r)
    out = []
    for (model, n, topo), rows in groups.items():
        by = {r.solver: r for r in rows}
        auto = by.get("auto")
        baselines = [
            r for r in rows if r.solver in fast_solver_names() and r.pipelined_time_s is not None
        ]
        best = min(baselines, key=lambda r: r.pipelined_time_s or math.inf, default=None)
        best_step = min(
            (r.step_time_s for r in baselines if r.step_time_s is not None), default=None
        )
        best_1f1b = min(
            (r.pipeline_1f1b_s for r in baselines if r.pipeline_1f1b_s is not None), default=None
        )
        single = by.get("single")
        even = by.get("even")
        ilp = by.get("ilp")
        out.append(
            GroupSummary(
                model=model,
                devices=n,
                topology=topo,
                auto_s=auto.pipelined_time_s if auto else None,
                auto_step_s=auto.step_time_s if auto else None,
                auto_memory_fraction=auto.max_memory_fraction if auto else None,
                auto_ratio=auto.pipelined_ratio if auto else None,
                best_baseline=best.solver if best else None,
                best_baseline_s=best.pipelined_time_s if best else None,
                even_s=even.pipelined_time_s if even else None,
                ilp_s=ilp.pipelined_time_s if ilp else None,
                single_fits=single is None or single.status != "infeasible",
                single_step_s=single.step_time_s if single else None,
                best_baseline_step_s=best_step,
                auto_1f1b_s=auto.pipeline_1f1b_s if auto else None,
                best_baseline_1f1b_s=best_1f1b,
                even_1f1b_s=even.pipeline_1f1b_s if even else None,
            )
        )
    placed = [r for rows in groups.values() for r in rows if r.step_time_s is not None]
    return Summary(
        tuple(out),
        placements=len(placed),
        pipelines=sum(r.pipeline_1f1b_s is not None for r in placed),
    )


def _ms(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x * 1e3:.3f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _avg(xs: Sequence[float]) -> str:
    if not xs:
        return "- (no group)"
    return f"{sum(xs) / len(xs) * 100:.1f}% over {len(xs)} groups (min {min(xs) * 100:.1f}%, max {max(xs) * 100:.1f}%)"


def summary_lines(summary: Summary) -> list[str]:
    """The printed summary block: one line per group, then the totals and checks."""
    lines = [
        "placement solvers: the auto solver vs the others, pipelined time per batch (ms; a proxy "
        "objective, NOT the step that runs: see the strategy block for that):"
    ]
    for g in summary.groups:
        flags = []
        if not g.auto_ok:
            flags.append(f"<-- auto SLOWER than {g.best_baseline}")
        if not g.ilp_ok:
            flags.append("(ilp alone better)")
        if not g.single_fits:
            flags.append("[does not fit one device]")
        lines.append(
            f"  {g.model} x{g.devices} {g.topology}: auto {_ms(g.auto_s)}, best baseline "
            f"{_ms(g.best_baseline_s)} ({g.best_baseline or '-'}), even {_ms(g.even_s)}, ilp "
            f"{_ms(g.ilp_s)}; gain over even {_pct(g.gain_over_even)} {' '.join(flags)}".rstrip()
        )
    losses = [g for g in summary.groups if not g.auto_ok]
    ilp_losses = [g for g in summary.groups if not g.ilp_ok]
    step_losses = [g for g in summary.groups if not g.step_ok]
    lines.append(
        f"auto solver's proxy never worse than the best baseline solver's: "
        f"{'yes' if not losses else 'NO'} ({len(summary.groups) - len(losses)}/{len(summary.groups)} groups)"
        + "".join(
            f"; loses {g.model} x{g.devices} {g.topology} to {g.best_baseline}" for g in losses
        )
    )
    lines.append(
        f"auto vs ilp alone (same time limit): ilp better in {len(ilp_losses)} groups"
        + "".join(f"; {g.model} x{g.devices} {g.topology}" for g in ilp_losses)
    )
    lines.append(
        f"plain (un-pipelined) step, which auto does not optimise: auto slower than the best "
        f"baseline's step in {len(step_losses)}/{len(summary.groups)} groups"
    )
    f1b_losses = [g for g in summary.groups if not g.one_f_one_b_ok]
    lines.append(
        f"simulated 1F1B step (M = {MICROBATCHES_PER_DEVICE} x devices; {summary.pipelines} of "
        f"{summary.placements} placements are pipelines the simulator accepts, the rest are "
        f"blank): auto slower than the best baseline's in {len(f1b_losses)}/{len(summary.groups)} groups"
        + "".join(f"; {g.model} x{g.devices} {g.topology}" for g in f1b_losses)
    )
    lines.append(
        "proxy (not what runs): gain over even at 4 and 8 devices, every model: "
        + _avg(summary.gains(min_devices=4))
    )
    lines.append(
        "  the same on the simulated 1F1B step: "
        + _avg(summary.gains(min_devices=4, one_f_one_b=True))
    )
    lines.append(
        "proxy (not what runs): gain over even at 4 and 8 devices, models that do not fit one "
        "device: " + _avg(summary.gains(min_devices=4, needs_memory_split=True))
    )
    return lines


# --------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------

Column = tuple[str, Literal["<", ">"], Callable[[Record], str]]


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def _gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


PREDICTED_COLUMNS: tuple[Column, ...] = (
    ("model", "<", lambda r: r.model),
    ("dev", ">", lambda r: str(r.devices)),
    ("topology", "<", lambda r: f"{r.topology} ({r.link})"),
    ("solver", "<", lambda r: r.solver),
    ("step_ms", ">", lambda r: _ms(r.step_time_s)),
    ("step/LB", ">", lambda r: _num(r.step_ratio, ".3f")),
    ("pipe_ms", ">", lambda r: _ms(r.pipelined_time_s)),
    ("pipe/LB", ">", lambda r: _num(r.pipelined_ratio, ".3f")),
    ("1f1b_ms", ">", lambda r: _ms(r.pipeline_1f1b_s)),
    ("M", ">", lambda r: "-" if r.num_microbatches is None else str(r.num_microbatches)),
    ("mem_GiB/limit", ">", lambda r: f"{_gib(r.peak_memory_bytes)}/{_gib(r.memory_limit_bytes)}"),
    ("mem", ">", lambda r: _num(r.max_memory_fraction, ".3f")),
    ("solve_s", ">", lambda r: _num(r.solve_time_s, ".3f")),
    ("status", "<", lambda r: r.status),
)

MEASURED_COLUMNS: tuple[Column, ...] = (
    ("model", "<", lambda r: r.model),
    ("dev", ">", lambda r: str(r.devices)),
    ("topology", "<", lambda r: r.topology),
    ("solver", "<", lambda r: r.solver),
    ("measured_ms", ">", lambda r: _ms(r.measured_time_s)),
    ("predicted_ms", ">", lambda r: _ms(r.predicted_time_s)),
    ("pred/meas", ">", lambda r: _num(_ratio(r.predicted_time_s, r.measured_time_s), ".2f")),
    ("M", ">", lambda r: "-" if r.num_microbatches is None else str(r.num_microbatches)),
    ("note", "<", lambda r: r.note),
)


def _render(header: Sequence[str], aligns: Sequence[str], cells: Sequence[Sequence[str]]) -> str:
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)
    ]
    out = []
    for line in [list(header), *cells]:
        out.append(
            "  ".join(
                c.ljust(w) if a == "<" else c.rjust(w)
                for c, w, a in zip(line, widths, aligns, strict=True)
            ).rstrip()
        )
    out.insert(1, "-" * max(len(line) for line in out))
    return "\n".join(out)


def record_table(records: Sequence[Record], columns: Sequence[Column] = PREDICTED_COLUMNS) -> str:
    """A fixed-width text table of ``records``."""
    return _render(
        [c[0] for c in columns],
        [c[1] for c in columns],
        [[c[2](r) for c in columns] for r in records],
    )


def _markdown(header: Sequence[str], cells: Sequence[Sequence[str]], right: Sequence[bool]) -> str:
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---:" if r else "---" for r in right) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# README section
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """Where and how a run was made, for the generated text."""

    command: str
    date: str
    git_commit: str
    machine: str
    wall_time_s: float
    time_limit_s: float
    trace_lines: tuple[str, ...]
    table_path: str | None = None
    json_path: str | None = None
    strategy_time_limit_s: float = STRATEGY_SEARCH_LIMIT_S
    strategy_failures: tuple[str, ...] = ()
    """``model xN topology: why`` of every group whose strategy search raised."""


def _git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).resolve().parent.parent,
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError:
        return "unknown"
    return out.stdout.strip() or "unknown"


def _too_big_lines(records: Sequence[Record], summary: Summary) -> list[str]:
    """One bullet per model that does not fit one device: what single needs, where auto fits."""
    lines = []
    models = dict.fromkeys(g.model for g in summary.groups if not g.single_fits)
    for model in models:
        single = next(r for r in records if r.model == model and r.solver == "single")
        fits = [
            f"{g.devices} {g.topology} {_num(g.auto_memory_fraction, '.2f')}"
            for g in summary.groups
            if g.model == model and g.auto_s is not None
        ]
        none = sorted({g.devices for g in summary.groups if g.model == model and g.auto_s is None})
        lines.append(
            f"- {model}: `single` infeasible (one device would need "
            f"{_num(single.max_memory_fraction, '.2f')}x its {_gib(single.memory_limit_bytes)} GiB)"
            + (f"; no solver fits {', '.join(map(str, none))} devices" if none else "")
            + (
                "; `auto`'s plans fit every device, fullest device / limit at " + ", ".join(fits)
                if fits
                else ""
            )
            + "."
        )
    return lines


def _strategy_cells(g: GroupResult) -> list[str]:
    return [
        g.model,
        str(g.devices),
        g.topology,
        f"{g.chosen_description} ({g.chosen_family})" + ("" if g.chosen_fits else ", does not fit"),
        realised.ms(g.chosen_step_s),
        realised.entry_cell(g, "single"),
        realised.entry_cell(g, "data_parallel"),
        realised.entry_cell(g, EVEN_PIPELINE),
        realised.entry_cell(g, "pipeline"),
        realised.pct(g.gain_over(g.step_s("single"))),
        realised.pct(g.gain_over(g.step_s("data_parallel"))),
        realised.pct(g.gain_over(g.step_s(EVEN_PIPELINE))),
        realised.pct(g.gain_over(g.step_s("pipeline"))),
    ]


def strategy_section(groups: Sequence[GroupResult], cmd: str) -> list[str]:
    """The README's headline: ``auto``'s strategy against the others on the simulated step."""
    summary = realised.summarize_realised(groups)
    out = [
        f"Summary ({cmd}), on the **predicted step of what would run** (the strategy planner's "
        "simulation of the rewritten training step, each replica at its own batch, all-reduce "
        "and pipeline bubbles included), only against strategies that fit in memory:",
        "",
        *(f"- {line}." for line in realised.summary_lines(summary)),
        "",
        f"Per model, devices and topology, predicted step in ms ({cmd}): `auto`'s strategy and "
        "its step; the best of each family the planner scored (one device, data parallel, "
        "a pure pipeline); the even split pipelined (the `even` solver's layers over every "
        "device, 1F1B, the best micro-batch count M); `auto`'s gain over each (`1 - auto / "
        "other`, `-` where the other does not fit or does not run).",
        "",
        _markdown(
            [
                "model",
                "devices",
                "topology",
                "auto's strategy",
                "auto",
                "single",
                "data parallel",
                "even pipeline",
                "best pipeline",
                "vs single",
                "vs data parallel",
                "vs even pipeline",
                "vs best pipeline",
            ],
            [_strategy_cells(g) for g in groups],
            [False, True, False, False, *([True] * 9)],
        ),
    ]
    return out


def strategy_text(groups: Sequence[GroupResult]) -> list[str]:
    """The printed block of the strategy search: one line per group, then the headline."""
    lines = ["auto's strategy vs the others, predicted step of what would run (ms):"]
    for g in groups:
        cells = ", ".join(
            f"{r.name} {realised.ms(r.step_time_s)}" + ("" if r.fits else " (does not fit)")
            for r in g.results
        )
        lines.append(
            f"  {g.model} x{g.devices} {g.topology}: auto {realised.ms(g.chosen_step_s)} = "
            f"{g.chosen_description} ({g.chosen_family}, {g.chosen_placement}); {cells}; "
            f"search {g.search_time_s:.1f} s" + ("" if g.ok else "  <-- auto SLOWER")
        )
    return lines + realised.summary_lines(realised.summarize_realised(groups))


def readme_section(
    records: Sequence[Record], info: RunInfo, groups: Sequence[GroupResult] = ()
) -> str:
    """The README's results section, in Markdown, generated from ``groups`` (the strategy
    search, the headline) and ``records`` (each solver's placement, not what runs)."""
    predicted = [r for r in records if r.status != MEASURED_STATUS]
    measured = [r for r in records if r.status == MEASURED_STATUS]
    summary = summarize(predicted)
    cmd = f"`{info.command}`"
    out = [
        "## Benchmark results",
        "",
        f"Generated by {cmd} (git {info.git_commit}, {info.date}, {info.machine}, "
        f"{info.wall_time_s / 60:.1f} min wall; solver time limit {info.time_limit_s:g} s, "
        f"strategy search limit {info.strategy_time_limit_s:g} s). "
        "Nothing here is typed by hand: rerun the command to regenerate every number in this "
        "section."
        + (f" The full table of every solver is in `{info.table_path}`." if info.table_path else "")
        + (
            f" The JSON (one record per group, one per solver row) is in `{info.json_path}`."
            if info.json_path
            else ""
        ),
        "",
        "Every time below is *predicted* by the cost model (roofline over the device catalog) and "
        "the simulator; none is measured on a GPU.",
        "",
        "Models (random weights, `keras.applications` and Keras layers; nothing downloaded):",
        "",
    ]
    out += [f"- {line}" for line in info.trace_lines]
    if groups:
        out += ["", *strategy_section(groups, cmd)]
    out += [f"- Strategy search failed: {line}" for line in info.strategy_failures]
    out += [
        "",
        "### Placement solvers on their own objective (not what runs)",
        "",
        "Each solver's layer placement of the whole batch on every device, scored on the "
        "**pipelined time per batch** (the slowest device's compute plus its transfers: the "
        "steady state of a pipeline fed with many micro-batches, which the `auto` and `ilp` "
        "solvers minimise). That figure is a proxy, not the step the rewrite runs: the numbers "
        "above are. The 1F1B columns simulate one step of the placement pipelined with "
        f"PipeDream-Flush's schedule and M = {MICROBATCHES_PER_DEVICE} x devices micro-batches "
        "(blank where the placement is not a pipeline).",
        "",
        "What each solver stands for:",
        "",
    ]
    names = {r.solver for r in predicted}
    out.append(
        _markdown(
            ["solver", "stands for"],
            [[f"`{n}`", d] for n, d in BASELINE_DESCRIPTIONS if n in names],
            [False, False],
        )
    )
    losses = [g for g in summary.groups if not g.auto_ok]
    out += [
        "",
        f"Solver checks ({cmd}; proxy objective, not what runs):",
        "",
        f"- The `auto` solver's pipelined time is never worse than the best baseline solver's: "
        f"**{'yes' if not losses else 'no'}** "
        f"({len(summary.groups) - len(losses)} of {len(summary.groups)} groups)"
        + "".join(
            f"; it loses {g.model} x{g.devices} {g.topology} to `{g.best_baseline}`" for g in losses
        )
        + ".",
        f"- {summary.pipelines} of {summary.placements} placements are pipelines the 1F1B "
        "simulator accepts (the others send data both ways between two devices).",
    ]
    out += _too_big_lines(predicted, summary)
    out += [
        "",
        f"Per model, devices and topology, ms ({cmd}; placements, not what runs): pipelined "
        "time per batch of the `auto` solver's placement, its ratio to the lower bound, the best "
        "baseline solver's and the even split's, the `auto` solver's gain over even on that "
        "proxy; the simulated 1F1B step of its placement and of even's; one device's plain "
        "step; the fullest device's memory under the `auto` solver.",
        "",
    ]
    cells = []
    for g in summary.groups:
        cells.append(
            [
                g.model,
                str(g.devices),
                g.topology,
                _ms(g.auto_s),
                _num(g.auto_ratio, ".2f"),
                f"{_ms(g.best_baseline_s)} ({g.best_baseline or '-'})",
                _ms(g.even_s),
                _pct(g.gain_over_even),
                _ms(g.auto_1f1b_s),
                _ms(g.even_1f1b_s),
                _ms(g.single_step_s) if g.single_fits else "infeasible",
                _num(g.auto_memory_fraction, ".3f"),
            ]
        )
    out.append(
        _markdown(
            [
                "model",
                "devices",
                "topology",
                "auto",
                "auto / LB",
                "best baseline",
                "even",
                "auto vs even (proxy)",
                "auto 1F1B",
                "even 1F1B",
                "single (1 device step)",
                "auto peak mem / limit",
            ],
            cells,
            [False, True, False, True, True, True, True, True, True, True, True, True],
        )
    )
    if measured:
        out += [
            "",
            f"Measured on this machine (merged with `--measured`, {cmd}):",
            "",
            _markdown(
                [
                    "model",
                    "devices",
                    "topology",
                    "solver",
                    "measured ms",
                    "predicted ms",
                    "predicted / measured",
                    "micro-batches",
                    "note",
                ],
                [
                    [
                        r.model,
                        str(r.devices),
                        r.topology,
                        r.solver,
                        _ms(r.measured_time_s),
                        _ms(r.predicted_time_s),
                        _num(_ratio(r.predicted_time_s, r.measured_time_s), ".2f"),
                        "-" if r.num_microbatches is None else str(r.num_microbatches),
                        r.note,
                    ]
                    for r in measured
                ],
                [False, True, False, False, True, True, True, True, False],
            ),
        ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _csv(kind: Callable[[str], Any]) -> Callable[[str], tuple[Any, ...]]:
    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(x.strip()) for x in text.split(",") if x.strip())
        except (ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def _topology(text: str) -> Topology:
    if text not in TOPOLOGIES:
        raise ValueError(f"unknown topology {text!r}; known: {', '.join(TOPOLOGIES)}")
    return text


def _model_name(text: str) -> str:
    return zoo_model(text).name


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{', '.join(QUICK_MODELS)} at {', '.join(map(str, QUICK_DEVICE_COUNTS))} devices, "
        f"time limit {QUICK_TIME_LIMIT_S:g} s",
    )
    parser.add_argument("--models", type=_csv(_model_name), help="comma-separated zoo models")
    parser.add_argument("--devices", type=_csv(int), help="comma-separated device counts")
    parser.add_argument("--topologies", type=_csv(_topology), help="pcie,nvlink")
    parser.add_argument("--solvers", type=_csv(str), help="comma-separated solvers (default all)")
    parser.add_argument(
        "--time-limit", type=float, help=f"solver time limit, s (default {TIME_LIMIT_S:g})"
    )
    parser.add_argument(
        "--strategy-time-limit",
        type=float,
        help="the strategy search's time limit, s (default: the product's "
        f"{STRATEGY_SEARCH_LIMIT_S:g}, at most the solver time limit)",
    )
    parser.add_argument(
        "--no-strategies",
        action="store_true",
        help="skip the strategy search (only the solvers' placements, not what runs)",
    )
    parser.add_argument(
        "--json", metavar="OUT", help="write the group and row records to OUT (JSON)"
    )
    parser.add_argument("--table", metavar="OUT", help="also write the printed text to OUT")
    parser.add_argument("--readme", metavar="OUT", help="write the README results section to OUT")
    parser.add_argument(
        "--measured",
        metavar="FILE",
        action="append",
        default=[],
        help="merge measured records from FILE (JSON, see load_measured); repeatable",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    models = args.models or (QUICK_MODELS if args.quick else tuple(e.name for e in ZOO))
    device_counts = args.devices or (QUICK_DEVICE_COUNTS if args.quick else DEVICE_COUNTS)
    topologies = args.topologies or TOPOLOGIES
    time_limit_s = args.time_limit or (QUICK_TIME_LIMIT_S if args.quick else TIME_LIMIT_S)
    strategy_limit_s = args.strategy_time_limit or min(time_limit_s, STRATEGY_SEARCH_LIMIT_S)
    solvers = args.solvers or solver_names()
    unknown = sorted(set(solvers) - set(solver_names()))
    if unknown:
        parser.error(f"unknown solvers {', '.join(unknown)}; known: {', '.join(solver_names())}")
    if any(n < 1 for n in device_counts):
        parser.error(f"device counts must be >= 1, got {device_counts}")
    measured: list[Record] = []
    for path in args.measured:
        try:
            measured.extend(load_measured(path))
        except (OSError, ValueError) as exc:
            parser.error(f"--measured {path}: {exc}")

    say = sys.stderr.write
    start = time.perf_counter()
    records: list[Record] = []
    groups: list[GroupResult] = []
    failed: list[str] = []
    trace_lines: list[str] = []
    for name in models:
        entry = zoo_model(name)
        extra = (
            () if args.no_strategies else per_replica_batches(entry.batch_size, max(device_counts))
        )
        traced: TracedZooModel = trace_zoo_model(entry, extra)
        trace_lines.append(traced.describe())
        say(traced.describe() + "\n")
        for n in device_counts:
            for topo in topologies:
                t0 = time.perf_counter()
                records.extend(
                    run_config(
                        name,
                        traced.graph,
                        device_type=entry.device_type,
                        num_devices=n,
                        topology=topo,
                        solvers=solvers,
                        time_limit_s=time_limit_s,
                    )
                )
                t1 = time.perf_counter()
                if not args.no_strategies:
                    try:
                        groups.append(
                            run_strategies(
                                name,
                                traced.graph_at,
                                entry.batch_size,
                                device_type=entry.device_type,
                                num_devices=n,
                                topology=topo,
                                time_limit_s=strategy_limit_s,
                            )
                        )
                    except PartitionError as exc:
                        failed.append(f"{name} x{n} {topo}: {str(exc).splitlines()[0][:200]}")
                say(
                    f"  {name} x{n} {topo}: solvers {t1 - t0:.1f} s, strategies "
                    f"{time.perf_counter() - t1:.1f} s\n"
                )
        del traced
    wall_s = time.perf_counter() - start

    command = " ".join(["python -m benchmarks.run", *map(shlex.quote, argv_list)])
    info = RunInfo(
        command=command,
        date=datetime.date.today().isoformat(),
        git_commit=_git_commit(),
        machine=f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        wall_time_s=wall_s,
        time_limit_s=time_limit_s,
        trace_lines=tuple(trace_lines),
        table_path=args.table,
        json_path=args.json,
        strategy_time_limit_s=strategy_limit_s,
        strategy_failures=tuple(failed),
    )
    summary = summarize(records)
    text = [
        f"$ {command}   # {info.date}, {info.machine}, git {info.git_commit}, "
        f"{wall_s:.0f} s wall, time limit {time_limit_s:g} s, strategy search "
        f"{strategy_limit_s:g} s",
        *trace_lines,
        "",
    ]
    if groups:
        text += [*strategy_text(groups), ""]
    text += [f"strategy search FAILED: {line}" for line in failed]
    text += ["placements of each solver (not what runs):", record_table(records), ""]
    if measured:
        text += ["measured rows:", record_table(measured, MEASURED_COLUMNS), ""]
    text += summary_lines(summary)
    text.append(f"total wall time {wall_s:.1f} s")
    output = "\n".join(text) + "\n"
    sys.stdout.write(output)
    all_records = [*records, *measured]
    if args.table:
        write_atomic(args.table, output)
    if args.json:
        write_atomic(args.json, results_json(groups, all_records))
    if args.readme:
        write_atomic(args.readme, readme_section(all_records, info, groups))
    strategies_ok = not failed and realised.summarize_realised(groups).losses == ()
    return 0 if summary.auto_never_slower and strategies_ok else 1


def results_json(groups: Sequence[GroupResult], records: Sequence[Record]) -> str:
    """The JSON file: ``{"groups": [one per (model, devices, topology)], "records": [one per
    solver row and measured row]}``, keys sorted (:func:`load_measured` reads its records)."""
    data = {"groups": [g.to_json() for g in groups], "records": [r.to_json() for r in records]}
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
