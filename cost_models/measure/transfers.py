"""Timing the devices a plan will use: point-to-point transfers, the replicas' all-reduce, and
each device's compute speed, as the rewrites run them (imports TensorFlow).

Every function takes TensorFlow device strings, local (``/device:CPU:1``, ``/device:GPU:0``) or
a connected cluster's (``/job:worker/replica:0/task:1/device:CPU:0``), and times ``tf.function``
calls driven from this process, as a placed model's steps are. Each measured quantity is the
difference of two calls that differ only in it, timed in **interleaved rounds**
(:func:`time_interleaved`: one call of each kind a round, so that the machine's drift over the
seconds they take falls on both alike), and a point is the median over the rounds:

* :func:`transfer_points`: a tensor made on ``src`` (``tf.random.uniform``, never constant-folded)
  and summed on ``dst``, less the same made and summed on ``dst``: the copy the placed rewrite
  makes when a layer's input comes from another device (``Send``/``Recv``; gRPC between tasks).
* :func:`all_reduce_points`: the explicit all-reduce of partitioner's replica rewrite
  (:mod:`passes.rewrite.replicate`, reduce to one device then broadcast): each member makes
  :data:`NUM_TENSORS` tensors of the size (a model's gradients are a list), the first member sums
  each with ``tf.add_n`` and divides by the member count, and every member reads every sum, less
  the same tensors made and read on their own member (also with :data:`MANY_TENSORS`).
* :func:`matmul_flops_per_s`: ``n x n`` float32 matrix products on one device, FLOP/s.
* :func:`dispatch_s`: one no-op step over the devices: the client's fixed cost of a step.
* :func:`concurrent_compute_s`, :func:`concurrent_memory_s`: a reference training step, and a
  memory-bound reference, on each device alone and on all at once (cores of one machine share
  its memory bandwidth).

Callers bound each call in time (a remote task that hangs would block it for ever);
``partition calibrate`` (:mod:`passes.cluster.calibrate`) does.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import tensorflow as tf

__all__ = [
    "CONCURRENT_REFERENCE",
    "MANY_TENSORS",
    "MEMORY_REFERENCE",
    "NUM_TENSORS",
    "all_reduce_points",
    "concurrent_compute_s",
    "concurrent_memory_s",
    "dispatch_s",
    "matmul_flops_per_s",
    "time_interleaved",
    "transfer_points",
]

NUM_TENSORS = 8
"""Tensors per all-reduce (a model's gradients are a list; the rewrite reduces each)."""

MANY_TENSORS = 64
"""Tensors per all-reduce of the second measurement: each tensor is its own transfer and sum,
so a model's list of tens of gradients costs more than the same bytes in :data:`NUM_TENSORS`
(:mod:`cost_models.estimate.collectives`)."""


def time_interleaved(
    steps: Mapping[str, Callable[[], Any]],
    rounds: int,
    warmup: int,
    before_each: Callable[[], Any] | None = None,
) -> dict[str, tuple[float, ...]]:
    """Each of ``steps`` called once per round for ``rounds`` rounds (after ``warmup`` rounds);
    the seconds of every timed call per step. ``before_each`` runs, untimed, before every call
    (warm-up too), e.g. a barrier so that several processes start together."""
    settle = before_each or (lambda: None)
    for _ in range(warmup):
        for step in steps.values():
            settle()
            step()
    samples: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for key, step in steps.items():
            settle()
            t0 = time.perf_counter()
            step()
            samples[key].append(time.perf_counter() - t0)
    return {k: tuple(v) for k, v in samples.items()}


def _difference_s(samples: Mapping[str, Sequence[float]], with_it: str, without: str) -> float:
    """The median call with the measured quantity less the median call without it (>= 1 ns)."""
    return max(1e-9, statistics.median(samples[with_it]) - statistics.median(samples[without]))


def _move(num_floats: int, src: str, dst: str) -> Callable[[], Any]:
    def body() -> Any:
        with tf.device(src):
            a = tf.random.uniform([num_floats])
        with tf.device(dst):
            return tf.reduce_sum(a)

    step = tf.function(body, jit_compile=False)
    return lambda: step().numpy()


def transfer_points(
    src: str, dst: str, sizes_bytes: Sequence[int], *, rounds: int, warmup: int = 2
) -> tuple[tuple[int, float], ...]:
    """``(bytes, seconds)`` of copying a float32 tensor of each size from ``src`` to ``dst``."""
    steps: dict[str, Callable[[], Any]] = {}
    for size in sizes_bytes:
        n = max(1, size // 4)
        steps[f"{size} moved"] = _move(n, src, dst)
        steps[f"{size} local"] = _move(n, dst, dst)
    samples = time_interleaved(steps, rounds, warmup)
    return tuple(
        (size, _difference_s(samples, f"{size} moved", f"{size} local")) for size in sizes_bytes
    )


def _reduce(
    num_floats: int, members: Sequence[str], *, exchange: bool, tensors: int
) -> Callable[[], Any]:
    """One call: every member makes its tensors; with ``exchange`` the first member sums them
    over the members (``add_n``, divided by their count) and every member reads the sums,
    without it every member reads its own."""
    count = float(len(members))

    def body() -> Any:
        made = []
        for device in members:
            with tf.device(device):
                made.append([tf.random.uniform([num_floats]) for _ in range(tensors)])
        if exchange:
            with tf.device(members[0]):
                sums = [tf.add_n(list(parts)) / count for parts in zip(*made)]
            read = [sums] * len(members)
        else:
            read = made
        totals = []
        for device, held in zip(members, read):
            with tf.device(device):
                totals.append(tf.add_n([tf.reduce_sum(t) for t in held]))
        return tf.add_n(totals)

    step = tf.function(body, jit_compile=False)
    return lambda: step().numpy()


def all_reduce_points(
    members: Sequence[str],
    sizes_bytes: Sequence[int],
    *,
    rounds: int,
    warmup: int = 2,
    tensors: int = NUM_TENSORS,
) -> tuple[tuple[int, float], ...]:
    """``(total bytes, seconds)`` of the rewrite's all-reduce of ``tensors`` float32 tensors of
    that total size among ``members`` (the first is the root)."""
    steps: dict[str, Callable[[], Any]] = {}
    for size in sizes_bytes:
        n = max(1, size // (4 * tensors))
        steps[f"{size} reduced"] = _reduce(n, members, exchange=True, tensors=tensors)
        steps[f"{size} local"] = _reduce(n, members, exchange=False, tensors=tensors)
    samples = time_interleaved(steps, rounds, warmup)
    return tuple(
        (size, _difference_s(samples, f"{size} reduced", f"{size} local")) for size in sizes_bytes
    )


def matmul_flops_per_s(
    device: str, *, size: int = 512, repeats: int = 24, rounds: int = 9
) -> float:
    """FLOP/s of ``repeats`` chained ``size x size`` float32 matrix products on ``device``
    (the fastest call, less the fastest call that makes the inputs alone: a device's speed is
    what it can do, and other work on its core only ever slows a call).

    The planner scales op times profiled here by the ratio of two such figures (this process's
    and a device's), so each must be steady: at the former 8 products (about 11 ms a call on
    one core) and 5 rounds, figures of one core taken minutes apart ranged 162-200 GFLOP/s,
    moving predictions by up to 20%; 24 products (about 35 ms) over 9 rounds cost about 0.4 s."""

    def chain(products: int) -> Callable[[], Any]:
        def body() -> Any:
            with tf.device(device):
                a = tf.random.uniform([size, size]) / size
                for _ in range(products):
                    a = tf.matmul(a, a)
                return tf.reduce_sum(a)

        step = tf.function(body, jit_compile=False)
        return lambda: step().numpy()

    samples = time_interleaved({"products": chain(repeats), "inputs": chain(0)}, rounds, 2)
    seconds = max(1e-9, min(samples["products"]) - min(samples["inputs"]))
    return 2.0 * size**3 * repeats / seconds


CONCURRENT_REFERENCE = "3 steps of a 4 x Dense(1024) float32 MLP at batch 256 (relu, MSE, SGD)"
"""The training step :func:`concurrent_compute_s` times (weights 16 MiB: beyond a core's own
cache, as a model's are)."""


def _reference_steps(devices: Sequence[str]) -> Callable[[], Any]:
    """One call: :data:`CONCURRENT_REFERENCE` on every device of ``devices`` (at once when
    several: nothing orders them)."""
    width, depth, batch = 1024, 4, 256
    weights: dict[str, list[Any]] = {}
    for device in devices:
        with tf.device(device):
            weights[device] = [
                tf.Variable(tf.random.normal([width, width]) * 0.03) for _ in range(depth)
            ]

    def body() -> Any:
        losses = []
        for device in devices:
            with tf.device(device):
                x = tf.random.uniform([batch, width])
                for _ in range(3):
                    with tf.GradientTape() as tape:
                        h = x
                        for w in weights[device]:
                            h = tf.nn.relu(tf.matmul(h, w))
                        loss = tf.reduce_mean(tf.square(h))
                    for w, g in zip(weights[device], tape.gradient(loss, weights[device])):
                        w.assign_sub(1e-3 * g)
                losses.append(loss)
        return tf.add_n(losses)

    step = tf.function(body, jit_compile=False)
    return lambda: step().numpy()


MEMORY_REFERENCE = (
    "6 rounds of two elementwise updates of two 16 MiB float32 vectors (a = 0.999 a + 0.001 b; "
    "b = relu(b - a / 2))"
)
"""The memory-bound step :func:`concurrent_memory_s` times: every pass streams tensors larger
than a core's caches, and does next to no arithmetic per byte."""


def _memory_reference_steps(devices: Sequence[str]) -> Callable[[], Any]:
    """One call: :data:`MEMORY_REFERENCE` on every device of ``devices`` (at once when
    several: nothing orders them)."""
    size = 4 * 1024 * 1024
    vectors: dict[str, list[Any]] = {}
    for device in devices:
        with tf.device(device):
            vectors[device] = [tf.Variable(tf.random.uniform([size])) for _ in range(2)]

    def body() -> Any:
        sums = []
        for device in devices:
            with tf.device(device):
                a, b = vectors[device]
                for _ in range(6):
                    a.assign(a * 0.999 + b * 0.001)
                    b.assign(tf.nn.relu(b - a * 0.5))
                sums.append(tf.reduce_sum(a))
        return tf.add_n(sums)

    step = tf.function(body, jit_compile=False)
    return lambda: step().numpy()


def _alone_and_together(
    make: Callable[[Sequence[str]], Callable[[], Any]],
    devices: Sequence[str],
    rounds: int,
    warmup: int,
) -> tuple[tuple[float, ...], float]:
    steps = {f"alone {d}": make([d]) for d in devices}
    steps["together"] = make(devices)
    samples = time_interleaved(steps, rounds, warmup)
    alone = tuple(statistics.median(samples[f"alone {d}"]) for d in devices)
    return alone, statistics.median(samples["together"])


def concurrent_compute_s(
    devices: Sequence[str], *, rounds: int = 9, warmup: int = 2
) -> tuple[tuple[float, ...], float]:
    """Median seconds of :data:`CONCURRENT_REFERENCE` on each of ``devices`` alone and on all
    of them at once, in interleaved rounds. Cores of one machine share its memory bandwidth
    and caches: on two loopback workers pinned to the two cores of the test machine, 128.7 /
    127.9 ms alone, 136.0 ms together (x1.06), as data-parallel replicas run (x1.00-1.05 in
    three later runs)."""
    return _alone_and_together(_reference_steps, devices, rounds, warmup)


def concurrent_memory_s(
    devices: Sequence[str], *, rounds: int = 9, warmup: int = 2
) -> tuple[tuple[float, ...], float]:
    """The same for :data:`MEMORY_REFERENCE`: on those two workers 85.9 / 87.7 ms alone,
    108.6 ms together (x1.24; x1.26 and x1.28 in two more runs)."""
    return _alone_and_together(_memory_reference_steps, devices, rounds, warmup)


def dispatch_s(devices: Sequence[str], *, rounds: int = 9) -> float:
    """The median seconds of one step that touches every device and does nothing else."""

    def body() -> Any:
        total = tf.constant(0.0)
        for device in devices:
            with tf.device(device):
                total = total + 1.0
        return total

    step = tf.function(body, jit_compile=False)
    return statistics.median(time_interleaved({"noop": lambda: step().numpy()}, rounds, 2)["noop"])
