"""The layers whose training is not exact under micro-batching, defined once (pure data).

Splitting a batch into ``M`` micro-batches and accumulating their gradients gives the batch
gradient exactly for layers that treat samples independently. Two kinds of layer do not:

* **batch statistics** (``BatchNormalization``) normalise over each micro-batch's samples, not
  the whole batch, and update their moving statistics ``M`` times per batch;
* **randomness** (``Dropout`` and the noise layers) draw their masks or noise per micro-batch, so
  the random stream differs from the unpipelined model's (the same in distribution).

Read by the planner's warnings (``partitioner.api``, by the traced layers' class names) and by
the pipeline rewrite (``passes.rewrite.pipeline``, by the Keras classes of the built model), so
both name the same classes; ``tests/simulation/test_inexact_layers.py`` checks that they agree.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = [
    "INEXACT_LAYERS",
    "INEXACT_UNDER_MICROBATCHES",
    "InexactKind",
    "InexactLayer",
    "inexact_class_names",
]


class InexactKind(enum.Enum):
    """Why a layer is not exact under micro-batching."""

    BATCH_STATISTICS = "batch statistics"
    """It normalises over the (micro-)batch's samples."""
    RANDOMNESS = "randomness"
    """It draws random masks or noise per call."""


@dataclass(frozen=True)
class InexactLayer:
    """One Keras layer class that is not exact under micro-batching, and why (one clause)."""

    class_name: str
    kind: InexactKind
    why: str


_MASKS = "draws its random masks per micro-batch"
_NOISE = "draws its random noise per micro-batch"

INEXACT_LAYERS: tuple[InexactLayer, ...] = (
    InexactLayer(
        "BatchNormalization",
        InexactKind.BATCH_STATISTICS,
        "normalises over each micro-batch's samples, not the whole batch, so its outputs, "
        "gradients and moving statistics differ from the unpipelined model's",
    ),
    InexactLayer(
        "Dropout",
        InexactKind.RANDOMNESS,
        "draws its random masks per micro-batch, so they differ from the unpipelined model's "
        "(the same in distribution)",
    ),
    InexactLayer("SpatialDropout1D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("SpatialDropout2D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("SpatialDropout3D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("GaussianDropout", InexactKind.RANDOMNESS, _NOISE),
    InexactLayer("GaussianNoise", InexactKind.RANDOMNESS, _NOISE),
    InexactLayer("AlphaDropout", InexactKind.RANDOMNESS, _MASKS),
)
"""Every Keras layer class known not to be exact under micro-batching."""

INEXACT_UNDER_MICROBATCHES: Mapping[str, str] = MappingProxyType(
    {layer.class_name: layer.why for layer in INEXACT_LAYERS}
)
"""``class name -> why`` of :data:`INEXACT_LAYERS` (read-only)."""


def inexact_class_names(kind: InexactKind) -> frozenset[str]:
    """The class names of :data:`INEXACT_LAYERS` of one kind."""
    return frozenset(layer.class_name for layer in INEXACT_LAYERS if layer.kind is kind)
