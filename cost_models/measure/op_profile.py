"""Per-op profiling: every op's time inside the traced training step, from TensorFlow's profiler.

:mod:`cost_models.measure.profiled` times each layer on its own, as a separate ``tf.function``; that is
what a plan needs for layers that may run on another device, but a layer called alone pays costs
the whole step does not (a function call, a cold cache) and misses some it does (the executor's
work between ops). This module measures the ops where they actually run: the step function that
:func:`passes.trace.trace_model` traced is run ``steps`` times under
``tf.profiler.experimental`` (host tracer only), and the kernel events of its executor threads are
read back from the profile (``*.xplane.pb``, an ``XSpace`` protocol buffer).

Matching events to ops
----------------------
A kernel event is named ``"<node name>:<op type>"``. The node names are the traced graph's op
names, except for nodes grappler made (``.../ArithmeticOptimizer/AddOpsRewrite_...``) and ops it
fused into another (their time appears under the fused node's name, for example a Dense layer's
``MatMul`` + ``BiasAdd`` + ``Relu`` under ``.../Relu``). An event whose node is a traced op is
that op's; an event inside a function a traced op runs (a ``While`` loop's body, a
``PartitionedCall``: the node name starts with that op's name and ``/``) is that op's, the
innermost such op; any other is given to the traced op whose name scope is the longest prefix of
the node name (grappler keeps the scope of the ops it rewrote), in the phase of that op; what
matches no scope is left unattributed and reported. (Giving a loop body's kernels to the first op
of the loop's scope instead put an LSTM's whole recurrence on an op that has none of the loop's
inputs, so the step simulation ran a decoder before its encoder.) Per layer and phase, times are summed over its ops, so
fusion within a layer loses nothing.

The wall time of the step is measured separately, without the profiler (which slows small
kernels), as the ``statistic`` (median, or least) of ``steps`` timed runs, less the same
statistic of an empty ``tf.function`` on the same inputs timed in the same rounds (the fixed cost of a call: Python, argument
handling, the result's copy; it is no op's cost).

Threads: TensorFlow runs independent ops of a step side by side on a CPU (``inter_op``
threads), so ops' event times overlap and their sum exceeds the wall time. The planner's device
runs one op at a time (as a GPU stream does), so each kernel's time is its share of the CPU
while it ran (:func:`share_concurrent`, processor sharing: ``n`` kernels side by side each get
``1 / n`` of it, as each could use every core through the intra-op threads); without that, a
model with four independent towers had its towers' kernels timed about 3x their work and its
serial head's at 1x, and the whole-step calibration, one factor for all, then priced the head at
a third of its time. The accuracy benchmark also sets one inter-op thread before TensorFlow
starts (:func:`configure_serial_executor`), so that no kernel shares.
"""

from __future__ import annotations

import bisect
import glob
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Literal

from partitioner.core.errors import PartitionError
from partitioner.core.ir import CostedGraph, Graph, Phase

__all__ = [
    "KernelEvent",
    "Statistic",
    "StepOpProfile",
    "apply_op_profile",
    "apply_step_profile",
    "attribute_events",
    "concurrency",
    "configure_serial_executor",
    "interleaved_step_times",
    "layer_phase_times",
    "profile_step_ops",
    "random_inputs",
    "share_concurrent",
    "step_calibration",
    "step_inputs",
]

logger = logging.getLogger(__name__)

Statistic = Literal["median", "min"]
"""How repeated measurements are summarised."""


@dataclass(frozen=True)
class KernelEvent:
    """One kernel execution read from the profile: its node, op type, start and seconds, and
    the thread that ran it (the profile's line; any int that tells threads apart)."""

    node: str
    op_type: str
    duration_s: float
    start_s: float = 0.0
    thread: int = 0


