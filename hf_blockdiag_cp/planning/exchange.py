"""The K/V exchange plan: which K/V rows every CP rank needs and how they move, built on the host.

Every CP rank holds the same full-row ``doc_ids`` and :class:`~.placement.Placement`, so every
rank computes the same plan for all ranks with no communication and no device sync. A rank's real
(non-padding) query at global position ``p`` needs the keys of its document from
``max(document start, p - window + 1)`` to ``p``; a rank's *need* is the union over its queries, and
the rows of the need held by other ranks are what it receives (each exactly once).

Strategies (:class:`Strategy`, chosen by ``BlockDiagCPConfig.kv_exchange``):

- ``none`` (only chosen by ``auto``): no rank needs another rank's rows; K/V stay local.
- ``allgather``: every rank receives every row.
- ``halo``: point-to-point; valid when every rank receives only the last rows of the previous rank
  (contiguous placement, no document reaching back more than one rank).
- ``a2a``: ``all_to_all_single`` with exact uneven splits and per-pair row lists: any placement.
- ``auto``: ``none`` when nothing moves, else ``halo`` when valid (no collective over the whole
  group), else ``a2a``; both move exactly the needed rows.

A rank's K/V buffer is its received rows (grouped by source rank, ascending positions) followed by
its own ``L`` rows (all-gather: every rank's rows in rank order); :attr:`RankTransfer.buffer_positions`
names the global position of every buffer row, which the varlen plan maps keys through.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ..config import BlockDiagCPConfig
from .blocks import BlockSpans
from .documents import arange, as_doc_ids, document_runs, run_starts
from .placement import Placement, contiguous_placement
from .varlen import PlanError

__all__ = ["ExchangePlan", "RankTransfer", "Strategy", "needed_positions", "plan_exchange"]


class Strategy(str, enum.Enum):
    """How K/V rows reach the ranks that need them (a ``str`` so it compares equal to its name)."""

    NONE = "none"
    ALLGATHER = "allgather"
    HALO = "halo"
    A2A = "a2a"

    def __str__(self) -> str:
        return self.value


def needed_positions(doc_ids_row: torch.Tensor, positions: torch.Tensor, window: int | None = None,
                     block_ids_row: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted global positions of the keys that the real queries at ``positions`` need.

    Args:
        doc_ids_row: ``[S]`` full-row document ids (0 = padding).
        positions: ``[n]`` global positions of one rank's queries.
        window: sliding window (keys ``p - window + 1 .. p``), ``None`` = the document's whole prefix.
        block_ids_row: ``[S]`` bidirectional blocks (:mod:`.blocks`; 0 = causal): a block query needs its block's
            later keys too.
    """
    row = doc_ids_row.to(torch.int64)
    query = positions[row[positions] != 0]
    if query.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    query = torch.sort(query).values
    low = run_starts(row)[query]
    if window is not None:
        low = torch.maximum(low, query - window + 1)
    high = query
    if block_ids_row is not None:
        blocks = block_ids_row.to(torch.int64)
        # The last position of every position's run of equal block ids (a block's end - 1).
        run_last = blocks.numel() - 1 - run_starts(blocks.flip(0)).flip(0)
        high = torch.where(blocks[query] > 0, run_last[query], query)
    # Union of the intervals [low, query]: with queries ascending, a new interval starts where its
    # low end lies beyond every earlier interval's end.
    reach = torch.cummax(high, 0).values
    fresh = torch.ones_like(query, dtype=torch.bool)
    fresh[1:] = low[1:] > reach[:-1] + 1
    group = torch.cumsum(fresh.to(torch.int64), 0) - 1
    count = int(group[-1]) + 1
    starts = torch.full((count,), row.numel(), dtype=torch.int64).scatter_reduce(0, group, low, "amin")
    ends = torch.zeros(count, dtype=torch.int64).scatter_reduce(0, group, high + 1, "amax")
    lengths = ends - starts
    return torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths) + arange(
        int(lengths.sum()))


def _expand_runs(runs: torch.Tensor) -> torch.Tensor:
    """``[sum(n)]`` int64: ``cat([arange(a, a + n) for a, n in runs])`` for ``runs [k, 2]`` without a Python loop
    (in numpy: no tensor is read back to the host, should a layer be the first to ask)."""
    table = runs.numpy()
    starts, lengths = table[:, 0], table[:, 1]
    offsets = np.cumsum(lengths) - lengths
    return torch.from_numpy(np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64))


