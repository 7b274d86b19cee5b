"""Sparse-indexer attention under context parallelism: the MLA latent and the indexer keys cross ranks, not K/V.

Legend: ``S`` full-row positions, ``L`` local rows of this rank, ``R`` rows it receives (``R + L`` = its buffer),
``r`` = ``kv_lora_rank``, ``dr`` = ``qk_rope_head_dim``, ``Di`` = the indexer's head dim.

Per DSA layer and step, with the step's K/V exchange plan (the one dense layers use: halo / all-to-all / all-gather,
every placement, a document split anywhere):

1. the attention layer's ``expand_kv`` (served per instance, :func:`expand_kv`) moves its latent ``[L, r]`` and rope
   key ``[L, dr]`` as one fused ``[L, r + dr]`` buffer (one differentiable collective: the gradient of every row a
   peer used comes back to its owner, summed), then expands the ``[R + L]`` buffer rows with ``kv_b_proj`` here, on
   the receiving rank: ``r + dr`` values per token cross the wire instead of ``H * (Dk + Dv)``;
2. the served indexer (:func:`select_cp`) moves its keys ``[L, Di]`` (no gradient: the indexer is ``no_grad``) with
   the same plan, and selects for each local fragment of a document the top keys of that document at or before each
   query: the document's keys in position order are buffer rows ``key_row[doc start .. last query]``;
3. the attention (:func:`attend_cp`) attends over the selected keys of the buffer.

Indices are **global positions** of the row (one coordinate system per step: GLM's ``"shared"`` layers reuse them
as they are, and they do not depend on the placement); positions relative to the document give the tie rule, as at
CP = 1. When no document of the step is longer than the indexer's ``index_topk``, every query selects every earlier
key of its document: every rank then skips the indexer's exchange and scoring and attends with the plain
block-diagonal kernel over the same buffer (decided from the full row's documents, alike on every rank).
Shared layers (no indexer) move only the latent.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from ..attention.core import attend_flat, flat_rows, kernel_spec
from ..attention.layer import kernel_name, kv_exchange, step_backend
from ..context import BlockDiagCPContext
from ..distributed import RankExchange, exchange_kv
from ..errors import Refusal
from ..planning.documents import document_runs
from ..runtime import StepRuntime, device_plan, require_live_group, step_runtime
from .attention import sparse_attention
from .topk import document_topk

__all__ = ["SparseStep", "attend_cp", "expand_kv", "select_cp", "sparse_step"]


@dataclass(frozen=True, eq=False)
class SparseStep:
    """One rank's sparse geometry of one CP step on one device (derived on the host once per step).

    Attributes:
        exchange: the rank's device-ready exchange of the full (window ``None``) plan, ``None``: nothing moves.
        key_row: ``[S]`` int64 buffer row holding each global position (``-1``: not in this rank's buffer).
        query_lo / query_hi: ``[L]`` int64 global positions each local query may select (its document's start and
            itself; padding rows ``lo > hi``).
        buffer_rows: ``R + L``.
        longest_doc: the step's longest document (every rank alike): when ``<= index_topk`` all keys are selected.
    """

    exchange: RankExchange | None
    key_row: torch.Tensor
    query_lo: torch.Tensor
    query_hi: torch.Tensor
    buffer_rows: int
    longest_doc: int


#: Per step runtime (weak: gone with the step), per device: the step's :class:`SparseStep`. Owned by this module.
_STEPS: weakref.WeakKeyDictionary[StepRuntime, dict[torch.device, SparseStep]] = weakref.WeakKeyDictionary()


def sparse_step(ctx: BlockDiagCPContext, device: torch.device) -> SparseStep:
    """The step's :class:`SparseStep` on ``device`` (built on first use from host data; no device read)."""
    steps = _STEPS.setdefault(step_runtime(ctx), {})
    found = steps.get(device)
    if found is None:
        found = steps[device] = _build_step(ctx, device)
    return found


def _build_step(ctx: BlockDiagCPContext, device: torch.device) -> SparseStep:
    if ctx.ulysses_size > 1:
        raise Refusal(f"sparse indexer attention (DeepSeek-V3.2 / GLM-MoE-DSA) with the head-parallel layout "
                      f"(ulysses_size={ctx.ulysses_size}) is not implemented by blockdiag_cp: its MLA latent is "
                      "shared by every head; use ulysses_size=1")
    if ctx.blocks is not None and ctx.blocks.count:
        raise Refusal("sparse indexer attention with bidirectional blocks (block_ids) is not implemented")
    require_live_group(ctx, ctx.group, "CP")
    transfer = ctx.exchange.for_rank(ctx.cp_rank)
    positions = transfer.buffer_positions
    full_len = ctx.full_len
    key_row = torch.full((full_len,), -1, dtype=torch.int64)
    key_row[positions] = torch.arange(positions.numel())
    row = ctx.doc_ids[0].to(torch.int64)
    starts, ends = document_runs(row)
    doc_start = torch.zeros(full_len, dtype=torch.int64)
    for a, b in zip(starts.tolist(), ends.tolist()):
        doc_start[a:b] = a
    local = ctx.local_index.to(torch.int64)
    real = row[local] != 0
    lo = torch.where(real, doc_start[local], 1)
    hi = torch.where(real, local, 0)
    # The exchange plan gives each rank its queries' whole document prefix; a missing row would be a planning bug.
    held = torch.cumsum((key_row >= 0).to(torch.int64), 0)
    count = held[hi] - torch.where(lo > 0, held[(lo - 1).clamp(min=0)], 0)
    if bool((real & (count != hi - lo + 1)).any()):
        raise RuntimeError(f"CP rank {ctx.cp_rank}: the K/V exchange plan does not hold the whole document prefix of "
                           "every local query; cannot serve the sparse indexer")
    longest = int((torch.from_numpy(ends) - torch.from_numpy(starts)).max()) if starts.size else 0
    return SparseStep(exchange=kv_exchange(ctx, device, None), key_row=key_row.to(device), query_lo=lo.to(device),
                      query_hi=hi.to(device), buffer_rows=int(positions.numel()), longest_doc=longest)


def expand_kv(module: torch.nn.Module, original: Any, ctx: BlockDiagCPContext, kv_nope: torch.Tensor,
              k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The latent ``kv_nope [1, 1, L, r]`` and rope key ``k_rot [1, 1, L, dr]`` moved by the step's exchange, then
    expanded by the layer's own ``expand_kv`` (``original``): key / value states ``[1, H, R + L, Dk / Dv]``."""
    step = sparse_step(ctx, kv_nope.device)
    if kv_nope.shape[0] != 1 or kv_nope.shape[2] != ctx.local_len:
        raise ValueError(f"{type(module).__name__}: CP expects one packed row of {ctx.local_len} local rows, got "
                         f"a latent of shape {tuple(kv_nope.shape)}")
    if step.exchange is None:
        return original(kv_nope, k_rot)
    rows, rank = kv_nope.shape[2], kv_nope.shape[3]
    dtype = torch.promote_types(kv_nope.dtype, k_rot.dtype)
    fused_LW = torch.cat([kv_nope.reshape(rows, rank).to(dtype), k_rot.reshape(rows, -1).to(dtype)], dim=1)
    buffer = exchange_kv(fused_LW, step.exchange)  # [R + L, r + dr], one collective each way
    total = buffer.shape[0]
    latent = buffer[:, :rank].to(kv_nope.dtype).reshape(1, 1, total, rank)
    rope = buffer[:, rank:].to(k_rot.dtype).reshape(1, 1, total, -1)
    return original(latent, rope)


def select_cp(indexer: torch.nn.Module, ctx: BlockDiagCPContext, fragments: Any, q_BLHD: torch.Tensor,
              k_BLD: torch.Tensor, w_BLH: torch.Tensor) -> torch.Tensor:
    """``[1, L, min(index_topk, S)]`` int32 global key positions selected for each local query (``-1``: none).

    ``fragments``: the forward's local fragments (documents pieces with their global start and document start);
    ``q / k / w``: the indexer's local queries ``[1, L, H, Di]``, keys ``[1, L, Di]``, head weights ``[1, L, H]``.
    """
    topk = int(indexer.index_topk)
    step = sparse_step(ctx, q_BLHD.device)
    width = min(topk, ctx.full_len)
    out_LK = torch.full((q_BLHD.shape[1], width), -1, dtype=torch.int32, device=q_BLHD.device)
    everything = step.longest_doc <= topk  # every rank alike: no exchange, every earlier key selected
    keys_MD = None
    if not everything:
        keys_MD = k_BLD[0] if step.exchange is None else exchange_kv(k_BLD[0].contiguous(), step.exchange)
    scale = float(indexer.softmax_scale)
    for frag in fragments:
        if frag.doc == 0:  # padding selects nothing
            continue
        rows = slice(frag.start, frag.start + frag.length)
        offset = frag.global_start - frag.doc_start  # the fragment's first query, relative to its document
        if everything:
            pos_K = torch.arange(width, device=out_LK.device)
            reach_n = torch.arange(offset, offset + frag.length, device=out_LK.device)
            out_LK[rows] = torch.where(pos_K[None, :] <= reach_n[:, None], pos_K[None, :] + frag.doc_start, -1)
            continue
        doc_keys = keys_MD[step.key_row[frag.doc_start:frag.global_start + frag.length]]
        sel = document_topk(q_BLHD[0, rows], doc_keys, w_BLH[0, rows], scale, topk, q_offset=offset)
        out_LK[rows, :sel.shape[1]] = torch.where(sel >= 0, sel + frag.doc_start, -1)
    return out_LK[None]


def attend_cp(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              indices: torch.Tensor, *, scale: float, dropout_p: float) -> torch.Tensor:
    """Attention of the local queries ``[1, Hq, L, D]`` over the buffer keys / values ``[1, Hkv, R + L, D / Dv]``
    (:func:`expand_kv`'s) at the selected global positions ``indices [1, L, K]`` -> ``[L, Hq, Dv]``."""
    step = sparse_step(ctx, query.device)
    if key.shape[2] != step.buffer_rows:
        raise ValueError(f"sparse attention under CP expects the {step.buffer_rows} key rows of this rank's exchange "
                         f"buffer (the MLA latent moved by the served expand_kv), got {key.shape[2]}; was the model "
                         "prepared for blockdiag_cp, and is there no KV cache (use_cache=False)?")
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (1, query.shape[2]):
        raise ValueError(f"indices must be [1, L={query.shape[2]}, K], got shape {tuple(indices.shape)}")
    if step.longest_doc <= indices.shape[-1]:  # every earlier key is selected: the plain block-diagonal kernel
        plan = device_plan(ctx, query.device, None)
        spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=None, softcap=None, sinks=None,
                           noncausal=False)
        backend = step_backend(ctx, spec, query.device)
        with step_runtime(ctx).guard(ctx, kernel_name(backend)):
            return attend_flat(flat_rows(query), flat_rows(key), flat_rows(value), plan.plan, backend, scale=scale,
                               dropout_p=dropout_p, config=ctx.config, schedules=plan.schedules)
    return sparse_attention(flat_rows(query), flat_rows(key), flat_rows(value), indices,
                            (step.query_lo, step.query_hi), scale=scale, dropout_p=dropout_p,
                            training=dropout_p > 0, key_rows=step.key_row)
