"""Planning time: a plan in seconds, cold and warm, against the time to import TensorFlow.

Each case is planned by the ``partition`` command, as a user runs it, in a fresh process, three
times: **cold** (an empty cache directory: every trace is made), **again** (the same command,
with the trace cache the cold run filled, ``passes/trace_cache.py``) and **warm** (the same model
at another ``--gpus``: its strategy search may trace batches the first runs did not). For each
run: the wall time, the peak resident memory of the process (its ``ru_maxrss``), the plan's own
phases (``phase_times_s``), and the wall time over the time ``python -c "import tensorflow"``
takes in a fresh process, timed in the same run before the cases (the median of three): this
machine's speed drifts by tens of percent between hours, the ratio much less.

Targets (issue 35): ResNet-50 b32 on 2 devices cold <= 2.0x, warm <= 0.8x; InceptionV3 b32 on 8
devices cold <= 3.0x; Llama-7B on 8 x a100-80gb within 120 s and 8 GB (issue 20).

    python -m benchmarks.planning_time [--cases resnet50 inception_v3 gpt2_small llama_7b]
        [--json benchmarks/results/planning_time.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner.core.files import write_atomic

REPO = Path(__file__).resolve().parent.parent
README_COMMAND = "python -m benchmarks.planning_time"


@dataclass(frozen=True)
class Case:
    """One model planned cold (``argv``) then warm (``warm_argv``: another device count)."""

    name: str
    model: str
    argv: tuple[str, ...]
    warm_argv: tuple[str, ...]
    cold_ratio_target: float | None = None
    warm_ratio_target: float | None = None
    wall_target_s: float | None = None
    memory_target_bytes: int | None = None


_A100 = ("--device-type", "a100-80gb", "--topology", "nvlink", "--batch-size", "8")
CASES = (
    Case("resnet50", "examples/resnet50.py", ("--gpus", "2", "--batch-size", "32"),
         ("--gpus", "4", "--batch-size", "32"), cold_ratio_target=2.0, warm_ratio_target=0.8),
    Case("inception_v3", "benchmarks/zoo.py:inception_v3", ("--gpus", "8", "--batch-size", "32"),
         ("--gpus", "4", "--batch-size", "32"), cold_ratio_target=3.0),
    Case("gpt2_small", "examples/decoder.py:gpt_125m", ("--gpus", "8", "--batch-size", "8"),
         ("--gpus", "4", "--batch-size", "8")),
    Case("llama_7b", "examples/decoder.py:llama_7b", ("--gpus", "8", *_A100),
         ("--gpus", "16", *_A100), wall_target_s=120.0, memory_target_bytes=8 * 10**9),
)  # fmt: skip
"""The cases of issue 35, in its order."""


def _timed(
    argv: list[str], env: dict[str, str]
) -> tuple[float, int, subprocess.CompletedProcess[str]]:
    """Run ``argv`` in a fresh process: its wall time, peak resident bytes (the kernel's account
    of that one child, ``wait4``) and result."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(argv, proc.returncode, out.read(), err.read())
    return wall, int(usage.ru_maxrss) * 1024, done


