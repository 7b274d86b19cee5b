"""``sdpa_mask``: one SDPA call with a dense boolean mask over the packed rows.

The last-resort fallback, never chosen by ``"auto"``: it builds a ``[Tq, Tk]`` mask (O(Tq * Tk)
memory). With ``Dv != D`` SDPA runs its math kernel (exact; its dense scores are the size of the
mask). Only real rows are packed, and every query sees at least its own key, so no row is empty and
no NaN can appear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import KernelCall, KernelSpec, reject_unsupported, token_coordinates, visible

NAME = "sdpa_mask"


def unavailable_reason(spec: KernelSpec) -> str | None:
    if not spec.dtype.is_floating_point:
        return f"sdpa_mask needs a floating dtype, got {spec.dtype}"
    if spec.softcap is not None:
        return "sdpa_mask (scaled_dot_product_attention) has no logit softcapping"
    if spec.sinks:
        return "sdpa_mask (scaled_dot_product_attention) has no attention sinks"
    return None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME)
    q_seg, q_pos, k_seg, k_pos = token_coordinates(call)
    mask = visible(q_seg[:, None], q_pos[:, None], k_seg[None, :], k_pos[None, :], call.window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                         v.transpose(0, 1).unsqueeze(0), attn_mask=mask, dropout_p=call.dropout_p,
                                         scale=call.scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[0].transpose(0, 1)
