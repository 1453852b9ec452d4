"""The measured all-reduce of two loopback MultiWorkerMirroredStrategy workers, as a topology fit.

    python -m benchmarks.collective_fit [--reps N] [--json out.json]

Two SPMD processes on 127.0.0.1, each pinned to its own core (one intra-op thread and
:data:`INTER_OP_THREADS` inter-op threads: the data-parallel processes of
:mod:`benchmarks.strategies`), build ``tf.distribute.MultiWorkerMirroredStrategy`` from a
``TF_CONFIG`` naming both and time, per total size in :data:`SIZES_BYTES`, one ``tf.function``
whose replica function is ``tf.distribute.get_replica_context().all_reduce(SUM, tensors)`` of
:data:`NUM_TENSORS` float32 tensors of that total size: the batched collective Keras's optimizer
runs on a model's gradients (``keras/src/backend/tensorflow/optimizer.py``,
``_all_reduce_sum_gradients``; a ring over gRPC on CPUs).

The sizes are timed in ``reps`` interleaved rounds (after warm-up rounds), one call of each size
a round, so that the machine's drift falls on every size alike, and every call starts after an
untimed one-scalar all-reduce, so both processes enter it together, as a training step's
all-reduce starts once both replicas' backward is done. (Timed back to back instead, size after
size and without the barrier, the 16 MB point measured 43-44 ms in two runs, where the same
call in the data-parallel processes' rounds, after the barrier, took 29 and 34 ms, the medians
of 21 rounds.) A point is, per size, the median over the rounds of the slower process's time of
each call. ``latency_s + bytes / bandwidth_bytes_per_s`` is fitted to the points by least
squares of the relative errors (the intercept kept >= 0), and :meth:`CollectiveFit.to_ir` gives
the :class:`~partitioner.core.ir.AllReduceFit` a :class:`~partitioner.core.ir.Topology` carries
(``all_reduce``), which :mod:`cost_models.estimate.collectives` then uses for every all-reduce
between the two devices. The fit never sees a training step: it is the collective alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cost_models.devices import fits
from partitioner.cli.worker import MIN_INTER_OP_THREADS
from partitioner.core.ir import AllReduceFit

__all__ = [
    "NUM_TENSORS",
    "SIZES_BYTES",
    "CollectiveFit",
    "barrier",
    "fit_latency_bandwidth",
    "measure_all_reduce",
]

SIZES_BYTES = (100_000, 1_000_000, 4_000_000, 16_000_000, 32_000_000, 64_000_000)
"""Total bytes of the all-reduced tensors per point (0.1 to 64 MB)."""
NUM_TENSORS = 8
"""Tensors per all-reduce (a model's gradients are a list; Keras batches them in one call)."""
INTER_OP_THREADS = MIN_INTER_OP_THREADS
"""Inter-op threads of every TensorFlow process of the two-core benchmarks (one intra-op thread
each): ``partition worker``'s default, the data-parallel processes, and the process that
profiles and calibrates (benchmarks.strategies), so that the ops are timed as they run."""
TIMEOUT_S = 600.0


@dataclass(frozen=True)
class CollectiveFit:
    """The fitted all-reduce and the points it was fitted to."""

    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[int, float], ...]
    """``(total bytes, seconds)``: the median of the slower process per call."""
    samples_s: tuple[tuple[float, ...], ...]
    """Per point, the slower process's time of every timed call."""
    source: str

    def to_ir(self) -> AllReduceFit:
        """The topology's ``all_reduce`` field: measured among two devices, whichever algorithm
        ``MultiWorkerMirroredStrategy`` ran."""
        return AllReduceFit(self.latency_s, self.bandwidth_bytes_per_s, 2, self.source)

    def predict_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, data: dict[str, Any]) -> CollectiveFit:
        return cls(
            float(data["latency_s"]), float(data["bandwidth_bytes_per_s"]),
            tuple((int(b), float(s)) for b, s in data["points"]),
            tuple(tuple(float(x) for x in row) for row in data["samples_s"]), str(data["source"]),
        )  # fmt: skip


