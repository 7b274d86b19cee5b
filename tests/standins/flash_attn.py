"""A pure-PyTorch stand-in for the ``flash_attn`` package (flash-attn 2 public API).

Implements the documented contract of ``flash_attn_varlen_func`` and ``flash_attn_func``:
causal attention is bottom-right aligned (query ``i`` of a segment with ``Sq`` queries and ``Sk``
keys has its diagonal at key ``i + Sk - Sq``), ``window_size=(left, right)`` counts keys around
that diagonal (``-1`` = unbounded), GQA by head count, ``softcap`` applied to the scaled scores.

It is *stricter* than the real kernel, which trusts its metadata (a bad ``cu_seqlens`` entry is an
illegal memory access on the GPU, not an exception): every index the kernel would read is
checked, and ``max_seqlen_q/k`` must be the **exact** maxima of the segment lengths (the real
kernel only needs upper bounds, but an inexact value means the caller computed it wrongly).
Violations raise :class:`ContractError`. Deviations from the real package, on purpose: float32
and float64 inputs are accepted (CPU tests at tight tolerance), and the tensors may live on CPU.

Every call is recorded in the module's ``calls`` list as a :class:`FlashCall`; a fresh module per
test comes from :func:`make_module`.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import NoReturn

import torch

from ._contract import check_cu_seqlens
from ._math import segment_attention

HALF_DTYPES = (torch.float16, torch.bfloat16)
STANDIN_DTYPES = HALF_DTYPES + (torch.float32, torch.float64)


class ContractError(RuntimeError):
    """An argument the real kernel would trust (or reject) is wrong."""


@dataclass(frozen=True)
class FlashCall:
    """One recorded launch (``cu_seqlens_*`` read back to host tuples; ``None`` for ``flash_attn_func``)."""

    fn: str
    q_shape: tuple[int, ...]
    k_shape: tuple[int, ...]
    v_shape: tuple[int, ...]
    dtype: torch.dtype
    cu_seqlens_q: tuple[int, ...] | None
    cu_seqlens_k: tuple[int, ...] | None
    cu_seqlens_dtype: torch.dtype | None
    max_seqlen_q: int
    max_seqlen_k: int
    dropout_p: float
    softmax_scale: float | None
    causal: bool
    window_size: tuple[int, int]
    softcap: float
    deterministic: bool
    return_attn_probs: bool


def _fail(msg: str) -> NoReturn:
    raise ContractError(f"flash_attn stand-in: {msg}")


def _check_tensor(name: str, t: object, ndim: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        _fail(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.stride(-1) != 1:
        _fail(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    return t


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed_dtypes: tuple[torch.dtype, ...]) -> None:
    if not q.dtype == k.dtype == v.dtype:
        _fail(f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in allowed_dtypes:
        _fail(f"dtype {q.dtype} not supported (allowed: {allowed_dtypes})")
    if not q.device == k.device == v.device:
        _fail(f"q/k/v devices differ: {q.device}, {k.device}, {v.device}")
    num_q_heads, num_k_heads = q.shape[-2], k.shape[-2]
    if v.shape[-2] != num_k_heads or v.shape[:-2] != k.shape[:-2]:
        _fail(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if num_k_heads == 0 or num_q_heads % num_k_heads:
        _fail(f"number of query heads {num_q_heads} must be divisible by key/value heads {num_k_heads}")
    head_dim = q.shape[-1]
    if k.shape[-1] != head_dim or v.shape[-1] != head_dim:
        _fail(f"flash-attn 2 needs equal head dims, got q {head_dim}, k {k.shape[-1]}, v {v.shape[-1]}")
    if head_dim > 256:
        _fail(f"head_dim {head_dim} > 256")


def _check_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs) -> tuple[int, int]:
    if not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        _fail(f"dropout_p={dropout_p!r} must be a float in [0, 1)")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        _fail(f"softmax_scale={softmax_scale!r} must be None or a positive float")
    for name, flag in (("causal", causal), ("deterministic", deterministic), ("return_attn_probs", return_attn_probs)):
        if not isinstance(flag, bool):
            _fail(f"{name}={flag!r} must be a bool")
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window_size)):
        _fail(f"window_size={window_size!r} must be a pair of ints >= -1")
    if not isinstance(softcap, (int, float)) or softcap < 0:
        _fail(f"softcap={softcap!r} must be a float >= 0")
    if alibi_slopes is not None:
        raise NotImplementedError("flash_attn stand-in: alibi_slopes is not implemented")
    return int(window_size[0]), int(window_size[1])


def _check_max(name: str, value: object, cu: tuple[int, ...]) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        _fail(f"{name} must be a Python int, got {type(value).__name__}")
    exact = max((b - a for a, b in zip(cu, cu[1:])), default=0)
    if value != exact:
        _fail(f"{name}={value} is not the exact maximum segment length {exact}")
    return value


def make_module(allowed_dtypes: tuple[torch.dtype, ...] = STANDIN_DTYPES) -> types.ModuleType:
    """A fresh ``flash_attn`` stand-in module with an empty ``calls`` list."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.8.3+standin"
    module.__file__ = __file__
    calls: list[FlashCall] = []
    module.calls = calls
    module.ContractError = ContractError

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        """``q [Tq, Hq, D]``, ``k/v [Tk, Hk, D]``, int32 ``cu_seqlens_q/k [n + 1]`` -> ``[Tq, Hq, D]``
        (``(out, softmax_lse [Hq, Tq], None)`` with ``return_attn_probs``)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t, 3)
        _check_qkv(q, k, v, allowed_dtypes)
        window = _check_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs)
        if block_table is not None:
            raise NotImplementedError("flash_attn stand-in: paged KV (block_table) is not implemented")
        cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, _fail)
        cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, _fail)
        if len(cu_q) != len(cu_k):
            _fail(f"cu_seqlens_q has {len(cu_q)} entries, cu_seqlens_k {len(cu_k)}")
        _check_max("max_seqlen_q", max_seqlen_q, cu_q)
        _check_max("max_seqlen_k", max_seqlen_k, cu_k)
        calls.append(FlashCall("flash_attn_varlen_func", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype,
                               cu_q, cu_k, cu_seqlens_q.dtype, max_seqlen_q, max_seqlen_k, float(dropout_p),
                               softmax_scale, causal, window, float(softcap), deterministic, return_attn_probs))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        outs, lses = [], []
        for (qa, qb), (ka, kb) in zip(zip(cu_q, cu_q[1:]), zip(cu_k, cu_k[1:])):
            o, lse = segment_attention(q[qa:qb], k[ka:kb], v[ka:kb], scale=scale, causal=causal, window=window,
                                       softcap=float(softcap), dropout_p=float(dropout_p))
            outs.append(o)
            lses.append(lse)
        out = torch.cat(outs, dim=0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
        if return_attn_probs:
            lse = torch.cat(lses, dim=1) if lses else q.new_zeros(q.shape[1], 0, dtype=torch.float32)
            return out, lse, None
        return out

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False):
        """``q [B, Sq, Hq, D]``, ``k/v [B, Sk, Hk, D]`` -> ``[B, Sq, Hq, D]`` (every batch row has the
        same lengths; no ``cu_seqlens`` are read)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            _check_tensor(name, t, 4)
        _check_qkv(q, k, v, allowed_dtypes)
        if k.shape[0] != q.shape[0]:
            _fail(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}")
        window = _check_options(dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                                deterministic, return_attn_probs)
        calls.append(FlashCall("flash_attn_func", tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, None, None,
                               None, q.shape[1], k.shape[1], float(dropout_p), softmax_scale, causal, window,
                               float(softcap), deterministic, return_attn_probs))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
        pairs = [segment_attention(q[b], k[b], v[b], scale=scale, causal=causal, window=window,
                                   softcap=float(softcap), dropout_p=float(dropout_p)) for b in range(q.shape[0])]
        out = torch.stack([o for o, _ in pairs])
        if return_attn_probs:
            return out, torch.stack([lse for _, lse in pairs]), None
        return out

    module.flash_attn_varlen_func = flash_attn_varlen_func
    module.flash_attn_func = flash_attn_func
    return module
