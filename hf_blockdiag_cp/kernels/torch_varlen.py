"""``torch_varlen``: ``torch.nn.attention.varlen.varlen_attn`` (flash kernel inside torch, CUDA only).

Causal through ``window_size=(-1, 0)`` (or ``(w - 1, 0)`` with a sliding window), bottom-right
aligned like flash-attn; no dropout, no softcap, no sinks, equal q/k and v head dims.
"""

from __future__ import annotations

import torch

from ._imports import optional_import
from .base import HALF_DTYPES, Capabilities, KernelCall, reject_unsupported

NAME = "torch_varlen"
MODULE = "torch.nn.attention.varlen"


CAPABILITIES = Capabilities(NAME, "varlen_attn (torch_varlen)", module=MODULE, module_attr="varlen_attn",
                            devices=("cuda",), dtypes=HALF_DTYPES, value_dim=False, dropout=False,
                            softcap=False, sinks=False, auto={"cuda": 2})


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME)
    varlen, reason = optional_import(MODULE)
    if varlen is None:
        raise RuntimeError(reason)
    plan = call.plan
    return varlen.varlen_attn(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
                              scale=call.scale, window_size=call.causal_window, enable_gqa=q.shape[1] != k.shape[1])
