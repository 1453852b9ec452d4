"""The device catalog: completeness of the packaged data, lookups, and malformed files."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from cost_models.devices.catalog import (
    Precision,
    catalog,
    device_type_names,
    get_device_type,
    load_catalog,
    load_catalog_from,
)
from partitioner.core.errors import CatalogError, UnknownDeviceError

REQUIRED = {"cpu", "t4", "l4", "v100", "v100-16gb", "a100-40gb", "a100-80gb", "h100", "h200"}


def packaged_json() -> dict[str, Any]:
    path = Path(__file__).parents[2] / "cost_models" / "data" / "devices.json"
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def test_every_entry_has_every_figure_and_a_source() -> None:
    devices = load_catalog()
    assert set(devices) >= REQUIRED
    assert set(device_type_names()) == set(devices)
    for name, d in devices.items():
        assert d.name == name
        assert d.description and d.source
        for p in Precision:
            assert d.peak_flops_per_s[p.value] > 0 and math.isfinite(d.peak_flops_per_s[p.value])
        assert d.memory_bandwidth_bytes_per_s > 0
        assert d.memory_bytes > 0
        assert d.kernel_overhead_s > 0
        assert d.default_link in catalog().links


def test_datasheet_figures() -> None:
    h100 = get_device_type("h100")
    assert h100.peak_flops("bfloat16") == pytest.approx(989e12)
    assert h100.peak_flops("float32") == pytest.approx(67e12)
    assert h100.memory_bandwidth_bytes_per_s == pytest.approx(3.35e12)
    assert get_device_type("h200").memory_bandwidth_bytes_per_s == pytest.approx(4.8e12)
    assert get_device_type("a100-40gb").memory_bandwidth_bytes_per_s == pytest.approx(1.555e12)
    v100 = get_device_type("v100")
    assert v100.peak_flops("float16") == pytest.approx(125e12)
    assert v100.peak_flops("bfloat16") == v100.peak_flops("float32")  # no bf16 on Volta
    assert get_device_type("v100-16gb").memory_bytes < v100.memory_bytes


def test_dtype_mapping() -> None:
    t4 = get_device_type("t4")
    assert t4.peak_flops("half") == t4.peak_flops("fp16") == t4.peak_flops("float16")
    for other in ("int32", "bool", "float64", "string"):
        assert t4.peak_flops(other) == t4.peak_flops("float32")


def test_lookup_is_case_insensitive_and_knows_aliases() -> None:
    assert get_device_type("H100") is get_device_type("h100")
    assert get_device_type(" A100 ") is get_device_type("a100-80gb")


def test_unknown_device_lists_known_names() -> None:
    with pytest.raises(UnknownDeviceError) as info:
        get_device_type("tpu-v9")
    msg = str(info.value)
    assert "'tpu-v9'" in msg and "\n" not in msg
    for name in REQUIRED:
        assert name in msg


def test_device_types_are_hashable() -> None:
    assert len({get_device_type("t4"), get_device_type("t4"), get_device_type("l4")}) == 2


def test_packaged_file_round_trips_through_load_catalog_from(tmp_path: Path) -> None:
    cat = load_catalog_from(write(tmp_path, packaged_json()))
    assert set(cat) == set(load_catalog())


@pytest.mark.parametrize("field", ["memory_bytes", "source", "default_link", "kernel_overhead_s"])
def test_missing_field_names_entry_and_field(tmp_path: Path, field: str) -> None:
    data = packaged_json()
    del data["devices"]["l4"][field]
    with pytest.raises(CatalogError) as info:
        load_catalog_from(write(tmp_path, data))
    assert "'l4'" in str(info.value) and repr(field) in str(info.value)


def test_missing_flops_figure(tmp_path: Path) -> None:
    data = packaged_json()
    del data["devices"]["t4"]["peak_flops_per_s"]["bf16"]
    with pytest.raises(CatalogError, match=r"'t4'.*peak_flops_per_s\.bf16"):
        load_catalog_from(write(tmp_path, data))


@pytest.mark.parametrize("bad", [0, -1.0, "fast", True, None])
def test_non_positive_figure(tmp_path: Path, bad: object) -> None:
    data = packaged_json()
    data["devices"]["h100"]["memory_bandwidth_bytes_per_s"] = bad
    with pytest.raises(CatalogError, match=r"'h100'.*memory_bandwidth_bytes_per_s"):
        load_catalog_from(write(tmp_path, data))


def test_bad_link_reference_and_alias(tmp_path: Path) -> None:
    data = packaged_json()
    data["devices"]["t4"]["default_link"] = "warp-drive"
    with pytest.raises(CatalogError, match=r"warp-drive.*known: pcie3"):
        load_catalog_from(write(tmp_path, data))
    data = packaged_json()
    data["aliases"]["x"] = "nope"
    with pytest.raises(CatalogError, match=r"'x'.*'nope'"):
        load_catalog_from(write(tmp_path, data))


def test_unreadable_or_invalid_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read"):
        load_catalog_from(tmp_path / "missing.json")
    path = tmp_path / "broken.json"
    path.write_text("{ not json", encoding="utf-8")
    with pytest.raises(CatalogError, match="not valid JSON"):
        load_catalog_from(path)
