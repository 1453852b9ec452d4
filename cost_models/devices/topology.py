"""Topologies: which devices, on which hosts, joined by which links.

:func:`load_topology` turns the ``topology=`` argument into a :class:`~partitioner.core.ir.Topology`:

* a link kind -- ``pcie`` (each device type's own PCIe generation), ``nvlink`` (the NVLink
  generation of the device type), or a concrete catalog kind (``pcie3``, ``nvlink4``, ``eth100g``,
  ``infiniband``, ...) -- gives ``num_devices`` identical devices of ``device_type`` on one host,
  every pair joined by that link;
* ``tf-config`` reads the cluster from the ``TF_CONFIG`` environment variable
  (:func:`topology_from_tf_config`, parsed by :mod:`cost_models.devices.tf_config`);
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

    [all_reduce]                  # optional: a measured all-reduce that replaces the estimate
    latency_s = 2e-3              #   from the links (cost_models.estimate.collectives)
    bandwidth_bytes_per_s = 4e8
    members = 2                   # the number of devices it was measured among (>= 2)
    source = "MWMS on 2 loopback workers"   # how it was measured
    algorithm = "ring"            # optional: ring | reduce_to_one; omitted: whichever ran
    tensors = 8                   # optional: tensors per measured all-reduce
    many_tensors = { tensors = 64, latency_s = 4e-3, bandwidth_bytes_per_s = 4e8 }
                                  # optional: the same with more tensors (needs tensors)

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

Validation is strict and data-only (JSON or TOML parsers, never code; the structure is checked
against ``topology.schema.json`` next to this module, the cross-references here): a syntax
error, a missing or unknown key, a wrong type, a negative number, an unknown device type or link
kind each raise a one-line :class:`~partitioner.core.errors.CatalogError` (or
:class:`~partitioner.core.errors.UnknownDeviceError` / :class:`~partitioner.core.errors.UsageError`) naming
the file, the field and what is known.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

from cost_models.devices.catalog import DeviceKind, DeviceType, catalog, get_device_type
from cost_models.devices.communication import LinkAlias, get_link, link_names, resolve_link
from cost_models.devices.datafiles import (
    check_schema,
    check_text_size,
    describe_value,
    parse_json,
    parse_toml,
)
from cost_models.devices.fits import LatencyBandwidthFit, fit_latency_bandwidth
from cost_models.devices.tf_config import (
    TF_CONFIG_VARIABLE,
    TfConfig,
    address_host,
    check_addresses,
    check_job_name,
    parse_tf_config,
    tf_config_text,
)
from partitioner.core.errors import CatalogError, PartitionError, UnknownDeviceError, UsageError
from partitioner.core.files import read_input_text
from partitioner.core.ir import AllReduceFit, Device, Link, TensorCountFit, Topology
from partitioner.core.options import MAX_DEVICES, short_text
from partitioner.core.units import parse_bytes

__all__ = [
    "MAX_TF_CONFIG_BYTES",
    "TF_CONFIG_SPEC",
    "all_reduce_fit_to_dict",
    "bounded_tf_config_text",
    "check_memory_limit",
    "links_note",
    "load_topology",
    "parse_topology",
    "topology_from_tf_config",
    "topology_summary",
]

logger = logging.getLogger(__name__)

TF_CONFIG_SPEC = "tf-config"
"""The ``topology=`` value that reads the cluster from the ``TF_CONFIG`` environment variable."""

_MAX_DEVICES = MAX_DEVICES
"""The most devices one topology describes: the most a run plans for (the schema's ``count``
bound is the same number), refused before a device is made."""

_SCHEMA = "devices/topology.schema.json"
"""The topology file's JSON Schema, next to this reader (package data of ``cost_models``)."""

TASKS_ON_A_HOST_LINK = "grpc-loopback"
"""The catalog link between devices of two TF_CONFIG tasks on one host (two processes: gRPC)."""

_TF_JOBS = ("chief", "worker")
"""TF_CONFIG jobs whose tasks hold devices for model layers (``ps`` and ``evaluator`` do not)."""

TF_CONFIG_JOBS = ("chief", "worker", "ps", "evaluator")
"""The jobs a ``TF_CONFIG`` cluster may have (``tf.distribute``'s task types)."""


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
# Values the schema has checked, resolved against the catalog
# --------------------------------------------------------------------------------------------


def _memory(where: _Where, field: str, value: int | str) -> int:
    """A device's memory: an integer of bytes, or a size such as ``"16GiB"``."""
    if isinstance(value, int):
        if value <= 0:
            raise where.fail(field, f"must be a positive number of bytes, got {value}")
        return value
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise where.fail(field, str(exc)) from None


def _device_type(where: _Where, field: str, value: object) -> DeviceType:
    if not isinstance(value, str) or not value.strip():
        raise where.fail(field, f"must be a non-empty string, got {describe_value(value)}")
    name = value.strip()
    try:
        return get_device_type(name)
    except UnknownDeviceError:
        raise UnknownDeviceError(
            f"{where.origin}: {field}: unknown device type {name!r}; known: {_known_types()}"
        ) from None


