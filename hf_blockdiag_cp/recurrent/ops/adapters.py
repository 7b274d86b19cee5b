"""Thin adapters from the recurrent-op contract to the GPU libraries (imported lazily, never on CPU).

Same signatures and results as the pure-PyTorch ops in this package; the integration asks
``*_unavailable_reason(...)`` first and falls back to the torch op (or refuses) when it returns a reason.

- flash-linear-attention: ``chunk_gated_delta_rule`` / ``chunk_kda`` take ``cu_seqlens``, one ``initial_state``
  per sequence and return one final state per sequence, differentiably: passed through as they are (query/key
  heads are repeated to the value heads here, so the library's GVA support is not needed).
- causal-conv1d: ``causal_conv1d_fn`` convolves the row as one sequence (no ``seq_idx``: its layout and version
  constraints are avoided); the first K-1 outputs of each sequence and the final windows are then computed exactly
  by the torch op's boundary step (``conv.causal_conv1d(row_conv=...)``), initial states included.
- mamba_ssm ``mamba_chunk_scan_combined``: without states, the packed row runs with ``seq_idx`` (no padding).
  With an initial state or a final state, sequences are padded into a batch of rows, one per sequence (the library
  has one ``initial_states`` / final state per batch row, and ``return_varlen_states`` is not differentiable);
  ``dt`` is discretised here so that padding steps carry the state unchanged (dt = 0).
- mamba_ssm ``selective_scan_fn`` (Mamba1): no varlen, no initial state, a last state without a gradient. Sequences
  are padded into a batch; an initial state, or a final state that must carry a gradient, is unavailable.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F

from ...errors import Refusal
from . import conv as _conv
from ._layout import seq_lens_of

HALF_OR_FLOAT = (torch.float16, torch.bfloat16, torch.float32)


def _missing(module: str, pip_name: str) -> str | None:
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"{pip_name} is not installed ({exc}); pip install {pip_name}"
    return None


def _device_dtype(name: str, x: torch.Tensor) -> str | None:
    if x.device.type != "cuda":
        return f"{name} runs on CUDA devices only; the inputs are on {x.device}"
    if x.dtype not in HALF_OR_FLOAT:
        return f"{name} has no {x.dtype} kernels (fp16, bf16, fp32)"
    return None


# ---------------------------------------------------------------- flash-linear-attention (GDN, KDA)

def fla_unavailable_reason(q: torch.Tensor, *, kda: bool = False) -> str | None:
    """Why flash-linear-attention cannot run this GDN/KDA call, or None."""
    module = "fla.ops.kda" if kda else "fla.ops.gated_delta_rule"
    return _device_dtype("flash-linear-attention", q) or _missing(module, "flash-linear-attention")


def _fla_call(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seq_lens_host,
              use_qk_l2norm_in_kernel):
    heads = v.shape[2]
    if q.shape[2] != heads:  # repeat query/key heads to the value heads (GVA), as transformers' fallback does
        q = q.repeat_interleave(heads // q.shape[2], dim=2)
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
    kwargs = {}
    if cu_seqlens is not None:
        if seq_lens_host is not None:  # checked on the host only when the caller has the lengths (no sync)
            seq_lens_of(cu_seqlens, seq_lens_host, q.shape[0], q.shape[1])
        kwargs["cu_seqlens"] = cu_seqlens.long()
    o, final = fn(q, k, v, g, beta, scale=scale, initial_state=None if initial_state is None else initial_state.float(),
                  output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kwargs)
    return o.to(q.dtype), None if final is None else final.float()


def fla_chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64, seq_lens_host=None):
    """:func:`..delta_rule.chunk_gated_delta_rule` through ``fla.ops.gated_delta_rule.chunk_gated_delta_rule``
    (the library picks its own chunk size; ``chunk_size`` is accepted for the shared signature)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    return _fla_call(chunk_gated_delta_rule, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     seq_lens_host, use_qk_l2norm_in_kernel)


def fla_chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm_in_kernel=False, chunk_size=64, seq_lens_host=None):
    """:func:`..delta_rule.chunk_kda` through ``fla.ops.kda.chunk_kda`` (g: log decay per key channel; the
    library's in-kernel gate, ``use_gate_in_kernel``, stays off)."""
    from fla.ops.kda import chunk_kda
    return _fla_call(chunk_kda, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                     seq_lens_host, use_qk_l2norm_in_kernel)


# ---------------------------------------------------------------- causal-conv1d

