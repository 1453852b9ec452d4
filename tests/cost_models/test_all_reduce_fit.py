"""The topology's optional measured all-reduce fit: the IR field, the file format, the collectives."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from cost_models.devices.topology import all_reduce_fit_to_dict, load_topology, parse_topology
from cost_models.estimate.collectives import (
    AllReduceAlgorithm,
    all_reduce_s,
    concurrent_all_reduce_s,
    measured_all_reduce_s,
)
from partitioner.core.errors import CatalogError, InvalidGraphError
from partitioner.core.ir import AllReduceFit, Device, Link, Topology

FIT = AllReduceFit(2e-3, 4e8, 2, "MWMS on 2 loopback workers", "ring")


def _data(**all_reduce: Any) -> dict[str, Any]:
    return {"link": "host", "devices": [{"type": "cpu", "count": 2}], "all_reduce": all_reduce}


def _cpus(n: int, fit: AllReduceFit | None) -> Topology:
    link = Link("fast", 1e-6, 1e10)
    devices = tuple(Device(i, "cpu", 1 << 30) for i in range(n))
    return Topology(devices=devices, link=link, all_reduce=fit)


def test_default_is_none_and_topologies_without_it_still_load() -> None:
    assert load_topology("pcie", num_devices=2, device_type="v100").all_reduce is None
    data = _data()
    del data["all_reduce"]
    assert parse_topology(data).all_reduce is None


@pytest.mark.parametrize("fit", [FIT, AllReduceFit(0.0, 1e9, 4, "measured", None)])
def test_round_trip_through_json_and_a_file(tmp_path: Path, fit: AllReduceFit) -> None:
    data = _data(**all_reduce_fit_to_dict(fit))
    data["devices"][0]["count"] = fit.members
    assert parse_topology(data).all_reduce == fit
    path = tmp_path / "t.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    assert load_topology(str(path)).all_reduce == fit


GOOD = all_reduce_fit_to_dict(FIT)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"latency_s": -1.0}, r"all_reduce\.latency_s: must be a number of seconds in 0\.\.10, got -1"),
        ({"bandwidth_bytes_per_s": 0}, r"all_reduce\.bandwidth_bytes_per_s: must be a number"),
        ({"bandwidth_bytes_per_s": "fast"}, r"bandwidth_bytes_per_s: must be a number of bytes"),
        ({"members": 1}, r"all_reduce\.members: must be the number of devices .*got 1"),
        ({"members": 3}, r"all_reduce\.members: is 3, more than the topology's 2 devices"),
        ({"source": ""}, r"all_reduce\.source: must be a non-empty string"),
        ({"algorithm": "tree"}, r"all_reduce\.algorithm: must be 'ring' or 'reduce_to_one'"),
        ({"speed": 1}, r"all_reduce: unknown key 'speed'"),
        ({"source": 7}, r"all_reduce\.source: must be a non-empty string, got a number"),
    ],
)
def test_the_schema_rejects_bad_values_in_one_line(change: dict[str, Any], match: str) -> None:
    fields = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    with pytest.raises(CatalogError, match=match) as info:
        parse_topology(_data(**fields), origin="topology file 't.json'")
    assert "\n" not in str(info.value)
    assert str(info.value).startswith("topology file 't.json': ")


def test_a_missing_key_is_named() -> None:
    fields = {k: v for k, v in GOOD.items() if k != "members"}
    with pytest.raises(CatalogError, match=r"all_reduce: is missing key 'members'"):
        parse_topology(_data(**fields))


def test_the_ir_rejects_bad_fits() -> None:
    with pytest.raises(InvalidGraphError, match="members=1 >= 2"):
        AllReduceFit(0.0, 1.0, 1, "x")
    with pytest.raises(InvalidGraphError, match="algorithm='tree'"):
        AllReduceFit(0.0, 1.0, 2, "x", "tree")


def test_collectives_use_the_fit_instead_of_the_links() -> None:
    num_bytes = 40_000_000
    without = all_reduce_s(_cpus(2, None), (0, 1), num_bytes)
    with_fit = all_reduce_s(_cpus(2, FIT), (0, 1), num_bytes)
    assert with_fit == pytest.approx(2e-3 + num_bytes / 4e8)
    assert with_fit > 10 * without  # the fast link alone would predict far less


def test_the_fit_applies_to_its_algorithm_only_and_to_any_when_unnamed() -> None:
    topology = _cpus(2, FIT)
    linked = all_reduce_s(_cpus(2, None), (0, 1), 1000, AllReduceAlgorithm.REDUCE_TO_ONE)
    assert all_reduce_s(topology, (0, 1), 1000, AllReduceAlgorithm.REDUCE_TO_ONE) == linked
    anyone = _cpus(2, AllReduceFit(1e-3, 1e9, 2, "measured"))
    for algorithm in AllReduceAlgorithm:
        assert all_reduce_s(anyone, (0, 1), 1000, algorithm) == pytest.approx(1e-3 + 1e-6)


def test_other_group_sizes_scale_as_a_ring_and_concurrent_bytes_add() -> None:
    # four members: 3 latencies (one per member - 1 of the fit) and 3/4 over 1/2 of the bytes
    assert measured_all_reduce_s(FIT, 4, 4e8) == pytest.approx(3 * 2e-3 + 1.5)
    assert measured_all_reduce_s(FIT, 1, 4e8) == 0.0
    topology = _cpus(4, FIT)
    both = concurrent_all_reduce_s(topology, [((0, 1), 1000), ((2, 3), 3000)])
    assert both == pytest.approx(2e-3 + 4000 / 4e8)
    assert concurrent_all_reduce_s(topology, [((0, 1), 0)]) == 0.0
