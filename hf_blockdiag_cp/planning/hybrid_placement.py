"""The placement of a hybrid model's step: attention balance weighed against recurrent state traffic (host, per step).

The balanced placement cuts heavy documents head-tail over several ranks: attention balances, but every piece that
a later one follows sends a state summary in every recurrent layer (``slots`` up to 14 at 128K tokens on 8 ranks,
docs/layouts.md). :func:`hybrid_placement` balances attention with documents cut into *contiguous* pieces instead
(one sender per piece, pieces of one document on one rank merge back into one fragment), and
:func:`choose_placement` picks, per step, the candidate of least modelled step time::

    cost = A * 3.5 * 2 (D + Dv) Hq * W_max / C  +  2 * R * (P - 1) * slots * W * 4 / (C / F)

``A`` attention layers, ``W_max`` the most loaded rank's causal pairs (:func:`~.placement.rank_work`), ``R``
recurrent layers of summary width ``W`` (:mod:`.recurrent_cost`); ``C`` and ``F`` are the layout cost model's
(:mod:`.layout`: 400 TFLOP/s, ``BlockDiagCPConfig.layout_flops_per_byte``); 3.5 = forward plus a 2.5x backward,
2 = the summaries' forward all-gather plus their gradients' reduce-scatter. The candidates: balanced, hybrid at
three piece sizes, contiguous, zigzag; ties go to the earlier one (balanced first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .balance import Item, improve, make_item, piece_work, spill
from .documents import document_spans
from .layout import BACKWARD_FACTOR, CostModel
from .placement import Placement, _placement_of_ranges, make_placement, rank_work
from .recurrent_cost import RecurrentShape, recurrent_bytes, summary_slots

__all__ = ["HYBRID_PIECES", "PlacementChoice", "PlacementCost", "choose_placement", "hybrid_placement",
           "placement_cost"]

#: Work of the largest piece a hybrid placement cuts, as fractions of the mean work per rank: each a candidate.
#: A piece of the mean's work fills one rank (one sender); smaller pieces balance better and send more.
HYBRID_PIECES: tuple[float, ...] = (1.0, 0.5, 0.25)


def _cut(doc: int, start: int, length: int, cap: float, local_len: int, windows: Sequence[int | None]
         ) -> list[Item]:
    """Document ``doc`` (row positions ``[start, start + length)``) in contiguous pieces, each as long as
    ``local_len`` tokens and ``cap`` work allow (at least one token)."""
    items, a = [], 0
    while a < length:
        lo, hi = a + 1, min(a + local_len, length)
        while lo < hi:  # the longest end b with piece_work(a, b) <= cap (work grows with b)
            mid = (lo + hi + 1) // 2
            if piece_work(a, mid, windows) <= cap:
                lo = mid
            else:
                hi = mid - 1
        items.append(make_item(doc, start, [(start + a, start + lo)], windows))
        a = lo
    return items


def _shave(placed: list[list[Item]], load: list[float], room: list[int], spans: list[tuple[int, int]],
           tolerance: float, windows: Sequence[int | None]) -> None:
    """While the most loaded rank exceeds the mean by more than ``tolerance``: trade the tail of its heaviest
    contiguous item for as many tokens of the head of the least loaded rank's longest item (ranks stay full: a tail
    holds the most work per token, a head the least). Each trade adds two senders on the loaded rank at most."""
    size = len(load)
    mean = sum(load) / size
    for _ in range(2 * size):
        worst = max(range(size), key=lambda r: (load[r], -r))
        target = min(range(size), key=lambda r: (load[r], r))
        if load[worst] <= mean * (1 + tolerance) or target == worst:
            return
        shed = min(load[worst] - mean, mean - load[target])
        ours = [i for i, it in enumerate(placed[worst]) if len(it.ranges) == 1 and it.tokens > 1]
        theirs = [i for i, it in enumerate(placed[target]) if len(it.ranges) == 1 and it.tokens > 1]
        if not ours:
            return
        i = max(ours, key=lambda k: placed[worst][k].work)
        j = max(theirs, key=lambda k: placed[target][k].tokens) if theirs else None
        (a, b), start = placed[worst][i].ranges[0], spans[placed[worst][i].doc][0]
        limit = room[target] + (placed[target][j].tokens - 1 if j is not None else 0)
        c2, d2, start2 = (*placed[target][j].ranges[0], spans[placed[target][j].doc][0]) if j is not None else (0,) * 3

        def net(t: int) -> float:  # work the loaded rank sheds trading a tail of t tokens
            back = max(t - room[target], 0)
            return (piece_work(b - t - start, b - start, windows)
                    - piece_work(c2 - start2, c2 + back - start2, windows) if back else
                    piece_work(b - t - start, b - start, windows))

        lo, hi = 0, min(b - a - 1, limit)
        while lo < hi:  # the longest tail whose net shed stays within ``shed`` (net grows with t)
            mid = (lo + hi + 1) // 2
            if net(mid) <= shed:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0:
            return
        back = max(lo - room[target], 0)
        _trade(placed, load, room, (worst, i, b - lo, start), (target, j, c2 + back, start2) if back else None,
               windows)


def _trade(placed: list[list[Item]], load: list[float], room: list[int], out: tuple[int, int, int, int],
           back: tuple[int, int, int, int] | None, windows: Sequence[int | None]) -> None:
    """Move the tail from ``cut`` of item ``out = (rank, index, cut, doc start)`` to the rank of ``back``'s
    ``(rank, index, cut, doc start)`` (or the least loaded one), and the head before ``back``'s cut the other way."""

    def split(rank: int, index: int, cut: int, doc_start: int) -> tuple[Item, Item]:
        item = placed[rank][index]
        (a, b), doc = item.ranges[0], item.doc
        load[rank] -= item.work
        room[rank] += item.tokens
        return make_item(doc, doc_start, [(a, cut)], windows), make_item(doc, doc_start, [(cut, b)], windows)

    def put(rank: int, index: int | None, item: Item) -> None:
        if index is None:
            placed[rank].append(item)
        else:
            placed[rank][index] = item
        load[rank] += item.work
        room[rank] -= item.tokens

    worst = out[0]
    target = back[0] if back is not None else min(range(len(load)), key=lambda r: (load[r], r))
    head, tail = split(*out)
    if back is not None:
        their_head, their_tail = split(*back)
        put(target, back[1], their_tail)
        put(worst, None, their_head)
    put(worst, out[1], head)
    put(target, None, tail)