def causal_conv1d_unavailable_reason(x: torch.Tensor, weight: torch.Tensor, activation: str | None) -> str | None:
    """Why causal-conv1d cannot run this call, or None (widths 2..4, activation None/silu/swish)."""
    if not 2 <= weight.shape[-1] <= 4:
        return f"causal-conv1d supports kernel widths 2 to 4, got {weight.shape[-1]}"
    if activation not in _conv.ACTIVATIONS:
        return f"causal-conv1d supports activations {_conv.ACTIVATIONS}, got {activation!r}"
    return _device_dtype("causal-conv1d", x) or _missing("causal_conv1d", "causal-conv1d")


def _library_row_conv(x_CT: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from causal_conv1d import causal_conv1d_fn
    return causal_conv1d_fn(x_CT.unsqueeze(0), weight, bias, activation=None)[0]  # [1, C, T] -> [C, T]


def cc_causal_conv1d(x, weight, bias=None, activation=None, *, initial_state=None, output_final_state=False,
                     cu_seqlens=None, seq_lens_host=None):
    """:func:`..conv.causal_conv1d` with the row convolution done by ``causal_conv1d.causal_conv1d_fn``."""
    return _conv.causal_conv1d(x, weight, bias, activation, initial_state=initial_state,
                               output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                               seq_lens_host=seq_lens_host, row_conv=_library_row_conv)


# ---------------------------------------------------------------- mamba_ssm (Mamba2 SSD, Mamba1)

def ssd_unavailable_reason(x: torch.Tensor) -> str | None:
    """Why mamba_ssm's ``mamba_chunk_scan_combined`` cannot run this call, or None."""
    return _device_dtype("mamba_ssm", x) or _missing("mamba_ssm.ops.triton.ssd_combined", "mamba-ssm")


def _padded_index(lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gather [N * Lmax] rows of cat([x, zero row]) for a right-padded batch, unpad [T] slots, Lmax)."""
    total, longest = sum(lens), max(lens, default=0)
    gather = torch.full((len(lens), longest), total, dtype=torch.long)
    unpad, start = [], 0
    for s, n in enumerate(lens):
        gather[s, :n] = torch.arange(start, start + n)
        unpad.extend(range(s * longest, s * longest + n))
        start += n
    return gather.view(-1).to(device), torch.tensor(unpad, dtype=torch.long).to(device), longest


def _pad_rows(t_T: torch.Tensor, gather: torch.Tensor, n: int, longest: int) -> torch.Tensor:
    padded = torch.cat([t_T, t_T.new_zeros((1,) + tuple(t_T.shape[1:]))], dim=0).index_select(0, gather)
    return padded.view((n, longest) + tuple(t_T.shape[1:]))


def _seq_idx(lens: list[int], device: torch.device) -> torch.Tensor:
    ids = torch.repeat_interleave(torch.arange(len(lens), dtype=torch.int32), torch.tensor(lens, dtype=torch.long))
    return ids.view(1, -1).to(device)


def ms_ssd_chunk_scan(x, dt, A, B, C, *, D=None, dt_bias=None, dt_softplus=False, dt_limit=(0.0, math.inf),
                      initial_state=None, output_final_state=False, cu_seqlens=None, seq_lens_host=None,
                      chunk_size=256):
    """:func:`..ssd.ssd_chunk_scan` through ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``."""
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    batch, length, heads, head_dim = x.shape
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    if initial_state is None and not output_final_state:
        seq_idx = None if cu_seqlens is None else _seq_idx(lens, x.device)
        y = mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, seq_idx=seq_idx,
                                      dt_softplus=dt_softplus, dt_limit=dt_limit)
        return y.to(x.dtype), None
    # one batch row per sequence; dt discretised here so that padding (dt = 0) leaves the state unchanged
    dt_T = dt.reshape(-1, heads).float()
    if dt_bias is not None:
        dt_T = dt_T + dt_bias.float()
    dt_T = (F.softplus(dt_T) if dt_softplus else dt_T).clamp(min=dt_limit[0], max=dt_limit[1])
    gather, unpad, longest = _padded_index(lens, x.device)
    n_seq = len(lens)
    if longest == 0:
        state = x.new_zeros(n_seq, heads, head_dim, B.shape[-1], dtype=torch.float32)
        return x.new_zeros(x.shape), (state if initial_state is None else initial_state.float())
    pad = lambda t: _pad_rows(t.reshape(-1, *t.shape[2:]), gather, n_seq, longest)  # noqa: E731
    y, final = mamba_chunk_scan_combined(
        pad(x), _pad_rows(dt_T.to(x.dtype), gather, n_seq, longest), A, pad(B), pad(C), chunk_size, D=D,
        initial_states=None if initial_state is None else initial_state.float(), return_final_states=True)
    y = y.reshape(n_seq * longest, heads, head_dim).index_select(0, unpad).view(batch, length, heads, head_dim)
    return y.to(x.dtype), final.float() if output_final_state else None


def selective_scan_unavailable_reason(u: torch.Tensor, *, initial_state: torch.Tensor | None = None,
                                      final_state_needs_grad: bool = False) -> str | None:
    """Why mamba_ssm's ``selective_scan_fn`` cannot run this call, or None."""
    if initial_state is not None:
        return "mamba_ssm selective_scan_fn takes no initial state (a continued document needs the torch op)"
    if final_state_needs_grad:
        return "mamba_ssm selective_scan_fn returns its last state without a gradient (state passing needs one)"
    return _device_dtype("mamba_ssm", u) or _missing("mamba_ssm.ops.selective_scan_interface", "mamba-ssm")


def ms_selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, *,
                      initial_state=None, output_final_state=False, cu_seqlens=None, seq_lens_host=None,
                      chunk_size=64):
    """:func:`..selective_scan.selective_scan` through ``mamba_ssm``'s ``selective_scan_fn`` (one padded batch row
    per sequence; the final state carries no gradient, an initial state is refused)."""
    reason = selective_scan_unavailable_reason(u, initial_state=initial_state)
    if initial_state is not None:
        raise Refusal(reason)
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    batch, length, channels = u.shape
    lens = seq_lens_of(cu_seqlens, seq_lens_host, batch, length)
    d_T = delta.reshape(-1, channels).float()
    if delta_bias is not None:
        d_T = d_T + delta_bias.float()
    d_T = F.softplus(d_T) if delta_softplus else d_T  # padding then has delta = 0: the state passes unchanged
    gather, unpad, longest = _padded_index(lens, u.device)
    n_seq = len(lens)
    if longest == 0:
        return u.new_zeros(u.shape), u.new_zeros(n_seq, *A.shape, dtype=torch.float32) if output_final_state else None
    chan_first = lambda t: _pad_rows(t.reshape(-1, t.shape[-1]), gather, n_seq, longest).transpose(1, 2)  # noqa
    out = selective_scan_fn(chan_first(u), chan_first(d_T.to(u.dtype)), A, chan_first(B), chan_first(C),
                            D=None if D is None else D.float(), z=None if z is None else chan_first(z),
                            return_last_state=output_final_state)
    y, last = out if output_final_state else (out, None)
    y = y.transpose(1, 2).reshape(n_seq * longest, channels).index_select(0, unpad).view(batch, length, channels)
    return y.to(u.dtype), None if last is None else last.float()


