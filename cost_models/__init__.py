"""Cost models: device catalog, roofline, communication, memory. Pure Python; no TensorFlow."""

from cost_models.devices.catalog import (
    DeviceKind,
    DeviceType,
    device_type_names,
    get_device_type,
    load_catalog,
)
from cost_models.devices.communication import get_link, link_names, resolve_link
from cost_models.estimate.analytic import DEFAULT_ROOFLINE, RooflineModel, estimate_op_times_s
from cost_models.estimate.costs import cost_graph
from cost_models.estimate.memory import Optimizer, layer_memory, parse_optimizer, peak_memory_bytes

__all__ = [
    "DEFAULT_ROOFLINE",
    "DeviceKind",
    "DeviceType",
    "Optimizer",
    "RooflineModel",
    "cost_graph",
    "device_type_names",
    "estimate_op_times_s",
    "get_device_type",
    "get_link",
    "layer_memory",
    "link_names",
    "load_catalog",
    "parse_optimizer",
    "peak_memory_bytes",
    "resolve_link",
]
