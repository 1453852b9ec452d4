"""The device catalog: datasheet figures of the device types a topology can be built from.

The figures live in ``cost_models/data/devices.json`` (data, not code); this module loads them
and checks them against ``catalog.schema.json`` (next to it) and the cross-references the schema
cannot express (link kinds, aliases). Every figure must be present and positive, else loading
raises :class:`~partitioner.core.errors.CatalogError` naming the entry and the field. Each
device type has a :class:`DeviceKind` (CPU or GPU) and a ``family`` (its architecture
generation): code tells device types apart by these fields, never by their names.
"""

from __future__ import annotations

import enum
import functools
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from cost_models.devices.datafiles import (
    SchemaProblem,
    field_path,
    parse_json,
    read_text,
    schema_problem,
)
from partitioner.core.errors import CatalogError, UnknownDeviceError
from partitioner.core.ir import Link

__all__ = [
    "Catalog",
    "DeviceKind",
    "DeviceType",
    "Precision",
    "catalog",
    "device_type_names",
    "get_device_type",
    "load_catalog",
    "load_catalog_from",
    "precision_of",
]

logger = logging.getLogger(__name__)

_PACKAGED_NAME = "devices.json"


class DeviceKind(enum.Enum):
    """What executes a device type's ops: the host's CPU or a GPU."""

    CPU = "cpu"
    GPU = "gpu"

    @property
    def tf_name(self) -> str:
        """The device type in a TensorFlow device string: ``CPU`` or ``GPU``."""
        return self.value.upper()


class Precision(enum.Enum):
    """The arithmetic precisions the catalog quotes peak FLOP/s for."""

    FP32 = "fp32"
    TF32 = "tf32"
    """Float32 storage, matmuls and convolutions on TF32 tensor cores (Ampere and newer)."""
    BF16 = "bf16"
    FP16 = "fp16"


_DTYPE_PRECISION: Mapping[str, Precision] = MappingProxyType(
    {
        "float32": Precision.FP32,
        "fp32": Precision.FP32,
        "float": Precision.FP32,
        "tf32": Precision.TF32,
        "bfloat16": Precision.BF16,
        "bf16": Precision.BF16,
        "float16": Precision.FP16,
        "fp16": Precision.FP16,
        "half": Precision.FP16,
    }
)


def precision_of(dtype: str) -> Precision:
    """The precision whose peak applies to ``dtype`` (a TF dtype name such as ``'bfloat16'``).

    Anything that is not a 16-bit float (ints, bools, float64, strings) uses the fp32 figure.
    """
    return _DTYPE_PRECISION.get(dtype.lower(), Precision.FP32)


