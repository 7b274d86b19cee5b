"""``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash kernel inside torch, CUDA only).

Causal through ``window_size=(-1, 0)`` (or ``(w - 1, 0)`` with a sliding window), bottom-right
aligned like flash-attn; no dropout, no softcap, no sinks, equal q/k and v head dims.
"""

from __future__ import annotations

import torch

from ._imports import optional_import
from .base import KernelCall, KernelSpec, cuda_half_reason, reject_unsupported

NAME = "torch_varlen"
MODULE = "torch.nn.attention.varlen"


def unavailable_reason(spec: KernelSpec) -> str | None:
    module, reason = optional_import(MODULE)
    if module is None or not hasattr(module, "varlen_attn"):
        return reason or "torch.nn.attention.varlen.varlen_attn is missing in this torch"
    reason = cuda_half_reason(spec, "varlen_attn (in this torch)")
    if reason:
        return reason
    if spec.dropout_p > 0:
        return "varlen_attn has no dropout"
    if spec.softcap is not None:
        return "varlen_attn has no logit softcapping"
    if spec.head_dim != spec.value_dim:
        return f"varlen_attn (flash kernel) needs head_dim == value_dim, got {spec.head_dim}/{spec.value_dim}"
    if spec.sinks:
        return "varlen_attn has no attention sinks"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME)
    varlen, reason = optional_import(MODULE)
    if varlen is None:
        raise RuntimeError(reason)
    plan = call.plan
    return varlen.varlen_attn(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                              scale=call.scale, window_size=call.causal_window, enable_gqa=q.shape[1] != k.shape[1])
