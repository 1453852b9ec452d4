"""TF_CONFIG: TensorFlow's description of a cluster, parsed once for the whole library.

``TF_CONFIG`` (an environment variable holding JSON) names the cluster's jobs and their task
addresses, and which task this process is::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"]},
     "task": {"type": "worker", "index": 0}}

:func:`parse_tf_config` reads that text (or its parsed mapping) into a :class:`TfConfig`,
checked against ``tf_config.schema.json`` (next to this module); :func:`parse_cluster_jobs`
reads the bare ``{job: [addresses]}`` form a cluster file may hold. Both the topology
(:func:`cost_models.devices.topology.topology_from_tf_config`: which devices a plan is for) and
the cluster runtime (:func:`passes.cluster.runtime.load_cluster`: which servers to connect to)
use them. Errors are one line naming the origin and the field. Pure Python.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from cost_models.devices.datafiles import check_schema, parse_json
from partitioner.core.errors import CatalogError, PartitionError, UsageError
from partitioner.core.options import MAX_DEVICES, short_repr, short_text

__all__ = [
    "TF_CONFIG_EXAMPLE",
    "TF_CONFIG_VARIABLE",
    "TfConfig",
    "address_host",
    "address_key",
    "check_addresses",
    "check_job_name",
    "parse_cluster_jobs",
    "parse_tf_config",
    "tf_config_text",
]

TF_CONFIG_VARIABLE = "TF_CONFIG"
"""The environment variable TensorFlow reads the cluster from."""

_SCHEMA = "devices/tf_config.schema.json"
_ADDRESS = re.compile(r"^(?P<host>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(?P<port>[0-9]{1,5})$")
"""``host:port``: a host name or IPv4 address (letters, digits, ``_.-``), or a bracketed IPv6
address; the port is checked to be 1..65535."""
MAX_HOST_NAME_CHARS = 253
"""The longest host name DNS carries (RFC 1035: 255 octets on the wire, 253 characters)."""
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]", "ip6-localhost"})
_UNSPECIFIED = frozenset({"0.0.0.0", "[::]"})
"""Addresses that name no host: a connection to one reaches this machine."""
TF_CONFIG_EXAMPLE = '{"cluster": {"worker": ["host0:2222", "host1:2222"]}}'
"""TF_CONFIG's own form, for messages: TensorFlow reads the jobs only under ``cluster``."""

Jobs = tuple[tuple[str, tuple[str, ...]], ...]
"""A cluster's jobs in file order: ``((job, (address, ...)), ...)``."""


@dataclass(frozen=True)
class TfConfig:
    """A parsed TF_CONFIG: the cluster's jobs and, when given, this process's task."""

    jobs: Jobs
    task_type: str | None = None
    """``task.type``: the job of this process (None when TF_CONFIG names no task)."""
    task_index: int | None = None
    """``task.index`` (0 when ``task.type`` is given without an index)."""

    @property
    def job_names(self) -> tuple[str, ...]:
        return tuple(job for job, _ in self.jobs)

    def addresses(self, job: str) -> tuple[str, ...]:
        """The task addresses of ``job`` (empty when the cluster has no such job)."""
        return dict(self.jobs).get(job, ())

    def as_dict(self) -> dict[str, list[str]]:
        """``{job: [addresses]}``, as ``tf.train.ClusterSpec`` takes it."""
        return {job: list(addresses) for job, addresses in self.jobs}


def tf_config_text(environ: Mapping[str, str] | None = None) -> str | None:
    """The ``TF_CONFIG`` variable of ``environ`` (default ``os.environ``); None when unset or
    blank."""
    env = os.environ if environ is None else environ
    text = env.get(TF_CONFIG_VARIABLE, "")
    return text if text.strip() else None


def _jobs(cluster: Mapping[str, Any]) -> Jobs:
    return tuple((str(job), tuple(addresses)) for job, addresses in cluster.items())


def parse_cluster_jobs(
    jobs: object, *, origin: str = "cluster", error: type[PartitionError] = CatalogError
) -> Jobs:
    """The bare ``{job: ["host:port", ...]}`` form (TF_CONFIG's ``cluster`` value), checked."""
    check_schema(jobs, "cost_models", _SCHEMA, origin, error, ref="#/$defs/cluster")
    return _jobs(cast(Mapping[str, Any], jobs))