def _count(where: _Where, field: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.fail(field, f"must be a positive integer, got {describe_value(value)}")
    if value < 1 or value > _MAX_DEVICES:
        raise where.fail(field, f"must be an integer in 1..{_MAX_DEVICES}, got {value}")
    return value


# --------------------------------------------------------------------------------------------
# Links
# --------------------------------------------------------------------------------------------


_LinkSpec = Link | str
"""A concrete link, or an alias (``pcie``/``nvlink``/``default``) resolved per device pair."""

_ALIASES = frozenset(a.value for a in LinkAlias)


def _link_spec(where: _Where, field: str, value: object, *, allow_alias: bool) -> _LinkSpec:
    """A link kind (string) or a link table, as a :class:`Link` or a device-relative alias."""
    if isinstance(value, Mapping):
        return Link(
            kind=str(value.get("name", "custom")).strip(),
            latency_s=float(value["latency_s"]),
            bandwidth_bytes_per_s=float(value["bandwidth_bytes_per_s"]),
        )
    if not isinstance(value, str) or not value.strip():
        raise where.fail(
            field,
            "must be a link kind or a table with latency_s and bandwidth_bytes_per_s, got "
            f"{describe_value(value)}",
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


def _between_hosts(where: _Where, field: str, value: object) -> Link:
    """A link that joins hosts: a concrete kind or table (no device-relative alias)."""
    spec = _link_spec(where, field, value, allow_alias=False)
    assert isinstance(spec, Link)  # allow_alias=False returns concrete links only
    return spec


def _slower(a: Link, b: Link) -> Link:
    return min((a, b), key=lambda x: (x.bandwidth_bytes_per_s, -x.latency_s))


def _is_cpu(t: DeviceType) -> bool:
    return t.kind is DeviceKind.CPU


def _pcie_between(a: DeviceType, b: DeviceType) -> Link:
    gpus = [t for t in (a, b) if not _is_cpu(t)]
    if not gpus:
        return get_link(a.default_link)
    links = [get_link(t.default_link) for t in gpus]
    return _slower(links[0], links[-1])


def _nvlink_between(where: _Where, field: str, a: DeviceType, b: DeviceType) -> Link:
    """The NVLink of two GPUs of one NVLink generation (PCIe when one is a CPU)."""
    if _is_cpu(a) or _is_cpu(b):
        return _pcie_between(a, b)
    for t in (a, b):
        if t.nvlink is None:
            with_nvlink = ", ".join(n for n, d in catalog().devices.items() if d.nvlink is not None)
            raise where.fail(
                field,
                f"device type {t.name!r} has no NVLink; use link 'pcie' or a device type with "
                f"NVLink: {with_nvlink}",
            )
    if a.nvlink != b.nvlink or a.nvlink is None:
        raise where.fail(
            field,
            f"NVLink joins GPUs of one generation, but {a.name!r} has {a.nvlink} and {b.name!r} "
            f"has {b.nvlink}; use link 'pcie' or give the pair in [[links]]",
        )
    return get_link(a.nvlink)


def _pair_link(where: _Where, field: str, spec: _LinkSpec, a: DeviceType, b: DeviceType) -> Link:
    """The link ``spec`` between devices of types ``a`` and ``b`` on one host."""
    if isinstance(spec, Link):
        return spec
    if spec in (LinkAlias.PCIE.value, LinkAlias.DEFAULT.value):
        return _pcie_between(a, b)
    return _nvlink_between(where, field, a, b)


# --------------------------------------------------------------------------------------------
# Building a topology from resolved hosts
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _HostPlan:
    types: tuple[DeviceType, ...]
    memories: tuple[int, ...]
    link: _LinkSpec
    link_field: str


@dataclass(frozen=True)
class _Naming:
    """How devices are named: ``/job:<job>/replica:0/task:<t>/device:<K>:<j>``, or
    ``/device:<K>:<j>`` (one host with a CPU), or ``""`` (chosen when a plan is applied)."""

    job: str | None
    multi_host: bool
    any_cpu: bool

    def name(self, host: int, kind: DeviceKind, j: int) -> str:
        if self.job is not None or self.multi_host:
            return f"/job:{self.job or 'worker'}/replica:0/task:{host}/device:{kind.tf_name}:{j}"
        return f"/device:{kind.tf_name}:{j}" if self.any_cpu else ""


def _host_devices(
    h: int, plan: _HostPlan, first: int, naming: _Naming, memory_limit_bytes: int | None
) -> list[Device]:
    """The devices of host ``h``, numbered from ``first``; GPUs and CPUs counted apart."""
    counters = dict.fromkeys(DeviceKind, 0)
    out: list[Device] = []
    for t, mem in zip(plan.types, plan.memories, strict=True):
        j = counters[t.kind]
        counters[t.kind] += 1
        memory = mem if memory_limit_bytes is None else memory_limit_bytes
        out.append(Device(first + len(out), t.name, memory, host=h, name=naming.name(h, t.kind, j)))
    return out


def _host_links(where: _Where, plan: _HostPlan, first: int) -> dict[tuple[int, int], Link]:
    """The link of every pair of the host's devices (global indices from ``first``)."""
    n = len(plan.types)
    return {
        (first + a, first + b): _pair_link(
            where, plan.link_field, plan.link, plan.types[a], plan.types[b]
        )
        for a in range(n)
        for b in range(a + 1, n)
    }


def _build(
    where: _Where,
    hosts: Sequence[_HostPlan],
    *,
    inter: Link | None,
    job: str | None,
    pair_overrides: Mapping[tuple[int, int], Link],
    memory_limit_bytes: int | None,
) -> Topology:
    """The topology of resolved hosts: the most common intra-host link is the default, the
    others (and ``pair_overrides``) are per-pair links."""
    multi = len(hosts) > 1
    any_cpu = any(_is_cpu(t) for h in hosts for t in h.types)
    naming = _Naming(job, multi, any_cpu)
    devices: list[Device] = []
    intra: dict[tuple[int, int], Link] = {}
    for h, plan in enumerate(hosts):
        first = len(devices)
        devices += _host_devices(h, plan, first, naming, memory_limit_bytes)
        intra.update(_host_links(where, plan, first))
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


def _device_entries(
    where: _Where, prefix: str, raw_devices: Sequence[Mapping[str, Any]], device_type: str | None
) -> tuple[list[DeviceType], list[int]]:
    """The types and memories of one host's ``devices`` list, counts expanded."""
    types: list[DeviceType] = []
    memories: list[int] = []
    for j, entry in enumerate(raw_devices):
        dfield = f"{prefix}devices[{j}]"
        if "type" in entry:
            dtype = _device_type(where, f"{dfield}.type", entry["type"])
        elif device_type is not None:
            dtype = get_device_type(device_type)
        else:
            raise where.fail(dfield, f"is missing key 'type'; known types: {_known_types()}")
        count = entry.get("count", 1)
        memory = (
            _memory(where, f"{dfield}.memory", entry["memory"])
            if "memory" in entry
            else dtype.memory_bytes
        )
        types += [dtype] * count
        memories += [memory] * count
    return types, memories


def _host_items(top: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """``(field, host table)`` of every host entry; a top-level ``devices`` is one host."""
    if "hosts" in top:
        return [(f"hosts[{i}]", h) for i, h in enumerate(top["hosts"])]
    return [("", {"devices": top["devices"]})]


def _host_plans(
    where: _Where, top: Mapping[str, Any], default_link: _LinkSpec, device_type: str | None
) -> list[_HostPlan]:
    """Every host (``count`` copies expanded) with its devices and intra-host link."""
    hosts: list[_HostPlan] = []
    total = 0
    for field, host in _host_items(top):
        prefix = f"{field}." if field else ""
        copies = host.get("count", 1)
        if "link" in host:
            link_field = f"{prefix}link"
            link = _link_spec(where, link_field, host["link"], allow_alias=True)
        else:
            link_field, link = ("link" if "link" in top else f"{prefix}link"), default_link
        types, memories = _device_entries(where, prefix, host["devices"], device_type)
        total += copies * len(types)
        if total > _MAX_DEVICES:
            raise where.fail(
                field or "devices",
                f"makes {total} devices (at least), more than {_MAX_DEVICES}, the most a run "
                "plans for",
            )
        hosts += [_HostPlan(tuple(types), tuple(memories), link, link_field)] * copies
    return hosts


def _pair_overrides(
    where: _Where, raw_links: Sequence[Mapping[str, Any]], hosts: Sequence[_HostPlan]
) -> dict[tuple[int, int], Link]:
    """The ``[[links]]`` entries: a link per pair of device indices."""
    all_types = [t for h in hosts for t in h.types]
    n = len(all_types)
    overrides: dict[tuple[int, int], Link] = {}
    for i, entry in enumerate(raw_links):
        lfield = f"links[{i}]"
        pair = entry["devices"]
        a, b = min(pair), max(pair)
        if a < 0 or b >= n or a == b:
            raise where.fail(
                f"{lfield}.devices", f"{pair!r} must name two different devices in 0..{n - 1}"
            )
        if (a, b) in overrides:
            raise where.fail(f"{lfield}.devices", f"pair {pair!r} is given twice")
        spec = _link_spec(where, f"{lfield}.link", entry["link"], allow_alias=True)
        cpus = [t.name for t in (all_types[a], all_types[b]) if _is_cpu(t)]
        if str(entry["link"]).startswith("nvlink") and cpus:
            raise where.fail(
                f"{lfield}.link",
                f"is {entry['link']!r} between devices {a} and {b}, but device type "
                f"{cpus[0]!r} has no NVLink; use link 'pcie' for a CPU",
            )
        overrides[(a, b)] = _pair_link(where, f"{lfield}.link", spec, all_types[a], all_types[b])
    return overrides


def _all_reduce_fit(where: _Where, value: Mapping[str, Any], num_devices: int) -> AllReduceFit:
    """The ``all_reduce`` table (its structure checked by the schema) as a fit."""
    members = int(value["members"])
    if members > num_devices:
        raise where.fail(
            "all_reduce.members", f"is {members}, more than the topology's {num_devices} devices"
        )
    many = value.get("many_tensors")
    tensors = int(value.get("tensors", 0))
    if many is not None and not 1 <= tensors < int(many["tensors"]):
        raise where.fail(
            "all_reduce.tensors",
            f"is {tensors or 'missing'}; beside many_tensors.tensors = {many['tensors']} it must "
            "be the fit's own tensor count, from 1 to fewer than that",
        )
    return AllReduceFit(
        latency_s=float(value["latency_s"]),
        bandwidth_bytes_per_s=float(value["bandwidth_bytes_per_s"]),
        members=members,
        source=str(value["source"]).strip(),
        algorithm=value.get("algorithm"),
        tensors=tensors,
        many=None
        if many is None
        else TensorCountFit(
            tensors=int(many["tensors"]),
            latency_s=float(many["latency_s"]),
            bandwidth_bytes_per_s=float(many["bandwidth_bytes_per_s"]),
        ),
    )


def all_reduce_fit_to_dict(fit: AllReduceFit) -> dict[str, Any]:
    """The ``all_reduce`` table of a topology file for ``fit`` (what :func:`parse_topology`
    reads back)."""
    out: dict[str, Any] = {
        "latency_s": fit.latency_s,
        "bandwidth_bytes_per_s": fit.bandwidth_bytes_per_s,
        "members": fit.members,
        "source": fit.source,
    }
    if fit.algorithm is not None:
        out["algorithm"] = fit.algorithm
    if fit.tensors:
        out["tensors"] = fit.tensors
    if fit.many is not None:
        out["many_tensors"] = {
            "tensors": fit.many.tensors,
            "latency_s": fit.many.latency_s,
            "bandwidth_bytes_per_s": fit.many.bandwidth_bytes_per_s,
        }
    return out


def parse_topology(
    data: object,
    *,
    origin: str = "topology",
    device_type: str | None = None,
    memory_limit_bytes: int | None = None,
) -> Topology:
    """Build a topology from parsed file data (a dict as JSON or TOML gives it).

    ``data`` is checked against ``topology.schema.json``; ``device_type`` is the type of device
    entries that give none (else ``type`` is required); ``memory_limit_bytes``, when given, is
    every device's memory. ``origin`` starts every error message.
    """
    where = _Where(origin)
    check_schema(data, "cost_models", _SCHEMA, origin, CatalogError)
    top = cast(Mapping[str, Any], data)  # the schema says so
    job = top["job"].strip() if "job" in top else None
    if job is not None:
        check_job_name(job, origin, CatalogError)
    default_link: _LinkSpec = (
        _link_spec(where, "link", top["link"], allow_alias=True) if "link" in top else "pcie"
    )
    inter = (
        _between_hosts(where, "inter_host_link", top["inter_host_link"])
        if "inter_host_link" in top
        else None
    )
    hosts = _host_plans(where, top, default_link, device_type)
    pair_overrides = _pair_overrides(where, top.get("links", []), hosts)
    if len(hosts) == 1 and inter is not None:
        logger.debug("%s: one host; inter_host_link is not used", origin)
    topology = _build(
        where,
        hosts,
        inter=inter,
        job=job,
        pair_overrides=pair_overrides,
        memory_limit_bytes=memory_limit_bytes,
    )
    if "calibration" in top:
        _check_calibration(where, top, topology.num_devices)
        topology = replace(topology, **_measured_extras(where, top["calibration"], topology))
    if "all_reduce" not in top:
        return topology
    fit = _all_reduce_fit(where, top["all_reduce"], topology.num_devices)
    return replace(topology, all_reduce=fit)


def _measured_extras(where: _Where, cal: Mapping[str, Any], topology: Topology) -> dict[str, Any]:
    """The calibration's per-device compute speed and cluster addresses for the topology."""
    flops = tuple(float(f) for f in cal.get("matmul_flops_per_s", ()))
    if flops and len(flops) != topology.num_devices:
        raise where.fail(
            "calibration.matmul_flops_per_s",
            f"gives {len(flops)} speeds for {topology.num_devices} devices; run partition "
            "calibrate again",
        )
    extras: dict[str, Any] = {
        "device_flops_per_s": flops,
        "cluster_addresses": tuple(str(a) for a in cal.get("cluster", ())),
    }
    for key, field in (
        ("concurrent_compute", "concurrent_compute_factor"),
        ("concurrent_memory", "concurrent_memory_factor"),
    ):
        if cal.get(key) is not None:
            extras[field] = _concurrent_factor(where, key, cal[key], topology)
    client = cal.get("client")
    if client is not None:
        points = [(int(b), float(t)) for b, t in client["link_points"]]
        fit = fit_latency_bandwidth(points, f"{where.origin}: calibration.client.link_points")
        extras["client_step_s"] = float(client["step_s"])
        extras["client_link"] = Link(
            "measured client->device 0", fit.latency_s, fit.bandwidth_bytes_per_s
        )
    return extras


def _concurrent_factor(
    where: _Where, key: str, table: Mapping[str, Any], topology: Topology
) -> float:
    """``calibration.<key>``'s factor (``concurrent_compute``, ``concurrent_memory``): the
    reference on every device at once over the slowest device's alone (at least 1: running
    together is never taken as faster)."""
    alone = [float(t) for t in table["alone_s"]]
    if len(alone) != topology.num_devices:
        raise where.fail(
            f"calibration.{key}.alone_s",
            f"gives {len(alone)} times for {topology.num_devices} devices; run partition "
            "calibrate again",
        )
    return max(1.0, float(table["together_s"]) / max(alone))


def _same_figures(table: Mapping[str, Any], fit: LatencyBandwidthFit) -> bool:
    """Whether a file's ``latency_s`` / ``bandwidth_bytes_per_s`` are those fitted to its points
    (up to the rounding of writing them)."""
    return math.isclose(float(table["latency_s"]), fit.latency_s, rel_tol=1e-6, abs_tol=1e-12) and (
        math.isclose(float(table["bandwidth_bytes_per_s"]), fit.bandwidth_bytes_per_s, rel_tol=1e-6)
    )


def _edited(where: _Where, field: str, fit: LatencyBandwidthFit) -> CatalogError:
    return where.fail(
        field,
        f"differs from the fit of its calibration points (latency_s={fit.latency_s:.6g}, "
        f"bandwidth_bytes_per_s={fit.bandwidth_bytes_per_s:.6g}); run partition calibrate again, "
        "or delete the calibration table to use figures set by hand",
    )


def _check_calibration(where: _Where, top: Mapping[str, Any], num_devices: int) -> None:
    """A file written by ``partition calibrate``: every measured figure is the fit of its raw
    points (an edited figure, or points a fit cannot use, fail with one line)."""
    cal = top["calibration"]
    measured = cal.get("measured_devices")
    if measured is not None and len(measured) != num_devices:
        raise where.fail(
            "calibration.measured_devices",
            f"names {len(measured)} devices but the file has {num_devices}; run partition "
            "calibrate again",
        )
    tables = {
        tuple(sorted(e["devices"])): (i, e["link"]) for i, e in enumerate(top.get("links", []))
    }
    for k, entry in enumerate(cal["links"]):
        field = f"calibration.links[{k}]"
        pair = tuple(sorted(entry["devices"]))
        if pair not in tables or not isinstance(tables[pair][1], Mapping):
            raise where.fail(field, f"measures devices {list(pair)}, which no [[links]] table sets")
        points = [(int(b), float(s)) for b, s in entry["points"]]
        fit = fit_latency_bandwidth(points, f"{where.origin}: {field}")
        if not _same_figures(tables[pair][1], fit):
            raise _edited(where, f"links[{tables[pair][0]}].link", fit)
    if "all_reduce" not in top:
        raise where.fail("all_reduce", "is missing, though the calibration measured it")
    points = [(int(b), float(s)) for b, s in cal["all_reduce"]["points"]]
    fit = fit_latency_bandwidth(points, f"{where.origin}: calibration.all_reduce")
    if not _same_figures(top["all_reduce"], fit):
        raise _edited(where, "all_reduce", fit)
    _check_many_tensors(where, top["all_reduce"], cal["all_reduce"])


def _check_many_tensors(where: _Where, table: Mapping[str, Any], cal: Mapping[str, Any]) -> None:
    """The ``all_reduce`` table's tensor counts and ``many_tensors`` fit are those of the
    calibration's ``many_tensors`` points (both present, or neither)."""
    measured, written = cal.get("many_tensors"), table.get("many_tensors")
    if (measured is None) != (written is None):
        missing = "all_reduce.many_tensors" if written is None else "calibration.all_reduce"
        raise where.fail(
            missing,
            "is missing beside the other's many_tensors; run partition calibrate again",
        )
    if measured is None or written is None:
        return
    counts = (cal.get("tensors"), measured["tensors"])
    if counts != (table.get("tensors"), written["tensors"]):
        raise where.fail(
            "all_reduce.tensors",
            f"differs from the calibration's tensor counts {list(counts)}; run partition "
            "calibrate again",
        )
    points = [(int(b), float(s)) for b, s in measured["points"]]
    fit = fit_latency_bandwidth(points, f"{where.origin}: calibration.all_reduce.many_tensors")
    if not _same_figures(written, fit):
        raise _edited(where, "all_reduce.many_tensors", fit)


MAX_TOPOLOGY_BYTES = 1 << 20
"""The largest topology file read (1 MiB): a regular file, checked before it is opened."""

MAX_TF_CONFIG_BYTES = MAX_TOPOLOGY_BYTES
"""The longest ``TF_CONFIG`` value read (1 MiB, as a topology file)."""


def bounded_tf_config_text(
    environ: Mapping[str, str] | None = None, error: type[PartitionError] = UsageError
) -> str | None:
    """The ``TF_CONFIG`` variable of ``environ`` (None when unset or blank), ``error`` when it
    is longer than :data:`MAX_TF_CONFIG_BYTES`."""
    text = tf_config_text(environ)
    if text is None:
        return None
    return check_text_size(
        text, f"the {TF_CONFIG_VARIABLE} environment variable", error, MAX_TF_CONFIG_BYTES
    )


def _load_file(
    path: Path,
    *,
    device_type: str | None,
    memory_limit_bytes: int | None,
    device_type_given: bool = False,
) -> Topology:
    """Read, parse (JSON or TOML by suffix) and build a topology file; with
    ``device_type_given``, refuse a ``device_type`` that no entry of the file would take and
    that is not the type of all its devices (it would be ignored)."""
    origin = f"topology file {str(path)!r}"
    text = read_input_text(path, "topology file", UsageError, MAX_TOPOLOGY_BYTES)
    if path.suffix.lower() == ".json":
        data = parse_json(text, origin, CatalogError)
    else:
        data = parse_toml(text, origin, CatalogError)
    topology = parse_topology(
        data, origin=origin, device_type=device_type, memory_limit_bytes=memory_limit_bytes
    )
    typeless = any("type" not in e for _, host in _host_items(data) for e in host["devices"])
    types = list(dict.fromkeys(d.device_type for d in topology.devices))
    if device_type_given and not typeless and types != [device_type]:
        raise UsageError(
            f"{origin} names the type of each of its devices ({', '.join(types)}), so "
            f"device_type={device_type!r} would be ignored; drop one of the two"
        )
    logger.debug("%s: %s", origin, topology_summary(topology))
    return topology


# --------------------------------------------------------------------------------------------
# TF_CONFIG
# --------------------------------------------------------------------------------------------


def _tf_tasks(where: _Where, config: TfConfig) -> list[tuple[str, int, str]]:
    """``(job, task index, hostname)`` of every chief and worker task, chief first; a job
    TF_CONFIG does not define (a typo like ``Worker``) is refused, not dropped."""
    unknown = [job for job in config.job_names if job not in TF_CONFIG_JOBS]
    if unknown:
        raise where.fail(
            "cluster",
            f"has job {unknown[0]!r}, which TF_CONFIG does not define (its jobs: "
            f"{', '.join(TF_CONFIG_JOBS)}); rename it",
        )
    tasks: list[tuple[str, int, str]] = []
    for job in _TF_JOBS:
        for i, address in enumerate(config.addresses(job)):
            host = address_host(address)
            if not host:
                raise where.fail(f"cluster.{job}[{i}]", f"{address!r} has no hostname")
            tasks.append((job, i, host))
    if not tasks:
        raise where.fail(
            "cluster",
            f"has no {' or '.join(_TF_JOBS)} tasks to place layers on; jobs found: "
            f"{', '.join(short_text(j) for j in config.job_names)}",
        )
    return tasks


def _tf_devices(
    tasks: Sequence[tuple[str, int, str]], dtype: DeviceType, per_task: int, memory_bytes: int
) -> list[Device]:
    """``per_task`` devices per task, on one host per hostname (in order of first appearance)."""
    host_index: dict[str, int] = {}
    for _, _, hostname in tasks:
        host_index.setdefault(hostname, len(host_index))
    kind = dtype.kind.tf_name
    devices: list[Device] = []
    for job, i, hostname in tasks:
        for j in range(per_task):
            name = f"/job:{job}/replica:0/task:{i}/device:{kind}:{j}"
            devices.append(
                Device(len(devices), dtype.name, memory_bytes, host=host_index[hostname], name=name)
            )
    return devices


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
    "index": 0}}`` (parsed by :func:`cost_models.devices.tf_config.parse_tf_config`). Tasks
    whose addresses share a hostname share a host (joined by ``intra_link``); different
    hostnames are different hosts, joined by ``inter_link``; devices of two tasks on one host
    are two processes, joined by the catalog's ``grpc-loopback`` link
    (:data:`TASKS_ON_A_HOST_LINK`; ``partition calibrate`` measures it). Devices are named
    ``/job:<job>/replica:0/task:<i>/device:GPU:<j>`` (``CPU`` for a CPU device type), chief
    first, then workers in task order.
    """
    where = _Where(TF_CONFIG_VARIABLE)
    if isinstance(tf_config, str):
        check_text_size(tf_config, TF_CONFIG_VARIABLE, UsageError, MAX_TF_CONFIG_BYTES)
    config = check_addresses(
        parse_tf_config(tf_config), origin=TF_CONFIG_VARIABLE, error=CatalogError
    )
    per_task = _count(where, "devices_per_task", devices_per_task)
    dtype = _device_type(where, "device_type", device_type)
    if per_task > 1 and dtype.kind is DeviceKind.CPU:
        raise UsageError(
            f"devices_per_task={per_task} CPU devices: a TensorFlow process (a TF_CONFIG task) "
            "has one CPU device, so no worker would have the others; give devices_per_task=1"
        )
    intra = _link_spec(where, "intra_link", intra_link, allow_alias=True)
    inter = _between_hosts(where, "inter_link", inter_link)
    tasks = _tf_tasks(where, config)
    if len(tasks) * per_task > _MAX_DEVICES:
        raise where.fail(
            "cluster",
            f"{len(tasks)} tasks x {per_task} device(s) makes {len(tasks) * per_task} devices, "
            f"more than {_MAX_DEVICES}",
        )
    memory = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    devices = _tf_devices(tasks, dtype, per_task, memory)
    num_hosts = len({host for _, _, host in tasks})
    return Topology(
        devices=tuple(devices),
        link=_pair_link(where, "intra_link", intra, dtype, dtype),
        inter_host_link=inter if num_hosts > 1 else None,
        links=_between_tasks_on_a_host(tasks, per_task),
    )


def _between_tasks_on_a_host(
    tasks: Sequence[tuple[str, int, str]], per_task: int
) -> tuple[tuple[int, int, Link], ...]:
    """Devices of two tasks on one host: two TensorFlow processes, which exchange tensors over
    gRPC (the catalog's :data:`TASKS_ON_A_HOST_LINK`), not over the host's device link."""
    link = get_link(TASKS_ON_A_HOST_LINK)
    owner = [(k, host) for k, (_, _, host) in enumerate(tasks) for _ in range(per_task)]
    return tuple(
        (a, b, link)
        for a, (task_a, host_a) in enumerate(owner)
        for b, (task_b, host_b) in enumerate(owner)
        if a < b and host_a == host_b and task_a != task_b
    )


# --------------------------------------------------------------------------------------------
# The topology= argument
# --------------------------------------------------------------------------------------------


def check_memory_limit(memory_limit_bytes: int | None) -> None:
    """CatalogError unless ``memory_limit_bytes`` is None or a positive integer."""
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


def _load_tf_config(
    *,
    device_type: str | None,
    num_devices: int | None,
    memory_limit_bytes: int | None,
    inter_link: str,
    environ: Mapping[str, str] | None,
) -> Topology:
    """``topology="tf-config"``: the cluster of the environment's TF_CONFIG, ``num_devices``
    spread evenly over its tasks (default one per task)."""
    spec = f"topology={TF_CONFIG_SPEC!r}"
    if device_type is None:
        raise UsageError(f"{spec} needs a device type, e.g. device_type='h100'")
    raw = bounded_tf_config_text(environ)
    if raw is None:
        raise UsageError(
            f"{spec}: the TF_CONFIG environment variable is not set; set it or give a topology "
            "file"
        )
    config = check_addresses(parse_tf_config(raw), origin=TF_CONFIG_VARIABLE, error=CatalogError)
    tasks = len(_tf_tasks(_Where(TF_CONFIG_VARIABLE), config))
    per_task = 1
    if num_devices is not None:
        if num_devices % tasks:
            raise UsageError(
                f"gpus={num_devices} does not divide among the {tasks} TF_CONFIG tasks; "
                f"use a multiple of {tasks}"
            )
        per_task = num_devices // tasks
    if per_task > 1 and get_device_type(device_type).kind is DeviceKind.CPU:
        raise UsageError(
            f"gpus={num_devices} over the {tasks} TF_CONFIG tasks makes {per_task} CPU devices "
            f"per task, but a TensorFlow process has one CPU device, so no worker would have the "
            f"others; plan gpus={tasks} (one device per task), or for a GPU device type"
        )
    return topology_from_tf_config(
        raw,
        device_type=device_type,
        devices_per_task=per_task,
        inter_link=inter_link,
        memory_limit_bytes=memory_limit_bytes,
    )


def _uniform(
    kind: str, *, device_type: str | None, num_devices: int | None, memory_limit_bytes: int | None
) -> Topology:
    """A link kind: ``num_devices`` devices of ``device_type`` on one host, joined by it."""
    if device_type is None or num_devices is None:
        raise UsageError(
            f"topology={kind!r} needs a device type and a device count, e.g. "
            "device_type='h100', gpus=2"
        )
    dtype = get_device_type(device_type)
    limit = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    return Topology(
        devices=tuple(Device(i, dtype.name, limit) for i in range(num_devices)),
        link=resolve_link(kind, dtype),
    )


def _from_file(
    text: str,
    *,
    device_type: str | None,
    num_devices: int | None,
    memory_limit_bytes: int | None,
    device_type_given: bool,
) -> Topology:
    """A ``.json``/``.toml`` topology file, its device count checked against ``num_devices``."""
    path = Path(text)
    if path.suffix.lower() not in (".json", ".toml"):
        raise UsageError(
            f"topology={text!r} is neither a link kind ({_known_links()}, {TF_CONFIG_SPEC}) nor "
            "a .json/.toml topology file"
        )
    topology = _load_file(
        path,
        device_type=device_type,
        memory_limit_bytes=memory_limit_bytes,
        device_type_given=device_type_given,
    )
    if num_devices is not None and num_devices != topology.num_devices:
        raise UsageError(
            f"topology file {text!r} describes {topology.num_devices} devices but "
            f"gpus={num_devices}; give no device count or make them agree"
        )
    return topology


def load_topology(
    spec: str,
    *,
    device_type: str | None = None,
    num_devices: int | None = None,
    memory_limit_bytes: int | None = None,
    inter_link: str = "eth100g",
    environ: Mapping[str, str] | None = None,
    device_type_given: bool = False,
) -> Topology:
    """The topology named by ``spec`` (the ``topology=`` argument; see the module docstring).

    * a link kind (``pcie``, ``nvlink``, ``pcie4``, ...): ``num_devices`` devices of
      ``device_type`` on one host (both required);
    * ``tf-config``: the cluster in ``environ["TF_CONFIG"]`` (default ``os.environ``), with
      ``num_devices`` devices in all (default one per task; must divide evenly among the tasks),
      ``pcie`` within a host and ``inter_link`` between hosts;
    * a ``.json`` / ``.toml`` path: a topology file; ``num_devices``, when given, must match its
      device count, and ``device_type`` is the type of entries that name none; with
      ``device_type_given`` (the user chose it, not a default) a file whose every entry names
      a type refuses it (it would be ignored) unless all its devices are of that type.

    ``memory_limit_bytes``, when given, is every device's memory (overriding the catalog and the
    file). Errors are one-line :class:`~partitioner.core.errors.PartitionError` subclasses.
    """
    _check_count(num_devices)
    check_memory_limit(memory_limit_bytes)
    if not isinstance(spec, str) or not spec.strip():
        raise UsageError(f"topology={spec!r} must be a link kind ({_known_links()}) or a file")
    text = spec.strip()
    key = text.lower()
    if key in (TF_CONFIG_SPEC, "tf_config"):
        return _load_tf_config(
            device_type=device_type,
            num_devices=num_devices,
            memory_limit_bytes=memory_limit_bytes,
            inter_link=inter_link,
            environ=environ,
        )
    if key in _ALIASES or key in catalog().links:
        return _uniform(
            key,
            device_type=device_type,
            num_devices=num_devices,
            memory_limit_bytes=memory_limit_bytes,
        )
    return _from_file(
        text,
        device_type=device_type,
        num_devices=num_devices,
        memory_limit_bytes=memory_limit_bytes,
        device_type_given=device_type_given,
    )


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


def _link_kinds_used(topology: Topology) -> set[str]:
    """The kinds of link some pair of devices uses (:meth:`Topology.link_between`: a pair's
    override, else the inter-host link between hosts, else the intra-host link), counted from
    the pairs each rule covers, not pair by pair (a 512-device topology has 130k pairs)."""
    host = [d.host for d in topology.devices]
    n = len(host)
    same = sum(c * (c - 1) // 2 for c in Counter(host).values())
    same_overridden = sum(1 for a, b, _ in topology.links if host[a] == host[b])
    kinds = {link.kind for _, _, link in topology.links}
    if same > same_overridden:
        kinds.add(topology.link.kind)
    cross_left = (n * (n - 1) // 2 - same) - (len(topology.links) - same_overridden)
    if cross_left > 0 and topology.inter_host_link is not None:
        kinds.add(topology.inter_host_link.kind)
    return kinds


def links_note(topology: Topology) -> str:
    """Which transfer figures were measured and which come from the catalog, for the plan's
    cost notes: ``links measured (measured 0<->1); all-reduce measured (...)``."""
    if topology.num_devices < 2:
        return "no links (one device)"
    kinds = _link_kinds_used(topology)
    known = catalog().links
    measured = sorted(k for k in kinds if k not in known)
    listed = sorted(k for k in kinds if k in known)
    parts = []
    if measured:
        parts.append(f"links from the topology file ({', '.join(measured)})")
    if listed:
        parts.append(f"links from the catalog ({', '.join(listed)})")
    fit = topology.all_reduce
    if fit is None:
        parts.append("all-reduce estimated from the links")
    else:
        parts.append(f"all-reduce measured: {fit.source}")
    if topology.concurrent_compute_factor != 1.0 or topology.concurrent_memory_factor is not None:
        memory = topology.concurrent_factor(1.0)
        parts.append(
            f"devices computing at once measured x{topology.concurrent_compute_factor:.2f} "
            f"slower on matrix products, x{memory:.2f} on memory traffic (each op by its share)"
        )
    return "; ".join(parts)
