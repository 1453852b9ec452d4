"""Cost-model accuracy on this machine's CPU: predicted vs measured forward+backward time.

    python -m benchmarks.cost_accuracy [--quick] [--models resnet50,mlp] [--data FILE]
                                       [--reuse] [--write-calibration]

For five models (ResNet50 and MobileNetV2 from keras.applications with ``weights=None``, a
Transformer encoder, a two-layer LSTM, an MLP) it traces the training step, measures every layer's
forward and backward time (:func:`cost_models.measure.profiled.profile_model`, a fresh cache) and the
whole model's gradient step (:func:`cost_models.measure.profiled.time_model_step`), then predicts the same
times with the roofline calibrated **leave-one-model-out**: the efficiencies used for a model are
fitted on the other four models' layers only, so no model is scored on data it was fitted on.

Per model it prints: predicted total (every op of the step), measured total (the whole step, and
the sum of the layers measured one at a time), their errors, Spearman's rank correlation of the
layers' predicted and measured times, and the median absolute per-layer error. The same figures
for the uncalibrated default roofline come after, for reference.

``--data`` keeps the raw measurements (JSON, default ``benchmarks/results/cost_accuracy_cpu.json``)
and ``--reuse`` refits from them without measuring again. ``--write-calibration`` fits on all
the models and writes ``cost_models/data/calibration_cpu.json``, the default CPU calibration.
``--quick`` uses smaller inputs and fewer repeats (about a minute; the figures are noisier).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT / "benchmarks" / "results" / "cost_accuracy_cpu.json"
CALIBRATION_PATH = ROOT / "cost_models" / "data" / "calibration_cpu.json"

FIT_OPTIONS: dict[str, float] = {"weight_floor": 1.0, "max_scale": 8.0}
"""How the benchmark calibrates (see :func:`cost_models.estimate.calibrate.fit_roofline`): samples shorter
than the median sample weigh as the median one (tiny layers are mostly timer noise), and the
nominal cpu catalog figures may understate this machine by up to 8x."""

MODEL_NAMES = ("resnet50", "mobilenetv2", "transformer", "lstm", "mlp", "lstm_loop")
CALIBRATION_SUITE = (
    "cal_convnet",
    "cal_convnet_wide",
    "cal_separable",
    "cal_dense_small",
    "cal_dense_large",
    "cal_recurrent",
    "cal_recurrent_wide",
    "cal_recurrent_long",
    "cal_attention",
    "cal_attention_long",
)
"""Models the roofline is fitted on: the same layer families as the scored models, other shapes."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[], Any]
    batch_size: int
    description: str


