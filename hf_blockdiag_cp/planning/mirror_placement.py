"""The mirror placement: zigzag with free split points, over the row's documents in order of work per token.

A hybrid model pays one recurrent state summary per layer for every place where a document continues on another
rank (:mod:`.recurrent_cost`); zigzag pays at most two per rank but balances only one document filling the row.
The mirror placement keeps zigzag's shape and frees its split points. Notation (one row of ``S`` tokens, ``P``
ranks of ``L = S / P``):

- the *order*: the row's units (documents and padding runs, each kept whole and in its own token order) laid end
  to end; by default lightest work per token first (padding, short documents, then longer ones), which puts light
  tokens towards the front and the heavy tails of long documents at the back;
- rank ``r`` holds a *front stretch* ``[x_r, x_{r+1})`` and a *back stretch* of ``L - (x_{r+1} - x_r)`` tokens of
  that order: fronts are laid left to right from 0 in rank order, backs right to left from ``S``, so rank ``r``'s
  two stretches bound the *window* ``[x_r, x_r + (P - r) L)`` still to be placed and rank ``P - 1`` takes the last
  window of ``L`` tokens. ``x_{r+1} - x_r = L / 2`` for every rank is zigzag.

Each stretch is one piece of the order, so only its last document can continue elsewhere: at most two summaries per
rank (``slots <= 2``), whatever the split points. With ``F`` the prefix work of the order (per token
``min(t + 1, w)`` at in-document offset ``t``, summed over the model's windows ``w``, 0 on padding: the work model
of :func:`~.placement.rank_work`), rank ``r`` does ``F(x_{r+1}) - F(x_r) + F(e_r) - F(e_r - L + x_{r+1} - x_r)``
with ``e_r = x_r + (P - r) L``.

The split points are chosen for the least most-loaded rank. Rank ``r`` does ``V_r(x_r) - V_{r+1}(x_{r+1})`` with
``V_r(x)`` the work of the window ``[x, x + (P - r) L)``, so the split points that keep every rank within a bound
``B`` follow outside in from one sliding minimum of ``V_r`` per rank (:func:`_lattice_path`); ``B`` is bisected on a
lattice of :data:`COARSE_STEPS` positions per ``L`` tokens, then token by token near the lattice's best. When the
equal shares (each rank, outside in, the work nearest an equal share of what is left) are already within
:data:`GOOD_ENOUGH` of the mean, there is no search: one document filling the row gives zigzag. With light tokens at
the front of the order and heavy ones at the back, some split hits the mean at every rank; long documents (whose
first tokens are light) break that at 1M tokens on 64 ranks (docs/placement.md). Host cost: ``O(S)`` for the
order, then per bisection step (about 20) ``O(P L / step)`` near a tight bound, up to ``O(P S / step)`` for a loose
one: 0.6 ms at 128K / 8, about 40 ms at 1M / 64.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .placement_table import Placement, PlacementRuns
from .varlen import PlanError

__all__ = ["mirror_placement", "split_points"]

#: Split points within this fraction of the mean work per rank of the equal shares are kept as they are.
GOOD_ENOUGH = 1e-3
#: Positions per ``L`` tokens of the coarse search for the split points.
COARSE_STEPS = 128
#: The bisections of the bound stop when it is known within these fractions of the mean work per rank.
COARSE_TOLERANCE = 1e-3
FINE_TOLERANCE = 2e-4


def _units(ids: np.ndarray, documents: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """``(start [U], length [U], padding [U] bool)``: the row's documents and the padding runs between them."""
    full_len = ids.size
    if documents is None:
        start = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1]).astype(np.int64)
        padding = ids[start] == 0
        return start, np.diff(np.append(start, full_len)), padding
    doc_start, doc_end = documents
    bounds = np.unique(np.concatenate([[0, full_len], doc_start, doc_end]).astype(np.int64))
    start = bounds[:-1]
    # A unit that is no document's start is padding (documents tile their spans: every document starts a unit).
    return start, np.diff(bounds), ~np.isin(start, doc_start)


def _order_work(length: np.ndarray, padding: np.ndarray, windows: Sequence[int | None]) -> np.ndarray:
    """``[S]`` int64 work of each token of the units laid end to end in the given order (summed over ``windows``)."""
    unit_start = np.cumsum(length) - length
    offset = np.arange(int(length.sum()), dtype=np.int64) - np.repeat(unit_start, length)  # in-unit offset t
    work = np.zeros_like(offset)
    for window in windows:
        work += offset + 1 if window is None else np.minimum(offset + 1, window)
    work[np.repeat(padding, length)] = 0
    return work


