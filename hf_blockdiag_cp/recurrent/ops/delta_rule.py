"""Gated delta rule (Gated DeltaNet: Qwen3-Next / Qwen3.5 / OLMo-hybrid) and Kimi Delta Attention, chunked.

Legend: ``T`` packed tokens, ``H`` value heads (query/key heads are repeated to them, GQA-style), ``K``/``V`` key
and value head dims, ``N`` sequences, ``C`` chunks, ``L`` chunk size. State ``S`` ``[N, H, K, V]``. Per sequence and
head, with ``q``, ``k`` optionally l2-normalised and ``q`` multiplied by ``scale`` (default ``K ** -0.5``)::

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T,      o_t = S_t^T q_t

with a scalar ``g_t`` per head (GDN) or one per key channel (KDA). Chunked form (the WY/UT representation): within a
chunk started from ``S0``, the corrected values are ``u = U - W S0`` with ``(I + A) U = beta v`` and
``(I + A) W = beta k exp(gcum)``, ``A_ij = beta_i k_i^T diag(exp(gcum_i - gcum_j)) k_j`` for ``j < i``. Every
exponent is a decay between two positions of one chunk (<= 0), so nothing overflows.
"""

from __future__ import annotations

import math

import torch

from ._layout import ChunkLayout, chunk_layout, compute_dtype, initial_states, scan_states, seq_lens_of


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim (the form fla and transformers' fallbacks use)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_to(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, H, D]: each query/key head serves H // Hk consecutive value heads."""
    if x.shape[1] == heads:
        return x
    if heads % x.shape[1]:
        raise ValueError(f"value heads {heads} must be a multiple of query/key heads {x.shape[1]}")
    return x.repeat_interleave(heads // x.shape[1], dim=1)


class _Chunked:
    """The per-chunk quantities of the delta rule, for all chunks at once ([C, H, L, ...])."""

    def __init__(self, layout: ChunkLayout, k_T: torch.Tensor, g_T: torch.Tensor, beta_T: torch.Tensor,
                 v_T: torch.Tensor | None, q_T: torch.Tensor | None):
        per_channel = g_T.dim() == 3
        to_c = lambda t: layout.to_chunks(t).transpose(1, 2)  # [C, L, H, ...] -> [C, H, L, ...]  # noqa: E731
        k = to_c(k_T)
        beta = to_c(beta_T)  # [C, H, L]
        gcum = to_c(g_T).cumsum(dim=2)  # [C, H, L] or [C, H, L, K]
        L = layout.chunk_size
        lower = torch.ones(L, L, dtype=torch.bool, device=k.device).tril()
        if per_channel:
            # [C, H, L(i), L(j), K] decay between positions j <= i; zero above the diagonal
            pair = (gcum[:, :, :, None, :] - gcum[:, :, None, :, :]).masked_fill(~lower[:, :, None], -math.inf)
            pair = pair.exp()
            kk = torch.einsum("chik,chjk,chijk->chij", k, k, pair)
            qk = None if q_T is None else torch.einsum("chik,chjk,chijk->chij", to_c(q_T), k, pair)
            decay_in, decay_end = gcum.exp(), gcum[:, :, -1, :].exp()  # [C, H, L, K], [C, H, K]
            self.k_end = k * (gcum[:, :, -1:, :] - gcum).exp()
        else:
            pair = (gcum[..., :, None] - gcum[..., None, :]).masked_fill(~lower, -math.inf).exp()  # [C, H, L, L]
            kk = (k @ k.transpose(-1, -2)) * pair
            qk = None if q_T is None else (to_c(q_T) @ k.transpose(-1, -2)) * pair
            decay_in, decay_end = gcum.exp()[..., None], gcum[:, :, -1].exp()  # [C, H, L, 1], [C, H]
            self.k_end = k * (gcum[:, :, -1:] - gcum).exp()[..., None]
        strict = torch.ones(L, L, dtype=torch.bool, device=k.device).tril(-1)
        system = (beta[..., None] * kk).masked_fill(~strict, 0.0)  # unit lower triangular I + system
        solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
        self.per_channel = per_channel
        self.decay_end = decay_end
        self.W = solve(beta[..., None] * k * decay_in)  # [C, H, L, K]
        self.U = None if v_T is None else solve(beta[..., None] * to_c(v_T))  # [C, H, L, V]
        self.qk = None if qk is None else qk.masked_fill(~lower, 0.0)  # [C, H, L, L], diagonal included
        self.q_dec = None if q_T is None else to_c(q_T) * decay_in  # [C, H, L, K]

    def by_step(self, layout: ChunkLayout) -> None:
        """Split the per-chunk tensors the scan reads into per-step pieces (``layout.steps``)."""
        self.W_s = layout.steps(self.W)
        self.U_s = None if self.U is None else layout.steps(self.U)
        self.k_end_s = layout.steps(self.k_end)
        self.decay_end_s = layout.steps(self.decay_end)

    def decay_state(self, j: int, state: torch.Tensor) -> torch.Tensor:
        """diag(exp(gcum_L)) state at step ``j``, state [n, H, K, *]."""
        d = self.decay_end_s[j]
        return (d[..., None] if self.per_channel else d[..., None, None]) * state


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, per_channel: bool):
    """Flatten [B, T, ...] -> [T_all, ...] in the compute dtype, normalise, scale and repeat heads."""
    heads = v.shape[2] if v is not None else g.shape[2]
    dtype = compute_dtype(q, k, v, g, beta)
    k_T = k.reshape(-1, *k.shape[2:]).to(dtype)
    q_T = None if q is None else q.reshape(-1, *q.shape[2:]).to(dtype)
    if use_qk_l2norm_in_kernel:
        k_T = l2norm(k_T)
        q_T = None if q_T is None else l2norm(q_T)
    if q_T is not None:
        q_T = _heads_to(q_T * (k.shape[-1] ** -0.5 if scale is None else scale), heads)
    k_T = _heads_to(k_T, heads)
    g_T = g.reshape(-1, *g.shape[2:]).to(dtype)
    if g_T.dim() != (3 if per_channel else 2) or g_T.shape[1] != heads:
        raise ValueError(f"g must be [B, T, H={heads}{', K' if per_channel else ''}], got {tuple(g.shape)}")
    beta_T = beta.reshape(-1, heads).to(dtype)
    v_T = None if v is None else v.reshape(-1, heads, v.shape[-1]).to(dtype)
    return dtype, q_T, k_T, v_T, g_T, beta_T


def _delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state, cu_seqlens, seq_lens_host,
                use_qk_l2norm_in_kernel, chunk_size, per_channel):
    batch, length = k.shape[:2]
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    dtype, q_T, k_T, v_T, g_T, beta_T = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, per_channel)
    heads, dk, dv = v_T.shape[1], k_T.shape[-1], v_T.shape[-1]
    layout = chunk_layout(lens, chunk_size, k.device)
    ch = _Chunked(layout, k_T, g_T, beta_T, v_T, q_T)
    ch.by_step(layout)
    n_seq = len(lens)
    state0 = initial_states(initial_state, (n_seq, heads, dk, dv), k_T, dtype)  # [N, H, K, V]
    corrected = []

    def step(j: int, rows: slice, state: torch.Tensor) -> torch.Tensor:
        u = ch.U_s[j] - ch.W_s[j] @ state  # [n, H, L, V]
        corrected.append(u)
        return ch.decay_state(j, state) + ch.k_end_s[j].transpose(-1, -2) @ u

    entering, final = scan_states(layout, state0.index_select(0, layout.order), step)
    if entering:
        o_c = ch.q_dec @ torch.cat(entering, 0) + ch.qk @ torch.cat(corrected, 0)  # [C, H, L, V]
        o = layout.from_chunks(o_c.transpose(1, 2))
    else:
        o = v_T.new_zeros(0, heads, dv)
    out_dtype = q.dtype
    o = o.to(out_dtype).view(batch, length, heads, dv)
    if not output_final_state:
        return o, None
    return o, final if dtype == torch.float64 else final.float()


