"""``partition calibrate``: measure the devices a plan will use and write them as a topology file.

On a TensorFlow cluster (a cluster file or ``TF_CONFIG``: the ``partition worker`` tasks), this
process connects as the client (:func:`passes.cluster.runtime.connect`) and times, with
:mod:`cost_models.measure.transfers`, what the cluster rewrites run from a client:

* every pair of measured devices: a tensor copied from one to the other (what the placed and
  pipelined rewrites send between layers on two devices; gRPC between two tasks), at several
  sizes, fitted to ``latency_s + bytes / bandwidth_bytes_per_s``
  (:func:`cost_models.devices.fits.fit_latency_bandwidth`);
* the replicas' all-reduce among all measured devices as partitioner's replica rewrite runs it
  (reduce to the first device, then broadcast: :mod:`passes.rewrite.replica`), fitted the same
  way and written as the topology's ``[all_reduce]`` (``algorithm = "reduce_to_one"``), of 8
  tensors at a time and again of 64 (``many_tensors``: a model's gradients are tens of tensors,
  each its own transfer and sum);
* each device's float32 matrix-product speed, this process's too (the machine that profiles
  the model with ``--profile-ops``), and the client's fixed cost of one step over the devices;
* a reference training step on each device alone and on every device at once: cores of one
  machine share its memory bandwidth, so replicas computing together each run slower.

On this host (no cluster) the same among its GPUs. Logical CPU devices of one process are
refused: they share the process's memory and TensorFlow copies nothing between them (timed,
the "transfer" does not grow with its size), so the way to calibrate CPUs is as a cluster of
``partition worker`` processes, which exchange tensors over gRPC as they would in training.

The file it writes is an ordinary topology file (:mod:`cost_models.devices.topology`): one host
per task (so devices are named ``/job:<job>/replica:0/task:<i>/...`` as the cluster names them),
``[[links]]`` for every measured pair, ``inter_host_link`` the slowest of them (for any pair
not measured), ``[all_reduce]``, and a ``calibration`` table with the provenance: when, where,
TensorFlow's version, the cluster's addresses and every raw point, so that the reader can check
each figure against its points. Planning with the file (``partition model.py --topology FILE``)
prices every transfer and all-reduce by the measured figures, and the report names them as
measured. The devices' compute speed is recorded for the reader; op times still come from the
catalog's roofline or ``--profile-ops``.

Bounded: each timed call runs in a watched thread (``step_timeout_s``); a task that is down at
the start fails :func:`~passes.cluster.runtime.connect` within its ``timeout_s``, and one that
stops answering mid-way ends the run with a one-line :class:`~passes.cluster.runtime.ClusterError`
naming it. Nothing is written unless every figure was measured.
"""

from __future__ import annotations

import datetime
import functools
import itertools
import math
import socket
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cost_models.devices.fits import LatencyBandwidthFit, fit_latency_bandwidth
from partitioner.core.errors import UsageError
from partitioner.core.options import short_repr

if TYPE_CHECKING:
    from passes.cluster.runtime import ClusterHandle

# TensorFlow (``tf``, :mod:`cost_models.measure.transfers`, :mod:`passes.cluster.runtime`) is
# imported by the functions that measure, not here: the options and their bounds are checked
# before it loads, so a bad ``--rounds`` or ``--timeout`` is refused at once.

__all__ = [
    "CALIBRATION_TOOL",
    "MAX_ROUNDS",
    "MAX_TIMEOUT_S",
    "MIN_ROUNDS",
    "MIN_TIMEOUT_S",
    "Calibration",
    "CalibrationOptions",
    "calibrate_cluster",
    "calibrate_local",
    "check_timeout_s",
]

CALIBRATION_TOOL = "partition calibrate"
Progress = Callable[[str], None]

_KIB = 1024

