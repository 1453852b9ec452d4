"""Every strategy family on two loopback workers, planned and run only through the product.

    python -m benchmarks.strategies [--quick] [--models lstm_nmt,multi_tower,...]
                                    [--rounds 10] [--warmup 2] [--json PATH]
    python -m benchmarks.strategies --readme benchmarks/results/strategies.json

What a user with two ``partition worker`` processes does, and nothing else (issue 33, item 4):

1. **Workers.** Two ``partition worker`` processes on 127.0.0.1, task ``i`` pinned to core ``i``
   (``--cores``, one intra-op thread, the worker's default four inter-op threads), started with
   :func:`partitioner.cli.worker.start_local_workers`.
2. **Calibrate.** ``partition calibrate --cluster cluster.json --out calibrated.json`` (``--quick``
   under ``--quick``) as a subprocess; its wall time is recorded, and the topology file it writes
   is copied whole into the JSON output (``topology``), so every record carries the calibrated
   topology it was predicted with.
3. **Plan.** For each model (a file ``MODEL.py`` with ``build_model()`` written to the work
   directory; see *Models* below) and each family in ``single, data-parallel, placed, pipeline``
   and ``auto``: ``partition MODEL.py --topology calibrated.json --profile-ops --batch-size B
   --optimizer sgd --strategy FAMILY --out plan.json``, pinned to core 0 with ``taskset -c 0``. Why
   pinned: with ``--profile-ops`` the planner times every op of the training step on this process's
   CPU, and the workers run those ops on one core each with one intra-op thread; TensorFlow sizes
   its intra-op pool from the cores a process may use, so the pinned planner times the kernels as a
   worker runs them (the workers are idle while it plans). The prediction is the plan's
   ``predicted.step_time_s`` (for a plan with a strategy, its predicted step with the all-reduce);
   ``auto``'s plan also has every family's figure in its ``strategies`` table
   (``auto_table_step_s``: all from one profile, where the per-family plans each profiled anew).
   ``partition`` is run as ``python -m partitioner`` (the same entry point as the console script)
   so the interpreter running this benchmark runs it.
4. **Measure.** This process (unpinned) connects to the workers once
   (:func:`passes.cluster.runtime.connect`), and for each model, right after its plans are
   made (a model is planned and measured before the next is planned: the machine's speed
   drifts over minutes, and planning all seven first left up to a quarter of an hour between a
   model's profile and its steps; the one-device rows of a run came out 8-13% slower than their
   profiles on five of seven models), builds it with ``build_model()``,
   loads each plan with :func:`partitioner.load_plan`, applies it with
   ``plan.apply(model, cluster=handle)``, compiles the copy with SGD (learning rate 0.01) and MSE,
   and times ``train_on_batch(x, y)`` (wall time of the call, which returns the loss to the
   client) on one fixed batch of random data (numpy, seed 0; see *Models*). The families are
   timed in **interleaved rounds**: one step of each per round, the order rotated each round,
   ``--warmup`` rounds dropped, then the median over ``--rounds`` rounds, so the machine's
   drift falls on all alike.
   ``single``'s plan puts the whole model on one worker: the one-process baseline.

No measured figure is scaled by any reference timing, per row or per run. Per model it prints
each family's predicted and measured step and the error, which family ``auto`` chose, whether
the predicted winner (the fastest of the four per-family plans' predictions) and auto's choice
are the measured winner (the fastest of the four measured), and ``auto``'s measured step over
the best measured. A step that fails (a plan the CLI refuses, an apply or a step that raises)
is a row with its one-line error, not a crash. The ``auto`` row is a second applied copy of the
family it chose, timed in the same rounds: its gap to that family's row shows the run's noise.
The machine's cores may be shared: the numbers are as noisy as the machine was (run it alone for
figures to keep).

Wall time. The default run (seven models, 2 + 10 rounds) takes about 20 minutes on the two-core
machine: an estimate from its parts, measured on 2026-11-26 while others ran tests there.
``--models lstm_nmt,multi_tower --rounds 3 --warmup 1`` took 4.0 min: workers and ``partition
calibrate`` 23 s, planning lstm_nmt's five plans 125 s and multi_tower's 58 s, applying and timing
both about 25 s. One ``--strategy auto`` plan of gpt_tiny took 29 s, of mlp (batch 4096, about
1.8 s a step on one core) 84 s; the three models of this benchmark's own took 5.6 min in all
(planning about 4 of them). Planning, five profiled plans per model, is about three quarters of
the run (mlp's alone 5-7 min), so fewer ``--rounds`` would not bring it under 15 minutes.
``--quick`` takes about 40 s.

Models (``--models``; default all seven below; ``--quick``: ``small_mlp`` only).

* The four zoo models of :data:`ZOO_DEFAULT_MODELS`, at the architectures and batch sizes of
  :data:`ZOO_SPECS` (:data:`benchmarks.cluster_zoo.SPECS` and ``mlp``): ``mlp`` (8 x
  Dense(1024), batch 4096), ``multi_tower``, ``gpt_tiny`` (a GPT-style ``transformer_lm``) and
  ``lstm_nmt``. Their ``MODEL.py`` is two lines, ``from benchmarks.strategies import ZOO_SPECS``
  and ``build_model()`` returning ``ZOO_SPECS[key].build()`` (the planner's subprocess has the
  repository on ``PYTHONPATH``: :func:`child_env`). Their data is
  :func:`benchmarks.cluster_zoo.make_data`'s: one array per model input, floats standard
  normal, integer inputs (token ids, positions) below the sequence length; targets standard
  normal, shaped like the model's output (``lstm_nmt``'s and ``gpt_tiny``'s are per token,
  vocabulary-wide). ``mlp_tiny`` (cluster_zoo's smoke model) may be named too.
* Three of this benchmark's own, each a whole ``MODEL.py`` (:data:`SPECS`): ``conv_net``,
  ``recommender`` (an embedding table), ``wide_mlp``; and ``small_mlp`` for ``--quick``. Their
  data: floats in [0, 1), or ids below the embedding's vocabulary; targets standard normal,
  ``(batch, outputs)``.

Sizes. ``wide_mlp`` is 1024 -> 4 x Dense(2048) at batch 1024: 59 MB of gradients, which the
calibrated all-reduce of that run priced at about 60-80 ms against about 250 ms of one replica's
compute (a lower batch brings the two closer).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import cluster_zoo as cz

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

__all__ = [
    "FAMILIES",
    "SPECS",
    "ZOO_DEFAULT_MODELS",
    "ZOO_SPECS",
    "ModelSpec",
    "PlanOutcome",
    "Row",
    "Verdict",
    "format_table",
    "main",
    "make_rows",
    "readme_row",
    "records",
    "row_of_record",
    "verdict",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
FAMILIES: tuple[str, ...] = ("single", "data-parallel", "placed", "pipeline")
"""The families planned one by one (``--strategy``), in the table's order."""
AUTO = "auto"
PLAN_CORE = 0
"""The core the planning process is pinned to (worker 0's)."""
PLAN_TIMEOUT_S = 900.0
CALIBRATE_TIMEOUT_S = 300.0
LEARNING_RATE = 0.01
SEED = 0


