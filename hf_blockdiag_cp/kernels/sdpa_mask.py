"""``sdpa_mask``: SDPA with a dense boolean mask, one call per segment (document piece).

The last-resort fallback, never chosen by ``"auto"`` unless nothing better can run on every rank: each
segment gets its own dense ``[q_len, k_len]`` bottom-right causal (and windowed) mask, built once per
step and window and cached on the plan (at most the size of one ``[Tq, Tk]`` mask over the packed rows).
With ``Dv != D`` SDPA runs its math kernel (exact; its dense scores are the size of the mask).

Why per segment and not one ``[Tq, Tk]`` call: SDPA adds the mask to the scores, and a masked score
of a non-finite key is ``NaN + (-inf) = NaN``; a masked-out non-finite value row gets weight 0, and
``0 * NaN = NaN``. One dense call over the whole row therefore spreads a NaN/inf of one document into
every document of the row; a call per segment only ever sees that segment's own keys and values, so a
non-finite value stays in its document, exactly as with ``sdpa_doc`` and each document alone. Only
real rows are packed, and every query sees at least its own key, so no mask row is empty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .base import Capabilities, KernelCall, reject_unsupported, token_coordinates, visible

NAME = "sdpa_mask"


CAPABILITIES = Capabilities(NAME, "sdpa_mask (scaled_dot_product_attention)", softcap=False, sinks=False,
                            noncausal=True, last_resort=1)


def _build_masks(call: KernelCall) -> tuple[torch.Tensor, ...]:
    """Per segment, its ``[q_len, k_len]`` boolean visibility (on the plan's device)."""
    plan, window = call.plan, call.window
    _, q_pos, _, k_pos = token_coordinates(call)
    q_parts = q_pos.split([s.q_len for s in plan.segments])
    k_parts = k_pos.split([s.k_len for s in plan.segments])
    same = q_pos.new_zeros(())  # one segment per mask: the segment test is always true
    return tuple(visible(same, qp[:, None], same, kp[None, :], window) for qp, kp in zip(q_parts, k_parts))


def segment_masks(call: KernelCall) -> tuple[torch.Tensor, ...]:
    """The plan's per-segment masks for ``call.window`` (built once, kept in ``call.schedules``)."""
    return call.schedules.get(NAME, call.window, lambda: _build_masks(call))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """Packed ``q [Tq,Hq,D]``, ``k [Tk,Hkv,D]``, ``v [Tk,Hkv,Dv]`` -> ``[Tq,Hq,Dv]`` (see kernels.base)."""
    reject_unsupported(call, NAME, noncausal=True)
    plan = call.plan
    q_lens, k_lens = [s.q_len for s in plan.segments], [s.k_len for s in plan.segments]
    gqa = q.shape[1] != k.shape[1]
    pieces = []
    # A non-causal segment (a bidirectional block's queries) sees all its keys: no mask.
    masks = segment_masks(call) if call.causal else (None,) * len(q_lens)
    for qs, ks, vs, mask in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens), masks):
        # [n, H, D] -> [1, H, n, D] views; the output goes back to [n, Hq, Dv].
        out = F.scaled_dot_product_attention(qs.transpose(0, 1).unsqueeze(0), ks.transpose(0, 1).unsqueeze(0),
                                             vs.transpose(0, 1).unsqueeze(0), attn_mask=mask, dropout_p=call.dropout_p,
                                             scale=call.scale, enable_gqa=gqa)
        pieces.append(out[0].transpose(0, 1))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
