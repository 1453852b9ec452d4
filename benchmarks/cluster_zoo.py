"""Measured two-worker runs of zoo models, planned by the product, beside its predictions.

    python -m benchmarks.cluster_zoo [--quick] [--models lstm_nmt,multi_tower] [--steps 10]
                                     [--json benchmarks/results/cluster_zoo.json]

:mod:`benchmarks.cluster_pipeline` measures a hand-built chain of Dense layers split in two by
hand. This measures zoo models (:mod:`benchmarks.zoo`, built with the zoo's own builders at
reduced sizes that train in well under a second per step on one core; each row's ``model``
says the size) whose graphs are not chains -- an LSTM encoder-decoder with attention, a
multi-tower MLP, a small GPT-shaped decoder -- on the same kind of cluster: two
``partition worker`` processes on 127.0.0.1, each pinned to its own core with one intra-op
thread, this process the (unpinned) client.

For each model:

1. **Plan.** In a calibration process pinned to core 0 with one intra-op and one inter-op
   thread, :func:`partitioner.api.partition` plans it for a topology file of two ``cpu`` devices
   joined by the loopback link measured below (``gpus=None, device_type="cpu",
   optimizer="sgd", pipeline=True, schedule=1f1b, num_microbatches=M, profile_ops=True``: every
   op of the training step timed inside the step on that one core), with the model's solver (``auto``,
   or a fixed solver where noted). The stage assignment of every row comes from that plan.
2. **Measure** (median wall time of one ``train_on_batch`` step after warm-up; MSE against
   random targets, SGD): the plain model in the calibration process (one core, one thread); the
   plan applied to the two workers without micro-batches (``replace(plan, pipeline=None)
   .apply(model, devices=tasks, cluster=handle)``); and pipelined with GPipe and with 1F1B and
   ``M`` micro-batches (the plan's own pipeline, its schedule replaced for GPipe).
3. **Predict** with the product's machinery and one-core measurements: every op of the traced
   training step timed inside the step on the pinned core
   (:func:`cost_models.measure.op_profile.profile_step_ops`, the least of several steps; glue ops such
   as the loss included) merged with :func:`cost_models.measure.op_profile.apply_op_profile` into the
   graph costed for the measured topology, plus the calibrated executor cost per op (what
   ``partition --profile-ops`` does);

   * ``1 process, 1 core``: :func:`partitioner.simulation.step.simulate_step` with every layer on one
     device, plus the optimizer's update of all variables (timed on the core);
   * ``placed``: :func:`~partitioner.simulation.step.simulate_step` of the plan's placement (op-level:
     independent branches on the two devices overlap), plus the slower device's update, the
     batch fed from the client over the link and the client's fixed cost of one step on the
     cluster (a no-op step function, :func:`benchmarks.cluster_pipeline.measure_link`);
   * ``GPipe`` / ``1F1B``: :func:`partitioner.simulation.pipeline.simulate_stages` on the plan's stages
     (:func:`~partitioner.simulation.pipeline.pipeline_stages`) with op times profiled at the
     micro-batch size (times ``M``: the simulator divides by ``M``) and each stage's backward
     plus ``M - 1`` additions of its gradients into the running sums (timed), plus the same
     update, feed and client terms. ``linear`` in the table is the same simulation from the
     whole-batch profile (the simulator's linear-scaling assumption, what the plan itself uses);
     ``plan`` is the plan's own ``step_time_s`` (linear scaling, no update, feed or client cost).

The link is fitted from tensor moves between the two workers (latency + bytes / bandwidth,
:func:`benchmarks.cluster_pipeline.measure_link`). Token-id inputs are random ids below the
sequence length (every lookup in range; lookups cost the same for any id).

Records (``--json``) have the shape of ``benchmarks/results/cluster_pipeline.json`` and merge into
the zoo results with ``python -m benchmarks.run --measured FILE``. The machine's two cores are
shared: run it when nothing else runs (``flock`` on a shared lock file where others time
things); the ``CPU share`` columns say whether each worker had its core. Exit status 0.

Threads. The calibration process keeps **one** inter-op thread: this module sums the
profiler's kernel times as they are (no whole-step calibration, unlike
``partition --profile-ops``), and with more threads on one core kernels overlap in time, so
their durations add up past the step. Calibrated with the workers' four instead (b5fcda4,
reverted), its one-process and placed rows came out 19-170% above their measurements
(multi_tower's one-process step: 953 ms predicted, 353 measured). That was before kernels run
side by side counted their share of the CPU
(:func:`cost_models.measure.op_profile.share_concurrent`, 9462239); four threads here have not
been tried since. The workers run
:data:`partitioner.cli.worker.MIN_INTER_OP_THREADS` (four). The committed
``benchmarks/results/cluster_zoo.json`` is the last of three runs on the two-core AMD EPYC
machine (2026-11-26, code of 7a45ab1; decided before it ran that it would be committed), the
first committed with four inter-op threads on the workers; the other two were for the record,
the second with ``profile_step_ops(share_cores=None)`` patched in (kernels at their wall times,
not their share of the CPU) and only transformer_lm and lstm_nmt. The rows move between runs,
as they are neither interleaved nor scaled: transformer_lm's 1F1B row measured 234.6, 228.7 and
292.6 ms, its one-process row 343.3, 288.9 and 288.7 ms. The one-process predictions of
lstm_nmt and transformer_lm were off by -11.8% and -18.1% (first run), -2.5% and -4.8% (wall
times), +0.3% and -7.8% (committed).
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks.cluster_pipeline import (
    QUIET_CPU_SHARE,
    REPO_ROOT,
    LinkFit,
    measure_link,
    time_steps,
    time_steps_with_cpu,
)
from partitioner.core.ir import Device, Link, Phase, Schedule, Topology
from partitioner.simulation.pipeline import Stage, StageTransfer, simulate_stages

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

__all__ = [
    "SPECS",
    "ModelSpec",
    "Row",
    "ZooBuilder",
    "ZooCalibration",
    "loopback_topology",
    "main",
    "predict_pipelined",
    "predict_placed",
    "predict_single",
    "records",
    "stage_from_dict",
    "stage_to_dict",
]

DEFAULT_MODELS = ("lstm_nmt", "multi_tower")
PROFILE_DEVICE = "/device:CPU:0"


class ZooBuilder(enum.Enum):
    """The builder of :mod:`benchmarks.zoo` a spec calls."""

    LSTM_NMT = "lstm_nmt"
    MULTI_TOWER = "multi_tower"
    TRANSFORMER_LM = "transformer_lm"
    MLP = "mlp"


@dataclass(frozen=True)
class ModelSpec:
    """A zoo model at a size one core trains in well under a second per step."""

    key: str
    builder: ZooBuilder
    kwargs: tuple[tuple[str, Any], ...]
    label: str
    """The ``model`` of the records: the zoo name and the reduced size."""
    batch_size: int
    num_microbatches: int
    solver: str = "auto"

    def __post_init__(self) -> None:
        if self.num_microbatches < 1 or self.batch_size % self.num_microbatches:
            raise ValueError(
                f"{self.key}: batch {self.batch_size} is not divisible by "
                f"{self.num_microbatches} micro-batches"
            )

    @property
    def microbatch_size(self) -> int:
        return self.batch_size // self.num_microbatches

    def build(self) -> Any:
        import keras

        from benchmarks import zoo

        keras.utils.set_random_seed(0)
        return getattr(zoo, self.builder.value)(**dict(self.kwargs))


SPECS: Mapping[str, ModelSpec] = {
    s.key: s
    for s in (
        ModelSpec(
            "lstm_nmt",
            ZooBuilder.LSTM_NMT,
            (("seq", 20), ("vocab", 2000), ("units", 256), ("depth", 2)),
            "lstm_nmt 2+2 x LSTM(256), 20 tokens, vocab 2000",
            batch_size=64,
            num_microbatches=4,
        ),
        ModelSpec(
            "multi_tower",
            ZooBuilder.MULTI_TOWER,
            (("towers", 4), ("depth", 2), ("width", 1024), ("features", 512)),
            "multi_tower 4 towers x 2 Dense(1024), 512 features",
            batch_size=256,
            num_microbatches=4,
        ),
        ModelSpec(
            "gpt_tiny",
            ZooBuilder.TRANSFORMER_LM,
            (
                ("name", "gpt_tiny"),
                ("blocks", 4),
                ("d_model", 256),
                ("heads", 4),
                ("ffn", 1024),
                ("seq", 64),
                ("vocab", 2000),
                ("causal", True),
                ("pre_norm", True),
            ),
            "transformer_lm GPT-style 4 blocks x 256, 4 heads, context 64, vocab 2000",
            batch_size=16,
            num_microbatches=4,
        ),
        ModelSpec(
            "mlp_tiny",
            ZooBuilder.MLP,
            (("width", 64), ("depth", 2), ("features", 32)),
            "mlp 2 x Dense(64), 32 features",
            batch_size=32,
            num_microbatches=2,
        ),
    )
}
"""The models this benchmark knows (``--models``); ``mlp_tiny`` is the test's smoke model."""


