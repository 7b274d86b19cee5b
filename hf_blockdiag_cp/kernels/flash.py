"""``flash``: flash-attn 2 ``flash_attn_varlen_func`` (causal = bottom-right aligned).

Long-prefix guard (``KernelCall.flash_prefix_guard``): a segment with more keys than queries (the
document straddling a shard boundary) is run through fixed-length ``flash_attn_func``, which
accepts the same bottom-right causal layout without reading ``cu_seqlens``; the remaining
segments go through one varlen call. Some flash builds have faulted asynchronously on long
asymmetric varlen segments; with contiguous sharding this costs exactly one extra launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._imports import optional_import
from .base import HALF_DTYPES, Capabilities, KernelCall, reject_unsupported

NAME = "flash"
MODULE = "flash_attn"


CAPABILITIES = Capabilities(NAME, "flash-attn", module=MODULE, devices=("cuda",), dtypes=HALF_DTYPES,
                            max_head_dim=256, value_dim=False, sinks=False, noncausal=True, auto={"cuda": 0})


@dataclass(frozen=True, eq=False)
class PrefixGuard:
    """Host schedule for the guard: prefix segments alone, the rest in one varlen call."""

    prefix: tuple[int, ...]
    rest_cu_q: torch.Tensor | None  # [m + 1] int32 offsets of the remaining segments
    rest_cu_k: torch.Tensor | None
    rest_max_q: int
    rest_max_k: int
    rest_q_slice: tuple[int, int] | None  # packed query rows of the rest when contiguous
    rest_k_slice: tuple[int, int] | None
    rest_q_index: torch.Tensor | None
    rest_k_index: torch.Tensor | None
    out_index: torch.Tensor | None  # rows of cat(prefix outs..., rest out) in packed order


def _build_guard(call: KernelCall) -> PrefixGuard:
    plan = call.plan
    cq, ck = plan.host_cu_q, plan.host_cu_k
    prefix = plan.prefix_segments
    rest = [i for i in range(plan.num_segments) if i not in set(prefix)]
    dev = plan.device

    def ranges(ids: list[int], cu: tuple[int, ...]) -> torch.Tensor:
        return torch.cat([torch.arange(cu[i], cu[i + 1]) for i in ids]) if ids else torch.zeros(0, dtype=torch.int64)

    def contiguous(ids: list[int]) -> bool:
        return all(b == a + 1 for a, b in zip(ids, ids[1:]))

    rest_q_rows = ranges(rest, cq)
    rest_cu_q = rest_cu_k = None
    if rest:
        rest_cu_q = torch.tensor([0] + [cq[i + 1] - cq[i] for i in rest], dtype=torch.int64).cumsum(0).to(torch.int32)
        rest_cu_k = torch.tensor([0] + [ck[i + 1] - ck[i] for i in rest], dtype=torch.int64).cumsum(0).to(torch.int32)
    order = torch.cat([ranges([i], cq) for i in prefix] + [rest_q_rows])
    out_index = None
    if not torch.equal(order, torch.arange(plan.total_q)):
        out_index = torch.empty_like(order)
        out_index[order] = torch.arange(order.numel())
    contiguous_rest = contiguous(rest)
    return PrefixGuard(
        prefix=prefix,
        rest_cu_q=None if rest_cu_q is None else rest_cu_q.to(dev),
        rest_cu_k=None if rest_cu_k is None else rest_cu_k.to(dev),
        rest_max_q=max((cq[i + 1] - cq[i] for i in rest), default=0),
        rest_max_k=max((ck[i + 1] - ck[i] for i in rest), default=0),
        rest_q_slice=(cq[rest[0]], cq[rest[-1] + 1]) if rest and contiguous_rest else None,
        rest_k_slice=(ck[rest[0]], ck[rest[-1] + 1]) if rest and contiguous_rest else None,
        rest_q_index=None if contiguous_rest or not rest else rest_q_rows.to(dev),
        rest_k_index=None if contiguous_rest or not rest else ranges(rest, ck).to(dev),
        out_index=None if out_index is None else out_index.to(dev),
    )


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    reject_unsupported(call, NAME, softcap=True, noncausal=True)
    fa, reason = optional_import(MODULE)
    if fa is None:
        raise RuntimeError(reason)
    plan = call.plan
    # Non-causal segments (bidirectional blocks) see all their keys: no mask, no window, and no prefix to guard.
    window = call.causal_window if call.causal else (-1, -1)
    common = dict(dropout_p=call.dropout_p, softmax_scale=call.scale, causal=call.causal, window_size=window,
                  softcap=call.softcap or 0.0, deterministic=call.deterministic)
    if not call.flash_prefix_guard or not plan.prefix_segments or not call.causal:
        return fa.flash_attn_varlen_func(q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
                                         plan.max_seqlen_k, **common)
    guard = call.schedules.get(NAME, "prefix_guard", lambda: _build_guard(call))
    cq, ck = plan.host_cu_q, plan.host_cu_k
    outs = []
    for i in guard.prefix:
        o = fa.flash_attn_func(q[cq[i]:cq[i + 1]].unsqueeze(0), k[ck[i]:ck[i + 1]].unsqueeze(0),
                               v[ck[i]:ck[i + 1]].unsqueeze(0), **common)
        outs.append(o[0])
    if guard.rest_cu_q is not None:
        if guard.rest_q_slice is not None:
            (qa, qb), (ka, kb) = guard.rest_q_slice, guard.rest_k_slice
            rq, rk, rv = q[qa:qb], k[ka:kb], v[ka:kb]
        else:
            rq = q.index_select(0, guard.rest_q_index)
            rk = k.index_select(0, guard.rest_k_index)
            rv = v.index_select(0, guard.rest_k_index)
        outs.append(fa.flash_attn_varlen_func(rq, rk, rv, guard.rest_cu_q, guard.rest_cu_k, guard.rest_max_q,
                                              guard.rest_max_k, **common))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return out if guard.out_index is None else out.index_select(0, guard.out_index)