@dataclass(frozen=True)
class StepOpProfile:
    """Per-op times of one traced step (means over the profiled steps) and the step's wall time."""

    model: str
    op_time_s: Mapping[str, float]
    """Traced op name -> seconds per step (own events plus grappler's nodes in its scope)."""
    step_time_s: float
    """Wall seconds of one step run without the profiler (the statistic over the timed runs),
    less the fixed cost of calling a ``tf.function`` (an empty one on the same inputs, timed in
    the same rounds)."""
    call_overhead_s: float
    """That fixed cost: seconds of the empty function (the same statistic)."""
    unattributed_time_s: float
    """Seconds per step of kernel events that matched no traced op or scope."""
    profiled_steps: int
    num_events: int

    @property
    def ops_total_s(self) -> float:
        return math.fsum(self.op_time_s.values())


def configure_serial_executor() -> None:
    """One inter-op thread: the step's ops run one at a time (each kernel still uses every core).

    Must run before TensorFlow initialises its runtime (before the first op); raises
    PartitionError naming the next step otherwise.
    """
    import tensorflow as tf

    try:
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError as exc:
        raise PartitionError(
            "cannot set one inter-op thread: TensorFlow has already started; call "
            f"configure_serial_executor() before running any op ({exc})"
        ) from None


def _scope_owners(graph: Graph) -> dict[str, str]:
    """Name scope -> the traced op whose scope it is (the first op seen in that scope)."""
    owners: dict[str, str] = {}
    for op in graph.ops:
        scope = op.id.rpartition("/")[0]
        while scope and scope not in owners:
            owners[scope] = op.id
            scope = scope.rpartition("/")[0]
    return owners


def _enclosing_op(node: str, known: Mapping[str, int]) -> str | None:
    """The traced op named ``node``, else the innermost traced op whose function runs it (the
    longest ``/``-prefix of ``node`` that is a traced op's name)."""
    prefix = node
    while prefix:
        if prefix in known:
            return prefix
        prefix = prefix.rpartition("/")[0]
    return None


def attribute_events(
    graph: Graph, events: Iterable[KernelEvent], steps: int, statistic: Statistic = "median"
) -> tuple[dict[str, float], float]:
    """Seconds per step per traced op, and the unattributed seconds per step (pure).

    See the module docstring for the matching rules. An op's events, in time order, are cut into
    ``steps`` equal runs (an op in an unrolled or repeated region runs several times a step);
    the op's time is the ``statistic`` (``"median"`` or ``"min"``) of the runs' sums. ``"min"``
    is the steadier on a shared machine: another process can only add time to a kernel.
    """
    if steps < 1:
        raise PartitionError(f"steps={steps} must be >= 1")
    if statistic not in ("median", "min"):
        raise PartitionError(f"statistic={statistic!r} must be 'median' or 'min'")
    known = graph.op_index
    owners = _scope_owners(graph)
    per_op: dict[str, list[KernelEvent]] = {}
    lost = 0.0
    for ev in events:
        target = _enclosing_op(ev.node, known)
        if target is None:
            scope = ev.node.rpartition("/")[0]
            while scope and scope not in owners:
                scope = scope.rpartition("/")[0]
            target = owners.get(scope) if scope else None
        if target is None:
            lost += ev.duration_s
        else:
            per_op.setdefault(target, []).append(ev)
    out: dict[str, float] = {}
    for op_id, evs in per_op.items():
        evs.sort(key=lambda e: e.start_s)
        if len(evs) % steps:
            # Not a whole number of runs per step (a grappler node shared out unevenly): the mean.
            out[op_id] = math.fsum(e.duration_s for e in evs) / steps
            continue
        k = len(evs) // steps
        sums = [math.fsum(e.duration_s for e in evs[i * k : (i + 1) * k]) for i in range(steps)]
        out[op_id] = min(sums) if statistic == "min" else statistics.median(sums)
    return out, lost / steps


