"""Turn a traced :class:`~partitioner.core.ir.Graph` into a :class:`~partitioner.core.ir.CostedGraph`.

Two ways to say where the graph runs:

* ``topology=`` a :class:`~partitioner.core.ir.Topology` (from
  :func:`cost_models.devices.topology.load_topology`, or built by hand): each device's row of op times
  comes from the roofline of *its own* device type, so devices of different types get different
  times (computed once per type);
* ``device_type=``, ``num_devices=``, ``link=``: ``num_devices`` identical devices on one host,
  every pair joined by ``link`` (``pcie``, ``nvlink`` or a catalog kind).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

from cost_models.devices.catalog import get_device_type
from cost_models.devices.communication import resolve_link
from cost_models.devices.topology import check_memory_limit
from cost_models.estimate.analytic import (
    RooflineModel,
    calibrated_roofline,
    estimate_op_times_s,
    op_memory_shares,
)
from cost_models.estimate.memory import Optimizer, layer_memory, parse_optimizer
from cost_models.estimate.precision import PrecisionPolicy, parse_precision
from partitioner.core.errors import CatalogError
from partitioner.core.ir import CostedGraph, Device, Graph, Phase, Topology

__all__ = ["SAME_SPEED_BAND", "cost_graph", "scale_to_device_speeds", "with_update_time"]

logger = logging.getLogger(__name__)


def _uniform_topology(
    device_type: str | None, num_devices: int | None, link: str, memory_limit_bytes: int | None
) -> Topology:
    if device_type is None or num_devices is None:
        raise CatalogError(
            "cost_graph needs a topology, or device_type and num_devices (e.g. "
            "device_type='h100', num_devices=2)"
        )
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise CatalogError(f"num_devices={num_devices!r} must be an integer >= 1")
    dtype = get_device_type(device_type)
    limit = dtype.memory_bytes if memory_limit_bytes is None else memory_limit_bytes
    return Topology(
        devices=tuple(Device(i, dtype.name, limit) for i in range(num_devices)),
        link=resolve_link(link, dtype),
    )


def cost_graph(
    graph: Graph,
    *,
    topology: Topology | None = None,
    device_type: str | None = None,
    num_devices: int | None = None,
    link: str | None = None,
    optimizer: Optimizer | str = Optimizer.ADAM,
    memory_limit_bytes: int | None = None,
    roofline: RooflineModel | Mapping[str, RooflineModel] | None = None,
    precision: PrecisionPolicy | str | None = None,
) -> CostedGraph:
    """Cost ``graph`` on ``topology``, or on ``num_devices`` identical ``device_type`` devices
    joined by ``link`` (default ``pcie``).

    With ``topology``, ``device_type``/``num_devices``/``link`` must be left out (a
    ``num_devices`` that matches is accepted); each device's op times come from its own device
    type. ``memory_limit_bytes``, when given, becomes every device's memory (default: the
    topology's, else the catalog's ``memory_bytes``).

    ``roofline`` is one :class:`~cost_models.estimate.analytic.RooflineModel` for every device, or a
    mapping from device type (catalog name or alias) to the model of that type -- e.g. each
    type's calibrated model -- where types it leaves out use the default roofline.

    ``precision`` (a :class:`~cost_models.estimate.precision.PrecisionPolicy` or its name:
    ``fp32``, ``tf32``, ``mixed_float16``, ``mixed_bfloat16``) prices the graph as trained under
    that policy; ``None`` keeps the one it was traced in (float32 traces as ``tf32``,
    TensorFlow's default on GPUs with TF32 tensor cores).
    """
    start = time.perf_counter()
    check_memory_limit(memory_limit_bytes)
    opt = parse_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    policy = None if precision is None else parse_precision(precision)
    if topology is None:
        topo = _uniform_topology(
            device_type, num_devices, "pcie" if link is None else link, memory_limit_bytes
        )
    else:
        topo = _given_topology(topology, device_type, num_devices, link, memory_limit_bytes)
    rows = _op_time_rows(graph, topo, roofline, policy)
    costed = CostedGraph(
        graph=graph,
        topology=topo,
        op_compute_time_s=tuple(rows[d.device_type] for d in topo.devices),
        layer_memory=layer_memory(graph, opt, policy),
        op_memory_share=_memory_shares(graph, topo, policy),
    )
    logger.debug(
        "costed graph %r (%d ops, %d layers) on %d devices (%s) over %s in %.3f s",
        graph.name,
        len(graph.ops),
        len(graph.layers),
        topo.num_devices,
        ", ".join(sorted(rows)),
        topo.link.kind,
        time.perf_counter() - start,
    )
    return costed


def _memory_shares(
    graph: Graph, topology: Topology, policy: PrecisionPolicy | None
) -> tuple[float, ...]:
    """Each op's memory-bound share (:func:`~cost_models.estimate.analytic.op_memory_shares`) on
    the first device's type: what share of an op is memory traffic is the op's nature."""
    device_type = topology.devices[0].device_type
    fused = calibrated_roofline(device_type).fused_elementwise
    return op_memory_shares(graph, get_device_type(device_type), policy, fused)


def _given_topology(
    topology: Topology,
    device_type: str | None,
    num_devices: int | None,
    link: str | None,
    memory_limit_bytes: int | None,
) -> Topology:
    """``topology`` checked against the uniform arguments, with ``memory_limit_bytes`` applied."""
    if not isinstance(topology, Topology):
        raise CatalogError(
            f"topology must be a partitioner.core.ir.Topology, got {type(topology).__name__}"
        )
    if device_type is not None or link is not None:
        raise CatalogError(
            "cost_graph: give either topology= or device_type=/link=, not both (the "
            "topology names each device's type and the links)"
        )
    if num_devices is not None and num_devices != topology.num_devices:
        raise CatalogError(
            f"num_devices={num_devices!r} but the topology has {topology.num_devices} devices"
        )
    if memory_limit_bytes is None:
        return topology
    return dataclasses.replace(
        topology,
        devices=tuple(
            dataclasses.replace(d, memory_bytes=memory_limit_bytes) for d in topology.devices
        ),
    )


def _per_type_rooflines(roofline: Mapping[str, RooflineModel]) -> dict[str, RooflineModel]:
    """``roofline``'s models by canonical device type name."""
    per_type: dict[str, RooflineModel] = {}
    for name, given in roofline.items():
        if not isinstance(given, RooflineModel):
            raise CatalogError(
                f"roofline[{name!r}] must be a RooflineModel, got {type(given).__name__}"
            )
        per_type[get_device_type(name).name] = given
    return per_type


def _op_time_rows(
    graph: Graph,
    topo: Topology,
    roofline: RooflineModel | Mapping[str, RooflineModel] | None,
    policy: PrecisionPolicy | None = None,
) -> dict[str, tuple[float, ...]]:
    """The roofline op times of ``graph`` per device type of ``topo`` (each computed once)."""
    per_type = _per_type_rooflines(roofline) if isinstance(roofline, Mapping) else {}
    rows: dict[str, tuple[float, ...]] = {}
    for d in topo.devices:
        if d.device_type not in rows:
            dtype = get_device_type(d.device_type)
            chosen = per_type.get(dtype.name) if isinstance(roofline, Mapping) else roofline
            if chosen is None:
                # The packaged calibration of the type's family where one exists (cpu: fitted
                # on the reference machine), else the catalog's plain roofline.
                chosen = calibrated_roofline(dtype.name)
            rows[d.device_type] = estimate_op_times_s(graph, dtype, chosen, policy)
    return rows


SAME_SPEED_BAND = 0.15
"""How far two measured speeds may differ by noise alone: the figure of one core moves that much
between processes and minutes (one core of the two-core test machine, pinned, one thread:
174-201 GFLOP/s within an hour, the same benchmark at 24 products x 9 rounds), and scaling by
such a ratio put every prediction of a run 6-12% low or high. Only the part of a ratio beyond
the band is taken as another speed (:func:`_speed_factor`), so that the factor moves smoothly:
with a cut-off instead (factor 1 within the band, the whole ratio beyond it), one device
measured at 172 GFLOP/s against this process's 224 (x1.30) priced its replicas 30% slower
and put a data-parallel prediction 14% high, where 200 GFLOP/s would have changed nothing."""


def scale_to_device_speeds(
    costed: CostedGraph, rows: Sequence[int], measured_here_flops_per_s: float
) -> tuple[CostedGraph, dict[int, float]]:
    """Op times measured on this machine, moved to each device of ``rows`` by its measured
    speed: row ``d`` times ``measured_here_flops_per_s / topology.device_flops_per_s[d]`` (both
    the same float32 matrix-product benchmark, :mod:`cost_models.measure.transfers`) less the
    noise band (:func:`_speed_factor`); the factor of each device. Unchanged when the
    topology measured no speeds."""
    speeds = costed.topology.device_flops_per_s
    if not speeds or not measured_here_flops_per_s > 0:
        return costed, {}
    factors = {d: _speed_factor(measured_here_flops_per_s / speeds[d]) for d in rows}
    table = list(costed.op_compute_time_s)
    for d, factor in factors.items():
        table[d] = tuple(t * factor for t in table[d])
    return replace(costed, op_compute_time_s=tuple(table)), factors


def _speed_factor(ratio: float) -> float:
    """``ratio`` less the band (:data:`SAME_SPEED_BAND`), by division: 1 within it, and
    continuous at its edges (``ratio / 1.15`` above, ``ratio * 1.15`` below)."""
    widest = 1.0 + SAME_SPEED_BAND
    if ratio > widest:
        return ratio / widest
    if ratio < 1.0 / widest:
        return ratio * widest
    return 1.0


def with_update_time(costed: CostedGraph, rows: Sequence[int], update_s: float) -> CostedGraph:
    """``costed`` with the optimizer's update of a step (``update_s`` seconds, timed for the
    whole model) on devices ``rows``: each layer's share, in proportion to its parameter bytes
    plus optimizer slots (what an update reads and writes), is added to its backward ops in
    proportion to their times (an update runs as soon as its gradient is ready, inside the
    layer's backward as far as the simulated device is concerned)."""
    weights = [m.param_bytes + m.optimizer_bytes for m in costed.layer_memory]
    total = sum(weights)
    if update_s <= 0 or total <= 0 or not rows:
        return costed
    layer_index = {m.layer: k for k, m in enumerate(costed.layer_memory)}
    owners = [
        layer_index.get(op.layer) if op.layer is not None and op.phase is Phase.BACKWARD else None
        for op in costed.graph.ops
    ]
    table = list(costed.op_compute_time_s)
    for d in rows:
        added = _update_parts_s(table[d], owners, weights, update_s)
        table[d] = tuple(t + a for t, a in zip(table[d], added))
    shares = costed.op_memory_share
    if shares:  # the update reads and writes every weight and slot: memory traffic, whole
        before = costed.op_compute_time_s[rows[0]]
        after = table[rows[0]]
        shares = tuple(
            (t * x + (u - t)) / u if u > 0 else x for t, u, x in zip(before, after, shares)
        )
    return replace(costed, op_compute_time_s=tuple(table), op_memory_share=shares)


def _update_parts_s(
    row: Sequence[float], owners: Sequence[int | None], weights: Sequence[int], update_s: float
) -> list[float]:
    """Per op of ``row``, its part of the update: its layer's (by ``weights``), shared among
    the layer's backward ops (``owners``) by their times."""
    total = sum(weights)
    backward_s = [0.0] * len(weights)
    for k, t in zip(owners, row):
        if k is not None:
            backward_s[k] += t
    return [
        update_s * weights[k] / total * _share(t, backward_s[k], owners, k) if k is not None else 0.0
        for k, t in zip(owners, row)
    ]


def _share(t: float, layer_backward_s: float, owners: Sequence[int | None], k: int) -> float:
    """An op's part of its layer's update: its part of the layer's backward time (an even part
    when the backward took no time)."""
    if layer_backward_s > 0:
        return t / layer_backward_s
    return 1.0 / sum(1 for o in owners if o == k)
