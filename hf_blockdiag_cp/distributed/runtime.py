"""The CP attention path of one layer: agree (once per step) -> exchange K/V -> kernel.

Called by the registered attention function when ``cp_context.cp_size > 1``. Every decision was
made on the host when the context was planned; the layer only looks things up in the context's
state (device copy, agreed backends, the rank's exchange tables), which the first layer of a step
fills and every later layer and activation-checkpoint recompute reuses.
"""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist

from ..attention.core import attend_flat, check_qkv, flat_rows, kernel_spec
from ..context import BlockDiagCPContext
from ..kernels import available_backends, choose_backend
from ..planning import PlanError
from ..planning.fingerprint import fingerprint
from .agreement import agree_on_backends
from .exchange import CommStats, RankExchange, exchange_kv
from .groups import GroupRef

__all__ = ["CPKernelError", "comm_stats", "cp_attention", "step_backends"]


class CPKernelError(RuntimeError):
    """An attention kernel raised on this rank during a CP step (its peers will fail in their next
    collective, within ``collective_timeout_s``)."""


def comm_stats(ctx: BlockDiagCPContext) -> CommStats:
    """Bytes this rank moved through K/V exchanges in this context's step so far."""
    return ctx.state.setdefault("comm_stats", CommStats())


def step_backends(ctx: BlockDiagCPContext) -> dict[tuple, str]:
    """Backend chosen per kernel spec in this step (filled as layers run)."""
    return ctx.state.setdefault("backends", {})


def _rank_exchange(ctx: BlockDiagCPContext, device: torch.device) -> RankExchange | None:
    key = ("rank_exchange", device)
    if key in ctx.state:
        return ctx.state[key]
    plan, rank = ctx.exchange, ctx.cp_rank
    ex = None
    if plan.strategy != "none":
        if ctx.group is None or not dist.is_initialized():
            raise RuntimeError("cp_size > 1 needs an initialised torch.distributed process group in cp_context.group")
        if isinstance(ctx.group, GroupRef):
            raise RuntimeError(f"cp_context names the process group {ctx.group.name!r}, which this process does not "
                               "have; build the collator in the training process that created the group")
        if dist.get_world_size(ctx.group) != ctx.cp_size or dist.get_rank(ctx.group) != rank:
            raise ValueError(f"cp_context says rank {rank} of {ctx.cp_size} but its group has rank "
                             f"{dist.get_rank(ctx.group)} of {dist.get_world_size(ctx.group)}")
        local_len = plan.local_len
        send_rows = [plan.send_rows(rank, dst) for dst in range(plan.cp_size)]
        send_index = None
        if plan.strategy == "a2a":
            send_index = torch.cat([torch.arange(a - rank * local_len, b - rank * local_len) for a, b in send_rows]
                                   ).to(device)
        if plan.strategy == "allgather":
            recv_rows = (plan.cp_size - 1) * local_len
        else:
            recv_rows = sum(plan.send_counts[src][rank] for src in range(plan.cp_size))
        ex = RankExchange(
            strategy=plan.strategy,
            rank=rank,
            size=plan.cp_size,
            global_ranks=tuple(dist.get_global_rank(ctx.group, i) for i in range(plan.cp_size)),
            local_len=local_len,
            recv_rows=recv_rows,
            send_splits=tuple(b - a for a, b in send_rows),
            recv_splits=tuple(plan.send_counts[src][rank] for src in range(plan.cp_size)),
            send_index=send_index,
            timeout=datetime.timedelta(seconds=ctx.config.collective_timeout_s),
            group=ctx.group,
            stats=comm_stats(ctx),
        )
    ctx.state[key] = ex
    return ex


def _backend(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             dropout_p: float, window: int | None, softcap: float | None) -> str:
    spec = kernel_spec(query, key, value, dropout_p=dropout_p, window=window, softcap=softcap)
    chosen = step_backends(ctx)
    if spec in chosen:
        return chosen[spec]
    config = ctx.config
    agreed = ctx.state.get("agreed_backends")
    if agreed is None:
        # The step's first layer: one small collective so that every rank knows what every other
        # rank can run. Library/device availability is the same for the later layers; what differs
        # per layer (window, dropout) is a pure function of the spec, identical on all ranks.
        plan = ctx.exchange
        agreed = agree_on_backends(
            spec,
            data_fingerprint=ctx.data_fingerprint,
            plan_fingerprint=fingerprint(repr((plan.cp_size, plan.local_len, plan.strategy, config.backend)).encode()),
            disabled=config.disabled_backends,
            group=ctx.group,
            rank=ctx.cp_rank,
            timeout=datetime.timedelta(seconds=config.collective_timeout_s),
            device=query.device,
        )
        ctx.state["agreed_backends"] = agreed
    name, note = choose_backend(config.backend, spec, agreed & available_backends(spec, config.disabled_backends))
    if note:
        warnings.warn(f"{note} (on every CP rank)", stacklevel=3)
    chosen[spec] = name
    return name


def cp_attention(ctx: BlockDiagCPContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                 dropout_p: float, scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """Block-diagonal attention of this rank's local rows over K/V gathered from the CP group.

    Args:
        ctx: the step's context (``cp_size > 1``).
        query: ``[1, Hq, L, D]`` local queries.
        key, value: ``[1, Hkv, L, D]`` / ``[1, Hkv, L, Dv]`` local keys/values (before exchange).

    Returns:
        ``[L, Hq, Dv]`` (padding rows are zeros).
    """
    check_qkv(query, key, value)
    local_len = query.shape[2]
    if query.shape[0] != 1 or key.shape[2] != local_len:
        raise PlanError(f"CP attention expects one packed row per micro-batch and local keys: got query "
                        f"{tuple(query.shape)}, key {tuple(key.shape)}")
    ctx = ctx.to(query.device)
    backend = _backend(ctx, query, key, value, dropout_p, window, softcap)
    num_kv_heads, head_dim, value_dim = key.shape[1], key.shape[3], value.shape[3]
    k_flat, v_flat = flat_rows(key), flat_rows(value)
    ex = _rank_exchange(ctx, query.device)
    if ex is not None:
        # One fused buffer per layer: one collective forward, one backward (see exchange.py).
        kv = torch.cat([k_flat.reshape(local_len, -1), v_flat.reshape(local_len, -1)], dim=1)
        kv = exchange_kv(kv, ex)
        rows = kv.shape[0]
        k_flat = kv[:, : num_kv_heads * head_dim].view(rows, num_kv_heads, head_dim)
        v_flat = kv[:, num_kv_heads * head_dim:].view(rows, num_kv_heads, value_dim)
    try:
        return attend_flat(flat_rows(query), k_flat, v_flat, ctx.plan, backend, scale=scale, dropout_p=dropout_p,
                           window=window, softcap=softcap, config=ctx.config)
    except Exception as err:
        raise CPKernelError(f"CP rank {ctx.cp_rank}/{ctx.cp_size}: the {backend!r} attention kernel failed "
                            f"({type(err).__name__}: {err}); peer ranks will stop at their next collective") from err