def _works(prefix: np.ndarray, cp_size: int, points: Sequence[int]) -> np.ndarray:
    """``[P]`` float64 work of each rank for the split points ``x [P + 1]`` (``x_P = x_{P-1} + L``)."""
    x = np.asarray(points, dtype=np.int64)
    local_len = (prefix.size - 1) // cp_size
    end = x + (cp_size - np.arange(cp_size + 1)) * local_len  # e_r; rank r's back stretch is [e_{r+1}, e_r)
    return (np.diff(prefix[x]) - np.diff(prefix[end])).astype(np.float64)


def _equal_shares(prefix: np.ndarray, cp_size: int) -> list[int]:
    """Split points ``x [P + 1]`` outside in, each rank taking the work nearest an equal share of what is left (over
    all ``L + 1`` front lengths at once; on one document filling the row this is zigzag)."""
    local_len = (prefix.size - 1) // cp_size
    points = [0]
    for r in range(cp_size - 1):
        x = points[-1]
        end = x + (cp_size - r) * local_len
        left = prefix[end] - prefix[x]
        # take[a]: work of the front [x, x + a) plus the back [end - L + a, end), for every front length a.
        take = prefix[x:x + local_len + 1] - prefix[end - local_len:end + 1] + left
        points.append(x + int(np.argmin(np.abs(take - left / (cp_size - r)))))
    points.append(points[-1] + local_len)
    return points