def parse_tf_config(
    config: str | Mapping[str, Any],
    *,
    origin: str = TF_CONFIG_VARIABLE,
    error: type[PartitionError] = CatalogError,
) -> TfConfig:
    """``config`` (TF_CONFIG's JSON text, or its parsed mapping) as a :class:`TfConfig`.

    Text that is not JSON raises :class:`~partitioner.core.errors.UsageError`; data that does
    not fit the schema raises ``error`` (``"TF_CONFIG: cluster.worker: must be a list of
    'host:port' strings, got ..."``).
    """
    data: Any
    if isinstance(config, str):
        data = parse_json(config, origin, UsageError, hint=f"it should look like {TF_CONFIG_EXAMPLE}")
    else:
        data = dict(config)
    check_schema(data, "cost_models", _SCHEMA, origin, error)
    task = data.get("task") or {}
    _check_task_keys(task, origin, error)
    task_type = task.get("type")
    return TfConfig(
        jobs=_jobs(data["cluster"]),
        task_type=task_type,
        task_index=task.get("index", 0) if task_type is not None else task.get("index"),
    )


_TASK_KEYS = frozenset({"type", "index", "trial", "cloud"})
"""The keys of TF_CONFIG's ``task`` TensorFlow and the clouds that set it write."""


def _check_task_keys(task: Mapping[str, Any], origin: str, error: type[PartitionError]) -> None:
    """A ``task`` with an index has a type, and one without an index (TensorFlow then takes 0)
    has no key of another name: ``{"type": "worker", "idx": 1}`` is a misspelt index, not
    task 0."""
    if "index" in task and "type" not in task:
        raise error(
            f"{origin}: task gives index {task['index']!r} but no type; add the job it is of, "
            f'like {{"type": "worker", "index": {task["index"]!r}}}'
        )
    unknown = sorted(k for k in task if k not in _TASK_KEYS)
    if "index" not in task and unknown:
        raise error(
            f"{origin}: task has no 'index' (TensorFlow would take task 0) but has key "
            f"{short_repr(unknown[0], 40)}; spell the index 'index', like "
            '{"type": "worker", "index": 1}'
        )


def address_host(address: str) -> str:
    """The host of a ``host:port`` address (``""`` for ``":2222"``), as one name however it is
    spelled: without case or a trailing dot, an IPv4 address as its dotted quad (``127.1``,
    ``0x7f000001``), and every loopback name (``127.x.y.z``, ``[::1]``) and unspecified address
    (``0.0.0.0``, ``[::]``: a connection to one reaches this machine) as ``localhost``; tasks
    with one host share a machine."""
    text = address.strip()
    name = (text.rsplit(":", 1)[0] if ":" in text else text).lower().rstrip(".")
    name = _canonical_ip(name)
    if name in _LOOPBACK_NAMES or name.startswith("127.") or name in _UNSPECIFIED:
        return "localhost"
    return name


def _canonical_ip(name: str) -> str:
    """An IP address in one spelling: IPv4 as its dotted quad (``127.1``, ``0x7f000001``: what
    the resolver takes), IPv6 compressed in brackets (``[0:0:0:0:0:0:0:1]`` is ``[::1]``), an
    IPv4-mapped IPv6 address as its IPv4 (``[::ffff:127.0.0.1]``); a host name as it is."""
    if name.startswith("[") and name.endswith("]"):
        try:
            ip = ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            return name
        mapped = ip.ipv4_mapped
        return str(mapped) if mapped is not None else f"[{ip.compressed}]"
    try:
        return socket.inet_ntoa(socket.inet_aton(name))
    except OSError:
        return name


def _job_addresses(
    origin: str, job: str, value: tuple[str, ...], error: type[PartitionError]
) -> tuple[str, ...]:
    """The checked ``host:port`` addresses of ``job`` (non-empty, valid ports, no repeats)."""
    if not value:
        raise error(
            f"{origin}: job {job!r} must be a non-empty list of 'host:port' strings, got {list(value)!r}"
        )
    out: list[str] = []
    for i, address in enumerate(value):
        match = _ADDRESS.match(address.strip())
        if match is None or not 0 < int(match.group("port")) < 65536:
            raise error(
                f"{origin}: {job}[{i}] = {address!r} is not a 'host:port' address "
                "(e.g. '127.0.0.1:2222')"
            )
        host = match.group("host")
        if len(host) > MAX_HOST_NAME_CHARS or any(len(p) > 63 for p in host.split(".")):
            raise error(
                f"{origin}: {job}[{i}]'s host ({len(host)} characters) is longer than a host "
                f"name can be ({MAX_HOST_NAME_CHARS} characters, 63 per dot-separated label); "
                "give the host's name or address"
            )
        out.append(address.strip())
    keys = [address_key(a) for a in out]
    if len(set(keys)) != len(keys):
        raise error(f"{origin}: job {job!r} lists an address twice: {out}{_spelled(out)}")
    return tuple(out)


