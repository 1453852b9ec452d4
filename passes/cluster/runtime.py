"""Placing a plan on a TensorFlow cluster: workers on other processes or machines.

A cluster is one job of worker tasks, each a ``tf.distribute.Server`` (``partition worker``,
:mod:`partitioner.cli.worker`), given as ``{"worker": ["host:port", ...]}``, a JSON file holding that
or a ``TF_CONFIG``-style ``{"cluster": {...}, "task": {...}}``, or the ``TF_CONFIG`` environment
variable itself (:func:`load_cluster`).

:func:`connect` makes this process the cluster's client
(``tf.config.experimental_connect_to_cluster``; the client joins as its own ``localhost`` job,
so the cluster file lists only the workers). Remote devices are then named
``/job:worker/replica:0/task:<i>/device:<CPU|GPU>:<j>``; :func:`remote_device_strings` maps a
plan's devices onto them and :func:`place_on_cluster` applies the plan with
:func:`passes.rewrite.device_placement.place_model` (or :func:`passes.rewrite.pipeline.pipeline_model`), so every
layer's variables live on, and its forward and backward ops run on, its remote task, while
``fit`` is driven from the client. Plans with replicas (data parallel, hybrid) go through
:func:`replicate_on_cluster`: ``R`` copies on the tasks' devices, trained on shares of each
batch with an explicit all-reduce (:func:`passes.rewrite.replicate.replicate_pipeline`; each
variable's gradients reduced on replica 0's device of it, the result read by every replica).

Threads. The functions a client runs on a worker use the thread counts of the *client's*
config where it sets them (``experimental_connect_to_cluster`` ships a copy of it), else the
worker's (:mod:`partitioner.cli.worker` sets them); :func:`connect` warns when the client forces a
single inter-op thread, which stalls a pipeline stage's sends.

Faults. TensorFlow's remote eager runtime waits for an unreachable task without limit, so every
step that talks to the cluster is bounded here:

* :func:`connect` waits at most ``timeout_s`` for every task's port to accept a connection and
  for the remote context to come up, then raises :class:`ClusterError` naming the task;
* a placed model's ``fit``/``evaluate``/``predict`` (and the ``*_on_batch`` calls) run in a
  watched thread: a worker process that dies makes TensorFlow fail the step at once (its socket
  closes), and that error becomes a one-line :class:`ClusterError` naming the task and address;
  a worker that stops answering (a hung process, a lost machine) is caught by the watchdog when
  no batch finishes within ``step_timeout_s`` (the first batch of a call, which traces and
  ships the functions, gets :data:`FIRST_STEP_FACTOR` times that).

After a fault the placed copy is unusable (its variables on the lost task are gone), but the
original model's weights are untouched (the placed model is a copy) and nothing here writes the
plan file. Restart the worker, call :func:`connect` again and apply the plan again.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import keras
import tensorflow as tf

from cost_models.devices.catalog import DeviceKind
from cost_models.devices.datafiles import check_text_size, parse_json, read_text
from cost_models.devices.tf_config import (
    TF_CONFIG_EXAMPLE,
    TF_CONFIG_VARIABLE,
    TfConfig,
    address_host,
    check_addresses,
    parse_cluster_jobs,
    parse_tf_config,
)
from cost_models.devices.topology import bounded_tf_config_text
from partitioner.core.errors import RewriteError, UsageError
from partitioner.core.ir import Schedule
from partitioner.core.options import short_repr, short_text
from passes.cluster.loopback import (
    close_foreign_connections,
    is_loopback,
    listening_sockets,
    tie_listening,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONNECT_TIMEOUT_S",
    "DEFAULT_STEP_TIMEOUT_S",
    "FIRST_STEP_FACTOR",
    "MAX_CLUSTER_BYTES",
    "ClusterError",
    "ClusterHandle",
    "WorkerCluster",
    "connect",
    "guard_model",
    "load_cluster",
    "place_on_cluster",
    "probe_tasks",
    "remote_device_strings",
    "replicate_on_cluster",
]

DEFAULT_CONNECT_TIMEOUT_S = 30.0
DEFAULT_STEP_TIMEOUT_S = 30.0
FIRST_STEP_FACTOR = 10.0
"""The first batch of a call may take this many times ``step_timeout_s`` (tracing, shipping)."""

_TASK_IN_MESSAGE = re.compile(r"/job:(?P<job>[\w-]+)/replica:\d+/task:(?P<task>\d+)")
_CLUSTER_FAULT_WORDS = ("socket closed", "connection reset", "failed to connect", "grpc", "ping")


class ClusterError(RewriteError):
    """A cluster could not be reached, or a worker failed while the client used it."""


# -- the cluster description ---------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerCluster:
    """The tasks of a cluster: ``addresses[i]`` is task ``i`` of job ``job_name``.

    ``other_jobs`` keeps any further jobs of the description (``chief``, ``ps``) so the
    ``ClusterSpec`` a worker serves is the whole cluster; ``task_index`` is TF_CONFIG's
    ``task.index`` when its ``task.type`` is ``job_name``.
    """

    job_name: str
    addresses: tuple[str, ...]
    other_jobs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    task_index: int | None = None
    source: str = "cluster"
    task_type: str | None = None
    """TF_CONFIG's ``task.type`` (whichever job it names), for a worker's messages."""

    @property
    def num_tasks(self) -> int:
        return len(self.addresses)

    def as_dict(self) -> dict[str, list[str]]:
        """``{job: [addresses]}`` for ``tf.train.ClusterSpec``."""
        jobs = {self.job_name: list(self.addresses)}
        jobs.update({job: list(addrs) for job, addrs in self.other_jobs})
        return jobs

    def task_name(self, task: int) -> str:
        """``/job:worker/replica:0/task:<task>``."""
        return f"/job:{self.job_name}/replica:0/task:{task}"

    def describe(self, task: int) -> str:
        """``worker task 1 (127.0.0.1:2223)`` for messages."""
        address = self.addresses[task] if 0 <= task < self.num_tasks else "?"
        return f"{self.job_name} task {task} ({address})"


_CLUSTER_EXAMPLE = '{"worker": ["host0:2222", "host1:2222"]}'

MAX_CLUSTER_BYTES = 1 << 20
"""The largest cluster file read (1 MiB; TF_CONFIG has the same bound): a regular file, refused
without blocking otherwise (a FIFO, ``/dev/zero``, a directory)."""


def _read_cluster_data(
    cluster: Mapping[str, Any] | str | os.PathLike[str] | None,
) -> tuple[object, str]:
    """The parsed cluster description and where it came from (for messages)."""
    if isinstance(cluster, Mapping):
        return dict(cluster), "cluster"
    if isinstance(cluster, str) and not cluster.strip():
        raise UsageError(
            f"cluster={short_repr(cluster, 20)} is empty; give a cluster file, a mapping like "
            f"{_CLUSTER_EXAMPLE}, or a TF_CONFIG JSON string (os.environ['TF_CONFIG'])"
        )
    if isinstance(cluster, str) and cluster.lstrip().startswith("{"):
        text = check_text_size(cluster, "the cluster= string", UsageError, MAX_CLUSTER_BYTES)
        source = "the cluster= string (TF_CONFIG form)"
    elif cluster is None:
        variable = bounded_tf_config_text()
        if variable is None:
            raise UsageError(
                "no cluster given and TF_CONFIG is not set; give a cluster file (JSON like "
                f"{_CLUSTER_EXAMPLE}) or set TF_CONFIG"
            )
        text, source = variable, TF_CONFIG_VARIABLE
    elif isinstance(cluster, (str, os.PathLike)):
        path = Path(cluster)
        source = f"cluster file {str(path)!r}"
        text = read_text(
            path,
            source,
            UsageError,
            hint=f"pass a JSON file like {_CLUSTER_EXAMPLE}",
            max_bytes=MAX_CLUSTER_BYTES,
        )
    else:
        raise UsageError(
            f"cluster={short_repr(cluster, 60)} ({type(cluster).__name__}) is no cluster; give a "
            f"cluster file, a mapping like {_CLUSTER_EXAMPLE}, or a TF_CONFIG JSON string "
            "(os.environ['TF_CONFIG'])"
        )
    example = TF_CONFIG_EXAMPLE if source == TF_CONFIG_VARIABLE else _CLUSTER_EXAMPLE
    return parse_json(text, source, UsageError, hint=f"it should look like {example}"), source


def _cluster_config(data: object, source: str) -> TfConfig:
    """The TF_CONFIG form (``{"cluster": ..., "task": ...}``) or the bare ``{job: [...]}``
    form, through the one TF_CONFIG parser."""
    tf_config = source == TF_CONFIG_VARIABLE
    if not isinstance(data, dict):
        example = TF_CONFIG_EXAMPLE if tf_config else _CLUSTER_EXAMPLE
        raise UsageError(
            f"{source} must be a JSON object like {example}, got {type(data).__name__}"
        )
    if "cluster" in data or tf_config:  # TensorFlow reads no cluster from TF_CONFIG without it
        return parse_tf_config(data, origin=source, error=UsageError)
    return TfConfig(jobs=parse_cluster_jobs(data, origin=source, error=UsageError))


def load_cluster(
    cluster: Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    job_name: str = "worker",
) -> WorkerCluster:
    """The worker tasks of a cluster description (see the module docstring for the forms).

    ``cluster`` is a mapping, a path to a JSON file, or None for the ``TF_CONFIG`` environment
    variable; either way it is parsed by :mod:`cost_models.devices.tf_config`. Raises
    :class:`~partitioner.core.errors.UsageError` with the offending value.
    """
    data, source = _read_cluster_data(cluster)
    config = _cluster_config(data, source)
    if job_name not in config.job_names:
        raise UsageError(
            _no_job(config, source, job_name, isinstance(data, dict) and "cluster" in data)
        )
    config = check_addresses(config, origin=source, error=UsageError)
    workers = config.addresses(job_name)
    others = tuple((job, addrs) for job, addrs in config.jobs if job != job_name)
    task_index = config.task_index if config.task_type == job_name else None
    return WorkerCluster(job_name, workers, others, task_index, source, config.task_type)


def _no_job(config: TfConfig, source: str, job_name: str, tf_config_form: bool) -> str:
    """Why ``config`` has no task to serve for ``job_name``, and the next step in the form the
    cluster was given in (TF_CONFIG's jobs are read only under ``cluster``)."""
    jobs = ", ".join(short_text(j) for j in config.job_names) or "none"
    workers = f'{{"{job_name}": ["host0:2222", "host1:2222"]}}'
    form = f'{{"cluster": {workers}}}' if tf_config_form else workers
    head = f"{source} has no job {short_repr(job_name, 60)} (jobs found: {jobs})"
    task = config.task_type
    if task is not None and task != job_name and task in config.job_names:
        return (
            f"{head}, and its task is of job {task!r}: serve that job instead (partition worker "
            f"--job {task}), or list the {job_name!r} tasks as {form}"
        )
    return f"{head}; list the {job_name!r} tasks as {form}"


# -- reachability --------------------------------------------------------------------------------


def _split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"
"""An HTTP/2 client preface and an empty SETTINGS frame: a live gRPC server answers at once."""


def _task_state(address: str, timeout_s: float) -> str:
    """``"up"``, ``"down"`` (no connection) or ``"silent"`` (connects, but the server says
    nothing: a stopped or hung process whose kernel still accepts connections)."""
    try:
        with socket.create_connection(_split_address(address), timeout=timeout_s) as conn:
            conn.settimeout(timeout_s)
            try:
                conn.sendall(_HTTP2_PREFACE)
                return "up" if conn.recv(9) else "down"
            except TimeoutError:
                return "silent"
    except OSError:
        return "down"


def probe_tasks(cluster: WorkerCluster, *, timeout_s: float = 1.0) -> tuple[int, ...]:
    """The tasks that do not answer within ``timeout_s`` (each): down, hung or not a server.

    A task answers when its port accepts a TCP connection and its gRPC server sends its
    HTTP/2 settings, which a stopped or hung process does not.
    """
    return tuple(
        task
        for task, address in enumerate(cluster.addresses)
        if _task_state(address, timeout_s) != "up"
    )


def _describe_states(cluster: WorkerCluster, timeout_s: float) -> str | None:
    """``worker task 1 (h:p) is down`` for the tasks that do not answer, or None."""
    parts = []
    for task, address in enumerate(cluster.addresses):
        state = _task_state(address, timeout_s)
        if state == "down":
            parts.append(f"{cluster.describe(task)} is down")
        elif state == "silent":
            parts.append(f"{cluster.describe(task)} does not answer")
    return "; ".join(parts) or None


def _wait_for_tasks(cluster: WorkerCluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        down = probe_tasks(cluster, timeout_s=min(1.0, max(0.05, timeout_s)))
        if not down:
            return
        if time.monotonic() >= deadline:
            states = _describe_states(cluster, timeout_s=1.0) or cluster.describe(down[0])
            raise ClusterError(
                f"{states} (waited {timeout_s:g} s); start it with `partition worker --task "
                f"{down[0]} --cluster FILE` and connect again"
            )
        time.sleep(0.1)


def _bounded(what: str, fn: Callable[[], Any], timeout_s: float) -> Any:
    """``fn()`` in a daemon thread; None if it does not return within ``timeout_s``.

    Exceptions from ``fn`` are re-raised here. A call that does not return keeps its thread (TF
    offers no way to cancel a remote call); the caller reports the fault.
    """
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"partitioner-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None
    if "error" in box:
        raise box["error"]
    return box.get("result", True)


# -- connecting ----------------------------------------------------------------------------------


def _canonical(device: str) -> str:
    """``/job:worker/task:1/device:CPU:0`` -> ``/job:worker/replica:0/task:1/device:CPU:0``."""
    try:
        spec = tf.DeviceSpec.from_string(device)
    except ValueError:
        return device
    if spec.job is not None and spec.replica is None:
        spec = spec.replace(replica=0)
    if spec.job is not None and spec.task is None:
        spec = spec.replace(task=0)
    return str(spec.to_string())


@dataclass(frozen=True)
class ClusterHandle:
    """A connected cluster: its tasks and the devices TensorFlow lists on them."""

    cluster: WorkerCluster
    device_names: tuple[str, ...]
    """Every device of the cluster's job, canonical (``/job:j/replica:0/task:i/device:T:k``)."""
    local_device_names: tuple[str, ...] = ()
    timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S

    def task_devices(self, task: int, kind: DeviceKind) -> tuple[str, ...]:
        """The ``kind`` (GPU or CPU) devices of ``task``, in index order."""
        prefix = f"{self.cluster.task_name(task)}/device:{kind.tf_name}:"
        found = [d for d in self.device_names if d.startswith(prefix)]
        return tuple(sorted(found, key=lambda d: int(d.rsplit(":", 1)[1])))

    def plan_devices(self, task: int) -> tuple[str, ...]:
        """The devices of ``task`` a plan's devices map to: its GPUs, or its CPUs if none."""
        return self.task_devices(task, DeviceKind.GPU) or self.task_devices(task, DeviceKind.CPU)

    def devices_per_task(self) -> tuple[int, ...]:
        """How many plan devices each task holds (:meth:`plan_devices`)."""
        return tuple(len(self.plan_devices(t)) for t in range(self.cluster.num_tasks))

    def task_of(self, device: str) -> int | None:
        """The task of a device string of this cluster's job, else None."""
        match = _TASK_IN_MESSAGE.search(_canonical(device))
        if match is None or match.group("job") != self.cluster.job_name:
            return None
        return int(match.group("task"))


def connect(
    cluster: WorkerCluster | Mapping[str, Any] | str | os.PathLike[str] | None,
    *,
    job_name: str = "worker",
    timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> ClusterHandle:
    """Make this process the client of ``cluster`` and list its devices, within ``timeout_s``.

    Waits (up to ``timeout_s``) for every task to accept connections, so workers still
    starting are fine. Raises :class:`ClusterError` naming a task that is down or does not
    answer. Connecting again (to the same or another cluster) invalidates tensors and
    variables on the old remote devices.
    """
    from passes.cluster.calibrate import check_timeout_s

    timeout_s = check_timeout_s("timeout_s", timeout_s)
    spec = (
        cluster if isinstance(cluster, WorkerCluster) else load_cluster(cluster, job_name=job_name)
    )
    if "localhost" in dict(spec.other_jobs) or spec.job_name == "localhost":
        raise UsageError(
            f"{spec.source} has a job named 'localhost'; the client joins under that name, so "
            "rename the job"
        )
    _wait_for_tasks(spec, timeout_s)
    _warn_single_inter_op_thread()
    before = listening_sockets()
    names = _connect_and_list(spec, timeout_s)
    _client_kept_local(spec, {p for i, p in listening_sockets().items() if i not in before})
    remote = _remote_devices(spec, names)
    local = tuple(n for n in names if n not in remote)
    logger.info("connected to %s: %s", spec.source, ", ".join(remote))
    return ClusterHandle(spec, remote, local, timeout_s)


def _client_kept_local(spec: WorkerCluster, ports: set[int]) -> None:
    """The client's own gRPC server (``ports``: the listeners the connect opened) tied to the
    loopback device when every task of the cluster is on this machine, and connections from
    other hosts made before the tie shut: TensorFlow listens on every interface, where another
    host could send it graphs to run. On a cluster of other hosts the workers must reach it,
    and it is left as TensorFlow made it."""
    others = (a for _, addresses in spec.other_jobs for a in addresses)
    hosts = {address_host(a) for a in (*spec.addresses, *others)}
    if not ports or not all(is_loopback(h) for h in hosts):
        return
    for port in ports:
        _, problem = tie_listening(port)
        close_foreign_connections(port)  # any another host made before the tie
        if problem:
            logger.warning(
                "the client's server on port %d listens on every interface (%s), though the "
                "cluster is on this machine",
                port,
                problem,
            )


def _warn_single_inter_op_thread() -> None:
    """Warn when this client forces one inter-op thread (the workers' function runs take the
    client's config over, and a pipeline stage's sends then wait behind its work)."""
    if tf.config.threading.get_inter_op_parallelism_threads() == 1:
        logger.warning(
            "this client sets 1 inter-op thread, which the workers' function runs take over: a "
            "pipeline stage then sends its activations only after all of its queued work; leave "
            "tf.config.threading.set_inter_op_parallelism_threads unset (partitioner.cli.worker)"
        )


def _connect_and_list(spec: WorkerCluster, timeout_s: float) -> tuple[str, ...]:
    """Connect to the cluster and list every device (canonical names), within ``timeout_s``."""
    try:
        tf.config.experimental_connect_to_cluster(tf.train.ClusterSpec(spec.as_dict()))
    except (ValueError, tf.errors.OpError) as exc:
        raise ClusterError(f"could not connect to {spec.source}: {_first_line(exc)}") from None
    try:
        devices = _bounded("connect", tf.config.list_logical_devices, timeout_s)
    except tf.errors.OpError as exc:
        raise ClusterError(
            f"the cluster in {spec.source} did not come up: {_first_line(exc)}; check that every "
            "worker runs `partition worker` with this cluster file"
        ) from None
    if devices is None:
        down = probe_tasks(spec)
        if not down:  # every task takes a connection: the bound was too short for the connect
            raise ClusterError(
                f"every task of {spec.source} accepts connections, but the cluster's devices "
                f"were not listed within timeout_s={timeout_s:g} s; give a longer timeout "
                "(connecting takes about a second)"
            )
        raise ClusterError(
            f"{spec.describe(down[0])} did not answer within {timeout_s:g} s while connecting; "
            f"check that every task runs `partition worker` with the same cluster "
            f"({', '.join(spec.addresses)})"
        )
    return tuple(_canonical(d.name) for d in devices)


def _remote_devices(spec: WorkerCluster, names: Sequence[str]) -> tuple[str, ...]:
    """The devices of the cluster's job; ClusterError when a task lists none."""
    remote = tuple(n for n in names if n.startswith(f"/job:{spec.job_name}/"))
    missing = [t for t in range(spec.num_tasks) if not any(
        n.startswith(spec.task_name(t) + "/") for n in remote
    )]  # fmt: skip
    if missing:
        raise ClusterError(
            f"connected, but TensorFlow lists no device on {spec.describe(missing[0])}; is a "
            "`partition worker` of this cluster serving there?"
        )
    return remote


# -- plan devices -> remote device strings -------------------------------------------------------


class _DeviceLike(Protocol):
    @property
    def index(self) -> int: ...

    @property
    def host(self) -> int: ...

    @property
    def name(self) -> str: ...


def _task_device(handle: ClusterHandle, task: int, slot: int, what: str) -> str:
    if not 0 <= task < handle.cluster.num_tasks:
        raise ClusterError(
            f"{what} needs task {task}, but the cluster has {handle.cluster.job_name} tasks "
            f"0..{handle.cluster.num_tasks - 1}; start more workers or plan for fewer devices"
        )
    pool = handle.plan_devices(task)
    if slot >= len(pool):
        gpus = handle.task_devices(task, DeviceKind.GPU)
        kind = (DeviceKind.GPU if gpus else DeviceKind.CPU).tf_name
        raise ClusterError(
            f"{what} is device {slot} of {handle.cluster.describe(task)}, which has "
            f"{len(pool)} {kind} device(s); plan for fewer devices per task"
        )
    return pool[slot]


def _one_host_slot(handle: ClusterHandle, position: int, count: int) -> tuple[int, int]:
    """(task, device slot) of one-host plan device ``position`` of ``count``: task ``position``
    when the tasks are enough, else the tasks' devices filled in order."""
    if count <= handle.cluster.num_tasks:
        return position, 0
    for task, held in enumerate(handle.devices_per_task()):
        if position < held:
            return task, position
        position -= held
    return handle.cluster.num_tasks + position, 0  # past the last task: _task_device says so


def remote_device_strings(
    handle: ClusterHandle, devices: Sequence[_DeviceLike | int | str]
) -> tuple[str, ...]:
    """The remote TensorFlow device of each plan device.

    * a device string (or a plan device whose ``name`` is set, as a ``tf-config`` topology names
      them) is used as it is, once checked against the cluster's devices;
    * an integer ``i`` is task ``i``'s first GPU, or its CPU when it has none;
    * plan devices without a name: when they all share one host, plan device ``i`` goes to task
      ``i`` (when there are more of them than tasks, they fill the tasks' devices in order: task
      0's GPUs, or CPUs, then task 1's, ...); when they name several hosts, host ``h`` is task
      ``h`` and its ``k``-th device is the task's ``k``-th GPU (or CPU).
    """
    known = set(handle.device_names) | set(handle.local_device_names)
    unnamed = [d for d in devices if not isinstance(d, (int, str)) and not d.name]
    one_host = len({d.host for d in unnamed}) <= 1
    slot_on_host: dict[int, int] = {}
    out: list[str] = []
    for position, device in enumerate(devices):
        if isinstance(device, bool):
            raise UsageError(f"device {device!r} is neither an index nor a device string")
        if isinstance(device, int):
            out.append(_task_device(handle, device, 0, f"device {device}"))
            continue
        name = device if isinstance(device, str) else device.name
        if name:
            canonical = _canonical(name)
            if canonical not in known:
                raise ClusterError(
                    f"plan device {position} is {name!r}, which the cluster does not have; "
                    f"its devices are {sorted(known)}"
                )
            out.append(canonical)
            continue
        assert not isinstance(device, str)
        what = f"plan device {device.index}"
        if one_host:
            task, slot = _one_host_slot(handle, position, len(devices))
            out.append(_task_device(handle, task, slot, what))
        else:
            slot = slot_on_host.get(device.host, 0)
            slot_on_host[device.host] = slot + 1
            out.append(_task_device(handle, device.host, slot, what))
    if len(set(out)) != len(out):
        raise ClusterError(
            f"two plan devices map to one cluster device: {out}; give each plan device its own"
        )
    return tuple(out)


# -- faults during use ---------------------------------------------------------------------------


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) if str(exc).strip() else type(exc).__name__
    # TF messages start with "Graph execution error: Detected at node ... ": keep the cause.
    for marker in ("UNAVAILABLE:", "ABORTED:", "DEADLINE_EXCEEDED:", "CANCELLED:", "INTERNAL:"):
        at = text.find(marker)
        if at >= 0:
            text = text[at:]
            break
    cut = text.find(" Additional GRPC error information")
    if cut > 0:
        text = text[:cut]
    return text[:240] + ("..." if len(text) > 240 else "")


def _is_cluster_fault(exc: BaseException) -> bool:
    if isinstance(
        exc,
        (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.DeadlineExceededError),
    ):
        return True
    if isinstance(exc, tf.errors.OpError):
        text = str(exc).lower()
        return any(word in text for word in _CLUSTER_FAULT_WORDS)
    return False


def _fault_message(handle: ClusterHandle, what: str, cause: str, steps: int) -> str:
    cluster = handle.cluster
    states = _describe_states(cluster, timeout_s=1.0)
    named = [int(m.group("task")) for m in _TASK_IN_MESSAGE.finditer(cause)
             if m.group("job") == cluster.job_name]  # fmt: skip
    if states is not None:
        who = states
    elif named:
        who = f"{cluster.describe(named[0])} failed"
    else:
        who = f"a {cluster.job_name} task failed"
    return (
        f"{who}: {what} stopped after {steps} batch(es): {cause}; restart the worker, then "
        "connect() and apply the plan again (the original model and the plan file are unchanged)"
    )


class _Progress(keras.callbacks.Callback):
    """Notes the time of every batch boundary, for the stall watchdog."""

    def __init__(self) -> None:
        super().__init__()
        self.last_s = time.monotonic()
        self.batches = 0

    def _tick(self, *args: Any, **kwargs: Any) -> None:
        self.last_s = time.monotonic()

    def _done(self, *args: Any, **kwargs: Any) -> None:
        self.last_s = time.monotonic()
        self.batches += 1

    on_train_batch_begin = on_test_batch_begin = on_predict_batch_begin = _tick
    on_train_batch_end = on_test_batch_end = on_predict_batch_end = _done
    on_epoch_begin = on_epoch_end = _tick


_WATCHED_WITH_CALLBACKS = ("fit", "evaluate", "predict")
_WATCHED_PLAIN = ("train_on_batch", "test_on_batch", "predict_on_batch")


def _watch(
    handle: ClusterHandle,
    what: str,
    method: Callable[..., Any],
    step_timeout_s: float | None,
    with_callbacks: bool,
) -> Callable[..., Any]:
    def watched(*args: Any, **kwargs: Any) -> Any:
        progress = _Progress()
        if with_callbacks:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), progress]
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["result"] = method(*args, **kwargs)
            except BaseException as exc:  # handed to the caller's thread
                box["error"] = exc

        thread = threading.Thread(target=target, name=f"partitioner-{what}", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            if step_timeout_s is None or not thread.is_alive():
                continue
            allowed = step_timeout_s * (FIRST_STEP_FACTOR if progress.batches == 0 else 1.0)
            if time.monotonic() - progress.last_s > allowed:
                cause = f"no batch finished within {allowed:g} s"
                raise ClusterError(_fault_message(handle, what, cause, progress.batches))
        if "error" in box:
            error = box["error"]
            if _is_cluster_fault(error):
                message = _fault_message(handle, what, _first_line(error), progress.batches)
                raise ClusterError(message) from None
            raise error
        return box.get("result")

    return watched


def guard_model(
    model: keras.Model,
    handle: ClusterHandle,
    *,
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
) -> keras.Model:
    """Make ``model``'s training and inference calls fail fast on cluster faults (in place).

    ``fit``/``evaluate``/``predict``/``*_on_batch`` run in a watched thread: a cluster error
    (a worker's socket closes) becomes a one-line :class:`ClusterError`, and so does no batch
    finishing within ``step_timeout_s`` (None turns the watchdog off). Meant for the fresh
    copy :func:`place_on_cluster` makes; returns ``model``.
    """
    if step_timeout_s is not None:
        from passes.cluster.calibrate import check_timeout_s

        step_timeout_s = check_timeout_s("step_timeout_s", step_timeout_s)
    for name in (*_WATCHED_WITH_CALLBACKS, *_WATCHED_PLAIN):
        method = getattr(model, name)
        watched = _watch(handle, name, method, step_timeout_s, name in _WATCHED_WITH_CALLBACKS)
        object.__setattr__(model, name, watched)
    object.__setattr__(model, "cluster", handle)
    return model


def place_on_cluster(
    model: keras.Model,
    layer_devices: Mapping[str, str],
    sample_inputs: Sequence[Any],
    handle: ClusterHandle,
    *,
    num_microbatches: int | None = None,
    schedule: Schedule | None = None,
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
) -> keras.Model:
    """A copy of ``model`` with each layer on its remote device, guarded against faults.

    ``layer_devices`` maps layer names to device strings of ``handle`` (see
    :func:`remote_device_strings`). With ``num_microbatches`` (and a pipelining ``schedule``)
    the copy is a :class:`passes.rewrite.pipeline.PipelinedModel`, else a
    :class:`passes.rewrite.device_placement.PlacedModel`; either way :func:`guard_model` bounds its
    calls. Creating the remote variables is bounded by the handle's ``timeout_s``.
    """
    _check_layer_devices(handle, layer_devices)
    if (num_microbatches is None) != (schedule is None):
        raise UsageError("pass both num_microbatches and schedule to pipeline, or neither")

    def build() -> keras.Model:
        return _placed_copy(model, layer_devices, sample_inputs, num_microbatches, schedule)

    placed = _bounded_placement(handle, build)
    return guard_model(placed, handle, step_timeout_s=step_timeout_s)


def _check_layer_devices(
    handle: ClusterHandle, layer_devices: Mapping[str, str], replica: int | None = None
) -> None:
    """ClusterError for a layer placed on a device the cluster does not have."""
    known = set(handle.device_names) | set(handle.local_device_names)
    whose = "" if replica is None else f" of replica {replica}"
    for layer, device in layer_devices.items():
        if _canonical(device) not in known:
            raise ClusterError(
                f"layer {layer!r}{whose} is placed on {device!r}, which the cluster does not "
                f"have; its devices are {sorted(handle.device_names)}"
            )


def _device_keys(devices: Sequence[str]) -> tuple[str, ...]:
    """The canonical names of ``devices`` (already checked against the cluster), one key per
    device for the replica layout checks; RewriteError when one device is named twice."""
    keys = tuple(_canonical(d) for d in devices)
    for k, key in enumerate(keys):
        if key in keys[:k]:
            raise RewriteError(
                f"device {devices[k]!r} is named twice ({devices[keys.index(key)]!r}); each "
                "replica and stage needs a device of its own"
            )
    return keys


def replicate_on_cluster(
    model: keras.Model,
    layer_devices_per_replica: Sequence[Mapping[str, str]],
    sample_inputs: Sequence[Any],
    handle: ClusterHandle,
    *,
    num_microbatches: int = 1,
    schedule: Schedule = Schedule.NONE,
    step_timeout_s: float | None = DEFAULT_STEP_TIMEOUT_S,
) -> keras.Model:
    """``R = len(layer_devices_per_replica)`` copies of ``model`` on the cluster's devices,
    trained data-parallel (one device per replica) or hybrid (pipelined replicas), guarded
    against faults as :func:`place_on_cluster` guards its copy.

    ``layer_devices_per_replica[r]`` maps each layer to replica ``r``'s device string of
    ``handle``. The copy is a :class:`passes.rewrite.replicate.ReplicatedPipeline` (module
    docstring there): each step splits the batch into ``R`` shares, each replica computes its
    gradients on its devices, and each variable's ``R`` gradients are reduced once on replica
    0's device of it and applied by every replica. ``fit`` and ``train_on_batch`` are driven
    from the client. Creating the remote variables is bounded by the handle's ``timeout_s``.
    """
    plans = [dict(p) for p in layer_devices_per_replica]
    for r, plan in enumerate(plans):
        _check_layer_devices(handle, plan, r)

    def build() -> keras.Model:
        from passes.rewrite.replicate import replicate_pipeline

        return replicate_pipeline(
            model,
            plans,
            num_microbatches=num_microbatches,
            schedule=schedule,
            sample_inputs=sample_inputs,
            check_devices=_device_keys,
        )

    replicated = _bounded_placement(handle, build)
    return guard_model(replicated, handle, step_timeout_s=step_timeout_s)


def _placed_copy(
    model: keras.Model,
    layer_devices: Mapping[str, str],
    sample_inputs: Sequence[Any],
    num_microbatches: int | None,
    schedule: Schedule | None,
) -> keras.Model:
    """The pipelined copy (with micro-batches) or the placed copy of ``model``."""
    if num_microbatches is not None and schedule is not None:
        from passes.rewrite.pipeline import pipeline_model

        return pipeline_model(
            model,
            layer_devices,
            num_microbatches=num_microbatches,
            schedule=schedule,
            sample_inputs=sample_inputs,
        )
    from passes.rewrite.device_placement import place_model

    return place_model(model, layer_devices, sample_inputs)


def _bounded_placement(handle: ClusterHandle, build: Callable[[], keras.Model]) -> keras.Model:
    """``build()`` within the handle's ``timeout_s``; cluster faults become ClusterError."""
    what = "placing the model"
    try:
        placed = _bounded("place", build, handle.timeout_s)
    except tf.errors.OpError as exc:
        if not _is_cluster_fault(exc):
            raise
        raise ClusterError(_fault_message(handle, what, _first_line(exc), 0)) from None
    if placed is None:
        cause = f"creating the remote variables took over {handle.timeout_s:g} s"
        raise ClusterError(_fault_message(handle, what, cause, 0))
    return placed
