"""The K/V exchange plan: which K/V rows every CP rank needs and how they move, built on the host.

Every CP rank holds the same full-row ``doc_ids``, so every rank computes the same plan for all
ranks with no communication and no device sync. Contiguous sharding: rank ``r`` owns global rows
``[r*L, (r+1)*L)``; its real (non-padding) queries need keys from the start of the document that
contains its first real row (possibly several ranks back) up to its last real row.

Strategies (``BlockDiagCPConfig.kv_exchange``):

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

import warnings
from dataclasses import dataclass

import torch

from ..config import BlockDiagCPConfig
from ..planning import PlanError, as_doc_ids

__all__ = ["ExchangePlan", "plan_exchange", "needed_ranges"]


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


def _send_rows(need: tuple[tuple[int, int], ...], local_len: int, src: int, dst: int) -> tuple[int, int]:
    lo, hi = need[dst]
    a, b = max(lo, src * local_len), min(hi, dst * local_len, (src + 1) * local_len)
    return (a, b) if src < dst and b > a else (0, 0)


@dataclass(frozen=True)
class ExchangePlan:
    """How K/V rows move between the ``P`` ranks of one CP group for one step.

    Attributes:
        cp_size / local_len / full_len: ``P``, ``L`` and ``S = P * L``.
        need: per rank, global ``[lo, hi)`` K/V rows its real queries need.
        requested / strategy: the configured and the resolved strategy (``none``, ``allgather``,
            ``halo`` or ``a2a``).
        halo_valid: whether every rank's remote need lies within the previous rank.
        kv_ranges: per rank, the global ranges its K/V buffer holds, in buffer order.
        send_counts: ``send_counts[src][dst]`` rows ``src`` sends to ``dst`` (``halo`` / ``a2a``;
            all-gather moves ``L`` rows between every pair).
    """

    cp_size: int
    local_len: int
    full_len: int
    need: tuple[tuple[int, int], ...]
    requested: str
    strategy: str
    halo_valid: bool
    kv_ranges: tuple[tuple[tuple[int, int], ...], ...]
    send_counts: tuple[tuple[int, ...], ...]

    def remote_rows(self, rank: int) -> int:
        """Rows ``rank`` needs from other ranks."""
        lo, hi = self.need[rank]
        return max(0, min(hi, rank * self.local_len) - lo) if hi > lo else 0

    def send_rows(self, src: int, dst: int) -> tuple[int, int]:
        """Global ``[lo, hi)`` rows ``src`` sends to ``dst`` under ``halo`` / ``a2a``."""
        return _send_rows(self.need, self.local_len, src, dst)

    def rows_received(self, rank: int) -> int:
        """K/V rows ``rank`` receives per layer under the resolved strategy."""
        if self.strategy == "none":
            return 0
        if self.strategy == "allgather":
            return (self.cp_size - 1) * self.local_len
        return sum(self.send_counts[src][rank] for src in range(self.cp_size))

    def rows_sent(self, rank: int) -> int:
        if self.strategy == "none":
            return 0
        if self.strategy == "allgather":
            return (self.cp_size - 1) * self.local_len
        return sum(self.send_counts[rank])

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
        strategy = "none" if not any(remote) else ("halo" if halo_valid else "a2a")
    elif requested == "halo" and not halo_valid:
        warnings.warn("kv_exchange='halo' cannot serve a document reaching back more than one rank this step; "
                      "using 'a2a'", stacklevel=2)
        strategy = "a2a"
    else:
        strategy = requested
    counts = tuple(tuple(b - a for a, b in (_send_rows(need, local_len, s, d) for d in range(cp_size)))
                   for s in range(cp_size))
    if strategy == "none":
        ranges = tuple(((r * local_len, (r + 1) * local_len),) for r in range(cp_size))
    elif strategy == "allgather":
        ranges = tuple(((0, full_len),) for _ in range(cp_size))
    else:
        ranges = tuple(((min(need[r][0], r * local_len) if need[r][1] > need[r][0] else r * local_len,
                         (r + 1) * local_len),) for r in range(cp_size))
    return ExchangePlan(cp_size=cp_size, local_len=local_len, full_len=full_len, need=need, requested=requested,
                        strategy=strategy, halo_valid=halo_valid, kv_ranges=ranges, send_counts=counts)
