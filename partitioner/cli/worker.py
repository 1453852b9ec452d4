"""``partition worker``: one task of a TensorFlow cluster that a client places layers on.

``run_worker(task_index, cluster)`` starts a ``tf.distribute.Server`` for task ``task_index`` of
the ``worker`` job (the cluster comes from a mapping, a JSON file, or the ``TF_CONFIG``
environment variable; see :func:`passes.cluster.runtime.load_cluster`), with ``threads`` intra-op
threads (default 1: each kernel on one core), ``inter_op_threads`` inter-op threads (default
``max(MIN_INTER_OP_THREADS, threads)``, four on one core, see below) and, optionally, the
process pinned to given CPU cores. It serves until SIGTERM or SIGINT and then returns 0; it never
writes a traceback for a stop.

Thread pools. A client's functions run on a worker in an eager context that the *client*
creates there, configured by the session config the client ships when it connects
(``tf.config.experimental_connect_to_cluster`` sends a copy of the client's own config); the
worker's server config does not reach it. Where the client leaves a thread count at 0 (the
default), TensorFlow takes it from the worker's ``TF_NUM_INTEROP_THREADS`` /
``TF_NUM_INTRAOP_THREADS`` environment, else from the cores the worker may use. So
:func:`run_worker` sets those two variables from ``inter_op_threads`` and ``threads``.

Why two inter-op threads. With one inter-op thread, a worker whose stage tasks are chained
(:mod:`passes.rewrite.pipeline`) hands micro-batch 0's activations to the next stage only after it has
computed *every* forward: measured with ``passes.rewrite.pipeline.measure_task_times`` on
``benchmarks.cluster_pipeline``'s model (8 x Dense(1024), M = 8, workers pinned to one core
each), stage 1's first forward ended 94 ms after it could start instead of 11-15 ms, and the
same happened with 1 inter-op thread set by the client, not with 2 (our reading: the executor
runs a chain of ready kernels on its thread and queues the other ready ones, the ``_Send``
among them, on the pool, whose only thread is that one). With two inter-op threads the sends
go out at once. A worker pinned to one core still computes on that one core (kernels are
single-threaded with ``threads = 1``); the second thread mostly runs sends and waits.

Why four. Two are not enough when a worker has two chains of kernels ready at once (two towers
of a multi-branch model, say): both threads run a chain and the sends wait behind them. The
multi_tower model of ``benchmarks.cluster_zoo`` with towers 0-1 on one worker and 2-3 on the
other (workers pinned to one core each): with two inter-op threads its training step took
338-356 ms against 376-385 ms for the whole model on one worker, the second worker starting its
towers' backward only after the first had finished its own; with four, 274 ms against 382 ms
(interleaved rounds of both placements, from one client).
Idle threads cost nothing; a worker still computes on its cores.

A client (:func:`passes.cluster.runtime.connect`) adds itself to the cluster as its own job, so the
cluster file lists only the workers::

    {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}

or, in ``TF_CONFIG`` form, ``{"cluster": {"worker": [...]}, "task": {"type": "worker",
"index": 0}}`` (then ``--task`` may be left out).

Who may connect. A TensorFlow worker executes any graph a client sends it, with the rights of
its process (read and write files, run ops): there is no authentication. So a worker serves
this machine only unless told otherwise: ``bind`` (``--bind``) is ``127.0.0.1`` by default.
TensorFlow's gRPC server itself always listens on every interface (``0.0.0.0``/``[::]``, fixed
in its C++: ``tf.distribute.Server`` and its ``ServerDef`` take a port, never an address); for a
loopback ``bind`` the worker ties the listening socket to the loopback device
(``SO_BINDTODEVICE lo``, Linux), so connections from other hosts are refused, and it stops
with one line if that cannot be done (:mod:`passes.cluster.loopback`). It does so from a thread
that watches for the socket while the server starts (started through TensorFlow's C API
without Python's interpreter lock, so the thread runs meanwhile), ties it the moment it is bound
(before or just after it listens), and ties it again once the server is up. Then, before it
says it is ready, it shuts down every connection from a non-loopback address that the server
accepted before the tie (a tie refuses new ones but keeps those; one log line names how many),
and while it serves it does the same every half second. What remains: the window between the
server's ``listen`` and the tie, one look of the thread (about 0.1 ms here; longer if the
machine keeps the thread waiting; none when the thread catches the socket between its ``bind``
and ``listen``, which measured runs did not), in which another host may open a connection that
then lives until the sweep shuts it, before "ready". TensorFlow offers no way to listen on
loopback alone; without its C API at hand (another build) the window is the server's start-up,
a few milliseconds, and the sweep still closes what came through. A task whose cluster address is not on this machine's
loopback is refused in one line under the default; naming another address of this machine
(``--bind 0.0.0.0``, an interface's IP) serves every interface, with a one-line warning. A
``--bind`` that is no such address (empty, a typo like ``127.0.0.l``, a name that does not
resolve, a host name beyond loopback, an address this machine does not have, or one that no
host is: a broadcast address such as ``255.255.255.255``, a multicast or reserved one, which
the kernel would let a socket bind) is refused in one line before anything starts: it never
falls back to every interface.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, BinaryIO

from partitioner.cli.parsing import OneLineParser
from partitioner.cli.quiet import hold_native_lines, import_quietly
from partitioner.core.errors import PartitionError, UsageError
from partitioner.core.files import (
    check_links_followed,
    file_kind,
    write_atomic,
    written_by_partitioner,
)
from partitioner.core.jsonfiles import json_digest
from passes.cluster.loopback import (
    EarlyTie,
    close_foreign_connections,
    is_loopback,
    settle_foreign_connections,
    start_server_unlocked,
    tie_listening,
)

if TYPE_CHECKING:
    from passes.cluster.runtime import WorkerCluster

logger = logging.getLogger(__name__)

__all__ = [
    "LOG_HEADER",
    "LocalWorkers",
    "check_bind",
    "free_ports",
    "main",
    "run_worker",
    "start_local_workers",
]

LOOPBACK = "127.0.0.1"
"""The default ``--bind``: this machine only."""
MIN_INTER_OP_THREADS = 4
"""A worker's inter-op threads unless told (or ``--threads`` is larger): see the module docstring."""
MAX_THREADS = 1024
"""The most threads in each of a worker's pools (``--threads``, ``--inter-op-threads``).
TensorFlow starts one OS thread per count when the server starts, each with its stack, so
``--threads 100000000`` exhausted memory; more threads than cores only take turns on them, and
1024 is four times the cores of the largest common CPU hosts. A fixed bound, not one from this
machine's cores, so one command line behaves alike on every host of a cluster."""

