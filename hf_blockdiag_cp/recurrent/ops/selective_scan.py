"""Mamba1 selective scan per sequence, chunked, with state in and out (mamba / falcon_mamba / jamba).

Legend: ``T`` packed tokens, ``D`` channels, ``S`` state size, ``N`` sequences, ``C`` chunks, ``L`` chunk size.
State ``[N, D, S]``. With ``delta`` after ``+ delta_bias`` and ``softplus`` (when asked)::

    h_t = exp(delta_t A) h_{t-1} + delta_t u_t B_t,      y_t = (h_t C_t + D u_t) * silu(z_t)

The state is diagonal, so the chunked form is a two-level scan: a loop over the ``L`` positions that runs all chunks
at once from a zero state (their end states), a loop over chunk steps that carries each sequence's state to each
chunk start, and the positions again from those starts to read the outputs. Python does
``2 L + max chunks per sequence`` iterations, never one per token, and nothing of size ``[T, D, S]`` is kept but
what autograd saves.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import chunk_layout, compute_dtype, scan_states, segment_sums, seq_lens_of


def _delta(delta: torch.Tensor, delta_bias: torch.Tensor | None, delta_softplus: bool,
           dtype: torch.dtype) -> torch.Tensor:
    delta = delta.to(dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)
    return F.softplus(delta) if delta_softplus else delta


def _finish(y: torch.Tensor, u: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    if D is not None:
        y = y + u * D.to(y.dtype)
    if z is not None:
        y = y * F.silu(z.to(y.dtype))
    return y


def selective_scan(u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                   delta_bias: torch.Tensor | None = None, delta_softplus: bool = False, *,
                   initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                   cu_seqlens: torch.Tensor | None = None, seq_lens_host: list[int] | None = None,
                   chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked Mamba1 scan. u, delta, z: [B, T, D] (channels last); A: [D, S]; B, C: [B, T, S]; D, delta_bias: [D];
    initial_state: [N, D, S]. Returns (y [B, T, D] in u's dtype, final [N, D, S] fp32 or None)."""
    batch, length, channels = u.shape
    state_size = A.shape[-1]
    if A.shape != (channels, state_size) or B.shape != (batch, length, state_size) or C.shape != B.shape:
        raise ValueError(f"A must be [D, S], B and C [B, T, S]; got {tuple(A.shape)}, {tuple(B.shape)}, "
                         f"{tuple(C.shape)} for u {tuple(u.shape)}")
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    dtype = compute_dtype(u, delta, A, B, C, initial_state)
    layout = chunk_layout(lens, chunk_size, u.device)
    u_T = u.reshape(-1, channels).to(dtype)
    d_T = _delta(delta.reshape(-1, channels), delta_bias, delta_softplus, dtype)
    A_ = A.to(dtype)
    d_c = layout.to_chunks(d_T)  # [C, L, D]; padding slots have delta = 0: no decay, no input
    du_c = layout.to_chunks(d_T * u_T)  # [C, L, D]
    B_c = layout.to_chunks(B.reshape(-1, state_size).to(dtype))  # [C, L, S]
    C_c = layout.to_chunks(C.reshape(-1, state_size).to(dtype))

    def scan_positions(h: torch.Tensor, read: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """All chunks at once over the L positions from states h [C, D, S]; outputs y [C, D] per position."""
        ys = []
        for pos in range(layout.chunk_size):
            h = torch.exp(d_c[:, pos, :, None] * A_) * h + du_c[:, pos, :, None] * B_c[:, pos, None, :]
            if read:
                ys.append(torch.einsum("cds,cs->cd", h, C_c[:, pos]))
        return h, ys

    # pass 1: each chunk's end state from zero, and its total decay exp(A * sum delta)
    chunk_state, _ = scan_positions(du_c.new_zeros(layout.n_chunks, channels, state_size), read=False)
    chunk_decay = torch.exp(d_c.sum(dim=1)[:, :, None] * A_)  # [C, D, S]
    n_seq = len(lens)
    if initial_state is None:
        state0 = u_T.new_zeros(n_seq, channels, state_size)
    else:
        if initial_state.shape != (n_seq, channels, state_size):
            raise ValueError(f"initial_state must be [N={n_seq}, D={channels}, S={state_size}], "
                             f"got {tuple(initial_state.shape)}")
        state0 = initial_state.to(dtype)

    decay_s, state_s = layout.steps(chunk_decay), layout.steps(chunk_state)

    def step(j: int, rows: slice, state: torch.Tensor) -> torch.Tensor:
        return decay_s[j] * state + state_s[j]

    entering, final = scan_states(layout, state0.index_select(0, layout.order), step)
    if entering:
        # pass 2: rerun the positions from each chunk's true start state, reading the outputs
        _, ys = scan_positions(torch.cat(entering, 0), read=True)
        y_c = torch.stack(ys, dim=1)  # [C, L, D]
        y = _finish(layout.from_chunks(y_c), u_T, D, None if z is None else z.reshape(-1, channels))
    else:
        y = u_T.new_zeros(0, channels)
    y = y.to(u.dtype).view(batch, length, channels)
    if not output_final_state:
        return y, None
    return y, final if dtype == torch.float64 else final.float()


def selective_scan_transition(delta: torch.Tensor, A: torch.Tensor, *, delta_bias: torch.Tensor | None = None,
                              delta_softplus: bool = False, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Total log-decay [N, D, S] per sequence: ``S_end(S_in) = S_end(0) + exp(decay) * S_in``."""
    batch, length, channels = delta.shape
    dtype = compute_dtype(delta, A)
    a = _delta(delta.reshape(-1, channels), delta_bias, delta_softplus, dtype)[:, :, None] * A.to(dtype)
    if cu_seqlens is None:
        return a.view(batch, length, *A.shape).sum(1)
    return segment_sums(a, cu_seqlens)


def selective_scan_reference(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                             initial_state=None, cu_seqlens=None):
    """Float64 token-by-token reference; returns (y [B, T, D], final [N, D, S]) in fp64."""
    batch, length, channels = u.shape
    lens = seq_lens_of(cu_seqlens, None, batch, length)
    us = u.reshape(-1, channels).double()
    ds = _delta(delta.reshape(-1, channels), delta_bias, delta_softplus, torch.float64)
    Bs, Cs, Ad = B.reshape(-1, A.shape[-1]).double(), C.reshape(-1, A.shape[-1]).double(), A.double()
    ys, finals, start = [], [], 0
    for s, n in enumerate(lens):
        h = us.new_zeros(A.shape) if initial_state is None else initial_state[s].double()
        for t in range(start, start + n):
            h = torch.exp(ds[t][:, None] * Ad) * h + (ds[t] * us[t])[:, None] * Bs[t][None, :]
            ys.append(h @ Cs[t])
        finals.append(h)
        start += n
    y = torch.stack(ys) if ys else us.new_zeros(us.shape)
    y = _finish(y, us, None if D is None else D.double(), None if z is None else z.reshape(-1, channels).double())
    return y.view(batch, length, channels), torch.stack(finals)
