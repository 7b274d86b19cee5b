"""Exact attention of one segment with logit softcapping and/or attention sinks, in query chunks.

Used by :mod:`.sdpa_doc` when the call has ``softcap`` or ``sinks`` (no SDPA kernel on CPU has
either). Forward and backward are written out, flash style: forward keeps only the output and each
row's log-sum-exp, backward recomputes one query chunk's scores at a time. So the extra memory is a
few ``[Hq, chunk, span]`` tensors (``span``: the keys the chunk can see), never ``[Hq, n, m]`` for a
whole segment, and nothing per chunk is held between forward and backward.

Per segment, with ``s = scale * q.k``: ``s <- softcap * tanh(s / softcap)`` (gemma2), masked
bottom-right causal (and to the window), then ``p = exp(s - lse)`` with
``lse = log(sum_j exp(s_j) + exp(sink))`` (gpt-oss: the sink joins the denominator, carries no value
and is neither scaled nor capped). Backward, with ``delta = rowsum(dO * O)``:
``dS = P * (dO.V - delta)`` (times ``1 - tanh^2`` under softcap), ``dsink = -sum_rows p_sink * delta``.

Everything is computed in float32 (float64 inputs stay float64) and rounded once to the input dtype;
the sinks' gradient comes back in the sinks' dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

__all__ = ["chunk_spans", "segment_attention"]

# Score elements of one chunk over all heads (16 MiB in float32; backward holds ~5 such tensors).
_SCORE_BUDGET = 1 << 22
_MIN_CHUNK = 16


def chunk_spans(n: int, m: int, chunk: int, window: int | None) -> Iterator[tuple[int, int, int, int]]:
    """``(a, b, lo, hi)`` per chunk of ``chunk`` query rows: rows ``[a, b)`` of a bottom-right aligned
    segment with ``n`` queries and ``m >= n`` keys see (at most) keys ``[lo, hi)`` (causal, and to the
    window of ``window`` keys)."""
    prefix = m - n
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        lo = 0 if window is None else max(0, prefix + a - window + 1)
        yield a, b, lo, prefix + b


def _chunks(n: int, m: int, num_heads: int, window: int | None) -> Iterator[tuple[int, int, int, int]]:
    """:func:`chunk_spans` with the chunk sized so that one chunk's scores over all heads fit the budget."""
    widest = m if window is None else min(m, window + _MIN_CHUNK)
    return chunk_spans(n, m, max(_MIN_CHUNK, _SCORE_BUDGET // (num_heads * widest)), window)


def _scores(qc: torch.Tensor, k: torch.Tensor, a: int, b: int, lo: int, hi: int, prefix: int, scale: float,
            softcap: float | None, window: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Masked (capped) scores ``[H, c*g, span]`` of query chunk ``qc [H, c*g, D]`` (rows ordered
    query-major, group-minor) over keys ``k [H, span, D]``, and ``tanh`` of the capped scores (or None)."""
    s = torch.matmul(qc, k.transpose(1, 2)).mul_(scale)
    t = None
    if softcap is not None:
        t = torch.tanh(s.div_(softcap))
        s = t * softcap
    num_heads, rows, span = s.shape
    q_pos = torch.arange(prefix + a, prefix + b, device=s.device).view(b - a, 1, 1)
    k_pos = torch.arange(lo, hi, device=s.device).view(1, 1, span)
    hidden = k_pos > q_pos
    if window is not None:
        hidden |= k_pos <= q_pos - window
    # [c, 1, span] broadcasts over the query groups of each K/V head.
    s.view(num_heads, b - a, rows // (b - a), span).masked_fill_(hidden, float("-inf"))
    return s, t


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, scale: float, softcap: float | None, window: int | None):  # type: ignore[override]
        n, num_q_heads, dim = q.shape
        m, num_kv_heads, dim_v = v.shape
        groups = num_q_heads // num_kv_heads
        compute = torch.float64 if q.dtype == torch.float64 else torch.float32
        # [H, n, g, D]: a query chunk [H, c, g, D] is a view [H, c*g, D] (one bmm, K/V never repeated).
        qh = q.to(compute).reshape(n, num_kv_heads, groups, dim).permute(1, 0, 2, 3).contiguous()
        kh = k.to(compute).permute(1, 0, 2).contiguous()  # [H, m, D]
        vh = v.to(compute).permute(1, 0, 2).contiguous()  # [H, m, Dv]
        sink = None if sinks is None else sinks.to(compute).view(num_kv_heads, 1, groups)
        out = qh.new_empty(num_kv_heads, n, groups, dim_v)
        lse = qh.new_empty(num_kv_heads, n, groups)
        prefix = m - n
        for a, b, lo, hi in _chunks(n, m, num_q_heads, window):
            c = b - a
            s, _ = _scores(qh[:, a:b].reshape(num_kv_heads, c * groups, dim), kh[:, lo:hi], a, b, lo, hi, prefix,
                           scale, softcap, window)
            row_lse = torch.logsumexp(s, dim=-1).view(num_kv_heads, c, groups)
            if sink is not None:
                row_lse = torch.logaddexp(row_lse, sink)
            p = s.sub_(row_lse.view(num_kv_heads, c * groups, 1)).exp_()
            out[:, a:b] = torch.matmul(p, vh[:, lo:hi]).view(num_kv_heads, c, groups, dim_v)
            lse[:, a:b] = row_lse
        ctx.save_for_backward(qh, kh, vh, sink, out, lse)
        ctx.scale, ctx.softcap, ctx.window = scale, softcap, window
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if sinks is None else sinks.dtype)
        return out.permute(1, 0, 2, 3).reshape(n, num_q_heads, dim_v).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        qh, kh, vh, sink, out, lse = ctx.saved_tensors
        num_kv_heads, n, groups, dim = qh.shape
        m, dim_v = vh.shape[1], vh.shape[2]
        scale, softcap, window = ctx.scale, ctx.softcap, ctx.window
        q_dtype, k_dtype, v_dtype, sink_dtype = ctx.dtypes
        prefix = m - n
        dout = grad_out.to(qh.dtype).reshape(n, num_kv_heads, groups, dim_v).permute(1, 0, 2, 3).contiguous()
        delta = (dout * out).sum(-1)  # [H, n, g]: rowsum(dO * O) = sum_j p_j dO.v_j
        dq = torch.empty_like(qh)
        dk = torch.zeros_like(kh)
        dv = torch.zeros_like(vh)
        dsink = None if sink is None else torch.zeros_like(sink)
        for a, b, lo, hi in _chunks(n, m, num_kv_heads * groups, window):
            c = b - a
            rows = c * groups
            qc = qh[:, a:b].reshape(num_kv_heads, rows, dim)
            s, t = _scores(qc, kh[:, lo:hi], a, b, lo, hi, prefix, scale, softcap, window)
            p = s.sub_(lse[:, a:b].reshape(num_kv_heads, rows, 1)).exp_()
            do_c = dout[:, a:b].reshape(num_kv_heads, rows, dim_v)
            dv[:, lo:hi].baddbmm_(p.transpose(1, 2), do_c)
            ds = torch.matmul(do_c, vh[:, lo:hi].transpose(1, 2))
            ds.sub_(delta[:, a:b].reshape(num_kv_heads, rows, 1)).mul_(p)
            if t is not None:
                ds.mul_(1 - t * t)  # d(cap * tanh(x / cap)) / dx
            ds.mul_(scale)
            dq[:, a:b] = torch.matmul(ds, kh[:, lo:hi]).view(num_kv_heads, c, groups, dim)
            dk[:, lo:hi].baddbmm_(ds.transpose(1, 2), qc)
            if dsink is not None:
                p_sink = torch.exp(sink - lse[:, a:b])  # [H, c, g]
                dsink -= (p_sink * delta[:, a:b]).sum(1, keepdim=True)
        num_q_heads = num_kv_heads * groups
        return (dq.permute(1, 0, 2, 3).reshape(n, num_q_heads, dim).to(q_dtype),
                dk.permute(1, 0, 2).to(k_dtype), dv.permute(1, 0, 2).to(v_dtype),
                None if dsink is None else dsink.reshape(num_q_heads).to(sink_dtype), None, None, None)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None, *,
                      scale: float, softcap: float | None, window: int | None) -> torch.Tensor:
    """One segment: ``q [n, Hq, D]``, ``k [m, Hkv, D]``, ``v [m, Hkv, Dv]`` (``m >= n``, the last
    ``n`` keys are the queries' own), ``sinks [Hq]`` or None -> ``[n, Hq, Dv]`` in ``q.dtype``."""
    return _SegmentAttention.apply(q, k, v, sinks, scale, softcap, window)