WORKER_WARNING = (
    "a TensorFlow worker executes any graph a client sends it, with this process's rights, "
    "and asks no password: let only trusted hosts reach it"
)

READY_PREFIX = "partition worker ready:"
"""The first line a worker writes to stdout once its server accepts connections."""


def _pin_to_cores(cores: Sequence[int]) -> None:
    available = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    bad = [c for c in cores if c not in available]
    if bad or not cores:
        raise UsageError(
            f"--cores {','.join(map(str, cores)) or '(none)'}: this machine's process may use "
            f"cores {available}; pick cores from that list"
        )
    os.sched_setaffinity(0, set(cores))


def run_worker(
    task_index: int | None,
    cluster_spec: Mapping[str, Any] | str | Path | None,
    *,
    job_name: str = "worker",
    threads: int = 1,
    inter_op_threads: int | None = None,
    cores: Sequence[int] | None = None,
    on_ready: Callable[[int, str], None] | None = None,
    stop: threading.Event | None = None,
    bind: str = LOOPBACK,
    warn_open: bool = True,
) -> int:
    """Serve task ``task_index`` of job ``job_name`` until SIGTERM/SIGINT (or ``stop`` is set).

    ``cluster_spec`` is a ``{job: [addresses]}`` or TF_CONFIG-style mapping, a path to a JSON
    file holding one, or None for the ``TF_CONFIG`` environment variable; ``task_index`` None
    takes TF_CONFIG's ``task.index``. ``threads`` sets TensorFlow's intra-op thread pool and
    ``inter_op_threads`` its inter-op pool (None: ``max(MIN_INTER_OP_THREADS, threads)``), for
    the server and, via ``TF_NUM_INTRAOP_THREADS``/``TF_NUM_INTEROP_THREADS``, for the functions
    a client runs here (unless the client's own config sets them; see the module docstring);
    ``cores`` pins the process to those CPU cores (Linux). ``on_ready(task, address)`` is called
    once the server listens. ``bind`` is who may connect: a loopback address (the default) ties
    the server to this machine (module docstring), an explicit other address of this machine
    (``0.0.0.0``) lets every interface in (a warning on this module's logger unless
    ``warn_open`` is False: the command line says it itself), and anything else (empty, a typo)
    is refused before anything starts (:func:`check_bind`). Returns the exit status (0 after a
    stop). Signal handlers are installed only when called from the main thread.
    """
    inter_op = _thread_counts(threads, inter_op_threads)
    loopback_only = check_bind(bind)
    from passes.cluster.runtime import load_cluster

    cluster = load_cluster(cluster_spec, job_name=job_name)
    index = _task_index(cluster, task_index, job_name)
    _check_reach(cluster.addresses[index], index, bind if warn_open else None, loopback_only)
    if cores is not None:
        _pin_to_cores(cores)
    stop_event = stop if stop is not None else threading.Event()
    if threading.current_thread() is threading.main_thread():
        _stop_on_signals(index, stop_event)
    address = cluster.addresses[index]
    port = _port(address) if loopback_only else 0
    early = EarlyTie(port) if loopback_only else None
    try:
        server = _start_server(cluster, job_name, index, threads, inter_op)
    finally:
        if early is not None:
            early.stop()
    if loopback_only:
        _secure_start(port, early)
    logger.info("worker task %d of job %r serving at %s (%s)", index, job_name, address, server)
    if on_ready is not None:
        on_ready(index, address)
    # server.join() blocks in C++ where no signal handler runs; wait on the event instead.
    while not stop_event.wait(0.5):
        if loopback_only:
            _sweep_foreign(port)
    logger.info("worker task %d stopped", index)
    return 0


