"""The balanced placement's assignment: which rank holds each document, or each piece of a split one.

Items (a whole document, a head-tail pair of its chunks, or a contiguous part of one that fit no rank) are
placed heaviest first on the least loaded rank with room (:func:`assign`), then improved by a local search
that moves or swaps whole items (:func:`improve`). The rounds, and the placement made of their result, are
:func:`~hf_blockdiag_cp.planning.placement.balanced_placement`'s.

Work model: a query at in-document offset ``t`` attends ``t + 1`` keys (``min(t + 1, w)`` under a sliding window
``w``); the work of an item is the sum over its queries, averaged over the model's windows (:func:`piece_work`;
a placement's work per rank is :func:`~hf_blockdiag_cp.planning.placement.rank_work`).
"""

from __future__ import annotations

import bisect
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .varlen import PlanError

__all__ = ["Item", "assign", "cheapest_split", "head_tail_items", "improve", "make_item", "piece_work", "spill"]


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


@dataclass
class Item:
    """Positions placed together on one rank: a whole document, a head-tail pair of its chunks, or
    (when no rank had room for a piece) a contiguous part of one."""

    work: float
    tokens: int
    ranges: list[tuple[int, int]]
    doc: int


def make_item(doc: int, doc_start: int, ranges: list[tuple[int, int]], windows: Sequence[int | None]) -> Item:
    """The item of document ``doc`` (starting at row position ``doc_start``) holding ``ranges`` of the row."""
    if len(ranges) == 1:  # a whole document: the common case
        a, b = ranges[0]
        return Item(piece_work(a - doc_start, b - doc_start, windows), b - a, ranges, doc)
    ranges = [(a, b) for a, b in ranges if b > a]
    work = sum(piece_work(a - doc_start, b - doc_start, windows) for a, b in ranges)
    return Item(work, sum(b - a for a, b in ranges), ranges, doc)