# -- what one core measures ------------------------------------------------------------------


@dataclass(frozen=True)
class ZooCalibration:
    """The plan and everything one pinned core measured for one model (seconds, bytes)."""

    plan_json: str
    plan_solver: str
    plan_step_time_s: float
    """The plan's own pipelined step (whole-batch profile, linear scaling, no update)."""
    single_step_s: float
    single_step_samples_s: tuple[float, ...]
    single_cpu_share: float
    single_compute_s: float
    """:func:`partitioner.simulation.step.simulate_step` with every layer on one device."""
    placed_compute_s: float
    """:func:`partitioner.simulation.step.simulate_step` of the plan's placement (whole batch)."""
    full_stages: tuple[Stage, ...]
    """The plan's stages costed with the whole-batch profile."""
    micro_stages: tuple[Stage, ...]
    """The plan's stages costed with the micro-batch profile times ``M``."""
    device_update_s: tuple[float, ...]
    """Per plan device, the optimizer's update of its layers' variables."""
    device_accumulate_s: tuple[float, ...]
    """Per plan device, one addition of a micro-batch's gradients into the running sums."""
    all_update_s: float
    feed_bytes: int
    """Inputs and targets of one batch, sent from the client each step."""
    profiled_layers: int
    total_layers: int


def stage_to_dict(stage: Stage) -> dict[str, Any]:
    """A stage as JSON data (enums by value)."""
    out = asdict(stage)
    out["layers"] = list(stage.layers)
    out["sends"] = [
        {
            "src_stage": t.src_stage,
            "dst_stage": t.dst_stage,
            "phase": t.phase.value,
            "batch_bytes": t.batch_bytes,
            "consumers": [p.value for p in t.consumers],
        }
        for t in stage.sends
    ]
    return out


