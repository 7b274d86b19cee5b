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

import torch

from ..config import BlockDiagCPConfig
from .documents import as_doc_ids, run_starts
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


def needed_positions(doc_ids_row: torch.Tensor, positions: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Sorted global positions of the keys that the real queries at ``positions`` need.

    Args:
        doc_ids_row: ``[S]`` full-row document ids (0 = padding).
        positions: ``[n]`` global positions of one rank's queries.
        window: sliding window (keys ``p - window + 1 .. p``), ``None`` = the document's whole prefix.
    """
    row = doc_ids_row.to(torch.int64)
    query = positions[row[positions] != 0]
    if query.numel() == 0:
        return torch.zeros(0, dtype=torch.int64)
    query = torch.sort(query).values
    low = run_starts(row)[query]
    if window is not None:
        low = torch.maximum(low, query - window + 1)
    # Union of the intervals [low, query]: with queries ascending, a new interval starts where its
    # low end lies beyond every earlier interval's end.
    reach = torch.cummax(query, 0).values
    fresh = torch.ones_like(query, dtype=torch.bool)
    fresh[1:] = low[1:] > reach[:-1] + 1
    group = torch.cumsum(fresh.to(torch.int64), 0) - 1
    count = int(group[-1]) + 1
    starts = torch.full((count,), row.numel(), dtype=torch.int64).scatter_reduce(0, group, low, "amin")
    ends = torch.zeros(count, dtype=torch.int64).scatter_reduce(0, group, query + 1, "amax")
    lengths = ends - starts
    return torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths) + torch.arange(
        int(lengths.sum()))


@dataclass(frozen=True, eq=False)
class RankTransfer:
    """One rank's share of an :class:`ExchangePlan`: every number its exchange needs (host side).

    Attributes:
        rank: the rank these numbers are for.
        strategy: the plan's resolved strategy.
        send_splits / recv_splits: rows sent to / received from each rank (``halo`` / ``a2a``).
        recv_rows: rows received per layer and placed before the local rows (all-gather:
            ``(P - 1) * L``).
        send_index: ``[sum(send_splits)]`` int64 local rows sent, grouped by destination (CPU).
        buffer_positions: ``[R + L]`` (all-gather ``[P * L]``) int64 global position of every row of
            the rank's K/V buffer after the exchange.
        need: exact number of remote rows the rank's queries need (whatever the strategy moves).
    """

    rank: int
    strategy: Strategy
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: int
    send_index: torch.Tensor
    buffer_positions: torch.Tensor
    need: int

    @property
    def rows_sent(self) -> int:
        return sum(self.send_splits)


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
                  placement: Placement | None = None, window: int | None = None) -> ExchangePlan:
    """Plan the K/V exchange for one packed row ``doc_ids [S]`` or ``[1, S]`` over ``cp_size`` ranks.

    Args:
        doc_ids: the full row's document ids (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
        config: its ``kv_exchange`` picks the strategy.
        placement: which positions each rank holds (default: contiguous).
        window: plan for a layer with this sliding window (``None``: full causal layers).
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
    owner, local_row = placement.owner()
    # recv[d][s]: sorted global positions rank d needs from rank s.
    recv: list[list[torch.Tensor]] = []
    for dst in range(cp_size):
        need = needed_positions(row, placement.index[dst], window)
        remote = need[owner[need] != dst]
        recv.append([remote[owner[remote] == src] for src in range(cp_size)])
    counts = [[int(recv[d][s].numel()) for s in range(cp_size)] for d in range(cp_size)]
    moved = any(counts[d][s] for d in range(cp_size) for s in range(cp_size))
    halo_valid = all(
        not counts[d][s] or (s == d - 1 and torch.equal(local_row[recv[d][s]],
                                                        torch.arange(local_len - counts[d][s], local_len)))
        for d in range(cp_size) for s in range(cp_size))
    requested = config.kv_exchange
    if requested == "auto":
        strategy = Strategy.NONE if not moved else (Strategy.HALO if halo_valid else Strategy.A2A)
    elif requested == "halo" and not halo_valid:
        warnings.warn("kv_exchange='halo' cannot serve this step's placement (a rank needs rows other than the "
                      "previous rank's last ones); using 'a2a'", stacklevel=2)
        strategy = Strategy.A2A
    else:
        strategy = Strategy(requested)
    transfers = []
    for rank in range(cp_size):
        need = sum(counts[rank])
        own = placement.index[rank]
        if strategy == Strategy.NONE:
            zeros = (0,) * cp_size
            transfers.append(RankTransfer(rank, strategy, zeros, zeros, 0, torch.zeros(0, dtype=torch.int64), own,
                                          need))
        elif strategy == Strategy.ALLGATHER:
            zeros = (0,) * cp_size
            transfers.append(RankTransfer(rank, strategy, zeros, zeros, (cp_size - 1) * local_len,
                                          torch.zeros(0, dtype=torch.int64), placement.index.flatten(), need))
        else:
            sent = [recv[dst][rank] for dst in range(cp_size)]
            received = torch.cat(recv[rank])
            transfers.append(RankTransfer(
                rank, strategy,
                send_splits=tuple(int(t.numel()) for t in sent),
                recv_splits=tuple(counts[rank]),
                recv_rows=need,
                send_index=local_row[torch.cat(sent)],
                buffer_positions=torch.cat([received, own]),
                need=need,
            ))
    return ExchangePlan(placement=placement, window=window, strategy=strategy, halo_valid=halo_valid,
                        transfers=tuple(transfers))
