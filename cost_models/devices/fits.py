"""Fitting ``seconds = latency_s + bytes / bandwidth_bytes_per_s`` to timed transfers.

Pure Python (no TensorFlow), beside the topology reader that uses it:
:mod:`cost_models.measure.transfers` times the points, ``partition calibrate``
(:mod:`passes.cluster.calibrate`) fits them, and the topology reader
(:mod:`cost_models.devices.topology`) refits a calibrated file's raw points to check that its
figures still describe them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.core.errors import CatalogError

__all__ = ["MIN_FIT_POINTS", "LatencyBandwidthFit", "fit_latency_bandwidth"]

MIN_FIT_POINTS = 2
"""A line needs two sizes."""


@dataclass(frozen=True)
class LatencyBandwidthFit:
    """``latency_s + bytes / bandwidth_bytes_per_s`` and the ``(bytes, seconds)`` points it fits."""

    latency_s: float
    bandwidth_bytes_per_s: float
    points: tuple[tuple[int, float], ...]

    def predict_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


def _never_faster_when_larger(xs: Sequence[float], ts: Sequence[float]) -> list[float]:
    """Each time raised to the largest time of any smaller size: moving more bytes never takes
    less time, so a point below that is noise (on a busy machine one 16 MiB copy timed at a
    tenth of the 4 MiB one, and the relative weights let it tip the slope negative)."""
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    out = list(ts)
    most = -math.inf
    for i in order:
        most = max(most, ts[i])
        out[i] = most
    return out


def fit_latency_bandwidth(points: Sequence[tuple[int, float]], what: str) -> LatencyBandwidthFit:
    """Least squares of the **relative** errors of ``seconds = latency + bytes / bandwidth``,
    after raising each time to the largest time of any smaller size (:func:`_never_faster_when_larger`).

    Each point weighs ``1 / seconds**2``, so every size's error counts as a fraction of its
    time, as predictions are judged (ordinary least squares let the largest point set the line
    and over-predicted a 16 MB all-reduce by 42-55% on a two-core machine). A negative intercept
    is refitted through the origin. ``CatalogError`` naming ``what`` for fewer than
    :data:`MIN_FIT_POINTS` sizes, a time <= 0, or times that do not grow with size.
    """
    xs = [float(b) for b, _ in points]
    ts = _never_faster_when_larger(xs, [float(t) for _, t in points])
    if len(set(xs)) < MIN_FIT_POINTS:
        raise CatalogError(
            f"{what}: a latency + bytes / bandwidth fit needs points at {MIN_FIT_POINTS} or more "
            f"sizes, got {[list(p) for p in points]}; measure again with partition calibrate"
        )
    if not all(t > 0 and math.isfinite(t) for t in ts):
        raise CatalogError(
            f"{what}: every time must be a finite number of seconds > 0, got {ts}; measure again "
            "with partition calibrate"
        )
    ws = [1.0 / (t * t) for t in ts]
    total = math.fsum(ws)
    mx = math.fsum(w * x for w, x in zip(ws, xs)) / total
    mt = math.fsum(w * t for w, t in zip(ws, ts)) / total
    den = math.fsum(w * (x - mx) ** 2 for w, x in zip(ws, xs))
    slope = math.fsum(w * (x - mx) * (t - mt) for w, x, t in zip(ws, xs, ts)) / den
    latency = mt - slope * mx
    if latency < 0:
        latency = 0.0
        slope = math.fsum(w * x * t for w, x, t in zip(ws, xs, ts)) / math.fsum(
            w * x * x for w, x in zip(ws, xs)
        )
    if slope <= 0:
        raise CatalogError(
            f"{what}: the times do not grow with the size ({[list(p) for p in points]}), so no "
            "bandwidth follows; measure again on a quiet machine with partition calibrate"
        )
    return LatencyBandwidthFit(latency, 1.0 / slope, tuple((int(b), float(t)) for b, t in points))
