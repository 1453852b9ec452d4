"""Wall time of the ``partition`` command end to end, as a user runs it.

    python -m benchmarks.cli_wall [--repeats 3]

Runs ``partition examples/resnet50.py --gpus 2 --batch-size 32`` (and the MLP example) in a fresh
process each time and prints a table of wall times (the target for ResNet50 is <= 30 s on the
2-core reference machine).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = (
    ("resnet50", ["examples/resnet50.py", "--gpus", "2", "--batch-size", "32"], 30.0),
    ("mnist_mlp", ["examples/mnist_mlp.py", "--gpus", "2"], 30.0),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for name, argv, target_s in CASES:
        times = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                cmd = [sys.executable, "-m", "partitioner", *argv, "--out", f"{tmp}/plan.json"]
                t0 = time.perf_counter()
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
                times.append(time.perf_counter() - t0)
                if done.returncode != 0:
                    sys.stderr.write(f"{name}: exit {done.returncode}: {done.stderr.strip()}\n")
                    return 1
        rows.append((name, statistics.median(times), min(times), max(times), target_s))
    header = f"{'case':<12} {'median_s':>9} {'min_s':>7} {'max_s':>7} {'target_s':>9}  ok"
    sys.stdout.write(header + "\n" + "-" * len(header) + "\n")
    for name, med, lo, hi, target in rows:
        ok = "yes" if med <= target else "NO"
        sys.stdout.write(f"{name:<12} {med:>9.2f} {lo:>7.2f} {hi:>7.2f} {target:>9.1f}  {ok}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
