"""Topologies: --topology kinds, JSON/TOML files, TF_CONFIG, and costing on mixed device types."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cost_model_graphs import op

from cost_models.devices.catalog import get_device_type
from cost_models.devices.communication import get_link
from cost_models.devices.topology import (
    load_topology,
    parse_topology,
    topology_from_tf_config,
    topology_summary,
)
from cost_models.estimate.analytic import (
    DEFAULT_ROOFLINE,
    RooflineModel,
    calibrated_roofline,
    calibration_note,
    estimate_op_times_s,
)
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.precision import op_peak_flops, traced_precision
from partitioner.core.errors import CatalogError, PartitionError, UnknownDeviceError, UsageError
from partitioner.core.ir import Device, Edge, Graph, LayerInfo, Link, Phase, Topology

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topologies"
GIB = 1 << 30


# ------------------------------------------------------------------------- example files


def test_two_gpu_types_toml() -> None:
    topo = load_topology(str(EXAMPLES / "two_gpu_types.toml"))
    assert [d.device_type for d in topo.devices] == ["h100", "v100"]
    assert [d.memory_bytes for d in topo.devices] == [
        get_device_type("h100").memory_bytes,
        get_device_type("v100").memory_bytes,
    ]
    # PCIe between an H100 (gen 5) and a V100 (gen 3) runs at gen 3.
    assert topo.link_between(0, 1) == get_link("pcie3")
    assert topo.num_hosts == 1 and [d.name for d in topo.devices] == ["", ""]
    assert not topo.is_uniform
    assert topology_summary(topo) == "h100 + v100 (pcie3)"


def test_two_hosts_json() -> None:
    topo = load_topology(str(EXAMPLES / "two_hosts.json"))
    assert topo.num_devices == 16 and topo.num_hosts == 2
    assert [d.host for d in topo.devices] == [0] * 8 + [1] * 8
    assert topo.link_between(0, 7) == get_link("nvlink4")
    assert topo.link_between(3, 12) == get_link("eth100g")
    assert topo.channel_between(3, 12) == topo.channel_between(0, 8) == ("host", 0, 1)
    assert topo.devices[0].name == "/job:worker/replica:0/task:0/device:GPU:0"
    assert topo.devices[15].name == "/job:worker/replica:0/task:1/device:GPU:7"
    assert topo.slowest_link == get_link("eth100g")
    assert topology_summary(topo) == "2 hosts x 8 x h100, nvlink4 within hosts, eth100g between"


def test_cpu_plus_gpus_toml() -> None:
    topo = load_topology(str(EXAMPLES / "cpu_plus_gpus.toml"))
    assert [d.device_type for d in topo.devices] == ["cpu", "l4", "l4"]
    assert [d.name for d in topo.devices] == ["/device:CPU:0", "/device:GPU:0", "/device:GPU:1"]
    assert topo.devices[0].memory_bytes == 16 * GIB
    # The CPU's end of a CPU-GPU transfer is the GPU's PCIe slot.
    assert topo.link_between(0, 1) == get_link("pcie4") == topo.link_between(1, 2)


def test_infiniband_cluster_with_a_measured_pair() -> None:
    topo = load_topology(str(EXAMPLES / "infiniband_cluster.toml"))
    assert topo.num_devices == 16 and topo.num_hosts == 4
    assert topo.link_between(1, 2) == get_link("nvlink3")
    assert topo.link_between(1, 5) == get_link("infiniband")
    measured = topo.link_between(4, 0)
    assert measured == Link("measured-rdma", 3e-6, 20e9)
    assert topo.channel_between(0, 4) == ("device", 0, 4)  # its own channel
    assert topo.channel_between(1, 5) == ("host", 0, 1)


def test_json_and_toml_describe_the_same_topology(tmp_path: Path) -> None:
    toml = tmp_path / "t.toml"
    toml.write_text(
        'job = "trainer"\ninter_host_link = "eth25g"\n'
        '[[hosts]]\nlink = "nvlink"\n[[hosts.devices]]\ntype = "a100-40gb"\ncount = 2\n'
        '[[hosts]]\n[[hosts.devices]]\ntype = "t4"\nmemory = "8GiB"\n'
    )
    data = {
        "job": "trainer",
        "inter_host_link": "eth25g",
        "hosts": [
            {"link": "nvlink", "devices": [{"type": "a100-40gb", "count": 2}]},
            {"devices": [{"type": "t4", "memory": 8 * GIB}]},
        ],
    }
    js = tmp_path / "t.json"
    js.write_text(json.dumps(data))
    a, b = load_topology(str(toml)), load_topology(str(js))
    assert a == b
    assert a.link_between(0, 1) == get_link("nvlink3")
    assert a.link_between(0, 2) == get_link("eth25g")
    assert a.devices[2] == Device(
        2, "t4", 8 * GIB, host=1, name="/job:trainer/replica:0/task:1/device:GPU:0"
    )


def test_memory_limit_device_count_and_default_type(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": [{"count": 3}], "link": "pcie4"}))
    topo = load_topology(str(path), device_type="v100", memory_limit_bytes=GIB)
    assert [(d.device_type, d.memory_bytes) for d in topo.devices] == [("v100", GIB)] * 3
    assert topo.link == get_link("pcie4") and topo.links == ()
    assert load_topology(str(path), device_type="t4", num_devices=3).num_devices == 3
    with pytest.raises(UsageError, match="describes 3 devices but gpus=2"):
        load_topology(str(path), device_type="t4", num_devices=2)


# ------------------------------------------------------------------------- link kinds


def test_link_kind_specs_match_the_old_uniform_topology() -> None:
    topo = load_topology("nvlink", device_type="v100", num_devices=3)
    assert (
        topo
        == cost_graph(_matmul_graph(), device_type="v100", num_devices=3, link="nvlink").topology
    )
    assert topo.link == get_link("nvlink2")
    assert load_topology("PCIe", device_type="h100", num_devices=2).link == get_link("pcie5")
    limited = load_topology("eth10g", device_type="cpu", num_devices=2, memory_limit_bytes=GIB)
    assert limited.link == get_link("eth10g") and limited.devices[1].memory_bytes == GIB


@pytest.mark.parametrize(
    ("spec", "kwargs", "error", "match"),
    [
        ("fast", {"device_type": "h100", "num_devices": 2}, UsageError,
         r"topology='fast' is neither a link kind \(pcie, nvlink, pcie3"),
        ("pcie", {"num_devices": 2}, UsageError, "needs a device type and a device count"),
        ("nvlink", {"device_type": "t4", "num_devices": 2}, CatalogError, "has no NVLink"),
        ("pcie", {"device_type": "gpu9000", "num_devices": 2}, UnknownDeviceError, "known: cpu"),
        ("pcie", {"device_type": "h100", "num_devices": 0}, CatalogError, "num_devices=0"),
        ("pcie", {"device_type": "h100", "num_devices": 2, "memory_limit_bytes": -5},
         CatalogError, "memory_limit_bytes=-5"),
        ("/nonexistent/topo.toml", {}, UsageError, "no such topology file: /nonexistent/topo"),
    ],
)  # fmt: skip
def test_bad_specs(
    spec: str, kwargs: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        load_topology(spec, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- malformed files

_H = '[[hosts]]\n[[hosts.devices]]\ntype = "h100"\n'

MALFORMED: list[tuple[str, str, type[PartitionError], str]] = [
    ("toml", "hosts = [", CatalogError, "not valid TOML"),
    ("json", '{"hosts": [}', CatalogError, "not valid JSON (Expecting value at line 1"),
    ("json", '{"link": "pcie", "link": "nvlink", "devices": [{"type": "h100"}]}', CatalogError,
     "duplicate key 'link'"),
    ("json", '{"devices": [{"type": "h100", "memory": NaN}]}', CatalogError, "NaN is not a number"),
    ("json", "[1, 2]", CatalogError, "(top level): must be a table/object"),
    ("toml", 'name = "x"\n', CatalogError, "(top level): is missing key 'hosts'"),
    ("toml", '[[hosts]]\nlink = "pcie"\n', CatalogError, "hosts[0]: is missing key 'devices'"),
    ("toml", '[[hosts]]\ndevices = []\n', CatalogError, "hosts[0].devices: must be a non-empty list"),
    ("toml", "[[hosts]]\n[[hosts.devices]]\ncount = 2\n", CatalogError,
     "hosts[0].devices[0]: is missing key 'type'; known types: cpu, t4"),
    ("toml", '[[hosts]]\n[[hosts.devices]]\ntype = "gpu9000"\n', UnknownDeviceError,
     "hosts[0].devices[0].type: unknown device type 'gpu9000'; known: cpu"),
    ("toml", _H + 'count = "two"\n', CatalogError,
     "hosts[0].devices[0].count: must be a positive integer, got a string ('two')"),
    ("toml", _H + "count = 0\n", CatalogError, "hosts[0].devices[0].count: must be an integer in 1..512, got 0"),
    ("toml", _H + "count = true\n", CatalogError, "got a boolean"),
    ("toml", _H + 'memory = "16 gigs"\n', CatalogError,
     "hosts[0].devices[0].memory: '16 gigs' is not a size like 16GiB"),
    ("toml", _H + "memory = -1\n", CatalogError, "memory: must be a positive number of bytes, got -1"),
    ("toml", _H + 'memroy = "1GiB"\n', CatalogError,
     "hosts[0].devices[0]: unknown key 'memroy'; known keys: type, count, memory"),
    ("toml", 'hots = 1\n' + _H, CatalogError, "(top level): unknown key 'hots'; known keys: name, job"),
    ("toml", 'link = "pcie9"\n' + _H, CatalogError,
     "link: unknown link kind 'pcie9'; known: pcie, nvlink, pcie3, pcie4"),
    ("toml", '[[hosts]]\nlink = { latency_s = -1, bandwidth_bytes_per_s = 1e9 }\n'
     '[[hosts.devices]]\ntype = "h100"\n', CatalogError,
     "hosts[0].link.latency_s: must be a number of seconds in 0..10, got -1"),
    ("toml", '[[hosts]]\nlink = { latency_s = 1e-6, bandwidth_bytes_per_s = 0 }\n'
     '[[hosts.devices]]\ntype = "h100"\n', CatalogError,
     "bandwidth_bytes_per_s: must be a number of bytes per second in 1e3..1e15, got 0"),
    # link figures bounded above too (issue 34): 1e300 s or B/s gave a plan of 1e290-s steps
    ("json", '{"link": {"latency_s": 1e300, "bandwidth_bytes_per_s": 1e9}, "devices": [{"type": "h100"}]}',
     CatalogError, "link.latency_s: must be a number of seconds in 0..10, got 1e+300"),
    ("json", '{"link": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e-300}, "devices": [{"type": "h100"}]}',
     CatalogError, "link.bandwidth_bytes_per_s: must be a number of bytes per second in 1e3..1e15, got 1e-300"),
    ("json", '{"link": {"latency_s": 1e-6, "bandwidth_bytes_per_s": 1e300}, "devices": [{"type": "h100"}]}',
     CatalogError, "link.bandwidth_bytes_per_s: must be a number of bytes per second in 1e3..1e15, got 1e+300"),
    ("toml", '[[hosts]]\nlink = { latency_s = 1e-6 }\n[[hosts.devices]]\ntype = "h100"\n',
     CatalogError, "hosts[0].link: is missing key 'bandwidth_bytes_per_s'"),
    ("toml", "[[hosts]]\ncount = 2\n[[hosts.devices]]\ntype = \"h100\"\n", CatalogError,
     "inter_host_link: is missing: 2 hosts need a link between them; known: pcie3"),
    ("toml", 'inter_host_link = "pcie"\n' + _H, CatalogError,
     "inter_host_link: 'pcie' depends on the device type and cannot join hosts"),
    ("toml", '[[hosts]]\nlink = "nvlink"\n[[hosts.devices]]\ntype = "t4"\ncount = 2\n',
     CatalogError, "hosts[0].link: device type 't4' has no NVLink"),
    ("toml", '[[hosts]]\nlink = "nvlink"\n[[hosts.devices]]\ntype = "h100"\n'
     '[[hosts.devices]]\ntype = "v100"\n', CatalogError,
     "hosts[0].link: NVLink joins GPUs of one generation, but 'h100' has nvlink4 and 'v100' has nvlink2"),
    ("toml", _H + '[[links]]\ndevices = [0, 5]\nlink = "pcie4"\n', CatalogError,
     "links[0].devices: [0, 5] must name two different devices in 0..0"),
    ("toml", _H + '[[links]]\ndevices = [0]\nlink = "pcie4"\n', CatalogError,
     "links[0].devices: must be two device indices [a, b], got [0]"),
    ("toml", _H + "[[links]]\ndevices = [0, 1]\n", CatalogError, "links[0]: is missing key 'link'"),
    ("json", '{"hosts": [], "devices": []}', CatalogError, "give either 'hosts' or 'devices'"),
    ("toml", 'job = "/job:x"\n' + _H, CatalogError, "job '/job:x' is not a TensorFlow job name"),
    ("toml", "hosts = 3\n", CatalogError, "hosts: must be a non-empty list of host tables, got a number (3)"),
]  # fmt: skip


@pytest.mark.parametrize(("ext", "text", "error", "piece"), MALFORMED)
def test_malformed_files_give_one_line_errors(
    tmp_path: Path, ext: str, text: str, error: type[PartitionError], piece: str
) -> None:
    path = tmp_path / f"bad.{ext}"
    path.write_text(text)
    with pytest.raises(error) as info:
        load_topology(str(path))
    message = str(info.value)
    assert piece in message
    assert f"topology file {str(path)!r}" in message
    assert "\n" not in message


def test_a_file_is_data_only(tmp_path: Path) -> None:
    """A value that looks like code stays a string and is rejected as one."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"devices": [{"type": "__import__('os').system('true')"}]}))
    with pytest.raises(UnknownDeviceError, match="unknown device type"):
        load_topology(str(path))


