"""The fragments of one forward's local rows: where each recurrent scan starts and stops (host data).

A *fragment* is a maximal stretch of a rank's local rows that is one piece of one document and consecutive in
the full row. At CP = 1 the fragments are the documents; under CP a document split over ranks (or placed in
several pieces on one rank, zigzag / balanced) has several, and each one after the first continues the state
of the one before it. Computed once per forward by the model's pre-hook (:mod:`hf_blockdiag_cp.model.prepare`)
from the forward's arguments, on the host, and read by every recurrent layer of that forward (and of its
activation-checkpoint recompute).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..config import BlockDiagCPConfig
from ..distributed.exchange import Deferred
from ..planning.documents import doc_ids_from_flattening, doc_ids_from_position_ids
from ..planning.fragments import Fragment, FragmentPlan, local_fragments, plan_fragments
from ..runtime import step_runtime
from .backend import forward_backend

__all__ = ["GATHER", "Fragment", "LocalRuns", "local_runs"]

#: What the state all-gather is called in errors (its backward: "recurrent state gradient ...", by the runtime).
GATHER = "recurrent state all-gather"


@dataclass(frozen=True, eq=False)
class LocalRuns:
    """The fragments of every local row, in row order.

    Attributes:
        rows: per batch row, its fragments in local order (they tile ``[0, local_len)``).
        local_len: local rows per batch row.
        cp_size: the CP group size of the step (1: whole rows).
        plan: the step's :class:`~hf_blockdiag_cp.planning.fragments.FragmentPlan` (CP > 1).
        context: the step's ``cp_context`` (CP > 1: its group, rank and runtime).
        backend: the forward's recurrent backend request and library mask
            (:func:`~hf_blockdiag_cp.recurrent.backend.forward_backend`).
    """

    rows: tuple[tuple[Fragment, ...], ...]
    local_len: int
    cp_size: int = 1
    plan: FragmentPlan | None = None
    context: Any = None
    backend: tuple[str, int] = ("model", 0)

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        return tuple(f for row in self.rows for f in row)

    @property
    def rank(self) -> int:
        """This rank's place in the CP group (0 at CP = 1)."""
        return self.context.cp_rank if self.plan is not None else 0

    @property
    def local(self) -> tuple[Fragment, ...]:
        """This rank's fragments in local order (under CP the plan's, which its ``send`` / ``sources`` index)."""
        return self.plan.fragments[self.rank] if self.plan is not None else self.fragments

    def agree(self, device: torch.device) -> None:
        """The step's rank agreement, once per step (shared with attention), before its first collective (CP > 1)."""
        step_runtime(self.context).agree(self.context, device)

    def gather(self, buffer: torch.Tensor, deferred: Deferred | None = None) -> torch.Tensor:
        """Every rank's ``buffer [slots, W]`` as ``[P * slots, W]`` (rank-major), differentiably: the step's one
        recurrent collective per layer and direction, named :data:`GATHER` in errors. With ``deferred``: started,
        to be read after ``deferred.wait()``."""
        return step_runtime(self.context).all_gather(self.context, buffer, GATHER, deferred)

    def guard(self, what: str) -> Any:
        """Under CP: a runner that raises between collectives marks the group failed and raises
        :class:`~hf_blockdiag_cp.errors.CPKernelError` naming ``what`` (the step runtime's guard)."""
        if self.plan is None:
            return contextlib.nullcontext()
        return step_runtime(self.context).guard(self.context, what)


def local_runs(named: dict[str, Any], packed: bool) -> LocalRuns | None:
    """The fragments of a forward with arguments ``named`` (``None``: one document per row, nothing to split).

    Args:
        named: the forward's arguments by name (``cp_context``, ``cu_seq_lens_q/k``, ``seq_idx``,
            ``position_ids``, ``input_ids``).
        packed: whether the batch puts more than one document in a row (:func:`~hf_blockdiag_cp.model.batch.packing`).
    """
    ctx = named.get("cp_context")
    like = next((t for t in (named.get("input_ids"), named.get("inputs_embeds"), named.get("position_ids"))
                 if isinstance(t, torch.Tensor)), None)
    config = getattr(ctx, "config", None) or BlockDiagCPConfig()
    backend = forward_backend(config.recurrent_backend, like.device if like is not None else torch.device("cpu"))
    if ctx is not None:
        index = ctx.local_index.to(torch.int64)
        rows = local_fragments(ctx.doc_ids, index)
        if ctx.cp_size == 1:
            return LocalRuns(rows, index.numel(), backend=backend)
        # Under a head-parallel attention layout (ulysses_size > 1) the layers between attention calls still hold
        # sequence shards (ctx.placement is the layout's [P, L] table): the same fragments and state passing apply.
        plan = _cached_plan(ctx)
        return LocalRuns(rows, index.numel(), ctx.cp_size, plan, ctx, backend)
    if not packed:
        return None
    position_ids = named.get("position_ids")
    cu = named.get("cu_seq_lens_k", named.get("cu_seq_lens_q"))
    seq_idx = named.get("seq_idx")
    if cu is not None or seq_idx is not None:
        like = next(t for t in (named.get("input_ids"), named.get("inputs_embeds"), position_ids) if t is not None)
        length = like.shape[1]
        if like.shape[0] != 1:
            raise ValueError(f"cu_seq_lens_* / seq_idx describe one flattened row, but the batch has {like.shape[0]}")
        ids = doc_ids_from_flattening(
            length, cu_seq_lens_q=named.get("cu_seq_lens_q"), cu_seq_lens_k=named.get("cu_seq_lens_k"),
            seq_idx=None if seq_idx is None else seq_idx.reshape(-1),
            position_ids=None if position_ids is None else position_ids.reshape(-1))[None]
    else:
        ids = doc_ids_from_position_ids(position_ids)
    return LocalRuns(local_fragments(ids, torch.arange(ids.shape[1])), ids.shape[1], backend=backend)


def _cached_plan(ctx: Any) -> FragmentPlan:
    """The step's fragment plan, planned once per step and kept in the step's runtime (shared by device copies)."""
    runtime = step_runtime(ctx)
    if runtime.fragments is None:
        runtime.fragments = plan_fragments(ctx.doc_ids, ctx.placement.index)
    return runtime.fragments