def _check_reach(address: str, index: int, bind: str | None, loopback_only: bool) -> None:
    """A loopback-only worker's cluster address is this machine's loopback; an open one is a
    warning naming ``bind`` (None: the caller warns itself)."""
    if loopback_only:
        _check_loopback_address(address, index)
    elif bind is not None:
        logger.warning("bind=%r: listening on every interface; %s", bind, WORKER_WARNING)


def _host(address: str) -> str:
    """``host`` of ``host:port`` (``[::1]:2222`` -> ``::1``)."""
    return address.rpartition(":")[0].strip("[]")


def _port(address: str) -> int:
    """``port`` of ``host:port``."""
    try:
        return int(address.rpartition(":")[2])
    except ValueError:
        raise UsageError(f"cluster address {address!r} has no port; write it host:port") from None


def check_bind(bind: str) -> bool:
    """Whether ``bind`` keeps the worker to this machine (True) or opens it to every interface
    (False); :class:`UsageError` naming the value when it is no address (empty, a typo like
    ``127.0.0.l``, a name that does not resolve), a host name that is not loopback (give the
    address itself), an address that is not this machine's, or one that is no host's
    (broadcast, multicast, reserved: :func:`_not_unicast`). Fails closed: nothing but an
    explicit non-loopback address of this machine (``0.0.0.0``, ``::``, an interface's IP)
    opens it."""
    if not isinstance(bind, str) and bind is not None:
        raise UsageError(
            f"--bind {bind!r} is not a string (its type is {type(bind).__name__}); give the "
            f"address as text, such as '0.0.0.0', or leave it out to serve this machine only "
            f"({LOOPBACK})"
        )
    if not isinstance(bind, str) or not bind.strip():
        raise UsageError(
            f"--bind {bind!r} is not an address; leave it out to serve this machine only "
            f"({LOOPBACK}), or give an address such as 0.0.0.0 to serve other hosts"
        )
    host = _unbracketed(bind.strip())
    try:
        literal = ipaddress.ip_address(host)
    except ValueError:
        literal = None
    if literal is None:
        if is_loopback(host):
            return True
        raise UsageError(
            f"--bind {bind!r} is not an IP address, and as a host name it "
            f"{'names addresses beyond loopback' if _resolves(host) else 'does not resolve'}; "
            f"give {LOOPBACK} (this machine only) or the IP address to serve, such as 0.0.0.0"
        )
    if isinstance(literal, ipaddress.IPv6Address) and literal.ipv4_mapped is not None:
        literal = literal.ipv4_mapped  # ::ffff:a.b.c.d is a.b.c.d
    if literal.is_loopback:
        return True
    kind = _not_unicast(literal)
    if kind is not None:
        raise UsageError(
            f"--bind {bind!r} is {kind}, not an address of this machine to serve on; give "
            f"{LOOPBACK} (this machine only), 0.0.0.0 or one of its interfaces' addresses"
        )
    _check_local_address(bind, literal)
    return False