@dataclass(frozen=True, eq=False)
class RankTransfer:
    """One rank's share of an :class:`ExchangePlan`: every number its exchange needs (host side).

    The plan holds every rank's transfer, but only as runs (``[k, 2]`` rows of ``(start, length)``), cut out of
    the plan's shared table of moves on first use (:attr:`send_runs`, :attr:`recv_runs`); the per-row tensors
    :attr:`send_index` and :attr:`buffer_positions` are expanded from them on first use, so a rank pays
    per-token work only for its own transfer, and per-rank work only for the ranks it asks about.

    Attributes:
        rank: the rank these numbers are for.
        strategy: the plan's resolved strategy.
        send_splits / recv_splits: rows sent to / received from each rank (``halo`` / ``a2a``).
        recv_rows: rows received per layer and placed before the local rows (all-gather:
            ``(P - 1) * L``).
        need: exact number of remote rows the rank's queries need (whatever the strategy moves).
        placement: the plan's placement (:attr:`own_positions`: this rank's ``[L]`` positions in it).
        moves: the plan's table of moved runs (``None`` when nothing moves run by run: none, all-gather).
        send_runs: ``[k, 2]`` int64 ``(first local row, rows)`` sent, grouped by destination.
        recv_runs: ``[m, 2]`` int64 ``(first global position, rows)`` received, grouped by source.
        send_index: ``[sum(send_splits)]`` int64 local rows sent, grouped by destination (CPU).
        buffer_positions: ``[R + L]`` (all-gather ``[P * L]``) int64 global position of every row of
            the rank's K/V buffer after the exchange.
    """

    rank: int
    strategy: Strategy
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: int
    need: int
    placement: Placement
    moves: _Moves | None = None

    @property
    def own_positions(self) -> torch.Tensor:
        """``[L]`` global positions of this rank's own rows (computed once; its own storage)."""
        return self._own_positions

    @cached_property
    def _own_positions(self) -> torch.Tensor:
        return self.placement.positions(self.rank)

    @property
    def rows_sent(self) -> int:
        return sum(self.send_splits)

    @cached_property
    def send_runs(self) -> torch.Tensor:
        return torch.zeros((0, 2), dtype=torch.int64) if self.moves is None else self.moves.send_runs(self.rank)

    @cached_property
    def recv_runs(self) -> torch.Tensor:
        return torch.zeros((0, 2), dtype=torch.int64) if self.moves is None else self.moves.recv_runs(self.rank)

    @cached_property
    def send_index(self) -> torch.Tensor:
        return _expand_runs(self.send_runs)

    @cached_property
    def buffer_positions(self) -> torch.Tensor:
        # A tensor of its own (not a view of the placement's [P, L] table): a pickled context then carries
        # this rank's rows, not the whole table once more.
        if self.strategy == Strategy.ALLGATHER:
            return self.placement.index.flatten().clone()
        return torch.cat([_expand_runs(self.recv_runs), self.own_positions])


