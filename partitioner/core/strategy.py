"""A training strategy as plain data: ``R`` data-parallel replicas x ``S`` pipeline stages.

A :class:`Strategy` says which device runs replica ``r``'s stage ``s``
(``device_groups[r][s]``, indices into the topology), which stage each layer belongs to
(``stage_of_layer``, the same for every replica: replicas are copies), how many micro-batches
each replica splits its share of the batch into, and in which order (the pipeline schedule).

Its :class:`Family` follows from those numbers:

* ``single``: one device (R = S = 1);
* ``data_parallel``: R > 1 replicas of the whole model (S = 1), gradients all-reduced;
* ``pipeline``: one replica of S > 1 stages fed M > 1 micro-batches;
* ``placed``: S > 1 stages, no micro-batches (M = 1): a plain split, for memory;
* ``hybrid``: R > 1 replicas of S > 1 stages.

Pure data: nothing here imports TensorFlow.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from partitioner.core.errors import InvalidGraphError
from partitioner.core.ir import Schedule

__all__ = ["Family", "Strategy"]


class Family(enum.Enum):
    """The kind of strategy (see the module docstring)."""

    SINGLE = "single"
    DATA_PARALLEL = "data_parallel"
    PIPELINE = "pipeline"
    PLACED = "placed"
    HYBRID = "hybrid"

    @property
    def label(self) -> str:
        """How a person says it."""
        return _LABELS[self]


_LABELS = {
    Family.SINGLE: "single device",
    Family.DATA_PARALLEL: "data parallel",
    Family.PIPELINE: "pipeline",
    Family.PLACED: "plain split",
    Family.HYBRID: "hybrid",
}


@dataclass(frozen=True)
class Strategy:
    """R replicas x S stages of a model (see the module docstring).

    ``device_groups[r][s]`` is the topology device of replica ``r``'s stage ``s``;
    ``stage_of_layer[k]`` the stage (``0..S-1``) of layer ``k`` in layer order.
    ``num_microbatches`` is per replica; ``schedule`` is ``Schedule.NONE`` exactly when it is 1.
    """

    device_groups: tuple[tuple[int, ...], ...]
    stage_of_layer: tuple[int, ...]
    num_microbatches: int = 1
    schedule: Schedule = Schedule.NONE

    def __post_init__(self) -> None:
        groups = self.device_groups
        if not groups or not groups[0] or len({len(g) for g in groups}) != 1:
            raise InvalidGraphError(
                f"device_groups={groups!r}: every replica needs the same number (>= 1) of stages"
            )
        used = [d for g in groups for d in g]
        if len(set(used)) != len(used) or min(used) < 0:
            raise InvalidGraphError(f"device_groups={groups!r}: each device may serve one stage")
        bad = [s for s in self.stage_of_layer if not 0 <= s < self.stages]
        if not self.stage_of_layer or bad:
            raise InvalidGraphError(
                f"stage_of_layer names stages {sorted(set(bad))} outside 0..{self.stages - 1}"
            )
        if self.num_microbatches < 1:
            raise InvalidGraphError(f"num_microbatches={self.num_microbatches} must be >= 1")
        if (self.num_microbatches == 1) != (self.schedule is Schedule.NONE):
            raise InvalidGraphError(
                f"schedule={self.schedule.value!r} with num_microbatches={self.num_microbatches}: "
                "a schedule orders micro-batches, so it is 'none' exactly when there is one"
            )

    @property
    def replicas(self) -> int:
        """R: data-parallel copies of the model."""
        return len(self.device_groups)

    @property
    def stages(self) -> int:
        """S: devices each replica is split over."""
        return len(self.device_groups[0])

    @property
    def devices(self) -> tuple[int, ...]:
        """Every device the strategy uses, replica by replica, stage by stage."""
        return tuple(d for g in self.device_groups for d in g)

    @property
    def family(self) -> Family:
        if self.replicas == 1 and self.stages == 1:
            return Family.SINGLE
        if self.stages == 1:
            return Family.DATA_PARALLEL
        if self.replicas > 1:
            return Family.HYBRID
        return Family.PIPELINE if self.num_microbatches > 1 else Family.PLACED

    def layer_devices(self, replica: int = 0) -> tuple[int, ...]:
        """The topology device of each layer (layer order) in replica ``replica``."""
        group = self.device_groups[replica]
        return tuple(group[s] for s in self.stage_of_layer)

    def describe(self) -> str:
        """The strategy in words, e.g. ``2 replicas x 4 stages, 1F1B, 16 micro-batches``."""
        if self.family is Family.SINGLE:
            return "one device"
        parts = []
        if self.replicas > 1:
            parts.append(f"{self.replicas} data-parallel replicas")
        if self.stages > 1:
            parts.append(f"{self.stages} stages")
        text = " x ".join(parts)
        if self.num_microbatches > 1:
            text += f", {self.schedule.label}, {self.num_microbatches} micro-batches"
        elif self.stages > 1:
            text += ", no micro-batches"
        return text
