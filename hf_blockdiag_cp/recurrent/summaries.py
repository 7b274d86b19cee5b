"""The one collective of a recurrent layer under CP: every rank's fragment summaries in one fixed-shape all-gather,
and the per-fragment run around it (:func:`run_with_summaries`).

Each rank sends ``plan.slots`` summaries of ``W`` floats (the same on every rank, zero-padded), so the all-gather
has one shape per layer and direction: ``(P - 1) * slots * W * 4`` bytes per rank, whatever the row length. Its
backward is one reduce-scatter, which every rank must join: a rank that sends nothing differentiable still
gathers a buffer that requires grad, and :func:`anchor` ties the gathered summaries into every rank's output.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..distributed import CommStats
from ..distributed.exchange import _AllGather
from ..runtime import step_runtime

__all__ = ["anchor", "gather_summaries", "run_with_summaries"]


@dataclass(frozen=True)
class _Gather:
    """What :class:`~hf_blockdiag_cp.distributed.exchange._AllGather` reads from an exchange."""

    size: int
    rank: int
    group: Any
    timeout: datetime.timedelta
    stats: CommStats | None


def gather_summaries(runs: Any, sent: list[torch.Tensor], width: int, device: torch.device) -> torch.Tensor | None:
    """All ranks' fragment summaries ``[P * slots, W]`` fp32 (rank ``r``'s slot ``s`` at row ``r * slots + s``) from
    this rank's ``sent`` (``[W]`` each, in the plan's send order, at most ``slots``); ``None`` when no fragment of the
    step sends one.

    Args:
        runs: the forward's :class:`~.runs.LocalRuns` (its plan's ``slots``; its ``cp_context``: group, rank, timeout,
            traffic counters).
    """
    slots, context = runs.plan.slots, runs.context
    if not slots:
        return None
    buffer = torch.zeros(slots, width, dtype=torch.float32, device=device)
    if sent:
        buffer = torch.cat([torch.stack([s.float() for s in sent]), buffer[len(sent):]])
    if torch.is_grad_enabled() and not buffer.requires_grad:
        buffer.requires_grad_()  # a rank that sends nothing differentiable must still join the backward
    gather = _Gather(context.cp_size, context.cp_rank, context.group,
                     datetime.timedelta(seconds=context.config.collective_timeout_s), step_runtime(context).comm)
    return _AllGather.apply(buffer, gather)


def anchor(out: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """``out`` tied to ``gathered`` with a zero: every rank runs the gather's backward (a collective), also one whose
    fragments use none of it."""
    return out + (gathered.sum() * 0).to(out.dtype)


def run_with_summaries(runs: Any, width: int, device: torch.device, out_dim: int,
                       call: Callable[[Any, Any], tuple[torch.Tensor, Any]],
                       summarize: Callable[[Any, Any, bool], torch.Tensor],
                       compose: Callable[[list[torch.Tensor]], Any]) -> tuple[torch.Tensor, dict[int, Any]]:
    """A recurrent module run once per fragment of the forward's rows, states passed between CP ranks.

    A fragment at its document's start runs from zero (``call(f, None)``); under CP one that a later fragment of its
    document follows sends ``summarize(f, end, continues)`` (``[W]``), and one that continues a document runs
    from ``compose(summaries of the earlier fragments in document order)``. Returns the outputs reassembled into
    rows (``out_dim``: their time axis) and, at CP = 1, each row's last fragment's end state (``{row: end}``).
    """
    cp = runs.cp_size > 1
    rank = runs.context.cp_rank if cp else 0
    frags = runs.plan.fragments[rank] if cp else runs.fragments
    sending = set(runs.plan.send[rank]) if cp else set()
    outputs: dict[int, torch.Tensor] = {}
    summaries: dict[int, torch.Tensor] = {}
    ends: dict[int, Any] = {}
    for i, f in enumerate(frags):
        continues = cp and f.continues
        if continues and i not in sending:
            continue
        out, end = call(f, None)
        ends[f.row] = end
        if not continues:
            outputs[i] = out
        if i in sending:
            summaries[i] = summarize(f, end, continues)
    gathered = None
    if cp:
        plan = runs.plan
        gathered = gather_summaries(runs, [summaries[i] for i in plan.send[rank]], width, device)  # [P * slots, W]
        for i, srcs in (plan.sources[rank] if gathered is not None else {}).items():
            outputs[i], _ = call(frags[i], compose([gathered[r * plan.slots + s] for r, s in srcs]))
    rows = []
    for row in range(runs.batch_size):
        pieces = [outputs[i] for i, f in enumerate(frags) if f.row == row]
        rows.append(torch.cat(pieces, out_dim) if len(pieces) > 1 else pieces[0])
    out = torch.cat(rows, 0) if len(rows) > 1 else rows[0]
    if gathered is not None:
        out = anchor(out, gathered)
    return out, ({} if cp else ends)