def _specs(quick: bool) -> dict[str, ModelSpec]:
    import keras

    image = 64 if quick else 128
    seq = 32 if quick else 64

    def resnet50() -> Any:
        return keras.applications.ResNet50(weights=None, input_shape=(image, image, 3), classes=100)

    def mobilenetv2() -> Any:
        return keras.applications.MobileNetV2(
            weights=None, input_shape=(image, image, 3), classes=100
        )

    def transformer() -> Any:
        d_model, heads, ff, blocks, vocab = 128, 4, 512, 2 if quick else 4, 2000
        tokens = keras.Input((seq,), dtype="int32", name="tokens")
        x = keras.layers.Embedding(vocab, d_model, name="embed")(tokens)
        for b in range(blocks):
            attn = keras.layers.MultiHeadAttention(heads, d_model // heads, name=f"mha_{b}")(x, x)
            x = keras.layers.LayerNormalization(name=f"ln1_{b}")(
                keras.layers.Add(name=f"res1_{b}")([x, attn])
            )
            h = keras.layers.Dense(ff, activation="relu", name=f"ff1_{b}")(x)
            h = keras.layers.Dense(d_model, name=f"ff2_{b}")(h)
            x = keras.layers.LayerNormalization(name=f"ln2_{b}")(
                keras.layers.Add(name=f"res2_{b}")([x, h])
            )
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        out = keras.layers.Dense(10, name="head")(x)
        return keras.Model(tokens, out, name="transformer_encoder")

    def lstm(unroll: bool = True) -> Any:
        return keras.Sequential(
            [
                keras.Input((seq, 64)),
                keras.layers.LSTM(256, return_sequences=True, unroll=unroll, name="lstm_1"),
                keras.layers.LSTM(256, unroll=unroll, name="lstm_2"),
                keras.layers.Dense(10, name="head"),
            ],
            name="lstm_model" if unroll else "lstm_loop_model",
        )

    def mlp() -> Any:
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(1024, activation="relu", name="dense_1"),
                keras.layers.Dropout(0.2, name="dropout_1"),
                keras.layers.Dense(1024, activation="relu", name="dense_2"),
                keras.layers.Dropout(0.2, name="dropout_2"),
                keras.layers.Dense(10, name="head"),
            ],
            name="mlp",
        )

    # The calibration suite: small models of the same layer families as the five above, with
    # other shapes; the roofline is fitted on these and the five are scored (never fitted on).
    def conv_bn_relu(x: Any, name: str, filters: int, kernel: int, stride: int = 1) -> Any:
        x = keras.layers.Conv2D(filters, kernel, strides=stride, padding="same", name=name)(x)
        x = keras.layers.BatchNormalization(name=f"{name}_bn")(x)
        return keras.layers.ReLU(name=f"{name}_relu")(x)

    def cal_convnet() -> Any:
        # Channels 24..2048 over spatial sizes 40..3: the range of shapes image models reach.
        x = inp = keras.Input((40, 40, 3))
        x = conv_bn_relu(x, "c0", 24, 3)
        x = conv_bn_relu(x, "c1", 48, 5, 2)
        y = conv_bn_relu(x, "c2", 48, 1)
        x = keras.layers.Add(name="skip")([x, y])
        x = keras.layers.MaxPooling2D(2, strides=1, padding="same", name="pool")(x)
        x = conv_bn_relu(x, "c3", 160, 3, 2)
        x = conv_bn_relu(x, "c4", 384, 1)
        x = conv_bn_relu(x, "c5", 192, 3, 2)
        x = conv_bn_relu(x, "c6", 768, 1)
        x = conv_bn_relu(x, "c7", 384, 3, 2)
        x = conv_bn_relu(x, "c8", 1536, 1)
        x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
        return keras.Model(inp, keras.layers.Dense(20, name="out")(x), name="cal_convnet")

    def cal_convnet_wide() -> Any:
        x = inp = keras.Input((56, 56, 3))
        x = conv_bn_relu(x, "stem", 48, 7, 2)
        x = keras.layers.MaxPooling2D(3, strides=2, padding="same", name="pool")(x)
        for i, (filters, kernel) in enumerate(((96, 3), (96, 3), (320, 1), (128, 3))):
            x = conv_bn_relu(x, f"c{i}", filters, kernel, 2 if i == 3 else 1)
        x = keras.layers.AveragePooling2D(2, name="avg")(x)
        x = conv_bn_relu(x, "c4", 1024, 1)
        x = conv_bn_relu(x, "c5", 512, 3)
        x = keras.layers.Flatten(name="flat")(x)
        return keras.Model(inp, keras.layers.Dense(20, name="out")(x), name="cal_convnet_wide")

    def cal_separable() -> Any:
        x = inp = keras.Input((48, 48, 3))
        x = keras.layers.Conv2D(24, 3, strides=2, padding="same", name="stem")(x)
        blocks = (
            (1, 32, 1),
            (2, 48, 2),
            (4, 48, 1),
            (3, 96, 2),
            (4, 160, 1),
            (4, 256, 2),
            (2, 320, 1),
        )
        for i, (mult, filters, stride) in enumerate(blocks):
            y = keras.layers.Conv2D(int(x.shape[-1]) * mult, 1, name=f"ex{i}")(x)
            y = keras.layers.BatchNormalization(name=f"exbn{i}")(y)
            y = keras.layers.ReLU(6.0, name=f"exr{i}")(y)
            y = keras.layers.DepthwiseConv2D(3, strides=stride, padding="same", name=f"dw{i}")(y)
            y = keras.layers.BatchNormalization(name=f"dwbn{i}")(y)
            y = keras.layers.ReLU(6.0, name=f"dwr{i}")(y)
            y = keras.layers.Conv2D(filters, 1, name=f"pw{i}")(y)
            x = keras.layers.BatchNormalization(name=f"pwbn{i}")(y)
        x = keras.layers.GlobalAveragePooling2D(name="gap")(x)
        return keras.Model(inp, keras.layers.Dense(20, name="out")(x), name="cal_separable")

    def cal_dense(widths: tuple[int, ...], features: int, name: str) -> Any:
        x = inp = keras.Input((features,))
        for i, width in enumerate(widths):
            x = keras.layers.Dense(width, activation="relu" if i % 2 else "tanh", name=f"d{i}")(x)
            if i == 1:
                x = keras.layers.LayerNormalization(name="ln")(x)
            if i == 2:
                x = keras.layers.Dropout(0.1, name="drop")(x)
        return keras.Model(inp, keras.layers.Dense(30, name="out")(x), name=name)

    def cal_recurrent(units: int, steps: int, features: int, name: str) -> Any:
        x = inp = keras.Input((steps, features))
        x = keras.layers.GRU(units, return_sequences=True, unroll=True, name="gru")(x)
        x = keras.layers.LSTM(units * 3 // 4, return_sequences=True, unroll=True, name="lstm")(x)
        x = keras.layers.SimpleRNN(units // 2, unroll=True, name="rnn")(x)
        return keras.Model(inp, keras.layers.Dense(10, name="out")(x), name=name)

    def cal_attention_long() -> Any:
        # Longer sequences, other head shapes: attention's einsums and softmax at another size.
        tokens = keras.Input((96,), dtype="int32")
        x = keras.layers.Embedding(500, 64, name="embed")(tokens)
        for i, (heads, key_dim) in enumerate(((8, 8), (2, 32), (4, 24))):
            a = keras.layers.MultiHeadAttention(heads, key_dim, name=f"mha{i}")(x, x)
            x = keras.layers.LayerNormalization(name=f"ln{i}")(keras.layers.Add(name=f"res{i}")([x, a]))
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        return keras.Model(tokens, keras.layers.Dense(5, name="out")(x), name="cal_attention_long")

    def cal_attention() -> Any:
        tokens = keras.Input((48,), dtype="int32")
        x = keras.layers.Embedding(1000, 96, name="embed")(tokens)
        a = keras.layers.MultiHeadAttention(6, 16, name="mha")(x, x)
        x = keras.layers.LayerNormalization(name="ln1")(keras.layers.Add(name="res1")([x, a]))
        h = keras.layers.Dense(384, activation="gelu", name="ff1")(x)
        x = keras.layers.Add(name="res2")([x, keras.layers.Dense(96, name="ff2")(h)])
        b = keras.layers.MultiHeadAttention(2, 48, name="mha2")(x, x)
        x = keras.layers.LayerNormalization(name="ln2")(keras.layers.Add(name="res3")([x, b]))
        x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
        return keras.Model(tokens, keras.layers.Dense(5, name="out")(x), name="cal_attention")

    batch = 8
    return {
        "cal_convnet": ModelSpec(
            "cal_convnet", cal_convnet, 8, "40x40x3, conv+BN+ReLU 24..1536 channels"
        ),
        "cal_convnet_wide": ModelSpec(
            "cal_convnet_wide", cal_convnet_wide, 4, "56x56x3, 7x7 stem, pools, 48..1024 channels"
        ),
        "cal_separable": ModelSpec(
            "cal_separable", cal_separable, 8, "48x48x3, 7 inverted-residual-like blocks"
        ),
        "cal_dense_small": ModelSpec(
            "cal_dense_small",
            lambda: cal_dense((2048, 512, 1536, 256, 768), 300, "cal_dense_small"),
            32,
            "300 -> 2048 -> 512 -> 1536 -> 256 -> 768 -> 30",
        ),
        "cal_dense_large": ModelSpec(
            "cal_dense_large",
            lambda: cal_dense((640, 1280, 384, 2560), 1000, "cal_dense_large"),
            128,
            "1000 -> 640 -> 1280 -> 384 -> 2560 -> 30",
        ),
        "cal_recurrent": ModelSpec(
            "cal_recurrent",
            lambda: cal_recurrent(128, 12, 40, "cal_recurrent"),
            16,
            "12 x 40 -> GRU 128 -> LSTM 96 -> RNN 64 (unrolled)",
        ),
        "cal_recurrent_long": ModelSpec(
            "cal_recurrent_long",
            lambda: keras.Sequential(
                [
                    keras.Input((24, 32)),
                    keras.layers.GRU(512, return_sequences=True, unroll=True, name="gru"),
                    keras.layers.SimpleRNN(384, unroll=True, name="rnn"),
                    keras.layers.Dense(10, name="out"),
                ],
                name="cal_recurrent_long",
            ),
            8,
            "24 x 32 -> GRU 512 -> RNN 384 (unrolled): small batch, large weights read every step",
        ),
        "cal_recurrent_wide": ModelSpec(
            "cal_recurrent_wide",
            lambda: cal_recurrent(384, 6, 100, "cal_recurrent_wide"),
            4,
            "6 x 100 -> GRU 384 -> LSTM 288 -> RNN 192 (unrolled)",
        ),
        "cal_attention": ModelSpec(
            "cal_attention", cal_attention, 8, "seq 48, d 96, 2 attention blocks"
        ),
        "cal_attention_long": ModelSpec(
            "cal_attention_long", cal_attention_long, 4, "seq 96, d 64, 3 attention layers"
        ),
        "resnet50": ModelSpec("resnet50", resnet50, batch, f"{image}x{image}x3, 100 classes"),
        "mobilenetv2": ModelSpec(
            "mobilenetv2", mobilenetv2, batch, f"{image}x{image}x3, 100 classes"
        ),
        "transformer": ModelSpec(
            "transformer",
            transformer,
            batch,
            f"seq {seq}, d 128, 4 heads, ff 512, {2 if quick else 4} blocks",
        ),
        "lstm": ModelSpec(
            "lstm", lstm, 16 if not quick else 8, f"seq {seq} x 64 -> LSTM 256 x2 (unrolled) -> 10"
        ),
        "lstm_loop": ModelSpec(
            "lstm_loop",
            lambda: lstm(unroll=False),
            16 if not quick else 8,
            f"seq {seq} x 64 -> LSTM 256 x2 (tf.while_loop) -> 10",
        ),
        "mlp": ModelSpec("mlp", mlp, 64, "784 -> 1024 -> 1024 -> 10, dropout"),
    }


# ----------------------------------------------------------------------------------------------
# Measuring (TensorFlow)


def measure(
    spec: ModelSpec, quick: bool, statistic: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """Trace the step, then time every op inside it and the step's wall time; the raw record.

    Per-layer times are the sums of the layer's ops' kernel times within the whole step
    (:func:`cost_models.measure.op_profile.profile_step_ops`), so a layer's figure and the model's total
    come from the same runs of the same graph. ``statistic`` is kept in the metadata.
    """
    import keras

    from cost_models.estimate.analytic import ZERO_WORK_OPS
    from cost_models.measure.op_profile import layer_phase_times, profile_step_ops, step_inputs
    from passes.trace import trace_model

    keras.utils.set_random_seed(0)
    model = spec.build()
    trace = trace_model(model, batch_size=spec.batch_size)
    graph = trace.graph
    inputs = step_inputs(trace)
    t0 = time.perf_counter()
    steps = 8 if quick else 30
    prof = profile_step_ops(
        trace,
        inputs,
        steps=steps,
        warmup=2 if quick else 3,
        statistic="min" if statistic == "min" else "median",
    )
    profile_s = time.perf_counter() - t0
    measured = layer_phase_times(graph, prof.op_time_s)
    log(
        f"  {spec.name}: step {1e3 * prof.step_time_s:.2f} ms, ops {1e3 * prof.ops_total_s:.2f} ms, "
        f"unattributed {1e3 * prof.unattributed_time_s:.2f} ms ({prof.num_events} events)"
    )
    index = graph.op_index
    input_bytes = [0] * len(graph.ops)
    for e in graph.edges:
        input_bytes[index[e.dst]] += e.bytes
    ops = [
        [op.layer, op.phase.value, op.op_type, op.flops, ib + op.output_bytes,
         op.output_dtypes[0] if op.output_dtypes else "float32", op.output_bytes,
         op.transposed_bytes]
        for op, ib in zip(graph.ops, input_bytes)
        if op.op_type not in ZERO_WORK_OPS
    ]  # fmt: skip
    return {
        "model": spec.name,
        "keras_name": model.name,
        "description": spec.description,
        "batch_size": spec.batch_size,
        "layers": [info.name for info in graph.layers],
        "measured": {k: list(v) for k, v in measured.items()},
        "skipped": [info.name for info in graph.layers if info.name not in measured],
        "step_time_s": prof.step_time_s,
        "ops_time_s": prof.ops_total_s,
        "glue_time_s": prof.ops_total_s - sum(f + b for f, b in measured.values()),
        "unattributed_time_s": prof.unattributed_time_s,
        "num_ops": len(graph.ops),
        "ops": ops,
        "profile_time_s": profile_s,
        "profiled_steps": steps,
    }


# ----------------------------------------------------------------------------------------------
# Fitting and scoring (pure)


def samples_of(record: dict[str, Any]) -> list[Any]:
    """The fitting samples of a record: one per layer and phase (its ops' measured kernels)."""
    from cost_models.estimate.calibrate import OPAQUE_OPS, LayerSample, OpWork
    from partitioner.core.ir import Phase

    grouped: dict[tuple[str, str], list[Any]] = {}
    for layer, phase, op_type, flops, moved, dtype, out_bytes, transposed in record["ops"]:
        if layer is not None:
            grouped.setdefault((layer, phase), []).append(
                OpWork(op_type, flops, moved, dtype, out_bytes, transposed)
            )
    out = []
    for layer, (fwd, bwd) in record["measured"].items():
        for phase, t in (("forward", fwd), ("backward", bwd)):
            ops = grouped.get((layer, phase))
            if ops and t > 0 and not any(o.op_type in OPAQUE_OPS for o in ops):
                out.append(LayerSample(record["model"], layer, Phase(phase), tuple(ops), t))
    return out


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    if len(a) < 2:
        return float("nan")
    ra, rb = _ranks(a), _ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return cov / var if var > 0 else float("nan")


@dataclass(frozen=True)
class Score:
    model: str
    predicted_total_s: float
    step_s: float
    layers_sum_s: float
    spearman: float
    median_layer_error: float
    num_layers: int


def score(record: dict[str, Any], roofline: Any) -> tuple[Score, list[tuple[str, float, float]]]:
    from cost_models.devices.catalog import get_device_type
    from cost_models.estimate.calibrate import LayerSample, OpWork, predict_sample_s
    from partitioner.core.ir import Phase

    device = get_device_type("cpu")
    per_layer: dict[str | None, list[Any]] = {}
    for layer, _phase, op_type, flops, moved, dtype, out_bytes, transposed in record["ops"]:
        per_layer.setdefault(layer, []).append(
            OpWork(op_type, flops, moved, dtype, out_bytes, transposed)
        )

    def predict(ops: list[Any]) -> float:
        if not ops:
            return 0.0
        return predict_sample_s(
            LayerSample("", "", Phase.FORWARD, tuple(ops), 1.0), device, roofline
        )

    # Kernels, plus the executor's cost per op (every op of the step, zero-work ones too).
    total = sum(predict(ops) for ops in per_layer.values())
    total += roofline.dispatch_overhead_s * record["num_ops"]
    rows = []
    for layer, (fwd, bwd) in record["measured"].items():
        meas = fwd + bwd
        if meas <= 0:
            continue
        rows.append((layer, predict(per_layer.get(layer, [])), meas))
    errs = [abs(p - m) / m for _, p, m in rows]
    return (
        Score(
            model=record["model"],
            predicted_total_s=total,
            step_s=record["step_time_s"],
            layers_sum_s=sum(m for _, _, m in rows),
            spearman=spearman([p for _, p, _ in rows], [m for _, _, m in rows]),
            median_layer_error=statistics.median(errs) if errs else float("nan"),
            num_layers=len(rows),
        ),
        rows,
    )


def _pct(x: float) -> str:
    return f"{100 * x:+.1f}%"


def print_table(title: str, scores: Sequence[Score], out: Any) -> None:
    out.write(f"\n{title}\n")
    header = (
        f"{'model':<12} {'layers':>6} {'pred ms':>9} {'step ms':>9} {'err':>7} "
        f"{'sum ms':>9} {'err':>7} {'spearman':>8} {'med |layer err|':>15}"
    )
    out.write(header + "\n" + "-" * len(header) + "\n")
    for s in scores:
        out.write(
            f"{s.model:<12} {s.num_layers:>6} {1e3 * s.predicted_total_s:>9.2f} "
            f"{1e3 * s.step_s:>9.2f} {_pct(s.predicted_total_s / s.step_s - 1):>7} "
            f"{1e3 * s.layers_sum_s:>9.2f} {_pct(s.predicted_total_s / s.layers_sum_s - 1):>7} "
            f"{s.spearman:>8.3f} {100 * s.median_layer_error:>14.1f}%\n"
        )
    target = [s for s in scores if s.model in MODEL_NAMES[:5]] or list(scores)
    step_errs = [abs(s.predicted_total_s / s.step_s - 1) for s in target]
    sum_errs = [abs(s.predicted_total_s / s.layers_sum_s - 1) for s in target]
    out.write(
        f"over {', '.join(s.model for s in target)}: median |total err| vs step {100 * statistics.median(step_errs):.1f}%, "
        f"vs sum of layers {100 * statistics.median(sum_errs):.1f}%; "
        f"min spearman {min(s.spearman for s in target):.3f}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs, fewer repeats")
    parser.add_argument("--models", default=",".join(MODEL_NAMES[:5]))
    parser.add_argument(
        "--data", type=Path, default=None, help=f"raw data JSON (default {DEFAULT_DATA})"
    )
    parser.add_argument("--reuse", action="store_true", help="refit from --data without measuring")
    parser.add_argument("--write-calibration", action="store_true")
    parser.add_argument("--layers", action="store_true", help="print every layer's figures")
    parser.add_argument(
        "--statistic",
        choices=("median", "min"),
        default="min",
        help="summary of the repeated steps, per op and for the wall time (min is the steadier "
        "on a shared machine: another process only adds time)",
    )
    args = parser.parse_args(argv)
    out = sys.stdout
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODEL_NAMES]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(MODEL_NAMES)}")
    data_path = args.data or (
        DEFAULT_DATA.with_name("cost_accuracy_cpu_quick.json") if args.quick else DEFAULT_DATA
    )

    def log(msg: str) -> None:
        sys.stderr.write(msg + "\n")
        sys.stderr.flush()

    records: dict[str, dict[str, Any]] = {}
    wanted = [*CALIBRATION_SUITE, *names]
    if args.reuse:
        raw = json.loads(data_path.read_text(encoding="utf-8"))
        records = {r["model"]: r for r in raw["records"] if r["model"] in wanted}
        meta = raw.get("meta", {})
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
        import tensorflow as tf

        from cost_models.measure.op_profile import configure_serial_executor

        configure_serial_executor()
        specs = _specs(args.quick)
        t_all = time.perf_counter()
        for n in wanted:
            t0 = time.perf_counter()
            log(f"measuring {n} ...")
            records[n] = measure(specs[n], args.quick, args.statistic, log)
            log(f"  {n}: {time.perf_counter() - t0:.1f} s")
        from cost_models.measure.profiled import device_kind

        meta = {
            "device": device_kind("/device:CPU:0"),
            "tf_version": tf.__version__,
            "quick": args.quick,
            "inter_op_threads": 1,
            "statistic": args.statistic,
            "measure_time_s": time.perf_counter() - t_all,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        from partitioner.core.files import write_atomic

        data_path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(
            data_path, json.dumps({"meta": meta, "records": list(records.values())}) + "\n"
        )
        log(f"raw data written to {data_path}")

    from cost_models.devices.catalog import get_device_type
    from cost_models.estimate.analytic import DEFAULT_ROOFLINE
    from cost_models.estimate.calibrate import fit_dispatch_overhead, fit_roofline, save_calibration

    device = get_device_type("cpu")
    samples = {n: samples_of(r) for n, r in records.items()}
    out.write(
        f"Cost accuracy on {meta.get('device', '?')} (TF {meta.get('tf_version', '?')}), "
        f"{'quick' if meta.get('quick') else 'full'} run; one inter-op thread (ops one at a time, "
        "as the planner's device queue); times are kernel times inside the whole step\n"
    )
    for n, r in records.items():
        out.write(
            f"  {n:<14} batch {r['batch_size']:>3}, {r['description']}; {len(r['layers'])} layers, "
            f"{r['num_ops']} ops; step {1e3 * r['step_time_s']:.1f} ms, kernels "
            f"{1e3 * r['ops_time_s']:.1f} ms ({1e3 * r['glue_time_s']:.1f} ms outside layers), "
            f"unattributed {1e3 * r['unattributed_time_s']:.2f} ms\n"
        )
    def calibrate(models: Sequence[str], source: str = "") -> Any:
        """The roofline fitted on ``models``' layers, with their dispatch cost per op."""
        fitted = fit_roofline(
            [s for m in models for s in samples[m]], device, **FIT_OPTIONS, source=source
        )
        dispatch_s = fit_dispatch_overhead(
            [(records[m]["step_time_s"], records[m]["ops_time_s"], records[m]["num_ops"]) for m in models]
        )
        return dataclasses.replace(
            fitted, roofline=dataclasses.replace(fitted.roofline, dispatch_overhead_s=dispatch_s)
        )

    suite_models = [m for m in CALIBRATION_SUITE if m in samples]
    scored = [n for n in names if n in records]
    layer_rows: dict[str, list[tuple[str, float, float]]] = {}
    if suite_models:
        cal_suite = calibrate(suite_models)
        suite_scores = []
        for n in scored:
            sc, rows = score(records[n], cal_suite.roofline)
            suite_scores.append(sc)
            layer_rows[n] = rows
        print_table(
            f"Calibrated on the calibration suite only ({', '.join(m for m in CALIBRATION_SUITE if m in samples)}); "
            "the scored models are never fitted on:",
            suite_scores,
            out,
        )
    held_out: list[Score] = []
    for n in scored:
        train = [m for m in samples if m != n]
        if not train:
            continue
        held_out.append(score(records[n], calibrate(train).roofline)[0])
    if held_out:
        print_table(
            "Leave-one-model-out (the suite and the other scored models in the fit):", held_out, out
        )
    print_table(
        "Uncalibrated default roofline (reference):",
        [score(records[n], DEFAULT_ROOFLINE)[0] for n in scored],
        out,
    )
    cal_all = calibrate(
        list(samples),
        source=(
            "fitted by `python -m benchmarks.cost_accuracy --write-calibration` on the layers of "
            f"{', '.join(records)}: kernel times inside the training step, one inter-op thread, "
            f"measured on {meta.get('device', '?')} (TF {meta.get('tf_version', '?')}) "
            f"at {meta.get('measured_at', '?')}"
        ),
    )
    out.write(
        f"\nFit on all {cal_all.fit.num_samples} layer samples: rms relative error "
        f"{100 * cal_all.fit.rms_relative_error:.1f}%, median |error| "
        f"{100 * cal_all.fit.median_abs_relative_error:.1f}%; efficiencies "
        + ", ".join(f"{k} {v:.3f}" for k, v in cal_all.class_efficiency.items())
        + "; of the bandwidth "
        + ", ".join(f"{k} {v:.3f}" for k, v in cal_all.class_memory_efficiency.items())
        + f"; peak x{cal_all.roofline.peak_flops_scale:.2f}, "
        f"bandwidth x{cal_all.roofline.memory_bandwidth_scale:.2f} the catalog figures; overhead per op "
        + ", ".join(f"{k} {1e6 * v:.1f} us" for k, v in cal_all.class_overhead_s.items())
        + f"; transposed matmul operands {1e9 * cal_all.roofline.transpose_s_per_byte:.3f} ns/byte"
        + f"; bytes beyond {cal_all.roofline.spill_threshold_bytes >> 10} KiB per op "
        f"{1e9 * cal_all.roofline.spill_s_per_byte:.3f} ns/byte; dispatch "
        f"{1e6 * cal_all.roofline.dispatch_overhead_s:.2f} us per op\n"
    )
    if args.layers:
        for n, rows in layer_rows.items():
            out.write(f"\n{n}: layer, predicted ms, measured ms\n")
            for layer, p, m in rows:
                out.write(f"  {layer:<40} {1e3 * p:>9.3f} {1e3 * m:>9.3f} {_pct(p / m - 1):>8}\n")
    if args.write_calibration:
        save_calibration(cal_all, CALIBRATION_PATH)
        out.write(f"wrote {CALIBRATION_PATH.relative_to(ROOT)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
