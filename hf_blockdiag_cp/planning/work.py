"""The work model of the placements: causal query-key pairs per document piece and per rank.

A query at in-document offset ``t`` attends ``t + 1`` keys (``min(t + 1, w)`` under a sliding window ``w``); a
rank's work is the sum over its queries, averaged over the model's windows. The balanced placement
(:func:`~hf_blockdiag_cp.planning.placement.balanced_placement`) balances it; :func:`rank_work` measures it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from .documents import arange, run_starts

if TYPE_CHECKING:
    from .placement import Placement

__all__ = ["piece_work", "rank_work", "rank_work_tokens"]


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
        return rank_work_tokens(doc_ids_row, placement, windows)
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


def rank_work_tokens(doc_ids_row: torch.Tensor, placement: Placement, windows: Sequence[int | None] = (None,)
                     ) -> torch.Tensor:
    """:func:`rank_work` token by token (any number of windows)."""
    row = doc_ids_row.to(torch.int64)
    offset = (arange(row.numel()) - run_starts(row)).to(torch.float64)
    per_token = torch.zeros_like(offset)
    for window in windows:
        per_token += offset + 1 if window is None else torch.clamp(offset + 1, max=window)
    per_token = torch.where(row != 0, per_token / len(windows), 0.0)
    return per_token[placement.index].sum(dim=1)