# ------------------------------------------------------------------------- TF_CONFIG

TF_CONFIG = {
    "cluster": {
        "chief": ["alpha:2222"],
        "worker": ["alpha:2223", "beta:2222", "gamma:2222"],
        "ps": ["delta:2222"],
    },
    "task": {"type": "worker", "index": 1},
}


def test_tf_config_cluster() -> None:
    topo = topology_from_tf_config(
        json.dumps(TF_CONFIG), device_type="v100", devices_per_task=2, intra_link="nvlink"
    )
    assert topo.num_devices == 8  # chief + 3 workers, 2 each; the ps task holds no layers
    assert [d.host for d in topo.devices] == [
        0,
        0,
        0,
        0,
        1,
        1,
        2,
        2,
    ]  # chief and worker 0 share alpha
    assert [d.name for d in topo.devices[:3]] == [
        "/job:chief/replica:0/task:0/device:GPU:0",
        "/job:chief/replica:0/task:0/device:GPU:1",
        "/job:worker/replica:0/task:0/device:GPU:0",
    ]
    assert topo.devices[7].name == "/job:worker/replica:0/task:2/device:GPU:1"
    assert topo.link_between(0, 1) == get_link("nvlink2")  # one task's two GPUs
    # chief and worker 0 share host alpha but are two processes: gRPC, not NVLink
    assert topo.link_between(0, 3) == get_link("grpc-loopback")
    assert topo.link_between(0, 4) == get_link("eth100g")
    cpu = topology_from_tf_config(TF_CONFIG, device_type="cpu", inter_link="infiniband")
    assert cpu.devices[1].name == "/job:worker/replica:0/task:0/device:CPU:0"
    assert cpu.inter_host_link == get_link("infiniband")


