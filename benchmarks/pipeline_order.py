"""The order TensorFlow's executor runs a pipeline's tasks in, with and without control dependencies.

    python -m benchmarks.pipeline_order [--microbatches 4] [--width 1024] [--batch-size 256]
                                        [--repeats 3]

A 3-stage MLP (two Dense layers per stage) is pipelined over three logical CPU devices with
:func:`passes.rewrite.pipeline.pipeline_model`, for GPipe and 1F1B, once with the schedule enforced by
control dependencies and once with the order left to the executor (``enforce_order=False``). Each
run's tasks are timed with in-graph ``tf.timestamp()`` probes
(:func:`passes.rewrite.pipeline.measure_task_times`); the table gives, per device, the order the tasks
started in, whether it is the schedule's order, and how many pairs of tasks on one device
overlapped in time. ``step_ms`` is the median wall time of one ``train_on_batch`` step.

A second table says why the stages are not separate nested ``tf.function``s: it times an op put
under ``tf.control_dependencies`` of a nested function's call (and of its output tensor), and of
the same computation inlined. A control edge on a call waits only for the callee's side effects
(TensorFlow inlines multi-device calls with their *control outputs* as the call's control
source), so the first fires long before the callee's compute has finished.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import tensorflow as tf

    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * 3
    )
    import keras
    import numpy as np

    from partitioner.core.ir import Schedule
    from passes.rewrite.pipeline import measure_task_times, pipeline_model

    keras.utils.set_random_seed(0)
    inputs = keras.Input((args.width,))
    h = inputs
    plan = {}
    for k in range(6):
        layer = keras.layers.Dense(args.width, activation="tanh", name=f"dense_{k}")
        h = layer(h)
        plan[layer.name] = f"/device:CPU:{k // 2}"
    model = keras.Model(inputs, h)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, args.width)).astype(np.float32)
    y = rng.standard_normal((args.batch_size, args.width)).astype(np.float32)

    header = (
        f"{'schedule':<6} {'enforced':<8} {'device':<14} {'started in order':<40} "
        f"{'= schedule':<10} {'overlaps':>8} {'step_ms':>8}"
    )
    sys.stdout.write(header + "\n" + "-" * len(header) + "\n")
    for schedule in (Schedule.GPIPE, Schedule.ONE_F_ONE_B):
        for enforce in (True, False):
            pipelined = pipeline_model(
                model,
                plan,
                num_microbatches=args.microbatches,
                schedule=schedule,
                sample_inputs=[x[:1]],
                enforce_order=enforce,
            )
            pipelined.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
            measure_task_times(pipelined, x, y)  # warm-up (tracing)
            timings = measure_task_times(pipelined, x, y)
            pipelined.train_on_batch(x, y)
            steps = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                pipelined.train_on_batch(x, y)
                steps.append(time.perf_counter() - t0)
            step_ms = statistics.median(steps) * 1e3
            for s, device in enumerate(pipelined.stage_devices):
                mine = [t for t in timings if t.task.stage == s]
                seen = " ".join(str(t.task) for t in mine)
                expected = " ".join(str(t) for t in pipelined.task_order[s])
                overlaps = sum(
                    1
                    for i, a in enumerate(mine)
                    for b in mine[i + 1 :]
                    if a.start_s < b.end_s and b.start_s < a.end_s
                )
                sys.stdout.write(
                    f"{schedule.value:<6} {'yes' if enforce else 'no':<8} {device:<14} "
                    f"{seen:<40} {'yes' if seen == expected else 'NO':<10} {overlaps:>8} "
                    f"{step_ms:>8.1f}\n"
                )
    nested_function_table(tf)
    return 0


def nested_function_table(tf: Any) -> None:
    @tf.function(autograph=False)
    def heavy(x: Any) -> Any:
        for _ in range(6):
            x = tf.tanh(tf.matmul(x, x) * 1e-3)
        return x

    @tf.function(autograph=False)
    def probe(x: Any, nested: bool) -> Any:
        t0 = tf.timestamp()
        with tf.control_dependencies([t0]):
            x = tf.identity(x)
        out = heavy(x) if nested else heavy.python_function(x)
        with tf.control_dependencies([out.op]):
            after_op = tf.timestamp()
        with tf.control_dependencies([tf.identity(out)]):
            after_data = tf.timestamp()
        # `out` is returned: grappler turns ops whose outputs nobody reads into NoOps
        return after_op - t0, after_data - t0, out

    x = tf.random.normal((1024, 1024))
    header = f"{'stage as':<22} {'ctrl dep on call/op ms':>23} {'dep on its data ms':>19}"
    sys.stdout.write("\n" + header + "\n" + "-" * len(header) + "\n")
    for nested in (True, False):
        for _ in range(2):
            probe(x, nested)  # warm-up
        on_op, on_data, _ = probe(x, nested)
        on_op, on_data = float(on_op) * 1e3, float(on_data) * 1e3
        name = "nested tf.function" if nested else "inlined ops"
        sys.stdout.write(f"{name:<22} {on_op:>23.1f} {on_data:>19.1f}\n")


if __name__ == "__main__":
    raise SystemExit(main())
