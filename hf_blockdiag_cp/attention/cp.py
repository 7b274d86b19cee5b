"""The sequence layout of one CP layer: backend (after the step's agreement) -> exchange K/V -> kernel.

Called by the registered attention function when ``cp_context.cp_size > 1`` and ``ulysses_size == 1``.
Each rank keeps its local query rows for all heads and receives the K/V rows its queries need from the
other ranks. The verbs are the step runtime's (:class:`~hf_blockdiag_cp.runtime.StepRuntime`); what is particular
here is only the plan choice for chunked attention.
"""

from __future__ import annotations

import dataclasses

import torch

from ..context import BlockDiagCPContext
from ..runtime import DevicePlan, device_plan, step_runtime
from .core import attend_flat, check_qkv, kernel_spec
from .keywords import chunked_context_plan
from .layer import LayerCall, check_one_row, kernel_name

__all__ = ["attend_sequence", "sequence_attention"]


def attend_sequence(call: LayerCall, plan: DevicePlan | None = None) -> torch.Tensor:
    """Block-diagonal attention of this rank's local rows over K/V gathered from the CP group.

    Args:
        call: the layer's call; ``call.ctx`` has ``cp_size > 1``, ``ulysses_size == 1``; ``query [1, Hq, L, D]``,
            ``key`` / ``value`` ``[1, Hkv, L, D / Dv]`` local rows (before exchange); ``sinks [Hq]`` the same on
            every rank (not exchanged).
        plan: a finer plan on ``query.device`` over the buffer of the full (window ``None``) exchange, instead
            of the context's plan for ``window`` (chunked attention; the kernel still applies ``window``); by
            default the mask's chunked plan when it has a ``chunk_size``.

    Returns:
        ``[L, Hq, Dv]`` (padding rows are zeros).
    """
    ctx, query, key, value = call.ctx, call.query, call.key, call.value
    check_one_row(query.shape, key.shape)
    device = query.device
    if plan is None and call.chunk_size is not None:
        # Chunks only remove keys: the same exchange serves them, with a finer plan over its buffer.
        plan = chunked_context_plan(ctx, call.mask, device)
    exchange_window = call.window if plan is None else None
    if plan is None:
        plan = device_plan(ctx, device, call.window)
    runtime = step_runtime(ctx)
    # Every rank asks alike (the blocks are in the plan fingerprint), whether or not its own rows hold a block.
    spec = dataclasses.replace(call.spec, noncausal=bool(getattr(getattr(ctx, "blocks", None), "count", 0)))
    backend = runtime.backend(ctx, spec, device)
    k_flat, v_flat = runtime.exchange_kv(ctx, key[0].transpose(0, 1), value[0].transpose(0, 1),  # [L, Hkv, D]
                                         exchange_window)
    with runtime.guard(ctx, kernel_name(backend)):
        return attend_flat(query[0].transpose(0, 1), k_flat, v_flat, plan.plan, backend, scale=call.scale,
                           dropout_p=call.dropout, window=call.window, softcap=call.softcap, sinks=call.sinks,
                           config=ctx.config, schedules=plan.schedules)


def sequence_attention(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                       dropout_p: float, scale: float, window: int | None, softcap: float | None,
                       sinks: torch.Tensor | None = None, plan: DevicePlan | None = None) -> torch.Tensor:
    """:func:`attend_sequence` called with the tensors (tests, benchmarks): ``query [1, Hq, L, D]``, ``key`` /
    ``value`` ``[1, Hkv, L, D / Dv]`` are checked first; returns ``[L, Hq, Dv]``."""
    check_qkv(query, key, value)
    spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks)
    call = LayerCall(query, key, value, spec, None, None, None, dropout_p, scale, window, softcap, sinks, ctx, {})
    return attend_sequence(call, plan)