def stage_from_dict(data: Mapping[str, Any]) -> Stage:
    """The inverse of :func:`stage_to_dict`."""
    return Stage(
        index=int(data["index"]),
        device=int(data["device"]),
        layers=tuple(str(x) for x in data["layers"]),
        forward_time_s=float(data["forward_time_s"]),
        backward_time_s=float(data["backward_time_s"]),
        static_memory_bytes=int(data["static_memory_bytes"]),
        activation_bytes=int(data["activation_bytes"]),
        sends=tuple(
            StageTransfer(
                src_stage=int(t["src_stage"]),
                dst_stage=int(t["dst_stage"]),
                phase=Phase(t["phase"]),
                batch_bytes=int(t["batch_bytes"]),
                consumers=tuple(Phase(p) for p in t["consumers"]),
            )
            for t in data["sends"]
        ),
    )


def calibration_to_json(cal: ZooCalibration) -> str:
    data = asdict(cal)
    data["full_stages"] = [stage_to_dict(s) for s in cal.full_stages]
    data["micro_stages"] = [stage_to_dict(s) for s in cal.micro_stages]
    return json.dumps(data)


def calibration_from_json(text: str) -> ZooCalibration:
    data = json.loads(text)
    data["full_stages"] = tuple(stage_from_dict(s) for s in data["full_stages"])
    data["micro_stages"] = tuple(stage_from_dict(s) for s in data["micro_stages"])
    for key in ("single_step_samples_s", "device_update_s", "device_accumulate_s"):
        data[key] = tuple(float(v) for v in data[key])
    return ZooCalibration(**data)


# -- the pure predictions -----------------------------------------------------------------------


def loopback_topology(link: LinkFit) -> Topology:
    """Two CPU devices (the two workers) joined by the measured loopback link."""
    loopback = Link("loopback (measured)", link.latency_s, link.bandwidth_bytes_per_s)
    return Topology(
        devices=(Device(0, "cpu", 1 << 34, 0, "task 0"), Device(1, "cpu", 1 << 34, 0, "task 1")),
        link=loopback,
    )


def client_terms_s(link: LinkFit, feed_bytes: int) -> float:
    """Feeding the batch from the client, and the client's fixed cost of a cluster step."""
    return loopback_topology(link).link.transfer_time_s(feed_bytes) + link.dispatch_s


def predict_single(cal: ZooCalibration) -> float:
    """The one-core step: every layer's profiled time in one simulated device, plus the update."""
    return cal.single_compute_s + cal.all_update_s


def predict_placed(cal: ZooCalibration, link: LinkFit) -> float:
    """The placed step on two workers without micro-batches (see the module docstring)."""
    return cal.placed_compute_s + max(cal.device_update_s) + client_terms_s(link, cal.feed_bytes)