def _transition(k, g, beta, *, cu_seqlens, seq_lens_host, use_qk_l2norm_in_kernel, chunk_size, per_channel):
    batch, length = k.shape[:2]
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    _, _, k_T, _, g_T, beta_T = _prepare(None, k, None, g, beta, None, use_qk_l2norm_in_kernel, per_channel)
    heads, dk = k_T.shape[1], k_T.shape[-1]
    layout = chunk_layout(lens, chunk_size, k.device)
    ch = _Chunked(layout, k_T, g_T, beta_T, None, None)
    ch.by_step(layout)
    eye = torch.eye(dk, dtype=k_T.dtype, device=k.device).expand(len(lens), heads, dk, dk)

    def step(j: int, rows: slice, m: torch.Tensor) -> torch.Tensor:
        # one chunk maps S0 -> diag(exp(gcum_L)) S0 - k_end^T W S0 (+ terms without S0)
        return ch.decay_state(j, m) - ch.k_end_s[j].transpose(-1, -2) @ (ch.W_s[j] @ m)

    _, final = scan_states(layout, eye.index_select(0, layout.order), step)
    return final


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           *, scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                           use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
                           seq_lens_host: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated DeltaNet. q, k: [B, T, Hk, K]; v: [B, T, H, V]; g: [B, T, H] (log decay, <= 0); beta: [B, T, H];
    initial_state: [N, H, K, V]. Returns (o [B, T, H, V] in q's dtype, final [N, H, K, V] fp32 or None)."""
    return _delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, seq_lens_host=seq_lens_host,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, per_channel=False)


