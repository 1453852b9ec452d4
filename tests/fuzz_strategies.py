"""Hypothesis strategies for end-to-end fuzzing: op-level training graphs, costs, topologies.

A drawn :class:`FuzzCase` is what a traced and costed model looks like to the solvers and the
simulators:

* an op-level :class:`~partitioner.core.ir.Graph` of one training step: an ``input`` glue op, each
  layer's forward ops (layers in order, so forward data flows from a layer to itself or a later
  one), an optional ``loss`` glue op, then each layer's backward ops in reverse layer order
  (gradients flow from a layer to itself or an earlier one), with optional backward glue ops
  (gradient sums) in between. Backward ops also read forward outputs (saved activations). A layer
  may own no op at all. Every tensor has one size, and a tensor may have two outputs read by
  different consumers;
* a :class:`~partitioner.core.ir.Topology` of 1 to 4 devices of up to three device types (different
  speeds and memories), on one or two hosts (an inter-host link; hosts need not be contiguous in
  device order), with optional per-pair link overrides;
* per-device op times: a base time per op times a per-type speed, with per-(type, op) noise so
  that device types are fast at different ops; some ops take no time;
* per-layer memory (parameters, gradients, optimizer slots, activations) and device memory
  limits drawn from one of four regimes: ``ample`` (every device holds the whole model),
  ``tight`` (about a device's share), ``random`` and ``too-small`` (some layer fits no device);
* a random layer placement (any devices, possibly leaving some empty) for the simulators.

Sizes stay small (at most 6 layers, 4 devices) so that tests can check solvers against a brute
force over every placement.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from partitioner.core.ir import (
    CostedGraph,
    Device,
    Edge,
    Graph,
    LayerInfo,
    LayerMemory,
    Link,
    Op,
    Phase,
    Topology,
)

__all__ = [
    "MEMORY_REGIMES",
    "FuzzCase",
    "fuzz_cases",
    "links",
    "op_graphs",
    "topologies",
]

MAX_LAYERS = 6
MAX_DEVICES = 4
MEMORY_REGIMES = ("ample", "tight", "random", "too-small")
DEVICE_TYPES = ("alpha", "beta", "gamma")
LAYER_CLASSES = ("Dense", "Conv2D", "BatchNormalization", "Dropout", "Add")


@dataclass(frozen=True)
class FuzzCase:
    """A costed graph, the memory regime its limits came from, and a random layer placement."""

    costed: CostedGraph
    regime: str
    assignment: tuple[int, ...]


def links(kind: str, *, slow: bool = False) -> st.SearchStrategy[Link]:
    """Links with latency up to 1 ms (10 ms when ``slow``) and 1 kB/s .. 10 MB/s bandwidth.

    Op times are up to a few seconds and tensors up to 10 kB, so transfers matter.
    """
    return st.builds(
        Link,
        kind=st.just(kind),
        latency_s=st.sampled_from([0.0, 1e-4, 1e-3, 1e-2 if slow else 5e-4]),
        bandwidth_bytes_per_s=st.sampled_from([1e3, 1e4, 1e5] if slow else [1e4, 1e5, 1e6, 1e7]),
    )


@st.composite
def topologies(draw: st.DrawFn, num_devices: int, memory_bytes: tuple[int, ...]) -> Topology:
    """``num_devices`` devices with the given memories, 1-2 hosts, per-pair overrides."""
    n_hosts = draw(st.integers(1, 2)) if num_devices >= 2 else 1
    if n_hosts == 1:
        hosts = [0] * num_devices
    else:
        hosts = draw(st.lists(st.integers(0, 1), min_size=num_devices, max_size=num_devices))
        if len(set(hosts)) == 1:
            hosts[-1] = 1 - hosts[-1]  # both hosts hold a device
    types = draw(
        st.lists(st.sampled_from(DEVICE_TYPES), min_size=num_devices, max_size=num_devices)
    )
    devices = tuple(
        Device(index=d, device_type=types[d], memory_bytes=memory_bytes[d], host=hosts[d])
        for d in range(num_devices)
    )
    pairs = [(a, b) for a in range(num_devices) for b in range(a + 1, num_devices)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=3)) if pairs else []
    overrides = tuple((a, b, draw(links(f"override{a}{b}"))) for a, b in sorted(chosen))
    return Topology(
        devices=devices,
        link=draw(links("intra")),
        inter_host_link=draw(links("inter", slow=True)) if n_hosts == 2 else None,
        links=overrides,
    )


@st.composite
def op_graphs(
    draw: st.DrawFn, max_layers: int = MAX_LAYERS, *, pipeline_safe: bool = False
) -> Graph:
    """A training-step op graph (see the module docstring).

    Glue ops take the layer of their first producer (:attr:`partitioner.core.ir.Graph.layer_graph`).
    By default the loss may read any layer's output and a gradient sum lists its producers in
    any order, so a glue op may carry data against the layer order (its merged layer feeds an
    earlier layer's forward, or a later layer's backward). With ``pipeline_safe`` the loss reads
    only the last layer (which then owns a forward op) and a gradient sum lists its latest
    producer first, so that data flows with the layer order as in a trace of a one-output model.
    """
    n_layers = draw(st.integers(1, max_layers))
    layers = tuple(
        LayerInfo(
            name=f"layer{k}",
            class_name=draw(st.sampled_from(LAYER_CLASSES)),
            num_params=(p := draw(st.integers(0, 1000))),
            trainable_params=p,
            param_bytes=4 * p,
            trainable_param_bytes=4 * p,
        )
        for k in range(n_layers)
    )
    ops: list[Op] = []
    edges: list[Edge] = []
    sizes: dict[tuple[str, int], int] = {}

    def add_op(op_id: str, layer: str | None, phase: Phase, producers: list[int]) -> None:
        seen: set[tuple[str, int]] = set()
        for j in producers:
            src = ops[j].id
            out = draw(st.integers(0, 1))
            if (src, out) in seen:
                continue
            seen.add((src, out))
            if (src, out) not in sizes:
                sizes[(src, out)] = draw(st.sampled_from([0, 8, 100, 1000, 10_000]))
            edges.append(Edge(src, op_id, sizes[(src, out)], out))
        ops.append(
            Op(
                op_id,
                "Glue" if layer is None else "MatMul",
                layer,
                phase,
                output_bytes=draw(st.integers(0, 10_000)),
                flops=draw(st.integers(0, 10**6)),
            )
        )

    def pick(candidates: list[int], low: int, high: int) -> list[int]:
        if not candidates:
            return []
        return draw(st.lists(st.sampled_from(candidates), min_size=low, max_size=high, unique=True))

    add_op("input", None, Phase.FORWARD, [])
    forward = [0]
    for k, layer in enumerate(layers):
        at_least = 1 if n_layers == 1 or (pipeline_safe and k == n_layers - 1) else 0
        for j in range(draw(st.integers(at_least, 3))):
            add_op(f"f{k}_{j}", layer.name, Phase.FORWARD, pick(forward, 1, 2))
            forward.append(len(ops) - 1)
    backward: list[int] = []
    if draw(st.booleans()):
        last = [i for i in forward if ops[i].layer == layers[-1].name]
        add_op("loss", None, Phase.FORWARD, pick(last if pipeline_safe else forward, 1, 2))
        backward.append(len(ops) - 1)  # gradients start at the loss
    for k in reversed(range(n_layers)):
        for j in range(draw(st.integers(0, 3))):
            producers = pick(backward, 0, 2) + pick(forward, 0, 1)
            add_op(f"b{k}_{j}", layers[k].name, Phase.BACKWARD, producers)
            backward.append(len(ops) - 1)
        if backward and draw(st.integers(0, 3)) == 0:
            producers = pick(backward, 1, 2)
            if pipeline_safe:
                producers.sort(reverse=True)  # owned by the latest producer's (lowest) layer
            add_op(f"gradsum{k}", None, Phase.BACKWARD, producers)
            backward.append(len(ops) - 1)
    return Graph(
        name="fuzz",
        ops=tuple(ops),
        edges=tuple(edges),
        layers=layers,
        batch_size=draw(st.integers(1, 16)),
    )


@st.composite
def fuzz_cases(
    draw: st.DrawFn,
    max_layers: int = MAX_LAYERS,
    max_devices: int = MAX_DEVICES,
    regimes: tuple[str, ...] = MEMORY_REGIMES,
    *,
    pipeline_safe: bool = False,
) -> FuzzCase:
    """A costed graph with a memory regime and a random placement (see the module docstring)."""
    graph = draw(op_graphs(max_layers, pipeline_safe=pipeline_safe))
    n_dev = draw(st.integers(1, max_devices))
    n_layers = len(graph.layers)

    component = st.sampled_from([0, 1, 10, 100, 1000])
    layer_memory = tuple(
        LayerMemory(
            layer=info.name,
            param_bytes=draw(component),
            gradient_bytes=draw(component),
            optimizer_bytes=draw(component),
            activation_bytes=draw(component),
        )
        for info in graph.layers
    )
    totals = [m.total_bytes for m in layer_memory]
    total, largest = sum(totals), max(totals)
    regime = draw(st.sampled_from(regimes))
    if regime == "ample":
        memories = [total + draw(st.integers(0, 100)) for _ in range(n_dev)]
    elif regime == "tight":
        share = -(-total // n_dev)
        memories = [
            max(largest, share + draw(st.integers(-share // 4, share // 2))) for _ in range(n_dev)
        ]
    elif regime == "random":
        memories = [draw(st.integers(0, 2 * total + 1)) for _ in range(n_dev)]
    else:  # too-small: the largest layer fits no device
        memories = [draw(st.integers(0, max(0, largest - 1))) for _ in range(n_dev)]
    topology = draw(topologies(n_dev, tuple(memories)))

    base = [draw(st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0, 2.5])) for _ in graph.ops]
    speed = {t: draw(st.sampled_from([0.5, 1.0, 2.0, 3.0])) for t in DEVICE_TYPES}
    noisy = draw(st.booleans())
    noise = {
        (t, i): (draw(st.sampled_from([0.5, 1.0, 1.5])) if noisy else 1.0)
        for t in DEVICE_TYPES
        for i in range(len(graph.ops))
    }
    times = tuple(
        tuple(b * noise[(dev.device_type, i)] / speed[dev.device_type] for i, b in enumerate(base))
        for dev in topology.devices
    )
    costed = CostedGraph(
        graph=graph, topology=topology, op_compute_time_s=times, layer_memory=layer_memory
    )
    assignment = tuple(
        draw(st.lists(st.integers(0, n_dev - 1), min_size=n_layers, max_size=n_layers))
    )
    return FuzzCase(costed=costed, regime=regime, assignment=assignment)
