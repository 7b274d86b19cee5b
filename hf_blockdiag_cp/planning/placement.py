"""Placement: which global positions of a packed row each CP rank holds, decided on the host per step.

Under a block-diagonal mask documents are independent, so the collator is free to choose which
documents — or pieces of them — each rank holds. A :class:`Placement` maps every position of the
row of ``S`` tokens to one of ``P`` ranks; every rank holds exactly ``L = S / P`` positions, kept
in ascending order (a rank's local rows are its positions sorted, so consecutive positions stay
consecutive local rows and form one kernel segment per document piece).

Kinds:

- ``contiguous``: rank ``r`` holds ``[r*L, (r+1)*L)``. Least communication, but a CP step is as
  slow as its slowest rank, and causal work per rank is badly unbalanced for document masks.
- ``zigzag``: the row cut into ``2P`` chunks; rank ``r`` holds chunks ``r`` and ``2P-1-r``. Balanced
  for one document filling the row, not for many documents.
- ``balanced``: documents are placed whole where they fit, and only documents too long or too
  heavy for one rank are split, head-tail over the fewest ranks that balance them
  (:func:`balanced_placement`).
- ``mirror``: zigzag's two stretches per rank over the documents laid lightest per token first, with split
  points chosen to balance work (:mod:`.mirror_placement`): at most two recurrent state summaries per rank.

Work model: a query at in-document offset ``t`` attends ``t + 1`` keys (``min(t + 1, w)`` under a
sliding window ``w``); a rank's work is the sum over its queries, averaged over the model's windows.

This module holds the placements, the balanced placement's rounds and the work per rank (:func:`rank_work`); one
round's assignment of documents to ranks, and the work of a piece, are :mod:`.balance`'s.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..config import PLACEMENTS
from .balance import Item as _Item
from .balance import assign as _assign
from .balance import cheapest_split as _cheapest_split
from .balance import head_tail_items as _head_tail_items  # noqa: F401
from .balance import improve as _improve
from .balance import make_item as _item  # noqa: F401
from .balance import piece_work
from .balance import spill as _spill  # noqa: F401
from .documents import arange, document_spans, run_starts
from .mirror_placement import mirror_placement
from .placement_table import Placement, PlacementRuns, contiguous_placement, zigzag_placement
from .varlen import PlanError

# The private names imported above are this module's from before it was split by job: tests/planning/reference_plans.py
# patches ``_assign`` and ``_improve`` here (balanced_placement looks them up in this module) and builds its
# reference from the others.

__all__ = [
    "PLACEMENTS",
    "Placement",
    "PlacementRuns",
    "balanced_placement",
    "contiguous_placement",
    "make_placement",
    "piece_work",
    "rank_work",
    "zigzag_placement",
]


def rank_work(doc_ids_row: torch.Tensor, placement: Placement, windows: Sequence[int | None] = (None,)
              ) -> torch.Tensor:
    """``[P]`` float64 causal pairs each rank's queries attend (the work model of :func:`balanced_placement`).

    Computed on runs (each placement run cut by the documents: closed-form sums in exact integers) when the
    number of windows is a power of two, where that equals the per-token float sum bit for bit; else per token.
    """
    count = len(windows)
    if count & (count - 1):
        return _rank_work_tokens(doc_ids_row, placement, windows)
    row = doc_ids_row.to(torch.int64).reshape(-1)
    runs = placement.runs
    ids = row.numpy()
    full_len = ids.size
    fresh = np.flatnonzero(ids[1:] != ids[:-1]) + 1 if full_len else np.zeros(0, np.int64)
    doc_start = np.concatenate([[0], fresh]).astype(np.int64) if full_len else fresh.astype(np.int64)
    cuts = np.union1d(runs.start, doc_start).astype(np.int64)
    cuts = cuts[cuts < full_len]
    ends = np.append(cuts[1:], full_len)
    real = ids[cuts] != 0 if cuts.size else np.zeros(0, bool)
    first = doc_start[np.searchsorted(doc_start, cuts, side="right") - 1] if cuts.size else cuts
    lo, hi = (cuts - first)[real], (ends - first)[real]  # in-document offsets [lo, hi) of each piece
    owner = runs.rank[np.searchsorted(runs.start, cuts, side="right") - 1][real] if cuts.size else cuts
    pairs = np.zeros(lo.size, dtype=np.int64)
    for window in windows:
        if window is None:
            pairs += (hi * (hi + 1) - lo * (lo + 1)) // 2
        else:
            mid = np.minimum(np.maximum(lo, window), hi)
            pairs += (mid * (mid + 1) - lo * (lo + 1)) // 2 + (hi - mid) * window
    total = np.zeros(placement.cp_size, dtype=np.int64)
    np.add.at(total, owner, pairs)
    return torch.from_numpy(total.astype(np.float64) / count)


def _rank_work_tokens(doc_ids_row: torch.Tensor, placement: Placement, windows: Sequence[int | None] = (None,)
                      ) -> torch.Tensor:
    """:func:`rank_work` token by token (any number of windows)."""
    row = doc_ids_row.to(torch.int64)
    offset = (arange(row.numel()) - run_starts(row)).to(torch.float64)
    per_token = torch.zeros_like(offset)
    for window in windows:
        per_token += offset + 1 if window is None else torch.clamp(offset + 1, max=window)
    per_token = torch.where(row != 0, per_token / len(windows), 0.0)
    return per_token[placement.index].sum(dim=1)


def balanced_placement(doc_ids_row: torch.Tensor, cp_size: int, *, tolerance: float = 0.05,
                       windows: Sequence[int | None] = (None,), max_rounds: int = 16,
                       documents: tuple[np.ndarray, np.ndarray] | None = None) -> Placement:
    """Balance causal work over ranks while splitting as few documents as possible.

    1. Every document longer than ``L`` is split head-tail (chunks ``j`` and ``2k-1-j`` of ``2k``
       together) over the fewest ``k`` ranks whose pieces fit ``L`` tokens; the others stay whole.
    2. Items (whole documents and split pieces) are placed heaviest first on the least loaded rank
       that has room for their tokens, pieces of one document on different ranks where possible;
       an item that fits no rank whole is cut into contiguous parts over the ranks with most room.
       Padding positions fill the remaining room, so every rank holds exactly ``L`` positions.
    3. While the most loaded rank exceeds the mean by more than ``tolerance``, its heaviest
       document is split over one more rank and the items are placed again (at most
       ``max_rounds`` times; the most balanced placement seen wins).

    ``tolerance`` is the one knob trading communication for balance: a split document's earlier
    rows must reach the ranks holding its later rows, so fewer splits move fewer K/V rows. Cost per
    round: ``O(D log D + D * P)`` host work for ``D`` documents, plus one ``O(S)`` pass.

    Args:
        doc_ids_row: ``[S]`` document ids of the full row (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        tolerance: accepted excess of the most loaded rank's work over the mean (>= 0).
        windows: the model's attention windows (``None`` = full causal) for the work model.
        max_rounds: bound on re-placement rounds.
        documents: the row's :func:`~hf_blockdiag_cp.planning.documents.document_runs`, if the caller has them.
    """
    if not tolerance >= 0:
        raise ValueError(f"balance tolerance={tolerance!r} must be >= 0")
    row = doc_ids_row.to(torch.int64).flatten()
    full_len = row.numel()
    local_len = full_len // cp_size
    spans = document_spans(row, documents)
    parts = [max(1, math.ceil((end - start) / local_len)) for start, end in spans]
    best: tuple[float, list[list[_Item]], list[int]] | None = None
    cache: dict[Any, Any] = {}  # items are never modified: rounds share them (and the sorted items)
    for _ in range(max_rounds + 1):
        placed, load, room, spilled = _assign(spans, parts, cp_size, local_len, windows, cache=cache)
        _improve(placed, load, room)
        mean = sum(load) / cp_size
        worst = max(range(cp_size), key=lambda r: load[r])
        ratio = load[worst] / mean if mean else 1.0
        if best is None or ratio < best[0]:
            best = (ratio, placed, room)
        if ratio <= 1 + tolerance:
            break

        def splittable(d: int) -> bool:
            return parts[d] < cp_size and 2 * (parts[d] + 1) <= spans[d][1] - spans[d][0]

        # A document cut contiguously because no rank had room for its piece gets smaller pieces;
        # else the cheapest document of the most loaded rank to split further is split.
        grow = [d for d in spilled if splittable(d)] or _cheapest_split(
            [it.doc for it in placed[worst]], load[worst] - mean, spans, parts, splittable, windows)
        if not grow:
            break
        for d in grow:
            parts[d] += 1
    _, placed, room = best
    return _placement_of_ranges([[r for item in items for r in item.ranges] for items in placed], room, spans,
                                full_len)


def _placement_of_ranges(ranges: list[list[tuple[int, int]]], room: list[int], spans: list[tuple[int, int]],
                         full_len: int) -> Placement:
    """The balanced placement from each rank's document ranges, padding handed out in row order (rank 0 first,
    ``room[r]`` positions each): built from runs, without sorting the row's positions."""
    cp_size = len(ranges)
    local_len = full_len // cp_size
    # Padding is the complement of the documents, as runs; ``pad_cum[k]`` padding positions precede run k.
    bounds = [0, *(x for span in spans for x in span), full_len]
    pad_runs = [(a, b) for a, b in zip(bounds[::2], bounds[1::2]) if b > a]
    pad_cum = [0]
    for a, b in pad_runs:
        pad_cum.append(pad_cum[-1] + b - a)
    starts: list[int] = []
    lengths: list[int] = []
    taken = 0
    for rank in range(cp_size):
        pieces = [(a, b) for a, b in ranges[rank] if b > a]
        end = taken + room[rank]
        k = bisect.bisect_right(pad_cum, taken) - 1
        while taken < end and k < len(pad_runs):
            a, b = pad_runs[k]
            lo = a + taken - pad_cum[k]
            hi = min(b, lo + end - taken)
            pieces.append((lo, hi))
            taken += hi - lo
            k += 1
        pieces.sort()
        held = sum(b - a for a, b in pieces)
        if held != local_len or taken != end:
            raise PlanError(f"placement 'balanced' does not give rank {rank} exactly {local_len} positions "
                            f"(it holds {held})")
        starts.extend(a for a, _ in pieces)
        lengths.extend(b - a for a, b in pieces)
    start = np.asarray(starts, dtype=np.int64)
    length = np.asarray(lengths, dtype=np.int64)
    keep = length > 0
    start, length = start[keep], length[keep]
    row_start = np.cumsum(length) - length  # flat [P * L] row of each piece, rank-major
    # The runs are the pieces, merged where one continues the previous on the same rank; the [P, L] table is
    # built from them only if asked for.
    rank = row_start // max(local_len, 1)
    fresh = np.ones(start.size, dtype=bool)
    fresh[1:] = (start[1:] != start[:-1] + length[:-1]) | (rank[1:] != rank[:-1])
    first = np.flatnonzero(fresh)
    merged = np.add.reduceat(length, first) if first.size else length[first]
    order = np.argsort(start[first], kind="stable")
    runs = PlacementRuns(start[first][order], merged[order].astype(np.int64), rank[first][order],
                         (row_start[first] % max(local_len, 1))[order])
    return Placement.from_runs("balanced", runs, cp_size, local_len)


def make_placement(doc_ids_row: torch.Tensor, cp_size: int, kind: str, *, tolerance: float = 0.05,
                   windows: Sequence[int | None] = (None,),
                   documents: tuple[np.ndarray, np.ndarray] | None = None) -> Placement:
    """The placement ``kind`` (one of :data:`PLACEMENTS`) of the row ``doc_ids_row [S]`` over ``cp_size`` ranks
    (``documents``: the row's :func:`~hf_blockdiag_cp.planning.documents.document_runs`, if the caller has them)."""
    full_len = int(doc_ids_row.numel())
    if cp_size < 1 or full_len % cp_size:
        raise PlanError(f"the row length S={full_len} is not divisible by cp_size={cp_size}")
    if kind == "contiguous" or cp_size == 1:
        return contiguous_placement(full_len, cp_size)
    if kind == "zigzag":
        return zigzag_placement(full_len, cp_size)
    if kind == "balanced":
        return balanced_placement(doc_ids_row, cp_size, tolerance=tolerance, windows=windows, documents=documents)
    if kind == "mirror":
        return mirror_placement(doc_ids_row, cp_size, windows=windows, documents=documents)
    raise ValueError(f"placement={kind!r} is not one of {', '.join(PLACEMENTS)}")