# ---------------------------------------------------------------- one table for the integration

LIBRARY_OPS = {
    "causal_conv1d": cc_causal_conv1d,
    "ssd_chunk_scan": ms_ssd_chunk_scan,
    "chunk_gated_delta_rule": fla_chunk_gated_delta_rule,
    "chunk_kda": fla_chunk_kda,
    "selective_scan": ms_selective_scan,
}


def library_unavailable_reason(op: str, x: torch.Tensor, *, weight: torch.Tensor | None = None,
                               activation: str | None = None, initial_state: torch.Tensor | None = None,
                               final_state_needs_grad: bool = False) -> str | None:
    """Why ``LIBRARY_OPS[op]`` cannot run a call with first input ``x`` (and, for the conv, its ``weight`` and
    ``activation``; for Mamba1, whether an initial state is given or the final state needs a gradient), or None.
    The integration asks this on every rank before any collective and uses the torch op otherwise."""
    if op == "causal_conv1d":
        if weight is None:
            raise ValueError("library_unavailable_reason('causal_conv1d', ...) needs weight=")
        return causal_conv1d_unavailable_reason(x, weight, activation)
    if op == "ssd_chunk_scan":
        return ssd_unavailable_reason(x)
    if op in ("chunk_gated_delta_rule", "chunk_kda"):
        return fla_unavailable_reason(x, kda=op == "chunk_kda")
    if op == "selective_scan":
        return selective_scan_unavailable_reason(x, initial_state=initial_state,
                                                 final_state_needs_grad=final_state_needs_grad)
    raise Refusal(f"no recurrent op {op!r}; known: {sorted(LIBRARY_OPS)}")
