"""cost_graph: from a Graph to a CostedGraph a solver can use."""

from __future__ import annotations

import pytest
from cost_model_graphs import mlp

from cost_models.devices.catalog import get_device_type
from cost_models.devices.communication import get_link
from cost_models.estimate.analytic import calibrated_roofline, estimate_op_times_s
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import Optimizer, layer_memory
from partitioner.core.errors import CatalogError, PartitionError, UnknownDeviceError


def test_cost_graph_builds_a_valid_problem() -> None:
    g = mlp()
    costed = cost_graph(g, device_type="A100", num_devices=3, link="nvlink", optimizer="sgd")
    topo = costed.topology
    assert topo.num_devices == 3
    assert all(d.device_type == "a100-80gb" for d in topo.devices)
    assert topo.devices[0].memory_bytes == get_device_type("a100").memory_bytes
    assert topo.link == get_link("nvlink3")
    row = estimate_op_times_s(g, get_device_type("a100"), calibrated_roofline("a100"))
    assert costed.op_compute_time_s == (row, row, row)
    assert costed.layer_memory == layer_memory(g, Optimizer.SGD)
    problem = costed.problem()
    assert problem.num_layers == 2 and problem.num_devices == 3
    assert sum(problem.compute_time_s[0]) == pytest.approx(sum(row))


def test_defaults_and_memory_limit() -> None:
    costed = cost_graph(mlp(), device_type="cpu", num_devices=1, memory_limit_bytes=2**30)
    assert costed.topology.link.kind == "host"
    assert costed.topology.devices[0].memory_bytes == 2**30
    assert costed.layer_memory == layer_memory(mlp(), Optimizer.ADAM)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"device_type": "h100", "num_devices": 0}, CatalogError, "num_devices=0"),
        ({"device_type": "h100", "num_devices": 2, "memory_limit_bytes": -1}, CatalogError,
         "memory_limit_bytes=-1"),
        ({"device_type": "gpu9000", "num_devices": 2}, UnknownDeviceError, "known: cpu"),
        ({"device_type": "t4", "num_devices": 2, "link": "nvlink"}, CatalogError, "no NVLink"),
        ({"device_type": "t4", "num_devices": 2, "optimizer": "lion"}, PartitionError, "lion"),
    ],
)  # fmt: skip
def test_bad_arguments(kwargs: dict[str, object], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        cost_graph(mlp(), **kwargs)  # type: ignore[arg-type]