@dataclass(frozen=True)
class ModelSpec:
    """One benchmark model: its source (a ``build_model()`` file), batch and inputs."""

    name: str
    description: str
    batch_size: int
    source: str
    input_shape: tuple[int, ...] | None = None
    """The one input's shape after the batch; ``None``: the model's own inputs, made by
    :func:`benchmarks.cluster_zoo.make_data` (the zoo models)."""
    id_vocabulary: int | None = None
    """Integer ids below this (an embedding's input), else float inputs."""


ZOO_SPECS: Mapping[str, cz.ModelSpec] = {
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
"""The zoo models a generated ``MODEL.py`` builds (:func:`zoo_source`): cluster_zoo's and the
issue's MLP; ``mlp_tiny`` is cluster_zoo's smoke model."""
ZOO_DEFAULT_MODELS = ("mlp", "multi_tower", "gpt_tiny", "lstm_nmt")


def zoo_source(key: str) -> str:
    """The ``MODEL.py`` of :data:`ZOO_SPECS` ``[key]``."""
    return (
        "from benchmarks.strategies import ZOO_SPECS\n\n\n"
        f"def build_model():\n    return ZOO_SPECS[{key!r}].build()\n"
    )


def zoo_spec(key: str) -> ModelSpec:
    """The zoo model ``key`` at its architecture and batch size (:data:`ZOO_SPECS`)."""
    zoo = ZOO_SPECS[key]
    return ModelSpec(key, zoo.label, zoo.batch_size, zoo_source(key))


_CONV = """import keras


def build_model():
    inputs = keras.Input((32, 32, 3), name="image")
    h = inputs
    for i, (filters, stride) in enumerate([(32, 1), (32, 1), (64, 2), (64, 1), (128, 2)]):
        h = keras.layers.Conv2D(
            filters, 3, strides=stride, padding="same", activation="relu", name=f"conv{i}"
        )(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h), name="conv_net")
"""

_RECOMMENDER = """import keras


def build_model():
    ids = keras.Input((16,), dtype="int32", name="ids")
    h = keras.layers.Embedding(200_000, 64, name="table")(ids)
    h = keras.layers.Flatten(name="flat")(h)
    for i, width in enumerate([1024, 512, 256]):
        h = keras.layers.Dense(width, activation="relu", name=f"mlp{i}")(h)
    return keras.Model(ids, keras.layers.Dense(1, name="score")(h), name="recommender")
"""

_WIDE = """import keras


def build_model():
    inputs = keras.Input((1024,), name="x")
    h = inputs
    for i in range(4):
        h = keras.layers.Dense(2048, activation="relu", name=f"wide{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h), name="wide_mlp")
"""

_SMALL = """import keras


def build_model():
    inputs = keras.Input((256,), name="x")
    h = inputs
    for i in range(3):
        h = keras.layers.Dense(512, activation="relu", name=f"dense{i}")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(h), name="small_mlp")
"""

SPECS: dict[str, ModelSpec] = {
    **{key: zoo_spec(key) for key in ZOO_SPECS},
    **{
        spec.name: spec
        for spec in (
            ModelSpec("conv_net", "5 Conv2D + head, 32x32x3", 256, _CONV, (32, 32, 3)),
            ModelSpec(
                "recommender",
                "Embedding(200k x 64) of 16 ids + MLP 1024-512-256",
                1024,
                _RECOMMENDER,
                (16,),
                id_vocabulary=200_000,
            ),
            ModelSpec("wide_mlp", "1024 -> 4 x Dense(2048) -> 10", 1024, _WIDE, (1024,)),
            ModelSpec("small_mlp", "256 -> 3 x Dense(512) -> 10", 256, _SMALL, (256,)),
        )
    },
}
"""Every model ``--models`` may name: :data:`ZOO_SPECS`' (by their keys) and this benchmark's
own."""
DEFAULT_MODELS = (*ZOO_DEFAULT_MODELS, "conv_net", "recommender", "wide_mlp")
QUICK_MODELS = ("small_mlp",)


# -- results as data (no TensorFlow) ---------------------------------------------------------------


@dataclass(frozen=True)
class PlanOutcome:
    """What ``partition ... --strategy FAMILY --out plan.json`` gave."""

    family: str
    path: str | None
    wall_s: float
    error: str | None = None
    predicted_step_s: float | None = None
    chosen_family: str | None = None
    """The plan's ``strategy.family`` in CLI spelling (``data-parallel``)."""
    description: str = ""
    table_step_s: Mapping[str, float] | None = None
    """The plan's ``strategies`` table: family (CLI spelling) -> predicted step."""


@dataclass(frozen=True)
class Row:
    """One family of one model: predicted beside measured."""

    model: str
    strategy: str
    description: str
    predicted_step_s: float | None
    measured_step_s: float | None
    samples_s: tuple[float, ...] = ()
    chosen: bool = False
    """Whether ``auto``'s plan chose this family (the ``auto`` row itself: always)."""
    auto_chose: str | None = None
    """The family ``auto``'s plan chose (CLI spelling; ``hybrid`` is not planned alone)."""
    auto_table_step_s: float | None = None
    plan_wall_s: float | None = None
    error: str | None = None

    @property
    def error_pct(self) -> float | None:
        if self.predicted_step_s is None or not self.measured_step_s:
            return None
        return 100.0 * (self.predicted_step_s - self.measured_step_s) / self.measured_step_s


@dataclass(frozen=True)
class Verdict:
    """Per model: who was predicted to win, who won, and where ``auto`` landed."""

    model: str
    auto_family: str | None
    predicted_winner: str | None
    measured_winner: str | None
    auto_measured_over_best: float | None

    @property
    def predicted_is_measured(self) -> bool | None:
        if self.predicted_winner is None or self.measured_winner is None:
            return None
        return self.predicted_winner == self.measured_winner

    @property
    def auto_is_measured(self) -> bool | None:
        if self.auto_family is None or self.measured_winner is None:
            return None
        return self.auto_family == self.measured_winner


def cli_family(value: str) -> str:
    """A plan's family (``data_parallel``) in the CLI's spelling (``data-parallel``)."""
    return value.replace("_", "-")


def make_rows(
    model: str,
    plans: Mapping[str, PlanOutcome],
    samples: Mapping[str, Sequence[float]],
    errors: Mapping[str, str],
) -> list[Row]:
    """The rows of one model, in :data:`FAMILIES` order then ``auto``."""
    auto = plans.get(AUTO)
    chosen = auto.chosen_family if auto is not None and auto.error is None else None
    table = (auto.table_step_s or {}) if auto is not None else {}
    rows = []
    for family in (*FAMILIES, AUTO):
        plan = plans.get(family)
        if plan is None:
            continue
        timed = tuple(samples.get(family, ()))
        rows.append(
            Row(
                model=model,
                strategy=family,
                description=plan.description,
                predicted_step_s=plan.predicted_step_s,
                measured_step_s=statistics.median(timed) if timed else None,
                samples_s=timed,
                chosen=family == AUTO or family == chosen,
                auto_chose=chosen,
                auto_table_step_s=table.get(family) if family != AUTO else None,
                plan_wall_s=plan.wall_s,
                error=plan.error or errors.get(family),
            )
        )
    return rows


def _fastest(pairs: Sequence[tuple[str, float | None]]) -> str | None:
    known = [(value, name) for name, value in pairs if value is not None]
    return min(known)[1] if known else None


def verdict(rows: Sequence[Row]) -> Verdict:
    """The winners of one model's rows (the four families; ``auto`` is judged against them)."""
    families = [r for r in rows if r.strategy != AUTO]
    auto = next((r for r in rows if r.strategy == AUTO), None)
    measured_winner = _fastest([(r.strategy, r.measured_step_s) for r in families])
    best = min((r.measured_step_s for r in families if r.measured_step_s), default=None)
    ratio = (
        auto.measured_step_s / best
        if auto is not None and auto.measured_step_s is not None and best
        else None
    )
    return Verdict(
        model=rows[0].model if rows else "",
        auto_family=rows[0].auto_chose if rows else None,
        predicted_winner=_fastest([(r.strategy, r.predicted_step_s) for r in families]),
        measured_winner=measured_winner,
        auto_measured_over_best=ratio,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def _yes(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def format_table(rows: Sequence[Row], title: str = "") -> str:
    """One model's table and its verdict lines (plain text)."""
    header = ("family", "plan", "predicted ms", "auto table ms", "measured ms", "error", "auto")
    body = [
        (
            r.strategy,
            (r.description or "-")[:34],
            _ms(r.predicted_step_s),
            _ms(r.auto_table_step_s),
            _ms(r.measured_step_s),
            "-" if r.error_pct is None else f"{r.error_pct:+.1f}%",
            "chosen" if r.chosen and r.strategy != AUTO else "",
        )
        for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *body)]
    lines = [title] if title else []
    for cells in (header, *body):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip())
    lines += [f"  {r.strategy}: FAILED: {r.error}" for r in rows if r.error]
    v = verdict(rows)
    ratio = "-" if v.auto_measured_over_best is None else f"{v.auto_measured_over_best:.2f}x"
    lines.append(
        f"auto chose {v.auto_family or '-'}; predicted winner {v.predicted_winner or '-'}, "
        f"measured winner {v.measured_winner or '-'}: predicted = measured "
        f"{_yes(v.predicted_is_measured)}, auto = measured {_yes(v.auto_is_measured)}; "
        f"auto measured / best measured {ratio}"
    )
    return "\n".join(lines)


ERROR_TARGET_PCT = 15.0
"""A family row's prediction is close when within this many percent of its measurement."""
AUTO_TARGET = 1.05
"""``auto``'s measured step is on target when within this factor of the best measured family."""


def summary(rows: Sequence[Row]) -> str:
    """Across models: winners matched, rows within 15%, auto's worst ratio."""
    models = list(dict.fromkeys(r.model for r in rows))
    verdicts = [verdict([r for r in rows if r.model == m]) for m in models]
    matched = sum(1 for v in verdicts if v.predicted_is_measured)
    auto_matched = sum(1 for v in verdicts if v.auto_is_measured)
    errors = [abs(r.error_pct) for r in rows if r.error_pct is not None and r.strategy != AUTO]
    within = sum(1 for e in errors if e <= ERROR_TARGET_PCT)
    ratios = [v.auto_measured_over_best for v in verdicts if v.auto_measured_over_best]
    worst = f"{max(ratios):.2f}x" if ratios else "-"
    return (
        f"{len(models)} model(s): predicted winner = measured winner on {matched}, auto's choice "
        f"on {auto_matched}; {within} of {len(errors)} family rows predicted within 15%; auto "
        f"measured / best measured at worst {worst}"
    )


def records(rows: Sequence[Row]) -> list[dict[str, Any]]:
    """The JSON records: one per row, the error in percent added."""
    out = []
    for r in rows:
        rec = asdict(r)
        rec["samples_s"] = list(r.samples_s)
        rec["error_pct"] = r.error_pct
        out.append(rec)
    return out


def row_of_record(rec: Mapping[str, Any]) -> Row:
    """A row back from its JSON record (:func:`records`)."""
    return Row(
        model=str(rec["model"]), strategy=str(rec["strategy"]),
        description=str(rec.get("description", "")), predicted_step_s=rec["predicted_step_s"],
        measured_step_s=rec["measured_step_s"], samples_s=tuple(rec.get("samples_s") or ()),
        chosen=bool(rec.get("chosen")), auto_chose=rec.get("auto_chose"),
        auto_table_step_s=rec.get("auto_table_step_s"), plan_wall_s=rec.get("plan_wall_s"),
        error=rec.get("error"),
    )  # fmt: skip


README_ROW_START = "| every strategy family planned and run only through the product"
README_ROW_WHAT = (
    "every strategy family planned and run only through the product on two single-core "
    "loopback `partition worker`s (issue 33): `partition calibrate`, then `partition MODEL.py "
    "--profile-ops --strategy F` for single, data-parallel, placed, pipeline and `auto`, then "
    "`plan.apply(model, cluster=...)` and `train_on_batch`, the families timed in interleaved "
    "rounds, nothing scaled"
)
README_COMMAND = "`python -m benchmarks.strategies --json benchmarks/results/strategies.json`"


def readme_row(doc: Mapping[str, Any]) -> str:
    """The README's "Measured" row of this benchmark, from its JSON (``--json``): the models, on
    how many the predicted winner and ``auto``'s choice were the measured winner, ``auto``'s
    measured step within :data:`AUTO_TARGET` of the best, the family rows predicted within
    :data:`ERROR_TARGET_PCT`, and the worst error."""
    rows = [row_of_record(rec) for rec in doc["records"]]
    models = list(dict.fromkeys(r.model for r in rows))
    verdicts = [verdict([r for r in rows if r.model == m]) for m in models]
    agree = [v.model for v in verdicts if v.predicted_is_measured]
    auto_agree = sum(1 for v in verdicts if v.auto_is_measured)
    ratios = [v for v in verdicts if v.auto_measured_over_best is not None]
    auto_ok = sum(1 for v in ratios if (v.auto_measured_over_best or 0.0) <= AUTO_TARGET)
    errors = [(e, r) for r in rows if (e := r.error_pct) is not None and r.strategy != AUTO]
    within = sum(1 for e, _ in errors if abs(e) <= ERROR_TARGET_PCT)
    failed = [f"{r.model} {r.strategy}" for r in rows if r.error]
    worst = "no family row measured"
    if errors:
        worst_pct, worst_row = max(errors, key=lambda pair: abs(pair[0]))
        worst = f"worst error {worst_pct:+.0f}% ({worst_row.model} {worst_row.strategy})"
    wall, calibrate_s = doc.get("wall_time_s"), doc.get("calibrate_wall_s")
    command = README_COMMAND + (f" ({float(wall) / 60:.1f} min" if wall else "")
    if wall:
        command += f"; `partition calibrate` {float(calibrate_s):.0f} s)" if calibrate_s else ")"
    result = (
        f"{len(models)} models ({', '.join(models)}): predicted winner = measured winner on "
        f"{len(agree)} of {len(verdicts)}{' (' + ', '.join(agree) + ')' if agree else ''}, "
        f"`auto`'s choice on {auto_agree} of {len(verdicts)}; `auto`'s measured step within "
        f"{AUTO_TARGET}x of the best measured family on {auto_ok} of {len(ratios)}; "
        f"{within} of {len(errors)} family rows predicted within {ERROR_TARGET_PCT:.0f}%, "
        f"{worst}" + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    return f"| {README_ROW_WHAT} | {command} | {result} |"


# -- the product's commands (subprocesses) ----------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment of the product's subprocesses: this repository importable, TF quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])]
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    env.pop("TF_CONFIG", None)
    return env


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


def calibrate(cluster_file: Path, out: Path, quick: bool) -> tuple[dict[str, Any], float]:
    """Run ``partition calibrate``; the topology it wrote and its wall time."""
    cmd = [sys.executable, "-m", "partitioner", "calibrate", "--cluster", str(cluster_file),
           "--out", str(out), *(["--quick"] if quick else [])]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(), timeout=CALIBRATE_TIMEOUT_S
    )
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"partition calibrate failed ({done.returncode}): "
                         f"{_last_line(done.stderr)}")  # fmt: skip
    data: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
    return data, wall_s


