"""Mamba2 state space duality (SSD) scan per sequence, chunked, with state in and out.

Legend: ``T`` packed tokens, ``H`` heads, ``P`` head dim, ``G`` B/C groups, ``S`` state size, ``N`` sequences,
``C`` chunks, ``L`` chunk size. State ``[N, H, P, S]``. Per sequence and head:
``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, where dt has had ``dt_bias`` added,
``softplus`` (when asked) and the clamp to ``dt_limit`` applied, in that order (transformers' mamba2/bamba
``mamba2_chunk_scan``). The gated RMSNorm of the layer is outside the scan.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._layout import chunk_layout, compute_dtype, initial_states, scan_states, segment_sums, seq_lens_of


def discretised_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None, dt_softplus: bool,
                   dt_limit: tuple[float, float], dtype: torch.dtype) -> torch.Tensor:
    """The step sizes the scan uses: ``clamp(softplus(dt + dt_bias))`` as configured, in ``dtype``."""
    dt = dt.to(dtype)
    if dt_bias is not None:
        dt = dt + dt_bias.to(dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _d_skip(x: torch.Tensor, D: torch.Tensor | None) -> torch.Tensor | float:
    """D x with D [H] or [H, P]; x [..., H, P]."""
    if D is None:
        return 0.0
    d = D.to(x.dtype)
    return x * (d[:, None] if d.dim() == 1 else d)


def _check(x, dt, A, B, C):
    batch, length, heads, _ = x.shape
    groups = B.shape[2]
    if dt.shape != (batch, length, heads) or A.shape != (heads,):
        raise ValueError(f"dt must be [B, T, H={heads}] and A [H], got {tuple(dt.shape)}, {tuple(A.shape)}")
    if B.shape != C.shape or B.shape[:2] != (batch, length) or heads % groups:
        raise ValueError(f"B, C must be [B, T, G, S] with H % G == 0, got {tuple(B.shape)}, {tuple(C.shape)}")


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, *,
                   D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None, dt_softplus: bool = False,
                   dt_limit: tuple[float, float] = (0.0, math.inf), initial_state: torch.Tensor | None = None,
                   output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                   seq_lens_host: list[int] | None = None,
                   chunk_size: int = 256) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked SSD. x: [B, T, H, P]; dt: [B, T, H] (raw); A: [H]; B, C: [B, T, G, S]; D: [H] or [H, P];
    dt_bias: [H]; initial_state: [N, H, P, S]. Returns (y [B, T, H, P] in x's dtype, final [N, H, P, S] fp32)."""
    _check(x, dt, A, B, C)
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2:]
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    dtype = compute_dtype(x, dt, A, B, C, initial_state)
    layout = chunk_layout(lens, chunk_size, x.device)
    rep = heads // groups
    x_T = x.reshape(-1, heads, head_dim).to(dtype)
    dt_T = discretised_dt(dt.reshape(-1, heads), dt_bias, dt_softplus, dt_limit, dtype)
    # padding slots get dt = 0: no decay, no input, so states pass through them unchanged
    xdt_c = layout.to_chunks(x_T * dt_T[..., None])  # [C, L, H, P]
    a_c = layout.to_chunks(dt_T * A.to(dtype))  # [C, L, H] log decay per step
    B_c = layout.to_chunks(B.reshape(-1, groups, state_size).to(dtype)).repeat_interleave(rep, dim=2)
    C_c = layout.to_chunks(C.reshape(-1, groups, state_size).to(dtype)).repeat_interleave(rep, dim=2)
    acum = a_c.cumsum(dim=1)  # [C, L, H]
    # intra-chunk: y_l = sum_{s <= l} (C_l . B_s) exp(acum_l - acum_s) dt_s x_s
    L = layout.chunk_size
    causal = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
    seg = (acum[:, :, None, :] - acum[:, None, :, :]).masked_fill(~causal[None, :, :, None], -math.inf).exp()
    scores = torch.einsum("clhn,cshn->clsh", C_c, B_c) * seg  # [C, L(l), L(s), H]
    y_c = torch.einsum("clsh,cshp->clhp", scores, xdt_c)
    # chunk states from zero: sum_s exp(acum_L - acum_s) dt_s x_s B_s^T -> [C, H, P, S]
    decay_to_end = (acum[:, -1:, :] - acum).exp()
    chunk_state = torch.einsum("clh,clhp,clhn->chpn", decay_to_end, xdt_c, B_c)
    chunk_decay = acum[:, -1, :].exp()  # [C, H]

    n_seq = len(lens)
    state0 = initial_states(initial_state, (n_seq, heads, head_dim, state_size), x_T, dtype)  # [N, H, P, S]

    decay_s, state_s = layout.steps(chunk_decay), layout.steps(chunk_state)

    def step(j: int, rows: slice, state: torch.Tensor) -> torch.Tensor:
        return decay_s[j][:, :, None, None] * state + state_s[j]

    entering, final = scan_states(layout, state0.index_select(0, layout.order), step)
    if entering:
        start = torch.cat(entering, dim=0)  # [C, H, P, S]
        y_c = y_c + torch.einsum("clhn,chpn,clh->clhp", C_c, start, acum.exp())
    y = layout.from_chunks(y_c) + _d_skip(x_T, D)
    return y.to(x.dtype).view(batch, length, heads, head_dim), (final.float() if dtype != torch.float64 else
                                                                 final) if output_final_state else None


def ssd_transition(dt: torch.Tensor, A: torch.Tensor, *, dt_bias: torch.Tensor | None = None,
                   dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, math.inf),
                   cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Total log-decay per sequence and head, [N, H]: ``S_end(S_in) = S_end(0) + exp(decay)[..., None, None] S_in``."""
    batch, length, heads = dt.shape
    dtype = compute_dtype(dt, A)
    a = (discretised_dt(dt, dt_bias, dt_softplus, dt_limit, dtype) * A.to(dtype)).reshape(-1, heads)
    if cu_seqlens is None:
        return a.view(batch, length, heads).sum(1)
    return segment_sums(a, cu_seqlens)


def ssd_chunk_scan_reference(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=False,
                             dt_limit=(0.0, math.inf), initial_state=None, cu_seqlens=None):
    """Float64 token-by-token reference; returns (y [B, T, H, P], final [N, H, P, S]) in fp64."""
    batch, length, heads, head_dim = x.shape
    groups, state_size = B.shape[2:]
    lens = seq_lens_of(cu_seqlens, None, batch, length)
    rep = heads // groups
    xs = x.reshape(-1, heads, head_dim).double()
    dts = discretised_dt(dt.reshape(-1, heads), dt_bias, dt_softplus, dt_limit, torch.float64)
    Bs = B.reshape(-1, groups, state_size).double().repeat_interleave(rep, dim=1)
    Cs = C.reshape(-1, groups, state_size).double().repeat_interleave(rep, dim=1)
    Ad = A.double()
    ys, finals, start = [], [], 0
    for s, n in enumerate(lens):
        h = (xs.new_zeros(heads, head_dim, state_size) if initial_state is None else initial_state[s].double())
        for t in range(start, start + n):
            h = torch.exp(dts[t] * Ad)[:, None, None] * h + dts[t][:, None, None] * xs[t][:, :, None] * Bs[t][:, None]
            ys.append((h * Cs[t][:, None, :]).sum(-1))
        finals.append(h)
        start += n
    y = torch.stack(ys) + _d_skip(xs, D) if ys else xs.new_zeros(xs.shape)
    return y.view(batch, length, heads, head_dim), torch.stack(finals)
