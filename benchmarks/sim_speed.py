"""Wall time of the step simulators on a random op graph of a training step (pure Python, no TF).

The graph has ``--ops`` ops: half forward, in ``--layers`` layers of consecutive ops, each
forward op fed by its predecessor and by a random earlier op within 200 positions; the other half
their backward ops in reverse, each edge ``u -> v`` mirrored as a gradient ``g(v) -> g(u)`` plus
the saved activation ``u -> g(v)``. Layers are placed in contiguous blocks on ``--devices``
identical devices (a pipeline). Each row is the best of ``--repeat`` runs, in seconds: ``cold``
on a freshly built graph (so it includes building the cached layer-level view), ``warm`` on the
same graph again.

    python -m benchmarks.sim_speed [--ops 10000] [--layers 200] [--devices 4]
                                   [--microbatches 8] [--repeat 5] [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    Schedule,
    Topology,
)
from partitioner.simulation.pipeline import pipeline_stages, simulate_pipeline
from partitioner.simulation.step import simulate_step


def make_costed(n_ops: int, n_layers: int, n_dev: int, seed: int) -> CostedGraph:
    rng = random.Random(seed)
    n_fwd = n_ops // 2
    layers = [f"layer{k}" for k in range(n_layers)]

    def layer_of(i: int) -> str:
        return layers[i * n_layers // n_fwd]

    fwd = [Op(f"f{i}", "MatMul", layer_of(i), Phase.FORWARD) for i in range(n_fwd)]
    bwd = [Op(f"g{i}", "MatMul", layer_of(i), Phase.BACKWARD) for i in reversed(range(n_fwd))]
    edges: list[Edge] = []
    for v in range(1, n_fwd):
        sources = {v - 1, rng.randrange(max(0, v - 200), v)}
        for u in sorted(sources):
            nbytes = rng.choice((4096, 1 << 16, 1 << 20))
            edges.append(Edge(f"f{u}", f"f{v}", nbytes))
            edges.append(Edge(f"g{v}", f"g{u}", nbytes))
            edges.append(Edge(f"f{u}", f"g{v}", nbytes))
    graph = Graph(
        "random", tuple(fwd + bwd), tuple(edges), tuple(LayerInfo(x, "Dense") for x in layers), 64
    )
    times = tuple(rng.random() * 1e-4 for _ in graph.ops)
    topo = Topology(
        tuple(Device(d, "h100", 80 << 30) for d in range(n_dev)), Link("nvlink", 1e-5, 4.5e11)
    )
    memory = tuple(LayerMemory(x, 1 << 20, 1 << 20, 2 << 20, 4 << 20) for x in layers)
    return CostedGraph(graph, topo, (times,) * n_dev, memory)


def best_of(
    repeat: int, build: Callable[[], CostedGraph], call: Callable[[CostedGraph], object]
) -> tuple[float, float]:
    cold = warm = float("inf")
    for _ in range(repeat):
        costed = build()
        t0 = time.perf_counter()
        call(costed)
        t1 = time.perf_counter()
        call(costed)
        t2 = time.perf_counter()
        cold, warm = min(cold, t1 - t0), min(warm, t2 - t1)
    return cold, warm


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    def build() -> CostedGraph:
        return make_costed(args.ops, args.layers, args.devices, args.seed)

    sample = build()
    n_dev, m = args.devices, args.microbatches
    placement = tuple(k * n_dev // args.layers for k in range(args.layers))
    cases: list[tuple[str, Callable[[CostedGraph], object]]] = [
        ("simulate_step", lambda c: simulate_step(c, placement)),
        ("simulate_step timeline", lambda c: simulate_step(c, placement, timeline=True)),
        ("pipeline_stages", lambda c: pipeline_stages(c, placement)),
        (
            f"simulate_pipeline gpipe M={m}",
            lambda c: simulate_pipeline(c, placement, schedule=Schedule.GPIPE, num_microbatches=m),
        ),
        (
            f"simulate_pipeline 1f1b M={m}",
            lambda c: simulate_pipeline(
                c, placement, schedule=Schedule.ONE_F_ONE_B, num_microbatches=m
            ),
        ),
    ]
    out = sys.stdout
    out.write(
        f"graph: {len(sample.graph.ops)} ops, {len(sample.graph.edges)} edges, "
        f"{args.layers} layers, {n_dev} devices; best of {args.repeat}\n"
    )
    header = f"{'function':<32}{'cold s':>10}{'warm s':>10}"
    out.write(header + "\n" + "-" * len(header) + "\n")
    for name, call in cases:
        cold, warm = best_of(args.repeat, build, call)
        out.write(f"{name:<32}{cold:>10.4f}{warm:>10.4f}\n")
    gpipe = simulate_pipeline(sample, placement, schedule=Schedule.GPIPE, num_microbatches=m)
    one = simulate_pipeline(sample, placement, schedule=Schedule.ONE_F_ONE_B, num_microbatches=m)
    plain = simulate_step(sample, placement)
    out.write(
        f"\nstep time: plain {plain.step_time_s * 1e3:.3f} ms; gpipe {gpipe.step_time_s * 1e3:.3f} "
        f"ms (bubble {max(gpipe.bubble_fraction):.1%}); 1f1b {one.step_time_s * 1e3:.3f} ms "
        f"(bubble {max(one.bubble_fraction):.1%})\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
