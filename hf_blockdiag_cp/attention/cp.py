"""The sequence layout of one CP layer: agree (once per step) -> exchange K/V -> kernel.

Called by the registered attention function when ``cp_context.cp_size > 1`` and ``ulysses_size == 1``.
Each rank keeps its local query rows for all heads and receives the K/V rows its queries need from the
other ranks. The pieces are the ones every layout shares (:mod:`.layer`); what is particular here is only
the plan choice for chunked attention.
"""

from __future__ import annotations

import torch

from ..context import BlockDiagCPContext
from ..runtime import DevicePlan, device_plan
from .core import flat_rows, kernel_spec
from .layer import check_local_rows, exchange_fused_kv, kv_exchange, run_kernel, step_backend

__all__ = ["sequence_attention"]


def sequence_attention(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                       dropout_p: float, scale: float, window: int | None, softcap: float | None,
                       sinks: torch.Tensor | None = None, plan: DevicePlan | None = None) -> torch.Tensor:
    """Block-diagonal attention of this rank's local rows over K/V gathered from the CP group.

    Args:
        ctx: the step's context (``cp_size > 1``, ``ulysses_size == 1``).
        query: ``[1, Hq, L, D]`` local queries.
        key, value: ``[1, Hkv, L, D]`` / ``[1, Hkv, L, Dv]`` local keys/values (before exchange).
        sinks: ``[Hq]`` attention-sink logits, the same on every rank (not exchanged).
        plan: a finer plan on ``query.device`` over the buffer of the full (window ``None``) exchange, instead
            of the context's plan for ``window`` (chunked attention; the kernel still applies ``window``).

    Returns:
        ``[L, Hq, Dv]`` (padding rows are zeros).
    """
    check_local_rows(query, key, value)
    exchange_window = window if plan is None else None
    if plan is None:
        plan = device_plan(ctx, query.device, window)
    # Every rank asks alike (the blocks are in the plan fingerprint), whether or not its own rows hold a block.
    spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks,
                       noncausal=bool(getattr(getattr(ctx, "blocks", None), "count", 0)))
    backend = step_backend(ctx, spec, query.device)
    k_flat, v_flat = exchange_fused_kv(flat_rows(key), flat_rows(value), kv_exchange(ctx, query.device,
                                                                                      exchange_window))
    return run_kernel(ctx, flat_rows(query), k_flat, v_flat, plan, backend, scale=scale, dropout_p=dropout_p,
                      window=window, softcap=softcap, sinks=sinks)
