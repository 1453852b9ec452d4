"""Every strategy family measured on two loopback workers, beside the strategy planner's prediction.

    python -m benchmarks.strategies [--quick] [--models mlp,multi_tower,gpt_tiny,lstm_nmt]
                                    [--steps N] [--json benchmarks/results/strategies.json]

Issue 16, item 5. The cluster is :mod:`benchmarks.cluster_zoo`'s: two ``partition worker``
processes on 127.0.0.1, each pinned to its own core with one intra-op thread, this process the
client; the models are its reduced zoo models plus ``mlp`` (8 x Dense(1024) and a Dense(10)
head, 1024 features, batch 4096: the MLP of :mod:`benchmarks.cluster_pipeline` at the issue's
batch). MSE against random targets, SGD; a step's time is the median of ``--steps`` timed
steps after warm-up.

Rows of each model (``strategy`` is the :class:`~partitioner.core.strategy.Family`):

* ``single`` -- **measured**: ``train_on_batch`` in one process pinned to one core, one intra-op
  thread and ``INTER_OP_THREADS`` inter-op threads (:func:`benchmarks.cluster_zoo.calibrate`).
  Every process of this benchmark (the calibration, the workers, the data-parallel pair) has the
  same thread counts (``benchmarks.collective_fit.INTER_OP_THREADS``, the workers' default), so
  that ops are profiled as they run:
  one inter-op thread instead of two changed a one-core ``train_on_batch`` from 567 to 460 ms
  (gpt_tiny) and from 606 to 738 ms (lstm_nmt) on this machine. **Predicted**:
  ``simulate_strategy`` of R = S = 1 on ``costed_at(B)``, plus the optimizer's update of every
  variable (timed on the core).
* ``data_parallel`` -- **measured**: ``tf.distribute.MultiWorkerMirroredStrategy`` with two
  SPMD processes (this module's ``--role dp``), ``TF_CONFIG`` naming two 127.0.0.1 ports, each
  process pinned to one of the two cores (one intra-op thread, the workers' inter-op threads,
  as the cluster workers), a custom training loop (``strategy.run`` of forward, ``GradientTape`` backward and
  ``optimizer.apply_gradients``, whose Keras implementation all-reduces the gradients in one
  batched ring collective over gRPC); each process feeds its own half of the global batch (no
  client: Keras's ``train_on_batch`` fails under this strategy in Keras 3.15, and
  ``MirroredStrategy`` refuses another process's devices, see
  :mod:`passes.rewrite.replicate`). The step is, step by step, the slower process's time
  (the median over the timed steps). **Reference**: in the same processes, in interleaved
  rounds with the data-parallel step, the same step of a local copy of the model under no
  strategy (a replica's step on its half batch, no all-reduce), the slower process's each
  round; every step of both starts after an untimed one-scalar all-reduce, so both
  processes start it together. The row times ``DP_ROUNDS_PER_STEP`` times ``--steps`` rounds.
  **Predicted**: ``simulate_strategy`` of R = 2, S = 1 on ``costed_at(B / 2)`` (a replica's
  step on one core, then the all-reduce of every gradient by the topology's measured
  all-reduce fit, see below), plus the update of every variable (each replica updates its
  whole copy); all three scaled by the reference over the replica and update terms
  (:func:`dp_scale`, for the drift explained under *worker scale* below: the calibration
  process profiled minutes earlier, alone on the machine).
* ``placed`` / ``pipeline`` (GPipe and 1F1B) -- **measured**: the plan of
  ``partition(..., pipeline=True, profile_ops=True)`` on the two workers
  (:func:`passes.cluster.runtime.place_on_cluster`, ``train_on_batch`` from this process), every
  workers' row of the model (and ``auto``'s, below) timed in **interleaved rounds**, one step of
  each per round, beside two references: the whole model placed on each worker alone
  (:func:`measure_cluster_rows`). **Predicted**: ``simulate_strategy`` of
  R = 1, S = 2 with the plan's layer placement and ``M`` (``M = 1`` for ``placed``), on the
  graph costed at ``B`` with each op's time that of the micro-batch ``B / M`` times ``M``
  (:func:`~partitioner.simulation.strategy.microbatch_costed`, as the planner prices a pipeline:
  a micro-batch is not ``1/M`` of a batch; ``linear`` in the JSON uses ``costed_at(B)`` alone,
  the simulator's linear scaling; the simulator adds each micro-batch's gradients after the
  first into the running sums inside its backward, priced by the catalog's memory bandwidth,
  :func:`partitioner.simulation.pipeline.accumulate_time_s`), plus the slower worker's update
  (timed on the core), feeding the batch from the client over the link, and the client's fixed
  cost of a step on the cluster (a no-op step); ``cluster_zoo_predicted_s`` is the cluster_zoo
  prediction (stage-level, measured stage times). **Worker scale**: the calibration process
  profiles minutes before the workers run, and this machine's speed drifts by about 10% over
  minutes (the same one-core step in four processes taking turns: within 4% of each other;
  the halves of one 20-round run: up to 15% apart). So the terms timed on a core (the
  simulated step and the update) of every workers' row are scaled by the references' step
  over the single row's prediction of it (:func:`worker_scale`, the JSON's ``worker_scale``
  and ``worker_reference_s``): the workers' speed in the same rounds as the rows, measured on
  the references alone, never fitted to a row. **Contention**: a third reference runs the
  whole model on both workers at once (a client thread each); its step over the slower
  worker's alone, less one (:func:`contention`; the two cores share the L3 cache and the
  memory bus), slows the simulated time in which both devices compute (``both_busy_s``, from
  the simulated timeline, :func:`both_busy_s`). Unscaled: ``predicted_terms_s`` summed.
* ``auto``'s choice -- ``search_strategies(costed_at, B, StrategyOptions(GPipe and 1F1B))`` on
  a topology of two ``cpu`` devices joined by the fitted loopback link
  (:func:`benchmarks.cluster_zoo.loopback_topology`) with the measured all-reduce fit. When its strategy is one of the rows above
  (the same family and, for two stages, the same layer placement, ``M`` and schedule) that row
  is marked ``chosen``; otherwise it is one more row, realised like its family (a pipeline or a
  split through :func:`passes.cluster.runtime.place_on_cluster`) and predicted like it.

The all-reduce is priced by a **measured collective fit**, not by the loopback link: before any
model, :func:`benchmarks.collective_fit.measure_all_reduce` times
``MultiWorkerMirroredStrategy``'s batched all-reduce (the call Keras's optimizer makes on the
gradients) on two processes pinned to the two cores at 0.1 to 64 MB (every call after a
barrier, the sizes in interleaved rounds, as the data-parallel row is timed), fits ``latency + bytes /
bandwidth`` (least squares of the relative errors) and the loopback topology the predictions and
the search use carries it (``Topology.all_reduce``, which
:mod:`cost_models.estimate.collectives` prefers to the link estimate). The fit sees only the
collective, never a training step; the JSON's ``all_reduce_fit`` holds it and its raw points.

``costed_at(b)`` is the model traced at batch ``b`` (:func:`passes.trace.trace_model`), costed on
the loopback topology (:func:`cost_models.estimate.costs.cost_graph`, SGD), with every op of the
training step timed inside the step on the pinned core at that batch
(:func:`cost_models.measure.op_profile.profile_step_ops`, the median of several steps) merged by
:func:`~cost_models.measure.op_profile.apply_op_profile` with the calibrated executor cost per op
(what ``partition --profile-ops`` does). **Whole-step calibration** (also what ``--profile-ops``
does, :func:`~cost_models.measure.op_profile.apply_step_profile`): the whole traced step
(forward, loss, backward; no update) is timed without the profiler at the same batch (the median,
less an empty call's cost); the time no kernel explains (the gaps between kernels, allocations)
is spread over the profiled ops in proportion (the factor that makes the one-device simulated
step of that batch equal its measured step). Every batch the search prices and the rows use
(``B``, ``B / 2``, each micro-batch) is profiled first, then their whole steps are timed together
in ``WALL_ROUNDS`` interleaved rounds
(:func:`~cost_models.measure.op_profile.interleaved_step_times`), so the ratio of a micro-batch's
step to the batch's does not carry the machine's drift between their profiles. Each batch gets
its own factor, and every row that uses that batch's profile uses it: it is measured on the
traced step alone, never fitted to a row's measurement (the JSON's ``step_calibration`` lists
them). Everything predicted is computed in a calibration process pinned to the first core.

Not modelled: Python and Keras overhead of a step outside the traced ops (Keras metrics, the
``train_on_batch`` call; the data-parallel loop has no metrics), the small all-reduces
``tf.distribute`` adds beyond the gradients', and
any contention between the two processes beyond their cores (memory bandwidth, the loopback
stack's CPU time). Hybrid strategies need four devices: the search may score none here.

Inter-op threads. With two inter-op threads per process, the backward passes of branches
placed on different workers hardly overlapped: multi_tower with towers 0-1 on one worker and
2-3 on the other, against the whole model on one worker, in interleaved rounds: forward alone 82
vs 131 ms, forward and backward 366 vs 385 ms; the first worker's two tower chains held both
threads and its sends to the second waited behind them. With four (``partition worker``'s
default since, :data:`partitioner.cli.worker.MIN_INTER_OP_THREADS`): 274 vs 382 ms. The run on
d55c123 (two threads) predicted multi_tower's placed rows about 20% fast for that reason; the
run on a095af4 (four) measured them 1.55x faster than one process (before: 1.07-1.25x) and
predicted them within 12.4% and 14.5%.

Repeatability. Four runs of 13155cf on one quiet two-core machine (2026-11-26), the first one
committed, each met every target: 21 of 21 predictions within 15% (worst -9.4%, -11.5%, -9.3%,
-8.6%; 83 of the 84 within 10%), the predicted winner the measured one and auto's choice the
best measured row on 4 of 4. The data-parallel step less its reference and update, against
the fit's all-reduce: 0.88x-1.36x; lstm_nmt's data parallel over one process measured 1.53x,
1.26x, 1.24x and 1.38x. Before 13155cf the fit timed each size's calls back to back (no barrier,
size after size) and the data-parallel row took 7 rounds: of three runs of b80f174 one met every
target, two had lstm_nmt's one process measured best (auto's data parallel 1.071x and 1.088x of
it), one had 18 of 21 within 15% (multi_tower's data parallel -35.5%: its steps 192-428 ms, its
reference 88-95 ms), and the data-parallel steps' all-reduce took 1.16x-2.34x the fit's.

The table gives per row the predicted and measured step, the error, ``chosen`` on auto's row;
per model whether the predicted winner (least predicted step) is the measured winner, and auto's
measured step over the best measured one (the issue's targets: <= 1.05, winners equal, every
error within 15%). ``--json`` writes ``{"all_reduce_fit": {...}, "records": [...]}`` with ``model``, ``strategy``,
``predicted_step_s``, ``measured_step_s``, ``chosen`` and the details. The two cores must be
otherwise idle for the numbers to mean anything (``cpu_share`` says whether each process had
its core). ``--quick``: 3 timed steps after 1 warm-up (default 7 after 2; the data-parallel
row times ``DP_ROUNDS_PER_STEP`` times as many). Exit status 0.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from benchmarks import cluster_zoo as cz
from benchmarks.cluster_pipeline import (
    QUIET_CPU_SHARE,
    REPO_ROOT,
    LinkFit,
    cpu_seconds,
    measure_link,
)
from benchmarks.collective_fit import (
    INTER_OP_THREADS,
    CollectiveFit,
    barrier,
    join_loopback_workers,
    measure_all_reduce,
)
from cost_models.measure.op_profile import concurrency
from partitioner.core.ir import AllReduceFit, EventKind, Schedule, TimelineEvent
from partitioner.core.strategy import Strategy

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

__all__ = [
    "DEFAULT_MODELS",
    "SPECS",
    "Prediction",
    "StrategyRow",
    "format_table",
    "main",
    "predict_terms",
    "records",
    "verdict",
]

SPECS: Mapping[str, cz.ModelSpec] = {
    **cz.SPECS,
    "mlp": cz.ModelSpec(
        "mlp",
        cz.ZooBuilder.MLP,
        (("width", 1024), ("depth", 8), ("features", 1024)),
        "mlp 8 x Dense(1024) + Dense(10), 1024 features",
        batch_size=4096,
        num_microbatches=8,
    ),
}
"""cluster_zoo's models and the issue's MLP; ``mlp_tiny`` is the test's smoke model."""
DEFAULT_MODELS = ("mlp", "multi_tower", "gpt_tiny", "lstm_nmt")
SEARCH_SCHEDULES = (Schedule.GPIPE, Schedule.ONE_F_ONE_B)
DP_TIMEOUT_S = 900.0
DP_ROUNDS_PER_STEP = 3
"""The data-parallel row times this many rounds per ``--steps``: its all-reduce over gRPC varies
from round to round far more than a step on a core does (multi_tower's step 162-246 ms in one
run of 21 rounds, its reference 84-98 ms), and the row is a median of them."""
WALL_ROUNDS = 11
"""Rounds of the interleaved whole-step timing of every profiled batch (:class:`ProfiledCosts`)."""
AUTO_TARGET = 1.05
ERROR_TARGET = 0.15


