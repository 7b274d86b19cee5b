"""The K/V exchange plan: which K/V rows every CP rank needs and how they move, built on the host.

Every CP rank holds the same full-row ``doc_ids``, so every rank computes the same plan for all
ranks with no communication and no device sync. Contiguous sharding: rank ``r`` owns global rows
``[r*L, (r+1)*L)``; its real (non-padding) queries need keys from the start of the document that
contains its first real row (possibly several ranks back) up to its last real row.

Strategies (:class:`Strategy`, chosen by ``BlockDiagCPConfig.kv_exchange``):

- ``none`` (only chosen by ``auto``): no document straddles a shard boundary; K/V stay local.
- ``allgather``: every rank receives the whole row.
- ``halo``: point-to-point send of exactly the straddling rows from the previous rank; valid only
  when no rank needs rows from more than one rank back.
- ``a2a``: ``all_to_all_single`` with exact uneven splits, for documents spanning any number of ranks.
- ``auto``: ``none`` when nothing straddles, else the cheapest valid strategy by bytes (``halo`` and
  ``a2a`` move the same rows; ``halo`` wins ties, needing no collective over the whole group).

With ``halo`` / ``a2a`` rank ``r``'s K/V buffer is ``[lo_r, (r+1)*L)``: received rows then its own.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass

import torch

from ..config import BlockDiagCPConfig
from .documents import as_doc_ids
from .varlen import PlanError

__all__ = ["ExchangePlan", "RankTransfer", "Strategy", "needed_ranges", "plan_exchange"]


class Strategy(str, enum.Enum):
    """How K/V rows reach the ranks that need them (a ``str`` so it compares equal to its name)."""

    NONE = "none"
    ALLGATHER = "allgather"
    HALO = "halo"
    A2A = "a2a"

    def __str__(self) -> str:
        return self.value


def needed_ranges(doc_ids_row: torch.Tensor, cp_size: int) -> tuple[tuple[int, int], ...]:
    """Per rank, the global ``[lo, hi)`` K/V rows its real queries need (``lo == hi`` if none).

    Args:
        doc_ids_row: ``[S]`` full-row document ids (0 = padding).
        cp_size: ``P``; ``S`` must be divisible by it.
    """
    full_len = int(doc_ids_row.numel())
    local_len = full_len // cp_size
    ids = doc_ids_row.to(torch.int64)
    positions = torch.arange(full_len)
    change = torch.ones(full_len, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    # run_start[i]: first position of the run of equal ids containing i.
    run_start = torch.cummax(torch.where(change, positions, torch.zeros_like(positions)), dim=0).values
    real = (ids != 0).view(cp_size, local_len)
    has_real = real.any(dim=1).tolist()
    first = torch.argmax(real.to(torch.int8), dim=1)
    last = local_len - 1 - torch.argmax(real.flip(1).to(torch.int8), dim=1)
    base = torch.arange(cp_size) * local_len
    lo = run_start[base + first].tolist()
    hi = (base + last + 1).tolist()
    return tuple((lo[r], hi[r]) if has_real[r] else (r * local_len, r * local_len) for r in range(cp_size))


@dataclass(frozen=True, eq=False)
class RankTransfer:
    """One rank's share of an :class:`ExchangePlan`: every number its exchange needs (host side).

    Attributes:
        rank: the rank these numbers are for.
        strategy: the plan's resolved strategy.
        send_ranges: per destination rank, the global ``[lo, hi)`` rows sent to it (``(0, 0)``: none).
        send_splits / recv_splits: rows sent to / received from each rank (``halo`` / ``a2a``).
        recv_rows: rows received per layer and prepended to the local rows (all-gather:
            ``(P - 1) * L``).
        send_index: ``[sum(send_splits)]`` int64 local rows sent, grouped by destination (CPU).
    """

    rank: int
    strategy: Strategy
    send_ranges: tuple[tuple[int, int], ...]
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    recv_rows: int
    send_index: torch.Tensor

    @property
    def rows_sent(self) -> int:
        return sum(self.send_splits)


@dataclass(frozen=True)
class ExchangePlan:
    """How K/V rows move between the ``P`` ranks of one CP group for one step.

    Attributes:
        cp_size / local_len / full_len: ``P``, ``L`` and ``S = P * L``.
        need: per rank, global ``[lo, hi)`` K/V rows its real queries need.
        strategy: the resolved :class:`Strategy`.
        halo_valid: whether every rank's remote need lies within the previous rank.
        kv_ranges: per rank, the global ranges its K/V buffer holds, in buffer order.
    """

    cp_size: int
    local_len: int
    full_len: int
    need: tuple[tuple[int, int], ...]
    strategy: Strategy
    halo_valid: bool
    kv_ranges: tuple[tuple[tuple[int, int], ...], ...]

    def send_range(self, src: int, dst: int) -> tuple[int, int]:
        """Global ``[lo, hi)`` rows ``src`` sends to ``dst`` under ``halo`` / ``a2a`` (``(0, 0)``: none)."""
        lo, hi = self.need[dst]
        a = max(lo, src * self.local_len)
        b = min(hi, dst * self.local_len, (src + 1) * self.local_len)
        return (a, b) if src < dst and b > a else (0, 0)

    def remote_rows(self, rank: int) -> int:
        """Rows ``rank`` needs from other ranks (the exact need, whatever the strategy)."""
        lo, hi = self.need[rank]
        return max(0, min(hi, rank * self.local_len) - lo) if hi > lo else 0

    def for_rank(self, rank: int) -> RankTransfer:
        """The splits, ranges and local send rows of ``rank`` under the resolved strategy."""
        if not 0 <= rank < self.cp_size:
            raise PlanError(f"rank={rank} outside [0, cp_size={self.cp_size})")
        ranks = range(self.cp_size)
        if self.strategy in (Strategy.NONE, Strategy.ALLGATHER):
            nothing = tuple((0, 0) for _ in ranks)
            recv = (self.cp_size - 1) * self.local_len if self.strategy == Strategy.ALLGATHER else 0
            zeros = tuple(0 for _ in ranks)
            return RankTransfer(rank, self.strategy, nothing, zeros, zeros, recv, torch.zeros(0, dtype=torch.int64))
        send_ranges = tuple(self.send_range(rank, dst) for dst in ranks)
        recv_splits = tuple(b - a for a, b in (self.send_range(src, rank) for src in ranks))
        base = rank * self.local_len
        pieces = [torch.arange(a - base, b - base) for a, b in send_ranges if b > a]
        send_index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64)
        return RankTransfer(rank, self.strategy, send_ranges, tuple(b - a for a, b in send_ranges), recv_splits,
                            sum(recv_splits), send_index)

    def rows_received(self, rank: int) -> int:
        """K/V rows ``rank`` receives per layer under the resolved strategy."""
        return self.for_rank(rank).recv_rows

    def rows_sent(self, rank: int) -> int:
        """K/V rows ``rank`` sends per layer under the resolved strategy."""
        if self.strategy == Strategy.ALLGATHER:
            return (self.cp_size - 1) * self.local_len
        return self.for_rank(rank).rows_sent

    def bytes_per_layer(self, rank: int, *, num_kv_heads: int, head_dim: int, value_dim: int | None = None,
                        dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
        """Bytes of K and V ``rank`` sends and receives in one layer's forward (backward mirrors it)."""
        row = num_kv_heads * (head_dim + (value_dim or head_dim)) * torch.finfo(dtype).bits // 8
        return {"sent": self.rows_sent(rank) * row, "received": self.rows_received(rank) * row}


