"""Token-based references for the run-based planners (what they computed before issue 25, kept for the tests).

Each function here does per-token work over the whole row for every rank: slow at scale, simple to read. The
property tests in ``test_run_plans.py`` require the package's planners to produce the same plans bit for bit.
"""

from __future__ import annotations

import torch

from hf_blockdiag_cp.planning.exchange import needed_positions
from hf_blockdiag_cp.planning.placement import Placement


def reference_exchange(row: torch.Tensor, placement: Placement, window: int | None):
    """``(recv, counts, halo_valid)``: ``recv[d][s]`` the sorted global positions rank ``d`` needs from rank
    ``s``, found token by token (every rank's queries expanded, every needed key listed)."""
    cp_size, local_len = placement.cp_size, placement.local_len
    owner, local_row = placement.owner()
    recv: list[list[torch.Tensor]] = []
    for dst in range(cp_size):
        need = needed_positions(row, placement.index[dst], window)
        remote = need[owner[need] != dst]
        recv.append([remote[owner[remote] == src] for src in range(cp_size)])
    counts = [[int(recv[d][s].numel()) for s in range(cp_size)] for d in range(cp_size)]
    halo_valid = all(
        not counts[d][s] or (s == d - 1 and torch.equal(local_row[recv[d][s]],
                                                        torch.arange(local_len - counts[d][s], local_len)))
        for d in range(cp_size) for s in range(cp_size))
    return recv, counts, halo_valid


def reference_transfer(recv, placement: Placement, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(send_index, buffer_positions)`` of ``rank`` under halo / a2a, from :func:`reference_exchange`'s ``recv``."""
    _, local_row = placement.owner()
    sent = [recv[dst][rank] for dst in range(placement.cp_size)]
    return local_row[torch.cat(sent)], torch.cat([torch.cat(recv[rank]), placement.index[rank]])


def reference_shard_checksum(values: torch.Tensor) -> int:
    """The checksum of :func:`~hf_blockdiag_cp.planning.fingerprint.shard_checksum` in Python ints, token by token."""
    total = 0
    for i, v in enumerate(values.reshape(-1).tolist()):
        total += (v + 1) * (((i * 2654435761) & 0xFFFFFFFF) + 1)
    return (total * 1000003 + values.numel()) % (1 << 64) & ((1 << 62) - 1)


def _reference_assign(spans, parts, cp_size, local_len, windows, cache=None):
    """The balanced placement's item assignment before issue 25: a scan over every rank per item."""
    from hf_blockdiag_cp.planning.placement import _head_tail_items, _item, _spill

    items = []
    for doc, (start, end) in enumerate(spans):
        if parts[doc] == 1:
            items.append(_item(doc, start, [(start, end)], windows))
        else:
            items.extend(_head_tail_items(doc, start, end - start, parts[doc], windows))
    items.sort(key=lambda it: (-it.work, -it.tokens))
    load = [0.0] * cp_size
    room = [local_len] * cp_size
    placed = [[] for _ in range(cp_size)]
    docs_on = [set() for _ in range(cp_size)]
    spilled = []
    for item in items:
        lightest = min(range(cp_size), key=lambda r: (load[r], -room[r]))
        if room[lightest] >= item.tokens and item.doc not in docs_on[lightest]:
            rank = lightest
        else:
            fits = [r for r in range(cp_size) if room[r] >= item.tokens]
            if not fits:
                _spill(item, spans[item.doc][0], windows, load, room, placed)
                spilled.append(item.doc)
                continue
            apart = [r for r in fits if item.doc not in docs_on[r]] or fits
            rank = min(apart, key=lambda r: (load[r], -room[r]))
        placed[rank].append(item)
        docs_on[rank].add(item.doc)
        load[rank] += item.work
        room[rank] -= item.tokens
    return placed, load, room, spilled


def _reference_improve(placed: list[list], load: list[float], room: list[int], *, steps: int = 8,
                       width: int = 16) -> None:
    """Local search: move a whole item off the most loaded rank, or swap it for a lighter one, while
    that lowers the pair's maximum (only whole items move: no new split, no new K/V traffic beyond
    where the pieces already were). Looks at the ``width`` heaviest items of each rank. (Before issue 25: a loop
    over every candidate.)"""
    ranks = range(len(load))
    for _ in range(steps):
        worst = max(ranks, key=lambda r: load[r])
        best = None
        for i, a in enumerate(placed[worst][:width]):
            for r in ranks:
                if r == worst:
                    continue
                if room[r] >= a.tokens:
                    peak = max(load[worst] - a.work, load[r] + a.work)
                    if peak < load[worst] and (best is None or peak < best[0]):
                        best = (peak, i, r, None)
                for j, b in enumerate(placed[r][:width]):
                    if b.work < a.work and room[r] + b.tokens >= a.tokens and room[worst] + a.tokens >= b.tokens:
                        peak = max(load[worst] - a.work + b.work, load[r] + a.work - b.work)
                        if peak < load[worst] and (best is None or peak < best[0]):
                            best = (peak, i, r, j)
        if best is None:
            return
        _, i, r, j = best
        moves = [(worst, r, placed[worst][i])] + ([] if j is None else [(r, worst, placed[r][j])])
        for src, dst, item in moves:
            placed[src].remove(item)
            placed[dst].append(item)
            load[src] -= item.work
            load[dst] += item.work
            room[src] += item.tokens
            room[dst] -= item.tokens
        for r_ in (worst, r):
            placed[r_].sort(key=lambda it: -it.work)


def reference_balanced_placement(row: torch.Tensor, cp_size: int, **kwargs) -> Placement:
    """:func:`~hf_blockdiag_cp.planning.placement.balanced_placement` with the loops over every rank."""
    from unittest import mock

    from hf_blockdiag_cp.planning import placement as module

    with mock.patch.object(module, "_assign", _reference_assign), mock.patch.object(module, "_improve",
                                                                                   _reference_improve):
        return module.balanced_placement(row, cp_size, **kwargs)
