"""Attention of each query over the keys its indexer selected, exact on any device (gather + softmax).

Legend: ``N = B * L`` flat query rows, ``M = B * S`` flat key rows, ``K`` selected keys per query, ``Hq`` query
heads, ``Hkv`` key/value heads (``Hq`` a multiple), ``D`` / ``Dv`` head dims.

A selected key counts only if the step's plan lets the query see it (same document, at or before the query): the
bounds come from the same :class:`~hf_blockdiag_cp.planning.VarlenPlan` the dense path runs, so the indexer's
selection can never widen what a query attends to. Memory: the gathered keys and values, ``O(N * K * Hkv * D)``,
never an ``[L, S]`` matrix.
"""

from __future__ import annotations

import torch

from ..errors import Refusal
from ..planning import VarlenPlan

__all__ = ["query_bounds", "sparse_attention"]


def query_bounds(plan: VarlenPlan, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(lo [N], hi [N])`` int64: the flat key rows ``lo .. hi`` each flat query row may see under ``plan``
    (causal segments only; rows of no segment, padding, get ``lo > hi``). Host data in, one copy to ``device``."""
    rows = plan.batch_size * plan.q_rows
    lo_N = torch.ones(rows, dtype=torch.int64)
    hi_N = torch.zeros(rows, dtype=torch.int64)
    for seg in plan.segments:
        if not seg.causal:
            raise Refusal("sparse indexer attention with bidirectional blocks is not implemented")
        lo_N[seg.q_start:seg.q_start + seg.q_len] = seg.k_start
        hi_N[seg.q_start:seg.q_start + seg.q_len] = seg.k_start + seg.prefix + torch.arange(seg.q_len)
    return lo_N.to(device), hi_N.to(device)


def sparse_attention(q_NHD: torch.Tensor, k_MHD: torch.Tensor, v_MHD: torch.Tensor, indices_BLK: torch.Tensor,
                     bounds: tuple[torch.Tensor, torch.Tensor], *, scale: float, dropout_p: float = 0.0,
                     training: bool = False, q_chunk: int = 4096) -> torch.Tensor:
    """Softmax attention of each query over its selected keys.

    Args:
        q_NHD: ``[B*L, Hq, D]`` flat query rows.
        k_MHD, v_MHD: ``[B*S, Hkv, D]`` / ``[B*S, Hkv, Dv]`` flat key / value rows.
        indices_BLK: ``[B, L, K]`` integer key positions in ``[0, S)`` of the query's batch row; ``-1`` = none.
        bounds: :func:`query_bounds` of the plan (flat key rows each query may see).
        scale: softmax scale; dropout_p: attention dropout (applied to the probabilities, as eager attention does).

    Returns:
        ``[B*L, Hq, Dv]``; a query with no visible selected key (padding) gets zeros.
    """
    batch, local_len, width = indices_BLK.shape
    rows, num_q_heads, _ = q_NHD.shape
    key_rows = k_MHD.shape[0] // batch
    num_kv_heads = k_MHD.shape[1]
    groups = num_q_heads // num_kv_heads
    if rows != batch * local_len:
        raise ValueError(f"indices are for {batch}x{local_len} queries but the call has {rows} query rows")
    lo_N, hi_N = bounds
    base_N = torch.arange(batch, device=q_NHD.device).repeat_interleave(local_len) * key_rows
    flat_NK = indices_BLK.reshape(rows, width).to(torch.int64) + base_N[:, None]
    valid_NK = (indices_BLK.reshape(rows, width) >= 0) & (flat_NK >= lo_N[:, None]) & (flat_NK <= hi_N[:, None])
    flat_NK = torch.where(valid_NK, flat_NK, 0)
    outs = []
    for n0 in range(0, rows, q_chunk):
        n1 = min(rows, n0 + q_chunk)
        valid = valid_NK[n0:n1]
        k_nKHD = k_MHD[flat_NK[n0:n1]]
        v_nKHD = v_MHD[flat_NK[n0:n1]]
        q_nhgD = q_NHD[n0:n1].view(n1 - n0, num_kv_heads, groups, -1)
        scores = torch.einsum("nhgd,nkhd->nhgk", q_nhgD, k_nKHD) * scale
        seen = valid.any(dim=-1)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        scores = torch.where(seen[:, None, None, None], scores, 0.0)  # no visible key: finite, zeroed below
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q_NHD.dtype)
        probs = probs * valid[:, None, None, :].to(probs.dtype)
        if dropout_p:
            probs = torch.nn.functional.dropout(probs, p=dropout_p, training=training)
        out = torch.einsum("nhgk,nkhd->nhgd", probs, v_nKHD)
        outs.append(out.reshape(n1 - n0, num_q_heads, v_MHD.shape[-1]))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
