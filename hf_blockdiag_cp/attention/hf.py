"""The transformers integration: the ``"blockdiag_cp"`` attention function and its registration.

transformers calls the registered mask function (:mod:`.mask`) once per forward and hands its
:class:`~.mask.BlockDiagMask` to every layer as ``attention_mask``; the layer's attention function here
takes its documents from ``cp_context`` (the collator's per-step context: no host reads at all in the
layers), else from the keyword arguments (:mod:`.keywords`), and runs the plan (:mod:`.core`, or
:mod:`.cp` for a CP shard).

What cannot be computed exactly is refused with ``NotImplementedError`` naming the cause, never
dropped: attention keywords this function does not implement, mask patterns other than those of
:mod:`.mask_spec`, bidirectional masks, model code that uses the mask itself; model-level refusals
(other token mixers, absolute positions, attention that bypasses ``AttentionInterface``) live in
:mod:`hf_blockdiag_cp.model`.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..config import ATTN_IMPLEMENTATION, BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..kernels import BackendUnavailable
from ..model import mark_attention_call, patch_transformers
from ..model.prepare import check_context_reached, forward_context
from .core import attend_flat, autocast_like_sdpa, check_qkv, flat_rows, kernel_spec, resolve_backend
from .cp import cp_attention
from .keywords import check_keywords, chunked_context_plan, plan_from_kwargs, refuse_appended_keys
from .mask import BlockDiagMask, blockdiag_cp_mask
from .runtime import device_plan
from .ulysses_path import ulysses_attention

__all__ = ["ATTN_IMPLEMENTATION", "BlockDiagMask", "blockdiag_cp_attention", "blockdiag_cp_mask", "register"]


def _model_type(module: torch.nn.Module, mask: BlockDiagMask | None) -> str:
    if mask is not None and mask.model_type != "this model":
        return mask.model_type
    return getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__


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
        sliding_window: keys visible to a query (itself included), ``None`` = unlimited; a window in the
            mask function (what transformers' sdpa and eager apply) takes precedence.
        softcap: logit softcapping (flash / flex backends only).
        **kwargs: ``cp_context``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ...; any
            other keyword that would change the attention raises ``NotImplementedError``.

    Returns:
        ``(out [B, L, Hq, D], None)``.
    """
    mark_attention_call(module)
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    model_type = _model_type(module, mask)
    check_keywords(module, model_type, kwargs)
    # Layers that drop the model's kwargs (stablelm, nemotron, falcon) get the context their forward was given.
    kwargs["cp_context"] = forward_context(module, kwargs.get("cp_context"))
    check_context_reached(module, kwargs["cp_context"])
    refuse_appended_keys(mask, query, key, model_type)  # keys that are neither the local rows nor a cache
    if mask is not None:
        if mask.spec.refusal is not None:
            raise NotImplementedError(f"{model_type}: {mask.spec.refusal}; blockdiag_cp cannot serve this mask")
        if mask.spec.bidirectional or not mask.spec.causal:
            raise NotImplementedError(f"{model_type} builds a bidirectional (encoder) attention mask for "
                                      f"{type(module).__name__}; blockdiag_cp implements causal attention only")
        # The mask is what transformers' sdpa and eager apply; a layer's own is_causal flag can be stale.
        sliding_window = mask.spec.window
    elif not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError(f"{model_type}: blockdiag_cp implements causal (decoder) attention only "
                                  f"({type(module).__name__} is not causal)")
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
    sinks = kwargs.get("s_aux")  # gpt-oss attention sinks: [Hq] logits joining every softmax denominator
    if isinstance(attention_mask, torch.Tensor):
        if sinks is not None:
            raise NotImplementedError("blockdiag_cp cannot apply attention sinks (s_aux) with a user-supplied dense mask")
        return _dense_user_mask(query, key, value, attention_mask, dropout, scale, softcap)
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    chunk_size = mask.spec.chunk_size if mask is not None else None
    if ctx is not None:
        if not isinstance(ctx, BlockDiagCPContext):
            raise TypeError(f"cp_context must be a BlockDiagCPContext, got {type(ctx).__name__}")
        if mask is not None and (mask.q_offset or mask.kv_offset or key.shape[2] != local_len):
            raise ValueError("cp_context cannot be combined with a KV cache; pass use_cache=False when training")
        ctx.check_local(batch, local_len)
        config = ctx.config
        if ctx.cp_size > 1 and ctx.ulysses_size > 1:  # head-parallel layout (issue 18)
            return ulysses_attention(ctx, query, key, value, dropout_p=dropout, scale=scale, window=sliding_window,
                                     softcap=softcap, sinks=sinks, chunk_size=chunk_size)
        if ctx.cp_size > 1:
            # Chunks only remove keys: the same exchange serves them, with a finer plan over its buffer.
            chunked = None if chunk_size is None else chunked_context_plan(ctx, mask, query.device)
            return cp_attention(ctx, query, key, value, dropout_p=dropout, scale=scale, window=sliding_window,
                                softcap=softcap, sinks=sinks, plan=chunked)
        check_qkv(query, key, value)
        if chunk_size is None:
            plan = device_plan(ctx, query.device, sliding_window)
        else:
            plan = chunked_context_plan(ctx, mask, query.device)
    else:
        check_qkv(query, key, value)
        config = BlockDiagCPConfig()
        plan = plan_from_kwargs(query, key, mask, kwargs, config)
    spec = kernel_spec(query, key, value, dropout_p=dropout, window=sliding_window, softcap=softcap, sinks=sinks)
    backend = resolve_backend(config, spec)
    return attend_flat(flat_rows(query), flat_rows(key), flat_rows(value), plan.plan, backend, scale=scale,
                       dropout_p=dropout, window=sliding_window, softcap=softcap, sinks=sinks, config=config,
                       schedules=plan.schedules)


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
    """Register ``"blockdiag_cp"`` with transformers' attention and mask interfaces and have every model that
    uses it prepared (:func:`hf_blockdiag_cp.model.prepare_model`); idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)
    patch_transformers()
