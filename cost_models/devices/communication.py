"""Links between devices: the ``links`` section of the catalog, plus device-aware shorthands.

``pcie`` means the device's own default link (its PCIe generation; ``host`` shared memory for
``cpu``); ``nvlink`` means the NVLink generation the device's systems use (v100 -> nvlink2,
a100 -> nvlink3, h100/h200 -> nvlink4). A link's time is ``latency_s + bytes / bandwidth``
(:meth:`partitioner.core.ir.Link.transfer_time_s`).
"""

from __future__ import annotations

import enum
import logging

from cost_models.devices.catalog import DeviceType, catalog
from partitioner.core.errors import CatalogError
from partitioner.core.ir import Link

__all__ = ["LinkAlias", "get_link", "link_names", "resolve_link"]

logger = logging.getLogger(__name__)


class LinkAlias(enum.Enum):
    """Link names that depend on the device type."""

    PCIE = "pcie"
    """The device's default link (its PCIe generation; ``host`` for cpu)."""
    NVLINK = "nvlink"
    """The NVLink generation matching the device."""
    DEFAULT = "default"
    """Same as ``pcie``: the device's default link."""


def link_names() -> tuple[str, ...]:
    """Concrete link kinds of the catalog, in catalog order."""
    return tuple(catalog().links)


def get_link(kind: str) -> Link:
    """The catalog link ``kind`` (case-insensitive), e.g. ``'pcie4'`` or ``'nvlink3'``."""
    key = kind.strip().lower()
    try:
        return catalog().links[key]
    except KeyError:
        aliases = ", ".join(a.value for a in LinkAlias)
        raise CatalogError(
            f"unknown link kind {kind!r}; known: {', '.join(link_names())} "
            f"(device-relative: {aliases})"
        ) from None


def resolve_link(kind: str, device_type: DeviceType) -> Link:
    """The link ``kind`` for devices of ``device_type``: a concrete kind, or ``pcie``/``nvlink``."""
    key = kind.strip().lower()
    if key in (LinkAlias.PCIE.value, LinkAlias.DEFAULT.value):
        link = get_link(device_type.default_link)
    elif key == LinkAlias.NVLINK.value:
        if device_type.nvlink is None:
            with_nvlink = ", ".join(n for n, d in catalog().devices.items() if d.nvlink is not None)
            raise CatalogError(
                f"device type {device_type.name!r} has no NVLink; use link 'pcie' "
                f"({device_type.default_link}) or pick one of: {with_nvlink}"
            )
        link = get_link(device_type.nvlink)
    else:
        link = get_link(key)
    logger.debug("link %r for %s resolved to %s", kind, device_type.name, link)
    return link