def _with_accumulation(
    stages: Sequence[Stage], accumulate_s: Sequence[float], num_microbatches: int
) -> tuple[Stage, ...]:
    """Each stage's backward plus its ``M - 1`` gradient additions (the pipelined ``B`` tasks)."""
    m = num_microbatches
    return tuple(
        replace(st, backward_time_s=st.backward_time_s + (m - 1) * accumulate_s[st.device])
        for st in stages
    )


def predict_pipelined(
    stages: Sequence[Stage],
    link: LinkFit,
    *,
    schedule: Schedule,
    num_microbatches: int,
    update_s: Sequence[float],
    accumulate_s: Sequence[float],
    feed_bytes: int,
) -> tuple[float, tuple[float, ...]]:
    """The pipelined step on the two workers, and each device's busy seconds in it.

    ``stages`` carry whole-step times (``M`` micro-batches' worth; the simulator gives each task
    ``1/M`` of them); ``update_s``/``accumulate_s`` are per device. The step is the simulated
    pipeline plus the slower device's update plus the client's terms; busy is each device's
    simulated compute plus its update.
    """
    if len(update_s) != 2 or len(accumulate_s) != 2:
        raise ValueError(f"need two devices' update and accumulate times, got {update_s}")
    topology = loopback_topology(link)
    sim = simulate_stages(
        _with_accumulation(stages, accumulate_s, num_microbatches),
        topology,
        schedule=schedule,
        num_microbatches=num_microbatches,
    )
    step = sim.step_time_s + max(update_s) + client_terms_s(link, feed_bytes)
    busy = tuple(sim.device_busy_s[d] + update_s[d] for d in range(2))
    return step, busy


# -- measured rows and records ----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    name: str
    schedule: Schedule
    num_microbatches: int
    measured_s: float
    samples_s: tuple[float, ...]
    predicted_s: float
    linear_predicted_s: float | None
    """The pipelined prediction from the whole-batch profile (linear scaling); None unpipelined."""
    worker_cpu_share: tuple[float, ...]
    expected_cpu_share: tuple[float, ...]
    client_cpu_share: float


@dataclass(frozen=True)
class ModelResult:
    spec: ModelSpec
    calibration: ZooCalibration
    rows: tuple[Row, ...]


def _error(predicted: float | None, measured: float) -> float | None:
    return None if predicted is None or measured <= 0 else (predicted - measured) / measured


def records(result: ModelResult) -> list[dict[str, Any]]:
    """The JSON records of one model (the shape of ``cluster_pipeline.json``)."""
    spec, cal = result.spec, result.calibration
    out: list[dict[str, Any]] = [
        {
            "model": spec.label, "devices": 1, "solver": "single", "topology": "localhost",
            "device_type": "cpu", "batch_size": spec.batch_size,
            "measured_time_s": cal.single_step_s, "predicted_time_s": predict_single(cal),
            "note": "1 process, 1 core",
        }
    ]  # fmt: skip
    for row in result.rows:
        out.append(
            {
                "model": spec.label, "devices": 2, "solver": cal.plan_solver,
                "topology": "localhost", "device_type": "cpu", "batch_size": spec.batch_size,
                "num_microbatches": row.num_microbatches, "measured_time_s": row.measured_s,
                "predicted_time_s": row.predicted_s, "note": row.name,
            }
        )  # fmt: skip
    return out


README_ROW_START = "| two-process runs of three zoo models"
README_ROW_WHAT = (
    "two-process runs of three zoo models at reduced sizes (lstm_nmt 2+2 x LSTM(256); "
    "multi_tower 4 x 2 Dense(1024); a GPT-style transformer_lm 4 x 256), planned by "
    "`partition --profile-ops` on one core (every op timed inside the step, at the batch and the "
    "micro-batch size), predicted stage by stage from the profile as measured (no whole-step "
    "calibration); the rows are timed one after another, neither interleaved nor scaled to the "
    "machine's drift (`benchmarks.strategies`, the next row, interleaves its rows)"
)
README_COMMAND = (
    "`python -m benchmarks.cluster_zoo --models lstm_nmt,multi_tower,gpt_tiny "
    "--json benchmarks/results/cluster_zoo.json`"
)