def head_tail_items(doc: int, start: int, length: int, parts: int,
                    windows: Sequence[int | None]) -> list[Item]:
    """Split a document into ``2 * parts`` chunks; item ``j`` holds chunks ``j`` and ``2*parts-1-j``,
    so every item has (nearly) the same tokens and the same causal work."""
    bounds = [start + (length * i) // (2 * parts) for i in range(2 * parts + 1)]
    return [make_item(doc, start, [(bounds[j], bounds[j + 1]), (bounds[2 * parts - 1 - j], bounds[2 * parts - j])],
                      windows) for j in range(parts)]


def cheapest_split(docs: list[int], excess: float, spans: list[tuple[int, int]], parts: list[int],
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


#: An entry of a shelf: ``(load, -room, rank)`` of a rank with room.
_Entry = tuple[float, int, int]


def assign(spans: list[tuple[int, int]], parts: list[int], cp_size: int, local_len: int,
           windows: Sequence[int | None], cache: dict[Any, Any] | None = None
           ) -> tuple[list[list[Item]], list[float], list[int], list[int]]:
    """One placement round: ``(items per rank heaviest first, work per rank, room left per rank,
    documents cut because their piece fit no rank)``."""
    cache = {} if cache is None else cache  # (doc, parts) -> its items: rounds change few documents' parts
    keyed = _sorted_items(spans, parts, windows, cache)
    load = [0.0] * cp_size
    room = [local_len] * cp_size
    placed: list[list[Item]] = [[] for _ in range(cp_size)]
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
    shelves: list[list[_Entry]] = [[] for _ in range(local_len.bit_length() + 1)]
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
        best = home = None
        multi = parts[doc] > 1  # a whole document is one item: no other item of it to keep apart
        holding = ranks_of.get(doc, ()) if multi else ()
        if neg_tokens == 0:  # fits a full rank too (not on a shelf): look at every rank
            fits = [r for r in range(cp_size) if r not in holding] or list(range(cp_size))
            rank = min(fits, key=lambda r: (load[r], -room[r]))
        else:
            best, home = _first_fit(shelves, top, neg_tokens, holding)
            rank = None if best is None else best[2]
        if rank is None:
            spill(item, spans[doc][0], windows, load, room, placed)
            spilled.append(doc)
            shelves = _restocked(len(shelves), load, room, alive[i + 1])
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


def _sorted_items(spans: list[tuple[int, int]], parts: list[int], windows: Sequence[int | None],
                  cache: dict[Any, Any]) -> list[tuple[float, int, int, int, Item]]:
    """The round's items keyed ``(-work, -tokens, doc, j)``, sorted: heaviest first, ties in document order."""

    def items_of(doc: int) -> list[tuple[float, int, int, int, Item]]:
        made = cache.get((doc, parts[doc]))
        if made is None:
            start, end = spans[doc]
            made = cache[doc, parts[doc]] = ([make_item(doc, start, [(start, end)], windows)] if parts[doc] == 1 else
                                             head_tail_items(doc, start, end - start, parts[doc], windows))
            made[:] = [(-it.work, -it.tokens, doc, j, it) for j, it in enumerate(made)]
        return made

    # Heaviest first, ties in document order (a stable sort by (-work, -tokens)): the cached tuples sort in C. Their
    # keys (-work, -tokens, doc, j) are distinct, so the sorted list is unique: the previous round's (kept in the
    # cache under ``None`` with its parts) is updated by taking out and putting in the items of the documents whose
    # parts changed, instead of sorting every item again.
    previous = cache.get(None)
    if previous is None:
        keyed: list[tuple[float, int, int, int, Item]] = []
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
    return keyed


def _first_fit(shelves: list[list[_Entry]], top: int, neg_tokens: int, holding: set[int] | tuple[()]
               ) -> tuple[_Entry | None, list[_Entry] | None]:
    """``(entry, its shelf)`` of the first rank in (load, -room, rank) order with room for ``-neg_tokens > 0``
    tokens, a rank not in ``holding`` if one has room; ``(None, None)`` when no rank on the shelves has room."""
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
    if best is not None and home is None:
        home = shelves[(-best[1]).bit_length()]
    return best, home


def _restocked(count: int, load: list[float], room: list[int], least: int) -> list[list[_Entry]]:
    """``count`` shelves holding every rank with room for ``least`` tokens (after a spill changed many rooms)."""
    shelves: list[list[_Entry]] = [[] for _ in range(count)]
    for r in range(len(room)):
        if 0 < room[r] >= least:
            shelves[room[r].bit_length()].append((load[r], -room[r], r))
    for shelf in shelves:
        shelf.sort()
    return shelves


def improve(placed: list[list[Item]], load: list[float], room: list[int], *, steps: int = 8,
            width: int = 16) -> None:
    """Local search: move a whole item off the most loaded rank, or swap it for a lighter one, while
    that lowers the pair's maximum (only whole items move: no new split, no new K/V traffic beyond
    where the pieces already were). Looks at the ``width`` heaviest items of each rank.

    Every candidate of a step (item ``i`` of the most loaded rank, rank ``r``, a move or a swap with item ``j``)
    is scored in one vectorised pass; the first best in ``(i, r, move, j)`` order wins, as in a loop over them.

    Slot 0 of every rank is an empty item (no work, no tokens): swapping with it is the move, scored by the same
    float operations (``x + 0.0`` and ``x - 0.0`` are ``x``), so one pass scores moves and swaps together."""
    works, tokens = _item_table(placed, width)

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


def _item_table(placed: list[list[Item]], width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(works [P, 1 + slots] float64, tokens [P, 1 + slots] int64)`` of the ``width`` heaviest items of each rank,
    slot 0 the empty item."""
    cp_size = len(placed)
    # The table has as many slots as the fullest rank has items (up to ``width``), after the empty slot 0: slots
    # past a rank's items hold infinite work (never a candidate), so narrower tables score the same candidates;
    # ``improve`` widens it.
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
    return works, tokens


def spill(item: Item, doc_start: int, windows: Sequence[int | None], load: list[float], room: list[int],
          placed: list[list[Item]]) -> None:
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
            part = make_item(item.doc, doc_start, taken, windows)
            placed[rank].append(part)
            load[rank] += part.work
            room[rank] -= part.tokens
        if not queue:
            return
    raise PlanError("balanced placement ran out of room (more real tokens than the row holds)")