# -- predictions and rows (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """A row's predicted step, term by term (seconds)."""

    replica_s: float
    """``simulate_strategy``: the slowest replica's simulated step (plain or pipelined)."""
    all_reduce_s: float
    """``simulate_strategy``: the ring all-reduce of the gradients across replicas."""
    update_s: float
    client_s: float
    linear_s: float | None = None
    """The same step with ``costed_at(B / R)`` for a pipeline (the simulator's linear scaling)."""
    worker_scale: float = 1.0
    """The workers' speed against the calibration process's (:func:`worker_scale`): every term
    timed on a core is scaled by it on the rows the workers run; 1.0 on the other rows."""
    both_busy_s: float = 0.0
    """Seconds of the simulated replica step in which both devices compute (:func:`both_busy_s`)."""
    contention: float = 0.0
    """How much slower a core computes while the other core computes too (:func:`contention`):
    ``both_busy_s`` takes ``1 + contention`` times as long on the workers' rows."""

    @property
    def step_s(self) -> float:
        on_core = self.replica_s + self.all_reduce_s + self.update_s
        return self.worker_scale * (on_core + self.contention * self.both_busy_s) + self.client_s

    def on_workers(self, scale: float, contention: float = 0.0) -> Prediction:
        """This prediction with the terms timed on a core scaled by ``scale`` and the time both
        devices compute by ``1 + contention`` (the client's terms are the link's and stay);
        ``linear_s`` likewise."""
        linear = self.linear_s
        if linear is not None:
            core = (linear - self.client_s) / self.worker_scale - self.contention * self.both_busy_s
            linear = scale * (core + contention * self.both_busy_s) + self.client_s
        return replace(self, worker_scale=scale, contention=contention, linear_s=linear)


@dataclass(frozen=True)
class StepTerms:
    """What one core and the link measured outside the simulated ops (seconds)."""

    all_update_s: float
    """The update of every variable (a replica of the whole model)."""
    device_update_s: Mapping[int, float]
    """Per device of the strategy, the update of its layers' variables."""
    client_s: float
    """Feeding the batch from the client and the client's fixed cost of a cluster step."""


def predict_terms(
    strategy: Strategy, replica_s: float, all_reduce_s: float, terms: StepTerms
) -> Prediction:
    """The step of ``strategy`` on the two-worker benchmark (see the module docstring).

    Replicas of one stage (single, data parallel) run in their own processes and update a whole
    copy; stages run on the cluster's workers from the client and wait for the slower worker's
    update. (A pipeline's ``M - 1`` gradient additions are in ``replica_s``: the simulator
    puts them in each backward.)
    """
    if strategy.stages == 1:
        return Prediction(replica_s, all_reduce_s, terms.all_update_s, 0.0)
    update = max(terms.device_update_s[d] for d in strategy.devices)
    return Prediction(replica_s, all_reduce_s, update, terms.client_s)


