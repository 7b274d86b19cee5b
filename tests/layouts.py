"""Small helpers shared by tests that build packed rows or put CP shards back together."""

from __future__ import annotations

import torch


def runs(*pairs: tuple[int, int]) -> list[int]:
    """Doc ids from ``(doc_id, length)`` pairs."""
    return [d for d, n in pairs for _ in range(n)]


def unshard(rank_batches: list[dict], key: str) -> torch.Tensor:
    """The ``[S]`` full row of ``key`` from every rank's ``[1, L]`` batch, each placed at its context's
    ``local_index`` (fails if some position is held by no rank)."""
    full_len = sum(b[key].shape[1] for b in rank_batches)
    out = torch.full((full_len,), -12345, dtype=torch.int64)
    for b in rank_batches:
        out[b["cp_context"].local_index] = b[key][0]
    assert (out != -12345).all(), "some position of the row is held by no rank"
    return out