def plan_command(
    model_file: Path, topology: Path, batch_size: int, family: str, out: Path
) -> list[str]:
    """The user's planning command for one family, pinned to :data:`PLAN_CORE` (module doc)."""
    pin = ["taskset", "-c", str(PLAN_CORE)] if shutil.which("taskset") else []
    return [
        *pin, sys.executable, "-m", "partitioner", str(model_file), "--topology", str(topology),
        "--profile-ops", "--batch-size", str(batch_size), "--optimizer", "sgd",
        "--strategy", family, "--out", str(out),
    ]  # fmt: skip


def read_plan(family: str, path: Path, wall_s: float) -> PlanOutcome:
    """The fields of a written plan file the benchmark reports."""
    data = json.loads(path.read_text(encoding="utf-8"))
    strategy = data.get("strategy") or {}
    table = {
        cli_family(row["family"]): float(row["step_time_s"]) for row in data.get("strategies") or ()
    }
    return PlanOutcome(
        family=family,
        path=str(path),
        wall_s=wall_s,
        predicted_step_s=float(data["predicted"]["step_time_s"]),
        chosen_family=cli_family(strategy["family"]) if strategy else None,
        description=str(strategy.get("description", "")),
        table_step_s=table,
    )


def plan_family(model_file: Path, topology: Path, spec: ModelSpec, family: str) -> PlanOutcome:
    """Run ``partition MODEL.py ... --strategy FAMILY --out plan.json``."""
    out = model_file.with_name(f"{spec.name}.{family}.plan.json")
    cmd = plan_command(model_file, topology, spec.batch_size, family, out)
    started = time.monotonic()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env=child_env(), timeout=PLAN_TIMEOUT_S
    )
    wall_s = time.monotonic() - started
    if done.returncode != 0 or not out.exists():
        why = _last_line(done.stderr or done.stdout)
        return PlanOutcome(family, None, wall_s, error=f"partition exit {done.returncode}: {why}")
    return read_plan(family, out, wall_s)


