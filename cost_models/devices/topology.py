"""Topologies: which devices, on which hosts, joined by which links.

:func:`load_topology` turns the ``--topology`` option into a :class:`~partitioner.core.ir.Topology`:

* a link kind -- ``pcie`` (each device type's own PCIe generation), ``nvlink`` (the NVLink
  generation of the device type), or a concrete catalog kind (``pcie3``, ``nvlink4``, ``eth100g``,
  ``infiniband``, ...) -- gives ``num_devices`` identical devices of ``device_type`` on one host,
  every pair joined by that link (what ``--link`` did before);
* ``tf-config`` reads the cluster from the ``TF_CONFIG`` environment variable
  (:func:`topology_from_tf_config`);
* a path ending in ``.json`` or ``.toml`` reads a topology file (format below).

Topology file format (TOML shown; JSON has the same structure, see ``examples/topologies/``)::

    name = "two-gpu-types"        # optional, for messages
    job = "worker"                # optional: name devices /job:worker/replica:0/task:<host>/...
    link = "pcie"                 # optional: default intra-host link of every host ("pcie")
    inter_host_link = "eth100g"   # required with more than one host

    [[hosts]]
    count = 1                     # optional: this many identical hosts (default 1)
    link = "nvlink"               # optional: this host's intra-host link (default: top-level link)

    [[hosts.devices]]
    type = "h100"                 # catalog device type (aliases allowed)
    count = 1                     # optional (default 1)
    memory = "80GiB"              # optional: "16GiB", "512MiB" or an integer of bytes

    [[hosts.devices]]
    type = "v100"

    [[links]]                     # optional per-pair override, by device index
    devices = [0, 1]
    link = { latency_s = 5e-6, bandwidth_bytes_per_s = 50e9, name = "measured" }

Instead of ``hosts``, a single-host file may list ``devices`` at the top level. A link is a
catalog kind (string) or a table with ``latency_s`` (>= 0), ``bandwidth_bytes_per_s`` (> 0) and an
optional ``name``. Devices are numbered host by host, in file order.

Link semantics within a host: ``pcie`` between two devices runs at the slower of their two PCIe
generations (a CPU's end is the GPU's PCIe slot; two CPUs use the catalog's ``host`` link);
``nvlink`` joins GPUs of one NVLink generation (a pair with a CPU falls back to PCIe; a GPU type
without NVLink, or two generations, is an error: use ``pcie`` or a ``[[links]]`` entry). Devices
on different hosts use ``inter_host_link``; all traffic between two hosts shares one channel
(:meth:`~partitioner.core.ir.Topology.channel_between`), except pairs given in ``[[links]]``, which
get their own.

Device names: with ``job`` or more than one host, every device is named
``/job:<job>/replica:0/task:<host>/device:<GPU|CPU>:<j>`` (``job`` defaults to ``worker``; ``j``
counts GPUs and CPUs of the host separately); on one host with a CPU among the devices, names are
``/device:CPU:<j>`` / ``/device:GPU:<j>``; otherwise names are left ``""`` (chosen when the plan
is applied).

Validation is strict and data-only (JSON or TOML parsers, never code): a syntax error, a missing
or unknown key, a wrong type, a negative number, an unknown device type or link kind each raise a
one-line :class:`~partitioner.core.errors.CatalogError` (or
:class:`~partitioner.core.errors.UnknownDeviceError` / :class:`~partitioner.core.errors.UsageError`) naming
the file, the field and what is known.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cost_models.devices.catalog import DeviceType, catalog, get_device_type
from cost_models.devices.communication import LinkAlias, get_link, link_names, resolve_link
from partitioner.core.errors import CatalogError, UnknownDeviceError, UsageError
from partitioner.core.ir import Device, Link, Topology
from partitioner.core.units import parse_bytes

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as _toml
    except ImportError:
        _toml = None

__all__ = [
    "TF_CONFIG_SPEC",
    "load_topology",
    "parse_topology",
    "topology_from_tf_config",
    "topology_summary",
]

logger = logging.getLogger(__name__)

TF_CONFIG_SPEC = "tf-config"
"""The ``--topology`` value that reads the cluster from the ``TF_CONFIG`` environment variable."""

_MAX_DEVICES = 4096
"""More devices than this in one topology is taken as a typo."""

_TOP_KEYS = ("name", "job", "link", "inter_host_link", "hosts", "devices", "links")
_HOST_KEYS = ("count", "link", "devices")
_DEVICE_KEYS = ("type", "count", "memory")
_PAIR_KEYS = ("devices", "link")
_LINK_KEYS = ("latency_s", "bandwidth_bytes_per_s", "name")
_TF_JOBS = ("chief", "worker")
"""TF_CONFIG jobs whose tasks hold devices for model layers (``ps`` and ``evaluator`` do not)."""


# --------------------------------------------------------------------------------------------
# Errors that name the source and the field
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Where:
    """Where a value came from: ``topology file 'x.toml'`` or ``TF_CONFIG``."""

    origin: str

    def fail(self, field: str, what: str) -> CatalogError:
        return CatalogError(f"{self.origin}: {field}: {what}")


def _known_links() -> str:
    aliases = f"{LinkAlias.PCIE.value}, {LinkAlias.NVLINK.value}"
    return f"{aliases}, {', '.join(link_names())}"


def _known_types() -> str:
    cat = catalog()
    aliases = ", ".join(f"{a}={t}" for a, t in cat.aliases.items())
    return f"{', '.join(cat.devices)} (aliases: {aliases})" if aliases else ", ".join(cat.devices)


# --------------------------------------------------------------------------------------------
# Typed access to untrusted data
# --------------------------------------------------------------------------------------------


def _table(where: _Where, field: str, value: object, keys: Sequence[str]) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise where.fail(
            field, f"must be a table/object with keys {', '.join(keys)}, got {_kind(value)}"
        )
    unknown = [k for k in value if k not in keys]
    if unknown:
        raise where.fail(field, f"unknown key {unknown[0]!r}; known keys: {', '.join(keys)}")
    return value


def _kind(value: object) -> str:
    if isinstance(value, bool):
        return f"a boolean ({value!r})"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return f"a string ({value!r})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    return type(value).__name__


def _count(where: _Where, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.fail(field, f"must be a positive integer, got {_kind(value)}")
    if value < 1 or value > _MAX_DEVICES:
        raise where.fail(field, f"must be an integer in 1..{_MAX_DEVICES}, got {value}")
    return value


def _nonneg_number(where: _Where, field: str, value: object, *, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise where.fail(field, f"must be a finite number, got {_kind(value)}")
    if value < 0 or (positive and value == 0):
        raise where.fail(field, f"must be {'> 0' if positive else '>= 0'}, got {value!r}")
    return float(value)


def _text(where: _Where, field: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise where.fail(field, f"must be a non-empty string, got {_kind(value)}")
    return value.strip()


def _memory(where: _Where, field: str, value: object) -> int:
    if isinstance(value, bool):
        raise where.fail(
            field, f'must be a size like "16GiB" or an integer of bytes, got {_kind(value)}'
        )
    if isinstance(value, int):
        if value <= 0:
            raise where.fail(field, f"must be a positive number of bytes, got {value}")
        return value
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError as exc:
            raise where.fail(field, str(exc)) from None
    raise where.fail(
        field, f'must be a size like "16GiB" or an integer of bytes, got {_kind(value)}'
    )


def _device_type(where: _Where, field: str, value: object) -> DeviceType:
    name = _text(where, field, value)
    try:
        return get_device_type(name)
    except UnknownDeviceError:
        raise UnknownDeviceError(
            f"{where.origin}: {field}: unknown device type {name!r}; known: {_known_types()}"
        ) from None


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------


_LinkSpec = Link | str
"""A concrete link, or an alias (``pcie``/``nvlink``/``default``) resolved per device pair."""

_ALIASES = frozenset(a.value for a in LinkAlias)


def _link_spec(where: _Where, field: str, value: object, *, allow_alias: bool) -> _LinkSpec:
    if isinstance(value, dict):
        obj = _table(where, field, value, _LINK_KEYS)
        for key in ("latency_s", "bandwidth_bytes_per_s"):
            if key not in obj:
                raise where.fail(
                    field,
                    f"is missing key {key!r}; a link table needs latency_s and bandwidth_bytes_per_s",
                )
        name = _text(where, f"{field}.name", obj["name"]) if "name" in obj else "custom"
        return Link(
            kind=name,
            latency_s=_nonneg_number(where, f"{field}.latency_s", obj["latency_s"], positive=False),
            bandwidth_bytes_per_s=_nonneg_number(
                where, f"{field}.bandwidth_bytes_per_s", obj["bandwidth_bytes_per_s"], positive=True
            ),
        )
    if not isinstance(value, str) or not value.strip():
        raise where.fail(
            field,
            f"must be a link kind or a table with latency_s and bandwidth_bytes_per_s, got "
            f"{_kind(value)}",
        )
    key = value.strip().lower()
    if key in _ALIASES:
        if not allow_alias:
            raise where.fail(
                field,
                f"{key!r} depends on the device type and cannot join hosts; use one of "
                f"{', '.join(link_names())}",
            )
        return key
    if key not in catalog().links:
        raise where.fail(field, f"unknown link kind {value!r}; known: {_known_links()}")
    return get_link(key)


def _slower(a: Link, b: Link) -> Link:
    return min((a, b), key=lambda x: (x.bandwidth_bytes_per_s, -x.latency_s))


def _is_host(t: DeviceType) -> bool:
    return t.default_link == "host"


def _pcie_between(a: DeviceType, b: DeviceType) -> Link:
    gpus = [t for t in (a, b) if not _is_host(t)]
    if not gpus:
        return get_link(a.default_link)
    links = [get_link(t.default_link) for t in gpus]
    return _slower(links[0], links[-1])


def _pair_link(where: _Where, field: str, spec: _LinkSpec, a: DeviceType, b: DeviceType) -> Link:
    """The link ``spec`` between devices of types ``a`` and ``b`` on one host."""
    if isinstance(spec, Link):
        return spec
    if spec in (LinkAlias.PCIE.value, LinkAlias.DEFAULT.value):
        return _pcie_between(a, b)
    # nvlink
    if _is_host(a) or _is_host(b):
        return _pcie_between(a, b)
    for t in (a, b):
        if t.nvlink is None:
            with_nvlink = ", ".join(n for n, d in catalog().devices.items() if d.nvlink is not None)
            raise where.fail(
                field,
                f"device type {t.name!r} has no NVLink; use link 'pcie' or a device type with "
                f"NVLink: {with_nvlink}",
            )
    if a.nvlink != b.nvlink:
        raise where.fail(
            field,
            f"NVLink joins GPUs of one generation, but {a.name!r} has {a.nvlink} and {b.name!r} "
            f"has {b.nvlink}; use link 'pcie' or give the pair in [[links]]",
        )
    assert a.nvlink is not None  # checked above
    return get_link(a.nvlink)


# --------------------------------------------------------------------------------------------
# Building a topology from resolved hosts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HostPlan:
    types: tuple[DeviceType, ...]
    memories: tuple[int, ...]
    link: _LinkSpec
    link_field: str


def _build(
    where: _Where,
    hosts: Sequence[_HostPlan],
    *,
    inter: Link | None,
    job: str | None,
    pair_overrides: Mapping[tuple[int, int], Link],
    memory_limit_bytes: int | None,
    task_of_host: Sequence[int] | None = None,
    job_of_host: Sequence[str] | None = None,
) -> Topology:
    devices: list[Device] = []
    host_of: list[int] = []
    intra: dict[tuple[int, int], Link] = {}
    multi = len(hosts) > 1
    any_cpu = any(_is_host(t) for h in hosts for t in h.types)
    for h, plan in enumerate(hosts):
        first = len(devices)
        counters = {"GPU": 0, "CPU": 0}
        for t, mem in zip(plan.types, plan.memories, strict=True):
            kind = "CPU" if _is_host(t) else "GPU"
            j = counters[kind]
            counters[kind] += 1
            if job is not None or multi or job_of_host is not None:
                job_name = job_of_host[h] if job_of_host is not None else (job or "worker")
                task = task_of_host[h] if task_of_host is not None else h
                name = f"/job:{job_name}/replica:0/task:{task}/device:{kind}:{j}"
            elif any_cpu:
                name = f"/device:{kind}:{j}"
            else:
                name = ""
            memory = mem if memory_limit_bytes is None else memory_limit_bytes
            devices.append(Device(len(devices), t.name, memory, host=h, name=name))
            host_of.append(h)
        members = range(first, len(devices))
        for a in members:
            for b in members:
                if a < b:
                    intra[(a, b)] = _pair_link(
                        where,
                        plan.link_field,
                        plan.link,
                        plan.types[a - first],
                        plan.types[b - first],
                    )
    if len(devices) > _MAX_DEVICES:
        raise where.fail("hosts", f"describes {len(devices)} devices, more than {_MAX_DEVICES}")
    if multi and inter is None:
        raise where.fail(
            "inter_host_link",
            f"is missing: {len(hosts)} hosts need a link between them; known: {', '.join(link_names())}",
        )
    if intra:
        default = Counter(intra.values()).most_common(1)[0][0]
    else:
        plan0 = hosts[0]
        default = _pair_link(where, plan0.link_field, plan0.link, plan0.types[0], plan0.types[0])
    overrides = {pair: link for pair, link in intra.items() if link != default}
    overrides.update(pair_overrides)
    return Topology(
        devices=tuple(devices),
        link=default,
        inter_host_link=inter if multi else None,
        links=tuple((a, b, link) for (a, b), link in sorted(overrides.items())),
    )


# --------------------------------------------------------------------------------------------
# Topology files
# --------------------------------------------------------------------------------------------


def _reject_constant(token: str) -> float:
    raise ValueError(f"{token} is not a number JSON allows")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _parse_text(text: str, fmt: str, origin: str) -> object:
    if fmt == "json":
        try:
            return json.loads(
                text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant
            )
        except json.JSONDecodeError as exc:
            raise CatalogError(
                f"{origin}: not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); "
                "fix the file"
            ) from None
        except ValueError as exc:
            raise CatalogError(f"{origin}: not valid JSON ({exc}); fix the file") from None
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise UsageError(
            f"{origin}: reading TOML needs Python 3.11+ or the 'tomli' package; write the "
            "topology as JSON instead"
        )
    try:
        return _toml.loads(text)
    except _toml.TOMLDecodeError as exc:
        raise CatalogError(f"{origin}: not valid TOML ({exc}); fix the file") from None


def parse_topology(
    data: object,
    *,
    origin: str = "topology",
    device_type: str | None = None,
    memory_limit_bytes: int | None = None,
) -> Topology:
    """Build a topology from parsed file data (a dict as JSON or TOML gives it).

    ``device_type`` is the type of device entries that give none (else ``type`` is required);
    ``memory_limit_bytes``, when given, is every device's memory (as ``--memory-limit``).
    ``origin`` starts every error message.
    """
    where = _Where(origin)
    top = _table(where, "(top level)", data, _TOP_KEYS)
    if "hosts" in top and "devices" in top:
        raise where.fail("(top level)", "give either 'hosts' or 'devices' (one host), not both")
    if "hosts" not in top and "devices" not in top:
        raise where.fail("(top level)", "is missing key 'hosts' (or 'devices' for one host)")
    if "name" in top:
        _text(where, "name", top["name"])
    job = _text(where, "job", top["job"]) if "job" in top else None
    if job is not None and ("/" in job or ":" in job):
        raise where.fail("job", f"must be a plain TF job name like 'worker', got {job!r}")
    default_link: _LinkSpec = (
        _link_spec(where, "link", top["link"], allow_alias=True) if "link" in top else "pcie"
    )
    inter: Link | None = None
    if "inter_host_link" in top:
        spec = _link_spec(where, "inter_host_link", top["inter_host_link"], allow_alias=False)
        assert isinstance(spec, Link)
        inter = spec

    if "hosts" in top:
        raw_hosts = top["hosts"]
        if not isinstance(raw_hosts, list) or not raw_hosts:
            raise where.fail(
                "hosts", f"must be a non-empty list of host tables, got {_kind(raw_hosts)}"
            )
        host_items: list[tuple[str, Mapping[str, Any]]] = [
            (f"hosts[{i}]", _table(where, f"hosts[{i}]", h, _HOST_KEYS))
            for i, h in enumerate(raw_hosts)
        ]
    else:
        host_items = [("", {"devices": top["devices"]})]

    hosts: list[_HostPlan] = []
    total = 0
    for field, host in host_items:
        prefix = f"{field}." if field else ""
        copies = _count(where, f"{prefix}count", host["count"]) if "count" in host else 1
        if "link" in host:
            link_field = f"{prefix}link"
            link = _link_spec(where, link_field, host["link"], allow_alias=True)
        else:
            link_field, link = ("link" if "link" in top else f"{prefix}link"), default_link
        if "devices" not in host:
            raise where.fail(field or "(top level)", "is missing key 'devices'")
        raw_devices = host["devices"]
        if not isinstance(raw_devices, list) or not raw_devices:
            raise where.fail(
                f"{prefix}devices",
                f"must be a non-empty list of device tables, got {_kind(raw_devices)}",
            )
        types: list[DeviceType] = []
        memories: list[int] = []
        for j, raw in enumerate(raw_devices):
            dfield = f"{prefix}devices[{j}]"
            entry = _table(where, dfield, raw, _DEVICE_KEYS)
            if "type" in entry:
                dtype = _device_type(where, f"{dfield}.type", entry["type"])
            elif device_type is not None:
                dtype = get_device_type(device_type)
            else:
                raise where.fail(dfield, f"is missing key 'type'; known types: {_known_types()}")
            count = _count(where, f"{dfield}.count", entry["count"]) if "count" in entry else 1
            memory = (
                _memory(where, f"{dfield}.memory", entry["memory"])
                if "memory" in entry
                else dtype.memory_bytes
            )
            types += [dtype] * count
            memories += [memory] * count
        total += copies * len(types)
        if total > _MAX_DEVICES:
            raise where.fail(field or "devices", f"makes more than {_MAX_DEVICES} devices")
        hosts += [_HostPlan(tuple(types), tuple(memories), link, link_field)] * copies

    n = sum(len(h.types) for h in hosts)
    pair_overrides: dict[tuple[int, int], Link] = {}
    if "links" in top:
        raw_links = top["links"]
        if not isinstance(raw_links, list):
            raise where.fail(
                "links", f"must be a list of {{devices, link}} tables, got {_kind(raw_links)}"
            )
        all_types = [t for h in hosts for t in h.types]
        for i, raw in enumerate(raw_links):
            lfield = f"links[{i}]"
            entry = _table(where, lfield, raw, _PAIR_KEYS)
            for key in _PAIR_KEYS:
                if key not in entry:
                    raise where.fail(
                        lfield, f"is missing key {key!r}; a pair needs devices = [a, b] and link"
                    )
            pair = entry["devices"]
            if (
                not isinstance(pair, list)
                or len(pair) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in pair)
            ):
                raise where.fail(
                    f"{lfield}.devices", f"must be two device indices [a, b], got {pair!r}"
                )
            a, b = min(pair), max(pair)
            if a < 0 or b >= n or a == b:
                raise where.fail(
                    f"{lfield}.devices",
                    f"{pair!r} must name two different devices in 0..{n - 1}",
                )
            if (a, b) in pair_overrides:
                raise where.fail(f"{lfield}.devices", f"pair {pair!r} is given twice")
            spec = _link_spec(where, f"{lfield}.link", entry["link"], allow_alias=True)
            pair_overrides[(a, b)] = _pair_link(
                where, f"{lfield}.link", spec, all_types[a], all_types[b]
            )
    if len(hosts) == 1 and inter is not None:
        logger.debug("%s: one host; inter_host_link is not used", origin)
    return _build(
        where,
        hosts,
        inter=inter,
        job=job,
        pair_overrides=pair_overrides,
        memory_limit_bytes=memory_limit_bytes,
    )


def _load_file(path: Path, *, device_type: str | None, memory_limit_bytes: int | None) -> Topology:
    origin = f"topology file {str(path)!r}"
    fmt = path.suffix.lower().lstrip(".")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{origin} does not exist; check the path") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise UsageError(f"cannot read {origin}: {reason}") from None
    data = _parse_text(text, fmt, origin)
    topology = parse_topology(
        data, origin=origin, device_type=device_type, memory_limit_bytes=memory_limit_bytes
    )
    logger.debug("%s: %s", origin, topology_summary(topology))
    return topology


# --------------------------------------------------------------------------------------------
# TF_CONFIG
# --------------------------------------------------------------------------------------------


def topology_from_tf_config(
    tf_config: str | Mapping[str, Any],
    *,
    device_type: str,
    devices_per_task: int = 1,
    intra_link: str = "pcie",
    inter_link: str = "eth100g",
    memory_limit_bytes: int | None = None,
) -> Topology:
    """The topology of a TF_CONFIG cluster: ``devices_per_task`` devices of ``device_type`` per
    task of the ``chief`` and ``worker`` jobs (``ps`` and ``evaluator`` hold no layers).

    ``tf_config`` is the JSON text of the ``TF_CONFIG`` variable or its parsed mapping, e.g.
    ``{"cluster": {"worker": ["host0:2222", "host1:2222"]}, "task": {"type": "worker",
    "index": 0}}``. Tasks whose addresses share a hostname share a host (joined by
    ``intra_link``); different hostnames are different hosts, joined by ``inter_link``. Devices
    are named ``/job:<job>/replica:0/task:<i>/device:GPU:<j>`` (``CPU`` for the ``cpu`` type),
    chief first, then workers in task order.
    """
    where = _Where("TF_CONFIG")
    data: object
    if isinstance(tf_config, str):
        try:
            data = json.loads(tf_config, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as exc:
            raise UsageError(
                f"TF_CONFIG is not valid JSON ({exc.msg} at column {exc.colno}); it should look "
                'like {"cluster": {"worker": ["host0:2222", "host1:2222"]}}'
            ) from None
        except ValueError as exc:
            raise UsageError(f"TF_CONFIG is not valid JSON ({exc})") from None
    else:
        data = dict(tf_config)
    if not isinstance(data, dict):
        raise where.fail("(top level)", f"must be an object with 'cluster', got {_kind(data)}")
    if "cluster" not in data:
        raise where.fail("(top level)", "is missing key 'cluster'")
    cluster = data["cluster"]
    if not isinstance(cluster, dict) or not cluster:
        raise where.fail(
            "cluster", f"must be a non-empty object of job -> addresses, got {_kind(cluster)}"
        )
    per_task = _count(where, "devices_per_task", devices_per_task)
    dtype = _device_type(where, "device_type", device_type)
    intra = _link_spec(where, "intra_link", intra_link, allow_alias=True)
    inter_spec = _link_spec(where, "inter_link", inter_link, allow_alias=False)
    assert isinstance(inter_spec, Link)

    tasks: list[tuple[str, int, str]] = []  # (job, task index, hostname)
    for job, addresses in cluster.items():
        if not isinstance(addresses, list) or any(
            not isinstance(a, str) or not a.strip() for a in addresses
        ):
            raise where.fail(
                f"cluster.{job}", f"must be a list of 'host:port' strings, got {addresses!r}"
            )
    for job in _TF_JOBS:
        for i, address in enumerate(cluster.get(job, [])):
            host = address.strip().rsplit(":", 1)[0] if ":" in address else address.strip()
            if not host:
                raise where.fail(f"cluster.{job}[{i}]", f"{address!r} has no hostname")
            tasks.append((job, i, host))
    if not tasks:
        raise where.fail(
            "cluster",
            f"has no {' or '.join(_TF_JOBS)} tasks to place layers on; jobs found: "
            f"{', '.join(map(str, cluster))}",
        )
    # One host per hostname, in order of first appearance; each task's devices on its host.
    host_index: dict[str, int] = {}
    for _, _, hostname in tasks:
        host_index.setdefault(hostname, len(host_index))
    kind = "CPU" if _is_host(dtype) else "GPU"
    devices: list[Device] = []
    for job, i, hostname in tasks:
        memory = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
        for j in range(per_task):
            devices.append(
                Device(
                    len(devices),
                    dtype.name,
                    memory,
                    host=host_index[hostname],
                    name=f"/job:{job}/replica:0/task:{i}/device:{kind}:{j}",
                )
            )
    link = _pair_link(where, "intra_link", intra, dtype, dtype)
    return Topology(
        devices=tuple(devices),
        link=link,
        inter_host_link=inter_spec if len(host_index) > 1 else None,
    )


# --------------------------------------------------------------------------------------------
# The --topology option
# --------------------------------------------------------------------------------------------


def _check_limit(memory_limit_bytes: int | None) -> None:
    if memory_limit_bytes is not None and (
        isinstance(memory_limit_bytes, bool)
        or not isinstance(memory_limit_bytes, int)
        or memory_limit_bytes <= 0
    ):
        raise CatalogError(
            f"memory_limit_bytes={memory_limit_bytes!r} must be a positive integer (or omitted to "
            "use the catalog figure)"
        )


def _check_count(num_devices: int | None) -> None:
    if num_devices is not None and (
        isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1
    ):
        raise CatalogError(f"num_devices={num_devices!r} must be an integer >= 1")


def load_topology(
    spec: str,
    *,
    device_type: str | None = None,
    num_devices: int | None = None,
    memory_limit_bytes: int | None = None,
    inter_link: str = "eth100g",
    environ: Mapping[str, str] | None = None,
) -> Topology:
    """The topology named by ``spec`` (the ``--topology`` option; see the module docstring).

    * a link kind (``pcie``, ``nvlink``, ``pcie4``, ...): ``num_devices`` devices of
      ``device_type`` on one host (both required);
    * ``tf-config``: the cluster in ``environ["TF_CONFIG"]`` (default ``os.environ``), with
      ``num_devices`` devices in all (default one per task; must divide evenly among the tasks),
      ``pcie`` within a host and ``inter_link`` between hosts;
    * a ``.json`` / ``.toml`` path: a topology file; ``num_devices``, when given, must match its
      device count, and ``device_type`` is the type of entries that name none.

    ``memory_limit_bytes``, when given, is every device's memory (overriding the catalog and the
    file). Errors are one-line :class:`~partitioner.core.errors.PartitionError` subclasses.
    """
    _check_count(num_devices)
    _check_limit(memory_limit_bytes)
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"--topology {spec!r} must be a link kind ({_known_links()}) or a file")
    text = spec.strip()
    key = text.lower()
    if key == TF_CONFIG_SPEC or key == "tf_config":
        if device_type is None:
            raise UsageError("--topology tf-config needs a device type (--device-type)")
        env = os.environ if environ is None else environ
        raw = env.get("TF_CONFIG")
        if not raw:
            raise UsageError(
                "--topology tf-config: the TF_CONFIG environment variable is not set; set it or "
                "give a topology file"
            )
        probe = topology_from_tf_config(raw, device_type=device_type, inter_link=inter_link)
        tasks = len({d.name.split("/device:")[0] for d in probe.devices})
        per_task = 1
        if num_devices is not None:
            if num_devices % tasks:
                raise UsageError(
                    f"--gpus {num_devices} does not divide among the {tasks} TF_CONFIG tasks; "
                    f"use a multiple of {tasks}"
                )
            per_task = num_devices // tasks
        return topology_from_tf_config(
            raw,
            device_type=device_type,
            devices_per_task=per_task,
            inter_link=inter_link,
            memory_limit_bytes=memory_limit_bytes,
        )
    if key in _ALIASES or key in catalog().links:
        if device_type is None or num_devices is None:
            raise UsageError(
                f"--topology {text} needs a device type and a device count (--device-type, --gpus)"
            )
        dtype = get_device_type(device_type)
        limit = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
        return Topology(
            devices=tuple(Device(i, dtype.name, limit) for i in range(num_devices)),
            link=resolve_link(key, dtype),
        )
    path = Path(text)
    if path.suffix.lower() not in (".json", ".toml"):
        raise UsageError(
            f"--topology {text!r} is neither a link kind ({_known_links()}, {TF_CONFIG_SPEC}) nor "
            "a .json/.toml topology file"
        )
    topology = _load_file(path, device_type=device_type, memory_limit_bytes=memory_limit_bytes)
    if num_devices is not None and num_devices != topology.num_devices:
        raise UsageError(
            f"topology file {text!r} describes {topology.num_devices} devices but --gpus is "
            f"{num_devices}; drop --gpus or make them agree"
        )
    return topology


def topology_summary(topology: Topology) -> str:
    """One line: ``"2 hosts x 8 h100, nvlink4 within hosts, eth100g between"``,
    ``"h100 + v100 (pcie3)"``, ``"4 x h100 (pcie5)"``."""
    by_host: dict[int, list[str]] = {}
    for d in topology.devices:
        by_host.setdefault(d.host, []).append(d.device_type)

    def group(types: list[str]) -> str:
        counts = Counter(types)
        if len(counts) == 1:
            ((t, c),) = counts.items()
            return f"{c} x {t}"
        return " + ".join(f"{c} x {t}" if c > 1 else t for t, c in counts.items())

    hosts = list(by_host.values())
    devs = topology.devices
    intra = sorted(
        {link.kind for a, b, link in topology.links if devs[a].host == devs[b].host}
        | {topology.link.kind}
    )
    if topology.num_devices == 1:
        return group(hosts[0])
    if len(hosts) == 1:
        return f"{group(hosts[0])} ({', '.join(intra)})"
    same = all(h == hosts[0] for h in hosts)
    body = f"{len(hosts)} hosts x {group(hosts[0])}" if same else "; ".join(group(h) for h in hosts)
    inter = topology.inter_host_link.kind if topology.inter_host_link is not None else "?"
    return f"{body}, {'/'.join(intra)} within hosts, {inter} between"
