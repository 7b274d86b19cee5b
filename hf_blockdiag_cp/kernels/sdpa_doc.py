"""``sdpa_doc``: exact per-document attention through ``scaled_dot_product_attention``.

The default on CPU and the universal fallback (any device, any float dtype, forward and backward).
A host-side schedule, built once per step and window and kept in the call's ``schedules``, turns the
segments into few SDPA calls:

- *square* segments (as many keys as queries) of similar length are right-padded with zero rows to
  a common length and batched into one ``is_causal`` call; padded keys are never seen by real
  queries (they lie after them) and padded outputs are dropped, so padding contributes exact zeros
  to every gradient;
- a *prefix* segment (a document straddling the shard boundary: keys start before the queries) is
  computed on CPU as two flash calls, the prefix without mask and the diagonal block causally,
  merged by their log-sum-exp (backward uses the merged output and log-sum-exp, the standard exact
  split); elsewhere, or with dropout, it takes the masked path;
- segments a sliding window cuts are computed in query chunks with a small boolean mask over the
  chunk's key span, so no ``O(L * S)`` tensor ever exists.

On a CPU without native bf16/fp16 instructions (no AMX, no AVX512-BF16/FP16) half-precision inputs
are computed in float32 and the result rounded once: there the CPU flash kernels convert internally
anyway, and their half-precision backward measured 6x slower than float32 (the result is also more
accurate, never less).

Features no SDPA kernel has take exact detours that leave the common case untouched:

- ``Dv != D`` (MLA-style, e.g. D=192, Dv=128): the CPU flash kernels need equal head dims and SDPA
  would silently fall back to its math kernel (a ``[Hq, n, n]`` score tensor per segment), so the
  narrower side is zero-padded once per call: zero columns of q/k add exact zeros to every score,
  zero columns of v give output columns that are dropped, and their gradients are dropped with them;
- logit softcapping and attention sinks: every segment goes through :mod:`._chunked` (exact,
  chunked, hand-written backward); no dropout there, so such calls with dropout are unavailable.

The packed q/k/v are split into per-segment views once (``Tensor.split``): their backward is one
concatenation, where a slice per segment would make autograd zero-fill a full-size gradient buffer
per segment and tensor (``O(segments * Tq)`` memory traffic, 14% of a 16K fwd+bwd with 12 documents).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from ..compat import CPU_FLASH_ATTENTION, CPU_FLASH_ATTENTION_BACKWARD
from ..planning import VarlenPlan
from ._chunked import chunk_spans, segment_attention
from .base import BackendUnavailable, Capabilities, KernelCall

NAME = "sdpa_doc"

# Batching tolerance: a group of square segments padded to its longest member may cost at most
# this much more than the members' own work, plus a per-segment allowance that stands for the
# fixed cost of one more SDPA call (~a 48-token document). 0: padding must be paid for by saved
# calls alone. With 0.15, ~1000-token documents were batched with 15% padding that no saved call
# repays (A/B, S=4096/16384, mean document S/8, 1 thread, fwd+bwd: up to 1.08x the per-document
# loop with 0.15, 0.90-1.0x with 0; mean-48-token documents still batch: ~0.45x the loop).
_PAD_TOLERANCE = 0.0
_CALL_EQUIVALENT = 48 * 48
# Mask elements per chunk on the masked path (4 Mi booleans = 4 MiB).
_MASK_BUDGET = 1 << 22
_MIN_CHUNK = 64

_cpu_flash = CPU_FLASH_ATTENTION
_cpu_flash_bwd = CPU_FLASH_ATTENTION_BACKWARD


CAPABILITIES = Capabilities(NAME, "sdpa_doc", dropout_with_extras=False, noncausal=True, noncausal_with_extras=False,
                            auto={"cuda": 3, "default": 0})


@dataclass(frozen=True, eq=False)
class _Batch:
    """Square segments zero-padded to ``length`` (one SDPA call); a single segment is not copied."""

    segments: tuple[int, ...]
    length: int


@dataclass(frozen=True)
class _Prefix:
    segment: int


@dataclass(frozen=True)
class _Masked:
    segment: int
    chunk: int


@dataclass(frozen=True, eq=False)
class DocSchedule:
    """The SDPA calls of one plan and window, in segment order."""

    steps: tuple[_Batch | _Prefix | _Masked, ...]
    q_lens: tuple[int, ...]  # per segment, to split the packed rows into per-segment views
    k_lens: tuple[int, ...]


def _group_square(square: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Greedy grouping of ``(segment, length)`` pairs, longest first, bounded padding waste."""
    square = sorted(square, key=lambda x: -x[1])
    groups: list[list[tuple[int, int]]] = []
    i = 0
    while i < len(square):
        group = [square[i]]
        longest = square[i][1]
        work = longest * longest
        j = i + 1
        while j < len(square):
            n = square[j][1]
            members = len(group) + 1
            if longest * longest * members > (1 + _PAD_TOLERANCE) * (work + n * n) + _CALL_EQUIVALENT * (members - 1):
                break
            group.append(square[j])
            work += n * n
            j += 1
        groups.append(group)
        i = j
    return groups


