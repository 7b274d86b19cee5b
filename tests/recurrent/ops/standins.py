"""CPU stand-ins for the GPU libraries the recurrent adapters call, built on this package's float64 references.

Each implements the documented contract of the real entry point and is stricter where the real kernel would
trust its input: flash-linear-attention ``chunk_gated_delta_rule`` / ``chunk_kda`` (B == 1 with int64
``cu_seqlens``, one fp32 ``initial_state`` per sequence, equal q/k/v head counts), causal-conv1d
``causal_conv1d_fn`` (x ``[B, D, L]``, widths 2..4), mamba_ssm ``mamba_chunk_scan_combined`` (``seq_idx``
resets; ``initial_states`` / final states per batch ROW, refused together with ``seq_idx`` as in the versions
that cannot combine them) and ``selective_scan_fn`` (no varlen, no initial state, last state without a gradient).
Calls are recorded in ``calls``. Install with :func:`install` (a pytest ``monkeypatch``).
"""

from __future__ import annotations

import math
import sys
import types

import torch

from hf_blockdiag_cp.recurrent import ops


class ContractError(RuntimeError):
    """An argument the real library would reject (or silently misread)."""


def _fail(msg: str):
    raise ContractError(msg)


def _cu_host(cu, total):
    if cu.dtype != torch.int64:
        _fail(f"cu_seqlens must be a LongTensor, got {cu.dtype}")
    host = [int(c) for c in cu.tolist()]
    if host[0] != 0 or host[-1] != total or any(b < a for a, b in zip(host, host[1:])):
        _fail(f"bad cu_seqlens {host} for {total} tokens")
    return host


def _cast_back(o, like):
    return o.to(like.dtype)


def _fla(per_channel: bool, calls: list):
    def fn(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
        if kwargs.get("use_gate_in_kernel"):
            _fail("the stand-in models use_gate_in_kernel=False only")
        if not (q.shape[2] == k.shape[2] == v.shape[2]):
            _fail(f"head counts differ: q {q.shape[2]}, k {k.shape[2]}, v {v.shape[2]}")
        want_g = (*v.shape[:3], k.shape[-1]) if per_channel else tuple(v.shape[:3])
        if tuple(g.shape) != want_g or tuple(beta.shape) != tuple(v.shape[:3]):
            _fail(f"g {tuple(g.shape)} / beta {tuple(beta.shape)} do not match v {tuple(v.shape)}")
        n = q.shape[0]
        if cu_seqlens is not None:
            if q.shape[0] != 1:
                _fail("cu_seqlens needs B == 1")
            n = len(_cu_host(cu_seqlens, q.shape[1])) - 1
        if initial_state is not None and (initial_state.dtype != torch.float32 or
                                          initial_state.shape != (n, v.shape[2], k.shape[-1], v.shape[-1])):
            _fail(f"initial_state must be fp32 [N={n}, H, K, V], got {initial_state.dtype} "
                  f"{tuple(initial_state.shape)}")
        calls.append(("chunk_kda" if per_channel else "chunk_gated_delta_rule", cu_seqlens is not None))
        o, final = ops.delta_rule_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                            cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return _cast_back(o, q), final.float() if output_final_state else None
    return fn


def _causal_conv1d_fn(calls: list):
    def fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
           final_states_out=None, activation=None):
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        if x.dim() != 3 or weight.shape != (x.shape[1], weight.shape[-1]) or not 2 <= weight.shape[-1] <= 4:
            _fail(f"x must be [B, D, L] and weight [D, 2..4], got {tuple(x.shape)}, {tuple(weight.shape)}")
        if (seq_idx is not None or initial_states is not None) and x.stride(1) != 1:
            _fail("seq_idx / initial_states need a channel-last x (x.stride(1) == 1)")
        calls.append(("causal_conv1d_fn", seq_idx is not None))
        act = None if activation is None else "silu"
        outs = []
        for b in range(x.shape[0]):
            xb = x[b].t().unsqueeze(0)
            cu = None
            if seq_idx is not None:
                ids = seq_idx[b].tolist()
                cu = torch.tensor([0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)])
            s0 = None if initial_states is None else initial_states[b:b + 1]
            y, _ = ops.causal_conv1d_reference(xb, weight, bias, act, initial_state=s0, cu_seqlens=cu)
            outs.append(y[0].t())
        return torch.stack(outs).to(x.dtype)
    return fn


def _mamba_chunk_scan_combined(calls: list):
    def fn(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
           cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, math.inf), return_final_states=False,
           return_varlen_states=False):
        if initial_states is not None and seq_idx is not None:
            _fail("initial_states together with seq_idx is not supported")
        if z is not None or return_varlen_states:
            _fail("the stand-in models z=None and return_varlen_states=False only")
        batch = x.shape[0]
        if initial_states is not None and initial_states.shape != (batch, *x.shape[2:], B.shape[-1]):
            _fail(f"initial_states must be [B, H, P, S] (one per batch row), got {tuple(initial_states.shape)}")
        calls.append(("mamba_chunk_scan_combined", seq_idx is not None, initial_states is not None))
        ys, finals = [], []
        for b in range(batch):
            cu = None
            if seq_idx is not None:
                ids = seq_idx[b].tolist()
                cu = torch.tensor([0] + [i for i in range(1, len(ids)) if ids[i] != ids[i - 1]] + [len(ids)])
            n = 1 if cu is None else len(cu) - 1
            s0 = None
            if initial_states is not None:  # the row's state enters its first sequence only
                s0 = torch.cat([initial_states[b:b + 1], initial_states.new_zeros(n - 1, *initial_states.shape[1:])])
            y, final = ops.ssd_chunk_scan_reference(x[b:b + 1], dt[b:b + 1], A, B[b:b + 1], C[b:b + 1], D=D,
                                                    dt_bias=dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                                                    initial_state=s0, cu_seqlens=cu)
            ys.append(y[0])
            finals.append(final[-1])  # the state at the end of the row
        y = torch.stack(ys).to(x.dtype)
        return (y, torch.stack(finals).float()) if return_final_states else y
    return fn


def _selective_scan_fn(calls: list):
    def fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False, return_last_state=False):
        if u.dim() != 3 or B.dim() != 3 or B.shape[2] != u.shape[2]:
            _fail(f"u must be [B, D, L] and B [B, N, L], got {tuple(u.shape)}, {tuple(B.shape)}")
        calls.append(("selective_scan_fn",))
        t = lambda a: None if a is None else a.transpose(1, 2)  # noqa: E731
        y, last = ops.selective_scan_reference(t(u), t(delta), A, t(B), t(C), D, t(z), delta_bias, delta_softplus)
        y = t(y).to(u.dtype)
        return (y, last.float().detach()) if return_last_state else y  # the real last state has no gradient
    return fn


def install(monkeypatch) -> list:
    """Put the stand-in modules in ``sys.modules``; returns the shared ``calls`` record."""
    calls: list = []

    def module(name: str, **attrs) -> types.ModuleType:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)
        return mod

    module("fla")
    module("fla.ops")
    module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=_fla(False, calls))
    module("fla.ops.kda", chunk_kda=_fla(True, calls))
    module("causal_conv1d", causal_conv1d_fn=_causal_conv1d_fn(calls))
    module("mamba_ssm")
    module("mamba_ssm.ops")
    module("mamba_ssm.ops.triton")
    module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=_mamba_chunk_scan_combined(calls))
    module("mamba_ssm.ops.selective_scan_interface", selective_scan_fn=_selective_scan_fn(calls))
    return calls