def readme_row(doc: Mapping[str, Any]) -> str:
    """The README's "Measured" row of this benchmark, from its JSON: per model, each two-worker
    row's measured speed-up over one process on one core and its prediction's error."""
    by_model: dict[str, list[Mapping[str, Any]]] = {}
    for rec in doc["records"]:
        by_model.setdefault(str(rec["model"]).split(" ")[0], []).append(rec)
    parts, single_errors = [], []
    for name, recs in by_model.items():
        single = next(r for r in recs if r["devices"] == 1)
        base = float(single["measured_time_s"])
        single_errors.append(abs(float(single["predicted_time_s"]) / base - 1))
        rows = ", ".join(
            f"{str(r['note']).removeprefix('2 workers, ')} {base / float(r['measured_time_s']):.2f}x"
            f" ({float(r['predicted_time_s']) / float(r['measured_time_s']) - 1:+.0%})"
            for r in recs
            if r["devices"] == 2
        )
        parts.append(f"{name} {rows}")
    result = (
        "two workers vs one process on one core, measured speed-up (prediction's error): "
        + "; ".join(parts)
        + f"; one process predicted within {max(single_errors):.0%}"
    )
    return f"| {README_ROW_WHAT} | {README_COMMAND} | {result} |"


def _fmt_ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1e3:.1f}"


def _fmt_err(predicted: float | None, measured: float) -> str:
    err = _error(predicted, measured)
    return "" if err is None else f"{err * 100:+.1f}%"


def table(result: ModelResult, link: LinkFit, steps: int, warmup: int) -> str:
    """The printed table of one model."""
    spec, cal = result.spec, result.calibration
    base = cal.single_step_s
    stage_text = "; ".join(
        f"stage {s.index} on worker {s.device}: {len(s.layers)} layers "
        f"({', '.join(s.layers[:3])}{', ...' if len(s.layers) > 3 else ''}), "
        f"fwd/bwd {s.forward_time_s * 1e3:.1f}/{s.backward_time_s * 1e3:.1f} ms per batch"
        for s in cal.full_stages
    )
    lines = [
        f"model: {spec.label}; batch {spec.batch_size}, {spec.num_microbatches} micro-batches; "
        f"MSE, SGD; {steps} timed steps (median) after {warmup} warm-up",
        f"plan: partition(..., solver={spec.solver!r}) -> {cal.plan_solver}; "
        f"{cal.profiled_layers} of {cal.total_layers} layers profiled on one core; {stage_text}",
        f"plan's own pipelined step (1F1B, linear scaling, no update/feed/client): "
        f"{cal.plan_step_time_s * 1e3:.1f} ms; update {max(cal.device_update_s) * 1e3:.2f} ms "
        f"(slower device), gradient accumulation "
        f"{max(cal.device_accumulate_s) * 1e3:.2f} ms per micro-batch; feed "
        f"{cal.feed_bytes / 1e6:.2f} MB",
        f"loopback link (fitted): latency {link.latency_s * 1e6:.0f} us, bandwidth "
        f"{link.bandwidth_bytes_per_s / 1e9:.2f} GB/s; no-op cluster step "
        f"{link.dispatch_s * 1e3:.2f} ms",
        "",
        f"{'run':<24} {'step ms':>8} {'speed-up':>9} {'predicted':>10} {'error':>8} "
        f"{'linear':>8} {'error':>8} {'CPU share':>10} {'expected':>10} {'client':>7}",
        f"{'1 process, 1 core':<24} {base * 1e3:>8.1f} {1.0:>8.2f}x "
        f"{_fmt_ms(predict_single(cal)):>10} {_fmt_err(predict_single(cal), base):>8} "
        f"{'':>8} {'':>8} {cal.single_cpu_share:>10.2f} {1.0:>10.2f}",
    ]
    for row in result.rows:
        lines.append(
            f"{row.name:<24} {row.measured_s * 1e3:>8.1f} {base / row.measured_s:>8.2f}x "
            f"{_fmt_ms(row.predicted_s):>10} {_fmt_err(row.predicted_s, row.measured_s):>8} "
            f"{_fmt_ms(row.linear_predicted_s):>8} "
            f"{_fmt_err(row.linear_predicted_s, row.measured_s):>8} "
            f"{'/'.join(f'{c:.2f}' for c in row.worker_cpu_share):>10} "
            f"{'/'.join(f'{c:.2f}' for c in row.expected_cpu_share):>10} "
            f"{row.client_cpu_share:>7.2f}"
        )
    ratios = [(cal.single_cpu_share, "the single process")] + [
        (share / expected, f"{row.name} worker {task}")
        for row in result.rows
        for task, (share, expected) in enumerate(zip(row.worker_cpu_share, row.expected_cpu_share))
        if expected > 0.2
    ]
    low, who = min(ratios)
    if low < QUIET_CPU_SHARE:
        lines.append(
            f"note: {who} got {low:.2f} of its expected CPU share (< {QUIET_CPU_SHARE}): it "
            "waited on something the simulator does not model, or other processes shared the "
            "cores"
        )
    return "\n".join(lines)


