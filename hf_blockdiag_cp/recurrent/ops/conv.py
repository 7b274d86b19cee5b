"""Short causal depthwise convolution per sequence (the ``causal_conv1d_fn`` of Mamba/GDN/KDA/LFM2 layers).

Legend: ``T`` packed tokens, ``C`` channels, ``K`` kernel width, ``N`` sequences. The state of a sequence is its
last ``K - 1`` inputs ``[N, C, K - 1]`` (oldest first, zeros on the left when the sequence is shorter), so a
window only ever sees its own sequence and that sequence's ``initial_state``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._layout import compute_dtype, seq_lens_of

ACTIVATIONS = (None, "silu", "swish")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise NotImplementedError(f"causal_conv1d activation={activation!r}: supported are {ACTIVATIONS}")


def _extended_index(seq_lens: list[int], width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                                   torch.Tensor]:
    """Rows of ``cat([x (T), state rows (N * (K-1))])`` laid out as ``[state_s, x_s]`` per sequence.

    Returns (ext_idx [T + N*(K-1)], out_idx [T]: the valid-conv output position of each token,
    last_idx [N, K-1]: the ext positions of each sequence's last K-1 inputs).
    """
    total = sum(seq_lens)
    ext, out, last = [], [], []
    start = 0
    for s, n in enumerate(seq_lens):
        base = len(ext)
        ext.extend(range(total + s * (width - 1), total + (s + 1) * (width - 1)))
        ext.extend(range(start, start + n))
        out.extend(range(base, base + n))  # valid conv output i reads ext[i .. i + K - 1]
        last.append(list(range(base + n, base + n + width - 1)))
        start += n
    as_t = lambda v: torch.tensor(v, dtype=torch.long).to(device)  # noqa: E731
    return as_t(ext), as_t(out), as_t(last).view(len(seq_lens), width - 1)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  seq_lens_host: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv restarted at each sequence start.

    x: [B, T, C] channels last; weight: [C, K]; bias: [C]; initial_state: [N, C, K-1] (N = B, or the number of
    sequences in ``cu_seqlens`` when B == 1). Computed in fp32 (fp64 for fp64 inputs); returns
    (y [B, T, C] in x's dtype, final_state [N, C, K-1] or None).
    """
    batch, length, channels = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width):
        raise ValueError(f"weight must be [C={channels}, K], got {tuple(weight.shape)}")
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    dtype = compute_dtype(x, weight, initial_state)
    x_TC = x.reshape(batch * length, channels).to(dtype)
    n_seq = len(lens)
    if width == 1:  # no window, no state
        y = x_TC * weight[:, 0].to(dtype) + (0 if bias is None else bias.to(dtype))
        fs = x.new_zeros((n_seq, channels, 0), dtype=torch.float32) if output_final_state else None
        return _activate(y, activation).to(x.dtype).view(batch, length, channels), fs
    if initial_state is None:
        state_rows = x_TC.new_zeros(n_seq * (width - 1), channels)
    else:
        if initial_state.shape != (n_seq, channels, width - 1):
            raise ValueError(f"initial_state must be [N={n_seq}, C={channels}, K-1={width - 1}], "
                             f"got {tuple(initial_state.shape)}")
        state_rows = initial_state.to(dtype).transpose(1, 2).reshape(n_seq * (width - 1), channels)
    ext_idx, out_idx, last_idx = _extended_index(lens, width, x.device)
    ext_EC = torch.cat([x_TC, state_rows], dim=0).index_select(0, ext_idx)
    w = weight.to(dtype).unsqueeze(1)  # [C, 1, K]
    if batch * length:
        y_CE = F.conv1d(ext_EC.t().unsqueeze(0), w, None if bias is None else bias.to(dtype), groups=channels)[0]
        y_TC = y_CE.t().index_select(0, out_idx)
    else:  # only empty sequences: nothing to convolve, the states pass through
        y_TC = x_TC
    y = _activate(y_TC, activation).to(x.dtype).view(batch, length, channels)
    final = None
    if output_final_state:
        final = ext_EC.index_select(0, last_idx.view(-1)).view(n_seq, width - 1, channels).transpose(1, 2)
        final = final.to(torch.promote_types(dtype, torch.float32)).contiguous()
    return y, final


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                            activation: str | None = None, *, initial_state: torch.Tensor | None = None,
                            cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 token-by-token reference (same shapes as :func:`causal_conv1d`); returns (y fp64, final fp64)."""
    batch, length, channels = x.shape
    width = weight.shape[-1]
    lens = seq_lens_of(cu_seqlens, None, batch, length)
    xs = x.reshape(-1, channels).double()
    w, b = weight.double(), None if bias is None else bias.double()
    ys, finals, start = [], [], 0
    for s, n in enumerate(lens):
        window = (x.new_zeros(channels, width - 1, dtype=torch.float64) if initial_state is None
                  else initial_state[s].double())
        for t in range(start, start + n):
            window = torch.cat([window, xs[t][:, None]], dim=1)  # [C, K]
            y = (window * w).sum(1) + (0 if b is None else b)
            ys.append(_activate(y, activation))
            window = window[:, 1:]
        finals.append(window)
        start += n
    y = torch.stack(ys).view(batch, length, channels) if ys else x.new_zeros(x.shape, dtype=torch.float64)
    return y, torch.stack(finals)
