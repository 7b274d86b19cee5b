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

The split points are chosen outside in: for a bound ``B`` on the work of a rank, each rank takes the most work it
can within ``B`` (its fronts' length searched over all ``L + 1`` values, one vectorised pass), which leaves the
least to the inner ranks; ``B`` is bisected down towards the mean. When light and heavy tokens of the order lie on
opposite sides of the window, some split hits the mean exactly, so most rows balance to a few parts in 10^4.
Host cost: ``O(S)`` per pass, about 15 passes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .placement import Placement, PlacementRuns
from .varlen import PlanError

__all__ = ["split_points", "mirror_placement"]

#: Bisection of the bound stops when it is known within this fraction of the mean work per rank.
BOUND_TOLERANCE = 1e-4


def _units(ids: np.ndarray, documents: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray,
                                                                                        np.ndarray]:
    """``(start [U], length [U], padding [U] bool)``: the row's documents and the padding runs between them."""
    full_len = ids.size
    if documents is None:
        start = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1]).astype(np.int64)
        padding = ids[start] == 0
        return start, np.diff(np.append(start, full_len)), padding
    doc_start, doc_end = documents
    bounds = np.union1d(np.concatenate([[0, full_len], doc_start, doc_end]), []).astype(np.int64)
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


def _greedy(prefix: np.ndarray, cp_size: int, bound: float | None) -> tuple[list[int], np.ndarray] | None:
    """Split points outside in: ``(x [P], work [P])``, each rank taking the most work within ``bound``, or (``bound``
    ``None``) the work nearest an equal share of what is left; ``None`` when a rank cannot stay within ``bound``.

    ``prefix``: ``[S + 1]`` prefix work of the order."""
    full_len = prefix.size - 1
    local_len = full_len // cp_size
    points, work = [0], np.zeros(cp_size, dtype=np.float64)
    x = 0
    for r in range(cp_size - 1):
        end = x + (cp_size - r) * local_len
        # take[a]: work of the front [x, x + a) plus the back [end - L + a, end), for every front length a.
        take = prefix[x:x + local_len + 1] - prefix[end - local_len:end + 1] + (prefix[end] - prefix[x])
        if bound is None:
            a = int(np.argmin(np.abs(take - (prefix[end] - prefix[x]) / (cp_size - r))))
        else:
            a = int(np.argmax(np.where(take <= bound, take, -1)))
            if take[a] > bound:
                return None
        work[r] = take[a]
        x += a
        points.append(x)
    work[-1] = prefix[x + local_len] - prefix[x]
    if bound is not None and work[-1] > bound:
        return None
    return points, work


def split_points(prefix: np.ndarray, cp_size: int, tolerance: float = BOUND_TOLERANCE) -> list[int]:
    """The split points ``x [P]`` (``x_0 = 0``) of least most-loaded rank found for the order of prefix work
    ``prefix [S + 1]``: the equal-share plan, then the bound bisected between the mean and the best maximum."""
    mean = float(prefix[-1]) / cp_size
    best = _greedy(prefix, cp_size, None)
    assert best is not None  # without a bound every rank takes some split
    low, high = mean, float(best[1].max())
    while high - low > tolerance * mean:
        bound = (low + high) / 2
        found = _greedy(prefix, cp_size, bound)
        if found is None:
            low = bound
            continue
        best, high = found, float(found[1].max())
    return best[0]


def _runs(start: np.ndarray, length: np.ndarray, order: np.ndarray, points: Sequence[int], cp_size: int
          ) -> PlacementRuns:
    """The placement's runs: the stretches of split points ``points`` over the units ``order`` laid end to end, cut
    at unit boundaries and mapped back to row positions (merged where one continues the previous on its rank)."""
    full_len = int(length.sum())
    local_len = full_len // cp_size
    stretches = []  # (start in the order, end, rank)
    for r in range(cp_size):
        x0, x1 = points[r], points[r + 1] if r + 1 < cp_size else points[r] + local_len
        stretches.append((x0, x1, r))
        if r + 1 < cp_size:
            stretches.append((x1 + (cp_size - r - 1) * local_len, x0 + (cp_size - r) * local_len, r))
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
    return Placement.from_runs("mirror", _runs(start, length, order, points, cp_size), cp_size, local_len)
