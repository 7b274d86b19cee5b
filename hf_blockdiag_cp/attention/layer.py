"""What every CP layer path shares: the layer's call as the layouts receive it, and the step's verbs by context.

The sequence layout (:mod:`.cp`) and the head-parallel layout (:mod:`.ulysses_path`) each take one
:class:`LayerCall` (built once by the registered attention function, :mod:`hf_blockdiag_cp.integration`) and ask the
step's :class:`~hf_blockdiag_cp.runtime.StepRuntime` for the rest: the agreement and backend
(:meth:`~hf_blockdiag_cp.runtime.StepRuntime.backend`), the K/V exchange
(:meth:`~hf_blockdiag_cp.runtime.StepRuntime.exchange_kv`), the head all-to-all and the guard around the kernel
(:meth:`~hf_blockdiag_cp.runtime.StepRuntime.guard`: a kernel that raises marks the CP group broken,
:class:`CPKernelError`). Every decision was made on the host when the context was planned
(:meth:`~hf_blockdiag_cp.context.BlockDiagCPContext.build`).

The functions below look those verbs up by context, for callers outside a layer (tests, benchmarks, the package's
``comm_stats``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from ..context import BlockDiagCPContext
from ..distributed import CommStats, RankExchange
from ..errors import CPKernelError
from ..kernels import KernelSpec
from ..planning import PlanError
from ..runtime import failure, require_live_group, step_runtime
from .mask import BlockDiagMask

__all__ = ["CPKernelError", "LayerCall", "check_one_row", "comm_stats", "kernel_failed", "kv_exchange",
           "require_live_group", "step_backend", "step_backends"]


@dataclass(frozen=True, eq=False)
class LayerCall:
    """One attention layer's call, as the layouts receive it.

    Attributes:
        query: ``[B, Hq, L, D]``; key, value: ``[B, Hkv, S, D / Dv]`` (same dtype, cast like SDPA under autocast).
        spec: the call's :class:`~hf_blockdiag_cp.kernels.KernelSpec` (a layout adjusts ``noncausal`` / head counts).
        attention_mask: what the mask function returned, ``None``, or a user tensor; mask: it, when a
            :class:`~.mask.BlockDiagMask`; chunk_size: the mask's attention chunk (llama4), or ``None``.
        dropout, scale, window, softcap: the layer's attention parameters (``window``: keys visible, ``None``
            = unlimited).
        sinks: ``[Hq]`` attention-sink logits (gpt-oss ``s_aux``) or ``None``.
        ctx: the step's ``cp_context`` (``None``: documents from the keyword arguments).
        kwargs: the remaining keyword arguments transformers passed.
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    spec: KernelSpec
    attention_mask: Any
    mask: BlockDiagMask | None
    chunk_size: int | None
    dropout: float
    scale: float
    window: int | None
    softcap: float | None
    sinks: torch.Tensor | None
    ctx: BlockDiagCPContext | None
    kwargs: dict[str, Any]


def check_one_row(q_shape: torch.Size, k_shape: torch.Size) -> None:
    """A CP layer gets one packed row of this rank's local tokens: ``query [1, Hq, L, D]``,
    ``key``/``value`` ``[1, Hkv, L, D / Dv]`` (no KV cache, no appended keys); shapes only."""
    if q_shape[0] != 1 or k_shape[2] != q_shape[2]:
        raise PlanError(f"CP attention expects one packed row per micro-batch and local keys: got query "
                        f"{tuple(q_shape)}, key {tuple(k_shape)}")


def kernel_failed(ctx: BlockDiagCPContext, backend: str, err: BaseException) -> CPKernelError:
    """Record ``ctx.group`` as broken and build the error for the ``backend`` attention kernel that raised ``err``
    (what :meth:`~hf_blockdiag_cp.runtime.StepRuntime.guard` raises around a layer's kernel)."""
    return failure(ctx, kernel_name(backend), err)


def kernel_name(backend: str) -> str:
    """How errors name a layer's kernel (the guard's ``what``)."""
    return f"{backend!r} attention kernel"


def comm_stats(ctx: BlockDiagCPContext) -> CommStats:
    """Bytes this rank moved through K/V exchanges (and head all-to-alls) in this context's step so far."""
    return step_runtime(ctx).comm


def step_backends(ctx: BlockDiagCPContext) -> dict[KernelSpec, str]:
    """Backend chosen per kernel spec in this step (filled as layers run)."""
    return step_runtime(ctx).backends


def collective_timeout(ctx: BlockDiagCPContext) -> datetime.timedelta:
    """The bound on each collective of the step (``config.collective_timeout_s``), built once per step."""
    return step_runtime(ctx).collective_timeout(ctx)


def step_backend(ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> str:
    """The backend of this step for ``spec`` (:meth:`~hf_blockdiag_cp.runtime.StepRuntime.backend`)."""
    return step_runtime(ctx).backend(ctx, spec, device)


def kv_exchange(ctx: BlockDiagCPContext, device: torch.device, window: int | None = None) -> RankExchange | None:
    """This rank's device-ready K/V exchange (:meth:`~hf_blockdiag_cp.runtime.StepRuntime.kv_exchange`)."""
    return step_runtime(ctx).kv_exchange(ctx, device, window)
