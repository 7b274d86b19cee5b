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
each bound of :data:`HYBRID_SLOTS` (``hybrid+k``), contiguous, zigzag, mirror (:mod:`.mirror_placement`: zigzag
with free split points, at most two summaries per rank); ties go to the earlier one (balanced first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .balance import Item, improve, make_item, piece_work, spill
from .documents import document_spans
from .layout import BACKWARD_FACTOR, CostModel
from .mirror_placement import mirror_placement
from .placement import Placement, _placement_of_ranges, make_placement, rank_work
from .recurrent_cost import RecurrentShape, recurrent_bytes, summary_slots

__all__ = ["HYBRID_SLOTS", "PlacementChoice", "PlacementCost", "choose_placement", "hybrid_placement",
           "placement_cost"]

#: Senders per rank the hybrid placement's balancing trades may add to what its cuts leave (``None``: no bound):
#: each a candidate. A looser bound balances better and sends more.
HYBRID_SLOTS: tuple[int | None, ...] = (0, 1, 2, None)


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


def _sends(item: Item, spans: list[tuple[int, int]]) -> int:
    """Summaries ``item`` sends: its ranges that a later part of their document follows (not on its heels)."""
    ranges, doc_end = item.ranges, spans[item.doc][1]
    return sum(1 for k, (_, b) in enumerate(ranges) if b < doc_end and (k + 1 == len(ranges) or ranges[k + 1][0] != b))


def _shave(placed: list[list[Item]], load: list[float], room: list[int], spans: list[tuple[int, int]],
           tolerance: float, windows: Sequence[int | None], slots: int | None) -> None:
    """While the most loaded rank exceeds the mean by more than ``tolerance``: move the tail of one of its contiguous
    items (the most work per token) to a less loaded rank, which gives back as many tokens (ranks stay full): whole
    items of least work per token where they shed enough (no new sender), else the head of its longest item (the
    least work per token; one more sender). Only trades that leave no rank above ``slots`` senders are made (a cut
    item's head sends; its tail sends where the item did)."""
    size = len(load)
    mean = sum(load) / size
    sends = [sum(_sends(it, spans) for it in items) for items in placed]
    for _ in range(4 * size):
        worst = max(range(size), key=lambda r: (load[r], -r))
        if load[worst] <= mean * (1 + tolerance):
            return
        ours = sorted((i for i, it in enumerate(placed[worst]) if len(it.ranges) == 1 and it.tokens > 1),
                      key=lambda i: -placed[worst][i].work)
        for target in sorted((r for r in range(size) if r != worst and load[r] < mean), key=lambda r: (load[r], r)):
            shed = min(load[worst] - mean, mean - load[target])
            if any(_trade(placed, load, room, spans, windows, sends, slots, worst, target, i, shed) for i in ours):
                break
        else:
            return


def _trade(placed: list[list[Item]], load: list[float], room: list[int], spans: list[tuple[int, int]],
           windows: Sequence[int | None], sends: list[int], slots: int | None, worst: int, target: int, i: int,
           shed: float) -> bool:
    """Trade the tail of item ``i`` of ``worst`` with ``target`` within the ``slots`` bound (see :func:`_shave`);
    whether a trade was made."""
    item = placed[worst][i]
    (a, b), start = item.ranges[0], spans[item.doc][0]
    sent = _sends(item, spans)
    cut_worst, cut_target = sends[worst] + 1 - sent, sends[target] + sent  # after the cut, before what comes back
    bound = max(cut_target, cut_worst + 1) if slots is None else slots
    if cut_target > bound or cut_worst > bound:
        return False

    def tail(t: int) -> float:
        return piece_work(b - t - start, b - start, windows)

    trade = _whole_trade(placed[target], room[target], b - a - 1, tail, shed)
    if trade is not None:
        t, back = trade
        _move(placed, load, room, worst, target, i, b - t, start, windows, whole=back)
    else:
        theirs = [k for k, it in enumerate(placed[target]) if len(it.ranges) == 1 and it.tokens > 1]
        j = max(theirs, key=lambda k: placed[target][k].tokens) if theirs else None
        c, start2 = (placed[target][j].ranges[0][0], spans[placed[target][j].doc][0]) if j is not None else (0, 0)
        limit = room[target] + (placed[target][j].tokens - 1 if j is not None and cut_worst < bound else 0)

        def net(t: int) -> float:  # work the loaded rank sheds trading a tail of t tokens for a head
            back = max(t - room[target], 0)
            return tail(t) - (piece_work(c - start2, c + back - start2, windows) if back else 0.0)

        lo, hi = 0, min(b - a - 1, limit)
        while lo < hi:  # the longest tail whose net shed stays within ``shed`` (net grows with t)
            mid = (lo + hi + 1) // 2
            if net(mid) <= shed:
                lo = mid
            else:
                hi = mid - 1
        if lo == 0 or net(lo) < shed / 4:
            return False
        back_tokens = max(lo - room[target], 0)
        _move(placed, load, room, worst, target, i, b - lo, start, windows,
              head=(j, c + back_tokens, start2) if back_tokens else None)
    for r in (worst, target):
        sends[r] = sum(_sends(it, spans) for it in placed[r])
    return True


def _whole_trade(items: list[Item], room: int, most: int, tail: Callable[[int], float], shed: float
                 ) -> tuple[int, list[int]] | None:
    """``(tail tokens, indices of whole items given back)``: the lightest-per-token whole items of the receiving rank
    whose trade sheds the most work within ``shed``, if that is at least half of it; else ``None``."""
    order = sorted(range(len(items)), key=lambda k: (items[k].work / items[k].tokens, k))
    best, tokens, work, taken = None, room, 0.0, []
    for k in [None, *order]:
        if k is not None:
            tokens, work = tokens + items[k].tokens, work + items[k].work
            taken = [*taken, k]
        if tokens > most:
            break
        net = tail(tokens) - work if tokens else 0.0
        if net <= shed and (best is None or net > best[0]):
            best = (net, tokens, taken)
    if best is None or best[1] == 0 or best[0] < shed / 2:
        return None
    return best[1], best[2]


def _move(placed: list[list[Item]], load: list[float], room: list[int], worst: int, target: int, index: int,
          cut: int, doc_start: int, windows: Sequence[int | None], *, whole: Sequence[int] = (),
          head: tuple[int, int, int] | None = None) -> None:
    """Item ``index`` of rank ``worst`` keeps ``[a, cut)``; ``[cut, b)`` goes to ``target``, which gives back the
    items ``whole`` and, with ``head = (index, cut, doc start)``, the head of that item before its cut."""

    def put(rank: int, item: Item, at: int | None = None) -> None:
        if at is None:
            placed[rank].append(item)
        else:
            placed[rank][at] = item
        load[rank] += item.work
        room[rank] -= item.tokens

    def take(rank: int, at: int) -> Item:
        item = placed[rank][at]
        load[rank] -= item.work
        room[rank] += item.tokens
        return item

    item = take(worst, index)
    (a, b), doc = item.ranges[0], item.doc
    given = [take(target, k) for k in whole]
    for k in sorted(whole, reverse=True):
        del placed[target][k]
    if head is not None:
        theirs = take(target, head[0])
        (c, d), their_doc = theirs.ranges[0], theirs.doc
        put(target, make_item(their_doc, head[2], [(head[1], d)], windows), head[0])
        given.append(make_item(their_doc, head[2], [(c, head[1])], windows))
    put(worst, make_item(doc, doc_start, [(a, cut)], windows), index)
    put(target, make_item(doc, doc_start, [(cut, b)], windows))
    for it in given:
        put(worst, it)


def hybrid_placement(doc_ids_row: torch.Tensor, cp_size: int, *, extra_slots: int | None = None,
                     tolerance: float = 0.05,
                     piece: float = 1.0,
                     windows: Sequence[int | None] = (None,)) -> Placement:
    """Balance causal work over ranks with documents cut into as few contiguous pieces as the balance allows.

    Documents of at most ``L`` tokens and ``piece`` times the mean work per rank stay whole; every other one is cut
    into contiguous pieces of at most ``L`` tokens and that work. Items go heaviest first to the least loaded rank
    with room (an item that fits none is cut over the ranks with most room), then the balanced placement's local
    search moves or swaps whole items, and while the most loaded rank exceeds the mean by more than ``tolerance``
    the tail of one of its pieces is traded for light tokens of a less loaded rank while no rank sends more than
    ``extra_slots`` more summaries than the cuts left (:func:`_shave`). Each piece sends at most one summary per
    recurrent layer; the balanced placement's head-tail pairs send two.

    Args:
        doc_ids_row: ``[S]`` document ids of the full row (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        extra_slots: the most senders the balancing trades may add to the most any rank has after the cuts
            (``None``: no bound).
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
    senders = max(sum(_sends(it, spans) for it in its) for its in placed)
    _shave(placed, load, room, spans, tolerance, windows, senders + extra_slots if extra_slots is not None else None)
    made = _placement_of_ranges([[r for item in its for r in item.ranges] for its in placed], room, spans, full_len)
    return Placement.from_runs("hybrid", made.runs, cp_size, local_len)


@dataclass(frozen=True)
class PlacementCost:
    """One candidate placement's modelled cost for a hybrid step.

    Attributes:
        name: the candidate (``balanced``, ``hybrid+1``, ``contiguous``, ...).
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
    ``tolerance``), hybrid at each bound of :data:`HYBRID_SLOTS`, contiguous, zigzag (when ``S`` is divisible by
    ``2P``), mirror, by :func:`placement_cost`; ties go to the earlier candidate. The same inputs give the same
    choice on every rank."""
    row = doc_ids_row.to(torch.int64).flatten()
    candidates: list[tuple[str, Placement]] = [
        ("balanced", make_placement(row, cp_size, "balanced", tolerance=tolerance, windows=windows))]
    candidates += [(f"hybrid+{'any' if n is None else n}",
                    hybrid_placement(row, cp_size, extra_slots=n, tolerance=tolerance, windows=windows))
                   for n in HYBRID_SLOTS]
    candidates.append(("contiguous", make_placement(row, cp_size, "contiguous")))
    if row.numel() % (2 * cp_size) == 0:
        candidates.append(("zigzag", make_placement(row, cp_size, "zigzag")))
    candidates.append(("mirror", mirror_placement(row, cp_size, windows=windows)))
    table = tuple(placement_cost(name, row, placement, shape, windows=windows, model=model)
                  for name, placement in candidates)
    best = min(range(len(table)), key=lambda i: (table[i].cost_s, i))
    return PlacementChoice(placement=candidates[best][1], cost=table[best], table=table)