def test_tf_config_through_load_topology() -> None:
    env = {"TF_CONFIG": json.dumps(TF_CONFIG)}
    topo = load_topology("tf-config", device_type="h100", num_devices=8, environ=env)
    assert topo.num_devices == 8 and topo.devices[-1].name.endswith("task:2/device:GPU:1")
    assert load_topology("tf-config", device_type="h100", environ=env).num_devices == 4
    with pytest.raises(UsageError, match="gpus=6 does not divide among the 4 TF_CONFIG tasks"):
        load_topology("tf-config", device_type="h100", num_devices=6, environ=env)
    with pytest.raises(UsageError, match="TF_CONFIG environment variable is not set"):
        load_topology("tf-config", device_type="h100", environ={})


@pytest.mark.parametrize(
    ("config", "error", "match"),
    [
        ("{cluster", UsageError, "TF_CONFIG is not valid JSON"),
        ('{"task": {}}', CatalogError, "TF_CONFIG: (top level): is missing key 'cluster'"),
        ('{"cluster": {"ps": ["a:1"]}}', CatalogError,
         "TF_CONFIG: cluster: has no chief or worker tasks to place layers on; jobs found: ps"),
        ('{"cluster": {"worker": "a:1"}}', CatalogError,
         "TF_CONFIG: cluster.worker: must be a list of 'host:port' strings"),
        ('{"cluster": {"worker": [":1"]}}', CatalogError,
         "TF_CONFIG: worker[0] = ':1' is not a 'host:port' address"),
        # the checks a cluster file gets (issue 34): a port, no address twice, the device bound
        ('{"cluster": {"worker": ["h0", "h1"]}}', CatalogError,
         "TF_CONFIG: worker[0] = 'h0' is not a 'host:port' address (e.g. '127.0.0.1:2222')"),
        ('{"cluster": {"worker": ["h0:2222", "h0:2222"]}}', CatalogError,
         "TF_CONFIG: job 'worker' lists an address twice"),
        ('{"cluster": {"chief": ["h0:2222"], "worker": ["h0:2222"]}}', CatalogError,
         "TF_CONFIG: two tasks share one address"),
        # one server spelled two ways (the campaign's rerun): loopback names, case, a port's zeros
        ('{"cluster": {"worker": ["localhost:2222", "127.0.0.1:2222"]}}', CatalogError,
         "lists an address twice: ['localhost:2222', '127.0.0.1:2222'] (one server spelled two ways)"),
        ('{"cluster": {"worker": ["LOCALHOST:2222", "localhost:02222"]}}', CatalogError,
         "(one server spelled two ways)"),
        ('{"cluster": {"chief": ["Host.:1"], "worker": ["host:1"]}}', CatalogError,
         "two tasks share one address: ['Host.:1', 'host:1'] (one server spelled two ways)"),
        ('{"cluster": {"worker": ["local\\u0000host:2222"]}}', CatalogError,
         "worker[0] = 'local\\x00host:2222' is not a 'host:port' address"),
        ('{"cluster": {"worker": ["h0:1", "h1:1"]}, "task": {"type": "worker", "index": 5}}',
         CatalogError, "TF_CONFIG: task.index 5 is past the 2 task(s) of job 'worker'; give 0..1"),
        ('{"cluster": {"worker": ["h0:1"]}, "task": {"type": "chief", "index": 0}}',
         CatalogError, "TF_CONFIG: task.type 'chief' is no job of the cluster (jobs: worker)"),
        (json.dumps({"cluster": {"worker": [f"h:{2000 + i}" for i in range(513)]}}), CatalogError,
         "TF_CONFIG: the cluster lists 513 tasks, more than 512"),
    ],
)  # fmt: skip
def test_bad_tf_config(config: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error) as info:
        topology_from_tf_config(config, device_type="h100")
    assert match in str(info.value)


