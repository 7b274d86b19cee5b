"""The :class:`Placement` type (which global positions of a packed row each CP rank holds) and the two fixed
placements, ``contiguous`` and ``zigzag``. The placements chosen per row (balanced, mirror, hybrid) build on it in
:mod:`.placement`, :mod:`.mirror_placement` and :mod:`.hybrid_placement`."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from .documents import arange
from .varlen import PlanError, QueryPiece

__all__ = ["Placement", "PlacementRuns", "contiguous_placement", "zigzag_placement"]


@dataclass(frozen=True, eq=False)
class PlacementRuns:
    """A placement as runs: maximal pieces of consecutive positions held at consecutive local rows of one rank.

    Every array is ``[R]`` int64 numpy, ascending ``start``; the runs partition ``[0, S)``. A contiguous
    placement has ``P`` runs, zigzag ``2P``, balanced about one per document piece plus ``P`` of padding.
    """

    start: np.ndarray
    length: np.ndarray
    rank: np.ndarray
    local_start: np.ndarray

    @property
    def end(self) -> np.ndarray:
        return self.start + self.length


@dataclass(frozen=True, eq=False)
class Placement:
    """Global positions held by each CP rank.

    Attributes:
        kind: the name of the scheme that made it (one of :data:`PLACEMENTS`).
        index: ``[P, L]`` int64; ``index[r]`` are rank ``r``'s global positions in ascending order
            (its ``local_index``). Together the rows are a permutation of ``[0, S)``.

    A placement made from its runs (:meth:`from_runs`, what the balanced placement returns) builds ``index`` on
    first use: planning one rank (:meth:`positions`, :meth:`pieces`, :attr:`runs`) needs only the runs, so a
    step pays no row-long table, and a pickled context carries none, unless something asks for it.
    """

    kind: str
    index: torch.Tensor

    @classmethod
    def from_runs(cls, kind: str, runs: PlacementRuns, cp_size: int, local_len: int) -> Placement:
        """The placement whose runs are ``runs`` (``P = cp_size`` ranks of ``local_len`` positions each)."""
        placement = cls.__new__(cls)
        object.__setattr__(placement, "kind", kind)
        placement.__dict__["runs"] = runs
        placement.__dict__["_shape"] = (cp_size, local_len)
        return placement

    def __getattr__(self, name: str) -> torch.Tensor:
        # Only reached for attributes not set: ``index`` of a placement made from runs, built once.
        shape = self.__dict__.get("_shape")
        if name != "index" or shape is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        index = _table_of_runs(self.__dict__["runs"], *shape)
        self.__dict__["index"] = index
        return index

    @property
    def _dims(self) -> tuple[int, int]:
        shape = self.__dict__.get("_shape")
        return shape if shape is not None else tuple(self.index.shape)

    @property
    def cp_size(self) -> int:
        return self._dims[0]

    @property
    def local_len(self) -> int:
        return self._dims[1]

    @property
    def full_len(self) -> int:
        return self._dims[0] * self._dims[1]

    def positions(self, rank: int) -> torch.Tensor:
        """``[L]`` int64 global positions of rank ``rank`` (ascending; a tensor of its own): from the runs when
        the table is not built, ``O(L)``."""
        index = self.__dict__.get("index")
        if index is not None:
            return index[rank].clone()
        runs = self.runs
        mine = runs.rank == rank  # in start order = local row order (a rank's positions ascend)
        start, length = runs.start[mine], runs.length[mine]
        return torch.from_numpy(np.repeat(start - (np.cumsum(length) - length), length)
                                + np.arange(int(length.sum()), dtype=np.int64))

    @property
    def is_contiguous(self) -> bool:
        """Whether rank ``r`` holds exactly ``[r*L, (r+1)*L)``."""
        return bool(torch.equal(self.index.flatten(), arange(self.full_len)))

    @cached_property
    def runs(self) -> PlacementRuns:
        """The placement as :class:`PlacementRuns` (one vectorised pass over ``index``, cached: the plans of
        every window and every rank share it)."""
        flat = self.index.reshape(-1).numpy()
        n, local_len = flat.size, self.local_len
        fresh = np.ones(n, dtype=bool)
        if n:
            fresh[1:] = flat[1:] != flat[:-1] + 1
            fresh[::local_len] = True  # a rank's first row starts a run whatever the previous rank ended with
        first = np.flatnonzero(fresh)
        length = np.diff(np.append(first, n))
        order = np.argsort(flat[first], kind="stable")
        return PlacementRuns(flat[first][order].astype(np.int64), length[order].astype(np.int64),
                             (first // max(local_len, 1))[order].astype(np.int64),
                             (first % max(local_len, 1))[order].astype(np.int64))

    def owner(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rank [S], local_row [S])``: who holds each global position, and at which local row."""
        rank = torch.empty(self.full_len, dtype=torch.int64)
        row = torch.empty(self.full_len, dtype=torch.int64)
        flat = self.index.flatten()
        rank[flat] = torch.arange(self.cp_size).repeat_interleave(self.local_len)
        row[flat] = torch.arange(self.local_len).repeat(self.cp_size)
        return rank, row

    def pieces(self, rank: int) -> list[QueryPiece]:
        """Rank ``rank``'s local rows as runs of consecutive global positions (batch row 0)."""
        if "index" not in self.__dict__:  # the runs are these pieces (maximal, in local row order)
            runs = self.runs
            mine = runs.rank == rank
            return [QueryPiece(0, a, g, n) for a, g, n in zip(runs.local_start[mine].tolist(),
                                                               runs.start[mine].tolist(), runs.length[mine].tolist())]
        positions = self.index[rank]
        breaks = torch.nonzero(positions[1:] != positions[:-1] + 1).flatten() + 1
        starts = [0, *breaks.tolist()]
        ends = [*breaks.tolist(), self.local_len]
        first = positions[starts].tolist() if self.local_len else []
        return [QueryPiece(0, a, g, b - a) for a, b, g in zip(starts, ends, first)]

    @classmethod
    def from_owner(cls, kind: str, owner: torch.Tensor, cp_size: int) -> Placement:
        """The placement in which rank ``owner[p]`` holds position ``p`` (``owner [S]``, each rank ``S / P`` times)."""
        counts = torch.bincount(owner.clamp(min=0), minlength=cp_size)
        if bool((owner < 0).any()) or not bool((counts == owner.numel() // cp_size).all()):
            raise PlanError(f"placement {kind!r} does not give every rank exactly {owner.numel() // cp_size} "
                            f"positions (counts {counts.tolist()})")
        # A stable sort by rank keeps each rank's positions ascending (numpy's is a radix sort here).
        index = torch.from_numpy(np.argsort(owner.numpy().astype(np.int16), kind="stable")).view(cp_size, -1)
        return cls(kind, index)


def contiguous_placement(full_len: int, cp_size: int) -> Placement:
    """Rank ``r`` holds ``[r*L, (r+1)*L)``."""
    return Placement("contiguous", arange(full_len).view(cp_size, full_len // cp_size))


def zigzag_placement(full_len: int, cp_size: int) -> Placement:
    """The row in ``2P`` equal chunks; rank ``r`` holds chunks ``r`` and ``2P - 1 - r``."""
    if full_len % (2 * cp_size):
        raise PlanError(f"placement='zigzag' needs the row length S={full_len} divisible by 2 * cp_size = "
                        f"{2 * cp_size}; use a seq_len that is, or another placement")
    chunks = arange(full_len).view(2 * cp_size, -1)
    return Placement("zigzag", torch.cat([chunks[:cp_size], chunks.flip(0)[:cp_size]], dim=1))


def _table_of_runs(runs: PlacementRuns, cp_size: int, local_len: int) -> torch.Tensor:
    """The ``[P, L]`` table of a placement given as runs."""
    order = np.argsort(runs.rank * local_len + runs.local_start, kind="stable")  # rank-major, local row order
    start, length = runs.start[order], runs.length[order]
    row_start = np.cumsum(length) - length
    # A running sum: +1 per row, and at each run's first row the jump from the previous run's last position to
    # this run's start. One row-long array, written twice (fresh row-long arrays cost page faults on top of
    # their writes).
    index = np.ones(cp_size * local_len, dtype=np.int64)
    if start.size:
        index[row_start] = np.append(start[0], start[1:] - (start[:-1] + length[:-1] - 1))
    np.cumsum(index, out=index)
    return torch.from_numpy(index).view(cp_size, local_len)