@dataclass(frozen=True)
class StrategyRow:
    """One measured and predicted row of a model."""

    model: str
    key: str
    """``single``, ``data_parallel``, ``placed``, ``gpipe``, ``1f1b`` or ``auto``."""
    strategy: str
    """The family: single | data_parallel | pipeline | hybrid | placed."""
    label: str
    predicted: Prediction
    measured_step_s: float | None = None
    samples_s: tuple[float, ...] = ()
    cpu_share: tuple[float, ...] = ()
    num_microbatches: int = 1
    schedule: str = "none"
    chosen: bool = False
    cluster_zoo_predicted_s: float | None = None
    worker_reference_s: tuple[float, ...] = ()
    """On the workers' rows: each worker's step of the whole model alone (:func:`worker_scale`);
    on the data-parallel row: a replica's step alone in its processes (:func:`dp_scale`)."""

    @property
    def predicted_step_s(self) -> float:
        return self.predicted.step_s

    @property
    def error(self) -> float | None:
        """(predicted - measured) / measured, None when not measured."""
        if not self.measured_step_s:
            return None
        return (self.predicted_step_s - self.measured_step_s) / self.measured_step_s


@dataclass(frozen=True)
class Verdict:
    """Per model: the winners and auto's place."""

    predicted_winner: str
    measured_winner: str | None
    auto_label: str | None
    auto_over_best: float | None
    """auto's measured step over the best measured row's."""
    worst_error: float | None

    @property
    def winners_agree(self) -> bool | None:
        return (
            None if self.measured_winner is None else self.predicted_winner == self.measured_winner
        )


def verdict(rows: Sequence[StrategyRow]) -> Verdict:
    """Who wins by prediction and by measurement among one model's rows."""
    if not rows:
        raise ValueError("no rows")
    predicted = min(rows, key=lambda r: r.predicted_step_s)
    measured = [r for r in rows if r.measured_step_s]
    best = min(measured, key=lambda r: float(r.measured_step_s or 0.0)) if measured else None
    chosen = [r for r in rows if r.chosen]
    if len(chosen) > 1:
        raise ValueError(f"{len(chosen)} rows are marked chosen: {[r.label for r in chosen]}")
    auto = chosen[0] if chosen else None
    ratio = None
    if auto is not None and auto.measured_step_s and best is not None:
        ratio = auto.measured_step_s / float(best.measured_step_s or 1.0)
    errors = [abs(e) for r in rows if (e := r.error) is not None]
    return Verdict(
        predicted_winner=predicted.label,
        measured_winner=None if best is None else best.label,
        auto_label=None if auto is None else auto.label,
        auto_over_best=ratio,
        worst_error=max(errors) if errors else None,
    )


def records(rows: Sequence[StrategyRow]) -> list[dict[str, Any]]:
    """JSON records: the issue's keys first, then the terms and details."""
    out = []
    for r in rows:
        out.append(
            {
                "model": r.model, "strategy": r.strategy,
                "predicted_step_s": r.predicted_step_s, "measured_step_s": r.measured_step_s,
                "chosen": r.chosen, "label": r.label, "key": r.key,
                "num_microbatches": r.num_microbatches, "schedule": r.schedule,
                "error": r.error, "predicted_terms_s": asdict(r.predicted),
                "cluster_zoo_predicted_s": r.cluster_zoo_predicted_s,
                "worker_reference_s": list(r.worker_reference_s),
                "samples_s": list(r.samples_s), "cpu_share": list(r.cpu_share),
            }
        )  # fmt: skip
    return out


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _pct(value: float | None, signed: bool = True) -> str:
    return "" if value is None else f"{value * 100:{'+' if signed else ''}.1f}%"


def _reference_lines(rows: Sequence[StrategyRow]) -> list[str]:
    """What each scaled row was scaled by: the data-parallel row's reference, then the
    workers' (one line for all their rows)."""
    lines = []
    for r in rows:
        if r.key == "data_parallel" and r.worker_reference_s:
            lines.append(
                f"one replica's step alone in the data-parallel processes, in their rounds: "
                f"{_ms(r.worker_reference_s[0])} ms; that row scales its core terms by "
                f"{r.predicted.worker_scale:.3f}"
            )
    scaled = next((r for r in rows if r.worker_reference_s and r.key not in ONE_PROCESS_KEYS), None)
    if scaled is not None:
        alone = " and ".join(_ms(t) for t in scaled.worker_reference_s)
        lines.append(
            f"the whole model alone on each worker, timed in the workers' rounds: {alone} ms; "
            f"the workers' rows scale their core terms by {scaled.predicted.worker_scale:.3f}, "
            f"and the time both compute by a further x{1 + scaled.predicted.contention:.3f} (the "
            "whole model on both workers at once over the slower alone)"
        )
    return lines


def format_table(rows: Sequence[StrategyRow], header: Sequence[str] = ()) -> str:
    """The printed table of one model's rows, and its verdict."""
    v = verdict(rows)
    base = next((r.measured_step_s for r in rows if r.key == "single"), None)
    lines = [*header, ""]
    lines.append(
        f"{'strategy':<14} {'run':<34} {'predicted ms':>12} {'measured ms':>11} {'error':>7} "
        f"{'speed-up':>8} {'CPU share':>10} {'chosen':>6}"
    )
    for r in rows:
        speed = f"{base / r.measured_step_s:.2f}x" if base and r.measured_step_s else ""
        lines.append(
            f"{r.strategy:<14} {r.label:<34} {_ms(r.predicted_step_s):>12} "
            f"{_ms(r.measured_step_s):>11} {_pct(r.error):>7} {speed:>8} "
            f"{'/'.join(f'{c:.2f}' for c in r.cpu_share):>10} {'auto' if r.chosen else '':>6}"
        )
    lines.extend(_reference_lines(rows))
    agree = {True: "yes", False: "NO", None: "not measured"}[v.winners_agree]
    lines.append(
        f"predicted winner: {v.predicted_winner}; measured winner: {v.measured_winner}; "
        f"the same: {agree}"
    )
    if v.auto_over_best is not None:
        ok = "within" if v.auto_over_best <= AUTO_TARGET else "OUTSIDE"
        lines.append(
            f"auto chose {v.auto_label}: measured {v.auto_over_best:.3f}x the best measured row "
            f"({ok} the {AUTO_TARGET}x target)"
        )
    if v.worst_error is not None:
        ok = "within" if v.worst_error <= ERROR_TARGET else "OUTSIDE"
        lines.append(f"worst |error| {_pct(v.worst_error, False)} ({ok} the 15% target)")
    # one-stage rows keep their core busy; a worker of a split or pipeline waits by design
    low = [
        (share, r.label)
        for r in rows
        if r.strategy in ("single", "data_parallel")
        for share in r.cpu_share
        if share < QUIET_CPU_SHARE
    ]
    if low:
        lines.append(
            f"note: {low[0][1]} had a CPU share of {low[0][0]:.2f} (< {QUIET_CPU_SHARE}): the "
            "cores were shared with other processes, or it waited on the link"
        )
    return "\n".join(lines)


# -- the README's row, from the JSON -------------------------------------------------------------

README_ROW_START = "| every strategy family on two single-core loopback workers"
"""How the README's "Measured" row of this benchmark starts (:func:`readme_row` writes it)."""

_FAMILY_WORDS = {"single": "one process", "data_parallel": "data parallel"}


def _error_range(rows: Sequence[StrategyRow]) -> str:
    errors = [e for r in rows if (e := r.error) is not None]
    if not errors:
        return "not measured"
    low, high = min(errors), max(errors)
    return _pct(low) if low == high else f"{_pct(low)} to {_pct(high)}"