def layer_phase_times(
    graph: Graph, op_time_s: Mapping[str, float]
) -> dict[str, tuple[float, float]]:
    """``{layer: (forward_s, backward_s)}`` summed over each layer's own ops (pure).

    Ops without a layer (glue) are left out; layers with no measured op are absent.
    """
    out: dict[str, list[float]] = {}
    for op in graph.ops:
        t = op_time_s.get(op.id)
        if t is None or op.layer is None:
            continue
        slot = out.setdefault(op.layer, [0.0, 0.0])
        slot[0 if op.phase is Phase.FORWARD else 1] += t
    return {k: (v[0], v[1]) for k, v in out.items()}


def _read_events(logdir: str) -> list[KernelEvent]:
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise PartitionError(f"TensorFlow's profiler wrote no trace under {logdir!r}")
    events: list[KernelEvent] = []
    thread, origin_ns = 0, None
    for path in files:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as fh:
            space.ParseFromString(fh.read())
        # Kernels run on the executor's inter-op threads ("tf_Compute/...") or, for inline ops,
        # on the Eigen pool's threads; python/host API lines are not kernels.
        lines = [
            (plane.event_metadata, line)
            for plane in space.planes
            for line in plane.lines
            if line.name.startswith("tf_Compute") or line.name.startswith("tf_numa")
        ]
        # starts in seconds from the first line's, so that float seconds keep the picoseconds
        if origin_ns is None and lines:
            origin_ns = min(line.timestamp_ns for _, line in lines)
        for meta, line in lines:
            thread += 1
            for ev in line.events:
                name = meta[ev.metadata_id].name
                if "::" in name or ":" not in name:
                    continue
                node, _, op_type = name.rpartition(":")
                start_s = (line.timestamp_ns - (origin_ns or 0)) * 1e-9 + ev.offset_ps * 1e-12
                events.append(KernelEvent(node, op_type, ev.duration_ps * 1e-12, start_s, thread))
    return events


def share_concurrent(events: Sequence[KernelEvent], cores: int = 1) -> list[KernelEvent]:
    """The events with each duration replaced by its share of ``cores`` (pure).

    TensorFlow runs independent kernels side by side on its inter-op threads; on ``cores``
    cores that ``n`` threads share, a kernel gets ``min(1, cores / n)`` of a core while ``n``
    threads run kernels (processor sharing), so its wall time overstates its work. Its share is
    that fraction integrated over its interval: what it would take running alone, as the
    simulator's device runs its ops (one at a time). A thread counts while any of its events
    runs (an event nested in another of its thread does not count twice). With one thread at a
    time, every duration is unchanged.
    """
    if cores < 1:
        raise PartitionError(f"cores={cores} must be >= 1")
    by_thread: dict[int, list[tuple[float, float]]] = {}
    for e in events:
        by_thread.setdefault(e.thread, []).append((e.start_s, e.start_s + e.duration_s))
    steps = concurrency(by_thread.values())
    times = [t for t, _ in steps]
    slopes = [min(1.0, cores / n) if n else 1.0 for _, n in steps]
    # the integral of the share at each change point (it is piecewise linear between them)
    bases = [0.0]
    for i in range(1, len(steps)):
        bases.append(bases[-1] + (times[i] - times[i - 1]) * slopes[i - 1])

    def integral(t: float) -> float:  # every event starts and ends at a change point or after
        i = bisect.bisect_right(times, t) - 1
        return bases[i] + (t - times[i]) * slopes[i]

    return [
        replace(e, duration_s=integral(e.start_s + e.duration_s) - integral(e.start_s))
        for e in events
    ]


def concurrency(groups: Iterable[Iterable[tuple[float, float]]]) -> list[tuple[float, int]]:
    """How many of ``groups`` (each a collection of ``(start, end)`` spans, overlapping or
    nested) are busy: ``(time, count)`` at every point where the count changes, in time order,
    the count holding until the next point (pure)."""
    changes = sorted(
        change
        for spans in groups
        for start, end in _union(spans)
        for change in ((start, 1), (end, -1))
    )
    out: list[tuple[float, int]] = []
    running = 0
    for t, delta in changes:
        running += delta
        if out and out[-1][0] == t:
            out[-1] = (t, running)
        else:
            out.append((t, running))
    return out


