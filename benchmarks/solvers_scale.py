"""Solve times of every fast solver (and auto) on synthetic 1k / 10k-layer problems.

Two shapes per size: a chain (each layer feeds the next) and a residual chain (plus a skip edge
over every 3 layers). Layer times vary over 13 values, every layer has 1 MiB of memory, the
devices are identical and hold the model easily, the link is NVLink-like. Each cell is the best
of ``--repeat`` runs, in seconds; ``auto`` runs with ``--auto-time-limit``.

    python -m benchmarks.solvers_scale [--layers 1000 10000] [--devices 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import time

from partitioner.core.errors import PartitionError
from partitioner.core.ir import Device, Link, PartitionProblem, Topology
from partitioner.solvers import fast_solver_names, get_solver

SOLVERS = (*fast_solver_names(), "auto")
"""Every registered fast solver, then ``auto`` (``ilp`` alone on 10k layers would only time out)."""


def make_problem(n: int, n_dev: int, residual: bool) -> PartitionProblem:
    times = [1e-4 * (1 + (k * 7919) % 13) for k in range(n)]
    edges = [(k, k + 1, 1 << 20) for k in range(n - 1)]
    if residual:
        edges += [(k, k + 3, 1 << 20) for k in range(0, n - 3, 3)]
    return PartitionProblem(
        layers=tuple(f"l{k}" for k in range(n)),
        compute_time_s=(tuple(times),) * n_dev,
        memory_bytes=(1 << 20,) * n,
        edges=tuple(edges),
        topology=Topology(
            tuple(Device(d, "h100", 80 << 30) for d in range(n_dev)), Link("nvlink", 1e-5, 4.5e11)
        ),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--auto-time-limit", type=float, default=5.0)
    args = parser.parse_args()

    header = f"{'problem':<16}" + "".join(f"{name:>12}" for name in SOLVERS)
    sys.stdout.write(header + "\n" + "-" * len(header) + "\n")
    for n in args.layers:
        for residual in (False, True):
            problem = make_problem(n, args.devices, residual)
            label = f"{n} {'residual' if residual else 'chain'}"
            cells = []
            for name in SOLVERS:
                options = {"time_limit_s": args.auto_time_limit} if name == "auto" else {}
                solver = get_solver(name, **options)
                best = float("inf")
                for _ in range(args.repeat if name != "auto" else 1):
                    t0 = time.perf_counter()
                    try:
                        solver.solve(problem)
                    except PartitionError:
                        best = float("nan")
                        break
                    best = min(best, time.perf_counter() - t0)
                cells.append(f"{best:>12.3f}")
            sys.stdout.write(f"{label:<16}" + "".join(cells) + "\n")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