def row_of_record(rec: Mapping[str, Any]) -> StrategyRow:
    """A row back from its JSON record (:func:`records`)."""
    return StrategyRow(
        model=rec["model"], key=rec["key"], strategy=rec["strategy"], label=rec["label"],
        predicted=Prediction(**rec["predicted_terms_s"]), measured_step_s=rec["measured_step_s"],
        num_microbatches=rec["num_microbatches"], schedule=rec["schedule"], chosen=rec["chosen"],
    )  # fmt: skip


def readme_row(doc: Mapping[str, Any]) -> str:
    """The README's "Measured" row of this benchmark, from its JSON (``--json``): the winners
    and auto's place per model (:func:`verdict`), and the prediction errors per family."""
    rows = [row_of_record(rec) for rec in doc["records"]]
    by_model: dict[str, list[StrategyRow]] = {}
    for r in rows:
        by_model.setdefault(r.model.split(" ")[0], []).append(r)
    verdicts = {name: verdict(model_rows) for name, model_rows in by_model.items()}
    agree = [name for name, v in verdicts.items() if v.winners_agree]
    autos = {n: v for n, v in verdicts.items() if v.auto_over_best is not None}
    auto_ok = sum(
        v.auto_over_best is not None and v.auto_over_best <= AUTO_TARGET for v in autos.values()
    )
    auto_words = ", ".join(
        f"{n} {v.auto_over_best:.2f}x ({(v.auto_label or '').removeprefix('auto: ')})"
        for n, v in autos.items()
    )
    errors = [e for r in rows if (e := r.error) is not None]
    within = sum(abs(e) <= ERROR_TARGET for e in errors)
    families = "; ".join(
        f"{_FAMILY_WORDS.get(f, f)} {_error_range([r for r in rows if r.strategy == f])}"
        for f in dict.fromkeys(r.strategy for r in rows)
    )
    wall = doc.get("wall_time_s")
    command = "`python -m benchmarks.strategies --json benchmarks/results/strategies.json`" + (
        f" ({wall / 60:.1f} min)" if wall else ""
    )
    result = (
        f"predicted winner = measured winner on {len(agree)} of {len(verdicts)}"
        f"{' (' + ', '.join(agree) + ')' if agree else ''}; `auto`'s measured step within "
        f"{AUTO_TARGET}x of the best measured row on {auto_ok} of {len(autos)}: {auto_words}; "
        f"errors (predicted vs measured): {families}; {within} of {len(errors)} rows within "
        f"{ERROR_TARGET:.0%}"
    )
    return f"| {README_ROW_WHAT} | {command} | {result} |"


README_ROW_WHAT = (
    "every strategy family on two single-core loopback workers (issue 16): one process, data "
    "parallel (`MultiWorkerMirroredStrategy`), placed, GPipe / 1F1B and `auto`'s choice, "
    "predicted (op times profiled inside the step with a whole-step calibration, a pipeline "
    "priced at its micro-batch, the all-reduce from a measured MWMS fit; the workers' rows "
    "timed in interleaved rounds and scaled to the whole model's step on each worker alone in "
    "those rounds, the time both compute slowed as much as both workers at once were, the "
    "data-parallel row scaled to a replica's step alone in its processes) beside measured"
)


# -- the calibration process: plan, profile, search and predict on one pinned core ---------------


@dataclass(frozen=True)
class PlannedRow:
    """A row's strategy (as realisable data) and its prediction, from the calibration process."""

    key: str
    strategy: str
    label: str
    num_microbatches: int
    schedule: str
    layer_devices: tuple[tuple[str, int], ...]
    """Layer name -> topology device (replica 0), for realising it on the cluster."""
    predicted: Prediction


