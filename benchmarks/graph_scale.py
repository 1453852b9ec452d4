"""Large graphs stay fast: bounds, solvers and simulators on a ~100k-op graph and 64 devices.

The graph is a synthetic op-level training step of a transformer-like stack (pre-LN blocks of
four layers -- layer norm, attention, layer norm, MLP -- between an embedding and a head with
the loss): every forward op of a layer reads its predecessors and the layer's weights, the block
input is read again by each residual add, and every forward op has its gradient op (reading the
gradients of its consumers, summed by an ``AddN`` where there are several, and the activations
it saved), every matmul a weight-gradient op, and every weight an optimizer update. Op times
follow a roofline of an A100 with +-30% jitter; tensor bytes follow the shapes. The topology is
``num_devices`` A100 80 GB, 8 per host over NVLink, hosts over InfiniBand.

Each phase is timed on its own (wall seconds, and the process's peak RSS during the phase):
the layer-level view and the problem (built once, as every caller's first call does), the lower
bounds, every fast solver of the registry, ``auto`` (``--auto-time-limit``), the ILP alone
(``--ilp-time-limit``: it cannot scale to thousands of layers x 64 devices and says how it fell
back), the plain step simulation (``evaluate``) and the pipeline simulation
(``evaluate_pipeline``, ``--microbatches``) of the best split, and the strategy search of
:mod:`partitioner.planner.search` (``--search-time-limit``; ``--no-search`` skips it). The target
of issue 20: solve + simulate <= 60 s for 100k ops on 64 devices.

    python -m benchmarks.graph_scale [--ops 100000] [--devices 64] [--microbatches 32]
        [--auto-time-limit 10] [--ilp-time-limit 10] [--search-time-limit 20] [--no-search]
        [--seed 0] [--json benchmarks/results/graph_scale.json]

:func:`run` returns the rows (for ``benchmarks.scale``).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from cost_models.devices.topology import parse_topology
from partitioner.core.errors import PartitionError
from partitioner.core.files import write_atomic
from partitioner.core.ir import (
    CostedGraph,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Op,
    PartitionProblem,
    Phase,
    Schedule,
    SolverResult,
    Topology,
)
from partitioner.planner.search import StrategyOptions, search_batches, search_strategies
from partitioner.simulation.bounds import costed_lower_bounds
from partitioner.simulation.evaluate import evaluate, evaluate_pipeline
from partitioner.solvers import fast_solver_names, get_solver
from partitioner.solvers.stages import make_acyclic

_T = TypeVar("_T")

TARGET_S = 60.0
"""Issue 20's target for solve + simulate on 100k ops and 64 devices."""

HIDDEN = 1024
SEQ_LEN = 32
BATCH = 64
_PEAK_FLOPS = 156e12 * 0.6
_MEMORY_BYTES_PER_S = 2.0e12 * 0.7
_LAUNCH_S = 5e-6


# -- the synthetic graph -----------------------------------------------------------------------

_Template = tuple[tuple[str, float, float, tuple[str, ...]], ...]
"""Per forward op: its type, FLOPs per token / hidden^2, output bytes per token / hidden, and its
inputs: ``"in"`` (the layer's input), ``"res"`` (the block input), ``"w"`` (a new weight read),
or the index of an earlier op of the layer."""

