"""Attention of each query over the keys its indexer selected, exact on any device (gather + softmax).

Legend: ``N = B * L`` flat query rows, ``M`` flat key rows, ``K`` selected keys per query, ``Hq`` query heads,
``Hkv`` key/value heads (``Hq = Hkv * G``), ``D`` / ``Dv`` head dims.

A selected key counts only if the step's plan lets the query see it (same document, at or before the query): the
bounds come from the same :class:`~hf_blockdiag_cp.planning.VarlenPlan` the dense path runs (CP = 1), or from the
step's CP geometry (:mod:`.cp`), so the indexer's selection can never widen what a query attends to.

Memory: the forward and the backward gather the selected keys and values chunk by chunk of queries (an 8 MiB
budget) and keep none of them: what is saved for the backward is ``q, k, v``, the output, its log-sum-exp ``[N, Hq]``
and a reference to the indexer's ``[B, L, K]`` indices (as FlashAttention recomputes its probabilities), never an
``[L, S]`` matrix nor ``[N, K, Hkv, D]`` gathered keys. With attention dropout (DSA checkpoints use none)
autograd runs the same math and keeps each chunk's gathered keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import Refusal
from ..planning import VarlenPlan

__all__ = ["query_bounds", "selects_everything", "sparse_attention"]

#: Bytes of gathered keys and values (float32) one chunk of queries may hold at once.
_CHUNK_BYTES = 8 << 20


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


def selects_everything(plan: VarlenPlan, width: int) -> bool:
    """Whether a top-``width`` selection keeps every key each query of ``plan`` may see (no segment has more than
    ``width`` keys): the plain block-diagonal kernel then computes the same attention. Host fields only."""
    return plan.max_seqlen_k <= width


def _chunk_budget(width: int, heads: int, dims: int) -> int:
    """Queries per chunk: gathered keys and values of one chunk within :data:`_CHUNK_BYTES` (float32)."""
    return max(1, _CHUNK_BYTES // max(1, width * heads * dims * 4))


def _acc(t: torch.Tensor) -> torch.dtype:
    """The accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(t.dtype, torch.float32)


@dataclass(frozen=True, eq=False)
class _Selection:
    """Where the selected keys of each query are: ``index [N, K]`` (the indexer's, any integer dtype, ``-1`` =
    none), ``lo / hi [N]`` bounds, and either ``key_rows [S]`` (positions -> rows) or ``(local_len, rows_per_batch)``
    (row-relative positions of ``B`` batch rows)."""

    index: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    key_rows: torch.Tensor | None
    local_len: int
    rows_per_batch: int

    def rows(self, n0: int, n1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows [n, K] int64, valid [n, K] bool)`` of queries ``n0 .. n1`` (rows 0 where not valid)."""
        index = self.index[n0:n1].to(torch.int64)
        target = index
        if self.key_rows is None:
            batch_row = torch.arange(n0, n1, device=index.device) // self.local_len
            target = index + (batch_row * self.rows_per_batch)[:, None]
        valid = (index >= 0) & (target >= self.lo[n0:n1, None]) & (target <= self.hi[n0:n1, None])
        rows = torch.where(valid, target, 0)
        if self.key_rows is not None:
            rows = self.key_rows[rows]
            valid = valid & (rows >= 0)
            rows = rows.clamp(min=0)
        return rows, valid


def _scores(q_nHD: torch.Tensor, k_nKhD: torch.Tensor, valid_nK: torch.Tensor, groups: int,
            scale: float) -> torch.Tensor:
    """``[n, Hkv, G, K]`` scores in :func:`_acc`'s dtype, ``-inf`` where a slot holds no visible key."""
    acc = _acc(q_nHD)
    q_nhgD = q_nHD.to(acc).view(q_nHD.shape[0], k_nKhD.shape[2], groups, -1)
    scores = torch.einsum("nhgd,nkhd->nhgk", q_nhgD, k_nKhD.to(acc)) * scale
    return scores.masked_fill(~valid_nK[:, None, None, :], float("-inf"))


