"""The head-parallel (Ulysses) CP path of one layer: agree -> heads to tokens -> K/V exchange -> kernel -> back.

Called instead of :func:`~.cp.attend_sequence` when the step's context chose ``u > 1``
(:attr:`~hf_blockdiag_cp.context.BlockDiagCPContext.ulysses_size`). Each rank starts with its ``L``
tokens for all heads; the all-to-all inside its ``u``-rank subgroup gives it the subgroup's ``u * L``
tokens for ``Hq / u`` query heads (:mod:`hf_blockdiag_cp.distributed.ulysses`); with ``c > 1``
sequence groups the K/V of those heads that its queries need from other groups arrive through
today's needed-only exchange between the ``c`` ranks of equal head rank; the kernel runs the
sequence group's plan; the output goes back by the inverse all-to-all. Everything was planned on
the host (:func:`~hf_blockdiag_cp.context.BlockDiagCPContext.build`); the step's
:class:`~hf_blockdiag_cp.runtime.StepRuntime` holds the device-ready collectives, built by the first layer.
The backend (after the step's agreement), the head all-to-all, the K/V exchange and the guard around the kernel are
the runtime's verbs; only the head slicing is particular to this layout.
"""

from __future__ import annotations

import dataclasses

import torch

from ..distributed.ulysses import heads_to_tokens, tokens_to_heads
from ..errors import Refusal
from ..runtime import device_plan, step_runtime
from .core import attend_flat
from .layer import LayerCall, check_one_row, kernel_name

__all__ = ["head_parallel_attention"]


def head_parallel_attention(call: LayerCall) -> torch.Tensor:
    """Block-diagonal attention of this rank's local rows under the step's ``u x c`` layout.

    Args:
        call: the layer's call; ``call.ctx`` has ``ulysses_size > 1``; ``query [1, Hq, L, D]`` local queries (all
            heads), ``key`` / ``value`` ``[1, Hkv, L, D / Dv]``; ``sinks [Hq]`` the same on every rank (this rank
            uses its heads' slice); ``chunk_size`` (llama4) is not supported under a head-parallel layout.

    Returns:
        ``[L, Hq, Dv]`` (padding rows are zeros), like :func:`~.cp.attend_sequence`.
    """
    ctx, query, key, value, window, sinks = call.ctx, call.query, call.key, call.value, call.window, call.sinks
    if call.chunk_size is not None:
        raise Refusal("chunked attention (attention_chunk_size) is not implemented with ulysses_size > 1; "
                      "use ulysses_size=1 for this model")
    check_one_row(query.shape, key.shape)
    split = ctx.layout.heads
    if query.shape[1] != split.num_q_heads or key.shape[1] != split.num_kv_heads:
        hq, hkv, dim = query.shape[1], key.shape[1], query.shape[-1]
        # A refusal (the model's structure), raised by every rank at the same layer before its all-to-all.
        raise Refusal(
            f"the step's head-parallel layout was planned for {split.num_q_heads} query and {split.num_kv_heads} K/V "
            f"heads (the collator's heads=, or num_attention_heads / num_key_value_heads of its model_config), but "
            f"this attention layer has {hq} and {hkv}: the model's layers do not all use the head counts its config "
            "names (e.g. more K/V heads on its sliding-window layers, or mixture-of-attention heads), and a "
            "head-parallel layout plans one head shape for every layer. If every attention layer has "
            f"{hq} query and {hkv} K/V heads pass heads=HeadShape({hq}, {hkv}, {dim}) to the collator instead of "
            "model_config; otherwise use ulysses_size=1 (the sequence layout does not depend on the head shape)")
    q_per_rank, kv_per_rank = split.q_per_rank, split.kv_per_rank
    device = query.device
    runtime = step_runtime(ctx)
    # The kernel sees this rank's head slice; the agreement (first layer) runs before any head moves.
    spec = dataclasses.replace(call.spec, num_q_heads=q_per_rank, num_kv_heads=kv_per_rank)
    backend = runtime.backend(ctx, spec, device)
    a2a = runtime.head_a2a(ctx, device)
    q, k, v = heads_to_tokens(query, key, value, a2a)  # [1, Hq/u, u*L, D], [1, n_kv, u*L, D / Dv]
    # Between the sequence groups, for this rank's heads only.
    k_flat, v_flat = runtime.exchange_kv(ctx, k[0].transpose(0, 1), v[0].transpose(0, 1), window)
    first = a2a.head_rank * q_per_rank
    head_sinks = None if sinks is None else sinks[first:first + q_per_rank]
    dplan = device_plan(ctx, device, window)
    with runtime.guard(ctx, kernel_name(backend)):
        out = attend_flat(q[0].transpose(0, 1), k_flat, v_flat, dplan.plan, backend, scale=call.scale,
                          dropout_p=call.dropout, window=window, softcap=call.softcap, sinks=head_sinks,
                          config=ctx.config, schedules=dplan.schedules)  # [u*L, Hq/u, Dv]
    out = tokens_to_heads(out.transpose(0, 1).unsqueeze(0), a2a)  # [1, Hq, L, Dv]
    # Contiguous like transformers' sdpa output: some models .view() the attention output (afmoe, dory).
    return out[0].transpose(0, 1).contiguous()