def hybrid_placement(doc_ids_row: torch.Tensor, cp_size: int, *, piece: float = 1.0, tolerance: float = 0.05,
                     windows: Sequence[int | None] = (None,)) -> Placement:
    """Balance causal work over ranks with documents cut into as few contiguous pieces as the balance allows.

    Documents of at most ``L`` tokens and ``piece`` times the mean work per rank stay whole; every other one is cut
    into contiguous pieces of at most ``L`` tokens and that work. Items go heaviest first to the least loaded rank
    with room (an item that fits none is cut over the ranks with most room), then the balanced placement's local
    search moves or swaps whole items, and while the most loaded rank exceeds the mean by more than ``tolerance``
    the tail of its heaviest piece is traded for light head tokens of the least loaded rank (:func:`_shave`). Each
    piece sends at most one summary per recurrent layer; the balanced placement's head-tail pairs send two.

    Args:
        doc_ids_row: ``[S]`` document ids of the full row (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        piece: the most work of one piece, as a fraction of the mean work per rank (> 0).
        tolerance: accepted excess of the most loaded rank's work over the mean (>= 0).
        windows: the model's attention windows (``None`` = full causal) for the work model.
    """
    if not piece > 0:
        raise ValueError(f"piece={piece!r} must be > 0")
    row = doc_ids_row.to(torch.int64).flatten()
    full_len = row.numel()
    local_len = full_len // cp_size
    spans = document_spans(row)
    works = [piece_work(0, end - start, windows) for start, end in spans]
    cap = max(piece * sum(works) / cp_size, 1.0)
    items: list[Item] = []
    for doc, ((start, end), work) in enumerate(zip(spans, works)):
        if end - start <= local_len and work <= cap:
            items.append(make_item(doc, start, [(start, end)], windows))
        else:
            items.extend(_cut(doc, start, end - start, cap, local_len, windows))
    items.sort(key=lambda it: (-it.work, -it.tokens, it.ranges[0][0]))  # heaviest first, ties in row order
    load, room = [0.0] * cp_size, [local_len] * cp_size
    placed: list[list[Item]] = [[] for _ in range(cp_size)]
    for item in items:
        fits = [r for r in range(cp_size) if room[r] >= item.tokens]
        if not fits:
            spill(item, spans[item.doc][0], windows, load, room, placed)
            continue
        rank = min(fits, key=lambda r: (load[r], -room[r], r))
        placed[rank].append(item)
        load[rank] += item.work
        room[rank] -= item.tokens
    for items_of_rank in placed:  # the local search looks at each rank's heaviest items first
        items_of_rank.sort(key=lambda it: -it.work)
    improve(placed, load, room)
    _shave(placed, load, room, spans, tolerance, windows)
    made = _placement_of_ranges([[r for item in its for r in item.ranges] for its in placed], room, spans, full_len)
    return Placement.from_runs("hybrid", made.runs, cp_size, local_len)


