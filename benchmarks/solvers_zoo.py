"""Every registered solver on four real model graphs (random weights, nothing downloaded).

Models: ResNet50 and InceptionV3 (``keras.applications``, ``weights=None``), a small BERT-like
Transformer encoder (6 blocks, d_model 512, 8 heads, ffn 2048, seq 128, int-token Embedding
input) and an LSTM model (Embedding -> 8 stacked LSTM(512, return_sequences) -> Dense, seq 64, like
the deep NMT stacks of the device-placement papers). Each
is traced once at batch 32 and costed on 2, 4 and 8 H100s over PCIe and NVLink; every solver of
:func:`partitioner.solvers.solver_names` then places it.

Columns: ``pipelined_s`` is :func:`partitioner.solvers.ilp.throughput_objective_s` (the slowest
device's compute plus its transfers: the time per batch of a pipeline), ``pipe/LB`` its ratio to
the work / largest-layer bound (:attr:`partitioner.bounds.LowerBounds.throughput_s`);
``step_s`` is the simulated plain (un-pipelined) step of :func:`partitioner.placement.evaluate`,
``step/LB`` its ratio to :attr:`~partitioner.bounds.LowerBounds.best_s`; ``mem_frac`` the fullest
device's memory over its limit; ``solve_s`` the wall time of ``solve``.

Then, per (model, devices, link), ``auto``'s ``pipelined_s`` is compared with the best of every
other solver; the exit status is 1 when ``auto`` is worse than one of them.

    python -m benchmarks.solvers_zoo [--quick] [--json out.json] [--time-limit S]
"""

# OR-Tools must load before TensorFlow (google/or-tools#3230), so that CP-SAT runs in-process.
import ortools.sat.python.cp_model  # noqa: F401, I001  (import order matters)

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras

from cost_models.costs import cost_graph
from partitioner.bounds import costed_lower_bounds
from partitioner.errors import InfeasibleError, PartitionError
from partitioner.placement import evaluate
from partitioner.solvers import get_solver, solver_names
from partitioner.solvers.ilp import throughput_objective_s
from passes.trace import trace_model

BATCH_SIZE = 32
DEVICE_TYPE = "h100"
TOLERANCE = 1e-9


# --------------------------------------------------------------------------------------------
# Models
# --------------------------------------------------------------------------------------------


def resnet50() -> keras.Model:
    return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3))


def inception_v3() -> keras.Model:
    return keras.applications.InceptionV3(weights=None, input_shape=(299, 299, 3))


