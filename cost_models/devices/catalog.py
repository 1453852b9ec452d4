"""The device catalog: datasheet figures of the device types a topology can be built from.

The figures live in ``cost_models/data/devices.json`` (data, not code); this module loads and
validates them. Every figure must be present and positive, else loading raises
:class:`~partitioner.core.errors.CatalogError` naming the entry and the field.
"""

from __future__ import annotations

import enum
import functools
import json
import logging
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from partitioner.core.errors import CatalogError, UnknownDeviceError
from partitioner.core.ir import Link

__all__ = [
    "Catalog",
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


class Precision(enum.Enum):
    """The arithmetic precisions the catalog quotes peak FLOP/s for."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


_DTYPE_PRECISION: Mapping[str, Precision] = MappingProxyType(
    {
        "float32": Precision.FP32,
        "fp32": Precision.FP32,
        "float": Precision.FP32,
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
    peak_flops_per_s: Mapping[str, float] = field(compare=False)
    """Dense peak FLOP/s by precision key (``'fp32'``, ``'bf16'``, ``'fp16'``); read-only."""
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


_FLOP_KEYS = tuple(p.value for p in Precision)
_DEVICE_FIELDS = (
    "description",
    "peak_flops_per_s",
    "memory_bandwidth_bytes_per_s",
    "memory_bytes",
    "kernel_overhead_s",
    "default_link",
    "source",
)
_LINK_FIELDS = ("latency_s", "bandwidth_bytes_per_s", "source")


def _fail(origin: str, what: str) -> CatalogError:
    return CatalogError(f"device catalog {origin}: {what}")


def _number(origin: str, entry: str, key: str, value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(origin, f"entry {entry!r} field {key!r} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise _fail(origin, f"entry {entry!r} field {key!r} must be {bound}, got {value!r}")
    return float(value)


def _text(origin: str, entry: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(
            origin, f"entry {entry!r} field {key!r} must be a non-empty string, got {value!r}"
        )
    return value


def _require(origin: str, entry: str, obj: object, keys: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(obj, dict):
        raise _fail(origin, f"entry {entry!r} must be a JSON object, got {type(obj).__name__}")
    for key in keys:
        if key not in obj or obj[key] is None:
            raise _fail(
                origin,
                f"entry {entry!r} is missing field {key!r}; every entry needs: {', '.join(keys)}",
            )
    return obj


def _parse_links(origin: str, raw: object) -> tuple[dict[str, Link], dict[str, str]]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(origin, "'links' must be a non-empty JSON object of link kinds")
    links: dict[str, Link] = {}
    sources: dict[str, str] = {}
    for kind, body in raw.items():
        key = kind.lower()
        entry = f"links.{kind}"
        obj = _require(origin, entry, body, _LINK_FIELDS)
        latency = _number(origin, entry, "latency_s", obj["latency_s"], allow_zero=True)
        bandwidth = _number(origin, entry, "bandwidth_bytes_per_s", obj["bandwidth_bytes_per_s"])
        links[key] = Link(kind=key, latency_s=latency, bandwidth_bytes_per_s=bandwidth)
        sources[key] = _text(origin, entry, "source", obj["source"])
    return links, sources


def _parse_device(origin: str, name: str, body: object, links: Mapping[str, Link]) -> DeviceType:
    obj = _require(origin, name, body, _DEVICE_FIELDS)
    flops_raw = obj["peak_flops_per_s"]
    if not isinstance(flops_raw, dict):
        raise _fail(
            origin, f"entry {name!r} field 'peak_flops_per_s' must be an object of {_FLOP_KEYS}"
        )
    flops: dict[str, float] = {}
    for key in _FLOP_KEYS:
        if key not in flops_raw or flops_raw[key] is None:
            raise _fail(
                origin,
                f"entry {name!r} is missing field 'peak_flops_per_s.{key}'; "
                f"every entry needs: {', '.join(_FLOP_KEYS)}",
            )
        flops[key] = _number(origin, name, f"peak_flops_per_s.{key}", flops_raw[key])
    memory = obj["memory_bytes"]
    if isinstance(memory, bool) or not isinstance(memory, int) or memory <= 0:
        raise _fail(
            origin,
            f"entry {name!r} field 'memory_bytes' must be a positive integer, got {memory!r}",
        )
    default_link = _text(origin, name, "default_link", obj["default_link"]).lower()
    if default_link not in links:
        raise _fail(
            origin,
            f"entry {name!r} default_link {default_link!r} is not a link kind; known: {', '.join(links)}",
        )
    nvlink_raw = obj.get("nvlink")
    nvlink: str | None = None
    if nvlink_raw is not None:
        nvlink = _text(origin, name, "nvlink", nvlink_raw).lower()
        if nvlink not in links:
            raise _fail(
                origin,
                f"entry {name!r} nvlink {nvlink!r} is not a link kind; known: {', '.join(links)}",
            )
    note = obj.get("note", "")
    return DeviceType(
        name=name,
        description=_text(origin, name, "description", obj["description"]),
        peak_flops_per_s=MappingProxyType(flops),
        memory_bandwidth_bytes_per_s=_number(
            origin, name, "memory_bandwidth_bytes_per_s", obj["memory_bandwidth_bytes_per_s"]
        ),
        memory_bytes=memory,
        kernel_overhead_s=_number(
            origin, name, "kernel_overhead_s", obj["kernel_overhead_s"], allow_zero=True
        ),
        default_link=default_link,
        source=_text(origin, name, "source", obj["source"]),
        nvlink=nvlink,
        note=note if isinstance(note, str) else "",
    )


def _parse(text: str, origin: str) -> Catalog:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _fail(
            origin, f"not valid JSON ({exc.msg} at line {exc.lineno}); fix the file"
        ) from None
    if not isinstance(raw, dict):
        raise _fail(origin, "top level must be a JSON object with 'devices' and 'links'")
    links, link_sources = _parse_links(origin, raw.get("links"))
    devices_raw = raw.get("devices")
    if not isinstance(devices_raw, dict) or not devices_raw:
        raise _fail(origin, "'devices' must be a non-empty JSON object of device entries")
    devices: dict[str, DeviceType] = {}
    for name, body in devices_raw.items():
        key = name.strip().lower()
        if key in devices:
            raise _fail(origin, f"duplicate device entry {name!r} (names are case-insensitive)")
        devices[key] = _parse_device(origin, key, body, links)
    aliases_raw = raw.get("aliases", {})
    if not isinstance(aliases_raw, dict):
        raise _fail(origin, "'aliases' must be a JSON object mapping alias -> device name")
    aliases: dict[str, str] = {}
    for alias, target in aliases_raw.items():
        a = alias.strip().lower()
        t = target.strip().lower() if isinstance(target, str) else target
        if a in devices:
            raise _fail(origin, f"alias {alias!r} shadows a device entry of the same name")
        if t not in devices:
            raise _fail(
                origin,
                f"alias {alias!r} points to unknown device {target!r}; known: {', '.join(devices)}",
            )
        aliases[a] = t
    logger.debug("loaded device catalog %s: %d devices, %d links", origin, len(devices), len(links))
    return Catalog(
        devices=MappingProxyType(devices),
        aliases=MappingProxyType(aliases),
        links=MappingProxyType(links),
        link_sources=MappingProxyType(link_sources),
        origin=origin,
    )


def load_catalog_from(path: str | os.PathLike[str]) -> Catalog:
    """Load and validate a catalog file (the packaged one, or another for tests/overrides)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(
            f"cannot read device catalog {str(p)!r}: {exc.strerror or exc}; check the path"
        ) from None
    return _parse(text, str(p))


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
    return _parse(text, f"data/{_PACKAGED_NAME}")


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