def _unbracketed(bind: str) -> str:
    """``bind`` without the one pair of brackets an IPv6 address may be written in (``[::1]``);
    :class:`UsageError` for brackets that are not one such pair (``[0.0.0.0``, ``[[::]]``): a
    typo, not an address, even where what is left would be one."""
    inner = bind[1:-1] if bind.startswith("[") and bind.endswith("]") else bind
    if "[" in inner or "]" in inner:
        raise UsageError(
            f"--bind {bind!r} is not an address (its brackets are not one pair around an IPv6 "
            f"address, as in [::1]); give {LOOPBACK} (this machine only) or the IP address to "
            "serve, such as 0.0.0.0"
        )
    return inner


LIMITED_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


def _not_unicast(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """What ``address`` is when no single host is it (a socket may still bind it on Linux,
    and TensorFlow would then listen on every interface), else None. The unspecified address
    (``0.0.0.0``, ``::``) is None: it means every interface, knowingly."""
    if address.is_unspecified:
        return None
    if address == LIMITED_BROADCAST:
        return "the limited broadcast address"
    if address.is_multicast:
        return "a multicast address"
    if address.is_reserved:
        return "a reserved address"
    if address.version == 4 and str(address) in _broadcast_addresses():
        return "a broadcast address of this machine's networks"
    return None


def _broadcast_addresses() -> frozenset[str]:
    """This machine's IPv4 network broadcast addresses (``192.0.2.255`` of ``192.0.2.2/24``),
    from the kernel's routing tables (``/proc/net/fib_trie``, Linux; empty elsewhere)."""
    try:
        lines = Path("/proc/net/fib_trie").read_text().splitlines()
    except OSError:
        return frozenset()
    found: set[str] = set()
    last = ""
    for line in lines:
        text = line.strip()
        if text.startswith("|--"):
            last = text[3:].strip()
        elif text.endswith(" BROADCAST"):
            found.add(last)
    return frozenset(found)


def _resolves(host: str) -> bool:
    try:
        return bool(socket.getaddrinfo(host, None))
    except (OSError, UnicodeError):
        return False


def _check_local_address(bind: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    """A non-loopback ``--bind`` must be one this machine can listen on (``0.0.0.0``, ``::``
    or an interface's address)."""
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((str(address), 0))
    except OSError as exc:
        raise UsageError(
            f"--bind {bind!r} is not an address of this machine ({exc.strerror or exc}); give "
            f"{LOOPBACK} (this machine only), 0.0.0.0 or one of its interfaces' addresses"
        ) from None


def _check_loopback_address(address: str, index: int) -> None:
    """Under the default ``--bind 127.0.0.1``, the task's own cluster address must be one
    that loopback serves (else clients could never reach it)."""
    if not is_loopback(_host(address)):
        raise UsageError(
            f"task {index}'s cluster address {address} is not this machine's loopback, and a "
            f"worker listens on {LOOPBACK} only unless --bind names an address: if the task "
            f"runs on this machine only, write it {LOOPBACK}:{_port(address)}; else pass --bind "
            f"0.0.0.0 to serve other hosts ({WORKER_WARNING})"
        )


def restrict_to_loopback(port: int, early: EarlyTie | None = None) -> int:
    """Tie this process's sockets listening on ``port`` to the loopback device, so only this
    machine can connect (TensorFlow's server listens on every interface); how many are tied
    (including those ``early`` tied already). UsageError when none could be (not Linux, or a
    kernel without unprivileged ``SO_BINDTODEVICE``)."""
    done = early.tied if early is not None else set()
    tied, problem = tie_listening(port)
    if not tied:
        raise UsageError(
            f"could not restrict the worker on port {port} to this machine "
            f"({problem or 'no listening socket found'}); pass --bind 0.0.0.0 to serve every "
            f"interface knowingly ({WORKER_WARNING})"
        )
    return len(tied | done)


def _secure_start(port: int, early: EarlyTie | None) -> None:
    """After the server started: tie its listening socket to ``lo`` (again: the fallback to
    ``early``), then shut down every connection from another host that it accepted before
    the tie (the tie keeps them), in one log line."""
    restrict_to_loopback(port, early)
    closed = settle_foreign_connections(port)
    when = (
        f"{early.elapsed_s * 1000:.1f} ms after the server began starting"
        if early is not None and early.elapsed_s is not None
        else "after the server started"
    )
    log = logger.warning if closed else logger.info
    log(
        "worker port %d tied to loopback %s; closed %d connection(s) from other hosts "
        "accepted before that",
        port, when, closed,
    )  # fmt: skip


def _sweep_foreign(port: int) -> None:
    """While serving: shut down any connection from another host (one that raced the tie)."""
    closed = close_foreign_connections(port)
    if closed:
        logger.warning(
            "worker port %d: closed %d connection(s) from other hosts (loopback only)", port, closed
        )


def _thread_counts(threads: int, inter_op_threads: int | None) -> int:
    """Check ``--threads`` and ``--inter-op-threads`` (each 1..:data:`MAX_THREADS`); the
    inter-op thread count (default ``max(MIN_INTER_OP_THREADS, threads)``)."""
    _check_thread_count("--threads", threads)
    inter_op = max(MIN_INTER_OP_THREADS, threads) if inter_op_threads is None else inter_op_threads
    _check_thread_count("--inter-op-threads", inter_op)
    return inter_op


def _check_thread_count(flag: str, count: object) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UsageError(f"{flag} {count!r} must be an integer >= 1")
    if count > MAX_THREADS:
        raise UsageError(
            f"{flag} {count!r} is more than {MAX_THREADS}, the most threads a worker starts per "
            f"pool; give 1..{MAX_THREADS} (this machine has {os.cpu_count() or 1} cores)"
        )


def _task_index(cluster: WorkerCluster, task_index: int | None, job_name: str) -> int:
    """This worker's task: ``--task``, else TF_CONFIG's ``task.index``; checked."""
    index = cluster.task_index if task_index is None else task_index
    if index is None and cluster.task_type not in (None, job_name):
        raise UsageError(
            f"{cluster.source}'s task is of job {cluster.task_type!r}, and this worker serves "
            f"job {job_name!r}: pass --job {cluster.task_type} to serve that task, or --task I "
            f"for task I of {job_name!r}"
        )
    if index is None and cluster.source != "TF_CONFIG":
        raise UsageError(
            f"no task index: pass --task I for this worker ({cluster.source} names no task, "
            "and TF_CONFIG's task is not read when a cluster is given)"
        )
    if index is None:
        raise UsageError(
            "no task index: pass --task I (or set TF_CONFIG's task.index) for this worker"
        )
    if isinstance(index, bool) or not 0 <= index < cluster.num_tasks:
        raise UsageError(
            f"--task {index} is not a task of job {job_name!r}, which has tasks "
            f"0..{cluster.num_tasks - 1} ({', '.join(cluster.addresses)})"
        )
    return index


def _stop_on_signals(index: int, stop_event: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop_event`` (main thread only)."""

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("worker task %d: signal %d, stopping", index, signum)
        stop_event.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def _start_server(
    cluster: WorkerCluster, job_name: str, index: int, threads: int, inter_op: int
) -> Any:
    """A started ``tf.distribute.Server`` for the task, with the thread pools set (also for the
    functions clients run here: module docstring)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # Read by TensorFlow when a client creates its eager context here (module docstring).
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(threads)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(inter_op)
    import tensorflow as tf
    from tensorflow.core.protobuf import tensorflow_server_pb2

    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads,
        inter_op_parallelism_threads=inter_op,
        allow_soft_placement=False,
    )
    spec = tf.train.ClusterSpec(cluster.as_dict())
    server_def = tensorflow_server_pb2.ServerDef(
        cluster=spec.as_cluster_def(), job_name=job_name, task_index=index, protocol="grpc"
    )
    server_def.default_session_config.CopyFrom(config)
    with hold_native_lines() as held:  # gRPC's own lines on a failure: the one line says it
        try:
            # Through the C API without the interpreter lock, so EarlyTie runs meanwhile.
            started = start_server_unlocked(server_def.SerializeToString())
            if started is None:
                started = tf.distribute.Server(
                    spec, job_name=job_name, task_index=index, config=config, start=True
                )
        except (tf.errors.OpError, ValueError) as exc:
            text = str(exc).strip()
            started = text.splitlines()[0] if text else type(exc).__name__
        held.keep = not isinstance(started, str)
    if isinstance(started, str):
        raise UsageError(
            f"worker task {index} could not listen on {cluster.addresses[index]}: {started}; "
            "is the port in use by another process?"
        )
    return started


def _parse_cores(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a list of core numbers like 0,1"
        ) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``partition worker`` options (also ``python -m partitioner.cli.worker``)."""
    parser = OneLineParser(
        prog="partition worker",
        description="Serve one task of a TensorFlow cluster until stopped (SIGTERM or Ctrl-C). "
        f"WARNING: {WORKER_WARNING}. It serves this machine only ({LOOPBACK}) unless --bind "
        "names another address.",
    )
    parser.add_argument(
        "--bind",
        default=LOOPBACK,
        metavar="ADDRESS",
        help=f"who may connect: {LOOPBACK} (default: this machine only; the task's cluster "
        "address must then be a loopback one) or an IP address of this machine such as 0.0.0.0 "
        "(TensorFlow then listens on every interface: trusted networks only); anything else "
        "(empty, a name that does not resolve, a broadcast or multicast address) is refused",
    )
    parser.add_argument("--task", type=int, default=None, help="task index (default: TF_CONFIG)")
    parser.add_argument(
        "--cluster",
        default=None,
        help='JSON file {"worker": ["host:port", ...]} or TF_CONFIG form (default: $TF_CONFIG)',
    )
    parser.add_argument("--job", default="worker", help="job name (default worker)")
    parser.add_argument(
        "--threads", type=int, default=1, help=f"intra-op threads (default 1; 1..{MAX_THREADS})"
    )
    parser.add_argument(
        "--inter-op-threads",
        type=int,
        default=None,
        help=f"inter-op threads (default: max({MIN_INTER_OP_THREADS}, --threads); 1.."
        f"{MAX_THREADS}; sends to other workers need a free thread, not one queued behind the "
        "kernels it runs)",
    )
    parser.add_argument(
        "--cores", type=_parse_cores, default=None, help="pin to these CPU cores, e.g. 0 or 0,1"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse ``argv``, serve, return the exit status; errors print one line."""
    args = build_parser().parse_args(list(argv) if argv is not None else None)

    def announce(task: int, address: str) -> None:
        line = f"{READY_PREFIX} task {task} at {address}"
        try:
            sys.stdout.write(f"{line}\n")
            sys.stdout.flush()
        except (OSError, ValueError, AttributeError) as exc:  # full, closed, or a closed pipe
            _stdout_dropped()
            reason = (exc.strerror if isinstance(exc, OSError) else None) or "it is closed"
            sys.stderr.write(f"partition worker: note: stdout takes no line ({reason}); {line}\n")
            sys.stderr.flush()

    try:
        # Before TensorFlow: a bad --bind or thread count starts nothing.
        loopback_only = check_bind(args.bind)
        _thread_counts(args.threads, args.inter_op_threads)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        import_quietly("passes.cluster.runtime")  # TensorFlow's start-up lines off the terminal
        if not loopback_only:
            sys.stderr.write(
                f"partition worker: warning: --bind {args.bind}: listening on every interface; "
                f"{WORKER_WARNING}\n"
            )
            sys.stderr.flush()
        return run_worker(
            args.task,
            args.cluster,
            job_name=args.job,
            threads=args.threads,
            inter_op_threads=args.inter_op_threads,
            cores=args.cores,
            on_ready=announce,
            bind=args.bind,
            warn_open=False,
        )
    except PartitionError as exc:
        sys.stderr.write(f"partition worker: error: {exc}\n")
        return exc.exit_code


# -- local workers (tests, benchmarks, trying a plan on one machine) ------------------------------


def free_ports(count: int) -> tuple[int, ...]:
    """``count`` distinct TCP ports that were free on 127.0.0.1 a moment ago."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return tuple(s.getsockname()[1] for s in sockets)
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalWorkers:
    """Worker subprocesses serving one cluster file; :meth:`stop` ends them."""

    cluster_file: Path
    addresses: tuple[str, ...]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def kill(self, task: int) -> None:
        """SIGKILL one worker (a crash: no goodbye)."""
        proc = self.processes[task]
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM every live worker; SIGKILL any still alive after ``grace_s``."""
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in self.processes:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def log(self, task: int) -> str:
        """What worker ``task`` wrote (stdout and stderr)."""
        return self.logs[task].read_text(errors="replace")

    def __enter__(self) -> LocalWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _accepts(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=0.5):
            return True
    except OSError:
        return False


def _stdout_dropped() -> None:
    """Stdout at /dev/null from here on (``sys.stdout`` too, if it was None): what it still
    holds goes nowhere instead of failing again, and the worker goes on serving."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    sys.stdout = open(1, "w", closefd=False)


def _new_log(path: Path) -> BinaryIO:
    """``path`` as a new, empty file opened for writing: a symbolic link or a regular file there
    (a hard link to another file too) is removed first, never written through or emptied (the
    log is this run's file, not one a name there leads to); anything else there (a FIFO, which
    an open would wait on for ever, a directory, a device) is a UsageError naming it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise UsageError(
            f"cannot write the worker log {path}: it is {file_kind(mode)}; give a directory "
            "without it"
        )
    if mode is not None and stat.S_ISREG(mode) and not _own_log(path):
        raise UsageError(
            f"the worker log {path} exists and is not a log partitioner wrote (its first line "
            f"{LOG_HEADER.strip()!r}); refusing to remove it (it may be your file): give a "
            "directory without it"
        )
    if mode is not None:
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    log = os.fdopen(os.open(path, flags, 0o666), "wb")
    log.write(LOG_HEADER.encode())
    log.flush()
    return log


LOG_HEADER = "# partition worker log, written by partitioner\n"
"""The first line of every worker log :func:`start_local_workers` writes: a later call removes
only such a file (a user's ``worker0.log`` there was deleted, campaign 34ae)."""


def _own_log(path: Path) -> bool:
    """Whether the regular file ``path`` may be removed: empty, starting with
    :data:`LOG_HEADER`, or one of several hard links (its data stays under the others)."""
    try:
        if os.lstat(path).st_nlink > 1:
            return True
        with open(path, "rb") as file:
            head = file.read(len(LOG_HEADER))
    except OSError:
        return False
    return head in (b"", LOG_HEADER.encode())


def _check_own_files(cluster_file: Path, num_tasks: int) -> None:
    """The cluster file and the logs :func:`start_local_workers` writes are new or its own:
    refused before any worker starts, not after the first."""
    _check_own_cluster_file(cluster_file)
    for task in range(num_tasks):
        log = cluster_file.parent / f"worker{task}.log"
        if log.is_file() and not log.is_symlink() and not _own_log(log):
            _new_log(log)  # raises the one line


def _check_own_cluster_file(path: Path) -> None:
    """``path`` is new, empty, or a cluster file :func:`start_local_workers` wrote, unchanged
    (:func:`_cluster_text`, its digest): a user's ``cluster.json`` there was replaced (campaign
    34ae), and so was one a user wrote by hand for local workers (one job ``worker`` on
    127.0.0.1, which a guess by content took for partitioner's, 34ag). UsageError otherwise."""
    if not os.path.lexists(path) or path.is_symlink():
        return  # new, or a link: the link itself is replaced, never what it leads to
    if path.is_file() and path.stat().st_size == 0:
        return
    if not written_by_partitioner(path):
        raise UsageError(
            f"{path} exists and is not a cluster file start_local_workers wrote (unchanged, "
            "with its digest); refusing to replace it (it may be your cluster): give a "
            "directory without it"
        )


def _cluster_text(addresses: Sequence[str]) -> str:
    """The cluster file of local workers at ``addresses``: TF_CONFIG's form, which
    ``--cluster`` reads, with a ``digest`` of its data (ignored by the readers) that proves
    partitioner wrote it (:func:`~partitioner.core.files.written_by_partitioner`)."""
    data: dict[str, Any] = {"cluster": {"worker": list(addresses)}}
    return json.dumps({**data, "digest": json_digest(data)}) + "\n"


def start_local_workers(
    num_tasks: int,
    directory: Path,
    *,
    threads: int = 1,
    inter_op_threads: int | None = None,
    cores: Sequence[int | None] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 60.0,
) -> LocalWorkers:
    """Start ``num_tasks`` workers (``python -m partitioner.cli.worker``) on free 127.0.0.1 ports.

    Writes ``directory/cluster.json`` and one log per worker there, pins task ``i`` to
    ``cores[i]`` when given, and waits (up to ``timeout_s``) until every worker says it is
    ready and its port accepts connections; on failure the started workers are stopped and
    :class:`~partitioner.core.errors.UsageError` says which one failed, with the tail of its log.
    """
    check_links_followed(directory, "start_local_workers directory=")
    directory.mkdir(parents=True, exist_ok=True)
    addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(num_tasks))
    cluster_file = directory / "cluster.json"
    _check_own_files(cluster_file, num_tasks)
    write_atomic(cluster_file, _cluster_text(addresses), follow_symlinks=False, only_ours=True)
    workers = LocalWorkers(cluster_file, addresses)
    child_env = dict(os.environ if env is None else env)
    child_env.pop("TF_CONFIG", None)
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    try:
        for task in range(num_tasks):
            log = directory / f"worker{task}.log"
            workers.logs.append(log)
            cmd = [
                sys.executable, "-m", "partitioner.cli.worker", "--task", str(task),
                "--cluster", str(cluster_file), "--threads", str(threads),
            ]  # fmt: skip
            if inter_op_threads is not None:
                cmd += ["--inter-op-threads", str(inter_op_threads)]
            core = cores[task] if cores is not None else None
            if core is not None:
                cmd += ["--cores", str(core)]
            with _new_log(log) as out:
                workers.processes.append(
                    subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=child_env)
                )
        deadline = time.monotonic() + timeout_s
        for task, (proc, address) in enumerate(zip(workers.processes, addresses)):
            while not (READY_PREFIX in workers.log(task) and _accepts(address)):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = " | ".join(workers.log(task).strip().splitlines()[-3:])
                    state = (
                        f"exited with status {proc.returncode}"
                        if proc.poll() is not None
                        else f"was not ready after {timeout_s:g} s"
                    )
                    raise UsageError(f"local worker task {task} ({address}) {state}: {tail}")
                time.sleep(0.1)
    except BaseException:
        workers.stop()
        raise
    return workers


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The gRPC server has no clean shutdown in TF 2; leave without running its destructors.
    os._exit(code)