MIN_ROUNDS = 3
"""The fewest timed rounds per size (the fits take the median of each size's rounds)."""
MAX_ROUNDS = 100
"""The most timed rounds per size (``rounds``, and ``warmup``): each link's sizes and rounds
run as one watched call, about 0.1 s per round of the default sizes over loopback gRPC, so
100 rounds already take ~10 s of the default 30 s ``step_timeout_s``; more add nothing to a
median but time (``rounds=10**9`` would run for years)."""
MAX_TIMEOUT_S = 3600.0
"""The longest ``step_timeout_s`` and connect ``timeout_s``: an hour. A task silent that long
is down; an infinite bound waits for ever on it."""


MIN_TIMEOUT_S = 0.1
"""The shortest bound: a connect or a measured step takes longer than that (a tenth of a second
is already a down task's fast failure in the tests), and ``1e-320`` would blame running tasks."""


def check_timeout_s(name: str, value: object) -> float:
    """``value`` as a number of seconds in [:data:`MIN_TIMEOUT_S`, :data:`MAX_TIMEOUT_S`];
    :class:`UsageError` naming the argument ``name`` otherwise (a bool, a non-number, nan, inf,
    too short, too long)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (isinstance(value, int) or math.isfinite(value))  # an int is exact, however large
        or value <= 0
    ):
        raise UsageError(f"{name}={short_repr(value)} must be a positive, finite number of seconds")
    if value < MIN_TIMEOUT_S:
        raise UsageError(
            f"{name}={short_repr(value)} is less than {MIN_TIMEOUT_S:g} seconds, too short for any task to "
            f"answer; give at least {MIN_TIMEOUT_S:g}"
        )
    if value > MAX_TIMEOUT_S:
        raise UsageError(
            f"{name}={short_repr(value)} is more than {MAX_TIMEOUT_S:g} seconds, the longest partitioner "
            f"waits for a task; give at most {MAX_TIMEOUT_S:g}"
        )
    return float(value)


def _check_rounds(name: str, value: object, least: int, what: str) -> None:
    """``value`` is an integer in ``least``..:data:`MAX_ROUNDS`."""
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= MAX_ROUNDS:
        raise UsageError(
            f"{name}={value!r} must be an integer from {least} to {MAX_ROUNDS} ({what} per size)"
        )


@dataclass(frozen=True)
class CalibrationOptions:
    """How much to measure: sizes, rounds and the bound on each timed call. :meth:`check`
    bounds them (``rounds`` :data:`MIN_ROUNDS`..:data:`MAX_ROUNDS`, ``warmup``
    0..:data:`MAX_ROUNDS`, ``step_timeout_s`` at most :data:`MAX_TIMEOUT_S`) without
    TensorFlow."""

    sizes_bytes: tuple[int, ...] = (
        256 * _KIB,
        1024 * _KIB,
        4096 * _KIB,
        16384 * _KIB,
        65536 * _KIB,
    )
    rounds: int = 9
    warmup: int = 2
    step_timeout_s: float = 30.0
    device_type: str | None = None
    """The catalog type of the measured devices (``cpu`` for CPUs; GPUs need it named)."""

    def check(self) -> None:
        if len(set(self.sizes_bytes)) < 2 or min(self.sizes_bytes, default=0) < 4:
            raise UsageError(
                f"sizes_bytes={list(self.sizes_bytes)} must hold two or more sizes >= 4 bytes"
            )
        _check_rounds("rounds", self.rounds, MIN_ROUNDS, "timed rounds")
        _check_rounds("warmup", self.warmup, 0, "untimed rounds")
        check_timeout_s("step_timeout_s", self.step_timeout_s)
        if self.device_type is not None:  # before anything is measured, as the planner does
            from cost_models.devices.catalog import get_device_type

            get_device_type(self.device_type)


@dataclass(frozen=True)
class Calibration:
    """Everything ``partition calibrate`` measured (figures and raw points)."""

    devices: tuple[str, ...]
    """The measured TensorFlow devices, one or more per task, in task order."""
    hosts: tuple[int, ...]
    """The task (cluster) or 0 (this host) of each device."""
    device_type: str
    links: tuple[tuple[int, int, LatencyBandwidthFit], ...]
    all_reduce: LatencyBandwidthFit
    """Of :data:`~cost_models.measure.transfers.NUM_TENSORS` tensors at a time."""
    matmul_flops_per_s: tuple[float, ...]
    client_matmul_flops_per_s: float
    dispatch_s: float
    where: str
    when: str
    job: str | None = None
    cluster_addresses: tuple[str, ...] = ()
    client_step_s: float | None = None
    """A no-op Keras training step on the first device, from this process (cluster only)."""
    client_link_points: tuple[tuple[int, float], ...] = ()
    """Copies of a tensor from this process to the first device (cluster only)."""
    all_reduce_many: LatencyBandwidthFit | None = None
    """The same all-reduce of :data:`~cost_models.measure.transfers.MANY_TENSORS` tensors."""
    concurrent_compute: tuple[tuple[float, ...], float] | None = None
    """A reference step's seconds on each device alone, and on all at once
    (:func:`~cost_models.measure.transfers.concurrent_compute_s`)."""
    concurrent_memory: tuple[tuple[float, ...], float] | None = None
    """The same for a memory-bound reference
    (:func:`~cost_models.measure.transfers.concurrent_memory_s`)."""

    def topology_data(self) -> dict[str, Any]:
        """The topology file (JSON-able), its ``calibration`` provenance included."""
        return _topology_data(self)


# -- measuring ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Watch:
    """Runs each timed call in a watched thread; names the task that stopped answering."""

    handle: ClusterHandle | None
    timeout_s: float

    def __call__(self, what: str, fn: Callable[[], Any]) -> Any:
        from passes.cluster.runtime import ClusterError, _bounded, probe_tasks

        result = _bounded(what, fn, self.timeout_s)
        if result is not None:
            return result
        if self.handle is None:
            raise ClusterError(f"measuring {what} did not finish within {self.timeout_s:g} s")
        down = probe_tasks(self.handle.cluster)
        who = self.handle.cluster.describe(down[0]) if down else "a task of the cluster"
        raise ClusterError(
            f"{who} did not answer within {self.timeout_s:g} s while measuring {what}; nothing "
            "was written: restart it and run partition calibrate again"
        )


def _measure(
    devices: Sequence[str], options: CalibrationOptions, watch: _Watch, say: Progress
) -> dict[str, Any]:
    """Every figure of :class:`Calibration` but the where and when."""
    from cost_models.measure import transfers

    sizes, rounds, warmup = options.sizes_bytes, options.rounds, options.warmup
    say(f"compute: {len(devices)} devices and this process, float32 matrix products")
    flops = tuple(
        watch(f"compute on {d}", functools.partial(transfers.matmul_flops_per_s, d))
        for d in devices
    )
    client = transfers.matmul_flops_per_s("/job:localhost/replica:0/task:0/device:CPU:0")
    links = []
    for a, b in itertools.combinations(range(len(devices)), 2):
        say(f"link {devices[a]} -> {devices[b]}: {len(sizes)} sizes x {rounds} rounds")
        points = watch(
            f"the link {devices[a]} -> {devices[b]}",
            functools.partial(
                transfers.transfer_points,
                devices[a],
                devices[b],
                sizes,
                rounds=rounds,
                warmup=warmup,
            ),
        )
        links.append((a, b, fit_latency_bandwidth(points, f"link {a}-{b}")))
    fits = []
    for tensors in (transfers.NUM_TENSORS, transfers.MANY_TENSORS):
        say(
            f"all-reduce of {tensors} tensors among {len(devices)} devices: {len(sizes)} sizes x "
            f"{rounds} rounds"
        )
        reduced = watch(
            f"the all-reduce of {tensors} tensors",
            functools.partial(
                transfers.all_reduce_points, devices, sizes,
                rounds=rounds, warmup=warmup, tensors=tensors,
            ),
        )  # fmt: skip
        fits.append(fit_latency_bandwidth(reduced, f"all-reduce of {tensors} tensors"))
    return {
        "links": tuple(links),
        "all_reduce": fits[0],
        "all_reduce_many": fits[1],
        **_measure_concurrent(devices, watch, say),
        "matmul_flops_per_s": flops,
        "client_matmul_flops_per_s": client,
        "dispatch_s": watch("a no-op step", lambda: transfers.dispatch_s(devices)),
    }


def _measure_concurrent(devices: Sequence[str], watch: _Watch, say: Progress) -> dict[str, Any]:
    """The compute and memory-bound references on each device alone and on all at once."""
    from cost_models.measure import transfers

    say(f"compute on {len(devices)} devices at once and alone: a reference training step")
    compute = watch(
        "the reference step on every device", lambda: transfers.concurrent_compute_s(devices)
    )
    say(f"memory traffic on {len(devices)} devices at once and alone: a reference step")
    memory = watch(
        "the memory-bound reference on every device",
        lambda: transfers.concurrent_memory_s(devices),
    )
    return {"concurrent_compute": compute, "concurrent_memory": memory}


def _measure_client(
    device: str, options: CalibrationOptions, watch: _Watch, say: Progress
) -> dict[str, Any]:
    """The client's cost of a step: feeding a tensor to ``device`` and a no-op Keras step."""
    from cost_models.measure import transfers

    here = "/job:localhost/replica:0/task:0/device:CPU:0"
    say(f"client -> {device}: {len(options.sizes_bytes)} sizes, and a no-op training step")
    points = watch(
        f"the link from this process to {device}",
        functools.partial(
            transfers.transfer_points, here, device, options.sizes_bytes,
            rounds=options.rounds, warmup=options.warmup,
        ),
    )  # fmt: skip
    step_s = watch("a no-op training step", functools.partial(_no_op_step_s, device, options))
    return {"client_step_s": step_s, "client_link_points": points}


