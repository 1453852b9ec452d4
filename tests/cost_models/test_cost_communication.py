"""Links: catalog kinds, device-relative shorthands, transfer times."""

from __future__ import annotations

import pytest

from cost_models.devices.catalog import get_device_type
from cost_models.devices.communication import get_link, link_names, resolve_link
from partitioner.core.errors import CatalogError

EXPECTED = {
    "pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4",
    "host", "eth10g", "eth25g", "eth100g", "infiniband",
}  # fmt: skip


def test_catalog_has_every_link() -> None:
    assert set(link_names()) >= EXPECTED
    for kind in EXPECTED:
        link = get_link(kind)
        assert link.kind == kind and link.bandwidth_bytes_per_s > 0 and link.latency_s >= 0


def test_transfer_time_is_latency_plus_bytes_over_bandwidth() -> None:
    link = get_link("pcie4")
    n = 96_000_000
    assert link.transfer_time_s(n) == pytest.approx(link.latency_s + n / link.bandwidth_bytes_per_s)
    assert link.transfer_time_s(0) == 0.0


@pytest.mark.parametrize(
    ("device", "pcie", "nvlink"),
    [("v100", "pcie3", "nvlink2"), ("a100", "pcie4", "nvlink3"), ("h100", "pcie5", "nvlink4"),
     ("h200", "pcie5", "nvlink4")],
)  # fmt: skip
def test_shorthands(device: str, pcie: str, nvlink: str) -> None:
    d = get_device_type(device)
    assert resolve_link("pcie", d) == get_link(pcie)
    assert resolve_link("NVLink", d) == get_link(nvlink)
    assert resolve_link("eth10g", d) == get_link("eth10g")


def test_cpu_default_is_host_memory() -> None:
    assert resolve_link("pcie", get_device_type("cpu")).kind == "host"


@pytest.mark.parametrize("device", ["t4", "l4", "cpu"])
def test_nvlink_on_device_without_it(device: str) -> None:
    with pytest.raises(CatalogError, match=f"'{device}' has no NVLink.*v100"):
        resolve_link("nvlink", get_device_type(device))


def test_unknown_link_lists_known() -> None:
    with pytest.raises(CatalogError, match=r"'carrier-pigeon'; known: pcie3.*infiniband.*nvlink"):
        get_link("carrier-pigeon")
