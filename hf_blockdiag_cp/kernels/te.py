"""``te``: TransformerEngine ``DotProductAttention`` in ``thd`` layout, ``padding_causal_bottom_right``.

One module per (heads, kv heads, head dim, scale, window, dtype, device), cached by
:func:`_dot_product_attention` (its ``lru_cache`` is the cache's owner). No dropout: a call with
dropout is reported unavailable so the caller falls back on every rank together.
"""

from __future__ import annotations

import functools

import torch

from ._imports import optional_import
from .base import HALF_DTYPES, Capabilities, KernelCall, reject_unsupported

NAME = "te"
MODULE = "transformer_engine.pytorch"


# TE takes kv_channels=(D, Dv), but only some of its fused backends (cuDNN, by GPU and version) run it; which
# one TE picks is not knowable without launching, so this adapter does not offer Dv != D.
CAPABILITIES = Capabilities(NAME, "the te backend (TransformerEngine fused attention)", module=MODULE,
                            devices=("cuda",), dtypes=HALF_DTYPES, value_dim=False, dropout=False,
                            softcap=False, sinks=False, auto={"cuda": 1})


@functools.lru_cache(maxsize=32)
def _dot_product_attention(num_q_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                           window: tuple[int, int], dtype: torch.dtype, device: torch.device):
    te, reason = optional_import(MODULE)
    if te is None:
        raise RuntimeError(reason)
    module = te.DotProductAttention(
        num_attention_heads=num_q_heads,
        kv_channels=head_dim,
        num_gqa_groups=num_kv_heads,
        attention_dropout=0.0,
        qkv_format="thd",
        attn_mask_type="padding_causal_bottom_right",
        window_size=window,
        softmax_scale=scale,
    )
    return module.to(device=device, dtype=dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME)
    plan = call.plan
    dpa = _dot_product_attention(q.shape[1], k.shape[1], q.shape[2], float(call.scale), call.causal_window,
                                 q.dtype, q.device)
    out = dpa(q, k, v, cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_kv=plan.cu_seqlens_k,
              max_seqlen_q=plan.max_seqlen_q, max_seqlen_kv=plan.max_seqlen_k)
    return out.view(q.shape[0], q.shape[1], v.shape[2])