def test_tf_config_unknown_device_type_and_link() -> None:
    with pytest.raises(UnknownDeviceError, match="TF_CONFIG: device_type: unknown device type 'x'"):
        topology_from_tf_config(TF_CONFIG, device_type="x")
    with pytest.raises(CatalogError, match="inter_link: unknown link kind 'eth9'"):
        topology_from_tf_config(TF_CONFIG, device_type="h100", inter_link="eth9")


# ------------------------------------------------------------------------- costing


def _matmul_graph(dtype: str = "float32") -> Graph:
    """One compute-bound layer (a 4096^3 matmul) and one memory-bound layer (a wide Relu)."""
    n = 4096
    ops = (
        op("x", "Placeholder", None, shape=(n, n), dtype=dtype),
        op("mm", "MatMul", "dense", shape=(n, n), dtype=dtype, flops=2 * n**3),
        op("relu", "Relu", "act", shape=(n, n), dtype=dtype, flops=n * n),
        op("g/relu", "ReluGrad", "act", shape=(n, n), dtype=dtype, flops=n * n,
           phase=Phase.BACKWARD),
        op("g/mm", "MatMul", "dense", shape=(n, n), dtype=dtype, flops=2 * n**3,
           phase=Phase.BACKWARD),
    )  # fmt: skip
    size = ops[1].output_bytes
    edges = (
        Edge("x", "mm", size),
        Edge("mm", "relu", size),
        Edge("relu", "g/relu", size),
        Edge("mm", "g/relu", size),
        Edge("g/relu", "g/mm", size),
        Edge("x", "g/mm", size),
    )
    return Graph("mm", ops, edges, (LayerInfo("dense", "Dense"), LayerInfo("act", "ReLU")))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v100_vs_h100_times_follow_the_catalog(dtype: str) -> None:
    g = _matmul_graph(dtype)
    v100, h100 = get_device_type("v100"), get_device_type("h100")
    # The datasheet roofline on both (the V100's family has a packaged calibration)
    slow = cost_graph(
        g, device_type="v100", num_devices=1, roofline=DEFAULT_ROOFLINE
    ).layer_compute_time_s[0]
    fast = cost_graph(
        g, device_type="h100", num_devices=1, roofline=DEFAULT_ROOFLINE
    ).layer_compute_time_s[0]
    # The matmul layer is compute-bound on both: its time less the kernel launches scales with
    # the peak FLOP/s of the precision; the Relu layer is memory-bound: with the bandwidth.
    ops_per_layer = 2
    # float32 matmuls run on TF32 tensor cores where the device has them (TensorFlow's default)
    policy = traced_precision(g)
    peak_v = op_peak_flops(v100, "MatMul", dtype, policy)
    flop_ratio = op_peak_flops(h100, "MatMul", dtype, policy) / peak_v
    dense_v = slow[0] - ops_per_layer * v100.kernel_overhead_s
    dense_h = fast[0] - ops_per_layer * h100.kernel_overhead_s
    assert dense_v / dense_h == pytest.approx(flop_ratio, rel=1e-9)
    bw_ratio = h100.memory_bandwidth_bytes_per_s / v100.memory_bandwidth_bytes_per_s
    act_v = slow[1] - ops_per_layer * v100.kernel_overhead_s
    act_h = fast[1] - ops_per_layer * h100.kernel_overhead_s
    assert act_v / act_h == pytest.approx(bw_ratio, rel=1e-9)
    # and the matmul time is the roofline's compute term, from the catalog's figure
    expected = 2 * (2 * 4096**3) / (peak_v * DEFAULT_ROOFLINE.compute_efficiency("MatMul"))
    assert dense_v == pytest.approx(expected, rel=1e-9)


