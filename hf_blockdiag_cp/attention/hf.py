"""The transformers integration: the ``"blockdiag_cp"`` attention function and its mask function.

transformers calls the mask function once per forward (per mask kind) and hands its result to every
layer as ``attention_mask``. Ours never builds a dense ``[B, 1, L, S]`` mask: it returns a small
:class:`BlockDiagMask` with the padding mask and cache offsets, which also owns the plan derived
from keyword arguments, so layers of one forward (and their recompute) plan once.

Document boundaries, in order of precedence: ``cp_context`` (the collator's per-step context: no
host reads at all in the layers), ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening``), packed
``position_ids`` (a position that does not continue the previous one by +1 starts a document), a
2-D padding mask, else one causal sequence per row; with a KV cache the queries are the last ``L``
positions (bottom-right), which is what ``generate()`` needs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..config import BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..kernels import BackendUnavailable
from ..planning import (
    VarlenPlan,
    build_varlen_plan,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    plan_from_segments,
)
from ..planning.varlen import Segment
from .core import attend_flat, autocast_like_sdpa, check_qkv, flat_rows, kernel_spec, resolve_backend
from .cp import cp_attention

__all__ = ["ATTN_IMPLEMENTATION", "BlockDiagMask", "blockdiag_cp_attention", "blockdiag_cp_mask", "register"]

ATTN_IMPLEMENTATION = "blockdiag_cp"


@dataclass(eq=False)
class BlockDiagMask:
    """What the mask hook hands to every layer instead of a dense mask.

    Attributes:
        padding_mask: ``[B, kv_length]`` bool (True = real token) for the K/V positions of this
            forward, or ``None``.
        q_offset / kv_offset: absolute position of the first query / key (non-zero with a cache).
        q_length / kv_length: query / key lengths transformers sized the mask for.
        source: the 2-D padding mask transformers passed in (``None`` if none).
        plans: per-forward plans derived from keyword arguments, by ``(B, L, S)`` of the layer's query
            and keys (owned here, reused by every layer of the forward and by its recompute).

    ``generate()`` with a compilable (static) cache builds the mask once and feeds it back to the
    model as ``attention_mask``; for that round trip the object presents itself as the 2-D padding
    mask it came from (``ndim == 2``, ``.to()`` is a no-op) and :func:`blockdiag_cp_mask` unwraps it.
    """

    padding_mask: torch.Tensor | None
    q_offset: int
    kv_offset: int
    q_length: int
    kv_length: int
    source: torch.Tensor | None = None
    plans: dict[tuple[int, int, int], VarlenPlan] = field(default_factory=dict, repr=False)

    ndim = 2

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape) if self.source is not None else (0, self.kv_offset + self.kv_length)

    def to(self, *args: Any, **kwargs: Any) -> BlockDiagMask:
        return self


def blockdiag_cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                      kv_offset: int = 0, mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                      **kwargs: Any) -> BlockDiagMask:
    """Mask hook registered with ``AttentionMaskInterface``: records the facts, builds no mask."""
    if isinstance(attention_mask, BlockDiagMask):  # our own mask fed back by generate()
        attention_mask = attention_mask.source
    padding, source = None, attention_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"blockdiag_cp expects a 2-D padding attention_mask, got shape {tuple(attention_mask.shape)}")
        padding = attention_mask.to(torch.bool)
        end = kv_offset + kv_length
        if padding.shape[-1] < end:  # static caches size keys beyond what was seen: those are not real
            padding = torch.nn.functional.pad(padding, (0, end - padding.shape[-1]))
        padding = padding[:, kv_offset:end]
    q_offset = int(q_offset)  # a tensor only for static caches; once per forward, not per layer
    return BlockDiagMask(padding, q_offset, int(kv_offset), int(q_length), int(kv_length), source)


def _plan_from_kwargs(query: torch.Tensor, key: torch.Tensor, mask: BlockDiagMask | None, kwargs: dict[str, Any],
                      config: BlockDiagCPConfig) -> VarlenPlan:
    """Plan for calls without a ``cp_context`` (one host read per forward, cached on the mask)."""
    batch, local_len, key_len = query.shape[0], query.shape[2], key.shape[2]
    cache_key = (batch, local_len, key_len)
    if mask is not None and cache_key in mask.plans:
        return mask.plans[cache_key]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    padding, row_offset = None, key_len - local_len  # by default the queries are the last rows (bottom-right)
    if mask is not None:
        padding = mask.padding_mask
        if mask.kv_length == key_len and 0 <= mask.q_offset - mask.kv_offset <= key_len - local_len:
            row_offset = mask.q_offset - mask.kv_offset  # static caches: keys past the queries are unused slots
        elif padding is not None:
            padding = padding[:, -key_len:]  # a cache layer keeping fewer keys than the mask was sized for
    if cu_q is not None or cu_k is not None:
        plan = _plan_from_cu_seqlens(cu_q, cu_k, kwargs, batch, local_len, key_len, config)
    else:
        if position_ids is not None and local_len == key_len and row_offset == 0:
            if position_ids.shape[-1] != key_len:
                raise ValueError(f"position_ids has length {position_ids.shape[-1]}, expected {key_len}")
            doc_ids = doc_ids_from_position_ids(position_ids.expand(batch, -1))
        else:
            doc_ids = torch.ones(batch, key_len, dtype=torch.int64)
        if padding is not None:
            doc_ids = doc_ids * padding.to("cpu", torch.int64)
        plan = build_varlen_plan(doc_ids, local_len=local_len, row_offset=row_offset, validate=config.validate)
    plan = plan.to(query.device)
    if mask is not None:
        mask.plans[cache_key] = plan
    return plan


def _plan_from_cu_seqlens(cu_q: Any, cu_k: Any, kwargs: dict[str, Any], batch: int, local_len: int, key_len: int,
                          config: BlockDiagCPConfig) -> VarlenPlan:
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    if batch != 1:
        raise ValueError(f"cu_seq_lens_* describe one flattened row, but the batch has B={batch} rows")
    host_q = torch.as_tensor(cu_q).detach().to("cpu", torch.int64).flatten().tolist()
    host_k = torch.as_tensor(cu_k).detach().to("cpu", torch.int64).flatten().tolist()
    if len(host_q) != len(host_k):
        raise ValueError(f"cu_seq_lens_q has {len(host_q)} entries but cu_seq_lens_k has {len(host_k)}")
    for name, host, bound in (("cu_seq_lens_q", host_q, local_len), ("cu_seq_lens_k", host_k, key_len)):
        if not host or host[0] != 0 or any(b < a for a, b in zip(host, host[1:])) or host[-1] > bound:
            raise ValueError(f"{name}={host[:8]}... must start at 0, not decrease and end <= {bound}")
    lens_q = [b - a for a, b in zip(host_q, host_q[1:])]
    lens_k = [b - a for a, b in zip(host_k, host_k[1:])]
    for name, given, lens in (("max_length_q", kwargs.get("max_length_q"), lens_q),
                              ("max_length_k", kwargs.get("max_length_k"), lens_k)):
        if given is not None and int(given) != max(lens, default=0):
            raise ValueError(f"{name}={int(given)} is not the longest segment ({max(lens, default=0)})")
    if host_q == host_k and local_len == key_len:
        return build_varlen_plan(doc_ids_from_cu_seqlens(host_k, key_len), local_len=local_len,
                                 validate=config.validate)
    segments = []
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        if nk < nq:
            raise ValueError(f"segment {i} has {nq} queries but only {nk} keys (cu_seq_lens_q/k)")
        segments.append(Segment(host_q[i], nq, host_k[i], nk))
    return plan_from_segments(segments, batch_size=1, q_rows=local_len, kv_rows=key_len, validate=config.validate)


def blockdiag_cp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"blockdiag_cp"``.

    Args:
        module: the calling attention layer.
        query: ``[B, Hq, L, D]`` (RoPE applied).
        key, value: ``[B, Hkv, S, D]`` (GQA heads not repeated).
        attention_mask: a :class:`BlockDiagMask` from :func:`blockdiag_cp_mask`, ``None``, or a
            user-made 4-D mask (then run as dense SDPA with that exact mask).
        dropout: attention dropout (transformers passes 0 outside training).
        scaling: softmax scale.
        sliding_window: keys visible to a query (itself included), ``None`` = unlimited.
        softcap: logit softcapping (flash / flex backends only).
        **kwargs: ``cp_context``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ...

    Returns:
        ``(out [B, L, Hq, D], None)``.
    """
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("blockdiag_cp does not implement attention sinks (s_aux)")
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError("blockdiag_cp implements causal (decoder) attention only")
    if kwargs.get("output_attentions"):
        warnings.warn("blockdiag_cp does not return attention weights (output_attentions=True is ignored)",
                      stacklevel=2)
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value, autocast_off = autocast_like_sdpa(query, key, value)
    with autocast_off:
        out = _attention(query, key, value, attention_mask, dropout, scale, sliding_window, softcap, kwargs)
    return out.reshape(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
               scale: float, sliding_window: int | None, softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """The body of :func:`blockdiag_cp_attention` on same-dtype inputs: ``[B*L, Hq, Dv]`` (or ``[B, L, Hq, Dv]``)."""
    ctx: BlockDiagCPContext | None = kwargs.get("cp_context")
    batch, local_len = query.shape[0], query.shape[2]
    if isinstance(attention_mask, torch.Tensor):
        return _dense_user_mask(query, key, value, attention_mask, dropout, scale, softcap)
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    if ctx is not None:
        if not isinstance(ctx, BlockDiagCPContext):
            raise TypeError(f"cp_context must be a BlockDiagCPContext, got {type(ctx).__name__}")
        if mask is not None and (mask.q_offset or mask.kv_offset or key.shape[2] != local_len):
            raise ValueError("cp_context cannot be combined with a KV cache; pass use_cache=False when training")
        ctx.check_local(batch, local_len)
        config = ctx.config
        if ctx.cp_size > 1:
            return cp_attention(ctx, query, key, value, dropout_p=dropout, scale=scale, window=sliding_window,
                                softcap=softcap)
        check_qkv(query, key, value)
        plan = ctx.to(query.device).plan
    else:
        check_qkv(query, key, value)
        config = BlockDiagCPConfig()
        plan = _plan_from_kwargs(query, key, mask, kwargs, config)
    spec = kernel_spec(query, key, value, dropout_p=dropout, window=sliding_window, softcap=softcap)
    backend = resolve_backend(config, spec)
    return attend_flat(flat_rows(query), flat_rows(key), flat_rows(value), plan, backend, scale=scale,
                       dropout_p=dropout, window=sliding_window, softcap=softcap, config=config)


def _dense_user_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """A caller-built 4-D mask is honoured exactly with dense SDPA (no planning possible)."""
    if softcap is not None:
        raise BackendUnavailable("blockdiag_cp cannot apply softcap with a user-supplied dense mask")
    if mask.dim() != 4:
        raise ValueError(f"attention_mask tensors must be 4-D [B, 1, L, S], got shape {tuple(mask.shape)}")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., : key.shape[2]],
                                                           dropout_p=dropout, scale=scale,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def register() -> None:
    """Register ``"blockdiag_cp"`` with transformers' attention and mask interfaces (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)


