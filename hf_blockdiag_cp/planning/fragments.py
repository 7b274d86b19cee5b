"""Fragments of documents on CP ranks, for recurrent layers: who hands which state to whom (host, once per step).

A *fragment* is a maximal stretch of a rank's local rows that is one piece of one document and consecutive in
the full row (a placement's run of one document). A recurrent scan over a document split into fragments needs,
at the start of every fragment but the first, the state the earlier fragments leave. :func:`plan_fragments`
decides from the step's placement which fragments *send* a summary (every fragment that a later fragment of its
document follows) and, for every continuing fragment, the ``(rank, slot)`` of each earlier fragment in document
order. All ranks compute the same plan from the same ``doc_ids`` and placement (both covered by the step's
agreement); each rank sends ``slots`` summaries, the same number on every rank, so one fixed-shape all-gather
per layer and direction moves them. O(fragments) work, fragments <= documents + pieces of the placement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .documents import run_boundaries

__all__ = ["Fragment", "FragmentPlan", "local_fragments", "plan_fragments"]


@dataclass(frozen=True)
class Fragment:
    """One piece of one document on one rank.

    Attributes:
        row: batch row.
        start / length: local rows ``[start, start + length)``.
        global_start: full-row position of the first row.
        doc_start: full-row position where the fragment's document (or padding run) starts.
        doc: document id (0: padding, which never continues: its outputs are not used).
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
        return self.doc != 0 and self.global_start > self.doc_start


def local_fragments(ids_full: torch.Tensor, positions: torch.Tensor) -> tuple[tuple[Fragment, ...], ...]:
    """Per batch row, the fragments of the local rows at full-row ``positions [L]`` (ascending) of ``ids_full
    [B, S]`` (a run of equal ids is one document, 0 padding), in local order."""
    rows = []
    for b in range(ids_full.shape[0]):
        full = ids_full[b]
        local = full[positions]
        cut = run_boundaries(local)
        cut[1:] |= positions[1:] != positions[:-1] + 1
        starts = torch.nonzero(cut).flatten().tolist() + [local.numel()]
        full_starts = torch.nonzero(run_boundaries(full)).flatten()
        row = []
        for lo, hi in zip(starts[:-1], starts[1:]):
            g = int(positions[lo])
            doc_start = int(full_starts[int(torch.searchsorted(full_starts, g, right=True)) - 1])
            row.append(Fragment(b, lo, hi - lo, g, doc_start, int(local[lo])))
        rows.append(tuple(row))
    return tuple(rows)


@dataclass(frozen=True)
class FragmentPlan:
    """Which fragment summaries the CP ranks exchange in a step.

    Attributes:
        fragments: per rank, its fragments (rows in order, each row's in local order).
        send: per rank, the indices (into its ``fragments``) of the fragments it sends, in slot order.
        slots: summaries every rank sends (the longest ``send``; shorter ones are padded).
        sources: per rank, ``{fragment index: ((rank, slot), ...)}`` for its continuing fragments: the earlier
            fragments of the document, in document order.
    """

    fragments: tuple[tuple[Fragment, ...], ...]
    send: tuple[tuple[int, ...], ...]
    slots: int
    sources: tuple[dict[int, tuple[tuple[int, int], ...]], ...]

    @property
    def cp_size(self) -> int:
        return len(self.fragments)


def plan_fragments(doc_ids: torch.Tensor, placement_index: torch.Tensor) -> FragmentPlan:
    """The plan for full rows ``doc_ids [B, S]`` placed as ``placement_index [P, L]`` (rank -> full positions)."""
    size = placement_index.shape[0]
    per_rank = [tuple(f for row in local_fragments(doc_ids, placement_index[r].to(torch.int64)) for f in row)
                for r in range(size)]
    documents: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (row, doc start) -> (global start, rank, i)
    for r, frags in enumerate(per_rank):
        for i, f in enumerate(frags):
            if f.doc != 0:
                documents.setdefault((f.row, f.doc_start), []).append((f.global_start, r, i))
    send: list[list[int]] = [[] for _ in range(size)]
    slot_of: dict[tuple[int, int], int] = {}
    sources: list[dict[int, tuple[tuple[int, int], ...]]] = [{} for _ in range(size)]
    for pieces in documents.values():
        pieces.sort()
        for _, r, i in pieces[:-1]:
            slot_of[(r, i)] = len(send[r])
            send[r].append(i)
        for k, (_, r, i) in enumerate(pieces[1:], start=1):
            sources[r][i] = tuple((pr, slot_of[(pr, pi)]) for _, pr, pi in pieces[:k])
    return FragmentPlan(tuple(per_rank), tuple(tuple(s) for s in send), max((len(s) for s in send), default=0),
                        tuple(sources))