def plan_exchange(doc_ids: torch.Tensor, *, cp_size: int, config: BlockDiagCPConfig | None = None) -> ExchangePlan:
    """Plan the K/V exchange for one packed row ``doc_ids [S]`` or ``[1, S]`` over ``cp_size`` ranks."""
    config = config or BlockDiagCPConfig()
    ids = as_doc_ids(doc_ids)
    if ids.shape[0] != 1:
        raise PlanError(f"under context parallelism a micro-batch is one packed row (B=1), got B={ids.shape[0]}")
    row = ids[0]
    full_len = int(row.numel())
    if cp_size < 1 or full_len % cp_size:
        raise PlanError(f"the row length S={full_len} is not divisible by cp_size={cp_size}")
    local_len = full_len // cp_size
    need = needed_ranges(row, cp_size)
    remote = [max(0, min(hi, r * local_len) - lo) if hi > lo else 0 for r, (lo, hi) in enumerate(need)]
    halo_valid = all(lo >= (r - 1) * local_len for r, (lo, hi) in enumerate(need) if hi > lo and remote[r])
    requested = config.kv_exchange
    if requested == "auto":
        strategy = Strategy.NONE if not any(remote) else (Strategy.HALO if halo_valid else Strategy.A2A)
    elif requested == "halo" and not halo_valid:
        warnings.warn("kv_exchange='halo' cannot serve a document reaching back more than one rank this step; "
                      "using 'a2a'", stacklevel=2)
        strategy = Strategy.A2A
    else:
        strategy = Strategy(requested)
    if strategy == Strategy.NONE:
        ranges = tuple(((r * local_len, (r + 1) * local_len),) for r in range(cp_size))
    elif strategy == Strategy.ALLGATHER:
        ranges = tuple(((0, full_len),) for _ in range(cp_size))
    else:
        ranges = tuple(((min(need[r][0], r * local_len) if need[r][1] > need[r][0] else r * local_len,
                         (r + 1) * local_len),) for r in range(cp_size))
    return ExchangePlan(cp_size=cp_size, local_len=local_len, full_len=full_len, need=need, strategy=strategy,
                        halo_valid=halo_valid, kv_ranges=ranges)