# -- the calibration process ------------------------------------------------------------------


def make_data(model: Any, batch_size: int, seed: int = 0) -> tuple[list[Any], Any]:
    """Random inputs (token ids below the sequence length) and random float targets."""
    import numpy as np

    from passes.trace import input_specs

    rng = np.random.default_rng(seed)
    xs: list[Any] = []
    for spec in input_specs(model, batch_size):
        shape = tuple(int(d) for d in spec.shape)
        dtype = spec.dtype.as_numpy_dtype
        if spec.dtype.is_floating:
            xs.append(rng.standard_normal(shape).astype(dtype))
        else:
            xs.append(rng.integers(0, shape[-1], size=shape).astype(dtype))
    out_shape = (batch_size, *(int(d) for d in model.output_shape[1:]))
    y = rng.standard_normal(out_shape).astype("float32")
    return xs, y


def compile_model(model: Any) -> None:
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)


def _topology_file(path: Path, link: LinkFit) -> Path:
    data = {
        "name": "two workers on loopback",
        "devices": [{"type": "cpu", "count": 2}],
        "links": [
            {
                "devices": [0, 1],
                "link": {
                    "latency_s": link.latency_s,
                    "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
                    "name": "loopback (measured)",
                },
            }
        ],
    }
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def variable_times(variables: Sequence[Any], reps: int) -> tuple[float, float]:
    """The SGD update of ``variables`` and one addition of two copies of their gradients."""
    import keras
    import tensorflow as tf

    if not variables:
        return 0.0, 0.0
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(list(variables))
    grads = [tf.ones_like(v.value) for v in variables]
    more = [tf.ones_like(v.value) * 2.0 for v in variables]

    def apply() -> Any:
        optimizer.apply_gradients(zip(grads, variables))
        return tf.constant(0)

    def add() -> Any:
        sums = [a + b for a, b in zip(grads, more)]
        return tf.add_n([tf.reduce_sum(tf.reshape(t, [-1])[:1]) for t in sums])

    update = tf.function(apply, jit_compile=False)
    accumulate = tf.function(add, jit_compile=False)
    up = statistics.median(time_steps(lambda: update().numpy(), reps, 3))
    acc = statistics.median(time_steps(lambda: accumulate().numpy(), reps, 3))
    return up, acc