@dataclass(frozen=True)
class DeviceType:
    """One catalog entry: the datasheet figures of a device type."""

    name: str
    description: str
    kind: DeviceKind
    """CPU or GPU: how TensorFlow names the device, and which links reach it."""
    family: str
    """The architecture generation (``turing``, ``ampere``, ``hopper``, ...; ``cpu``): a
    calibration fitted on one member of a family applies to the others."""
    peak_flops_per_s: Mapping[str, float] = field(compare=False)
    """Dense peak FLOP/s by precision key (``'fp32'``, ``'tf32'``, ``'bf16'``, ``'fp16'``):
    fp32 on the CUDA cores, the others on the tensor cores; read-only."""
    memory_bandwidth_bytes_per_s: float
    memory_bytes: int
    kernel_overhead_s: float
    default_link: str
    source: str
    nvlink: str | None = None
    """The NVLink generation this device's systems use, or ``None`` where it has none."""
    note: str = ""

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for ``dtype`` (TF dtype name or precision key)."""
        return self.peak_flops_per_s[precision_of(dtype).value]


@dataclass(frozen=True, eq=False)
class Catalog(Mapping[str, DeviceType]):
    """A loaded catalog: device types by canonical name, aliases, and link kinds."""

    devices: Mapping[str, DeviceType]
    aliases: Mapping[str, str]
    links: Mapping[str, Link]
    link_sources: Mapping[str, str]
    origin: str
    collective_efficiency: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    """Per link kind, the fraction of its bandwidth a ring all-reduce achieves as nccl-tests'
    bus bandwidth (NCCL's protocol overhead, the host bridges a PCIe ring crosses); kinds
    without a published figure are absent (1.0)."""
    collective_sources: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def ring_efficiency(self, kind: str) -> float:
        """The bus-bandwidth efficiency of a ring all-reduce over link ``kind`` (1.0 if unknown)."""
        return self.collective_efficiency.get(kind.strip().lower(), 1.0)

    def __getitem__(self, name: str) -> DeviceType:
        return self.devices[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.devices)

    def __len__(self) -> int:
        return len(self.devices)

    def resolve(self, name: str) -> DeviceType:
        """The device type called ``name`` (case-insensitive; aliases allowed)."""
        key = name.strip().lower()
        key = self.aliases.get(key, key)
        try:
            return self.devices[key]
        except KeyError:
            known = ", ".join(self.devices)
            aliases = ", ".join(f"{a}={t}" for a, t in self.aliases.items())
            hint = f" (aliases: {aliases})" if aliases else ""
            raise UnknownDeviceError(
                f"unknown device type {name!r}; known: {known}{hint}"
            ) from None


_SCHEMA = "devices/catalog.schema.json"
"""The catalog's JSON Schema, next to this reader (package data of ``cost_models``)."""


def _fail(origin: str, what: str) -> CatalogError:
    return CatalogError(f"device catalog {origin}: {what}")


def _schema_error(origin: str, problem: SchemaProblem) -> CatalogError:
    """A schema problem worded as the catalog's entries: ``entry 't4' field 'memory_bytes' ...``."""
    path = problem.path
    if len(path) < 2 or path[0] not in ("devices", "links"):
        return _fail(origin, f"{field_path(path)}: {problem.what}")
    entry = str(path[1]) if path[0] == "devices" else f"links.{path[1]}"
    rest = path[2:]
    if problem.missing_key is not None:
        missing = field_path((*rest, problem.missing_key))
        return _fail(origin, f"entry {entry!r} is missing field {missing!r}")
    if not rest:
        return _fail(origin, f"entry {entry!r} {problem.what}")
    return _fail(origin, f"entry {entry!r} field {field_path(rest)!r} {problem.what}")


def _link_kind(origin: str, entry: str, key: str, value: str, links: Mapping[str, Link]) -> str:
    """``value`` (a device's link field) as a known link kind."""
    kind = value.lower()
    if kind not in links:
        raise _fail(
            origin, f"entry {entry!r} {key} {kind!r} is not a link kind; known: {', '.join(links)}"
        )
    return kind


def _links(origin: str, raw: Mapping[str, Any]) -> tuple[dict[str, Link], dict[str, str]]:
    """The link kinds (lower-case) and the source of each figure."""
    links: dict[str, Link] = {}
    sources: dict[str, str] = {}
    for kind, body in raw.items():
        key = kind.lower()
        links[key] = Link(
            kind=key,
            latency_s=float(body["latency_s"]),
            bandwidth_bytes_per_s=float(body["bandwidth_bytes_per_s"]),
        )
        sources[key] = body["source"]
    return links, sources


def _collectives(raw: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, str]]:
    """The link kinds' ring all-reduce bus-bandwidth efficiencies and their sources."""
    efficiency: dict[str, float] = {}
    sources: dict[str, str] = {}
    for kind, body in raw.items():
        collective = body.get("collective")
        if collective is not None:
            efficiency[kind.lower()] = float(collective["bus_bandwidth_efficiency"])
            sources[kind.lower()] = collective["source"]
    return efficiency, sources