@dataclass(frozen=True, eq=False)
class ExchangePlan:
    """How K/V rows move between the ``P`` ranks of one CP group for one step (one window).

    Attributes:
        placement: which positions each rank holds.
        window: the sliding window the need was computed for (``None`` = full causal).
        strategy: the resolved :class:`Strategy`.
        halo_valid: whether every transfer is the sender's last rows to the next rank.
        transfers: per rank, its :class:`RankTransfer`.
    """

    placement: Placement
    window: int | None
    strategy: Strategy
    halo_valid: bool
    transfers: tuple[RankTransfer, ...]

    @property
    def cp_size(self) -> int:
        return self.placement.cp_size

    @property
    def local_len(self) -> int:
        return self.placement.local_len

    @property
    def full_len(self) -> int:
        return self.placement.full_len

    def for_rank(self, rank: int) -> RankTransfer:
        """The splits, send rows and buffer layout of ``rank`` under the resolved strategy."""
        if not 0 <= rank < self.cp_size:
            raise PlanError(f"rank={rank} outside [0, cp_size={self.cp_size})")
        return self.transfers[rank]

    def remote_rows(self, rank: int) -> int:
        """Rows ``rank`` needs from other ranks (the exact need, whatever the strategy)."""
        return self.transfers[rank].need

    def rows_received(self, rank: int) -> int:
        """K/V rows ``rank`` receives per layer under the resolved strategy."""
        return self.transfers[rank].recv_rows

    def rows_sent(self, rank: int) -> int:
        """K/V rows ``rank`` sends per layer under the resolved strategy."""
        if self.strategy == Strategy.ALLGATHER:
            return (self.cp_size - 1) * self.local_len
        return self.transfers[rank].rows_sent

    def bytes_per_layer(self, rank: int, *, num_kv_heads: int, head_dim: int, value_dim: int | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
        """Bytes of K and V ``rank`` sends and receives in one layer's forward (backward mirrors it)."""
        row = num_kv_heads * (head_dim + (value_dim or head_dim)) * torch.finfo(dtype).bits // 8
        return {"sent": self.rows_sent(rank) * row, "received": self.rows_received(rank) * row}


def plan_exchange(doc_ids: torch.Tensor, *, cp_size: int, config: BlockDiagCPConfig | None = None,
                  placement: Placement | None = None, window: int | None = None,
                  documents: tuple[np.ndarray, np.ndarray] | None = None,
                  blocks: BlockSpans | None = None) -> ExchangePlan:
    """Plan the K/V exchange for one packed row ``doc_ids [S]`` or ``[1, S]`` over ``cp_size`` ranks.

    Args:
        doc_ids: the full row's document ids (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        config: its ``kv_exchange`` picks the strategy.
        placement: which positions each rank holds (default: contiguous).
        window: plan for a layer with this sliding window (``None``: full causal layers).
        documents: the row's :func:`~hf_blockdiag_cp.planning.documents.document_runs`, if the caller has them
            (else computed here: one pass over the row).
        blocks: the row's bidirectional blocks (:mod:`.blocks`): a block query needs the keys up to its block's end.
    """
    config = config or BlockDiagCPConfig()
    ids = as_doc_ids(doc_ids)
    if ids.shape[0] != 1:
        raise PlanError(f"under context parallelism a micro-batch is one packed row (B=1), got B={ids.shape[0]}")
    row = ids[0]
    full_len = int(row.numel())
    if cp_size < 1 or full_len % cp_size:
        raise PlanError(f"the row length S={full_len} is not divisible by cp_size={cp_size}")
    placement = placement or contiguous_placement(full_len, cp_size)
    if placement.cp_size != cp_size or placement.full_len != full_len:
        raise PlanError(f"the placement is for P={placement.cp_size}, S={placement.full_len}, not P={cp_size}, "
                        f"S={full_len}")
    local_len = placement.local_len
    moves = _remote_runs(row, placement, window, documents, None if blocks is None else blocks.row(0))
    counts = moves.counts
    moved = bool(counts.any())
    halo_valid = moves.halo_valid
    requested = config.kv_exchange
    if requested == "auto":
        strategy = Strategy.NONE if not moved else (Strategy.HALO if halo_valid else Strategy.A2A)
    elif requested == "halo" and not halo_valid:
        warnings.warn("kv_exchange='halo' cannot serve this step's placement (a rank needs rows other than the "
                      "previous rank's last ones); using 'a2a'", stacklevel=2)
        strategy = Strategy.A2A
    else:
        strategy = Strategy(requested)
    need = counts.sum(axis=1).tolist()
    transfers = []
    if strategy in (Strategy.NONE, Strategy.ALLGATHER):
        zeros = (0,) * cp_size
        received = (cp_size - 1) * local_len if strategy == Strategy.ALLGATHER else 0
        for rank in range(cp_size):
            transfers.append(RankTransfer(rank, strategy, zeros, zeros, received, need[rank], placement))
    else:
        recv_splits = counts.tolist()
        send_splits = counts.T.tolist()
        for rank in range(cp_size):
            transfers.append(RankTransfer(rank, strategy, tuple(send_splits[rank]), tuple(recv_splits[rank]),
                                          need[rank], need[rank], placement, moves))
    return ExchangePlan(placement=placement, window=window, strategy=strategy, halo_valid=halo_valid,
                        transfers=tuple(transfers))


@dataclass(frozen=True, eq=False)
class _Moves:
    """Every K/V row that moves, as runs ``(start, length, src, dst, src local row)`` (numpy ``[k]`` int64
    arrays), sorted by destination, then source, then position; ``counts [P, P]``: rows ``dst`` needs from
    ``src``."""

    start: np.ndarray
    length: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    local: np.ndarray
    counts: np.ndarray
    halo_valid: bool

    def recv_runs(self, rank: int) -> torch.Tensor:
        """``[m, 2]`` (global start, rows) ``rank`` receives, grouped by source, positions ascending."""
        lo, hi = np.searchsorted(self.dst, [rank, rank + 1])
        return torch.from_numpy(np.stack([self.start[lo:hi], self.length[lo:hi]], axis=1).reshape(-1, 2))

    @cached_property
    def _by_src(self) -> np.ndarray:
        return np.lexsort((self.start, self.dst, self.src))

    def send_runs(self, rank: int) -> torch.Tensor:
        """``[k, 2]`` (first local row, rows) ``rank`` sends, grouped by destination, positions ascending."""
        order = self._by_src
        lo, hi = np.searchsorted(self.src[order], [rank, rank + 1])
        pick = order[lo:hi]
        return torch.from_numpy(np.stack([self.local[pick], self.length[pick]], axis=1).reshape(-1, 2))


def _remote_runs(row: torch.Tensor, placement: Placement, window: int | None,
                 documents: tuple[np.ndarray, np.ndarray] | None = None,
                 blocks: tuple[np.ndarray, np.ndarray] | None = None) -> _Moves:
    """What every rank needs from every other rank, computed on runs (document pieces), not tokens.

    A rank's queries are the pieces where its placement runs meet documents; a query piece ``[a, b)`` of the
    document starting at ``ds`` needs keys ``[max(ds, a - window + 1), b)`` (``ds`` without a window), the
    union of its queries' needs. The union of a rank's intervals, cut by the placement runs of other ranks,
    is what it receives. Cost: ``O(runs + documents)`` per rank pair touched, no pass over the row per rank.
    With bidirectional ``blocks`` (``(starts, ends)``) the row is cut at block boundaries too, and a piece inside a
    block needs keys up to the block's end: ``[low, block end)``.
    """
    runs = placement.runs
    cp_size, local_len, full_len = placement.cp_size, placement.local_len, placement.full_len
    doc_start, doc_end = document_runs(row) if documents is None else documents
    # Elementary pieces: cut the row at every run start and every document boundary.
    block_start, block_end = blocks if blocks is not None else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    cuts = np.union1d(runs.start, np.concatenate([doc_start, doc_end, block_start, block_end]))
    cuts = cuts[cuts < full_len].astype(np.int64)
    piece_end = np.append(cuts[1:], full_len)
    doc = np.searchsorted(doc_start, cuts, side="right") - 1
    real = (doc >= 0) & (cuts < doc_end[np.maximum(doc, 0)] if doc_end.size else np.zeros(cuts.size, bool))
    a, b, doc = cuts[real], piece_end[real], doc[real]
    rank = runs.rank[np.searchsorted(runs.start, a, side="right") - 1]
    low = doc_start[doc] if window is None else np.maximum(doc_start[doc], a - window + 1)
    if block_start.size:  # a piece inside a block (pieces are cut at block boundaries) needs its later keys
        k = np.searchsorted(block_start, a, side="right") - 1
        inside = (k >= 0) & (a < block_end[np.maximum(k, 0)])
        b = np.where(inside, block_end[np.maximum(k, 0)], b)
    # Per rank, queries ascending: lows ascend too (within a document with the query, across documents by
    # the document order), so a new interval of the union starts where its low passes the previous end.
    order = np.lexsort((a, rank))
    rank, low, high = rank[order], low[order], b[order]
    fresh = np.ones(rank.size, dtype=bool)
    fresh[1:] = (rank[1:] != rank[:-1]) | (low[1:] > high[:-1])
    first = np.flatnonzero(fresh)
    last = np.append(first[1:], rank.size)[:first.size].astype(np.int64) - 1
    u_rank, u_low, u_high = rank[first], low[first], high[last]
    # Cut each union interval by the placement runs it overlaps.
    k0 = np.searchsorted(runs.start, u_low, side="right") - 1
    k1 = np.searchsorted(runs.start, u_high, side="left")
    span = k1 - k0
    which = np.repeat(np.arange(u_low.size), span)
    run = k0[which] + (np.arange(which.size) - np.repeat(np.cumsum(span) - span, span))
    start = np.maximum(u_low[which], runs.start[run])
    end = np.minimum(u_high[which], runs.start[run] + runs.length[run])
    src, dst = runs.rank[run], u_rank[which]
    local = runs.local_start[run] + start - runs.start[run]
    remote = src != dst
    start, length, src, dst, local = start[remote], (end - start)[remote], src[remote], dst[remote], local[remote]
    order = np.lexsort((start, src, dst))
    start, length, src, dst, local = start[order], length[order], src[order], dst[order], local[order]
    pair = dst * cp_size + src
    counts = np.bincount(pair, weights=length, minlength=cp_size * cp_size).astype(np.int64).reshape(cp_size,
                                                                                                     cp_size)
    # Halo: every transfer is the sender's last rows, to the next rank. Positions ascend with local rows,
    # so the rows received from a sender are its last ones iff the lowest of them is row L - count.
    halo_valid = True
    if pair.size:
        group = np.flatnonzero(np.append(True, pair[1:] != pair[:-1]))
        g_dst, g_src = dst[group], src[group]
        lowest = np.minimum.reduceat(local, group)
        halo_valid = bool(np.all((g_src == g_dst - 1) & (lowest == local_len - counts[g_dst, g_src])))
    return _Moves(start, length, src, dst, local, counts, halo_valid)