def _window_min(values: np.ndarray, first: int, count: int, width: int) -> np.ndarray:
    """``[count]``: element ``j`` the least of ``values[first + j : first + j + width]`` (``inf`` past its ends)."""
    size = values.size
    if width >= size:  # every window holds a prefix of ``values``, a suffix, all or none
        head = np.minimum.accumulate(values)
        tail = np.minimum.accumulate(values[::-1])[::-1]
        a = first + np.arange(count)
        b = a + width - 1
        least = np.where(a <= 0, head[np.clip(b, 0, size - 1)], tail[np.clip(a, 0, size - 1)])
        return np.where((b < 0) | (a >= size), np.inf, least)
    # Van Herk / Gil-Werman: every window spans at most two blocks of ``width``; the least of its part in each is a
    # running minimum from the block's right end and from its left end.
    padded = np.full(-(-(count + width - 1) // width) * width, np.inf)
    lo, hi = max(first, 0), min(first + count + width - 1, size)
    if hi > lo:
        padded[lo - first:hi - first] = values[lo:hi]
    blocks = padded.reshape(-1, width)
    from_left = np.minimum.accumulate(blocks, axis=1).reshape(-1)
    from_right = np.minimum.accumulate(blocks[:, ::-1], axis=1)[:, ::-1].reshape(-1)
    j = np.arange(count)
    return np.minimum(from_right[j], from_left[j + width - 1])


def _lattice_path(prefix: np.ndarray, cp_size: int, bound: float, lo: Sequence[int], count: Sequence[int],
                  step: int) -> list[int] | None:
    """Split points ``x [P + 1]`` with every rank's work within ``bound``, each ``x_r`` one of ``lo[r] + k * step``
    (``k < count[r]``, ``lo[r + 1] - lo[r]`` a multiple of ``step``); ``None`` when there are none.

    Rank ``r`` does ``V_r(x_r) - V_{r+1}(x_{r+1})`` with ``V_r(x)`` the work of the window ``[x, x + (P - r) L)``, so
    ``x_{r+1}`` is reachable when the least ``V_r`` of the reachable ``x_r`` in ``[x_{r+1} - L, x_{r+1}]`` is within
    ``bound + V_{r+1}(x_{r+1})``: one sliding minimum per rank, then a walk back from the innermost rank. Each rank
    looks only at the positions within ``L`` after the previous rank's reachable ones (near a tight bound, few)."""
    local_len = (prefix.size - 1) // cp_size
    seen = [(lo[0], np.ones(count[0], dtype=bool))]  # per rank: (first position looked at, reachable)
    windows = []
    for r in range(cp_size - 1):
        first, reach = seen[r]
        x = first + step * np.arange(reach.size)
        windows.append(np.where(reach, prefix[x + (cp_size - r) * local_len] - prefix[x], np.inf))
        held = np.flatnonzero(reach)
        k0 = max(0, -(-(int(x[held[0]]) - lo[r + 1]) // step))
        k1 = min(count[r + 1] - 1, (int(x[held[-1]]) + local_len - lo[r + 1]) // step)
        nxt = lo[r + 1] + step * np.arange(k0, k1 + 1)
        least = _window_min(windows[r], -((local_len + first - int(nxt[0])) // step), nxt.size, local_len // step + 1)
        reach = least <= bound + (prefix[nxt + (cp_size - r - 1) * local_len] - prefix[nxt])
        if not reach.any():
            return None
        seen.append((int(nxt[0]), reach))
    first, reach = seen[-1]
    x = first + step * np.arange(reach.size)
    last = np.flatnonzero(reach & (prefix[x + local_len] - prefix[x] <= bound))
    if not last.size:
        return None
    points = [int(x[last[0]]) + local_len, int(x[last[0]])]
    for r in range(cp_size - 2, -1, -1):
        after = points[-1]
        x = seen[r][0] + step * np.arange(seen[r][1].size)
        inner = prefix[after + (cp_size - r - 1) * local_len] - prefix[after]
        fits = (x >= after - local_len) & (x <= after) & (windows[r] - inner <= bound)
        points.append(int(x[np.flatnonzero(fits)[0]]))
    return points[::-1]


def _bisect(prefix: np.ndarray, cp_size: int, lattice: tuple[list[int], list[int], int], low: float,
            best: tuple[list[int], float], tolerance: float) -> tuple[tuple[list[int], float], float]:
    """The best split points ``(x, most work)`` on ``lattice = (lo, count, step)`` (see :func:`_lattice_path`), and
    the highest bound found out of reach: the bound bisected between ``low`` and the best found until known within
    ``tolerance``."""
    while best[1] - low > tolerance:
        bound = (low + best[1]) / 2
        found = _lattice_path(prefix, cp_size, bound, *lattice)
        if found is None:
            low = bound
        else:
            best = (found, float(_works(prefix, cp_size, found).max()))
    return best, low


def split_points(prefix: np.ndarray, cp_size: int) -> list[int]:
    """Split points ``x [P + 1]`` (``x_0 = 0``, ``x_P = x_{P-1} + L``) of least most-loaded rank found for the order
    of prefix work ``prefix [S + 1]``: the equal shares if already within :data:`GOOD_ENOUGH` of the mean, else the
    best on a lattice of :data:`COARSE_STEPS` positions per ``L`` tokens, then the best within two lattice steps of
    it at every token."""
    local_len = (prefix.size - 1) // cp_size
    mean = float(prefix[-1]) / cp_size
    shares = _equal_shares(prefix, cp_size)
    best = (shares, float(_works(prefix, cp_size, shares).max()))
    if best[1] <= mean * (1 + GOOD_ENOUGH):
        return shares
    step = max(1, local_len // COARSE_STEPS)
    coarse = ([0] * cp_size, [r * local_len // step + 1 for r in range(cp_size)], step)
    best, low = _bisect(prefix, cp_size, coarse, mean, best, COARSE_TOLERANCE * mean)
    near = [max(0, x - 2 * step) for x in best[0][:-1]]
    fine = (near, [min(r * local_len, x + 2 * step) - a + 1 for r, (x, a) in enumerate(zip(best[0], near))], 1)
    # Token by token near the coarse points gains a fraction of a percent: searched from a little below what the
    # lattice could not reach.
    low = max(mean, low - 4 * COARSE_TOLERANCE * mean)
    return _bisect(prefix, cp_size, fine, low, best, FINE_TOLERANCE * mean)[0][0]


def _runs(start: np.ndarray, length: np.ndarray, order: np.ndarray, points: Sequence[int], cp_size: int
          ) -> PlacementRuns:
    """The placement's runs: the stretches of split points ``points`` over the units ``order`` laid end to end, cut
    at unit boundaries and mapped back to row positions (merged where one continues the previous on its rank)."""
    full_len = int(length.sum())
    local_len = full_len // cp_size
    stretches = []  # (start in the order, end, rank): rank r's front, then its back [e_{r+1}, e_r)
    for r in range(cp_size):
        stretches.append((points[r], points[r + 1], r))
        stretches.append((points[r + 1] + (cp_size - r - 1) * local_len, points[r] + (cp_size - r) * local_len, r))
    stretches.sort()
    bound = np.asarray([a for a, b, _ in stretches if b > a], dtype=np.int64)
    owner = np.asarray([r for a, b, r in stretches if b > a], dtype=np.int64)
    unit_len = length[order]
    unit_at = np.cumsum(unit_len) - unit_len  # each unit's start in the order
    cuts = np.union1d(bound, unit_at)
    piece_len = np.diff(np.append(cuts, full_len))
    unit = np.searchsorted(unit_at, cuts, side="right") - 1
    rank = owner[np.searchsorted(bound, cuts, side="right") - 1]
    row_start = start[order][unit] + cuts - unit_at[unit]
    by_row = np.argsort(row_start, kind="stable")
    row_start, piece_len, rank = row_start[by_row], piece_len[by_row], rank[by_row]
    fresh = np.ones(row_start.size, dtype=bool)
    fresh[1:] = (row_start[1:] != row_start[:-1] + piece_len[:-1]) | (rank[1:] != rank[:-1])
    first = np.flatnonzero(fresh)
    row_start, piece_len, rank = row_start[first], np.add.reduceat(piece_len, first), rank[first]
    # A rank's local rows are its positions ascending: each run starts after that rank's earlier runs.
    rank_major = np.lexsort((row_start, rank))
    before = np.empty_like(piece_len)
    before[rank_major] = np.cumsum(piece_len[rank_major]) - piece_len[rank_major]
    held = np.bincount(rank, weights=piece_len, minlength=cp_size)
    if not np.all(held == local_len):
        raise PlanError(f"placement 'mirror' does not give every rank exactly {local_len} positions "
                        f"(counts {held.astype(np.int64).tolist()})")
    return PlacementRuns(row_start, piece_len, rank, before - rank * local_len)


def mirror_placement(doc_ids_row: torch.Tensor, cp_size: int, *, windows: Sequence[int | None] = (None,),
                     fronts: Sequence[int] | None = None, sort: bool = True,
                     documents: tuple[np.ndarray, np.ndarray] | None = None) -> Placement:
    """The mirror placement of the row ``doc_ids_row [S]`` over ``cp_size`` ranks (module docstring).

    Args:
        doc_ids_row: ``[S]`` document ids of the full row (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        windows: the model's attention windows (``None`` = full causal) for the work model.
        fronts: forces the front lengths ``x_{r+1} - x_r`` of ranks ``0 .. P - 2`` (each in ``[0, L]``) instead of
            balancing; with ``sort=False`` and every one ``L / 2`` this is zigzag.
        sort: lay the units lightest work per token first (default); ``False`` keeps the row's order.
        documents: the row's :func:`~hf_blockdiag_cp.planning.documents.document_runs`, if the caller has them.
    """
    ids = doc_ids_row.to(torch.int64).reshape(-1).numpy()
    full_len = ids.size
    if cp_size < 1 or full_len % cp_size or full_len == 0:
        raise PlanError(f"placement='mirror' needs a non-empty row length S={full_len} divisible by "
                        f"cp_size={cp_size}")
    local_len = full_len // cp_size
    start, length, padding = _units(ids, documents)
    if sort:
        unit_work = np.add.reduceat(_order_work(length, padding, windows), np.cumsum(length) - length)
        order = np.lexsort((start, unit_work / length))  # lightest per token first, ties in row order
    else:
        order = np.arange(start.size)
    if fronts is None:
        prefix = np.zeros(full_len + 1, dtype=np.int64)
        np.cumsum(_order_work(length[order], padding[order], windows), out=prefix[1:])
        points = split_points(prefix, cp_size)
    else:
        if len(fronts) != cp_size - 1 or any(not 0 <= int(a) <= local_len for a in fronts):
            raise ValueError(f"fronts={list(fronts)!r} must be {cp_size - 1} lengths in [0, {local_len}]")
        points = np.concatenate([[0], np.cumsum(np.asarray(fronts, dtype=np.int64))]).tolist()
        points.append(points[-1] + local_len)
    return Placement.from_runs("mirror", _runs(start, length, order, points, cp_size), cp_size, local_len)