def transformer(
    blocks: int = 6,
    d_model: int = 512,
    heads: int = 8,
    ffn: int = 2048,
    seq: int = 128,
    vocab: int = 8192,
) -> keras.Model:
    layers = keras.layers
    tokens = keras.Input(shape=(seq,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, d_model, name="embed")(tokens)
    for b in range(blocks):
        attn = layers.MultiHeadAttention(heads, d_model // heads, name=f"mha_{b}")(x, x)
        x = layers.LayerNormalization(name=f"ln_attn_{b}")(
            layers.Add(name=f"add_attn_{b}")([x, attn])
        )
        h = layers.Dense(ffn, activation="gelu", name=f"ffn_in_{b}")(x)
        h = layers.Dense(d_model, name=f"ffn_out_{b}")(h)
        x = layers.LayerNormalization(name=f"ln_ffn_{b}")(layers.Add(name=f"add_ffn_{b}")([x, h]))
    logits = layers.Dense(vocab, name="lm_head")(x)
    return keras.Model(tokens, logits, name="transformer_encoder")


def lstm(seq: int = 64, vocab: int = 8192, units: int = 512, depth: int = 8) -> keras.Model:
    layers = keras.layers
    tokens = keras.Input(shape=(seq,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, units, name="embed")(tokens)
    for k in range(depth):
        x = layers.LSTM(units, return_sequences=True, name=f"lstm_{k}")(x)
    logits = layers.Dense(vocab, name="head")(x)
    return keras.Model(tokens, logits, name="lstm_lm")


MODELS = {
    "resnet50": resnet50,
    "inception_v3": inception_v3,
    "transformer": transformer,
    "lstm": lstm,
}


# --------------------------------------------------------------------------------------------
# Runs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    model: str
    devices: int
    link: str
    solver: str
    status: str
    pipelined_s: float | None
    step_s: float | None
    pipe_lb_s: float
    step_lb_s: float
    mem_frac: float | None
    solve_s: float

    @property
    def pipe_ratio(self) -> float | None:
        return None if self.pipelined_s is None else self.pipelined_s / self.pipe_lb_s

    @property
    def step_ratio(self) -> float | None:
        return None if self.step_s is None else self.step_s / self.step_lb_s

    def record(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "devices": self.devices,
            "topology": self.link,
            "solver": self.solver,
            "step_time_s": self.step_s,
            "pipelined_time_s": self.pipelined_s,
            "lower_bound_s": self.step_lb_s,
            "pipelined_lower_bound_s": self.pipe_lb_s,
            "solve_time_s": self.solve_s,
            "max_memory_fraction": self.mem_frac,
            "status": self.status,
        }


def run_config(
    model: str,
    graph: Any,
    n: int,
    link: str,
    time_limit_s: float,
    errors: list[tuple[str, str, str]],
) -> list[Row]:
    costed = cost_graph(graph, device_type=DEVICE_TYPE, num_devices=n, link=link)
    problem = costed.problem()
    bounds = costed_lower_bounds(costed)
    rows = []
    for name in solver_names():
        solver = get_solver(name, seed=0, time_limit_s=time_limit_s)
        t0 = time.perf_counter()
        try:
            result = solver.solve(problem)
        except InfeasibleError as exc:
            elapsed = time.perf_counter() - t0
            errors.append((f"{model} x{n} {link}", name, f"infeasible: {exc}"))
            rows.append(
                Row(
                    model,
                    n,
                    link,
                    name,
                    "infeasible",
                    None,
                    None,
                    bounds.throughput_s,
                    bounds.best_s,
                    None,
                    elapsed,
                )
            )
            continue
        except PartitionError as exc:  # e.g. more devices than layers
            elapsed = time.perf_counter() - t0
            rows.append(
                Row(
                    model,
                    n,
                    link,
                    name,
                    f"error ({type(exc).__name__})",
                    None,
                    None,
                    bounds.throughput_s,
                    bounds.best_s,
                    None,
                    elapsed,
                )
            )
            errors.append((f"{model} x{n} {link}", name, f"{type(exc).__name__}: {exc}"))
            continue
        elapsed = time.perf_counter() - t0
        ev = evaluate(costed, result.assignment)
        mem = max(d.memory_bytes / d.memory_limit_bytes for d in ev.per_device)
        rows.append(
            Row(
                model,
                n,
                link,
                name,
                result.status.value,
                throughput_objective_s(problem, result.assignment),
                ev.step_time_s,
                bounds.throughput_s,
                bounds.best_s,
                mem,
                elapsed,
            )
        )
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------

COLUMNS = (
    ("model", "<"),
    ("devices", ">"),
    ("link", "<"),
    ("solver", "<"),
    ("pipelined_s", ">"),
    ("pipe/LB", ">"),
    ("step_s", ">"),
    ("step/LB", ">"),
    ("mem_frac", ">"),
    ("solve_s", ">"),
    ("status", "<"),
)


def _num(x: float | None, fmt: str) -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, fmt)


def table(rows: list[Row]) -> str:
    cells = [
        [
            r.model,
            str(r.devices),
            r.link,
            r.solver,
            _num(r.pipelined_s, ".6f"),
            _num(r.pipe_ratio, ".3f"),
            _num(r.step_s, ".6f"),
            _num(r.step_ratio, ".3f"),
            _num(r.mem_frac, ".3f"),
            _num(r.solve_s, ".3f"),
            r.status,
        ]
        for r in rows
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(COLUMNS)]
    out = []
    for line in [[h for h, _ in COLUMNS], *cells]:
        out.append(
            "  ".join(
                c.ljust(w) if align == "<" else c.rjust(w)
                for c, w, (_, align) in zip(line, widths, COLUMNS, strict=True)
            ).rstrip()
        )
    out.insert(1, "-" * len(out[0]))
    return "\n".join(out)


def compare_auto(rows: list[Row]) -> tuple[list[str], bool]:
    """Per (model, devices, link): auto's pipelined time against the best other solver's."""
    groups: dict[tuple[str, int, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.devices, r.link), []).append(r)
    lines, ok = [], True
    for (model, n, link), group in groups.items():
        auto = next(r for r in group if r.solver == "auto")
        others = [r for r in group if r.solver != "auto" and r.pipelined_s is not None]
        label = f"{model} x{n} {link}"
        if not others:
            lines.append(
                f"{label}: auto vs best baseline: {_num(auto.pipelined_s, '.6f')} vs - (none feasible)"
            )
            continue
        best = min(others, key=lambda r: r.pipelined_s or math.inf)
        assert best.pipelined_s is not None
        good = auto.pipelined_s is not None and auto.pipelined_s <= best.pipelined_s * (
            1 + TOLERANCE
        )
        ok = ok and good
        lines.append(
            f"{label}: auto vs best baseline: {_num(auto.pipelined_s, '.6f')} vs "
            f"{best.pipelined_s:.6f} ({best.solver}){'' if good else '  <-- auto WORSE'}"
        )
    return lines, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="ResNet50 and the LSTM at 2 and 4 devices over PCIe, 2 s limit",
    )
    parser.add_argument("--json", metavar="OUT", help="write one record per row to OUT")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="time_limit_s of every solver (ilp/auto use it); default 5, 2 with --quick",
    )
    args = parser.parse_args()
    time_limit_s = args.time_limit if args.time_limit is not None else (2.0 if args.quick else 5.0)
    if args.quick:
        models, device_counts, links = ("resnet50", "lstm"), (2, 4), ("pcie",)
    else:
        models, device_counts, links = tuple(MODELS), (2, 4, 8), ("pcie", "nvlink")

    say = sys.stderr.write
    start = time.perf_counter()
    rows: list[Row] = []
    errors: list[tuple[str, str, str]] = []
    trace_lines = []
    for model in models:
        t0 = time.perf_counter()
        keras_model = MODELS[model]()
        traced = trace_model(keras_model, batch_size=BATCH_SIZE)
        graph = traced.graph
        line = (
            f"{model}: {len(graph.ops)} ops, {len(graph.layer_graph.nodes)} layers; built+traced "
            f"in {time.perf_counter() - t0:.1f} s (trace {traced.trace_time_s:.1f} s, FLOPs "
            f"{traced.flops_time_s:.1f} s)"
        )
        trace_lines.append(line)
        say(line + "\n")
        del keras_model
        keras.backend.clear_session()
        for n in device_counts:
            for link in links:
                t1 = time.perf_counter()
                rows.extend(run_config(model, graph, n, link, time_limit_s, errors))
                say(f"  {model} x{n} {link}: {time.perf_counter() - t1:.1f} s\n")

    lines, ok = compare_auto(rows)
    out = [f"solvers zoo: batch {BATCH_SIZE}, {DEVICE_TYPE}, time_limit_s={time_limit_s:g}"]
    out += [*trace_lines, "", table(rows), ""]
    if errors:
        failed: dict[tuple[str, str], list[str]] = {}
        for label, name, message in errors:
            failed.setdefault((label, message), []).append(name)
        out.append("infeasible / failed runs:")
        out += [f"  {label} [{', '.join(names)}]: {msg}" for (label, msg), names in failed.items()]
        out.append("")
    out += lines
    out.append(f"total wall time {time.perf_counter() - start:.1f} s")
    out.append(f"auto never worse than the best baseline: {'yes' if ok else 'no'}")
    sys.stdout.write("\n".join(out) + "\n")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.record() for r in rows], fh, indent=1)
            fh.write("\n")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
