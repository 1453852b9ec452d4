"""Turn a traced :class:`~partitioner.ir.Graph` into a :class:`~partitioner.ir.CostedGraph`."""

from __future__ import annotations

import logging
import time

from cost_models.analytic import RooflineModel, estimate_op_times_s
from cost_models.catalog import get_device_type
from cost_models.communication import resolve_link
from cost_models.memory import Optimizer, layer_memory, parse_optimizer
from partitioner.errors import CatalogError
from partitioner.ir import CostedGraph, Device, Graph, Topology

__all__ = ["cost_graph"]

logger = logging.getLogger(__name__)


def cost_graph(
    graph: Graph,
    *,
    device_type: str,
    num_devices: int,
    link: str = "pcie",
    optimizer: Optimizer | str = Optimizer.ADAM,
    memory_limit_bytes: int | None = None,
    roofline: RooflineModel | None = None,
) -> CostedGraph:
    """Cost ``graph`` on ``num_devices`` identical devices of ``device_type`` joined by ``link``.

    ``memory_limit_bytes`` caps each device's memory (default: the catalog's ``memory_bytes``).
    Op times come from the roofline model; every device gets the same row.
    """
    start = time.perf_counter()
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise CatalogError(f"num_devices={num_devices!r} must be an integer >= 1")
    if memory_limit_bytes is not None and (
        isinstance(memory_limit_bytes, bool)
        or not isinstance(memory_limit_bytes, int)
        or memory_limit_bytes <= 0
    ):
        raise CatalogError(
            f"memory_limit_bytes={memory_limit_bytes!r} must be a positive integer (or omitted to "
            "use the catalog figure)"
        )
    dtype = get_device_type(device_type)
    opt = parse_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    limit = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    topology = Topology(
        devices=tuple(Device(i, dtype.name, limit) for i in range(num_devices)),
        link=resolve_link(link, dtype),
    )
    row = estimate_op_times_s(graph, dtype, roofline)
    costed = CostedGraph(
        graph=graph,
        topology=topology,
        op_compute_time_s=(row,) * num_devices,
        layer_memory=layer_memory(graph, opt),
    )
    logger.debug(
        "costed graph %r (%d ops, %d layers) on %d x %s over %s in %.3f s",
        graph.name,
        len(graph.ops),
        len(graph.layers),
        num_devices,
        dtype.name,
        topology.link.kind,
        time.perf_counter() - start,
    )
    return costed
