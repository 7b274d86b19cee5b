"""Short causal depthwise convolution per sequence (the ``causal_conv1d_fn`` of Mamba/GDN/KDA/LFM2 layers).

Legend: ``T`` packed tokens, ``C`` channels, ``K`` kernel width, ``N`` sequences. The state of a sequence is its
last ``K - 1`` inputs ``[N, C, K - 1]`` (oldest first, zeros on the left when the sequence is shorter), so a
window only ever sees its own sequence and that sequence's ``initial_state``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...errors import Refusal
from ._layout import compute_dtype, seq_lens_of

ACTIVATIONS = (None, "silu", "swish")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise Refusal(f"causal_conv1d activation={activation!r}: supported are {ACTIVATIONS}")


def _boundary_index(seq_lens: list[int], width: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where the tokens whose window reaches back past their sequence start (the first K-1 of each sequence) and
    the final windows read from, as rows of ``small = cat([x[x_rows], state rows (N * (K-1))])``.

    Returns (tokens [M], windows [M, K]: the small row each tap of those tokens reads, oldest first,
    last [N, K-1]: the small rows of each sequence's last K-1 inputs (its final state), x_rows [R]).
    """
    x_rows: dict[int, int] = {}  # packed row -> position in small
    tokens, windows, last = [], [], []
    start = 0
    for s, n in enumerate(seq_lens):
        def ref(q: int) -> tuple[bool, int]:  # q: position in the sequence, negative = inside the incoming state
            if q >= 0:
                return True, x_rows.setdefault(start + q, len(x_rows))
            return False, s * (width - 1) + width - 1 + q

        for p in range(min(n, width - 1)):
            tokens.append(start + p)
            windows.append([ref(p - (width - 1) + k) for k in range(width)])
        last.append([ref(n - (width - 1) + k) for k in range(width - 1)])
        start += n
    n_x = len(x_rows)
    resolve = lambda rs: [i if is_x else n_x + i for is_x, i in rs]  # noqa: E731
    as_t = lambda v: torch.tensor(v, dtype=torch.long).to(device)  # noqa: E731
    return (as_t(tokens), as_t([resolve(w) for w in windows]).view(-1, width),
            as_t([resolve(w) for w in last]).view(len(seq_lens), width - 1), as_t(list(x_rows)))


def torch_row_conv(x_CT: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pre-activation causal depthwise conv of one row as ONE sequence: [C, T] -> [C, T]."""
    width = weight.shape[-1]
    out = F.conv1d(x_CT.unsqueeze(0), weight.unsqueeze(1), bias, padding=width - 1, groups=x_CT.shape[0])
    return out[0, :, :x_CT.shape[1]]


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  activation: str | None = None, *, initial_state: torch.Tensor | None = None,
                  output_final_state: bool = False, cu_seqlens: torch.Tensor | None = None,
                  seq_lens_host: list[int] | None = None,
                  row_conv=torch_row_conv) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Depthwise causal conv restarted at each sequence start.

    x: [B, T, C] channels last; weight: [C, K]; bias: [C]; initial_state: [N, C, K-1] (N = B, or the number of
    sequences in ``cu_seqlens`` when B == 1). Computed in fp32 (fp64 for fp64 inputs); returns
    (y [B, T, C] in x's dtype, a channels-first strided view like the models' own ``transpose``;
    final_state [N, C, K-1] or None).

    One convolution over the whole row (as the unpacked fallback does), then the first K-1 outputs of each
    sequence, whose windows reached into the previous sequence, are recomputed from the sequence's own state.
    ``row_conv(x [C, T], weight [C, K], bias) -> [C, T]`` does the row convolution (a GPU library's kernel in
    :mod:`.adapters`).
    """
    batch, length, channels = x.shape
    width = weight.shape[-1]
    if weight.shape != (channels, width):
        raise ValueError(f"weight must be [C={channels}, K], got {tuple(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise Refusal(f"causal_conv1d activation={activation!r}: supported are {ACTIVATIONS}")
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    dtype = compute_dtype(x, weight, initial_state)
    x_TC = x.reshape(batch * length, channels).to(dtype)
    n_seq = len(lens)
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    if width == 1:  # no window, no state
        y = x_TC * w[:, 0] + (0 if b is None else b)
        fs = x.new_zeros((n_seq, channels, 0), dtype=torch.float32) if output_final_state else None
        return _activate(y, activation).to(x.dtype).view(batch, length, channels), fs
    if initial_state is None:
        state_rows = x_TC.new_zeros(n_seq * (width - 1), channels)
    else:
        if initial_state.shape != (n_seq, channels, width - 1):
            raise ValueError(f"initial_state must be [N={n_seq}, C={channels}, K-1={width - 1}], "
                             f"got {tuple(initial_state.shape)}")
        state_rows = initial_state.to(dtype).transpose(1, 2).reshape(n_seq * (width - 1), channels)
    tokens, windows, last, x_rows = _boundary_index(lens, width, x.device)
    x_CT = x_TC.t()  # channels first, like the layers' own transpose; gathers on it keep the gradient layout
    small = torch.cat([x_CT.index_select(1, x_rows).t(), state_rows], dim=0)  # the few rows the boundaries read
    # only empty sequences: nothing to convolve, the states pass through
    y_CT = row_conv(x_CT, w, b) if len(x_TC) else x_CT
    if tokens.numel():
        fixed = torch.einsum("mkc,ck->cm", small[windows], w)  # [C, M]
        y_CT = y_CT.index_copy(1, tokens, fixed if b is None else fixed + b[:, None])
    y = _activate(y_CT, activation).to(x.dtype).t().reshape(batch, length, channels)
    final = None
    if output_final_state:
        final = small[last.view(-1)].view(n_seq, width - 1, channels).transpose(1, 2)
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
