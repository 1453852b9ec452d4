"""Optimal contiguous splits: the engine under ``params``, ``time`` and ``dp``.

Problem (the *linear partition* / chains-on-chains problem, generalised): cut the layers
``0..n-1`` (problem order) into exactly ``k`` non-empty contiguous blocks ``[c_s, c_{s+1})``,
``0 = c_0 < c_1 < ... < c_k = n``; block ``s`` runs on stage ``s``. Minimise the *bottleneck*

    max( max_s W_s(c_s, c_{s+1}),  max_{0 < s < k} cut_cost_s(c_s) )

where ``W_s(i, j) = sum(weight[s][i:j])`` (stage ``s`` may have its own row of weights, e.g. a
slower device) and ``cut_cost_s(c)`` is the price of the boundary between blocks ``s - 1`` and
``s`` when it falls before layer ``c`` (e.g. the time to send the bytes crossing it over the link
between the two blocks' devices; one row shared by every boundary, or one row per boundary). A
block may also be bounded in memory:
``sum(memory[i:j]) <= memory_limit[s]``; a split that breaks a bound is infeasible.

Exact algorithm. Write ``F_T(j, s)`` for "layers ``0..j-1`` split into ``s + 1`` feasible
blocks, all within ``T``". Then (the threshold form of the PipeDream recurrence)::

    F_T(0, -1) = true
    F_T(j, s)  = OR_{i < j} [ F_T(i, s-1)  and  W_s(i, j) <= T  and  M(i, j) <= limit_s
                              and  (s == 0 or cut_cost_s(i) <= T) ]

and the optimum is the least ``T`` with ``F_T(n, k-1)``. For fixed ``j`` the admissible ``i`` form
an interval ``[start_s(j), j-1]`` because ``W`` and ``M`` only grow as a block widens, so each
row is computed in ``O(n log n)`` with prefix sums, a binary search for ``start_s`` and a prefix
count of the previous row (vectorised with numpy): ``O(k n log n)`` per threshold. ``F_T`` is
monotone in ``T`` and the optimum is one of the finitely many block weights or cut costs, so a
bisection over the bit patterns of non-negative doubles (at most 64 probes, fewer as ``hi`` drops
to the bottleneck actually found) ends on the exact optimum (up to the rounding of the prefix
sums). 10,000 layers x 8 stages take about 0.1 s.

Reference: B. Olstad and F. Manne, "Efficient Partitioning of Sequences", IEEE Trans. Computers
44(11), 1995 (the chains-on-chains problem and its bottleneck search).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from partitioner.core.errors import SolverError

__all__ = ["ContiguousSplit", "linear_partition", "min_bottleneck_split"]

_FloatArray = npt.NDArray[np.float64]
_IntArray = npt.NDArray[np.int64]
_BoolArray = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class ContiguousSplit:
    """An optimal split: ``stage[k]`` is the block of layer ``k``; ``bottleneck`` its cost."""

    stage: tuple[int, ...]
    bottleneck: float
    cuts: tuple[int, ...]
    """``c_1 .. c_{k-1}``: the first layer of every block but the first."""


def _bits(x: float) -> int:
    return int(struct.unpack("<q", struct.pack("<d", x))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("<d", struct.pack("<q", bits))[0])


class _Engine:
    def __init__(
        self,
        weights: Sequence[Sequence[float]],
        num_blocks: int,
        memory_bytes: Sequence[int] | None,
        memory_limit_bytes: Sequence[int] | None,
        cut_cost: Sequence[Sequence[float]] | None,
    ) -> None:
        self.n = len(weights[0])
        self.k = num_blocks
        rows: list[_FloatArray] = []
        for row in weights:
            arr = np.asarray(row, dtype=np.float64)
            if (
                len(arr) != self.n
                or not bool(np.all(arr >= 0))
                or not bool(np.all(np.isfinite(arr)))
            ):
                raise SolverError(
                    f"contiguous split: every weight row needs {self.n} finite non-negative values"
                )
            rows.append(np.concatenate(([0.0], np.cumsum(arr))))
        self.prefix = rows
        positions = np.arange(self.n + 1, dtype=np.int64)
        self.positions = positions
        if memory_bytes is not None and memory_limit_bytes is not None:
            mem = np.asarray(memory_bytes, dtype=np.int64)
            if len(mem) != self.n or bool(np.any(mem < 0)):
                raise SolverError(f"contiguous split: memory needs {self.n} non-negative values")
            mprefix = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(mem)))
            self.mem_start: list[_IntArray] = [
                np.searchsorted(mprefix, mprefix - int(memory_limit_bytes[s]), side="left").astype(
                    np.int64
                )
                for s in range(self.k)
            ]
            self.mem_prefix: _IntArray | None = mprefix
        else:
            self.mem_start = [np.zeros(self.n + 1, dtype=np.int64) for _ in range(self.k)]
            self.mem_prefix = None
        boundaries = max(self.k - 1, 1)
        rows_cc: list[_FloatArray] = []
        for row in cut_cost if cut_cost is not None else [[0.0] * (self.n + 1)]:
            cc = np.asarray(row, dtype=np.float64)
            if len(cc) != self.n + 1:
                raise SolverError(f"contiguous split: cut_cost needs {self.n + 1} values")
            rows_cc.append(cc)
        if len(rows_cc) not in (1, boundaries):
            raise SolverError(
                f"contiguous split: {len(rows_cc)} cut_cost rows for {self.k - 1} boundaries; "
                f"give 1 or {self.k - 1}"
            )
        self.cut_costs: list[_FloatArray] = (
            rows_cc if len(rows_cc) == boundaries else rows_cc * boundaries
        )

    def row(self, s: int) -> _FloatArray:
        return self.prefix[s] if len(self.prefix) > 1 else self.prefix[0]

    def probe(self, threshold: float) -> list[tuple[_BoolArray, _IntArray]] | None:
        """Rows ``(F_T(., s), start_s)`` for every stage, or None when ``F_T(n, k-1)`` is false."""
        n, k = self.n, self.k
        reach = np.zeros(n + 1, dtype=np.bool_)
        reach[0] = True
        rows: list[tuple[_BoolArray, _IntArray]] = []
        for s in range(k):
            p = self.row(s)
            start = np.searchsorted(p, p - threshold, side="left").astype(np.int64)
            np.maximum(start, self.mem_start[s], out=start)
            count = np.concatenate((np.zeros(1, dtype=np.int64), np.cumsum(reach, dtype=np.int64)))
            lo = np.minimum(start, self.positions)
            ok: _BoolArray = (count[self.positions] - count[lo]) > 0
            if s < k - 1:
                allowed = self.cut_costs[s] <= threshold
                allowed[0] = False
                allowed[n] = False
                ok &= allowed
            else:
                final = bool(ok[n])
                ok[:] = False
                ok[n] = final
            rows.append((ok, start))
            reach = ok
        return rows if bool(reach[n]) else None

    def backtrack(self, rows: list[tuple[_BoolArray, _IntArray]]) -> tuple[int, ...]:
        cuts: list[int] = []
        j = self.n
        for s in range(self.k - 1, 0, -1):
            prev = rows[s - 1][0]
            lo = int(rows[s][1][j])
            hits = np.flatnonzero(prev[lo:j])
            i = lo + int(hits[-1])
            cuts.append(i)
            j = i
        return tuple(reversed(cuts))

    def bottleneck(self, cuts: tuple[int, ...]) -> float:
        bounds = (0, *cuts, self.n)
        worst = 0.0
        for s in range(self.k):
            p = self.row(s)
            worst = max(worst, float(p[bounds[s + 1]] - p[bounds[s]]))
        for s, c in enumerate(cuts):
            worst = max(worst, float(self.cut_costs[s][c]))
        return worst


def min_bottleneck_split(
    weights: Sequence[Sequence[float]],
    num_blocks: int,
    *,
    memory_bytes: Sequence[int] | None = None,
    memory_limit_bytes: Sequence[int] | None = None,
    cut_cost: Sequence[float] | Sequence[Sequence[float]] | None = None,
) -> ContiguousSplit | None:
    """The exact minimum-bottleneck split into ``num_blocks`` non-empty contiguous blocks.

    ``weights`` holds one row of per-layer weights (shared by all blocks) or one row per block.
    ``cut_cost[c]`` (length ``n + 1``) prices a boundary before layer ``c``; a list of
    ``num_blocks - 1`` such rows prices boundary ``s`` (between blocks ``s`` and ``s + 1``) by
    row ``s``. With
    ``memory_bytes`` and ``memory_limit_bytes`` (one limit per block) blocks must fit. Returns
    ``None`` when no split satisfies the memory limits (or ``n < num_blocks``).
    """
    _check_split_arguments(weights, num_blocks, memory_limit_bytes)
    engine = _Engine(weights, num_blocks, memory_bytes, memory_limit_bytes, _cut_rows(cut_cost))
    if engine.n < num_blocks:
        return None
    rows = engine.probe(math.inf)
    if rows is None:
        return None
    best_cuts = engine.backtrack(rows)
    best_cuts, best = _bisect_bottleneck(engine, best_cuts, engine.bottleneck(best_cuts))
    stage = [0] * engine.n
    bounds = (0, *best_cuts, engine.n)
    for s in range(num_blocks):
        for k in range(bounds[s], bounds[s + 1]):
            stage[k] = s
    return ContiguousSplit(stage=tuple(stage), bottleneck=best, cuts=best_cuts)


def _check_split_arguments(
    weights: Sequence[Sequence[float]],
    num_blocks: int,
    memory_limit_bytes: Sequence[int] | None,
) -> None:
    """Raise SolverError on a weight-row count, block count or memory-limit count that does not
    fit (the rows' values are checked by the engine)."""
    if not weights:
        raise SolverError("contiguous split: weights needs at least one row")
    if len(weights) not in (1, num_blocks):
        raise SolverError(
            f"contiguous split: {len(weights)} weight rows for {num_blocks} blocks; give 1 or "
            f"{num_blocks}"
        )
    if num_blocks < 1:
        raise SolverError(f"contiguous split: num_blocks={num_blocks} must be >= 1")
    if memory_limit_bytes is not None and len(memory_limit_bytes) != num_blocks:
        raise SolverError(
            f"contiguous split: {len(memory_limit_bytes)} memory limits for {num_blocks} blocks"
        )


def _cut_rows(
    cut_cost: Sequence[float] | Sequence[Sequence[float]] | None,
) -> list[Sequence[float]] | None:
    """``cut_cost`` as a list of rows (one row shared by every boundary, or one per boundary)."""
    if cut_cost is None:
        return None
    if len(cut_cost) and isinstance(cut_cost[0], (list, tuple, np.ndarray)):
        return [list(row) for row in cut_cost]  # type: ignore[arg-type]
    return [list(cut_cost)]  # type: ignore[arg-type]


def _bisect_bottleneck(
    engine: _Engine, cuts: tuple[int, ...], bottleneck: float
) -> tuple[tuple[int, ...], float]:
    """The smallest feasible bottleneck, from a feasible split ``cuts`` of value ``bottleneck``:
    bisection over the bit patterns of non-negative doubles (lo infeasible, hi feasible)."""
    best, best_cuts = bottleneck, cuts
    lo, hi = -1, _bits(best)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rows = engine.probe(_float(mid))
        if rows is None:
            lo = mid
            continue
        cuts = engine.backtrack(rows)
        value = engine.bottleneck(cuts)
        if value <= best:
            best, best_cuts = value, cuts
        hi = min(mid, _bits(best))
    return best_cuts, best


def linear_partition(weights: Sequence[float], num_blocks: int) -> tuple[int, ...]:
    """The block of every item in an optimal linear partition of ``weights``.

    Minimises the largest block sum over exactly ``num_blocks`` non-empty contiguous blocks
    (requires ``len(weights) >= num_blocks``).
    """
    if len(weights) < num_blocks:
        raise SolverError(
            f"linear partition: {len(weights)} items cannot fill {num_blocks} non-empty blocks"
        )
    split = min_bottleneck_split([weights], num_blocks)
    assert split is not None  # no memory limits: always feasible when n >= k
    return split.stage
