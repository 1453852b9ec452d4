"""The layers whose training is not exact under micro-batching, defined once (pure data).

Splitting a batch into ``M`` micro-batches and accumulating their gradients gives the batch
gradient exactly for layers that treat samples independently. Three kinds of layer do not:

* **batch statistics** (``BatchNormalization``) normalise over each micro-batch's samples, not
  the whole batch, and update their moving statistics ``M`` times per batch;
* **randomness** (``Dropout`` and the noise layers) draw their masks or noise per micro-batch, so
  the random stream differs from the unpipelined model's (the same in distribution);
* **masks** (``Masking``, an ``Embedding`` with ``mask_zero=True``): Keras averages a loss over
  the unmasked time steps of what it is given, so each part's loss is a mean over its own
  count of them, and the parts' means weighted equally are not the whole batch's mean when the
  parts hold different counts (campaign 34y: a padded LSTM's first loss 1.123 on one device,
  1.409 on 4 replicas).

A layer of those classes is exact when it does not do what makes it inexact
(:func:`inexact_reason`, from :class:`LayerFacts` that ``passes.checks.layer_facts`` reads off a
Keras layer): a random layer whose every rate is 0 draws nothing, and a frozen
``BatchNormalization`` (``trainable=False``) runs in inference mode in Keras 3, normalising with
its moving statistics. Any other layer that draws random numbers with a rate above 0 (an LSTM's
dropout) is inexact too.

Read by the planner's warnings (``partitioner.api``, through ``passes.checks.inexact_layers``,
which walks nested layers) and by the pipeline rewrite (``passes.rewrite.pipeline``, by the Keras
classes of the built model), so both name the same classes;
``tests/simulation/test_inexact_layers.py`` checks that they agree.
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
    "LayerFacts",
    "inexact_class_names",
    "inexact_reason",
]


class InexactKind(enum.Enum):
    """Why a layer is not exact under micro-batching."""

    BATCH_STATISTICS = "batch statistics"
    """It normalises over the (micro-)batch's samples."""
    RANDOMNESS = "randomness"
    """It draws random masks or noise per call."""
    MASKED_LOSS = "masked loss"
    """It masks time steps, and a loss over them is averaged over each part's unmasked steps."""
    OWN_STEP = "own step"
    """A model class with its own training step, run on each part: a loss coupling the samples
    of a batch (in-batch negatives) sees only the part's (``passes.checks.inexact_layers``)."""


@dataclass(frozen=True)
class InexactLayer:
    """One Keras layer class that is not exact under micro-batching, and why (one clause)."""

    class_name: str
    kind: InexactKind
    why: str


_MASKS = "draws its random masks per part of the batch (a micro-batch, a replica's share)"
_MASKED = (
    "masks time steps, and a loss over them is averaged over each micro-batch's (each "
    "replica's) unmasked steps, not the whole batch's, so the gradients differ when the parts "
    "hold different numbers of them"
)
_NOISE = "draws its random noise per part of the batch (a micro-batch, a replica's share)"

INEXACT_LAYERS: tuple[InexactLayer, ...] = (
    InexactLayer(
        "BatchNormalization",
        InexactKind.BATCH_STATISTICS,
        "normalises over each part of the batch (a micro-batch, a replica's share), not the "
        "whole batch, so its outputs, gradients and moving statistics differ from one device's "
        "step on the whole batch",
    ),
    InexactLayer(
        "Dropout",
        InexactKind.RANDOMNESS,
        "draws its random masks per part of the batch (a micro-batch, a replica's share), so "
        "they differ from one device's step on the whole batch (the same in distribution)",
    ),
    InexactLayer("SpatialDropout1D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("SpatialDropout2D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("SpatialDropout3D", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("GaussianDropout", InexactKind.RANDOMNESS, _NOISE),
    InexactLayer("GaussianNoise", InexactKind.RANDOMNESS, _NOISE),
    InexactLayer("AlphaDropout", InexactKind.RANDOMNESS, _MASKS),
    InexactLayer("Masking", InexactKind.MASKED_LOSS, _MASKED),
)
"""Every Keras layer class known not to be exact under micro-batching."""

INEXACT_UNDER_MICROBATCHES: Mapping[str, str] = MappingProxyType(
    {layer.class_name: layer.why for layer in INEXACT_LAYERS}
)
"""``class name -> why`` of :data:`INEXACT_LAYERS` (read-only)."""


def inexact_class_names(kind: InexactKind) -> frozenset[str]:
    """The class names of :data:`INEXACT_LAYERS` of one kind."""
    return frozenset(layer.class_name for layer in INEXACT_LAYERS if layer.kind is kind)


@dataclass(frozen=True)
class LayerFacts:
    """What decides whether one layer is exact under a split batch (read off a Keras layer by
    ``passes.checks.layer_facts``)."""

    class_names: tuple[str, ...]
    """The layer's class and its bases (most derived first)."""
    rates: tuple[float, ...] = ()
    """Its dropout / noise rates (``rate``, ``dropout``, ``recurrent_dropout``, ``stddev``)."""
    trainable: bool = True
    draws_randomness: bool = False
    """It has a seed generator (draws random numbers in training when a rate is above 0)."""
    masks: bool = False
    """It makes a mask of time steps (``Masking``, an ``Embedding`` with ``mask_zero=True``)."""


def inexact_reason(facts: LayerFacts) -> InexactLayer | None:
    """The table's entry (or, for another random layer, one of the same kind) that makes the
    layer inexact under a split batch; ``None`` when it is exact: every rate 0, or a frozen
    batch-statistics layer (inference mode)."""
    by_name = {layer.class_name: layer for layer in INEXACT_LAYERS}
    entry = next((by_name[c] for c in facts.class_names if c in by_name), None)
    random = entry.kind is InexactKind.RANDOMNESS if entry is not None else facts.draws_randomness
    if random:
        if facts.rates and all(r == 0 for r in facts.rates):
            return None
        return entry or InexactLayer(facts.class_names[0], InexactKind.RANDOMNESS, _MASKS)
    if entry is not None and entry.kind is InexactKind.BATCH_STATISTICS and facts.trainable:
        return entry
    if facts.masks:  # Masking, or another class that masks (an Embedding with mask_zero)
        return entry or InexactLayer(facts.class_names[0], InexactKind.MASKED_LOSS, _MASKED)
    return None