def _device(
    origin: str, name: str, body: Mapping[str, Any], links: Mapping[str, Link]
) -> DeviceType:
    """One schema-valid device entry, its link kinds checked against the catalog's links."""
    nvlink = body.get("nvlink")
    return DeviceType(
        name=name,
        description=body["description"],
        kind=DeviceKind(body["kind"]),
        family=body["family"].strip().lower(),
        peak_flops_per_s=MappingProxyType(
            {p.value: float(body["peak_flops_per_s"][p.value]) for p in Precision}
        ),
        memory_bandwidth_bytes_per_s=float(body["memory_bandwidth_bytes_per_s"]),
        memory_bytes=body["memory_bytes"],
        kernel_overhead_s=float(body["kernel_overhead_s"]),
        default_link=_link_kind(origin, name, "default_link", body["default_link"], links),
        source=body["source"],
        nvlink=None if nvlink is None else _link_kind(origin, name, "nvlink", nvlink, links),
        note=body.get("note", ""),
    )


def _devices(
    origin: str, raw: Mapping[str, Any], links: Mapping[str, Link]
) -> dict[str, DeviceType]:
    """The device entries by canonical (lower-case) name."""
    devices: dict[str, DeviceType] = {}
    for name, body in raw.items():
        key = name.strip().lower()
        if key in devices:
            raise _fail(origin, f"duplicate device entry {name!r} (names are case-insensitive)")
        devices[key] = _device(origin, key, body, links)
    return devices


def _aliases(
    origin: str, raw: Mapping[str, str], devices: Mapping[str, DeviceType]
) -> dict[str, str]:
    """Alias -> canonical device name, each pointing at a device and shadowing none."""
    aliases: dict[str, str] = {}
    for alias, target in raw.items():
        a, t = alias.strip().lower(), target.strip().lower()
        if a in devices:
            raise _fail(origin, f"alias {alias!r} shadows a device entry of the same name")
        if t not in devices:
            raise _fail(
                origin,
                f"alias {alias!r} points to unknown device {target!r}; known: {', '.join(devices)}",
            )
        aliases[a] = t
    return aliases


def _parse(text: str, origin: str) -> Catalog:
    """Parse, check against the schema, and build the catalog."""
    raw = parse_json(text, f"device catalog {origin}", CatalogError)
    problem = schema_problem(raw, "cost_models", _SCHEMA)
    if problem is not None:
        raise _schema_error(origin, problem)
    links, link_sources = _links(origin, raw["links"])
    devices = _devices(origin, raw["devices"], links)
    aliases = _aliases(origin, raw.get("aliases", {}), devices)
    efficiency, collective_sources = _collectives(raw["links"])
    logger.debug("loaded device catalog %s: %d devices, %d links", origin, len(devices), len(links))
    return Catalog(
        devices=MappingProxyType(devices),
        aliases=MappingProxyType(aliases),
        links=MappingProxyType(links),
        link_sources=MappingProxyType(link_sources),
        origin=origin,
        collective_efficiency=MappingProxyType(efficiency),
        collective_sources=MappingProxyType(collective_sources),
    )


def load_catalog_from(path: str | os.PathLike[str]) -> Catalog:
    """Load and validate a catalog file (the packaged one, or another for tests/overrides)."""
    p = Path(path)
    return _parse(read_text(p, f"device catalog {str(p)!r}", CatalogError), str(p))


@functools.lru_cache(maxsize=1)
def catalog() -> Catalog:
    """The packaged catalog (``cost_models/data/devices.json``), loaded once."""
    ref = resources.files("cost_models").joinpath("data", _PACKAGED_NAME)
    try:
        text = ref.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(
            f"cannot read the packaged device catalog data/{_PACKAGED_NAME}: {exc}; reinstall the package"
        ) from None
    try:
        return _parse(text, f"data/{_PACKAGED_NAME}")
    except CatalogError as exc:  # the package's own file, changed since it was installed
        raise CatalogError(f"{exc}; reinstall the package") from None


def load_catalog() -> Mapping[str, DeviceType]:
    """The packaged device types by canonical name (read-only)."""
    return catalog().devices


def get_device_type(name: str) -> DeviceType:
    """The device type ``name`` (case-insensitive, aliases such as ``a100`` allowed).

    Raises :class:`~partitioner.core.errors.UnknownDeviceError` listing the known names.
    """
    return catalog().resolve(name)


def device_type_names() -> tuple[str, ...]:
    """Canonical device type names, in catalog order."""
    return tuple(catalog().devices)