def import_tensorflow_s(repeats: int = 3) -> float:
    """The median wall time of ``python -c "import tensorflow"`` in a fresh process."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import tensorflow"], check=True, capture_output=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _plan_run(case: Case, mode: str, cache: Path, reference_s: float) -> dict[str, Any]:
    argv = case.warm_argv if mode == "warm" else case.argv
    env = {**os.environ, "PARTITIONER_CACHE_DIR": str(cache), "TF_CPP_MIN_LOG_LEVEL": "3"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        command = [sys.executable, "-m", "partitioner", case.model, *argv, "--out", str(out)]
        wall, peak, done = _timed(command, env)
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            return {"case": case.name, "mode": mode, "argv": argv, "error": tail[0]}
        plan = json.loads(out.read_text(encoding="utf-8"))
    return {
        "case": case.name,
        "mode": mode,
        "argv": list(argv),
        "wall_s": wall,
        "ratio": wall / reference_s,
        "peak_rss_bytes": peak,
        "phases_s": plan.get("phase_times_s", {}),
        "strategy": (plan.get("strategy") or {}).get("description") or plan["solver"]["name"],
        "step_time_s": plan["predicted"]["step_time_s"],
    }


def _verdicts(case: Case, row: dict[str, Any]) -> list[str]:
    checks: list[tuple[str, float | None, float]] = []
    target = {"cold": case.cold_ratio_target, "warm": case.warm_ratio_target}.get(row["mode"])
    checks.append((f"<= {target}x", target, row["ratio"]))
    checks.append(
        (
            f"<= {case.wall_target_s:.0f} s" if case.wall_target_s else "",
            case.wall_target_s,
            row["wall_s"],
        )
    )
    memory = case.memory_target_bytes
    checks.append((f"<= {memory / 1e9:.0f} GB" if memory else "", memory, row["peak_rss_bytes"]))
    return [f"{label}: {'met' if value <= limit else 'NOT met'}"
            for label, limit, value in checks if limit is not None]  # fmt: skip


def run(cases: list[Case]) -> dict[str, Any]:
    """Every case cold then warm, in fresh processes; the JSON document."""
    reference = import_tensorflow_s()
    rows = []
    for case in cases:
        with tempfile.TemporaryDirectory() as cache:
            for mode in ("cold", "again", "warm"):
                row = _plan_run(case, mode, Path(cache), reference)
                if "error" not in row:
                    row["verdicts"] = _verdicts(case, row)
                rows.append(row)
                sys.stderr.write(f"{case.name} {mode}: {row.get('wall_s', 0):.1f} s\n")
    return {
        "command": README_COMMAND,
        "git": _git_rev(),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPUs, {platform.machine()}, Python {platform.python_version()}",
        "import_tensorflow_s": reference,
        "runs": rows,
    }


def _git_rev() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def table(doc: dict[str, Any]) -> str:
    """The results as a Markdown table (the README's, pasted by ``benchmarks.readme``)."""
    lines = [
        "| model | run | wall | / import tensorflow | peak memory | trace | solve | strategies "
        "| target |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in doc["runs"]:
        if "error" in row:
            lines.append(
                f"| `{row['case']}` | {row['mode']} | failed: {row['error'][:80]} | | | | | |"
            )
            continue
        phases = row["phases_s"]
        traced = (
            phases.get("trace", 0.0) + phases.get("flops", 0.0) + phases.get("trace cache", 0.0)
        )
        lines.append(
            f"| `{row['case']}` | {row['mode']} `{' '.join(row['argv'])}` | {row['wall_s']:.1f} s "
            f"| {row['ratio']:.2f}x | {row['peak_rss_bytes'] / 2**30:.2f} GiB | {traced:.1f} s "
            f"| {phases.get('solve', 0.0):.1f} s | {phases.get('strategies', 0.0):.1f} s "
            f"| {'; '.join(row['verdicts']) or '-'} |"
        )
    lines.append("")
    lines.append(
        f"`{doc['command']}` (git {doc['git']}, {doc['date']}, {doc['machine']}): each run a fresh "
        "`partition` process; cold with an empty cache directory, again the same command after "
        "it, warm the same model at another `--gpus` after those; `import tensorflow` took "
        f"{doc['import_tensorflow_s']:.2f} s here "
        "(median of 3, same run). `trace` is tracing and FLOP counting, or reading the trace cache; "
        "`solve` is the solver's (`auto`'s CP-SAT runs to its 5 s default time limit where it "
        "proves no optimum); the rest of the wall is importing TensorFlow and building the model."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    names = [c.name for c in CASES]
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", nargs="+", default=names, choices=names)
    parser.add_argument(
        "--json", default=str(REPO / "benchmarks" / "results" / "planning_time.json")
    )
    args = parser.parse_args(argv)
    doc = run([c for c in CASES if c.name in args.cases])
    write_atomic(args.json, json.dumps(doc, indent=1) + "\n")
    sys.stdout.write(table(doc) + "\n")
    return 0 if all("error" not in r for r in doc["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
