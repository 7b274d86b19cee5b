"""Packing document lengths into rows: pure functions on integers (no tensors, no I/O).

- :func:`split_overflow` turns document lengths into pieces of at most ``capacity`` tokens
  (``overflow="split" | "truncate" | "error"``); empty documents give no piece.
- :func:`best_fit_decreasing` (what the collator uses) and :func:`first_fit` / :func:`next_fit`
  (greedy baselines for the benchmark) put item sizes into bins of ``capacity``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "OVERFLOW_MODES",
    "Piece",
    "best_fit_decreasing",
    "first_fit",
    "next_fit",
    "pack_pieces",
    "padding_fraction",
    "split_overflow",
]

OVERFLOW_MODES: tuple[str, ...] = ("split", "truncate", "error")


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
    if overflow not in OVERFLOW_MODES:
        raise ValueError(f"overflow={overflow!r} is not one of {', '.join(OVERFLOW_MODES)}")
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
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


def _check_sizes(sizes: Sequence[int], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"capacity={capacity} must be >= 1")
    for i, size in enumerate(sizes):
        if not 1 <= size <= capacity:
            raise ValueError(f"sizes[{i}]={size} must be in [1, capacity={capacity}]")


def best_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Best-fit-decreasing bin packing.

    Items are taken longest first (ties: lower index first); each goes into the open bin with the
    least room that still fits it (ties: the earliest bin), else into a new bin. ``O(n log n)``
    searches; the sorted free list costs ``O(bins)`` per insertion, negligible at per-step sizes.

    Returns:
        Item indices per bin, bins in opening order, items in the order they were placed.
    """
    _check_sizes(sizes, capacity)
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


def first_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Greedy first-fit in arrival order: each item goes into the earliest bin with room (baseline)."""
    _check_sizes(sizes, capacity)
    bins: list[list[int]] = []
    room: list[int] = []
    for item, size in enumerate(sizes):
        for b, left in enumerate(room):
            if left >= size:
                break
        else:
            b = len(bins)
            bins.append([])
            room.append(capacity)
        bins[b].append(item)
        room[b] -= size
    return bins


def next_fit(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Sequential greedy packing: fill the current bin in arrival order, open a new one when an
    item does not fit (what "concatenate and cut" pipelines do when they must not cut documents)."""
    _check_sizes(sizes, capacity)
    bins: list[list[int]] = []
    room = 0
    for item, size in enumerate(sizes):
        if size > room:
            bins.append([])
            room = capacity
        bins[-1].append(item)
        room -= size
    return bins


def padding_fraction(bins: Sequence[Sequence[int]], sizes: Sequence[int], capacity: int) -> float:
    """Fraction of the ``len(bins) * capacity`` slots left as padding (0 for no bins)."""
    total = len(bins) * capacity
    return 0.0 if total == 0 else 1.0 - sum(sizes[i] for b in bins for i in b) / total


def pack_pieces(pieces: Sequence[Piece], capacity: int) -> list[list[Piece]]:
    """Best-fit-decreasing rows of pieces; inside a row, pieces keep their input order (document
    order), so document ids grow with the source index."""
    bins = best_fit_decreasing([p.length for p in pieces], capacity)
    return [[pieces[i] for i in sorted(b)] for b in bins]