_LN: _Template = (
    ("Mean", 0.0, 1 / HIDDEN, ("in",)),
    ("Sub", 0.0, 1.0, ("in", "0")),
    ("Square", 0.0, 1.0, ("1",)),
    ("Mean", 0.0, 1 / HIDDEN, ("2",)),
    ("Rsqrt", 0.0, 1 / HIDDEN, ("3",)),
    ("Mul", 0.0, 1.0, ("1", "4")),
    ("Mul", 0.0, 1.0, ("5", "w")),
    ("AddV2", 0.0, 1.0, ("6", "w")),
)
_ATTENTION: _Template = (
    ("MatMul", 2.0, 1.0, ("in", "w")),
    ("MatMul", 2.0, 1.0, ("in", "w")),
    ("MatMul", 2.0, 1.0, ("in", "w")),
    ("Reshape", 0.0, 1.0, ("0",)),
    ("Reshape", 0.0, 1.0, ("1",)),
    ("Reshape", 0.0, 1.0, ("2",)),
    ("Transpose", 0.0, 1.0, ("3",)),
    ("Transpose", 0.0, 1.0, ("4",)),
    ("BatchMatMul", 2.0 * SEQ_LEN / HIDDEN, SEQ_LEN / HIDDEN * 16, ("6", "7")),
    ("Mul", 0.0, SEQ_LEN / HIDDEN * 16, ("8",)),
    ("Softmax", 0.0, SEQ_LEN / HIDDEN * 16, ("9",)),
    ("BatchMatMul", 2.0 * SEQ_LEN / HIDDEN, 1.0, ("10", "5")),
    ("Transpose", 0.0, 1.0, ("11",)),
    ("Reshape", 0.0, 1.0, ("12",)),
    ("MatMul", 2.0, 1.0, ("13", "w")),
    ("AddV2", 0.0, 1.0, ("14", "res")),
)
_MLP: _Template = (
    ("MatMul", 8.0, 4.0, ("in", "w")),
    ("BiasAdd", 0.0, 4.0, ("0", "w")),
    ("Mul", 0.0, 4.0, ("1",)),
    ("Tanh", 0.0, 4.0, ("2",)),
    ("AddV2", 0.0, 4.0, ("3",)),
    ("Mul", 0.0, 4.0, ("1", "4")),
    ("MatMul", 8.0, 1.0, ("5", "w")),
    ("BiasAdd", 0.0, 1.0, ("6", "w")),
    ("AddV2", 0.0, 1.0, ("7", "res")),
)
_EMBED: _Template = (("GatherV2", 0.0, 1.0, ("w", "in")), ("Mul", 0.0, 1.0, ("0",)))
_HEAD: _Template = (*_LN, ("MatMul", 2.0, 1.0, ("7", "w")))
_BLOCK = (("ln1", _LN), ("attention", _ATTENTION), ("ln2", _LN), ("mlp", _MLP))
_WEIGHT_ELEMENTS = {"MatMul": HIDDEN * HIDDEN, "GatherV2": 32000 * HIDDEN}
"""Weight elements read by an op type (others: a vector of ``HIDDEN``); the MLP's are 4x."""


@dataclass(frozen=True)
class _Forward:
    """A forward op, as its gradient needs it."""

    id: str
    layer: str | None
    inputs: tuple[str, ...]
    """Its activation inputs (weights and fed placeholders included: the gradient reads them)."""
    weights: tuple[str, ...]
    output_bytes: int
    matmul: bool