def _probs(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    return torch.exp(scores - torch.where(lse.isfinite(), lse, 0.0)[..., None])  # no visible key: all zeros


class _SparseAttention(torch.autograd.Function):
    """Softmax attention over gathered rows, recomputing the gathers in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, q_NHD, k_MHD, v_MHD, sel, scale, chunk):  # type: ignore[override]
        rows, num_q, _ = q_NHD.shape
        num_kv = k_MHD.shape[1]
        groups, acc = num_q // num_kv, _acc(q_NHD)
        out = q_NHD.new_zeros(rows, num_q, v_MHD.shape[-1])
        lse = torch.full((rows, num_kv, groups), float("-inf"), dtype=acc, device=q_NHD.device)
        for n0 in range(0, rows, chunk):
            n1 = min(rows, n0 + chunk)
            idx, valid = sel.rows(n0, n1)
            scores = _scores(q_NHD[n0:n1], k_MHD[idx], valid, groups, scale)
            lse[n0:n1] = torch.logsumexp(scores, dim=-1)
            value = torch.einsum("nhgk,nkhd->nhgd", _probs(scores, lse[n0:n1]), v_MHD[idx].to(acc))
            out[n0:n1] = value.reshape(n1 - n0, num_q, -1).to(out.dtype)
        ctx.save_for_backward(q_NHD, k_MHD, v_MHD, out, lse)
        ctx.sel, ctx.scale, ctx.chunk = sel, scale, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q_NHD, k_MHD, v_MHD, out, lse = ctx.saved_tensors
        sel, scale, chunk = ctx.sel, ctx.scale, ctx.chunk
        rows, num_q, _ = q_NHD.shape
        num_kv = k_MHD.shape[1]
        groups, acc = num_q // num_kv, _acc(q_NHD)
        grad_q = torch.zeros(q_NHD.shape, dtype=acc, device=q_NHD.device)
        grad_k = torch.zeros(k_MHD.shape, dtype=acc, device=k_MHD.device)
        grad_v = torch.zeros(v_MHD.shape, dtype=acc, device=v_MHD.device)
        # delta = rowsum(dO * O), the softmax's correction term per query and head.
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1).view(rows, num_kv, groups)
        for n0 in range(0, rows, chunk):
            n1 = min(rows, n0 + chunk)
            idx, valid = sel.rows(n0, n1)
            k_nKhD, v_nKhD = k_MHD[idx].to(acc), v_MHD[idx].to(acc)
            probs = _probs(_scores(q_NHD[n0:n1], k_nKhD, valid, groups, scale), lse[n0:n1])
            d_out = grad_out[n0:n1].to(acc).view(n1 - n0, num_kv, groups, -1)
            d_probs = torch.einsum("nhgd,nkhd->nhgk", d_out, v_nKhD)
            d_scores = probs * (d_probs - delta[n0:n1, ..., None]) * scale
            q_nhgD = q_NHD[n0:n1].to(acc).view(n1 - n0, num_kv, groups, -1)
            grad_q[n0:n1] = torch.einsum("nhgk,nkhd->nhgd", d_scores, k_nKhD).reshape(n1 - n0, num_q, -1)
            flat = idx.reshape(-1)
            grad_k.index_add_(0, flat, torch.einsum("nhgk,nhgd->nkhd", d_scores, q_nhgD).flatten(0, 1))
            grad_v.index_add_(0, flat, torch.einsum("nhgk,nhgd->nkhd", probs, d_out).flatten(0, 1))
        return grad_q.to(q_NHD.dtype), grad_k.to(k_MHD.dtype), grad_v.to(v_MHD.dtype), None, None, None


def _with_dropout(q_NHD: torch.Tensor, k_MHD: torch.Tensor, v_MHD: torch.Tensor, sel: _Selection, scale: float,
                  chunk: int, dropout_p: float, training: bool) -> torch.Tensor:
    """Autograd's version of the same math, with dropout on the probabilities (as eager attention applies it)."""
    rows, num_q, _ = q_NHD.shape
    groups = num_q // k_MHD.shape[1]
    outs = []
    for n0 in range(0, rows, chunk):
        n1 = min(rows, n0 + chunk)
        idx, valid = sel.rows(n0, n1)
        scores = _scores(q_NHD[n0:n1], k_MHD[idx], valid, groups, scale)
        scores = torch.where(valid.any(-1)[:, None, None, None], scores, 0.0)  # no visible key: zeroed below
        probs = torch.softmax(scores, dim=-1) * valid[:, None, None, :]
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=training)
        out = torch.einsum("nhgk,nkhd->nhgd", probs, v_MHD[idx].to(probs.dtype))
        outs.append(out.reshape(n1 - n0, num_q, -1).to(q_NHD.dtype))
    return torch.cat(outs, dim=0)


def sparse_attention(q_NHD: torch.Tensor, k_MHD: torch.Tensor, v_MHD: torch.Tensor, indices_BLK: torch.Tensor,
                     bounds: tuple[torch.Tensor, torch.Tensor], *, scale: float, dropout_p: float = 0.0,
                     training: bool = False, key_rows: torch.Tensor | None = None,
                     q_chunk: int | None = None) -> torch.Tensor:
    """Softmax attention of each query over its selected keys.

    Args:
        q_NHD: ``[B*L, Hq, D]`` flat query rows.
        k_MHD, v_MHD: ``[M, Hkv, D]`` / ``[M, Hkv, Dv]`` flat key / value rows (``M = B * S``, or a CP buffer).
        indices_BLK: ``[B, L, K]`` integer key positions (``-1`` = none): in ``[0, S)`` of the query's batch row, or,
            with ``key_rows``, global positions of the full row (``B = 1``).
        bounds: ``(lo [N], hi [N])``: the flat key rows (:func:`query_bounds`), or with ``key_rows`` the global
            positions, each query may see.
        scale: softmax scale; dropout_p: attention dropout (applied to the probabilities, as eager attention does).
        key_rows: ``[S]`` int64 row of ``k_MHD`` holding each global position (``-1``: not held), or ``None``.
        q_chunk: queries per chunk (default: an 8 MiB budget of gathered keys and values).

    Returns:
        ``[B*L, Hq, Dv]``; a query with no visible selected key (padding) gets zeros.
    """
    batch, local_len, width = indices_BLK.shape
    rows = q_NHD.shape[0]
    if rows != batch * local_len:
        raise ValueError(f"indices are for {batch}x{local_len} queries but the call has {rows} query rows")
    sel = _Selection(indices_BLK.reshape(rows, width), bounds[0], bounds[1], key_rows, local_len,
                     k_MHD.shape[0] // batch)
    chunk = q_chunk or _chunk_budget(width, k_MHD.shape[1], k_MHD.shape[2] + v_MHD.shape[2])
    if dropout_p and training:
        return _with_dropout(q_NHD, k_MHD, v_MHD, sel, scale, chunk, dropout_p, training)
    return _SparseAttention.apply(q_NHD, k_MHD, v_MHD, sel, scale, chunk)
