"""Two hosts x 8 GPUs over 100 GbE beside one host x 8 GPUs over NVLink: what the plan predicts.

    python -m benchmarks.hosts [--models bert_base,gpt2_small] [--time-limit S]

Each zoo model is traced once and costed on two topologies: ``1x8 nvlink`` (8 H100s, NVLink 4
between every pair) and ``2x8 eth100g`` (``examples/topologies/two_hosts.json``: two hosts of 8
H100s, NVLink within a host, 100 GbE between the hosts, all traffic between the hosts sharing one
channel). Each solver places it; the table gives the pipelined time per batch
(:func:`partitioner.solvers.ilp.throughput_objective_s`, shared host channel included), the
simulated 1F1B step (M = the batch size, at most 4 x devices; per-channel transfer queues), the
bytes that cross between hosts, and the fullest device's memory. Every figure is *predicted*
(roofline costs, simulator), nothing measured: a planned row, beside the measured two-process rows
of ``benchmarks.cluster_pipeline``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.zoo import trace_zoo_model, zoo_model
from cost_models.devices.topology import load_topology, topology_summary
from cost_models.estimate.costs import cost_graph
from partitioner.core.errors import PartitionError
from partitioner.core.ir import CostedGraph, Schedule, Topology
from partitioner.simulation.pipeline import simulate_pipeline
from partitioner.solvers import get_solver
from partitioner.solvers.ilp import throughput_objective_s
from partitioner.solvers.stages import make_acyclic

REPO = Path(__file__).resolve().parents[1]
TWO_HOSTS = REPO / "examples" / "topologies" / "two_hosts.json"
SOLVERS = ("auto", "metis", "dp", "even")
MODELS = ("bert_base", "gpt2_small")


def _topologies() -> tuple[tuple[str, Topology], ...]:
    return (
        ("1x8 nvlink", load_topology("nvlink", device_type="h100", num_devices=8)),
        ("2x8 eth100g", load_topology(str(TWO_HOSTS))),
    )


def _cross_host_bytes(costed: CostedGraph, assignment: Sequence[int]) -> int:
    problem = costed.problem()
    hosts = [costed.topology.devices[d].host for d in assignment]
    return sum(nbytes for a, b, nbytes in problem.edges if hosts[a] != hosts[b])


def rows(model: str, time_limit_s: float) -> list[list[str]]:
    traced = trace_zoo_model(zoo_model(model))
    out = []
    for label, topology in _topologies():
        costed = cost_graph(traced.graph, topology=topology)
        problem = costed.problem()
        m = min(traced.graph.batch_size, 4 * topology.num_devices)
        for name in SOLVERS:
            t0 = time.perf_counter()
            try:
                result = get_solver(name, seed=0, time_limit_s=time_limit_s).solve(problem)
            except PartitionError as exc:
                out.append([model, label, name, "-", "-", "-", "-", type(exc).__name__])
                continue
            solve_s = time.perf_counter() - t0
            staged = make_acyclic(result.assignment, problem)
            try:
                sim = simulate_pipeline(
                    costed, staged, schedule=Schedule.ONE_F_ONE_B, num_microbatches=m
                )
                one_f_one_b = f"{sim.step_time_s * 1e3:.3f}"
                memory = max(
                    p / d.memory_bytes
                    for p, d in zip(sim.peak_memory_bytes, topology.devices, strict=True)
                )
            except PartitionError:
                one_f_one_b, memory = "-", float("nan")
            out.append(
                [
                    model,
                    label,
                    name,
                    f"{throughput_objective_s(problem, result.assignment) * 1e3:.3f}",
                    f"{one_f_one_b} (M={m})",
                    f"{_cross_host_bytes(costed, result.assignment) / 2**20:.1f}",
                    f"{memory:.3f}",
                    f"{solve_s:.2f}",
                ]
            )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hosts", description=__doc__)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated zoo models")
    parser.add_argument("--time-limit", type=float, default=5.0, help="solver time limit, s")
    args = parser.parse_args(argv)
    header = [
        "model",
        "topology",
        "solver",
        "pipelined ms",
        "1F1B step ms",
        "cross-host MiB",
        "mem/limit",
        "solve s",
    ]
    table = [header]
    for model in args.models.split(","):
        table.extend(rows(model.strip(), args.time_limit))
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for name, topology in _topologies():
        sys.stdout.write(f"{name}: {topology_summary(topology)}\n")
    for k, r in enumerate(table):
        sys.stdout.write(
            "  ".join(
                c.rjust(w) if i > 2 else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
            + "\n"
        )
        if k == 0:
            sys.stdout.write("  ".join("-" * w for w in widths) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