def test_a_mixed_topology_gets_each_device_types_times() -> None:
    g = _matmul_graph()
    topo = load_topology(str(EXAMPLES / "two_gpu_types.toml"))
    costed = cost_graph(g, topology=topo, optimizer="sgd")
    assert costed.topology == topo
    # each type's own roofline: the datasheet one for the H100, the V100 family's calibration
    assert costed.op_compute_time_s == (
        estimate_op_times_s(g, get_device_type("h100")),
        estimate_op_times_s(g, get_device_type("v100"), calibrated_roofline("v100")),
    )
    assert "but not for hopper" in calibration_note(d.device_type for d in topo.devices)
    problem = costed.problem()
    assert problem.compute_time_s[0][0] < problem.compute_time_s[1][0] / 4  # 67 vs 15.7 TFLOP/s
    capped = cost_graph(g, topology=topo, memory_limit_bytes=GIB)
    assert [d.memory_bytes for d in capped.topology.devices] == [GIB, GIB]
    assert [d.device_type for d in capped.topology.devices] == ["h100", "v100"]


def test_cost_graph_topology_argument_errors() -> None:
    g = _matmul_graph()
    topo = Topology((Device(0, "h100", GIB), Device(1, "h100", GIB)), get_link("pcie5"))
    with pytest.raises(CatalogError, match="either topology= or device_type="):
        cost_graph(g, topology=topo, device_type="v100")
    with pytest.raises(CatalogError, match="num_devices=3 but the topology has 2 devices"):
        cost_graph(g, topology=topo, num_devices=3)
    with pytest.raises(CatalogError, match="needs a topology, or device_type and num_devices"):
        cost_graph(g)
    odd = Topology((Device(0, "tpu9", GIB),), get_link("pcie5"))
    with pytest.raises(UnknownDeviceError, match="unknown device type 'tpu9'"):
        cost_graph(g, topology=odd)


