"""Packing documents into rows.

- :func:`split_overflow` turns document lengths into pieces of at most ``capacity`` tokens
  (``overflow="split" | "truncate" | "error"``, checked by :func:`check_overflow`); empty documents
  give no piece.
- :func:`best_fit_decreasing` puts item sizes into bins of ``capacity``; :func:`pack_pieces` applies
  it to pieces.
- :func:`rows_of_documents` does both for :class:`Document` items and returns :class:`PackedRow`
  items (what :class:`PackingCollator` and :class:`PackedDataset` use).

All but the last are pure functions on integers (no tensors, no I/O).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from .._validate import check_int
from .examples import Document
from .rows import PackedRow

__all__ = [
    "OVERFLOW_MODES",
    "Piece",
    "best_fit_decreasing",
    "check_overflow",
    "pack_pieces",
    "rows_of_documents",
    "split_overflow",
]

OVERFLOW_MODES: tuple[str, ...] = ("split", "truncate", "error")


def check_overflow(overflow: str) -> str:
    """Return ``overflow`` if it is one of :data:`OVERFLOW_MODES`, else raise ``ValueError`` naming it."""
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow={overflow!r} is not one of {', '.join(OVERFLOW_MODES)}")
    return overflow


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, start + length)`` of document ``doc`` (an index into the lengths list)."""

    doc: int
    start: int
    length: int


def split_overflow(lengths: Sequence[int], capacity: int, overflow: str = "split", *,
                   indices: Sequence[int] | None = None, what: str = "example",
                   field: str = "input_ids") -> list[Piece]:
    """Pieces of at most ``capacity`` tokens covering every non-empty document.

    Args:
        lengths: token count of each document (0 = empty, dropped).
        capacity: the row length.
        overflow: for a document longer than ``capacity``: ``"split"`` into consecutive pieces of
            ``capacity`` tokens (the last one shorter), ``"truncate"`` to its first ``capacity``
            tokens, ``"error"`` to raise ``ValueError``.
        indices / what / field: how errors name document ``i``: ``f"{what} {indices[i]}: {field} ..."``
            (``indices`` defaults to the position in ``lengths``).

    Returns:
        Pieces in document order, then in token order.
    """
    check_overflow(overflow)
    check_int("capacity", capacity, minimum=1)
    pieces: list[Piece] = []

    def name(doc: int) -> str:
        return f"{what} {doc if indices is None else indices[doc]}: {field}"

    for doc, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"{name(doc)} has negative length {length}")
        if length > capacity:
            if overflow == "error":
                raise ValueError(f"{name(doc)} has {length} tokens, more than seq_len={capacity} "
                                 f"(overflow='error'; use overflow='split' or 'truncate')")
            if overflow == "truncate":
                pieces.append(Piece(doc, 0, capacity))
                continue
        pieces.extend(Piece(doc, start, min(capacity, length - start)) for start in range(0, length, capacity))
    return pieces


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing.

    Items are taken longest first (ties: lower index first); each goes into the open bin with the
    least room that still fits it (ties: the earliest bin), else into a new bin. ``O(n log n)``
    searches; the sorted free list costs ``O(bins)`` per insertion, negligible at per-step sizes.

    Returns:
        Item indices per bin, bins in opening order, items in the order they were placed.
    """
    check_int("capacity", capacity, minimum=1)
    for i, size in enumerate(sizes):
        if not 1 <= size <= capacity:
            raise ValueError(f"sizes[{i}]={size} must be in [1, capacity={capacity}]")
    order = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    free: list[tuple[int, int]] = []  # (room left, bin) sorted: bisect finds the tightest fit
    bins: list[list[int]] = []
    for item in order:
        size = sizes[item]
        k = bisect.bisect_left(free, (size, -1))
        if k < len(free):
            room, b = free.pop(k)
        else:
            room, b = capacity, len(bins)
            bins.append([])
        bins[b].append(item)
        if room - size > 0:
            bisect.insort(free, (room - size, b))
    return bins


def pack_pieces(pieces: Sequence[Piece], capacity: int) -> list[list[Piece]]:
    """Best-fit-decreasing rows of pieces; inside a row, pieces keep their input order (document
    order), so document ids grow with the source index."""
    bins = best_fit_decreasing([p.length for p in pieces], capacity)
    return [[pieces[i] for i in sorted(b)] for b in bins]


def rows_of_documents(docs: Sequence[Document], seq_len: int, overflow: str) -> list[PackedRow]:
    """Split over-long documents per ``overflow`` and pack best-fit-decreasing into rows of ``seq_len``
    tokens (``docs[i].index`` names them in errors)."""
    pieces = split_overflow([len(d) for d in docs], seq_len, overflow, indices=[d.index for d in docs])
    return [PackedRow(tuple(docs[p.doc].piece(p.start, p.length) for p in row)) for row in pack_pieces(pieces, seq_len)]