@dataclass
class _Builder:
    """The ops, edges and op times of the step: forward in layer order, backward in reverse."""

    batch: int
    rng: random.Random
    ops: list[Op] = field(default_factory=list)
    edges: list[Edge] = field(default_factory=list)
    layers: list[LayerInfo] = field(default_factory=list)
    times_s: list[float] = field(default_factory=list)
    forward: list[_Forward] = field(default_factory=list)
    consumers: dict[str, list[str]] = field(default_factory=dict)
    out_bytes: dict[str, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return self.batch * SEQ_LEN

    def add(self, op: Op, inputs: tuple[str, ...], extra_bytes: int = 0) -> None:
        """Append ``op`` reading ``inputs`` (whole tensors), timed by the roofline."""
        self.ops.append(op)
        moved = extra_bytes + op.output_bytes
        for src in inputs:
            nbytes = self.out_bytes[src]
            self.edges.append(Edge(src, op.id, nbytes))
            moved += nbytes
        self.out_bytes[op.id] = op.output_bytes
        t = max(op.flops / _PEAK_FLOPS, moved / _MEMORY_BYTES_PER_S) + _LAUNCH_S
        self.times_s.append(t * self.rng.uniform(0.7, 1.3))

    def forward_layer(self, name: str, template: _Template, x: str, res: str) -> str:
        """A layer's weight reads and forward ops; the id of its output op."""
        widen = 4 if name.endswith("mlp") else 1
        params = 0
        local: list[str] = []
        for j, (op_type, flops_per, bytes_per, inputs) in enumerate(template):
            srcs: list[str] = []
            weights: list[str] = []
            for src in inputs:
                if src == "w":
                    elements = _WEIGHT_ELEMENTS.get(op_type, HIDDEN) * widen
                    params += elements
                    wid = f"{name}/{j}/w{len(weights)}"
                    self.add(
                        Op(wid, "ReadVariableOp", name, Phase.FORWARD, output_bytes=4 * elements),
                        (),
                    )
                    weights.append(wid)
                    srcs.append(wid)
                else:
                    srcs.append({"in": x, "res": res}.get(src) or local[int(src)])
            oid = f"{name}/{j}"
            nbytes = max(
                4, int(bytes_per * HIDDEN * self.tokens * 4 * (widen if bytes_per > 1 else 1))
            )
            flops = int(flops_per * HIDDEN * HIDDEN * self.tokens)
            self.add(
                Op(oid, op_type, name, Phase.FORWARD, output_bytes=nbytes, flops=flops), tuple(srcs)
            )
            self._record(
                _Forward(oid, name, tuple(srcs), tuple(weights), nbytes, "MatMul" in op_type)
            )
            local.append(oid)
        kind = name.rsplit("/", 1)[-1]
        self.layers.append(LayerInfo(name, kind, params, params, 4 * params, 4 * params))
        return local[-1]

    def _record(self, f: _Forward) -> None:
        self.forward.append(f)
        for src in f.inputs:
            self.consumers.setdefault(src, []).append(f.id)

    def backward(self) -> None:
        """Every forward op's gradient after its consumers' (summed by an ``AddN`` when there
        are several), reading the activations it saved; each weight's gradient and update."""
        grad_of: dict[str, str] = {}
        for f in reversed(self.forward):
            readers = [grad_of[c] for c in self.consumers.get(f.id, ()) if c in grad_of]
            upstream: tuple[str, ...] = tuple(readers[:1])
            if len(readers) > 1:
                self.add(
                    Op(f"{f.id}/sum", "AddN", f.layer, Phase.BACKWARD, output_bytes=f.output_bytes),
                    tuple(readers),
                )
                upstream = (f"{f.id}/sum",)
            gid = f"{f.id}/grad"
            flops = 2 * HIDDEN * HIDDEN * self.tokens if f.matmul else 0
            op = Op(gid, "Grad", f.layer, Phase.BACKWARD, output_bytes=f.output_bytes, flops=flops)
            self.add(op, upstream + f.inputs)
            grad_of[f.id] = gid
            for w in f.weights:
                gw = f"{w}/grad"
                wbytes = self.out_bytes[w]
                self.add(
                    Op(gw, "MatMul", f.layer, Phase.BACKWARD, output_bytes=wbytes, flops=flops),
                    upstream + f.inputs,
                )
                self.add(
                    Op(f"{w}/apply", "ResourceApplyAdam", f.layer, Phase.BACKWARD),
                    (gw, w),
                    3 * wbytes,
                )


def blocks_for(num_ops: int) -> int:
    """The number of blocks whose step has about ``num_ops`` ops (at least 1)."""
    one, two = (len(build_graph(k, 1, 0)[0].ops) for k in (1, 2))
    return max(1, round((num_ops - (2 * one - two)) / (two - one)))


def build_graph(num_blocks: int, batch: int, seed: int) -> tuple[Graph, tuple[float, ...]]:
    """The training step of ``num_blocks`` blocks at ``batch``, and each op's time (seconds)."""
    b = _Builder(batch=batch, rng=random.Random(seed))
    tokens = b.tokens
    b.add(Op("input_ids", "Placeholder", None, Phase.FORWARD, output_bytes=4 * tokens), ())
    b.add(Op("labels", "Placeholder", None, Phase.FORWARD, output_bytes=4 * tokens), ())
    x = b.forward_layer("embed", _EMBED, "input_ids", "input_ids")
    for k in range(num_blocks):
        res = x
        for part, template in _BLOCK:
            x = b.forward_layer(f"block{k}/{part}", template, x, res)
            res = x if part in ("attention", "mlp") else res
    logits = b.forward_layer("head", _HEAD, x, x)
    loss = Op("loss", "SparseSoftmaxCrossEntropyWithLogits", None, Phase.FORWARD, output_bytes=4)
    b.add(loss, (logits, "labels"))
    b._record(_Forward("loss", None, (logits, "labels"), (), 4, False))
    b.backward()
    graph = Graph("transformer-like", tuple(b.ops), tuple(b.edges), tuple(b.layers), batch)
    return graph, tuple(b.times_s)


def make_topology(num_devices: int) -> Topology:
    """``num_devices`` A100 80 GB, 8 per host over NVLink, hosts joined by InfiniBand."""
    per_host = min(8, num_devices)
    hosts = [
        {
            "count": num_devices // per_host,
            "link": "nvlink",
            "devices": [{"type": "a100-80gb", "count": per_host}],
        }
    ]
    if num_devices % per_host:
        hosts.append(
            {"link": "nvlink", "devices": [{"type": "a100-80gb", "count": num_devices % per_host}]}
        )
    return parse_topology({"inter_host_link": "infiniband", "hosts": hosts}, origin="graph_scale")


def make_costed(
    num_blocks: int, topology: Topology, *, batch: int = BATCH, seed: int = 0
) -> CostedGraph:
    """The step of ``num_blocks`` blocks costed on ``topology`` (identical devices: one row of
    times shared by all); memory from the graph's layer view (Adam: two slots per weight)."""
    graph, times = build_graph(num_blocks, batch, seed)
    memory = tuple(
        LayerMemory(
            node.name,
            node.param_bytes,
            node.param_bytes,
            2 * node.param_bytes,
            node.activation_bytes,
            node.gradient_partial_bytes,
        )
        for node in graph.layer_graph.nodes
    )
    return CostedGraph(graph, topology, (times,) * topology.num_devices, memory)


# -- timing ------------------------------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); whether it could."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    """The process's peak RSS since the last reset (``VmHWM``), else since it started."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class Row:
    """One timed phase."""

    phase: str
    wall_s: float
    peak_rss_bytes: int
    counts: bool
    """Whether the phase is part of "solve + simulate" (the target)."""
    note: str = ""


def _timed(
    rows: list[Row], phase: str, call: Callable[[], _T], *, counts: bool = True
) -> _T | None:
    """Run ``call`` as one phase; a PartitionError is the phase's note, not a crash."""
    reset_peak_rss()
    t0 = time.perf_counter()
    note = ""
    out: _T | None
    try:
        out = call()
    except PartitionError as exc:
        out, note = None, f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - t0
    rows.append(Row(phase, wall, peak_rss_bytes(), counts, note))
    sys.stderr.write(f"  {phase}: {wall:.2f} s {note[:100]}\n")
    return out


def _solve_phases(
    rows: list[Row], problem: PartitionProblem, args: Settings
) -> SolverResult | None:
    """Every fast solver, then ``auto``, then the ILP alone; ``auto``'s result."""
    for name in fast_solver_names():
        solver = get_solver(name, seed=args.seed)
        result = _timed(rows, f"solve {name}", partial(solver.solve, problem))
        if result is not None and result.notes:
            rows[-1].note = "; ".join(result.notes)[:200]
    auto = get_solver("auto", seed=args.seed, time_limit_s=args.auto_time_limit_s)
    best = _timed(
        rows, f"solve auto (time_limit_s={args.auto_time_limit_s:g})", lambda: auto.solve(problem)
    )
    if best is not None:
        rows[-1].note = "; ".join(n for n in best.notes if n.startswith(("ilp", "chose")))
    ilp = get_solver("ilp", seed=args.seed, time_limit_s=args.ilp_time_limit_s)
    found = _timed(
        rows,
        f"solve ilp (time_limit_s={args.ilp_time_limit_s:g})",
        lambda: ilp.solve(problem),
        counts=False,
    )
    if found is not None:
        rows[-1].note = "; ".join(found.notes)[:200]
    return best


def _simulate_phases(
    rows: list[Row], costed: CostedGraph, assignment: tuple[int, ...], args: Settings
) -> None:
    """The plain step of ``assignment`` and the pipeline of its acyclic stages."""
    problem = costed.problem()
    step = _timed(rows, "simulate step (evaluate)", lambda: evaluate(costed, assignment))
    if step is not None:
        rows[-1].note = f"step {step.step_time_s * 1e3:.1f} ms"
    stages = make_acyclic(assignment, problem)
    m = args.microbatches
    piped = _timed(
        rows,
        f"simulate pipeline (1F1B, M={m})",
        lambda: evaluate_pipeline(
            costed, stages, schedule=Schedule.ONE_F_ONE_B, num_microbatches=m
        ),
    )
    if piped is not None:
        rows[-1].note = f"step {piped.step_time_s * 1e3:.1f} ms, {len(set(stages))} stages"


def _search_phase(rows: list[Row], costed: CostedGraph, blocks: int, args: Settings) -> None:
    """The strategy search, the model costed at every batch it asks for (not timed: that is
    the cost model's work, the graph here is synthetic)."""
    options = StrategyOptions(time_limit_s=args.search_time_limit_s, seed=args.seed)
    batch = costed.graph.batch_size
    wanted = search_batches(costed.topology.num_devices, batch, options)
    graphs = {batch: costed}
    t0 = time.perf_counter()
    for b in wanted:
        if b not in graphs:
            graphs[b] = make_costed(blocks, costed.topology, batch=b, seed=args.seed)
    sys.stderr.write(f"  costed at batches {wanted}: {time.perf_counter() - t0:.1f} s\n")
    found = _timed(
        rows,
        f"strategy search (time_limit_s={args.search_time_limit_s:g})",
        lambda: search_strategies(graphs.__getitem__, batch, options),
        counts=False,
    )
    if found is not None:
        skipped = [n for n in found.notes if "a lower bound on each step" in n or "past the" in n]
        rows[-1].note = "; ".join(
            [
                f"{len(found.candidates)} candidates simulated, best "
                f"{found.best.strategy.describe()} {found.best.step_time_s * 1e3:.1f} ms",
                *skipped,
            ]
        )


@dataclass(frozen=True)
class Settings:
    """What :func:`run` times."""

    microbatches: int = 32
    auto_time_limit_s: float = 10.0
    ilp_time_limit_s: float = 10.0
    search_time_limit_s: float = 20.0
    search: bool = True
    seed: int = 0


def run(num_ops: int, num_devices: int, settings: Settings | None = None) -> dict[str, Any]:
    """Time every phase on a graph of about ``num_ops`` ops and ``num_devices`` devices; the
    graph's size, the rows, and the total of the phases that count (solve + simulate)."""
    args = settings or Settings()
    topology = make_topology(num_devices)
    blocks = blocks_for(num_ops)
    rows: list[Row] = []
    built = _timed(
        rows,
        "build graph (synthetic)",
        lambda: make_costed(blocks, topology, seed=args.seed),
        counts=False,
    )
    if built is None:
        raise PartitionError("the synthetic graph could not be built")
    costed = built
    _timed(rows, "layer view + problem", costed.problem)
    problem = costed.problem()
    _timed(rows, "lower bounds", lambda: costed_lower_bounds(costed))
    best = _solve_phases(rows, problem, args)
    if best is not None:
        _simulate_phases(rows, costed, best.assignment, args)
    if args.search:
        _search_phase(rows, costed, blocks, args)
    total = sum(r.wall_s for r in rows if r.counts)
    return {
        "ops": len(costed.graph.ops),
        "edges": len(costed.graph.edges),
        "layers": problem.num_layers,
        "layer_edges": len(problem.edges),
        "devices": num_devices,
        "hosts": topology.num_hosts,
        "rows": [asdict(r) for r in rows],
        "solve_and_simulate_s": total,
        "target_s": TARGET_S,
        "met": total <= TARGET_S,
    }


def format_table(result: dict[str, Any]) -> str:
    """The rows as a text table, then the total against the target."""
    lines = [
        f"graph: {result['ops']} ops, {result['edges']} edges, {result['layers']} layers "
        f"({result['layer_edges']} layer edges); {result['devices']} devices on "
        f"{result['hosts']} hosts",
        f"{'phase':<40}{'wall s':>9}{'peak RSS':>11}  note",
    ]
    lines.append("-" * 80)
    for r in result["rows"]:
        mark = "" if r["counts"] else " *"
        lines.append(
            f"{r['phase'] + mark:<40}{r['wall_s']:>9.2f}"
            f"{r['peak_rss_bytes'] / 2**30:>9.2f} GiB  {r['note'][:110]}"
        )
    lines.append("-" * 80)
    verdict = "met" if result["met"] else "NOT met"
    lines.append(
        f"solve + simulate: {result['solve_and_simulate_s']:.1f} s (target <= "
        f"{result['target_s']:.0f} s: {verdict}); * not counted"
    )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=32)
    parser.add_argument("--auto-time-limit", type=float, default=10.0)
    parser.add_argument("--ilp-time-limit", type=float, default=10.0)
    parser.add_argument("--search-time-limit", type=float, default=20.0)
    parser.add_argument("--no-search", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="benchmarks/results/graph_scale.json")
    args = parser.parse_args()
    settings = Settings(
        microbatches=args.microbatches,
        auto_time_limit_s=args.auto_time_limit,
        ilp_time_limit_s=args.ilp_time_limit,
        search_time_limit_s=args.search_time_limit,
        search=not args.no_search,
        seed=args.seed,
    )
    result = run(args.ops, args.devices, settings)
    sys.stdout.write(format_table(result))
    if args.json:
        write_atomic(args.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
