"""The CP attention path of one layer: agree (once per step) -> exchange K/V -> kernel.

Called by the registered attention function when ``cp_context.cp_size > 1``. Every decision was
made on the host when the context was planned; the layer only looks things up in the step's
:class:`~.runtime.StepRuntime` (device plans, agreed backends, the rank's exchange), which the first
layer of a step fills and every later layer and activation-checkpoint recompute reuses.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..config import BACKENDS
from ..context import BlockDiagCPContext
from ..distributed import CommStats, RankExchange, agree_on_backends, exchange_kv, mark_broken
from ..distributed.groups import GroupRef
from ..kernels import KernelSpec, available_backends
from ..planning import PlanError
from ..planning.exchange import Strategy
from .core import attend_flat, check_qkv, flat_rows, kernel_spec, resolve_backend
from .runtime import DevicePlan, device_plan, plan_key, step_runtime

__all__ = ["CPKernelError", "comm_stats", "cp_attention", "step_backends"]

#: Bit order of the backend availability mask the ranks exchange (the same on every rank).
_BACKEND_BITS: tuple[str, ...] = tuple(name for name in BACKENDS if name != "auto")


class CPKernelError(RuntimeError):
    """An attention kernel raised on this rank during a CP step (its peers will fail in their next
    collective, within ``collective_timeout_s``). The CP group is recorded as broken: its next use on this
    rank raises :class:`~hf_blockdiag_cp.distributed.CollectiveError` instead of entering a collective
    its peers left."""


def kernel_failed(ctx: BlockDiagCPContext, backend: str, err: BaseException) -> CPKernelError:
    """Record ``ctx.group`` as broken (the peers are past this layer's exchange, or stuck in the next one) and
    build the error for a kernel that raised ``err`` on this rank."""
    failure = f"the {backend!r} attention kernel on CP rank {ctx.cp_rank} failed ({type(err).__name__})"
    mark_broken(ctx.group, failure)
    return CPKernelError(f"CP rank {ctx.cp_rank}/{ctx.cp_size}: the {backend!r} attention kernel failed "
                         f"({type(err).__name__}: {err}); peer ranks will stop at their next collective, and this CP "
                         "group cannot be used again in this process (end the job and restart it)")


def comm_stats(ctx: BlockDiagCPContext) -> CommStats:
    """Bytes this rank moved through K/V exchanges in this context's step so far."""
    return step_runtime(ctx).comm


def step_backends(ctx: BlockDiagCPContext) -> dict[KernelSpec, str]:
    """Backend chosen per kernel spec in this step (filled as layers run)."""
    return step_runtime(ctx).backends


def _timeout(ctx: BlockDiagCPContext) -> datetime.timedelta:
    return datetime.timedelta(seconds=ctx.config.collective_timeout_s)


def _check_group(ctx: BlockDiagCPContext) -> None:
    """The context's group must be a live process group here (pure attribute reads, once per step)."""
    if isinstance(ctx.group, GroupRef):
        raise RuntimeError(f"cp_context names the process group {ctx.group.name!r}, which this process does not "
                           "have; build the collator in the training process that created the group")
    if ctx.group is None or not dist.is_initialized():
        raise RuntimeError("cp_size > 1 needs an initialised torch.distributed process group in cp_context.group: "
                           "build the collator with group=mesh['cp'] (a collator given only cp_rank/cp_size builds "
                           "contexts without one; CPTrainer attaches the mesh's)")


def _rank_exchange(ctx: BlockDiagCPContext, device: torch.device, window: int | None = None) -> RankExchange | None:
    """This rank's device-ready exchange for layers with ``window`` (``None`` when nothing moves),
    built once per step, device and planned window."""
    key = plan_key(ctx, device, window)
    runtime = step_runtime(ctx)
    if key in runtime.exchanges:
        return runtime.exchanges[key]
    _, plan = ctx.plans_for(key.window)
    ex = None
    if plan is not None and plan.strategy != Strategy.NONE:
        transfer = plan.for_rank(ctx.cp_rank)
        ex = RankExchange(
            transfer=transfer,
            size=plan.cp_size,
            global_ranks=tuple(dist.get_global_rank(ctx.group, i) for i in range(plan.cp_size)),
            send_index=transfer.send_index.to(device),
            timeout=_timeout(ctx),
            group=ctx.group,
            stats=runtime.comm,
        )
    runtime.exchanges[key] = ex
    return ex


def _agreed_backends(ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> frozenset[str]:
    """The step's rank agreement (one small collective, first layer only).

    Library/device availability is the same for the later layers; what differs per layer (window,
    dropout) is a pure function of the spec, identical on all ranks.
    """
    runtime = step_runtime(ctx)
    if runtime.agreed_backends is None:
        _check_group(ctx)
        config = ctx.config
        runtime.agreed_backends = agree_on_backends(
            available_backends(spec, config.disabled_backends),
            _BACKEND_BITS,
            data_fingerprint=ctx.data_fingerprint,
            plan_fingerprint=ctx.plan_fingerprint,
            group=ctx.group,
            rank=ctx.cp_rank,
            size=ctx.cp_size,
            timeout=_timeout(ctx),
            device=device,
        )
    return runtime.agreed_backends


def _backend(ctx: BlockDiagCPContext, spec: KernelSpec, device: torch.device) -> str:
    chosen = step_runtime(ctx).backends
    if spec not in chosen:
        agreed = _agreed_backends(ctx, spec, device)
        chosen[spec] = resolve_backend(ctx.config, spec, agreed=agreed, where=" (on every CP rank)")
    return chosen[spec]


def exchange_fused_kv(k_flat: torch.Tensor, v_flat: torch.Tensor,
                      ex: RankExchange) -> tuple[torch.Tensor, torch.Tensor]:
    """Exchange ``k_flat [R, Hkv, D]`` and ``v_flat [R, Hkv, Dv]`` as one fused ``[R, Hkv * (D + Dv)]`` buffer
    (one collective forward, one backward: see distributed/exchange.py); returns the received + own rows."""
    rows, num_kv_heads, head_dim = k_flat.shape
    value_dim = v_flat.shape[2]
    kv = exchange_kv(torch.cat([k_flat.reshape(rows, -1), v_flat.reshape(rows, -1)], dim=1), ex)
    total = kv.shape[0]
    return (kv[:, : num_kv_heads * head_dim].view(total, num_kv_heads, head_dim),
            kv[:, num_kv_heads * head_dim:].view(total, num_kv_heads, value_dim))


def cp_attention(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 dropout_p: float, scale: float, window: int | None, softcap: float | None,
                 sinks: torch.Tensor | None = None, plan: DevicePlan | None = None) -> torch.Tensor:
    """Block-diagonal attention of this rank's local rows over K/V gathered from the CP group.

    Args:
        ctx: the step's context (``cp_size > 1``).
        query: ``[1, Hq, L, D]`` local queries.
        key, value: ``[1, Hkv, L, D]`` / ``[1, Hkv, L, Dv]`` local keys/values (before exchange).
        sinks: ``[Hq]`` attention-sink logits, the same on every rank (not exchanged).
        plan: a finer plan on ``query.device`` over the buffer of the full (window ``None``) exchange, instead
            of the context's plan for ``window`` (chunked attention; the kernel still applies ``window``).

    Returns:
        ``[L, Hq, Dv]`` (padding rows are zeros).
    """
    check_qkv(query, key, value)
    local_len = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != local_len:
        raise PlanError(f"CP attention expects one packed row per micro-batch and local keys: got query "
                        f"{tuple(query.shape)}, key {tuple(key.shape)}")
    exchange_window = window if plan is None else None
    if plan is None:
        plan = device_plan(ctx, query.device, window)
    spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks)
    backend = _backend(ctx, spec, query.device)
    k_flat, v_flat = flat_rows(key), flat_rows(value)
    ex = _rank_exchange(ctx, query.device, exchange_window)
    if ex is not None:
        k_flat, v_flat = exchange_fused_kv(k_flat, v_flat, ex)
    try:
        return attend_flat(flat_rows(query), k_flat, v_flat, plan.plan, backend, scale=scale, dropout_p=dropout_p,
                           window=window, softcap=softcap, sinks=sinks, config=ctx.config, schedules=plan.schedules)
    except Exception as err:
        raise kernel_failed(ctx, backend, err) from err
