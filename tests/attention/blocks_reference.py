"""The float64 dense reference of bidirectional blocks ("causal, or same block") and random rows of documents with
blocks, shared by the attention, planning and distributed tests of bidirectional blocks."""

from __future__ import annotations

import torch


def key_bounds(doc_ids: torch.Tensor, block_ids: torch.Tensor, window: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of one row ``[S]``: ``(lo, hi)``, the first and last key it sees (written position by position,
    independently of the planner): ``hi`` = itself, or its block's last position; ``lo`` = its document's start, or
    ``hi``'s window bound ``t - window + 1`` when later."""
    n = doc_ids.numel()
    lo, hi = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    for t in range(n):
        s = t
        while s > 0 and doc_ids[s - 1] == doc_ids[t]:
            s -= 1
        e = t
        if block_ids[t] > 0:
            while e + 1 < n and block_ids[e + 1] == block_ids[t]:
                e += 1
        lo[t] = s if window is None else max(s, t - window + 1)
        hi[t] = e
    return lo, hi


def staircase_mask(doc_ids: torch.Tensor, block_ids: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """``[S, S]`` bool: query ``t`` sees key ``k`` iff real, same document and ``lo(t) <= k <= hi(t)``."""
    lo, hi = key_bounds(doc_ids, block_ids, window)
    k = torch.arange(doc_ids.numel())
    same = (doc_ids[:, None] == doc_ids[None, :]) & (doc_ids[:, None] > 0)
    return same & (k[None, :] >= lo[:, None]) & (k[None, :] <= hi[:, None])


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``q [B, Hq, S, D]``, ``k, v [B, Hkv, S, D]`` in float64 under ``mask [S, S]`` (rows seeing nothing: 0)."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return probs @ v


def random_row(length: int, seed: int, *, padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(doc_ids [S], block_ids [S])``: random documents (lengths 1..) each with 0-2 blocks, ``padding`` zeros at
    the end; block ids unique over the row."""
    g = torch.Generator().manual_seed(seed)
    real = length - padding
    doc, blk, pos, d, b = [], [], 0, 0, 0
    while pos < real:
        n = min(real - pos, int(torch.randint(1, max(2, real // 2), (1,), generator=g)))
        d += 1
        ids = [0] * n
        for _ in range(int(torch.randint(0, 3, (1,), generator=g))):
            a = int(torch.randint(0, n, (1,), generator=g))
            e = min(n, a + int(torch.randint(1, 7, (1,), generator=g)))
            if all(x == 0 for x in ids[max(0, a - 1):min(n, e + 1)]):  # keep blocks apart (one run = one block)
                b += 1
                ids[a:e] = [b] * (e - a)
        doc += [d] * n
        blk += ids
        pos += n
    return torch.tensor(doc + [0] * padding), torch.tensor(blk + [0] * padding)