@dataclass(frozen=True)
class StrategyCalibration:
    """Everything the calibration process hands back for one model."""

    zoo_json: str
    """:func:`benchmarks.cluster_zoo.calibration_to_json` of the plan and one-core timings."""
    rows: tuple[PlannedRow, ...]
    auto_key: str
    """The key of the row ``search_strategies`` chose (``auto`` when it is its own row)."""
    auto_words: str
    search_step_s: float
    """The search's own score of its choice (no update, feed or client terms)."""
    family_best: tuple[tuple[str, float, str], ...] = field(default=())
    """Per family the search scored: its best predicted step and the strategy in words."""
    search_summary: str = ""
    """How many candidates the search scored and why it could not score others."""
    step_calibration: tuple[tuple[int, float, float], ...] = ()
    """Per profiled batch: the factor on its op times and its measured whole step (seconds)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StrategyCalibration:
        data = json.loads(text)
        rows = tuple(
            PlannedRow(
                **{
                    **r,
                    "layer_devices": tuple((str(n), int(d)) for n, d in r["layer_devices"]),
                    "predicted": Prediction(**r["predicted"]),
                }
            )
            for r in data["rows"]
        )
        best = tuple((str(f), float(s), str(w)) for f, s, w in data["family_best"])
        steps = tuple((int(b), float(f), float(s)) for b, f, s in data.get("step_calibration", []))
        return cls(**{**data, "rows": rows, "family_best": best, "step_calibration": steps})


class ProfiledCosts:
    """``costed_at(b)``: the model traced at ``b``, costed on ``topology``, its ops profiled at a
    batch on this process's core (memoised per batch), each batch's op times calibrated to that
    batch's measured whole step (:func:`cost_models.measure.op_profile.apply_step_profile`).

    :meth:`prepare` profiles a set of batches first and times their whole steps in interleaved
    rounds (:func:`~cost_models.measure.op_profile.interleaved_step_times`), so the ratios
    between batches (a micro-batch against the batch) do not carry the machine's drift between
    their profiles; a batch not prepared is profiled and timed on its own when first asked for.
    """

    def __init__(self, model: Any, topology: Any, reps: int, wall_rounds: int) -> None:
        from cost_models.estimate.analytic import calibrated_roofline

        self._model, self._topology, self._reps = model, topology, reps
        self._wall_rounds = wall_rounds
        self._dispatch_s = calibrated_roofline("cpu").dispatch_overhead_s
        self._traces: dict[int, Any] = {}
        self._step_inputs: dict[int, list[Any]] = {}
        self._costed: dict[int, Any] = {}
        self.step_factors: dict[int, tuple[float, float]] = {}
        """Per profiled batch: (the factor on its op times, the measured whole step)."""

    def _trace(self, batch: int) -> Any:
        from passes.trace import trace_model

        if batch not in self._traces:
            self._traces[batch] = trace_model(self._model, batch_size=batch)
        return self._traces[batch]

    def _inputs(self, batch: int) -> list[Any]:
        from cost_models.measure.op_profile import step_inputs

        if batch not in self._step_inputs:
            self._step_inputs[batch] = step_inputs(self._trace(batch))
        return self._step_inputs[batch]

    def _op_profile(self, batch: int, wall_steps: int) -> Any:
        from cost_models.measure.op_profile import profile_step_ops

        return profile_step_ops(
            self._trace(batch), self._inputs(batch), steps=self._reps, warmup=2,
            wall_steps=wall_steps,
        )  # fmt: skip

    def _calibrate(self, batch: int, profile: Any) -> None:
        from cost_models.estimate.costs import cost_graph
        from cost_models.measure.op_profile import apply_step_profile

        costed = cost_graph(self._trace(batch).graph, topology=self._topology, optimizer="sgd")
        rows = range(self._topology.num_devices)
        self._costed[batch], factor = apply_step_profile(
            costed, profile, rows, dispatch_s=self._dispatch_s
        )
        self.step_factors[batch] = (factor, profile.step_time_s)

    def prepare(self, batches: Sequence[int]) -> None:
        """Profile each of ``batches`` not yet costed, then time their whole steps together."""
        from cost_models.measure.op_profile import interleaved_step_times

        todo = sorted({b for b in batches if b not in self._costed}, reverse=True)
        profiles = [self._op_profile(b, wall_steps=1) for b in todo]
        pairs = [(self._trace(b), self._inputs(b)) for b in todo]
        walls = interleaved_step_times(pairs, rounds=self._wall_rounds, warmup=1)
        for b, prof, wall in zip(todo, profiles, walls, strict=True):
            self._calibrate(b, replace(prof, step_time_s=wall))

    def at(self, batch: int) -> Any:
        """Costed at ``batch``, its op times profiled at ``batch``."""
        if batch not in self._costed:
            self._calibrate(batch, self._op_profile(batch, wall_steps=self._wall_rounds))
        return self._costed[batch]

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(info.name for info in self._trace(min(self._traces or [1])).graph.layers)


def row_strategies(
    spec: cz.ModelSpec, plan: Any, names: Sequence[str]
) -> list[tuple[str, str, Strategy]]:
    """``(key, label, strategy)`` of the fixed rows: single, data parallel, and the plan's
    placed, GPipe and 1F1B steps when the plan is a two-device pipeline."""
    n, m = len(names), spec.num_microbatches
    rows = [
        ("single", "1 process, 1 core", Strategy(((0,),), (0,) * n)),
        ("data_parallel", "2 workers, MWMS data parallel", Strategy(((0,), (1,)), (0,) * n)),
    ]
    if plan.pipeline is None or plan.num_devices != 2:
        return rows
    stage_of = tuple(int(plan.assignment[name]) for name in names)
    rows += [
        ("placed", "2 workers, placed", Strategy(((0, 1),), stage_of)),
        ("gpipe", f"2 workers, GPipe M={m}", Strategy(((0, 1),), stage_of, m, Schedule.GPIPE)),
        ("1f1b", f"2 workers, 1F1B M={m}", Strategy(((0, 1),), stage_of, m, Schedule.ONE_F_ONE_B)),
    ]
    return rows


def same_realisation(a: Strategy, b: Strategy) -> bool:
    """Whether two strategies run the same way here (one-stage strategies by family)."""
    if a.family is not b.family:
        return False
    if a.stages == 1:
        return a.replicas == b.replicas
    return (a.layer_devices(0), a.num_microbatches, a.schedule) == (
        b.layer_devices(0), b.num_microbatches, b.schedule,
    )  # fmt: skip


def predict_strategy(
    strategy: Strategy, costs: ProfiledCosts, batch_size: int, terms: StepTerms
) -> Prediction:
    """``simulate_strategy`` at the per-replica batch (micro-batch profile for a pipeline)."""
    from partitioner.simulation.strategy import microbatch_costed, simulate_strategy

    per_replica = batch_size // strategy.replicas
    m = strategy.num_microbatches
    sim = simulate_strategy(
        microbatch_costed(costs.at(per_replica), costs.at(per_replica // m), m), strategy
    )
    pred = predict_terms(strategy, max(sim.replica_step_s), sim.all_reduce_s, terms)
    if strategy.stages > 1:
        pred = replace(pred, both_busy_s=both_busy_s(_timeline(sim, costs.at(per_replica))))
    if m == 1:
        return pred
    linear = simulate_strategy(costs.at(per_replica), strategy)
    return replace(pred, linear_s=replace(pred, replica_s=max(linear.replica_step_s)).step_s)


def _timeline(sim: Any, costed: Any) -> tuple[Any, ...]:
    """The simulated replica step's timeline (the pipeline's, or the plain step's re-run with
    its timeline)."""
    from partitioner.simulation.step import simulate_step

    if sim.replica.pipeline is not None:
        return tuple(sim.replica.pipeline.timeline)
    return simulate_step(costed, sim.strategy.layer_devices(0), timeline=True).timeline


def both_busy_s(timeline: Sequence[TimelineEvent]) -> float:
    """Seconds in which two or more devices compute at once in ``timeline`` (pure)."""
    devices = {e.resource for e in timeline if e.resource.startswith("device ")}
    compute = [e for e in timeline if e.kind is not EventKind.TRANSFER]
    steps = concurrency([(e.start_s, e.end_s) for e in compute if e.resource == d] for d in devices)
    return sum(t1 - t0 for (t0, n), (t1, _) in itertools.pairwise(steps) if n >= 2)


def _placement_terms(
    model: Any, layer_devices: Mapping[str, int], all_update_s: float, client_s: float, reps: int
) -> StepTerms:
    """The update of each device's variables under ``layer_devices``."""
    from passes.trace import placement_units

    units = {u.name: u for u in placement_units(model)}
    update: dict[int, float] = {}
    for d in sorted(set(layer_devices.values())):
        chosen = {
            id(w): w
            for name, dev in layer_devices.items()
            if dev == d
            for w in units[name].operation.trainable_weights
        }
        update[d] = cz.variable_times(list(chosen.values()), reps)[0]
    return StepTerms(all_update_s, update, client_s)


def _planned(
    key: str, label: str, strategy: Strategy, names: Sequence[str], prediction: Prediction
) -> PlannedRow:
    return PlannedRow(
        key, strategy.family.value, label, strategy.num_microbatches, strategy.schedule.value,
        tuple(zip(names, strategy.layer_devices(0))), prediction,
    )  # fmt: skip


def _search_summary(search: Any) -> str:
    rejected = "; ".join(f"{what}: {why}" for what, why in search.rejected[:3])
    more = f" (+{len(search.rejected) - 3} more)" if len(search.rejected) > 3 else ""
    text = f"{len(search.candidates)} candidates scored, {len(search.rejected)} rejected"
    notes = "; ".join(search.notes)
    return text + (f" [{rejected}{more}]" if rejected else "") + (f"; {notes}" if notes else "")


def _fixed_rows(
    spec: cz.ModelSpec, plan: Any, names: Sequence[str], costs: ProfiledCosts,
    terms: StepTerms, auto: Strategy,
) -> tuple[list[PlannedRow], str]:  # fmt: skip
    """The predicted fixed rows, and the key of the one that runs as ``auto`` (else ``auto``)."""
    rows, auto_key = [], "auto"
    for key, label, strategy in row_strategies(spec, plan, names):
        prediction = predict_strategy(strategy, costs, spec.batch_size, terms)
        rows.append(_planned(key, label, strategy, names, prediction))
        if auto_key == "auto" and same_realisation(strategy, auto):
            auto_key = key
    return rows, auto_key


def strategy_topology(link: LinkFit, collective: AllReduceFit | None) -> Any:
    """The two loopback workers as the predictions see them: the fitted link and, when given,
    the measured all-reduce."""
    return replace(cz.loopback_topology(link), all_reduce=collective)