def address_key(address: str) -> tuple[str, int]:
    """What makes two addresses one server: the host (:func:`address_host`: a TensorFlow
    server listens on every interface, so ``localhost`` and ``127.0.0.1`` are one) and the port
    as a number (``02222`` is 2222)."""
    return address_host(address), int(address.rpartition(":")[2])


def _spelled(addresses: list[str]) -> str:
    """`` (one server spelled two ways)`` when the repeats differ only in spelling."""
    return " (one server spelled two ways)" if len(set(addresses)) == len(addresses) else ""


def check_addresses(
    config: TfConfig, *, origin: str = TF_CONFIG_VARIABLE, error: type[PartitionError] = UsageError
) -> TfConfig:
    """``config`` with every address checked and stripped: each job a non-empty list of
    ``host:port`` (port 1..65535, no control characters), no address twice in a job or across
    jobs, however spelled (two servers cannot share a port: :func:`address_key`). The one check for a cluster file, ``TF_CONFIG`` and a topology read
    from either."""
    _check_jobs(config, origin, error)
    jobs = tuple((job, _job_addresses(origin, job, addrs, error)) for job, addrs in config.jobs)
    seen = [a for _, addrs in jobs for a in addrs]
    if len({address_key(a) for a in seen}) != len(seen):
        raise error(f"{origin}: two tasks share one address: {sorted(seen)}{_spelled(seen)}")
    _check_task(config, origin, error)
    return TfConfig(jobs=jobs, task_type=config.task_type, task_index=config.task_index)


_JOB_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
"""A job name TensorFlow takes in a device name (``/job:<name>``); another aborts its server."""

def check_job_name(job: str, origin: str, error: type[PartitionError]) -> None:
    """``job`` is a name TensorFlow takes in a device name (a cluster's jobs, a topology's
    ``job``), else ``error`` naming it."""
    if not _JOB_NAME.fullmatch(job):
        raise error(
            f"{origin}: job {short_repr(job, 60)} is not a TensorFlow job name (a letter, then "
            "letters, digits or '_'); rename it"
        )


SINGLE_TASK_JOBS = ("chief", "evaluator")
"""Jobs TensorFlow allows one task of ("There must be at most one 'chief' job")."""


def _check_jobs(config: TfConfig, origin: str, error: type[PartitionError]) -> None:
    """Every job name one TensorFlow takes, ``chief`` and ``evaluator`` one task at most, and
    at most :data:`~partitioner.core.options.MAX_DEVICES` tasks in all (the bound a topology's
    devices have: a cluster of 20,001 tasks made one error line of 349 KB)."""
    for job, addresses in config.jobs:
        check_job_name(job, origin, error)
        if job in SINGLE_TASK_JOBS and len(addresses) > 1:
            raise error(
                f"{origin}: job {job!r} lists {len(addresses)} tasks; TensorFlow allows one "
                f"{job}: list the others under 'worker'"
            )
    total = sum(len(addresses) for _, addresses in config.jobs)
    if total > MAX_DEVICES:
        raise error(
            f"{origin}: the cluster lists {total} tasks, more than {MAX_DEVICES}; plan a "
            f"cluster of at most {MAX_DEVICES} tasks"
        )


def _check_task(config: TfConfig, origin: str, error: type[PartitionError]) -> None:
    """``task`` names a job of the cluster and an index among its tasks (an ``evaluator`` may be
    outside the cluster, as TensorFlow allows)."""
    job, index = config.task_type, config.task_index
    if job is None or (job == "evaluator" and job not in config.job_names):
        return  # TensorFlow's evaluator may run outside the cluster it lists
    if job not in config.job_names:
        raise error(
            f"{origin}: task.type {short_repr(job, 60)} is no job of the cluster (jobs: "
            f"{', '.join(short_text(j) for j in config.job_names)})"
        )
    count = len(config.addresses(job))
    if index is not None and index >= count:
        raise error(
            f"{origin}: task.index {index} is past the {count} task(s) of job {job!r}; give "
            f"0..{count - 1}"
        )
