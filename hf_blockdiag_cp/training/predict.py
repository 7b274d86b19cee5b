"""Evaluation and prediction under CP: every rank's shard back into the row's own order.

Under CP a rank holds ``L = S / cp_size`` positions of each row, and with the balanced placement they are not
contiguous (``cp_context.local_index``). The stock evaluation loop would hand ``compute_metrics`` every rank's shard
as if it were a row, and count each row ``cp_size`` times. Here each rank's step output is all-gathered over its CP
group and scattered by the placement (``placement.index[r]`` are rank ``r``'s positions, known to every rank: no
extra communication), so every CP rank holds the full rows ``[B, S, ...]``; the loop then gathers over ``dp`` only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..context import BlockDiagCPContext
from ..errors import Refusal
from .mesh import cp_coordinates

__all__ = ["gather_over_dp", "gather_row_order", "mean_over_cp", "preprocess_local"]

Nested = torch.Tensor | tuple | list | None


def _map(value: Nested, fn: Callable[[torch.Tensor], torch.Tensor]) -> Nested:
    """``fn`` on every tensor of a (nested) tuple / list, keeping the structure."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_map(v, fn) for v in value)
    if not isinstance(value, torch.Tensor):
        raise Refusal(f"a prediction output of type {type(value).__name__} cannot be gathered into "
                      "row order under CP (tensors only)")
    return fn(value)


def _check_local(value: torch.Tensor, ctx: BlockDiagCPContext, what: str) -> None:
    if value.dim() < 2 or tuple(value.shape[:2]) != (ctx.batch_size, ctx.local_index.numel()):
        raise Refusal(
            f"{what} has shape {tuple(value.shape)} but under CP only per-position outputs [B={ctx.batch_size}, "
            f"L={ctx.local_index.numel()}, ...] can be put back in row order (a per-position "
            "preprocess_logits_for_metrics such as argmax is fine; one that shifts, drops or pools positions is not)")


def gather_row_order(value: Nested, ctx: BlockDiagCPContext, group: Any, what: str = "prediction") -> Nested:
    """This rank's ``[B, L, ...]`` shard(s) -> the full rows ``[B, S, ...]`` in row order, on every CP rank.

    One ``all_gather`` over ``group`` per tensor (every rank holds ``L`` positions); rank ``r``'s positions are
    ``ctx.placement.index[r]``, which every rank's context carries.
    """
    if ctx.cp_size == 1 or ctx.placement is None:
        return value

    def one(local: torch.Tensor) -> torch.Tensor:
        _check_local(local, ctx, what)
        parts = [torch.empty_like(local) for _ in range(ctx.cp_size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        stacked = torch.stack(parts, dim=1).flatten(1, 2)  # [B, P * L, ...] in placement order
        rows = torch.empty_like(stacked)
        rows[:, ctx.placement.index.flatten().to(local.device)] = stacked
        return rows

    return _map(value, one)


def preprocess_local(preprocess: Callable | None, logits: Nested, labels: Nested, ctx: BlockDiagCPContext) -> Nested:
    """``preprocess_logits_for_metrics`` on this rank's shard (before the gather), checked to stay per-position."""
    if preprocess is None or logits is None:
        return logits
    out = preprocess(logits, labels)
    _map(out, lambda t: (_check_local(t, ctx, "preprocess_logits_for_metrics' output"), t)[1])
    return out


def mean_over_cp(loss: torch.Tensor, group: Any, cp_size: int) -> torch.Tensor:
    """The CP group's mean of the ranks' losses (``W * S_r / N`` each): every CP rank then returns the same value,
    so the mean over the ``dp`` groups is ``sum_r S_r / N``, the exact token mean."""
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    return total / cp_size


def gather_over_dp(mesh: DeviceMesh, value: Nested) -> Nested:
    """The loop's ``gather_function`` under CP: concatenate along dim 0 over the ``dp`` groups only (the CP ranks of a
    group hold the same full rows, which must be counted once). Shapes must agree over ``dp`` (fixed row length)."""
    if cp_coordinates(mesh).dp_size == 1:
        return value
    group = mesh["dp"].get_group()

    def one(local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=0)

    return _map(value, one)
