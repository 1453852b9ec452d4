"""The profile cache: a second profile of the same model measures nothing and is much faster.

    python -m benchmarks.profile_cache [--model resnet50|mlp] [--cli]

Profiles the model twice with :func:`cost_models.measure.profiled.profile_model` into a fresh cache
directory and prints both wall times, the layer-device pairs measured and read from the cache,
and the speed-up (target: >= 3x). ``--cli`` instead times the whole command
``partition examples/<model>.py --gpus 2 --device-type cpu --profile`` twice in fresh processes
with ``PARTITIONER_CACHE_DIR`` pointing at a fresh directory (the end-to-end figure, once the
CLI passes ``--profile`` through).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def library(model_name: str) -> int:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    from cost_models.measure.profiled import profile_model

    def build() -> keras.Model:
        keras.utils.set_random_seed(0)
        if model_name == "resnet50":
            return keras.applications.ResNet50(weights=None, input_shape=(128, 128, 3), classes=100)
        return keras.Sequential(
            [keras.Input((784,)), keras.layers.Dense(512, activation="relu"),
             keras.layers.Dropout(0.2), keras.layers.Dense(512, activation="relu"),
             keras.layers.Dense(10)],
            name="mlp",
        )  # fmt: skip

    rows = []
    with tempfile.TemporaryDirectory() as cache:
        for run in ("first", "second"):
            model = build()  # a fresh model each time, as a new `partition --profile` run has
            t0 = time.perf_counter()
            result = profile_model(model, batch_size=8, cache_dir=cache)
            rows.append((run, time.perf_counter() - t0, result.measured_count, result.cached_count))
    out = sys.stdout
    out.write(f"profile_model({model_name}, batch 8) twice into one fresh cache directory\n")
    out.write(f"{'run':<8} {'wall_s':>8} {'measured':>9} {'cached':>7}\n")
    for run, wall, measured, cached in rows:
        out.write(f"{run:<8} {wall:>8.2f} {measured:>9} {cached:>7}\n")
    speedup = rows[0][1] / rows[1][1]
    ok = rows[1][2] == 0 and speedup >= 3.0
    out.write(f"speed-up {speedup:.1f}x (target >= 3x, second run measures nothing): "
              f"{'yes' if ok else 'NO'}\n")  # fmt: skip
    return 0 if ok else 1


def cli(model_name: str) -> int:
    path = {"resnet50": "examples/resnet50.py", "mlp": "examples/mnist_mlp.py"}[model_name]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PARTITIONER_CACHE_DIR": str(Path(tmp) / "cache")}
        for run in ("first", "second"):
            cmd = [sys.executable, "-m", "partitioner", path, "--gpus", "2", "--device-type", "cpu",
                   "--profile", "--out", f"{tmp}/plan.json"]  # fmt: skip
            t0 = time.perf_counter()
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            rows.append((run, time.perf_counter() - t0))
            if done.returncode != 0:
                sys.stderr.write(f"exit {done.returncode}: {done.stderr.strip()[-2000:]}\n")
                return 1
    sys.stdout.write(f"partition {path} --gpus 2 --device-type cpu --profile, twice\n")
    for run, wall in rows:
        sys.stdout.write(f"{run:<8} {wall:>8.2f} s\n")
    speedup = rows[0][1] / rows[1][1]
    sys.stdout.write(f"speed-up {speedup:.1f}x (target >= 3x)\n")
    return 0 if speedup >= 3.0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet50", "mlp"), default="resnet50")
    parser.add_argument("--cli", action="store_true", help="time the partition command end to end")
    args = parser.parse_args()
    return cli(args.model) if args.cli else library(args.model)


if __name__ == "__main__":
    raise SystemExit(main())
