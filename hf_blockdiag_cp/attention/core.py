"""Run a plan: pack the local rows, call the chosen kernel, unpack (padding rows get zeros).

Nothing here reads tensor values on the host: every decision comes from the host-side plan, so
an attention layer makes no device synchronisation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from ..config import BlockDiagCPConfig
from ..kernels import KernelCall, KernelSpec, get_backend
from ..kernels.base import PlanSchedules
from ..planning import PlanError, VarlenPlan, as_doc_ids, build_varlen_plan
from ..planning.blocks import block_spans
from ..runtime import resolve_backend

__all__ = ["attend_flat", "autocast_like_sdpa", "blockdiag_attention", "check_qkv", "flat_rows", "kernel_spec",
           "layer_inputs", "resolve_backend"]


def autocast_like_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, contextlib.AbstractContextManager]:
    """Under ``torch.autocast``, do what ``scaled_dot_product_attention`` does: cast q/k/v to the
    autocast dtype.

    Needed because RoPE's float math leaves q and k in float32 while v comes out of a bf16
    projection. Returns the (cast) tensors and a context to run the kernel in: autocast switched off,
    so the kernel keeps its own precision choices (e.g. float32 softmax statistics); outside
    autocast the tensors are returned unchanged with a no-op context (mixed dtypes then raise in
    :func:`check_qkv`, as in SDPA). Host-side flag reads only.
    """
    dtype, autocast_off = _autocast(query.device.type)
    if dtype is None:
        return query, key, value, autocast_off
    cast = [t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in (query, key, value)]
    return cast[0], cast[1], cast[2], autocast_off


def _autocast(device_type: str) -> tuple[torch.dtype | None, contextlib.AbstractContextManager]:
    """``(the autocast dtype, autocast switched off)`` under ``torch.autocast``, else ``(None, a no-op context)``."""
    if not torch.is_autocast_enabled(device_type):
        return None, contextlib.nullcontext()
    return torch.get_autocast_dtype(device_type), torch.autocast(device_type, enabled=False)


def layer_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float, window: int | None,
                 softcap: float | None, sinks: torch.Tensor | None, check: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, KernelSpec, contextlib.AbstractContextManager]:
    """What every layer path starts from, in one pass: ``query [B, Hq, L, D]``, ``key`` / ``value``
    ``[B, Hkv, S, D / Dv]`` cast like :func:`autocast_like_sdpa`, checked (:func:`check_qkv`, unless ``check`` is
    false: a caller-built dense mask, which SDPA checks itself), their :class:`~hf_blockdiag_cp.kernels.KernelSpec`
    (:func:`kernel_spec`; layouts adjust ``noncausal`` / the head counts) and the context to run the kernel in."""
    # The cast and the spec inline (host facts only): one function between the adapter and the layout.
    dtype, autocast_off = _autocast(query.device.type)
    if dtype is not None:
        query, key, value = (t.to(dtype) if t.is_floating_point() else t for t in (query, key, value))
    if check:
        check_qkv(query, key, value)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks))
    spec = _spec(query.device.type, query.dtype, query.shape, key.shape, value.shape, grad, dropout_p=dropout_p,
                 window=window, softcap=softcap, sinks=sinks is not None)
    return query, key, value, spec, autocast_off


def check_qkv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """Shape/dtype/device checks on ``query [B,Hq,L,D]``, ``key [B,Hkv,S,D]``, ``value [B,Hkv,S,Dv]``
    (attribute reads only)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, seq, D], got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if key.device != query.device or value.device != query.device:
        raise ValueError(f"query/key/value devices differ: {query.device}, {key.device}, {value.device}")
    if key.shape[0] != query.shape[0] or value.shape[0] != query.shape[0]:
        raise ValueError(f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]}")
    if key.shape[1] != value.shape[1]:
        raise ValueError(f"key has {key.shape[1]} heads but value has {value.shape[1]}")
    if key.shape[1] == 0 or query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads Hq={query.shape[1]} must be a multiple of key/value heads Hkv={key.shape[1]}")
    if key.shape[3] != query.shape[3]:
        raise ValueError(f"head dims differ: query D={query.shape[3]}, key D={key.shape[3]}")
    if key.shape[2] != value.shape[2]:
        raise ValueError(f"key length {key.shape[2]} != value length {value.shape[2]}")