def fit_latency_bandwidth(points: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(latency_s, bandwidth_bytes_per_s)`` of the product's fit
    (:func:`cost_models.devices.fits.fit_latency_bandwidth`: least squares of the relative
    errors, the one ``partition calibrate`` uses)."""
    fit = fits.fit_latency_bandwidth(points, "the all-reduce fit")
    return fit.latency_s, fit.bandwidth_bytes_per_s


# -- the worker process ----------------------------------------------------------------------


def _all_reduce_step(strategy: Any, total_bytes: int) -> Any:
    """A ``tf.function``: the replica all-reduces ``NUM_TENSORS`` float32 tensors (SUM)."""
    import tensorflow as tf

    each = max(1, total_bytes // (4 * NUM_TENSORS))
    tensors = [tf.fill([each], float(k + 1)) for k in range(NUM_TENSORS)]

    def replica() -> Any:
        context = tf.distribute.get_replica_context()
        reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, tensors)
        return tf.stack([r[0] for r in reduced])

    @tf.function(jit_compile=False)
    def step() -> Any:
        return strategy.run(replica)

    return step


def join_loopback_workers(index: int, ports: Sequence[int], core: int) -> Any:
    """This process as worker ``index`` of a ``MultiWorkerMirroredStrategy`` over 127.0.0.1
    ``ports``, pinned to ``core`` with one intra-op and ``INTER_OP_THREADS`` inter-op threads
    (the cluster workers' default); the strategy."""
    os.sched_setaffinity(0, {core})
    os.environ["TF_CONFIG"] = json.dumps(
        {
            "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
            "task": {"type": "worker", "index": index},
        }
    )
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(INTER_OP_THREADS)
    return tf.distribute.MultiWorkerMirroredStrategy()


def barrier(strategy: Any) -> Callable[[], Any]:
    """A one-scalar all-reduce: both processes leave it together (an untimed start line)."""
    import tensorflow as tf

    @tf.function
    def all_reduce_one() -> Any:
        def one() -> Any:
            context = tf.distribute.get_replica_context()
            return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.constant(1.0))

        return strategy.run(one)

    return lambda: strategy.experimental_local_results(all_reduce_one())[0].numpy()


def _worker(index: int, ports: Sequence[int], core: int, args: argparse.Namespace) -> None:
    """One SPMD process: ``warmup`` then ``reps`` rounds, each one all-reduce of every size,
    each started after a barrier (:func:`benchmarks.strategies.time_interleaved`)."""
    from benchmarks.strategies import time_interleaved

    strategy = join_loopback_workers(index, ports, core)

    def call(size: int) -> Any:
        step = _all_reduce_step(strategy, size)
        return lambda: strategy.experimental_local_results(step())[0].numpy()

    timed = time_interleaved(
        {str(size): call(size) for size in SIZES_BYTES}, args.reps, args.warmup, [os.getpid()],
        before_each=barrier(strategy),
    )  # fmt: skip
    samples = {size: list(m.samples_s) for size, m in timed.items()}
    Path(args.out).write_text(json.dumps(samples), encoding="utf-8")
    deadline = time.monotonic() + TIMEOUT_S
    while not Path(args.done).exists() and time.monotonic() < deadline:
        time.sleep(0.05)  # the peer may still be in its last collective: do not close on it


# -- the parent ------------------------------------------------------------------------------


def _launch(cores: Sequence[int], tmp: Path, reps: int, warmup: int, env: Any) -> list[Path]:
    """Start both workers, wait for their outputs, stop them."""
    from benchmarks.strategies import _free_ports, _wait_for_outputs

    ports = _free_ports(len(cores))
    outs = [tmp / f"ar{i}.json" for i in range(len(cores))]
    logs = [tmp / f"ar{i}.log" for i in range(len(cores))]
    done = tmp / "done"
    procs = []
    for i, core in enumerate(cores):
        cmd = [
            sys.executable, "-m", "benchmarks.collective_fit", "--role", "worker",
            "--index", str(i), "--ports", ",".join(map(str, ports)), "--core", str(core),
            "--reps", str(reps), "--warmup", str(warmup), "--out", str(outs[i]),
            "--done", str(done),
        ]  # fmt: skip
        with logs[i].open("wb") as log:
            procs.append(subprocess.Popen(cmd, env=env, cwd=_root(), stdout=log, stderr=log))
    try:
        _wait_for_outputs(outs, procs, logs)
    finally:
        done.touch()
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    return outs


def _root() -> Path:
    return Path(__file__).resolve().parents[1]


def measure_all_reduce(
    cores: Sequence[int], *, reps: int = 15, warmup: int = 2, env: Any = None
) -> CollectiveFit:
    """Time MWMS all-reduces on two processes pinned to ``cores`` and fit them (docstring)."""
    if env is None:
        from benchmarks.cluster_zoo import child_env

        env = child_env()
    with tempfile.TemporaryDirectory() as tmp:
        outs = _launch(cores, Path(tmp), reps, warmup, env)
        data = [json.loads(o.read_text(encoding="utf-8")) for o in outs]
    samples = tuple(
        tuple(max(vals) for vals in zip(*(d[str(size)] for d in data))) for size in SIZES_BYTES
    )
    points = tuple((size, statistics.median(s)) for size, s in zip(SIZES_BYTES, samples))
    latency, bandwidth = fit_latency_bandwidth(points)
    source = (
        f"MultiWorkerMirroredStrategy all_reduce(SUM) of {NUM_TENSORS} float32 tensors, 2 "
        f"loopback workers on cores {list(cores)}, {len(points)} sizes "
        f"{SIZES_BYTES[0] / 1e6:g}-{SIZES_BYTES[-1] / 1e6:g} MB, median of {reps} interleaved "
        "rounds, each call after a barrier, least "
        "squares of the relative errors (benchmarks.collective_fit)"
    )
    return CollectiveFit(latency, bandwidth, points, samples, source)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.collective_fit")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the fit and its points here")
    hidden = argparse.SUPPRESS
    parser.add_argument("--role", default="main", choices=["main", "worker"], help=hidden)
    for name in ("--out", "--done", "--ports"):
        parser.add_argument(name, default=None, help=hidden)
    parser.add_argument("--core", type=int, default=0, help=hidden)
    parser.add_argument("--index", type=int, default=0, help=hidden)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.role == "worker":
        _worker(args.index, [int(p) for p in args.ports.split(",")], args.core, args)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs two cores; this process may use {cores}")
    fit = measure_all_reduce(cores[:2], reps=args.reps, warmup=args.warmup)
    for size, seconds in fit.points:
        sys.stdout.write(
            f"{size / 1e6:8.1f} MB  {seconds * 1e3:9.2f} ms  fit {fit.predict_s(size) * 1e3:9.2f} ms\n"
        )
    sys.stdout.write(
        f"latency {fit.latency_s * 1e3:.3f} ms, bandwidth {fit.bandwidth_bytes_per_s / 1e6:.1f} MB/s\n"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(fit.to_json_dict(), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