def plan_model(spec: ModelSpec, work: Path, topology: Path) -> dict[str, PlanOutcome]:
    """Write the model file and plan every family and ``auto``, one after another."""
    model_file = work / f"{spec.name}.py"
    model_file.write_text(spec.source, encoding="utf-8")
    plans = {}
    for family in (*FAMILIES, AUTO):
        plans[family] = outcome = plan_family(model_file, topology, spec, family)
        state = outcome.error or f"predicted {_ms(outcome.predicted_step_s)} ms"
        _say(f"planned {spec.name} --strategy {family} in {outcome.wall_s:.1f} s: {state}")
    return plans


def _say(line: str) -> None:
    sys.stderr.write(f"[strategies] {line}\n")
    sys.stderr.flush()


# -- measuring in one client process ------------------------------------------------------------


def build(spec: ModelSpec, work: Path) -> Any:
    """``build_model()`` of the model file, imported as a user would."""
    loader = importlib.util.spec_from_file_location(f"cf_{spec.name}", work / f"{spec.name}.py")
    if loader is None or loader.loader is None:
        raise RuntimeError(f"cannot import {work / spec.name}.py")
    module = importlib.util.module_from_spec(loader)
    loader.loader.exec_module(module)
    return module.build_model()


def batch(spec: ModelSpec, model: Any) -> tuple[Any, Any]:
    """One fixed batch of random inputs and targets (seed :data:`SEED`; module doc, *Models*)."""
    import numpy as np

    if spec.input_shape is None:
        from benchmarks.cluster_zoo import make_data

        return make_data(model, spec.batch_size, seed=SEED)
    outputs = int(model.output_shape[-1])
    rng = np.random.default_rng(SEED)
    shape = (spec.batch_size, *spec.input_shape)
    x: Any = (
        rng.integers(0, spec.id_vocabulary, shape, dtype=np.int32)
        if spec.id_vocabulary is not None
        else rng.random(shape, dtype=np.float32)
    )
    y = rng.standard_normal((spec.batch_size, outputs)).astype(np.float32)
    return x, y


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def applied_models(
    spec: ModelSpec, plans: Mapping[str, PlanOutcome], handle: Any, work: Path
) -> tuple[dict[str, Any], dict[str, str]]:
    """Each planned family's model applied to the cluster and compiled; failures by family."""
    import keras

    from partitioner import load_plan

    applied: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for family, outcome in plans.items():
        if outcome.path is None:
            continue
        try:
            model = load_plan(outcome.path).apply(build(spec, work), cluster=handle)
            model.compile(optimizer=keras.optimizers.SGD(learning_rate=LEARNING_RATE), loss="mse")
            applied[family] = model
        except Exception as exc:  # reported as the row's error, not a crash
            errors[family] = f"apply: {_one_line(exc)}"
            _say(f"{spec.name} {family}: {errors[family]}")
    return applied, errors