def calibrate_strategies(
    spec: cz.ModelSpec, link: LinkFit, *, steps: int, warmup: int, work: Path,
    collective: AllReduceFit | None = None,
) -> StrategyCalibration:  # fmt: skip
    """Plan and time (cluster_zoo), then search and predict every row (module docstring)."""
    from partitioner.plan.model import Plan
    from partitioner.planner.search import StrategyOptions, search_batches, search_strategies

    cal = cz.calibrate(spec, link, steps=steps, warmup=warmup, work=work)
    model = spec.build()
    topology = strategy_topology(link, collective)
    costs = ProfiledCosts(model, topology, reps=max(3, steps // 2), wall_rounds=WALL_ROUNDS)
    options = StrategyOptions(schedules=SEARCH_SCHEDULES)
    plan = Plan.from_json_dict(json.loads(cal.plan_json))
    costs.prepare(
        (*search_batches(topology.num_devices, spec.batch_size, options),
         spec.batch_size // spec.num_microbatches)
    )  # fmt: skip
    search = search_strategies(costs.at, spec.batch_size, options)
    names = costs.layer_names
    client_s = cz.client_terms_s(link, cal.feed_bytes)
    terms = StepTerms(
        cal.all_update_s, dict(enumerate(cal.device_update_s)),
        client_s,
    )  # fmt: skip
    auto = search.best.strategy
    rows, auto_key = _fixed_rows(spec, plan, names, costs, terms, auto)
    if auto_key == "auto":
        placement = dict(zip(names, auto.layer_devices(0)))
        reps = max(10, 2 * steps)
        auto_terms = _placement_terms(model, placement, cal.all_update_s, client_s, reps)
        prediction = predict_strategy(auto, costs, spec.batch_size, auto_terms)
        rows.append(_planned("auto", f"auto: {auto.describe()}", auto, names, prediction))
    family_best = tuple(
        (f.value, c.step_time_s, c.strategy.describe()) for f, c in search.best_per_family().items()
    )
    return StrategyCalibration(
        cz.calibration_to_json(cal), tuple(rows), auto_key, auto.describe(),
        search.best.step_time_s, family_best, _search_summary(search),
        tuple((b, f, t) for b, (f, t) in sorted(costs.step_factors.items())),
    )  # fmt: skip


def calibrate_in_child(
    spec: cz.ModelSpec, link: LinkFit, core: int, *, steps: int, warmup: int,
    collective: AllReduceFit | None = None,
) -> StrategyCalibration:  # fmt: skip
    """:func:`calibrate_strategies` in a fresh process pinned to ``core``: one intra-op thread
    and the workers' inter-op threads (``INTER_OP_THREADS``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        cmd = [
            sys.executable, "-m", "benchmarks.strategies", "--role", "calibrate",
            "--models", spec.key, "--link", json.dumps(asdict(link)), "--out", str(out),
            "--core", str(core), "--steps", str(steps), "--warmup", str(warmup),
        ]  # fmt: skip
        if collective is not None:
            cmd += ["--collective", json.dumps(asdict(collective))]
        done = subprocess.run(
            cmd, env=cz.child_env(), cwd=REPO_ROOT, capture_output=True, text=True
        )
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"calibrating {spec.key} failed ({done.returncode}): {done.stderr[-3000:]}"
            )
        return StrategyCalibration.from_json(out.read_text(encoding="utf-8"))


def _child_calibrate(
    spec: cz.ModelSpec, link: LinkFit, core: int, out: Path, steps: int, warmup: int,
    collective: AllReduceFit | None,
) -> None:  # fmt: skip
    os.sched_setaffinity(0, {core})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    with tempfile.TemporaryDirectory() as tmp:
        result = calibrate_strategies(
            spec, link, steps=steps, warmup=warmup, work=Path(tmp), collective=collective
        )
    out.write_text(result.to_json(), encoding="utf-8")


# -- data parallel: two MultiWorkerMirroredStrategy processes -------------------------------------


def _dp_step(strategy: Any, model: Any, optimizer: Any, global_batch: int) -> Any:
    """One ``tf.function`` step: each replica's forward and backward on its share, the loss
    averaged over the global batch, Keras's optimizer all-reducing the gradients."""
    import tensorflow as tf

    def replica(inputs: list[Any], target: Any) -> Any:
        with tf.GradientTape() as tape:
            pred = model(inputs if len(inputs) > 1 else inputs[0], training=True)
            per_example = tf.reduce_mean(
                tf.square(pred - target), axis=list(range(1, len(pred.shape)))
            )
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        variables = model.trainable_variables
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    @tf.function(jit_compile=False)
    def step(inputs: list[Any], target: Any) -> Any:
        return strategy.run(replica, args=(inputs, target))

    return step


def _dp_worker(
    spec: cz.ModelSpec, index: int, ports: Sequence[int], core: int, args: argparse.Namespace
) -> None:
    """One SPMD process of the data-parallel row: ``steps`` rounds of its half batch's data-parallel
    step and, beside it, the same step of a local copy with no strategy (the reference: a
    replica's step without the all-reduce), each after a barrier so both processes start it
    together (:func:`time_interleaved`)."""
    strategy = join_loopback_workers(index, ports, core)
    import keras
    import tensorflow as tf

    with strategy.scope():
        model = spec.build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    alone, alone_optimizer = spec.build(), keras.optimizers.SGD(0.01)
    alone_optimizer.build(alone.trainable_variables)
    xs, y = cz.make_data(model, spec.batch_size)
    half = spec.batch_size // len(ports)
    rows = slice(index * half, (index + 1) * half)
    inputs, target = [tf.constant(x[rows]) for x in xs], tf.constant(y[rows])
    step = _dp_step(strategy, model, optimizer, spec.batch_size)
    alone_step = _dp_step(tf.distribute.get_strategy(), alone, alone_optimizer, spec.batch_size)

    def run() -> Any:
        return strategy.experimental_local_results(step(inputs, target))[0].numpy()

    def run_alone() -> Any:
        return alone_step(inputs, target).numpy()

    timed = time_interleaved(
        {"data_parallel": run, "reference": run_alone}, args.steps, args.warmup, [os.getpid()],
        before_each=barrier(strategy),
    )  # fmt: skip
    dp, reference = timed["data_parallel"], timed["reference"]
    out = {"samples_s": dp.samples_s, "cpu_share": dp.cpu_share[0]}
    Path(args.out).write_text(json.dumps({**out, "reference_samples_s": reference.samples_s}))
    deadline = time.monotonic() + DP_TIMEOUT_S
    while not Path(args.done).exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the peer may still be in its last collective: do not close on it


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass(frozen=True)
class Measured:
    step_s: float
    samples_s: tuple[float, ...]
    cpu_share: tuple[float, ...]
    reference_predicted_s: float | None = None
    reference_s: tuple[float, ...] = ()
    """The data-parallel row's reference: a replica's step without the all-reduce, the slower
    process's each round, the median (:func:`_dp_worker`); empty on the other rows."""


def _wait_for_outputs(outs: Sequence[Path], procs: Sequence[Any], logs: Sequence[Path]) -> None:
    deadline = time.monotonic() + DP_TIMEOUT_S
    while not all(o.exists() for o in outs):
        failed = [i for i, p in enumerate(procs) if p.poll() is not None and not outs[i].exists()]
        if failed or time.monotonic() > deadline:
            why = "; ".join(logs[i].read_text(errors="replace")[-2000:] for i in failed)
            raise SystemExit(f"data-parallel workers {failed or 'timed out'}: {why}")
        time.sleep(0.1)


def measure_data_parallel(
    spec: cz.ModelSpec, cores: Sequence[int], *, steps: int, warmup: int
) -> Measured:
    """The data-parallel row: two MWMS processes, one per core (see the module docstring)."""
    ports = _free_ports(len(cores))
    with tempfile.TemporaryDirectory() as tmp:
        outs = [Path(tmp) / f"dp{i}.json" for i in range(len(cores))]
        logs = [Path(tmp) / f"dp{i}.log" for i in range(len(cores))]
        done = Path(tmp) / "done"
        procs = []
        for i, core in enumerate(cores):
            cmd = [
                sys.executable, "-m", "benchmarks.strategies", "--role", "dp",
                "--models", spec.key, "--index", str(i), "--ports", ",".join(map(str, ports)),
                "--core", str(core), "--steps", str(steps), "--warmup", str(warmup),
                "--out", str(outs[i]), "--done", str(done),
            ]  # fmt: skip
            with logs[i].open("wb") as log:
                procs.append(
                    subprocess.Popen(cmd, env=cz.child_env(), cwd=REPO_ROOT, stdout=log, stderr=log)
                )
        try:
            _wait_for_outputs(outs, procs, logs)
        finally:
            done.touch()
            for p in procs:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        data = [json.loads(o.read_text()) for o in outs]
    samples = tuple(max(vals) for vals in zip(*(d["samples_s"] for d in data)))
    alone = [max(vals) for vals in zip(*(d["reference_samples_s"] for d in data))]
    return Measured(
        statistics.median(samples), samples, tuple(float(d["cpu_share"]) for d in data),
        reference_s=(statistics.median(alone),),
    )  # fmt: skip


# -- the cluster side ----------------------------------------------------------------------------


ONE_PROCESS_KEYS = ("single", "data_parallel")
"""The rows whose replicas run in processes of their own; every other row runs on the workers."""


def on_workers(rows: Sequence[PlannedRow]) -> list[PlannedRow]:
    """The rows the two workers run (every row not in :data:`ONE_PROCESS_KEYS`)."""
    return [p for p in rows if p.key not in ONE_PROCESS_KEYS]


@dataclass(frozen=True)
class ClusterMeasurement:
    """The workers' rows, and the whole model on each worker alone, timed in the same rounds."""

    rows: Mapping[str, Measured]
    reference_s: tuple[float, ...]
    """Per worker: the median step of the whole model placed on it alone."""
    together_s: float | None = None
    """The median of those steps run on every worker at once (one client thread each): the
    slowest one's time."""


def time_interleaved(
    steps: Mapping[str, Callable[[], Any]], rounds: int, warmup: int, pids: Sequence[int],
    before_each: Callable[[], Any] | None = None,
) -> dict[str, Measured]:  # fmt: skip
    """Each of ``steps`` timed once per round for ``rounds`` rounds (after ``warmup`` rounds),
    so that the machine's drift over the minutes they take falls on all of them alike; each
    one's CPU seconds per wall second of its own steps, per process of ``pids``.
    ``before_each`` runs, untimed, before every step (warm-up too)."""
    settle = before_each or (lambda: None)
    for _ in range(warmup):
        for step in steps.values():
            settle()
            step()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    cpu: dict[str, list[float]] = {k: [0.0] * len(pids) for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            settle()
            before = [cpu_seconds(p) for p in pids]
            t0 = time.perf_counter()
            step()
            samples[key].append(time.perf_counter() - t0)
            cpu[key] = [c + cpu_seconds(p) - b for c, p, b in zip(cpu[key], pids, before)]
    return {
        k: Measured(statistics.median(v), tuple(v), tuple(c / max(sum(v), 1e-9) for c in cpu[k]))
        for k, v in samples.items()
    }


def measure_cluster_rows(
    spec: cz.ModelSpec, rows: Sequence[PlannedRow], handle: Any, tasks: Sequence[str],
    pids: Sequence[int], *, steps: int, warmup: int,
) -> ClusterMeasurement:  # fmt: skip
    """The workers' rows (their placement, pipelined when ``M > 1``) and the whole model on
    each worker alone, in interleaved rounds (:func:`time_interleaved`)."""
    from passes.cluster.runtime import place_on_cluster

    model = spec.build()
    xs, y = cz.make_data(model, spec.batch_size)
    sample = [x[:1] for x in xs]
    names = [name for name, _ in rows[0].layer_devices]
    placements: dict[str, tuple[dict[str, str], dict[str, Any]]] = {
        f"worker {d} alone": (dict.fromkeys(names, task), {}) for d, task in enumerate(tasks)
    }
    for row in rows:
        pipelined: dict[str, Any] = {}
        if row.num_microbatches > 1:
            pipelined = {
                "num_microbatches": row.num_microbatches,
                "schedule": Schedule(row.schedule),
            }
        placements[row.key] = ({name: tasks[d] for name, d in row.layer_devices}, pipelined)
    step_of: dict[str, Callable[[], Any]] = {}
    for key, (layer_devices, pipelined) in placements.items():
        placed = place_on_cluster(model, layer_devices, sample, handle, **pipelined)
        cz.compile_model(placed)

        def step(placed: Any = placed) -> Any:
            return placed.train_on_batch(xs, y)

        step_of[key] = step
    with ThreadPoolExecutor(len(tasks)) as pool:
        alone = [step_of[f"worker {d} alone"] for d in range(len(tasks))]

        def together() -> None:
            for done in [pool.submit(step) for step in alone]:
                done.result()

        step_of["together"] = together
        timed = time_interleaved(step_of, steps, warmup, [*pids, os.getpid()])
    measured = {k: replace(m, cpu_share=m.cpu_share[: len(pids)]) for k, m in timed.items()}
    return ClusterMeasurement(
        {row.key: measured[row.key] for row in rows},
        tuple(measured[f"worker {d} alone"].step_s for d in range(len(tasks))),
        measured["together"].step_s,
    )


def worker_scale(single: Prediction, client_s: float, reference_s: Sequence[float]) -> float:
    """How much slower (> 1) or faster the workers run a step than the calibration process
    predicted: the whole model on one worker alone, less the client's terms, over the single
    row's predicted step (the same step, predicted from the calibration process's profile),
    averaged over the workers. The rows the workers run scale their core terms by it
    (:meth:`Prediction.on_workers`); it is measured on the references alone, never on a row."""
    if not reference_s or single.step_s <= 0:
        return 1.0
    return (statistics.fmean(reference_s) - client_s) / single.step_s


def contention(cluster: ClusterMeasurement) -> float:
    """How much slower a worker computes while the other computes too: the whole model on
    every worker at once over the slowest worker's alone, less one; 0 when not measured or
    faster (the cores share a cache and the memory bus, and contention cannot speed a core up).
    Measured on the references alone, never on a row."""
    if cluster.together_s is None or not cluster.reference_s:
        return 0.0
    return max(0.0, cluster.together_s / max(cluster.reference_s) - 1.0)


def zoo_predicted(spec: cz.ModelSpec, cal: Any, link: LinkFit) -> dict[str, float]:
    """cluster_zoo's stage-level predictions of the plan's placed, GPipe and 1F1B rows."""
    out = {"placed": cz.predict_placed(cal, link)}
    for key, schedule in (("gpipe", Schedule.GPIPE), ("1f1b", Schedule.ONE_F_ONE_B)):
        out[key] = cz.predict_pipelined(
            cal.micro_stages, link, schedule=schedule, num_microbatches=spec.num_microbatches,
            update_s=cal.device_update_s, accumulate_s=cal.device_accumulate_s,
            feed_bytes=cal.feed_bytes,
        )[0]  # fmt: skip
    return out


def dp_scale(dp: Prediction, reference_s: Sequence[float]) -> float:
    """The data-parallel processes' speed against the calibration process's: a replica's step
    alone in those processes (the row's reference, :class:`Measured`) over its prediction (the
    row's replica and update terms, no all-reduce). Like :func:`worker_scale`, measured on the
    reference alone, never on the row."""
    return worker_scale(Prediction(dp.replica_s, 0.0, dp.update_s, 0.0), 0.0, reference_s)


def _scaled(
    p: PlannedRow, m: Measured | None, workers: Sequence[PlannedRow],
    scale: tuple[float, float], reference: tuple[float, ...],
) -> tuple[Prediction, tuple[float, ...]]:  # fmt: skip
    """A row's prediction at its processes' measured speed (``scale``: the workers' scale and
    contention), and the reference that gave it."""
    if p in workers:
        return p.predicted.on_workers(*scale), reference
    if m is not None and m.reference_s:
        return p.predicted.on_workers(dp_scale(p.predicted, m.reference_s)), m.reference_s
    return p.predicted, ()


def assemble_rows(
    spec: cz.ModelSpec, scal: StrategyCalibration, measured: Mapping[str, Measured],
    cluster: ClusterMeasurement | None = None,
) -> list[StrategyRow]:  # fmt: skip
    """The rows of one model: each planned row with its measurement, auto's marked chosen, the
    workers' rows scaled to the workers' measured speed (:func:`worker_scale`, and
    :func:`contention` while both compute) and the data-parallel row to its processes'
    (:func:`dp_scale`)."""
    scale, shared, reference = 1.0, 0.0, tuple[float, ...]()
    workers = on_workers(scal.rows)
    if cluster is not None and workers:
        single = next(p.predicted for p in scal.rows if p.key == "single")
        reference = cluster.reference_s
        scale = worker_scale(single, workers[0].predicted.client_s, reference)
        shared = contention(cluster)
    out = []
    for p in scal.rows:
        m = measured.get(p.key)
        predicted, own_reference = _scaled(p, m, workers, (scale, shared), reference)
        out.append(
            StrategyRow(
                model=spec.label, key=p.key, strategy=p.strategy, label=p.label,
                predicted=predicted,
                measured_step_s=None if m is None else m.step_s,
                samples_s=() if m is None else m.samples_s,
                cpu_share=() if m is None else m.cpu_share,
                num_microbatches=p.num_microbatches, schedule=p.schedule,
                chosen=p.key == scal.auto_key,
                cluster_zoo_predicted_s=None if m is None else m.reference_predicted_s,
                worker_reference_s=own_reference,
            )
        )  # fmt: skip
    return out


def measure_spec(
    spec: cz.ModelSpec, link: LinkFit, cluster: tuple[Any, Sequence[str], Sequence[int]],
    cores: Sequence[int], *, steps: int, warmup: int, say: Any,
    collective: AllReduceFit | None = None,
) -> tuple[StrategyCalibration, list[StrategyRow]]:  # fmt: skip
    """Calibrate, search and predict in the pinned child, then measure every row."""
    handle, tasks, pids = cluster
    say(f"{spec.key}: planning, profiling and searching on core {cores[0]} ...\n")
    t0 = time.perf_counter()
    scal = calibrate_in_child(
        spec, link, cores[0], steps=steps, warmup=warmup, collective=collective
    )
    cal = cz.calibration_from_json(scal.zoo_json)
    say(f"{spec.key}: calibrated in {time.perf_counter() - t0:.0f} s; auto: {scal.auto_words}\n")
    measured = {
        "single": Measured(cal.single_step_s, cal.single_step_samples_s, (cal.single_cpu_share,))
    }
    workers = on_workers(scal.rows)
    timed: ClusterMeasurement | None = None
    if workers:
        say(f"{spec.key}: {', '.join(p.key for p in workers)} on the workers ...\n")
        timed = measure_cluster_rows(spec, workers, handle, tasks, pids, steps=steps, warmup=warmup)
        zoo = zoo_predicted(spec, cal, link) if any(p.key == "1f1b" for p in scal.rows) else {}
        for key, m in timed.rows.items():
            measured[key] = replace(m, reference_predicted_s=zoo.get(key))
    say(f"{spec.key}: data parallel ...\n")
    measured["data_parallel"] = measure_data_parallel(
        spec, cores, steps=DP_ROUNDS_PER_STEP * steps, warmup=warmup
    )
    return scal, assemble_rows(spec, scal, measured, timed)


def header(spec: cz.ModelSpec, scal: StrategyCalibration, steps: int, warmup: int) -> list[str]:
    """The lines above a model's table."""
    families = "; ".join(f"{f} {s * 1e3:.1f} ms ({w})" for f, s, w in scal.family_best)
    return [
        f"model: {spec.label}; batch {spec.batch_size}; MSE, SGD; {steps} timed steps (median) "
        f"after {warmup} warm-up, {DP_ROUNDS_PER_STEP * steps} for data parallel",
        f"auto (search_strategies, 2 cpu devices, fitted loopback): {scal.auto_words}, "
        f"searched step {scal.search_step_s * 1e3:.1f} ms (no update/feed/client terms)",
        f"search's best per family: {families}",
        f"search: {scal.search_summary}",
        "whole-step calibration of profiled op times (batch: factor, measured step): "
        + ", ".join(f"{b}: x{f:.3f}, {t * 1e3:.1f} ms" for b, f, t in scal.step_calibration),
    ]


@dataclass(frozen=True)
class RunResult:
    """Every model's rows, the loopback link and the measured all-reduce fit."""

    models: list[tuple[cz.ModelSpec, StrategyCalibration, list[StrategyRow]]]
    link: LinkFit
    collective: CollectiveFit


def run(specs: Sequence[cz.ModelSpec], *, steps: int, warmup: int, say: Any) -> RunResult:
    """Fit the all-reduce, start the two workers, fit the link, then each model's rows."""
    from partitioner.cli.worker import start_local_workers
    from passes.cluster.runtime import connect, remote_device_strings

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs two cores; this process may use {cores}")
    pair = (cores[0], cores[1])
    say("all-reduce: timing MultiWorkerMirroredStrategy collectives on two processes ...\n")
    collective = measure_all_reduce(
        pair, reps=max(15, 2 * steps), warmup=warmup, env=cz.child_env()
    )
    say(f"all-reduce: {fit_words(collective)}\n")
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        workers = start_local_workers(
            2,
            Path(tmp),
            threads=1,
            inter_op_threads=INTER_OP_THREADS,
            cores=list(pair),
            env=cz.child_env(),
        )
        with workers:
            handle = connect(workers.cluster_file, timeout_s=60)
            tasks = remote_device_strings(handle, [0, 1])
            link = measure_link(tasks, reps=max(20, 2 * steps))
            cluster = (handle, tasks, [p.pid for p in workers.processes])
            for spec in specs:
                scal, rows = measure_spec(
                    spec, link, cluster, pair, steps=steps, warmup=warmup, say=say,
                    collective=collective.to_ir(),
                )  # fmt: skip
                out.append((spec, scal, rows))
    return RunResult(out, link, collective)


def fit_words(fit: CollectiveFit) -> str:
    """The fit in one line: latency, bandwidth and each point against it."""
    points = ", ".join(
        f"{b / 1e6:g} MB {t * 1e3:.1f} ms ({_pct((fit.predict_s(b) - t) / t)})"
        for b, t in fit.points
    )
    return (
        f"measured MWMS all-reduce fit: latency {fit.latency_s * 1e3:.2f} ms, "
        f"{fit.bandwidth_bytes_per_s / 1e6:.0f} MB/s [{points}]"
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.strategies")
    parser.add_argument("--quick", action="store_true", help="few steps")
    parser.add_argument(
        "--models", default=None,
        help=f"comma-separated, of {', '.join(SPECS)} (default {','.join(DEFAULT_MODELS)})",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default=None, help="write the records here")
    hidden = argparse.SUPPRESS
    parser.add_argument("--role", default="main", choices=["main", "calibrate", "dp"], help=hidden)
    for name in ("--link", "--collective", "--out", "--done", "--ports"):
        parser.add_argument(name, default=None, help=hidden)
    parser.add_argument("--core", type=int, default=0, help=hidden)
    parser.add_argument("--index", type=int, default=0, help=hidden)
    return parser


def _link_from_json(text: str) -> LinkFit:
    data = json.loads(text)
    return LinkFit(
        float(data["latency_s"]), float(data["bandwidth_bytes_per_s"]),
        float(data["dispatch_s"]), tuple((int(s), float(t)) for s, t in data["samples"]),
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    keys = tuple(args.models.split(",")) if args.models else DEFAULT_MODELS
    unknown = [k for k in keys if k not in SPECS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(SPECS)}")
    args.steps = args.steps or (3 if args.quick else 7)
    args.warmup = args.warmup or (1 if args.quick else 2)
    if args.role == "calibrate":
        link = _link_from_json(args.link)
        fit = AllReduceFit(**json.loads(args.collective)) if args.collective else None
        _child_calibrate(
            SPECS[keys[0]], link, args.core, Path(args.out), args.steps, args.warmup, fit
        )
        return 0
    if args.role == "dp":
        ports = [int(p) for p in args.ports.split(",")]
        _dp_worker(SPECS[keys[0]], args.index, ports, args.core, args)
        return 0
    t0 = time.perf_counter()
    result = run(
        [SPECS[k] for k in keys], steps=args.steps, warmup=args.warmup, say=sys.stderr.write
    )
    wall_time_s = time.perf_counter() - t0
    text = "\n\n".join(
        format_table(rows, header(spec, scal, args.steps, args.warmup))
        for spec, scal, rows in result.models
    )
    sys.stdout.write(fit_words(result.collective) + "\n\n" + text + "\n")
    if args.json:
        from partitioner.core.files import write_atomic

        out = [rec for _, _, rows in result.models for rec in records(rows)]
        doc = {
            "all_reduce_fit": result.collective.to_json_dict(),
            "step_calibration": {
                spec.key: [list(x) for x in scal.step_calibration]
                for spec, scal, _ in result.models
            },
            "records": out,
            "wall_time_s": wall_time_s,
        }
        write_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the client's remote context has no clean teardown in TF 2
