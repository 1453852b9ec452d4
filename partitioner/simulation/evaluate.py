"""Evaluate a layer placement: simulated step time, per-device load and memory, a lower bound.

``evaluate`` runs :func:`partitioner.simulation.step.simulate_step` on the placement and reports, per
device, its layers, compute seconds, memory against its limit and bytes sent/received. The lower
bound on the step time is the larger of

* the model's total compute time on the fastest device (the one where it is smallest) divided
  by the number of devices (perfect balance, no communication), and
* the largest single layer's time on the device where it is fastest (layers are not split).

``evaluate_pipeline`` does the same for a pipelined step
(:func:`partitioner.simulation.pipeline.simulate_pipeline`: stages, a schedule and ``M`` micro-batches):
memory is each device's simulated peak (parameters, gradients, optimizer slots and the activations
of the micro-batches the schedule keeps alive), and the bound is the larger of the work and
largest-layer bounds and the critical path of one micro-batch (``critical_path_s / M``: the
step's ops scale linearly with the micro-batch, the simulator's assumption).

Both add the **client's cost of a step** when the topology was measured on a cluster
(``partition calibrate``): ``topology.client_step_s`` (Keras's call and the remote dispatch, a
no-op step timed from the client) plus the batch's inputs and targets fed over
``topology.client_link`` (:func:`client_s`, :func:`fed_bytes`). On devices of this process
both are 0.

``solve`` runs a solver on ``costed.problem()``, timing it into ``SolverResult.solve_time_s``,
and evaluates its answer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.core.ir import CostedGraph, Schedule, peak_bytes
from partitioner.simulation.bounds import LowerBounds, costed_lower_bounds
from partitioner.simulation.pipeline import PipelineSimulation, simulate_pipeline
from partitioner.simulation.step import StepSimulation, resolve_layer_devices, simulate_step

__all__ = [
    "DeviceLoad",
    "PlanEvaluation",
    "client_s",
    "evaluate",
    "evaluate_pipeline",
    "fed_bytes",
    "lower_bound_s",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DeviceLoad:
    """What one device carries under a placement."""

    device: int
    layers: tuple[str, ...]
    compute_s: float
    memory_bytes: int
    memory_limit_bytes: int
    bytes_sent: int
    bytes_received: int

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.memory_limit_bytes

    @property
    def transfer_bytes(self) -> int:
        return self.bytes_sent + self.bytes_received


@dataclass(frozen=True)
class PlanEvaluation:
    """The simulated cost of a placement."""

    step_time_s: float
    per_device: tuple[DeviceLoad, ...]
    lower_bound_s: float
    cross_device_bytes: int
    simulation: StepSimulation | None = None
    pipeline: PipelineSimulation | None = None

    @property
    def fits(self) -> bool:
        """Whether every device's layers fit in its memory."""
        return all(d.fits for d in self.per_device)


def lower_bound_s(costed: CostedGraph) -> float:
    """A lower bound on the step time of any layer placement (see the module docstring)."""
    return costed_lower_bounds(costed).best_s


def input_bytes(costed: CostedGraph) -> int:
    """Bytes of the step's batch inputs (the placeholders no layer owns)."""
    return sum(
        op.output_bytes for op in costed.graph.ops if op.op_type == "Placeholder" and op.layer is None
    )


def fed_bytes(costed: CostedGraph) -> int:
    """Bytes the client feeds one step: the batch's inputs and its targets
    (:attr:`~partitioner.core.ir.Graph.target_bytes`)."""
    return input_bytes(costed) + costed.graph.target_bytes


def client_s(costed: CostedGraph) -> float:
    """The client's cost of one step on a measured cluster (module docstring); 0 otherwise."""
    topology = costed.topology
    feed = topology.client_link.transfer_time_s(fed_bytes(costed)) if topology.client_link else 0.0
    return topology.client_step_s + feed


def evaluate(
    costed: CostedGraph, assignment: Sequence[int], *, bounds: LowerBounds | None = None
) -> PlanEvaluation:
    """Simulate ``assignment`` (device of each layer, in layer/problem order) on ``costed``;
    ``bounds``: ``costed``'s lower bounds when the caller has them (a search scoring many
    placements of one graph computes them once)."""
    devices = resolve_layer_devices(costed, assignment)
    sim = simulate_step(costed, devices)
    layer_names = tuple(n.name for n in costed.graph.layer_graph.nodes)
    per_device = []
    for d, dev in enumerate(costed.topology.devices):
        on_d = [k for k, x in enumerate(devices) if x == d]
        per_device.append(
            DeviceLoad(
                device=d,
                layers=tuple(layer_names[k] for k in on_d),
                compute_s=sim.device_busy_s[d],
                memory_bytes=peak_bytes(costed.layer_memory[k] for k in on_d),
                memory_limit_bytes=dev.memory_bytes,
                bytes_sent=sim.bytes_sent[d],
                bytes_received=sim.bytes_received[d],
            )
        )
    return PlanEvaluation(
        step_time_s=sim.step_time_s + client_s(costed),
        per_device=tuple(per_device),
        lower_bound_s=(bounds or costed_lower_bounds(costed)).best_s,
        cross_device_bytes=sum(sim.bytes_sent),
        simulation=sim,
    )


def evaluate_pipeline(
    costed: CostedGraph,
    assignment: Sequence[int],
    *,
    schedule: Schedule,
    num_microbatches: int,
    bounds: LowerBounds | None = None,
) -> PlanEvaluation:
    """Simulate ``assignment`` as a pipeline of ``num_microbatches`` under ``schedule``
    (``bounds`` as for :func:`evaluate`)."""
    devices = resolve_layer_devices(costed, assignment)
    sim = simulate_pipeline(
        costed, devices, schedule=schedule, num_microbatches=num_microbatches
    )
    layer_names = tuple(n.name for n in costed.graph.layer_graph.nodes)
    sent = [0] * costed.topology.num_devices
    received = [0] * costed.topology.num_devices
    for stage in sim.stages:
        for t in stage.sends:
            sent[stage.device] += t.batch_bytes
            received[sim.stages[t.dst_stage].device] += t.batch_bytes
    per_device = tuple(
        DeviceLoad(
            device=d,
            layers=tuple(layer_names[k] for k, x in enumerate(devices) if x == d),
            compute_s=sim.device_busy_s[d],
            memory_bytes=sim.peak_memory_bytes[d],
            memory_limit_bytes=dev.memory_bytes,
            bytes_sent=sent[d],
            bytes_received=received[d],
        )
        for d, dev in enumerate(costed.topology.devices)
    )
    bounds = bounds or costed_lower_bounds(costed)
    return PlanEvaluation(
        step_time_s=sim.step_time_s + costed.topology.client_step_s,
        per_device=per_device,
        lower_bound_s=max(bounds.throughput_s, bounds.critical_path_s / num_microbatches),
        cross_device_bytes=sum(sent),
        pipeline=sim,
    )