def _union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The disjoint intervals covering ``spans``, in order."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def random_inputs(
    specs: Iterable[Any], seed: int = 0, int_bounds: Sequence[int | None] = ()
) -> list[Any]:
    """Tensors for ``tf.TensorSpec`` objects with static shapes: standard normal floats; integers
    uniform below the spec's bound in ``int_bounds`` (token ids: the embedding's table size,
    :func:`passes.trace.integer_input_bounds`), else 0 or 1; booleans (masks) all true; zeros for
    the other dtypes."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    bounds = list(int_bounds)
    out = []
    for k, spec in enumerate(specs):
        shape = tuple(int(d) for d in spec.shape)
        if spec.dtype.is_floating:
            out.append(tf.constant(rng.standard_normal(shape), dtype=spec.dtype))
        elif spec.dtype.is_integer:
            high = (bounds[k] if k < len(bounds) else None) or 2
            out.append(tf.constant(rng.integers(0, high, shape), dtype=spec.dtype))
        elif spec.dtype.is_bool:
            out.append(tf.ones(shape, dtype=spec.dtype))
        else:
            out.append(tf.zeros(shape, dtype=spec.dtype))
    return out


def step_inputs(trace: Any, seed: int = 0) -> list[Any]:
    """Tensors matching the traced step's inputs (:func:`random_inputs`, token ids in range)."""
    signature = trace.step_function.structured_input_signature[0]
    return random_inputs(signature, seed, getattr(trace, "input_bounds", ()))


def profile_step_ops(
    trace: Any,
    inputs: Sequence[Any],
    *,
    steps: int = 10,
    warmup: int = 3,
    statistic: Statistic = "median",
    wall_steps: int | None = None,
    share_cores: int | None = 1,
) -> StepOpProfile:
    """Run the traced step (``trace.step_function``) and time its ops (see the module docstring).

    ``trace`` is a :class:`passes.trace.TraceResult`; ``inputs`` are tensors matching its specs.
    ``steps`` runs are profiled; the wall time is the statistic of ``wall_steps`` runs without
    the profiler (default ``steps``; they are cheap, and more of them steady the whole-step
    calibration, :func:`apply_step_profile`). Kernels that ran side by side count their share
    of ``share_cores`` (:func:`share_concurrent`; ``None``: their wall times).
    """
    walls_n = steps if wall_steps is None else wall_steps
    if steps < 1 or warmup < 0 or walls_n < 1:
        raise PartitionError(
            f"steps={steps} and wall_steps={walls_n} must be >= 1 and warmup={warmup} >= 0"
        )
    fn = _step_function(trace)
    graph: Graph = trace.graph
    run, run_empty = _step_runners(fn, inputs)
    for _ in range(warmup):
        run()
        run_empty()
    walls, empties = _wall_times(run, run_empty, walls_n)
    events = _profiled_events(run, steps)
    if share_cores is not None:
        events = share_concurrent(events, share_cores)
    op_time, lost = attribute_events(graph, events, steps, statistic)
    summary = min if statistic == "min" else statistics.median
    logger.debug(
        "op profile of %s: %d events, %.3f ms attributed, %.3f ms not, wall %.3f ms",
        graph.name,
        len(events),
        1e3 * math.fsum(op_time.values()),
        1e3 * lost,
        1e3 * statistics.median(walls),
    )
    return StepOpProfile(
        model=graph.name,
        op_time_s=MappingProxyType(op_time),
        step_time_s=max(0.0, summary(walls) - summary(empties)),
        call_overhead_s=summary(empties),
        unattributed_time_s=lost,
        profiled_steps=steps,
        num_events=len(events),
    )


