"""The fragments of one forward's local rows: where each recurrent scan starts and stops (host data).

A *fragment* is a maximal stretch of a rank's local rows that is one piece of one document and consecutive in
the full row. At CP = 1 the fragments are the documents; under CP a document split over ranks (or placed in
several pieces on one rank, zigzag / balanced) has several, and each one after the first continues the state
of the one before it. Computed once per forward by the model's pre-hook (:mod:`hf_blockdiag_cp.model.prepare`)
from the forward's arguments, on the host, and read by every recurrent layer of that forward (and of its
activation-checkpoint recompute).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..planning.documents import doc_ids_from_flattening, doc_ids_from_position_ids, run_boundaries

__all__ = ["Fragment", "LocalRuns", "local_runs"]


@dataclass(frozen=True)
class Fragment:
    """One piece of one document on this rank.

    Attributes:
        row: batch row.
        start / length: local rows ``[start, start + length)``.
        global_start: full-row position of the first row.
        doc_start: full-row position where the fragment's document (or padding run) starts.
        doc: document id (0: padding).
    """

    row: int
    start: int
    length: int
    global_start: int
    doc_start: int
    doc: int

    @property
    def continues(self) -> bool:
        """Whether an earlier piece of this document exists (its state must flow in)."""
        return self.global_start > self.doc_start


@dataclass(frozen=True)
class LocalRuns:
    """The fragments of every local row, in row order.

    Attributes:
        rows: per batch row, its fragments in local order (they tile ``[0, local_len)``).
        local_len: local rows per batch row.
        cp_size: the CP group size of the step (1: whole rows).
    """

    rows: tuple[tuple[Fragment, ...], ...]
    local_len: int
    cp_size: int = 1

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def fragments(self) -> tuple[Fragment, ...]:
        return tuple(f for row in self.rows for f in row)


def _fragments(ids_local: torch.Tensor, positions: torch.Tensor, ids_full: torch.Tensor, cp_size: int) -> LocalRuns:
    """Fragments from local document ids ``[B, L]``, their full-row positions ``[L]`` and full ids ``[B, S]``."""
    rows = []
    for b in range(ids_local.shape[0]):
        local = ids_local[b]
        cut = run_boundaries(local)
        cut[1:] |= positions[1:] != positions[:-1] + 1
        starts = torch.nonzero(cut).flatten().tolist() + [local.numel()]
        full_starts = torch.nonzero(run_boundaries(ids_full[b])).flatten()
        row = []
        for lo, hi in zip(starts[:-1], starts[1:]):
            g = int(positions[lo])
            doc_start = int(full_starts[torch.searchsorted(full_starts, g, right=True) - 1])
            row.append(Fragment(b, lo, hi - lo, g, doc_start, int(local[lo])))
        rows.append(tuple(row))
    return LocalRuns(tuple(rows), ids_local.shape[1], cp_size)


def local_runs(named: dict[str, Any], packed: bool) -> LocalRuns | None:
    """The fragments of a forward with arguments ``named`` (``None``: one document per row, nothing to split).

    Args:
        named: the forward's arguments by name (``cp_context``, ``cu_seq_lens_q/k``, ``seq_idx``,
            ``position_ids``, ``input_ids``).
        packed: whether the batch puts more than one document in a row (:func:`~hf_blockdiag_cp.model.batch.packing`).
    """
    ctx = named.get("cp_context")
    if ctx is not None:
        ids = ctx.doc_ids
        index = ctx.local_index.to(torch.int64)
        return _fragments(ids[:, index], index, ids, ctx.cp_size)
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
    return _fragments(ids, torch.arange(ids.shape[1]), ids, 1)