@dataclass(frozen=True)
class PlacementCost:
    """One candidate placement's modelled cost for a hybrid step.

    Attributes:
        name: the candidate (``balanced``, ``hybrid@0.5``, ``contiguous``, ...).
        imbalance: max / mean causal pairs over ranks.
        slots: summaries each rank sends per recurrent layer.
        recurrent_bytes: bytes per recurrent layer per rank, forward (``(P - 1) * slots * W * 4``).
        attention_s / recurrent_s: modelled seconds of the slowest rank's attention and of the summaries' exchange
            (forward and backward, all layers); ``cost_s`` their sum.
    """

    name: str
    imbalance: float
    slots: int
    recurrent_bytes: int
    attention_s: float
    recurrent_s: float

    @property
    def cost_s(self) -> float:
        return self.attention_s + self.recurrent_s


def placement_cost(name: str, doc_ids_row: torch.Tensor, placement: Placement, shape: RecurrentShape, *,
                   windows: Sequence[int | None] = (None,), model: CostModel | None = None) -> PlacementCost:
    """The :class:`PlacementCost` of ``placement`` for a model of ``shape`` (module docstring's formula)."""
    model = model or CostModel()
    work = rank_work(doc_ids_row, placement, windows)
    mean = float(work.mean())
    peak = float(work.max())
    slots = summary_slots(doc_ids_row, placement)
    per_layer = recurrent_bytes(shape, placement.cp_size, slots)
    flops = (1 + BACKWARD_FACTOR) * 2 * (shape.head_dim + shape.value_dim) * shape.q_heads * peak
    return PlacementCost(name=name, imbalance=peak / mean if mean else 1.0, slots=slots, recurrent_bytes=per_layer,
                         attention_s=shape.attention_layers * flops / model.compute_flops,
                         recurrent_s=2 * shape.layers * per_layer * model.flops_per_byte / model.compute_flops)


@dataclass(frozen=True)
class PlacementChoice:
    """The step's chosen placement and every candidate's cost (``table``, in evaluation order)."""

    placement: Placement
    cost: PlacementCost
    table: tuple[PlacementCost, ...]

    def reason(self) -> str:
        """One line for logs: the choice and why (every candidate's modelled cost)."""
        rows = ", ".join(f"{c.name}: {c.cost_s * 1e3:.4g} ms (imbalance {c.imbalance:.3f}, {c.slots} slots, "
                         f"{c.recurrent_bytes / 2 ** 20:.1f} MiB/layer)" for c in self.table)
        return f"placement -> {self.cost.name}: least attention + recurrent state time [{rows}]"


def choose_placement(doc_ids_row: torch.Tensor, cp_size: int, shape: RecurrentShape, *, tolerance: float = 0.05,
                     windows: Sequence[int | None] = (None,), model: CostModel | None = None) -> PlacementChoice:
    """The cheapest placement of the row ``doc_ids_row [S]`` for a hybrid model of ``shape``: balanced (at
    ``tolerance``), hybrid at each of :data:`HYBRID_PIECES`, contiguous, zigzag (when ``S`` is divisible by ``2P``),
    by :func:`placement_cost`; ties go to the earlier candidate. The same inputs give the same choice on every rank."""
    row = doc_ids_row.to(torch.int64).flatten()
    candidates: list[tuple[str, Placement]] = [
        ("balanced", make_placement(row, cp_size, "balanced", tolerance=tolerance, windows=windows))]
    candidates += [(f"hybrid@{p:g}", hybrid_placement(row, cp_size, piece=p, tolerance=tolerance,
                                                                windows=windows)) for p in HYBRID_PIECES]
    candidates.append(("contiguous", make_placement(row, cp_size, "contiguous")))
    if row.numel() % (2 * cp_size) == 0:
        candidates.append(("zigzag", make_placement(row, cp_size, "zigzag")))
    table = tuple(placement_cost(name, row, placement, shape, windows=windows, model=model)
                  for name, placement in candidates)
    best = min(range(len(table)), key=lambda i: (table[i].cost_s, i))
    return PlacementChoice(placement=candidates[best][1], cost=table[best], table=table)