def kernel_spec(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, dropout_p: float,
                window: int | None, softcap: float | None, sinks: torch.Tensor | None = None,
                noncausal: bool = False) -> KernelSpec:
    """The host-side facts backend availability depends on (``[B, H, seq, D]`` inputs; ``noncausal``: the plan has
    bidirectional blocks)."""
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (query, key, value, sinks))
    return _spec(query.device.type, query.dtype, query.shape, key.shape, value.shape, grad, dropout_p=dropout_p,
                 window=window, softcap=softcap, sinks=sinks is not None, noncausal=noncausal)


def _spec(device_type: str, dtype: torch.dtype, q_shape: torch.Size, k_shape: torch.Size, v_shape: torch.Size,
          requires_grad: bool, *, dropout_p: float, window: int | None, softcap: float | None, sinks: bool,
          noncausal: bool = False) -> KernelSpec:
    return KernelSpec(device_type=device_type, dtype=dtype, head_dim=q_shape[-1], value_dim=v_shape[-1],
                      num_q_heads=q_shape[1], num_kv_heads=k_shape[1], dropout_p=float(dropout_p), window=window,
                      softcap=softcap, sinks=sinks, noncausal=noncausal, requires_grad=requires_grad)


def attend_flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: VarlenPlan, backend: str, *,
                scale: float, dropout_p: float = 0.0, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, config: BlockDiagCPConfig | None = None,
                schedules: PlanSchedules | None = None, causal: bool = True) -> torch.Tensor:
    """Block-diagonal attention on flat rows.

    Args:
        q: ``[B*L, Hq, D]`` local query rows.
        k, v: ``[B*S_kv, Hkv, D]`` / ``[B*S_kv, Hkv, Dv]`` K/V buffer rows.
        plan: a plan on ``q.device`` for exactly these row counts.
        backend: a resolved backend name (not ``"auto"``).
        sinks: ``[Hq]`` attention-sink logits (gpt-oss ``s_aux``): join each softmax denominator.
        schedules: what kernels derived from ``plan`` in earlier calls (filled here; default: a fresh one).
        causal: ``False`` for a plan of non-causal segments only (one part of a plan with bidirectional blocks).

    Returns:
        ``[B*L, Hq, Dv]``; rows of no segment (padding) are zeros.
    """
    config = config or BlockDiagCPConfig()
    if plan.device != q.device:
        raise PlanError(f"the plan lives on {plan.device} but the queries on {q.device}; move it once per step")
    if q.shape[0] != plan.batch_size * plan.q_rows or k.shape[0] != plan.batch_size * plan.kv_rows:
        raise PlanError(f"plan is for {plan.batch_size}x{plan.q_rows} query and {plan.batch_size}x{plan.kv_rows} "
                        f"K/V rows, got {q.shape[0]} and {k.shape[0]}")
    if plan.parts is not None:
        # Bidirectional blocks: the causal segments, then the non-causal ones (no window: their key ranges are
        # exact); each query row is in exactly one part and the other part leaves it zero, so the outputs add up.
        schedules = PlanSchedules() if schedules is None else schedules
        outs = [attend_flat(q, k, v, part, backend, scale=scale, dropout_p=dropout_p,
                            window=window if causal else None, softcap=softcap, sinks=sinks, config=config,
                            schedules=schedules.part(i), causal=causal)
                for i, (part, causal) in enumerate(zip(plan.parts, (True, False))) if part.total_q]
        return outs[0] if len(outs) == 1 else outs[0] + outs[1]
    rows, num_q_heads, dim_v = q.shape[0], q.shape[1], v.shape[2]
    total_q = plan.total_q
    if total_q == 0:
        # All rows are padding: zeros that stay attached to q, k and v so every rank's backward
        # reaches the same collectives and gives finite (zero) gradients.
        anchor = (q.sum() + k.sum() + v.sum() + (0 if sinks is None else sinks.sum())) * 0
        return q.new_zeros(rows, num_q_heads, dim_v) + anchor
    q_packed = q[:total_q] if plan.q_index is None else q.index_select(0, plan.q_index)
    if plan.k_index is None:
        k_packed = k[plan.k_offset:plan.k_offset + plan.total_k]
        v_packed = v[plan.k_offset:plan.k_offset + plan.total_k]
    else:
        k_packed = k.index_select(0, plan.k_index)
        v_packed = v.index_select(0, plan.k_index)
    call = KernelCall(plan=plan, scale=scale, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks,
                      deterministic=config.deterministic, flash_prefix_guard=config.flash_prefix_guard,
                      schedules=PlanSchedules() if schedules is None else schedules, causal=causal)
    out = get_backend(backend).attention(q_packed, k_packed, v_packed, call)
    if total_q == rows:
        return out if plan.q_index is None else out.new_zeros(rows, num_q_heads, dim_v).index_copy(0, plan.q_index, out)
    if plan.q_index is None:
        return torch.cat([out, out.new_zeros(rows - total_q, num_q_heads, dim_v)], dim=0)
    return out.new_zeros(rows, num_q_heads, dim_v).index_copy(0, plan.q_index, out)


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, seq, D]`` (transformers' transposed view) -> ``[B*seq, H, D]`` (a view when possible)."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def blockdiag_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        doc_ids: torch.Tensor | Sequence[int], row_offset: int = 0, *, scale: float | None = None,
                        sliding_window: int | None = None, dropout_p: float = 0.0, backend: str | None = None,
                        config: BlockDiagCPConfig | None = None, block_ids: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """Per-document causal attention of local query rows over a packed row.

    Args:
        query: ``[B, Hq, L, D]``, the query rows at global positions ``[row_offset, row_offset + L)``.
        key, value: ``[B, Hkv, S, D]`` / ``[B, Hkv, S, Dv]`` covering global positions ``[0, S)``
            (``Hkv`` divides ``Hq``; K/V heads are not repeated).
        doc_ids: ``[S]`` or ``[B, S]`` integer document ids, 0 = padding; a document is a maximal
            run of equal non-zero ids.
        row_offset: global position of the first query row.
        scale: softmax scale (default ``D ** -0.5``).
        sliding_window: if given, a query sees only the last ``sliding_window`` keys (itself included).
        dropout_p: attention dropout probability.
        backend: a name from :data:`~hf_blockdiag_cp.config.BACKENDS`; default ``config.backend``
            (``HF_BLOCKDIAG_CP_BACKEND``, else ``"auto"``).
        config: further options (``backend``, ``deterministic``, ``validate``, ...); default
            ``BlockDiagCPConfig()``.
        block_ids: ``[S]`` or ``[B, S]`` bidirectional blocks (0 = causal token, ``k > 0``: member of block ``k``, a
            maximal run of one id inside one document): a block's queries also see its later keys.

    Returns:
        ``[B, Hq, L, Dv]``: a query attends to a key iff same document and key position <= query
        position, or both in one block (and within the window); padding query rows are zeros.

    This convenience builds the plan on every call (reading ``doc_ids`` on the host); training code
    builds it once per step through the collator's context instead. Under ``torch.autocast`` q/k/v
    are cast to the autocast dtype first, as ``scaled_dot_product_attention`` does.
    """
    query, key, value, autocast_off = autocast_like_sdpa(query, key, value)
    with autocast_off:
        return _blockdiag_attention(query, key, value, doc_ids, row_offset, scale=scale,
                                    sliding_window=sliding_window, dropout_p=dropout_p, backend=backend, config=config,
                                    block_ids=block_ids)


def _blockdiag_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         doc_ids: torch.Tensor | Sequence[int], row_offset: int, *, scale: float | None,
                         sliding_window: int | None, dropout_p: float, backend: str | None,
                         config: BlockDiagCPConfig | None, block_ids: torch.Tensor | None = None) -> torch.Tensor:
    check_qkv(query, key, value)
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window={sliding_window!r} must be a positive int or None")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p!r} must be in [0, 1)")
    config = config or BlockDiagCPConfig()
    batch, _, local_len, head_dim = query.shape
    full_len = key.shape[2]
    if row_offset < 0 or row_offset + local_len > full_len:
        raise ValueError(f"row_offset={row_offset} + L={local_len} exceeds the key length S={full_len}")
    ids = as_doc_ids(doc_ids, batch_size=batch, length=full_len)
    blocks = None if block_ids is None else block_spans(block_ids, ids)
    # A block's queries need the window in the plan (the kernel applies it to causal segments only).
    plan = build_varlen_plan(ids, local_len=local_len, row_offset=row_offset, validate=config.validate,
                             blocks=blocks, window=None if blocks is None else sliding_window)
    plan = plan.to(query.device)
    spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=sliding_window, softcap=None,
                       noncausal=plan.has_blocks)
    name = resolve_backend(config, spec, backend=backend)
    out = attend_flat(flat_rows(query), flat_rows(key), flat_rows(value), plan, name,
                      scale=head_dim ** -0.5 if scale is None else scale, dropout_p=dropout_p,
                      window=sliding_window, config=config)
    return out.view(batch, local_len, query.shape[1], value.shape[3]).transpose(1, 2)

