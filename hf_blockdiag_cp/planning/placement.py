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

Work model: a query at in-document offset ``t`` attends ``t + 1`` keys (``min(t + 1, w)`` under a
sliding window ``w``); a rank's work is the sum over its queries, averaged over the model's windows.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from ..config import PLACEMENTS
from .documents import arange, document_spans, run_starts
from .varlen import PlanError, QueryPiece

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


@dataclass(frozen=True, eq=False)
class PlacementRuns:
    """A placement as runs: maximal pieces of consecutive positions held at consecutive local rows of one rank.

    Every array is ``[R]`` int64 numpy, ascending ``start``; the runs partition ``[0, S)``. A contiguous
    placement has ``P`` runs, zigzag ``2P``, balanced about one per document piece plus ``P`` of padding.
    """

    start: np.ndarray
    length: np.ndarray
    rank: np.ndarray
    local_start: np.ndarray

    @property
    def end(self) -> np.ndarray:
        return self.start + self.length


@dataclass(frozen=True, eq=False)
class Placement:
    """Global positions held by each CP rank.

    Attributes:
        kind: the name of the scheme that made it (one of :data:`PLACEMENTS`).
        index: ``[P, L]`` int64; ``index[r]`` are rank ``r``'s global positions in ascending order
            (its ``local_index``). Together the rows are a permutation of ``[0, S)``.

    A placement made from its runs (:meth:`from_runs`, what the balanced placement returns) builds ``index`` on
    first use: planning one rank (:meth:`positions`, :meth:`pieces`, :attr:`runs`) needs only the runs, so a
    step pays no row-long table, and a pickled context carries none, unless something asks for it.
    """

    kind: str
    index: torch.Tensor

    @classmethod
    def from_runs(cls, kind: str, runs: PlacementRuns, cp_size: int, local_len: int) -> Placement:
        """The placement whose runs are ``runs`` (``P = cp_size`` ranks of ``local_len`` positions each)."""
        placement = cls.__new__(cls)
        object.__setattr__(placement, "kind", kind)
        placement.__dict__["runs"] = runs
        placement.__dict__["_shape"] = (cp_size, local_len)
        return placement

    def __getattr__(self, name: str) -> torch.Tensor:
        # Only reached for attributes not set: ``index`` of a placement made from runs, built once.
        shape = self.__dict__.get("_shape")
        if name != "index" or shape is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        index = _table_of_runs(self.__dict__["runs"], *shape)
        self.__dict__["index"] = index
        return index

    @property
    def _dims(self) -> tuple[int, int]:
        shape = self.__dict__.get("_shape")
        return shape if shape is not None else tuple(self.index.shape)

    @property
    def cp_size(self) -> int:
        return self._dims[0]

    @property
    def local_len(self) -> int:
        return self._dims[1]

    @property
    def full_len(self) -> int:
        return self._dims[0] * self._dims[1]

    def positions(self, rank: int) -> torch.Tensor:
        """``[L]`` int64 global positions of rank ``rank`` (ascending; a tensor of its own): from the runs when
        the table is not built, ``O(L)``."""
        index = self.__dict__.get("index")
        if index is not None:
            return index[rank].clone()
        runs = self.runs
        mine = runs.rank == rank  # in start order = local row order (a rank's positions ascend)
        start, length = runs.start[mine], runs.length[mine]
        return torch.from_numpy(np.repeat(start - (np.cumsum(length) - length), length)
                                + np.arange(int(length.sum()), dtype=np.int64))

    @property
    def is_contiguous(self) -> bool:
        """Whether rank ``r`` holds exactly ``[r*L, (r+1)*L)``."""
        return bool(torch.equal(self.index.flatten(), arange(self.full_len)))

    @cached_property
    def runs(self) -> PlacementRuns:
        """The placement as :class:`PlacementRuns` (one vectorised pass over ``index``, cached: the plans of
        every window and every rank share it)."""
        flat = self.index.reshape(-1).numpy()
        n, local_len = flat.size, self.local_len
        fresh = np.ones(n, dtype=bool)
        if n:
            fresh[1:] = flat[1:] != flat[:-1] + 1
            fresh[::local_len] = True  # a rank's first row starts a run whatever the previous rank ended with
        first = np.flatnonzero(fresh)
        length = np.diff(np.append(first, n))
        order = np.argsort(flat[first], kind="stable")
        return PlacementRuns(flat[first][order].astype(np.int64), length[order].astype(np.int64),
                             (first // max(local_len, 1))[order].astype(np.int64),
                             (first % max(local_len, 1))[order].astype(np.int64))

    def owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rank [S], local_row [S])``: who holds each global position, and at which local row."""
        rank = torch.empty(self.full_len, dtype=torch.int64)
        row = torch.empty(self.full_len, dtype=torch.int64)
        flat = self.index.flatten()
        rank[flat] = torch.arange(self.cp_size).repeat_interleave(self.local_len)
        row[flat] = torch.arange(self.local_len).repeat(self.cp_size)
        return rank, row

    def pieces(self, rank: int) -> list[QueryPiece]:
        """Rank ``rank``'s local rows as runs of consecutive global positions (batch row 0)."""
        if "index" not in self.__dict__:  # the runs are these pieces (maximal, in local row order)
            runs = self.runs
            mine = runs.rank == rank
            return [QueryPiece(0, a, g, n) for a, g, n in zip(runs.local_start[mine].tolist(),
                                                               runs.start[mine].tolist(), runs.length[mine].tolist())]
        positions = self.index[rank]
        breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), self.local_len]
        first = positions[starts].tolist() if self.local_len else []
        return [QueryPiece(0, a, g, b - a) for a, b, g in zip(starts, ends, first)]

    @classmethod
    def from_owner(cls, kind: str, owner: torch.Tensor, cp_size: int) -> Placement:
        """The placement in which rank ``owner[p]`` holds position ``p`` (``owner [S]``, each rank ``S / P`` times)."""
        counts = torch.bincount(owner.clamp(min=0), minlength=cp_size)
        if bool((owner < 0).any()) or not bool((counts == owner.numel() // cp_size).all()):
            raise PlanError(f"placement {kind!r} does not give every rank exactly {owner.numel() // cp_size} "
                            f"positions (counts {counts.tolist()})")
        # A stable sort by rank keeps each rank's positions ascending (numpy's is a radix sort here).
        index = torch.from_numpy(np.argsort(owner.numpy().astype(np.int16), kind="stable")).view(cp_size, -1)
        return cls(kind, index)


def contiguous_placement(full_len: int, cp_size: int) -> Placement:
    """Rank ``r`` holds ``[r*L, (r+1)*L)``."""
    return Placement("contiguous", arange(full_len).view(cp_size, full_len // cp_size))


def zigzag_placement(full_len: int, cp_size: int) -> Placement:
    """The row in ``2P`` equal chunks; rank ``r`` holds chunks ``r`` and ``2P - 1 - r``."""
    if full_len % (2 * cp_size):
        raise PlanError(f"placement='zigzag' needs the row length S={full_len} divisible by 2 * cp_size = "
                        f"{2 * cp_size}; use a seq_len that is, or another placement")
    chunks = arange(full_len).view(2 * cp_size, -1)
    return Placement("zigzag", torch.cat([chunks[:cp_size], chunks.flip(0)[:cp_size]], dim=1))


def piece_work(start: int, end: int, windows: Sequence[int | None] = (None,)) -> float:
    """Causal query-key pairs of a document's queries at offsets ``[start, end)``, averaged over ``windows``."""
    total = 0.0
    for window in windows:
        if window is None:
            total += (end * (end + 1) - start * (start + 1)) / 2
        else:
            # Offsets below the window see t + 1 keys, the rest see the full window.
            mid = min(max(start, window), end)
            total += (mid * (mid + 1) - start * (start + 1)) / 2 + (end - mid) * window
    return total / len(windows)


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


@dataclass
class _Item:
    """Positions placed together on one rank: a whole document, a head-tail pair of its chunks, or
    (when no rank had room for a piece) a contiguous part of one."""

    work: float
    tokens: int
    ranges: list[tuple[int, int]]
    doc: int


def _item(doc: int, doc_start: int, ranges: list[tuple[int, int]], windows: Sequence[int | None]) -> _Item:
    if len(ranges) == 1:  # a whole document: the common case
        a, b = ranges[0]
        return _Item(piece_work(a - doc_start, b - doc_start, windows), b - a, ranges, doc)
    ranges = [(a, b) for a, b in ranges if b > a]
    work = sum(piece_work(a - doc_start, b - doc_start, windows) for a, b in ranges)
    return _Item(work, sum(b - a for a, b in ranges), ranges, doc)


def _head_tail_items(doc: int, start: int, length: int, parts: int,
                     windows: Sequence[int | None]) -> list[_Item]:
    """Split a document into ``2 * parts`` chunks; item ``j`` holds chunks ``j`` and ``2*parts-1-j``,
    so every item has (nearly) the same tokens and the same causal work."""
    bounds = [start + (length * i) // (2 * parts) for i in range(2 * parts + 1)]
    return [_item(doc, start, [(bounds[j], bounds[j + 1]), (bounds[2 * parts - 1 - j], bounds[2 * parts - j])],
                  windows) for j in range(parts)]


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


def _table_of_runs(runs: PlacementRuns, cp_size: int, local_len: int) -> torch.Tensor:
    """The ``[P, L]`` table of a placement given as runs."""
    order = np.argsort(runs.rank * local_len + runs.local_start, kind="stable")  # rank-major, local row order
    start, length = runs.start[order], runs.length[order]
    row_start = np.cumsum(length) - length
    # A running sum: +1 per row, and at each run's first row the jump from the previous run's last position to
    # this run's start. One row-long array, written twice (fresh row-long arrays cost page faults on top of
    # their writes).
    index = np.ones(cp_size * local_len, dtype=np.int64)
    if start.size:
        index[row_start] = np.append(start[0], start[1:] - (start[:-1] + length[:-1] - 1))
    np.cumsum(index, out=index)
    return torch.from_numpy(index).view(cp_size, local_len)


def _cheapest_split(docs: list[int], excess: float, spans: list[tuple[int, int]], parts: list[int],
                    splittable: Callable[[int], bool], windows: Sequence[int | None]) -> list[int]:
    """The document of the most loaded rank to split over one more rank: the shortest one whose
    split sheds at least the rank's excess work (splitting moves about its length in K/V), else
    the heaviest splittable one."""
    candidates = [d for d in docs if splittable(d)]
    if not candidates:
        return []

    def shed(d: int) -> float:
        work = piece_work(0, spans[d][1] - spans[d][0], windows)
        return work / parts[d] - work / (parts[d] + 1)

    enough = [d for d in candidates if shed(d) >= excess]
    if enough:
        return [min(enough, key=lambda d: spans[d][1] - spans[d][0])]
    return [max(candidates, key=shed)]


def _assign(spans: list[tuple[int, int]], parts: list[int], cp_size: int, local_len: int,
            windows: Sequence[int | None], cache: dict[Any, Any] | None = None
            ) -> tuple[list[list[_Item]], list[float], list[int], list[int]]:
    """One placement round: ``(items per rank heaviest first, work per rank, room left per rank,
    documents cut because their piece fit no rank)``."""
    cache = {} if cache is None else cache  # (doc, parts) -> its items: rounds change few documents' parts

    def items_of(doc: int) -> list[tuple[float, int, int, int, _Item]]:
        made = cache.get((doc, parts[doc]))
        if made is None:
            start, end = spans[doc]
            made = cache[doc, parts[doc]] = ([_item(doc, start, [(start, end)], windows)] if parts[doc] == 1 else
                                             _head_tail_items(doc, start, end - start, parts[doc], windows))
            made[:] = [(-it.work, -it.tokens, doc, j, it) for j, it in enumerate(made)]
        return made

    # Heaviest first, ties in document order (a stable sort by (-work, -tokens)): the cached tuples sort in C. Their
    # keys (-work, -tokens, doc, j) are distinct, so the sorted list is unique: the previous round's (kept in the
    # cache under ``None`` with its parts) is updated by taking out and putting in the items of the documents whose
    # parts changed, instead of sorting every item again.
    previous = cache.get(None)
    if previous is None:
        keyed: list[tuple[float, int, int, int, _Item]] = []
        for doc in range(len(spans)):
            keyed.extend(items_of(doc))
        keyed.sort()
    else:
        old_parts, keyed = previous
        if old_parts != parts:
            for doc in [d for d, (new, old) in enumerate(zip(parts, old_parts)) if new != old]:
                for key in cache[doc, old_parts[doc]]:
                    del keyed[bisect.bisect_left(keyed, key)]
                for key in items_of(doc):
                    bisect.insort(keyed, key)
    cache[None] = (list(parts), keyed)
    load = [0.0] * cp_size
    room = [local_len] * cp_size
    placed: list[list[_Item]] = [[] for _ in range(cp_size)]
    spilled: list[int] = []
    # The rank of each item is the first in (load, -room, rank) order that has room for it, preferring ranks not
    # holding the document already. The ranks with room are kept in that order in buckets by room (``shelves[b]``:
    # rooms of bit length b, i.e. in [2^(b-1), 2^b), each a sorted list: one bisect out and one in per item). An
    # item of t tokens fits every rank of the shelves above t's (their first entry is their first fit), none below,
    # and is looked for only in its own shelf: the first fit overall is the least of these few candidates, found
    # without walking past the nearly full ranks that lead the load order.
    # A rank whose room is below the tokens of every item left can never be chosen again (rooms only shrink), so it
    # leaves the shelves: when its room drops below them, or when they grow (``alive[i]``: the least tokens of
    # items i, i + 1, ...; it only grows). Only ranks that fit no item left leave: every search finds the same rank.
    shelves: list[list[tuple[float, int, int]]] = [[] for _ in range(local_len.bit_length() + 1)]
    shelves[-1] = [(0.0, -local_len, r) for r in range(cp_size)]
    top = len(shelves)  # shelves[top:] are empty (rooms only shrink: ``top`` only falls, but for a spill)
    negative = np.fromiter(map(operator.itemgetter(1), keyed), dtype=np.int64, count=len(keyed))
    alive = (-np.maximum.accumulate(negative[::-1])[::-1]).tolist()
    alive.append(0)
    threshold = 0
    ranks_of: dict[int, set[int]] = {}  # a set: split documents can span many ranks
    bisect_left, insort = bisect.bisect_left, bisect.insort
    for i, (_, neg_tokens, doc, _, item) in enumerate(keyed):
        if alive[i] > threshold:
            threshold = alive[i]
            shelves = [[entry for entry in shelf if -entry[1] >= threshold] for shelf in shelves]
        rank = home = None
        multi = parts[doc] > 1  # a whole document is one item: no other item of it to keep apart
        holding = ranks_of.get(doc, ()) if multi else ()
        if neg_tokens == 0:  # fits a full rank too (not on a shelf): look at every rank
            fits = [r for r in range(cp_size) if r not in holding] or list(range(cp_size))
            rank = min(fits, key=lambda r: (load[r], -room[r]))
        else:
            own = (-neg_tokens).bit_length()
            best = home = None  # entries carry -room: a rank fits when -room <= -tokens
            if not holding:
                if own < top:
                    for entry in shelves[own]:
                        if entry[1] <= neg_tokens:
                            best, home = entry, shelves[own]
                            break
                for shelf in shelves[own + 1:top]:
                    if shelf and (best is None or shelf[0] < best):
                        best, home = shelf[0], shelf
            else:
                first_fit = None
                for entry in shelves[own] if own < top else ():
                    if entry[1] <= neg_tokens:
                        if entry[2] not in holding:
                            best = entry
                            break
                        if first_fit is None:
                            first_fit = entry
                for b in range(own + 1, top):
                    shelf = shelves[b]
                    if not shelf:
                        continue
                    if first_fit is None or shelf[0] < first_fit:
                        first_fit = shelf[0]
                    for entry in shelf:
                        if entry[2] not in holding:
                            if best is None or entry < best:
                                best = entry
                            break
                if best is None:
                    best = first_fit
            if best is not None:
                rank = best[2]
                home = shelves[(-best[1]).bit_length()] if home is None else home
        if rank is None:
            _spill(item, spans[doc][0], windows, load, room, placed)
            spilled.append(doc)
            shelves = [[] for _ in shelves]
            for r in range(cp_size):
                if 0 < room[r] >= alive[i + 1]:
                    shelves[room[r].bit_length()].append((load[r], -room[r], r))
            for shelf in shelves:
                shelf.sort()
            top = len(shelves)
            threshold = alive[i + 1]
            continue
        left = room[rank]
        if home is not None:  # the chosen entry, on its shelf
            del home[bisect_left(home, best)]
        elif left >= threshold and left > 0:
            shelf = shelves[left.bit_length()]
            del shelf[bisect_left(shelf, (load[rank], -left, rank))]
        placed[rank].append(item)
        if holding:
            holding.add(rank)
        elif multi:
            ranks_of[doc] = {rank}
        load[rank] += item.work
        left += neg_tokens
        room[rank] = left
        if left > 0 and left >= alive[i + 1]:  # a full rank fits nothing more (every other item holds a token)
            insort(shelves[left.bit_length()], (load[rank], -left, rank))
        if home is not None and not home:  # the top shelf may be empty now
            while top and not shelves[top - 1]:
                top -= 1
    return placed, load, room, spilled


def _improve(placed: list[list[_Item]], load: list[float], room: list[int], *, steps: int = 8,
             width: int = 16) -> None:
    """Local search: move a whole item off the most loaded rank, or swap it for a lighter one, while
    that lowers the pair's maximum (only whole items move: no new split, no new K/V traffic beyond
    where the pieces already were). Looks at the ``width`` heaviest items of each rank.

    Every candidate of a step (item ``i`` of the most loaded rank, rank ``r``, a move or a swap with item ``j``)
    is scored in one vectorised pass; the first best in ``(i, r, move, j)`` order wins, as in a loop over them.

    Slot 0 of every rank is an empty item (no work, no tokens): swapping with it is the move, scored by the same
    float operations (``x + 0.0`` and ``x - 0.0`` are ``x``), so one pass scores moves and swaps together."""
    cp_size = len(load)
    # The table has as many slots as the fullest rank has items (up to ``width``), after the empty slot 0: slots
    # past a rank's items hold infinite work (never a candidate), so narrower tables score the same candidates;
    # ``refresh`` widens it.
    slots = min(width, max(len(items) for items in placed))
    works = np.full((cp_size, 1 + slots), np.inf)
    works[:, 0] = 0.0
    tokens = np.zeros((cp_size, 1 + slots), dtype=np.int64)
    # Filled in one assignment: every item's work and tokens at (its rank, its slot).
    counts = np.fromiter((min(len(items), slots) for items in placed), dtype=np.int64, count=cp_size)
    rank_of = np.repeat(np.arange(cp_size), counts)
    slot_of = np.arange(rank_of.size) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    works[rank_of, slot_of] = [it.work for items in placed for it in items[:slots]]
    tokens[rank_of, slot_of] = [it.tokens for items in placed for it in items[:slots]]

    def refresh(rank: int) -> None:
        nonlocal works, tokens
        top = placed[rank][:width]
        if len(top) + 1 > works.shape[1]:
            grow = len(top) + 1 - works.shape[1]
            works = np.pad(works, ((0, 0), (0, grow)), constant_values=np.inf)
            tokens = np.pad(tokens, ((0, 0), (0, grow)))
        works[rank] = np.inf
        works[rank, 0] = 0.0
        works[rank, 1:len(top) + 1] = [it.work for it in top]
        tokens[rank, 1:len(top) + 1] = [it.tokens for it in top]

    # numpy copies of ``load`` / ``room``, updated with the same float operations on every move.
    loads, rooms = np.asarray(load, dtype=np.float64), np.asarray(room, dtype=np.int64)
    for _ in range(steps):
        worst = int(np.argmax(loads))  # the first most loaded rank, as max() over the list
        count = min(len(placed[worst]), width)
        if count == 0:
            return
        peak_load = load[worst]
        a_work, a_tokens = works[worst, 1:count + 1, None, None], tokens[worst, 1:count + 1, None, None]  # [i,1,1]
        # [i, r, slot]: item i of the worst rank for item ``slot`` of rank r (slot 0: the move).
        scores = peak_load - a_work + works
        np.maximum(scores, loads[:, None] + a_work - works, out=scores)
        # Candidates that do not fit score infinity (in place, no copies). The first least score is the first best
        # candidate if it lowers the peak; else no candidate does (so the test ``score < peak`` comes last, once).
        unfit = works >= a_work  # a swap needs a lighter item; a padded slot has infinite work: never lighter
        unfit[:, :, 0] = False
        # Room on both sides: -room[worst] <= a_tokens - tokens <= rooms[r], as one unsigned comparison (a value below
        # the lower bound wraps past every upper bound).
        spare = (room[worst] + a_tokens - tokens).view(np.uint64)
        unfit |= spare > (rooms + room[worst]).astype(np.uint64)[:, None]
        unfit[:, worst] = True
        np.putmask(scores, unfit, np.inf)
        flat = int(np.argmin(scores))
        if not scores.flat[flat] < peak_load:
            return
        i, r, slot = np.unravel_index(flat, scores.shape)
        i, r, j = int(i), int(r), None if slot == 0 else int(slot) - 1
        moves = [(worst, r, placed[worst][i])] + ([] if j is None else [(r, worst, placed[r][j])])
        for src, dst, item in moves:
            placed[src].remove(item)
            placed[dst].append(item)
            load[src] -= item.work
            load[dst] += item.work
            room[src] += item.tokens
            room[dst] -= item.tokens
            loads[src] -= item.work
            loads[dst] += item.work
            rooms[src] += item.tokens
            rooms[dst] -= item.tokens
        for r_ in (worst, r):
            placed[r_].sort(key=lambda it: -it.work)
            refresh(r_)


def _spill(item: _Item, doc_start: int, windows: Sequence[int | None], load: list[float], room: list[int],
           placed: list[list[_Item]]) -> None:
    """Cut ``item`` into contiguous parts over the ranks with most room (no rank has room for all of it)."""
    queue = list(item.ranges)
    for rank in sorted(range(len(room)), key=lambda r: -room[r]):
        taken = []
        while queue and room[rank] > sum(b - a for a, b in taken):
            a, b = queue.pop(0)
            cut = min(b, a + room[rank] - sum(e - d for d, e in taken))
            taken.append((a, cut))
            if cut < b:
                queue.insert(0, (cut, b))
        if taken:
            part = _item(item.doc, doc_start, taken, windows)
            placed[rank].append(part)
            load[rank] += part.work
            room[rank] -= part.tokens
        if not queue:
            return
    raise PlanError("balanced placement ran out of room (more real tokens than the row holds)")


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
    raise ValueError(f"placement={kind!r} is not one of {', '.join(PLACEMENTS)}")