def _no_op_step_s(device: str, options: CalibrationOptions) -> float:
    """The median ``train_on_batch`` of a one-unit Dense model placed on ``device`` (what
    every step driven from the client pays besides its ops: Keras's call, the dispatch)."""
    import statistics

    import keras
    import numpy as np

    from cost_models.measure import transfers
    from passes.rewrite.device_placement import place_model

    inputs = keras.Input((4,), name="x")
    model = keras.Model(inputs, keras.layers.Dense(1, name="unit")(inputs), name="no_op")
    x, y = np.ones((8, 4), np.float32), np.ones((8, 1), np.float32)
    placed = place_model(model, {"unit": device}, [x[:1]])
    placed.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    steps = {"step": lambda: placed.train_on_batch(x, y)}
    return statistics.median(transfers.time_interleaved(steps, options.rounds, 2)["step"])


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _task_devices(handle: ClusterHandle) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Each task's GPUs, or its first CPU when it has none; and each device's task."""
    from cost_models.devices.catalog import DeviceKind

    devices: list[str] = []
    hosts: list[int] = []
    for task in range(handle.cluster.num_tasks):
        mine = (
            handle.task_devices(task, DeviceKind.GPU)
            or handle.task_devices(task, DeviceKind.CPU)[:1]
        )
        devices += mine
        hosts += [task] * len(mine)
    return tuple(devices), tuple(hosts)


def _device_type(devices: Sequence[str], named: str | None) -> str:
    if named is not None:
        return named
    if any("GPU" in d.upper() for d in devices):
        raise UsageError(
            "the measured devices are GPUs: name their catalog type, e.g. device_type='h100' "
            "(partition devices lists them)"
        )
    return "cpu"


def calibrate_cluster(
    cluster: Any,
    options: CalibrationOptions = CalibrationOptions(),
    *,
    timeout_s: float | None = None,
    progress: Progress | None = None,
) -> Calibration:
    """Measure a TensorFlow cluster's tasks from this process (module docstring).

    ``cluster`` is what :func:`~passes.cluster.runtime.connect` takes (a cluster file, its
    mapping, or None for ``TF_CONFIG``) or a connected :class:`ClusterHandle`. ``timeout_s``
    bounds the connect (None: :data:`~passes.cluster.runtime.DEFAULT_CONNECT_TIMEOUT_S`; at
    most :data:`MAX_TIMEOUT_S`).
    """
    options.check()
    bound_s = None if timeout_s is None else check_timeout_s("timeout_s", timeout_s)
    from passes.cluster.runtime import DEFAULT_CONNECT_TIMEOUT_S, ClusterHandle, connect

    say = progress or (lambda _: None)
    handle = (
        cluster
        if isinstance(cluster, ClusterHandle)
        else connect(cluster, timeout_s=DEFAULT_CONNECT_TIMEOUT_S if bound_s is None else bound_s)
    )
    if handle.cluster.num_tasks < 2:
        raise UsageError(
            f"{handle.cluster.source} has {handle.cluster.num_tasks} task; calibrating needs two "
            "or more (a single task's devices: run partition calibrate on that machine)"
        )
    devices, hosts = _task_devices(handle)
    say(f"connected to {handle.cluster.num_tasks} tasks: {', '.join(handle.cluster.addresses)}")
    watch = _Watch(handle, options.step_timeout_s)
    figures = _measure(devices, options, watch, say)
    figures.update(_measure_client(devices[0], options, watch, say))
    return Calibration(
        devices=devices, hosts=hosts, device_type=_device_type(devices, options.device_type),
        where=f"{handle.cluster.num_tasks} tasks of {handle.cluster.source}", when=_now(),
        job=handle.cluster.job_name, cluster_addresses=handle.cluster.addresses, **figures,
    )  # fmt: skip


def calibrate_local(
    options: CalibrationOptions = CalibrationOptions(),
    *,
    progress: Progress | None = None,
) -> Calibration:
    """Measure this host's GPUs (two or more). A host without GPUs is refused: logical CPU
    devices of one process share its memory and TensorFlow copies nothing between them, so
    there is no link to measure; calibrate ``partition worker`` processes instead."""
    options.check()
    import tensorflow as tf

    say = progress or (lambda _: None)
    gpus = tf.config.list_physical_devices("GPU")
    if len(gpus) < 2:
        raise UsageError(
            f"this host has {len(gpus)} GPU; devices of one process share its memory and "
            "TensorFlow copies nothing between CPU devices, so there is no link to measure: "
            "start partition worker processes and calibrate them with cluster= (a cluster file)"
        )
    devices = tuple(d.name for d in tf.config.list_logical_devices("GPU"))
    watch = _Watch(None, options.step_timeout_s)
    figures = _measure(devices, options, watch, say)
    return Calibration(
        devices=devices, hosts=(0,) * len(devices),
        device_type=_device_type(devices, options.device_type),
        where=f"host {socket.gethostname()}", when=_now(), **figures,
    )  # fmt: skip


# -- the topology file -------------------------------------------------------------------------


def _link_table(fit: LatencyBandwidthFit, name: str) -> dict[str, Any]:
    return {
        "latency_s": fit.latency_s,
        "bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s,
        "name": name,
    }


def _hosts(cal: Calibration) -> list[dict[str, Any]]:
    counts: dict[int, int] = {}
    for host in cal.hosts:
        counts[host] = counts.get(host, 0) + 1
    return [{"devices": [{"type": cal.device_type, "count": n}]} for _, n in sorted(counts.items())]


def _points(points: Sequence[tuple[int, float]]) -> list[list[float]]:
    return [[int(b), float(s)] for b, s in points]


def _all_reduce_points(cal: Calibration) -> dict[str, Any]:
    """The ``calibration.all_reduce`` table: the raw points, of how many tensors each."""
    from cost_models.measure import transfers

    table: dict[str, Any] = {"points": _points(cal.all_reduce.points)}
    if cal.all_reduce_many is not None:
        table["tensors"] = transfers.NUM_TENSORS
        table["many_tensors"] = {
            "tensors": transfers.MANY_TENSORS,
            "points": _points(cal.all_reduce_many.points),
        }
    return table


def _all_reduce_table(cal: Calibration) -> dict[str, Any]:
    """The topology's ``all_reduce`` table: the fit of :data:`NUM_TENSORS` tensors, with that
    count and the fit of :data:`MANY_TENSORS` tensors when measured."""
    from cost_models.measure import transfers

    table: dict[str, Any] = {
        "latency_s": cal.all_reduce.latency_s,
        "bandwidth_bytes_per_s": cal.all_reduce.bandwidth_bytes_per_s,
        "members": len(cal.devices),
        "algorithm": "reduce_to_one",
        "source": (
            f"{CALIBRATION_TOOL} {cal.when}: partitioner's all-reduce (reduce to one, "
            f"broadcast) of {transfers.NUM_TENSORS} float32 tensors among {len(cal.devices)} "
            f"devices of {cal.where}"
        ),
    }
    many = cal.all_reduce_many
    if many is not None:
        table["tensors"] = transfers.NUM_TENSORS
        table["many_tensors"] = {
            "tensors": transfers.MANY_TENSORS,
            "latency_s": many.latency_s,
            "bandwidth_bytes_per_s": many.bandwidth_bytes_per_s,
        }
    return table


def _concurrent_table(cal: Calibration) -> dict[str, Any]:
    """``calibration.concurrent_compute`` and ``concurrent_memory`` where they were measured."""
    from cost_models.measure import transfers

    table = {}
    for key, measured, reference in (
        ("concurrent_compute", cal.concurrent_compute, transfers.CONCURRENT_REFERENCE),
        ("concurrent_memory", cal.concurrent_memory, transfers.MEMORY_REFERENCE),
    ):
        if measured is not None:
            alone, together = measured
            table[key] = {"alone_s": list(alone), "together_s": together, "reference": reference}
    return table


def _provenance(cal: Calibration) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    import tensorflow as tf

    try:
        ours = version("partitioner")
    except PackageNotFoundError:  # run from a checkout that is not installed
        ours = "unknown"
    return {
        "tool": CALIBRATION_TOOL,
        "when": cal.when,
        "where": cal.where,
        "machine": socket.gethostname(),
        "tensorflow": tf.__version__,
        "partitioner": ours,
        "cluster": list(cal.cluster_addresses),
        "measured_devices": list(cal.devices),
        "links": [{"devices": [a, b], "points": _points(f.points)} for a, b, f in cal.links],
        "all_reduce": _all_reduce_points(cal),
        "matmul_flops_per_s": list(cal.matmul_flops_per_s),
        "client_matmul_flops_per_s": cal.client_matmul_flops_per_s,
        "dispatch_s": cal.dispatch_s,
        **_concurrent_table(cal),
        **(
            {}
            if cal.client_step_s is None
            else {
                "client": {
                    "step_s": cal.client_step_s,
                    "link_points": _points(cal.client_link_points),
                }
            }
        ),
    }


def _topology_data(cal: Calibration) -> dict[str, Any]:
    slowest = max((f for _, _, f in cal.links), key=lambda f: f.predict_s(16 << 20))
    data: dict[str, Any] = {"name": f"calibrated: {cal.where}"}
    if cal.job is not None:
        data["job"] = cal.job
    hosts = _hosts(cal)
    if len(hosts) > 1:
        data["hosts"] = hosts
        data["inter_host_link"] = _link_table(slowest, "measured (slowest pair)")
    else:
        data["devices"] = hosts[0]["devices"]
    data["links"] = [
        {"devices": [a, b], "link": _link_table(f, f"measured {a}<->{b}")} for a, b, f in cal.links
    ]
    data["all_reduce"] = _all_reduce_table(cal)
    data["calibration"] = _provenance(cal)
    return data
