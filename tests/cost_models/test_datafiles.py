"""The shared data-file reader (cost_models.devices.datafiles), the one TF_CONFIG parser
(cost_models.devices.tf_config), and device kinds and families as catalog fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cost_models.devices.catalog import DeviceKind, catalog, get_device_type
from cost_models.devices.datafiles import (
    describe_value,
    field_path,
    load_schema,
    parse_json,
    parse_toml,
    read_text,
    schema_problem,
)
from cost_models.devices.tf_config import (
    TfConfig,
    address_host,
    parse_cluster_jobs,
    parse_tf_config,
    tf_config_text,
)
from cost_models.estimate.analytic import device_family
from partitioner.core.errors import CatalogError, UsageError

# ------------------------------------------------------------------------- the reader


def test_read_text_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match=r"cannot read my file: it does not exist; check the path"):
        read_text(tmp_path / "none.json", "my file", UsageError)
    (tmp_path / "f.json").write_text("{}")
    assert read_text(tmp_path / "f.json", "my file", UsageError) == "{}"


@pytest.mark.parametrize(
    ("text", "piece"),
    [
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ('{"a": NaN}', "NaN is not a number JSON allows"),
        ('{"a": Infinity}', "Infinity is not a number JSON allows"),
        ("{", "Expecting property name enclosed in double quotes at line 1 column 2"),
    ],
)
def test_json_is_strict(text: str, piece: str) -> None:
    with pytest.raises(CatalogError) as info:
        parse_json(text, "x.json", CatalogError)
    assert str(info.value).startswith("x.json is not valid JSON (") and piece in str(info.value)
    assert str(info.value).endswith("; fix the file")


def test_toml() -> None:
    assert parse_toml('a = 1\n[b]\nc = "d"\n', "x.toml", CatalogError) == {"a": 1, "b": {"c": "d"}}
    with pytest.raises(CatalogError, match=r"^x\.toml is not valid TOML \("):
        parse_toml("a = [", "x.toml", CatalogError)


def test_field_paths_and_values() -> None:
    assert field_path(()) == "(top level)"
    assert field_path(("hosts", 0, "devices", 1, "count")) == "hosts[0].devices[1].count"
    assert field_path(("a b", 2)) == '["a b"][2]'
    assert field_path(("hosts", "gpu-a")) == "hosts.gpu-a"
    assert describe_value("two") == "a string ('two')"
    assert describe_value(True) == "a boolean (True)"
    assert describe_value(3) == "a number (3)"
    assert describe_value([1]) == "a list" and describe_value({}) == "an empty object (table)"
    assert describe_value(None) == "null"


def test_schema_problems_are_worded_for_people() -> None:
    def what(data: object) -> tuple[str, str]:
        problem = schema_problem(data, "cost_models", "devices/topology.schema.json")
        assert problem is not None
        return field_path(problem.path), problem.what

    assert what({"devices": [{"type": "h100", "count": 1.0}]}) == (
        "devices[0].count", "must be a positive integer, got a number (1.0)"
    )  # a JSON integer, not 1.0
    assert what({"devices": [{"type": "h100", "count": 5000}]}) == (
        "devices[0].count", "must be an integer in 1..512, got 5000"
    )
    assert what({"link": {"latency_s": float("nan"), "bandwidth_bytes_per_s": 1e9},
                 "devices": [{"type": "h100"}]}) == (
        "link.latency_s", "must be a number of seconds in 0..10, got a number (nan)"
    )  # fmt: skip
    assert what({"devices": [{"type": "h100"}], "nmae": "x"})[1].startswith(
        "unknown key 'nmae'; known keys: name, job"
    )
    assert schema_problem({"devices": [{"type": "h100"}]}, "cost_models",
                          "devices/topology.schema.json") is None  # fmt: skip


@pytest.mark.parametrize(
    "resource",
    [
        "devices/catalog.schema.json",
        "devices/topology.schema.json",
        "devices/tf_config.schema.json",
        "estimate/calibration.schema.json",
        "measure/profile_cache.schema.json",
    ],
)
def test_schemas_ship_next_to_their_readers(resource: str) -> None:
    import jsonschema

    schema = load_schema("cost_models", resource)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"].endswith("2020-12/schema") and schema["title"]


def test_packaged_data_fits_its_schemas() -> None:
    data = Path(__file__).resolve().parents[2] / "cost_models" / "data"
    devices = json.loads((data / "devices.json").read_text())
    assert schema_problem(devices, "cost_models", "devices/catalog.schema.json") is None
    for path in data.glob("calibration_*.json"):
        raw = json.loads(path.read_text())
        assert schema_problem(raw, "cost_models", "estimate/calibration.schema.json") is None


# ------------------------------------------------------------------------- TF_CONFIG

TF_CONFIG = {
    "cluster": {"chief": ["alpha:2222"], "worker": ["alpha:2223", "beta:2222"]},
    "task": {"type": "worker", "index": 1},
    "environment": "cloud",
}


def test_tf_config_parses_text_and_mappings_alike() -> None:
    parsed = parse_tf_config(json.dumps(TF_CONFIG))
    assert parsed == parse_tf_config(TF_CONFIG)
    assert parsed.job_names == ("chief", "worker")
    assert parsed.addresses("worker") == ("alpha:2223", "beta:2222")
    assert parsed.addresses("ps") == ()
    assert (parsed.task_type, parsed.task_index) == ("worker", 1)
    assert parsed.as_dict() == TF_CONFIG["cluster"]
    no_index = parse_tf_config({"cluster": {"worker": ["a:1"]}, "task": {"type": "worker"}})
    assert no_index.task_index == 0
    assert parse_tf_config({"cluster": {"worker": ["a:1"]}}) == TfConfig((("worker", ("a:1",)),))


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ("{cluster", UsageError, "TF_CONFIG is not valid JSON ("),
        ("[]", CatalogError, "TF_CONFIG: (top level): must be an object with 'cluster', got a list"),
        ('{"cluster": {}}', CatalogError,
         "TF_CONFIG: cluster: must be a non-empty object of job -> addresses, got an empty object (table)"),
        ('{"cluster": {"worker": ["a:1"]}, "task": {"type": "worker", "index": -1}}',
         CatalogError, "TF_CONFIG: task.index: must be an integer >= 0, got a number (-1)"),
        ('{"cluster": {"worker": [""]}}', CatalogError,
         "TF_CONFIG: cluster.worker[0]: must be a 'host:port' string, got a string ('')"),
    ],
)  # fmt: skip
def test_bad_tf_config(config: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error) as info:
        parse_tf_config(config)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_cluster_jobs_and_environment() -> None:
    assert parse_cluster_jobs({"worker": ["a:1", "b:2"]}) == (("worker", ("a:1", "b:2")),)
    with pytest.raises(UsageError, match=r"^c\.json: worker: must be a list of 'host:port'"):
        parse_cluster_jobs({"worker": "a:1"}, origin="c.json", error=UsageError)
    assert tf_config_text({"TF_CONFIG": " "}) is None
    assert tf_config_text({"TF_CONFIG": "{}"}) == "{}"
    assert address_host("host0:2222") == "host0" and address_host(":1") == ""


# ------------------------------------------------------------------------- kinds and families


def test_device_kind_and_family_are_catalog_fields() -> None:
    assert get_device_type("cpu").kind is DeviceKind.CPU
    assert all(d.kind is DeviceKind.GPU for n, d in catalog().devices.items() if n != "cpu")
    assert DeviceKind.CPU.tf_name == "CPU" and DeviceKind.GPU.tf_name == "GPU"
    assert get_device_type("h200").family == get_device_type("h100").family == "hopper"
    assert device_family("a100") == "ampere"  # aliases resolve
    assert device_family("tpu9") == "tpu9"  # unknown names are their own family