def interleaved(
    models: Mapping[str, Any], x: Any, y: Any, warmup: int, rounds: int
) -> tuple[dict[str, list[float]], dict[str, str]]:
    """``train_on_batch`` wall times, one step of every model per round (order rotated each
    round); the first ``warmup`` rounds dropped. A model whose step raises leaves the rounds."""
    live = list(models)
    samples: dict[str, list[float]] = {k: [] for k in live}
    errors: dict[str, str] = {}
    for r in range(warmup + rounds):
        shift = r % len(live) if live else 0
        for family in live[shift:] + live[:shift]:
            if family in errors:
                continue
            started = time.perf_counter()
            try:
                models[family].train_on_batch(x, y)
            except Exception as exc:  # reported as the row's error
                errors[family] = f"train_on_batch: {_one_line(exc)}"
                continue
            if r >= warmup:
                samples[family].append(time.perf_counter() - started)
    return samples, errors


def measure_model(
    spec: ModelSpec, plans: Mapping[str, PlanOutcome], handle: Any, work: Path, args: Any
) -> list[Row]:
    """Apply every plan of one model on the cluster and time the families interleaved."""
    applied, errors = applied_models(spec, plans, handle, work)
    x, y = batch(spec, build(spec, work))
    _say(f"{spec.name}: timing {', '.join(applied)} ({args.warmup} + {args.rounds} rounds)")
    samples, step_errors = interleaved(applied, x, y, args.warmup, args.rounds)
    errors.update(step_errors)
    del applied
    gc.collect()
    return make_rows(spec.name, plans, {k: v for k, v in samples.items() if v}, errors)