def test_parse_topology_from_data() -> None:
    topo = parse_topology({"devices": [{"type": "h100"}, {"type": "cpu"}]}, origin="my cluster")
    assert [d.name for d in topo.devices] == ["/device:GPU:0", "/device:CPU:0"]
    assert topo.link_between(0, 1) == get_link("pcie5")
    with pytest.raises(CatalogError, match=r"^my cluster: devices\[0\]: unknown key 'typ'"):
        parse_topology({"devices": [{"typ": "h100"}]}, origin="my cluster")


def test_a_roofline_per_device_type() -> None:
    g = _matmul_graph()
    topo = load_topology(str(EXAMPLES / "two_gpu_types.toml"))
    slow_mm = RooflineModel(efficiency={"MatMul": 0.1})
    costed = cost_graph(g, topology=topo, roofline={"V100-32GB": slow_mm})
    assert costed.op_compute_time_s[0] == estimate_op_times_s(g, get_device_type("h100"))
    assert costed.op_compute_time_s[1] == estimate_op_times_s(g, get_device_type("v100"), slow_mm)
    everywhere = cost_graph(g, topology=topo, roofline=slow_mm)
    assert everywhere.op_compute_time_s[0] == estimate_op_times_s(
        g, get_device_type("h100"), slow_mm
    )
    with pytest.raises(CatalogError, match=r"roofline\['h100'\] must be a RooflineModel"):
        cost_graph(g, topology=topo, roofline={"h100": 0.5})  # type: ignore[dict-item]


def test_loopback_names_are_one_host() -> None:
    """``localhost`` and ``127.0.0.1`` are one machine: two tasks on it share a host (and the
    gRPC link between tasks), not two hosts joined by an inter-host link."""
    config = json.dumps({"cluster": {"worker": ["localhost:2222", "127.0.0.1:2223", "[::1]:2224"]}})
    topology = topology_from_tf_config(config, device_type="cpu")
    assert [d.host for d in topology.devices] == [0, 0, 0]
    assert topology.inter_host_link is None