def _step_function(trace: Any) -> Any:
    """The traced step's ``tf.function``, or a :class:`PartitionError` saying how to get one."""
    if trace.step_function is None:
        raise PartitionError("the trace has no step function; trace the model with passes.trace")
    return trace.step_function


def _step_runners(fn: Any, inputs: Sequence[Any]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Run the step once (waiting for its result), and run an empty function on its inputs."""
    import tensorflow as tf

    def run() -> None:
        out = fn(*inputs)
        flat = [t for t in tf.nest.flatten(out) if tf.is_tensor(t)]
        if flat:
            _ = flat[0].numpy()

    empty = tf.function(lambda *xs: tf.identity(xs[0]), autograph=False)

    def run_empty() -> None:
        _ = empty(*inputs).numpy()

    return run, run_empty


def _wall_times(
    run: Callable[[], None], run_empty: Callable[[], None], steps: int
) -> tuple[list[float], list[float]]:
    """Seconds of ``steps`` runs of the step and of the empty function, in alternate rounds."""
    walls: list[float] = []
    empties: list[float] = []
    for _ in range(steps):
        t0 = time.perf_counter()
        run_empty()
        t1 = time.perf_counter()
        run()
        walls.append(time.perf_counter() - t1)
        empties.append(t1 - t0)
    return walls, empties


def interleaved_step_times(
    steps: Sequence[tuple[Any, Sequence[Any]]],
    *,
    rounds: int,
    warmup: int = 1,
    statistic: Statistic = "median",
) -> tuple[float, ...]:
    """Each traced step's wall seconds (less the empty call on its inputs, as
    :class:`StepOpProfile`'s ``step_time_s``), timed in ``rounds`` rounds that run every step in
    turn, so that a drift of the machine's speed over the rounds reaches each step alike.

    ``steps`` holds ``(trace, inputs)`` pairs (:func:`profile_step_ops`'s arguments). Timing each
    step's runs back to back instead left the ratios between batches to whatever the machine did
    between them: on a shared two-core machine one batch's calibration moved 17% between runs.
    """
    if rounds < 1 or warmup < 0:
        raise PartitionError(f"rounds={rounds} must be >= 1 and warmup={warmup} >= 0")
    runners = [_step_runners(_step_function(trace), inputs) for trace, inputs in steps]
    for run, run_empty in runners:
        for _ in range(warmup):
            run()
            run_empty()
    walls: list[list[float]] = [[] for _ in runners]
    empties: list[list[float]] = [[] for _ in runners]
    for _ in range(rounds):
        for i, (run, run_empty) in enumerate(runners):
            wall, empty = _wall_times(run, run_empty, 1)
            walls[i] += wall
            empties[i] += empty
    summary = min if statistic == "min" else statistics.median
    return tuple(max(0.0, summary(w) - summary(e)) for w, e in zip(walls, empties, strict=True))


def _profiled_events(run: Callable[[], None], steps: int) -> list[KernelEvent]:
    """The kernel events of ``steps`` runs under TensorFlow's profiler (host tracer only)."""
    import tensorflow as tf

    with tempfile.TemporaryDirectory(prefix="partitioner-xplane-") as logdir:
        options = tf.profiler.experimental.ProfilerOptions(
            host_tracer_level=2, python_tracer_level=0, device_tracer_level=0
        )
        tf.profiler.experimental.start(logdir, options=options)
        try:
            for _ in range(steps):
                run()
        finally:
            tf.profiler.experimental.stop()
        return _read_events(logdir)


def apply_op_profile(
    costed: CostedGraph,
    op_time_s: Mapping[str, float],
    device_rows: Iterable[int],
    *,
    dispatch_s: float = 0.0,
) -> CostedGraph:
    """A new CostedGraph whose ``device_rows`` take the measured op times (pure).

    On each row, an op with a measured time gets it; an op without one keeps its estimate unless
    it belongs to a layer phase with measured ops (grappler fused it into one of them, or pruned
    it: its work is in their times), where it gets 0. Every op then pays ``dispatch_s`` (the
    executor's cost per op, which kernel times leave out). Layers with any measured op are
    recorded as measured.
    """
    if not (dispatch_s >= 0 and math.isfinite(dispatch_s)):
        raise PartitionError(f"dispatch_s={dispatch_s!r} must be a finite number >= 0")
    n_rows = costed.topology.num_devices
    rows = set(device_rows)
    bad = sorted(r for r in rows if not 0 <= r < n_rows)
    if bad:
        raise PartitionError(
            f"device rows {bad} are outside the topology's devices 0..{n_rows - 1}"
        )
    ops = costed.graph.ops
    covered = {(op.layer, op.phase) for op in ops if op.layer is not None and op.id in op_time_s}
    new_rows = []
    for d, row in enumerate(costed.op_compute_time_s):
        if d not in rows:
            new_rows.append(row)
            continue
        times = []
        for op, estimate in zip(ops, row, strict=True):
            measured = op_time_s.get(op.id)
            if measured is not None:
                times.append(max(0.0, measured) + dispatch_s)
            elif (op.layer, op.phase) in covered:
                times.append(dispatch_s)
            else:
                times.append(estimate)
        new_rows.append(tuple(times))
    measured_layers = {layer for layer, _ in covered}
    order = tuple(
        info.name
        for info in costed.graph.layers
        if info.name in measured_layers or info.name in costed.measured
    )
    return CostedGraph(
        graph=costed.graph,
        topology=costed.topology,
        op_compute_time_s=tuple(new_rows),
        layer_memory=costed.layer_memory,
        op_memory_share=costed.op_memory_share,
        measured=order,
    )


def step_calibration(
    costed: CostedGraph, op_time_s: Mapping[str, float], step_time_s: float, row: int = 0
) -> float:
    """The factor on the profiled op times that makes the one-device step of ``costed`` equal the
    measured whole step ``step_time_s``.

    ``costed`` already holds the profiled times on device ``row`` (:func:`apply_op_profile`). With
    ``total`` the sum of that row (profiled ops, every op's dispatch cost, estimates of the ops
    no kernel event matched) and ``profiled`` the sum of ``op_time_s`` over its ops, the factor
    ``f`` solves ``(total - profiled) + f * profiled = step_time_s``: the time no kernel explains
    (gaps between kernels, allocations) and the profiler's own cost are spread over the profiled
    ops in proportion to their times. One device runs one op at a time in the simulation, so its
    step is that sum. 1.0 when nothing is profiled or the rest alone already exceeds the step.
    """
    ids = [op.id for op in costed.graph.ops]
    total = math.fsum(costed.op_compute_time_s[row])
    profiled = math.fsum(op_time_s[i] for i in ids if i in op_time_s)
    rest = total - profiled
    if profiled <= 0 or step_time_s <= rest:
        return 1.0
    return (step_time_s - rest) / profiled


def apply_step_profile(
    costed: CostedGraph,
    profile: StepOpProfile,
    device_rows: Iterable[int],
    *,
    dispatch_s: float = 0.0,
) -> tuple[CostedGraph, float]:
    """:func:`apply_op_profile` of ``profile``'s op times scaled by :func:`step_calibration`, so
    that one device's simulated step is the step measured without the profiler; and the factor.

    Kernel events alone miss the executor's gaps and include the profiler's overhead; the
    whole step's wall time (``profile.step_time_s``) has neither. The factor is solved on the
    first of ``device_rows`` (they all take the same times); no rows: nothing changes, 1.0.
    """
    rows = tuple(device_rows)
    raw = apply_op_profile(costed, profile.op_time_s, rows, dispatch_s=dispatch_s)
    if not rows:
        return raw, 1.0
    factor = step_calibration(raw, profile.op_time_s, profile.step_time_s, rows[0])
    scaled = {op: t * factor for op, t in profile.op_time_s.items()}
    return apply_op_profile(costed, scaled, rows, dispatch_s=dispatch_s), factor