def _build_schedule(plan: VarlenPlan, window: int | None) -> DocSchedule:
    square, steps = [], []
    for i, s in enumerate(plan.segments):
        if window is not None and s.k_len > window:
            chunk = max(_MIN_CHUNK, min(s.q_len, _MASK_BUDGET // max(1, min(s.k_len, window + _MIN_CHUNK))))
            steps.append(_Masked(i, chunk))
        elif s.k_len > s.q_len:
            steps.append(_Prefix(i))
        else:
            square.append((i, s.q_len))
    for group in _group_square(square):
        ids = tuple(i for i, _ in group)
        length = group[0][1]
        steps.append(_Batch(ids, length))
    steps.sort(key=lambda st: st.segments[0] if isinstance(st, _Batch) else st.segment)
    return DocSchedule(tuple(steps), tuple(s.q_len for s in plan.segments), tuple(s.k_len for s in plan.segments))


def schedule(call: KernelCall) -> DocSchedule:
    """The schedule of ``call.plan`` for ``call.window`` (built once, kept in ``call.schedules``)."""
    return call.schedules.get(NAME, call.window, lambda: _build_schedule(call.plan, call.window))


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """``[n, H, D]`` packed rows -> ``[1, H, n, D]`` (a view)."""
    return x.transpose(0, 1).unsqueeze(0)


class _PrefixMerge(torch.autograd.Function):
    """Bottom-right causal attention of ``q [1,Hq,n,D]`` over ``k, v [1,Hkv,p+n,D]`` on CPU, as a
    mask-free prefix call plus a causal diagonal call merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, prefix: int, scale: float):  # type: ignore[override]
        # Both halves and the merge run in float32 (the CPU kernel is no slower there), so a
        # bf16/fp16 result is rounded once, like a single kernel's, instead of three times; float64 stays.
        dtype = q.dtype
        compute = torch.promote_types(dtype, torch.float32)
        q, k, v = q.to(compute), k.to(compute), v.to(compute)
        o1, l1 = _cpu_flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
        o2, l2 = _cpu_flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        p, scale, dtype = ctx.prefix, ctx.scale, grad_out.dtype
        grad_out = grad_out.to(q.dtype).contiguous()
        dq1, dk1, dv1 = _cpu_flash_bwd(grad_out, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False, scale=scale)
        dq2, dk2, dv2 = _cpu_flash_bwd(grad_out, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True, scale=scale)
        return ((dq1 + dq2).to(dtype), torch.cat([dk1, dk2], dim=2).to(dtype), torch.cat([dv1, dv2], dim=2).to(dtype),
                None, None)


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, chunk: int,
            call: KernelCall, gqa: bool) -> torch.Tensor:
    """Chunked masked SDPA for one segment; ``q [1,Hq,n,D]``, ``k, v [1,Hkv,m,D]`` -> ``[1,Hq,n,Dv]``."""
    n, m = q.shape[2], k.shape[2]
    prefix = m - n
    outs = []
    for a, b, lo, hi in chunk_spans(n, m, chunk, window):
        q_pos = torch.arange(prefix + a, prefix + b, device=q.device).unsqueeze(1)
        k_pos = torch.arange(lo, hi, device=q.device).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask,
                                                   dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


@functools.lru_cache(maxsize=None)
def _cpu_has_native(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` attention natively (AMX / AVX512 half-precision instructions)."""
    probes = {torch.bfloat16: ("_is_amx_tile_supported", "_is_avx512_bf16_supported"),
              torch.float16: ("_is_amx_fp16_supported",)}.get(dtype, ())
    return any(getattr(torch.cpu, name, lambda: False)() for name in probes)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """Packed ``q [Tq,Hq,D]``, ``k [Tk,Hkv,D]``, ``v [Tk,Hkv,Dv]`` -> ``[Tq,Hq,Dv]`` (see kernels.base)."""
    if call.softcap is not None or call.sinks is not None:
        if not call.causal:
            raise BackendUnavailable("sdpa_doc has no non-causal segments (bidirectional blocks) with logit "
                                     "softcapping or attention sinks")
        return _chunked_attention(q, k, v, call)
    if q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and not _cpu_has_native(q.dtype):
        return attention(q.float(), k.float(), v.float(), call).to(q.dtype)
    dim, dim_v = q.shape[-1], v.shape[-1]
    if dim_v != dim:
        width = max(dim, dim_v)
        if dim < width:
            q, k = F.pad(q, (0, width - dim)), F.pad(k, (0, width - dim))
        else:
            v = F.pad(v, (0, width - dim_v))
        return _attention(q, k, v, call)[..., :dim_v]
    return _attention(q, k, v, call)


def _chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """Every segment through :func:`._chunked.segment_attention` (softcap and/or sinks)."""
    if call.dropout_p > 0:
        raise BackendUnavailable(f"sdpa_doc applies no dropout (dropout_p={call.dropout_p}) together with "
                                 "logit softcapping or attention sinks")
    if call.softcap is not None and not call.softcap > 0:
        raise ValueError(f"softcap={call.softcap!r} must be a positive float or None")
    sinks = call.sinks
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a float tensor [Hq={q.shape[1]}], got {sinks.dtype} {tuple(sinks.shape)}")
    sched = schedule(call)
    q_parts, k_parts, v_parts = q.split(sched.q_lens), k.split(sched.k_lens), v.split(sched.k_lens)
    softcap = None if call.softcap is None else float(call.softcap)
    pieces = [segment_attention(qs, ks, vs, sinks, scale=call.scale, softcap=softcap, window=call.window)
              for qs, ks, vs in zip(q_parts, k_parts, v_parts)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    """Non-causal segments (a bidirectional block's queries over all the keys they see): one mask-free SDPA call
    per segment."""
    q_lens, k_lens = [s.q_len for s in call.plan.segments], [s.k_len for s in call.plan.segments]
    gqa = q.shape[1] != k.shape[1]
    pieces = [F.scaled_dot_product_attention(_heads_first(qs), _heads_first(ks), _heads_first(vs),
                                             dropout_p=call.dropout_p, scale=call.scale, enable_gqa=gqa)[0]
              .transpose(0, 1) for qs, ks, vs in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens))]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
    if not call.causal:
        return _full_attention(q, k, v, call)
    plan = call.plan
    sched = schedule(call)
    gqa = q.shape[1] != k.shape[1]
    segments = plan.segments
    q_parts, k_parts, v_parts = q.split(sched.q_lens), k.split(sched.k_lens), v.split(sched.k_lens)
    # Per segment, its output rows [q_len, Hq, Dv] (views); one cat assembles them in packed order.
    pieces: list[torch.Tensor | None] = [None] * len(segments)
    for st in sched.steps:
        if isinstance(st, _Batch):
            if len(st.segments) == 1:
                i = st.segments[0]
                o = F.scaled_dot_product_attention(
                    _heads_first(q_parts[i]), _heads_first(k_parts[i]), _heads_first(v_parts[i]),
                    dropout_p=call.dropout_p, is_causal=True, scale=call.scale, enable_gqa=gqa)
                pieces[i] = o[0].transpose(0, 1)
            else:  # the first member is the longest: pad_sequence pads every member to st.length
                qb, kb, vb = (pad_sequence([parts[i] for i in st.segments], batch_first=True).transpose(1, 2)
                              for parts in (q_parts, k_parts, v_parts))  # [nb, H, length, D]
                o = F.scaled_dot_product_attention(qb, kb, vb, dropout_p=call.dropout_p, is_causal=True,
                                                   scale=call.scale, enable_gqa=gqa)
                # unbind, then a per-member slice: backward zero-fills one member, not the whole batch.
                for i, member in zip(st.segments, o.transpose(1, 2).unbind(0)):
                    pieces[i] = member[:segments[i].q_len]
            continue
        s = segments[st.segment]
        qs, ks, vs = (_heads_first(parts[st.segment]) for parts in (q_parts, k_parts, v_parts))
        if isinstance(st, _Prefix):
            if s.q_len == 1:  # one query sees every key: no mask at all
                o = F.scaled_dot_product_attention(qs, ks, vs, dropout_p=call.dropout_p, scale=call.scale,
                                                   enable_gqa=gqa)
            elif q.device.type == "cpu" and call.dropout_p == 0.0 and _cpu_flash is not None:
                o = _PrefixMerge.apply(qs, ks, vs, s.prefix, call.scale)
            else:
                chunk = max(_MIN_CHUNK, min(s.q_len, _MASK_BUDGET // s.k_len))
                o = _masked(qs, ks, vs, None, chunk, call, gqa)
        else:
            o = _masked(qs, ks, vs, call.window, st.chunk, call, gqa)
        pieces[st.segment] = o[0].transpose(0, 1)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)