def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
              scale: float | None = None, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
              seq_lens_host: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention: as :func:`chunk_gated_delta_rule` with a per-key-channel gate g: [B, T, H, K]."""
    return _delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                       output_final_state=output_final_state, cu_seqlens=cu_seqlens, seq_lens_host=seq_lens_host,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, per_channel=True)


def gated_delta_rule_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *,
                                cu_seqlens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
                                chunk_size: int = 64, seq_lens_host: list[int] | None = None) -> torch.Tensor:
    """M [N, H, K, K] with ``S_end(S_in) = M @ S_in + S_end(0)`` exactly, per sequence (k: [B, T, Hk, K])."""
    return _transition(k, g, beta, cu_seqlens=cu_seqlens, seq_lens_host=seq_lens_host,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, per_channel=False)


def kda_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
                   use_qk_l2norm_in_kernel: bool = False, chunk_size: int = 64,
                   seq_lens_host: list[int] | None = None) -> torch.Tensor:
    """As :func:`gated_delta_rule_transition` for KDA's per-channel gate g: [B, T, H, K]."""
    return _transition(k, g, beta, cu_seqlens=cu_seqlens, seq_lens_host=seq_lens_host,
                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, chunk_size=chunk_size, per_channel=True)


def delta_rule_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                         use_qk_l2norm_in_kernel=False):
    """Float64 token-by-token reference for both GDN (g [B, T, H]) and KDA (g [B, T, H, K]).
    Returns (o [B, T, H, V], final [N, H, K, V]) in fp64."""
    batch, length = k.shape[:2]
    lens = seq_lens_of(cu_seqlens, None, batch, length)
    heads, dk, dv = v.shape[2], k.shape[-1], v.shape[-1]
    qs, ks = q.reshape(-1, *q.shape[2:]).double(), k.reshape(-1, *k.shape[2:]).double()
    if use_qk_l2norm_in_kernel:
        qs, ks = l2norm(qs), l2norm(ks)
    qs = _heads_to(qs * (dk ** -0.5 if scale is None else scale), heads)
    ks = _heads_to(ks, heads)
    vs, gs = v.reshape(-1, heads, dv).double(), g.reshape(-1, *g.shape[2:]).double()
    bs = beta.reshape(-1, heads).double()
    outs, finals, start = [], [], 0
    for s, n in enumerate(lens):
        S = qs.new_zeros(heads, dk, dv) if initial_state is None else initial_state[s].double()
        for t in range(start, start + n):
            decay = gs[t].exp()
            S = S * (decay[:, :, None] if decay.dim() == 2 else decay[:, None, None])
            delta = bs[t][:, None] * (vs[t] - torch.einsum("hkv,hk->hv", S, ks[t]))
            S = S + ks[t][:, :, None] * delta[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", S, qs[t]))
        finals.append(S)
        start += n
    o = torch.stack(outs).view(batch, length, heads, dv) if outs else vs.new_zeros(batch, length, heads, dv)
    return o, torch.stack(finals)