# -- the run -----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.strategies", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small_mlp only, few rounds")
    parser.add_argument("--models", default=None, help=f"comma list of {', '.join(SPECS)}")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (10; quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="rounds dropped (2; quick 1)")
    parser.add_argument("--json", default=None, help="write the records here")
    parser.add_argument("--workdir", default=None, help="keep models, plans, logs here")
    parser.add_argument(
        "--readme", default=None, metavar="JSON",
        help="print the README row of a run's --json file (readme_row) and exit; runs nothing",
    )  # fmt: skip
    args = parser.parse_args(list(argv) if argv is not None else None)
    names = (
        args.models.split(",") if args.models else (QUICK_MODELS if args.quick else DEFAULT_MODELS)
    )
    unknown = [n for n in names if n not in SPECS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(SPECS)}")
    args.specs = [SPECS[n] for n in names]
    args.rounds = args.rounds if args.rounds is not None else (5 if args.quick else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.rounds < 1 or args.warmup < 0:
        parser.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Workers, calibrate, then each model planned and at once measured from one client."""
    from partitioner.cli.worker import start_local_workers

    workers = start_local_workers(2, work / "workers", cores=[0, 1], env=child_env())
    try:
        _say(f"workers {', '.join(workers.addresses)} pinned to cores 0, 1; calibrating")
        topology_file = work / "calibrated.json"
        topology, calibrate_s = calibrate(workers.cluster_file, topology_file, args.quick)
        _say(f"partition calibrate took {calibrate_s:.1f} s")
        from passes.cluster.runtime import connect

        handle = connect(workers.cluster_file)
        rows: list[Row] = []
        for spec in args.specs:
            plans = plan_model(spec, work, topology_file)
            rows += measure_model(spec, plans, handle, work, args)
    finally:
        workers.stop()
    return {"rows": rows, "topology": topology, "calibrate_wall_s": calibrate_s}


def document(
    args: argparse.Namespace, argv: Sequence[str], result: Mapping[str, Any]
) -> dict[str, Any]:
    """The JSON output: the run's settings, the calibrated topology and the records."""
    rows: list[Row] = result["rows"]
    models = list(dict.fromkeys(r.model for r in rows))
    return {
        "benchmark": "strategies",
        "command": ["python", "-m", "benchmarks.strategies", *argv],
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {
            "node": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
        },
        "workers": "2 x partition worker on 127.0.0.1, cores 0 and 1, one intra-op thread",
        "planning": f"partition ... --profile-ops pinned to core {PLAN_CORE} (taskset)",
        "rounds": args.rounds,
        "warmup": args.warmup,
        "models": {
            s.name: {
                "description": s.description,
                "batch_size": s.batch_size,
                "source": (
                    f"benchmarks.strategies.ZOO_SPECS[{s.name!r}]"
                    if s.input_shape is None
                    else "benchmarks.strategies.SPECS"
                ),
            }
            for s in args.specs
        },
        "wall_time_s": result.get("wall_time_s"),
        "calibrate_wall_s": result["calibrate_wall_s"],
        "topology": result["topology"],
        "verdicts": [
            {
                **asdict(v),
                "predicted_is_measured": v.predicted_is_measured,
                "auto_is_measured": v.auto_is_measured,
            }
            for v in (verdict([r for r in rows if r.model == m]) for m in models)
        ],
        "records": records(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Run, print a table per model and the summary, write ``--json``; exit status 0."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.readme:
        doc = json.loads(Path(args.readme).read_text(encoding="utf-8"))
        sys.stdout.write(readme_row(doc) + "\n")
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="strategies_") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    result = {**result, "wall_time_s": time.monotonic() - started}
    rows: list[Row] = result["rows"]
    out = [f"partition calibrate: {result['calibrate_wall_s']:.1f} s"]
    for spec in args.specs:
        own = [r for r in rows if r.model == spec.name]
        out.append(format_table(own, f"\n{spec.name}: {spec.description}, batch {spec.batch_size}"))
    out.append("\n" + summary(rows))
    if args.json:
        doc = document(args, argv, result)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        out.append(f"records written to {args.json}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
