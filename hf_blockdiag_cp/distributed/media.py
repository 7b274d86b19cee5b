"""The feature all-to-all of a row's images and videos under CP: one differentiable collective per step.

``rows [R_enc, W]`` (this rank's encoded feature rows, deepstack levels side by side) -> ``[R_recv, W]`` rows for
this rank's placeholder tokens, grouped by source rank (see :mod:`hf_blockdiag_cp.planning.media` for the order).
Backward is the reverse all-to-all of the gradients, so the encoding rank gets the gradient of every row it sent.
Uneven splits (gloo and NCCL both take them); every rank derives the same splits from the plan.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ExchangeSizeError
from ..planning.media import MediaTransfer
from .exchange import CommStats, check_usable, wait

__all__ = ["MediaExchange", "exchange_features"]

_WHAT = "image/video feature all-to-all"


@dataclass(frozen=True, eq=False)
class MediaExchange:
    """What one rank's feature all-to-all needs at run time.

    Attributes:
        transfer: the rank's host plan; send_index: its ``send_index`` on the features' device.
        group / timeout: the CP group and the bound of the collective; stats: where bytes are recorded (or ``None``).
    """

    transfer: MediaTransfer
    send_index: torch.Tensor
    group: Any
    timeout: datetime.timedelta
    stats: CommStats | None = None

    @property
    def rank(self) -> int:
        return self.transfer.rank


def _moved(splits: tuple[int, ...], rank: int, row: torch.Tensor) -> int:
    return sum(n for p, n in enumerate(splits) if p != rank) * row.shape[1] * row.element_size()


class _FeatureAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: torch.Tensor, ex: MediaExchange) -> torch.Tensor:  # type: ignore[override]
        t = ex.transfer
        sent = rows.index_select(0, ex.send_index) if ex.send_index.numel() else rows.new_empty(0, rows.shape[1])
        received = rows.new_empty(t.recv_rows, rows.shape[1])
        work = dist.all_to_all_single(received, sent.contiguous(), output_split_sizes=list(t.recv_splits),
                                      input_split_sizes=list(t.send_splits), group=ex.group, async_op=True)
        wait(work, _WHAT, ex.rank, ex.timeout, group=ex.group)
        ctx.ex, ctx.encoded = ex, rows.shape[0]
        if ex.stats is not None:
            ex.stats.record("forward", _moved(t.send_splits, t.rank, rows), _moved(t.recv_splits, t.rank, rows))
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ex: MediaExchange = ctx.ex
        t = ex.transfer
        check_usable(ex.group, f"{_WHAT} (gradients)", ex.rank)
        returned = grad.new_empty(ex.send_index.numel(), grad.shape[1])
        work = dist.all_to_all_single(returned, grad.contiguous(), output_split_sizes=list(t.send_splits),
                                      input_split_sizes=list(t.recv_splits), group=ex.group, async_op=True)
        wait(work, f"{_WHAT} (gradients)", ex.rank, ex.timeout, group=ex.group)
        grad_rows = grad.new_zeros(ctx.encoded, grad.shape[1])
        if returned.numel():
            grad_rows.index_add_(0, ex.send_index, returned)
        if ex.stats is not None:
            ex.stats.record("backward", _moved(t.recv_splits, t.rank, grad), _moved(t.send_splits, t.rank, grad))
        return grad_rows, None


def exchange_features(rows: torch.Tensor, ex: MediaExchange) -> torch.Tensor:
    """``rows [R_enc, W]`` -> ``[R_recv, W]`` (see the module docstring). Raises :class:`ExchangeSizeError` before
    sending when ``rows`` is not the plan's encode buffer, :class:`CollectiveError` when the group failed."""
    check_usable(ex.group, _WHAT, ex.rank)
    planned = sum(ex.transfer.rows[i] for i in ex.transfer.encode)
    if rows.dim() != 2 or rows.shape[0] != planned:
        raise ExchangeSizeError(f"CP rank {ex.rank}: the {_WHAT} expects the encoder's feature rows of the "
                                f"{len(ex.transfer.encode)} item(s) it encodes ({planned} rows), got "
                                f"{tuple(rows.shape)}; refused before sending")
    return _FeatureAllToAll.apply(rows, ex)
