"""Ring all-reduces over a link kind run at its published bus-bandwidth efficiency (nccl-tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.gpu_fidelity import DATA, all_reduce_rows
from cost_models.devices.catalog import catalog, load_catalog_from
from cost_models.devices.topology import load_topology
from cost_models.estimate.collectives import (
    AllReduceAlgorithm,
    all_reduce_s,
    ring_bandwidth_bytes_per_s,
)
from partitioner.core.errors import CatalogError
from partitioner.core.ir import Device, Link, Topology

GPU_LINKS = ("pcie3", "pcie4", "pcie5", "nvlink2", "nvlink3", "nvlink4")


def test_every_gpu_link_kind_has_an_efficiency_with_its_source() -> None:
    cat = catalog()
    for kind in GPU_LINKS:
        assert 0 < cat.collective_efficiency[kind] <= 1
        assert "http" in cat.collective_sources[kind], kind
    assert cat.ring_efficiency("eth100g") == 1.0  # no published collective figure: the link's own
    assert cat.ring_efficiency("NVLink3") == cat.collective_efficiency["nvlink3"]


def test_ring_all_reduce_runs_at_the_efficient_bandwidth() -> None:
    topo = load_topology("nvlink", device_type="a100-80gb", num_devices=8)
    link = topo.link
    efficiency = catalog().collective_efficiency["nvlink3"]
    assert ring_bandwidth_bytes_per_s(link) == pytest.approx(
        link.bandwidth_bytes_per_s * efficiency
    )
    num_bytes = 2**30
    step_s = link.latency_s + num_bytes / 8 / (link.bandwidth_bytes_per_s * efficiency)
    assert all_reduce_s(topo, tuple(range(8)), num_bytes) == pytest.approx(2 * 7 * step_s)


def test_reduce_to_one_and_unknown_link_kinds_keep_the_link_bandwidth() -> None:
    nv = load_topology("nvlink", device_type="a100-80gb", num_devices=2)
    link = nv.link
    assert all_reduce_s(nv, (0, 1), 1000, AllReduceAlgorithm.REDUCE_TO_ONE) == pytest.approx(
        2 * (link.latency_s + 1000 / link.bandwidth_bytes_per_s)
    )
    own = Link("measured-here", 0.0, 100.0)
    devices = tuple(Device(i, "a100-80gb", 1 << 30) for i in range(2))
    assert all_reduce_s(Topology(devices, own), (0, 1), 100) == pytest.approx(2 * 50 / 100)


def test_published_all_reduce_rows_are_predicted_within_15_percent() -> None:
    rows = json.loads(DATA.read_text(encoding="utf-8"))["all_reduce"]
    assert {r["role"] for r in rows} == {"calibration", "validation"}
    assert {r["link"] for r in rows} >= {"nvlink", "pcie5"}
    for row in all_reduce_rows(rows):
        assert abs(row["error"]) <= 0.15, row["id"]


def test_an_efficiency_outside_0_1_or_without_a_source_is_refused(tmp_path: Path) -> None:
    path = Path(__file__).parents[2] / "cost_models" / "data" / "devices.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    data["links"]["pcie4"]["collective"] = {"bus_bandwidth_efficiency": 1.5, "source": "x"}
    bad = tmp_path / "devices.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(CatalogError, match=r"pcie4.*bus_bandwidth_efficiency"):
        load_catalog_from(bad)
    data["links"]["pcie4"]["collective"] = {"bus_bandwidth_efficiency": 0.5}
    bad.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(CatalogError, match=r"pcie4.*source"):
        load_catalog_from(bad)