def calibrate(
    spec: ModelSpec, link: LinkFit, *, steps: int, warmup: int, work: Path
) -> ZooCalibration:
    """Plan, profile and time ``spec`` on this process's core (see the module docstring)."""
    from cost_models.devices.topology import load_topology
    from cost_models.estimate.analytic import calibrated_roofline
    from cost_models.estimate.costs import cost_graph
    from cost_models.measure.op_profile import apply_op_profile, profile_step_ops, step_inputs
    from partitioner.api import partition
    from partitioner.simulation.pipeline import pipeline_stages
    from partitioner.simulation.step import simulate_step
    from passes.trace import placement_units, trace_model

    topo_path = _topology_file(work / "topology.json", link)
    model = spec.build()
    plan = partition(
        model, gpus=None, device_type="cpu", batch_size=spec.batch_size, solver=spec.solver,
        topology=str(topo_path), optimizer="sgd", pipeline=True,
        num_microbatches=spec.num_microbatches, schedule=Schedule.ONE_F_ONE_B, profile_ops=True,
    )  # fmt: skip
    m = spec.num_microbatches
    traced = trace_model(model, batch_size=spec.batch_size)
    traced_micro = trace_model(model, batch_size=spec.microbatch_size)
    topology = load_topology(str(topo_path), device_type="cpu")
    costed = cost_graph(traced.graph, topology=topology, optimizer="sgd")
    # Every op timed inside the step, at the whole batch and at the micro-batch size (the same
    # graph, so the same op names); a micro-batch's times x M, its dispatch paid M times.
    rows = range(topology.num_devices)
    dispatch_s = calibrated_roofline("cpu").dispatch_overhead_s
    reps_ops = max(5, steps)
    full = profile_step_ops(traced, step_inputs(traced), steps=reps_ops, warmup=2, statistic="min")
    micro = profile_step_ops(
        traced_micro, step_inputs(traced_micro), steps=reps_ops, warmup=2, statistic="min"
    )
    costed_full = apply_op_profile(costed, full.op_time_s, rows, dispatch_s=dispatch_s)
    costed_micro = apply_op_profile(
        costed, {k: v * m for k, v in micro.op_time_s.items()}, rows, dispatch_s=dispatch_s * m
    )
    assignment = dict(plan.assignment)
    single_compute = simulate_step(costed_full, dict.fromkeys(assignment, 0)).step_time_s
    placed_compute = simulate_step(costed_full, assignment).step_time_s

    reps = max(10, 2 * steps)
    units = {u.name: u for u in placement_units(model)}
    per_device: list[tuple[float, float]] = []
    everything: dict[int, Any] = {}
    for d in range(plan.num_devices):
        chosen: dict[int, Any] = {}
        for name, dev in assignment.items():
            if dev == d:
                for w in units[name].operation.trainable_weights:
                    chosen[id(w)] = w
        everything.update(chosen)
        per_device.append(variable_times(list(chosen.values()), reps))
    all_update, _ = variable_times(list(everything.values()), reps)

    xs, y = make_data(model, spec.batch_size)
    compile_model(model)
    wall0, cpu0 = time.perf_counter(), time.process_time()
    samples = time_steps(lambda: model.train_on_batch(xs, y), steps, warmup)
    cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    return ZooCalibration(
        plan_json=plan.to_json(),
        plan_solver=plan.solver.name,
        plan_step_time_s=plan.step_time_s,
        single_step_s=statistics.median(samples),
        single_step_samples_s=tuple(samples),
        single_cpu_share=cpu_share,
        single_compute_s=single_compute,
        placed_compute_s=placed_compute,
        full_stages=pipeline_stages(costed_full, assignment),
        micro_stages=pipeline_stages(costed_micro, assignment),
        device_update_s=tuple(u for u, _ in per_device),
        device_accumulate_s=tuple(a for _, a in per_device),
        all_update_s=all_update,
        feed_bytes=sum(int(x.nbytes) for x in xs) + int(y.nbytes),
        profiled_layers=len(costed_full.measured),
        total_layers=len(traced.graph.layers),
    )


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def calibrate_in_child(
    spec: ModelSpec, link: LinkFit, core: int, *, steps: int, warmup: int
) -> ZooCalibration:
    """:func:`calibrate` in a fresh process pinned to ``core`` with one TF thread."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "calibration.json"
        cmd = [
            sys.executable, "-m", "benchmarks.cluster_zoo", "--role", "calibrate",
            "--models", spec.key, "--link", json.dumps(asdict(link)), "--out", str(out),
            "--core", str(core), "--steps", str(steps), "--warmup", str(warmup),
        ]  # fmt: skip
        done = subprocess.run(cmd, env=child_env(), cwd=REPO_ROOT, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(
                f"calibrating {spec.key} failed ({done.returncode}): {done.stderr[-3000:]}"
            )
        return calibration_from_json(out.read_text(encoding="utf-8"))


def _child_calibrate(
    spec: ModelSpec, link: LinkFit, core: int, out: Path, steps: int, warmup: int
) -> None:
    os.sched_setaffinity(0, {core})
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        cal = calibrate(spec, link, steps=steps, warmup=warmup, work=Path(tmp))
    out.write_text(calibration_to_json(cal), encoding="utf-8")


# -- the cluster side -------------------------------------------------------------------------


def measure_model(
    spec: ModelSpec,
    cal: ZooCalibration,
    link: LinkFit,
    handle: Any,
    tasks: Sequence[str],
    pids: Sequence[int],
    *,
    steps: int,
    warmup: int,
) -> ModelResult:
    """The placed, GPipe and 1F1B rows of ``spec`` on the connected workers."""
    from partitioner.plan.model import Plan

    plan = Plan.from_json_dict(json.loads(cal.plan_json))
    if plan.pipeline is None or plan.num_devices != 2:
        raise SystemExit(f"{spec.key}: the plan is not a two-device pipeline")
    model = spec.build()
    xs, y = make_data(model, spec.batch_size)
    m = spec.num_microbatches
    placed_busy = tuple(
        sum(st.forward_time_s + st.backward_time_s for st in cal.full_stages if st.device == d)
        + cal.device_update_s[d]
        for d in range(2)
    )
    variants: list[tuple[str, Plan, Schedule]] = [
        ("2 workers, placed", replace(plan, pipeline=None), Schedule.NONE),
        (
            f"2 workers, GPipe M={m}",
            replace(plan, pipeline=replace(plan.pipeline, schedule=Schedule.GPIPE)),
            Schedule.GPIPE,
        ),
        (
            f"2 workers, 1F1B M={m}",
            replace(plan, pipeline=replace(plan.pipeline, schedule=Schedule.ONE_F_ONE_B)),
            Schedule.ONE_F_ONE_B,
        ),
    ]
    rows = []
    for name, variant, schedule in variants:
        placed = variant.apply(model, devices=list(tasks), cluster=handle, step_timeout_s=120.0)
        compile_model(placed)

        def step(placed: Any = placed) -> Any:
            return placed.train_on_batch(xs, y)

        samples, shares = time_steps_with_cpu(step, steps, warmup, [*pids, os.getpid()])
        linear: float | None = None
        if schedule is Schedule.NONE:
            predicted, busy = predict_placed(cal, link), placed_busy
        else:

            def pipelined(
                stages: Sequence[Stage], sched: Schedule = schedule
            ) -> tuple[float, tuple[float, ...]]:
                return predict_pipelined(
                    stages, link, schedule=sched, num_microbatches=m,
                    update_s=cal.device_update_s, accumulate_s=cal.device_accumulate_s,
                    feed_bytes=cal.feed_bytes,
                )  # fmt: skip

            predicted, busy = pipelined(cal.micro_stages)
            linear = pipelined(cal.full_stages)[0]
        rows.append(
            Row(
                name, schedule, 1 if schedule is Schedule.NONE else m,
                statistics.median(samples), tuple(samples), predicted, linear,
                shares[:2], tuple(b / predicted for b in busy), shares[2],
            )
        )  # fmt: skip
    return ModelResult(spec, cal, tuple(rows))


def run(
    specs: Sequence[ModelSpec], *, steps: int, warmup: int, say: Any
) -> tuple[list[ModelResult], LinkFit]:
    """Start the two workers, fit the link, then calibrate and measure each model."""
    from partitioner.cli.worker import start_local_workers
    from passes.cluster.runtime import connect, remote_device_strings

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs two cores; this process may use {cores}")
    pair = (cores[0], cores[1])
    results: list[ModelResult] = []
    with tempfile.TemporaryDirectory() as tmp:
        workers = start_local_workers(2, Path(tmp), threads=1, cores=list(pair), env=child_env())
        with workers:
            handle = connect(workers.cluster_file, timeout_s=60)
            tasks = remote_device_strings(handle, [0, 1])
            link = measure_link(tasks, reps=max(20, 2 * steps))
            pids = [p.pid for p in workers.processes]
            for spec in specs:
                say(f"{spec.key}: planning and calibrating on core {pair[0]} ...\n")
                t0 = time.perf_counter()
                cal = calibrate_in_child(spec, link, pair[0], steps=steps, warmup=warmup)
                say(f"{spec.key}: calibrated in {time.perf_counter() - t0:.0f} s; measuring ...\n")
                results.append(
                    measure_model(spec, cal, link, handle, tasks, pids, steps=steps, warmup=warmup)
                )
    return results, link


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster_zoo")
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument(
        "--models", default=None, help=f"comma-separated, of {', '.join(SPECS)} (default "
        f"{','.join(DEFAULT_MODELS)})"
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--json", default=None, help="write measured records (benchmarks.run)")
    parser.add_argument(
        "--role", default="main", choices=["main", "calibrate"], help=argparse.SUPPRESS
    )
    parser.add_argument("--link", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--core", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    keys = tuple(args.models.split(",")) if args.models else DEFAULT_MODELS
    unknown = [k for k in keys if k not in SPECS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(SPECS)}")
    steps = args.steps or (5 if args.quick else 10)
    warmup = args.warmup or (2 if args.quick else 3)
    if args.role == "calibrate":
        data = json.loads(args.link)
        link = LinkFit(
            float(data["latency_s"]), float(data["bandwidth_bytes_per_s"]),
            float(data["dispatch_s"]), tuple((int(s), float(t)) for s, t in data["samples"]),
        )  # fmt: skip
        _child_calibrate(SPECS[keys[0]], link, args.core, Path(args.out), steps, warmup)
        return 0
    results, link = run([SPECS[k] for k in keys], steps=steps, warmup=warmup, say=sys.stderr.write)
    text = "\n\n".join(table(r, link, steps, warmup) for r in results)
    sys.stdout.write(text + "\n")
    if args.json:
        from partitioner.core.files import write_atomic

        out = [rec for r in results for rec in records(r)]
        write_atomic(args.json, json.dumps({"records": out}, indent=1) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the client's remote context has no clean teardown in TF 2
