"""The varlen plan: which local query rows attend which K/V rows, built once per step on the host.

Coordinates. Queries are the local rows of ``[B, Hq, L, D]`` flattened to ``B * L`` rows; keys and
values are the rows of the K/V buffer ``[B, Hkv, S_kv, D]`` flattened to ``B * S_kv`` rows. A
*segment* is one document piece: ``q_len`` consecutive query rows and the ``k_len >= q_len``
consecutive key rows of the same document ending at the segment's last query (bottom-right causal
alignment: query ``i`` of the segment sees keys ``0 .. k_len - q_len + i``). Only the document that
starts before a piece of local rows (it straddles a shard boundary) has ``k_len > q_len``.

A rank may hold several pieces of a packed row at different global offsets (:class:`QueryPiece`);
contiguous sharding is the case of one piece per batch row. The K/V buffer holds a sorted union of
global ranges (``kv_ranges``): the whole row on one rank or after an all-gather, only the needed
range after a halo / all-to-all exchange.

Packing into the kernel contract: packed queries are the segments' query rows in order
(``[Tq, Hq, D]``), packed keys the segments' key rows in order (``[Tk, Hkv, D]``), with int32
``cu_seqlens_q/k`` offsets. When those rows are already contiguous the plan says so and the
attention path slices instead of gathering.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError
from .blocks import BlockSpans
from .documents import arange, as_doc_ids, document_spans

__all__ = ["PlanError", "QueryPiece", "Segment", "VarlenPlan", "build_varlen_plan", "plan_from_segments"]


@dataclass(frozen=True)
class QueryPiece:
    """``length`` consecutive local query rows of batch row ``batch_row``, starting at local row
    ``local_start``, holding consecutive global positions starting at ``global_start``."""

    batch_row: int
    local_start: int
    global_start: int
    length: int


@dataclass(frozen=True)
class Segment:
    """One document piece in flat coordinates: query rows ``[q_start, q_start + q_len)`` of the
    ``B * L`` local rows attend key rows ``[k_start, k_start + k_len)`` of the ``B * S_kv`` buffer
    rows, bottom-right aligned (``k_len >= q_len``); a non-``causal`` segment (a run of queries of one
    bidirectional block, :mod:`.blocks`) lets every query see all ``k_len`` keys."""

    q_start: int
    q_len: int
    k_start: int
    k_len: int
    causal: bool = True

    @property
    def prefix(self) -> int:
        """Keys before the segment's first query (> 0 only for a document straddling a boundary)."""
        return self.k_len - self.q_len


@dataclass(frozen=True, eq=False)
class VarlenPlan:
    """Per-step segmentation of one rank's local query rows (see module docstring).

    Attributes:
        batch_size: ``B``.
        q_rows: ``L``, local query rows per batch row.
        kv_rows: ``S_kv``, K/V buffer rows per batch row.
        kv_ranges: global ``[lo, hi)`` ranges the K/V buffer holds, in buffer order.
        segments: host-side segments sorted by ``q_start``.
        cu_seqlens_q / cu_seqlens_k: ``[n + 1]`` int32 packed offsets (on ``device``).
        host_cu_q / host_cu_k: the same offsets as host tuples, for host-side scheduling.
        max_seqlen_q / max_seqlen_k: exact maxima of the segment lengths.
        q_index: ``[Tq]`` int64 flat query rows in packed order, or ``None`` when they are rows
            ``[0, Tq)``.
        k_index: ``[Tk]`` int64 flat K/V rows in packed order, or ``None`` when they are rows
            ``[k_offset, k_offset + Tk)``.
        k_offset: first flat K/V row when ``k_index`` is ``None``.
        parts: when some segments are not causal (bidirectional blocks): ``(causal, full)``, the plans of the
            causal segments and of the non-causal ones over the same rows (each query row is in exactly one, so
            their outputs add up); ``None`` when every segment is causal.
    """

    batch_size: int
    q_rows: int
    kv_rows: int
    kv_ranges: tuple[tuple[int, int], ...]
    segments: tuple[Segment, ...]
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    host_cu_q: tuple[int, ...]
    host_cu_k: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    q_index: torch.Tensor | None
    k_index: torch.Tensor | None
    k_offset: int
    parts: tuple[VarlenPlan, VarlenPlan] | None = None

    @property
    def has_blocks(self) -> bool:
        """Whether some segments are not causal (a query of a bidirectional block sees later keys)."""
        return self.parts is not None

    @property
    def num_segments(self) -> int:
        return len(self.segments)

    @property
    def total_q(self) -> int:
        """``Tq``: real (non-padding) local query rows."""
        return self.host_cu_q[-1]

    @property
    def total_k(self) -> int:
        """``Tk``: packed key rows."""
        return self.host_cu_k[-1]

    @property
    def device(self) -> torch.device:
        return self.cu_seqlens_q.device

    @property
    def prefix_segments(self) -> tuple[int, ...]:
        """Indices of segments with more keys than queries (documents straddling a boundary)."""
        return tuple(i for i, s in enumerate(self.segments) if s.k_len > s.q_len)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> VarlenPlan:
        """Copy with the few small index tensors on ``device``."""
        device = torch.device(device)
        if device == self.device:
            return self

        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        return dataclasses.replace(
            self,
            cu_seqlens_q=move(self.cu_seqlens_q),
            cu_seqlens_k=move(self.cu_seqlens_k),
            q_index=move(self.q_index),
            k_index=move(self.k_index),
            parts=None if self.parts is None else tuple(p.to(device, non_blocking) for p in self.parts),
        )

    def describe(self) -> str:
        return (f"VarlenPlan(B={self.batch_size}, L={self.q_rows}, S_kv={self.kv_rows}, segments={self.num_segments},"
                f" Tq={self.total_q}, Tk={self.total_k}, max_q={self.max_seqlen_q}, max_k={self.max_seqlen_k},"
                f" prefix_segments={len(self.prefix_segments)}, gather_q={self.q_index is not None},"
                f" full_segments={0 if self.parts is None else self.parts[1].num_segments},"
                f" gather_k={self.k_index is not None})")

    def validate(self) -> None:
        """Check every index a kernel will trust; raise :class:`PlanError` naming the field."""
        _validate(self)


def _concat_ranges(starts: list[int], lens: list[int]) -> torch.Tensor:
    """``cat([arange(s, s + n) for s, n in zip(starts, lens)])`` without a Python loop over rows."""
    if not starts:
        return torch.zeros(0, dtype=torch.int64)
    starts_t = torch.tensor(starts, dtype=torch.int64)
    lens_t = torch.tensor(lens, dtype=torch.int64)
    offsets = torch.cumsum(lens_t, 0) - lens_t
    return torch.repeat_interleave(starts_t - offsets, lens_t) + arange(int(lens_t.sum()))


def plan_from_segments(segments: Sequence[Segment], *, batch_size: int, q_rows: int, kv_rows: int,
                       kv_ranges: Sequence[tuple[int, int]] | None = None, kv_order: torch.Tensor | None = None,
                       validate: bool = True, split: bool = True) -> VarlenPlan:
    """Build a :class:`VarlenPlan` (CPU tensors) from explicit segments.

    ``kv_order [kv_rows]`` (optional, ``B = 1``): the segments' key rows are coordinates of the
    buffer sorted by global position, and ``kv_order[i]`` is the real buffer row holding sorted row
    ``i`` (an exchange that lays received rows before the local ones); the key gather goes through it.
    ``split``: with non-causal segments, also build the plan's ``parts`` (``False`` for the parts themselves).
    """
    segs = tuple(sorted(segments, key=lambda s: s.q_start))
    parts = None
    if split and any(not s.causal for s in segs):
        # Each part is uniform (its own parts stay None); the causal part may be empty.
        parts = tuple(plan_from_segments([s for s in segs if s.causal is causal], batch_size=batch_size,
                                         q_rows=q_rows, kv_rows=kv_rows, kv_ranges=kv_ranges, kv_order=kv_order,
                                         validate=validate, split=False) for causal in (True, False))
    q_lens = [s.q_len for s in segs]
    k_lens = [s.k_len for s in segs]
    host_cu_q, host_cu_k = [0], [0]
    for s in segs:
        host_cu_q.append(host_cu_q[-1] + s.q_len)
        host_cu_k.append(host_cu_k[-1] + s.k_len)
    if host_cu_k[-1] >= 2**31:
        raise PlanError(f"Tk={host_cu_k[-1]} packed key rows overflow int32 cu_seqlens_k")
    q_contiguous = all(s.q_start == (segs[i - 1].q_start + segs[i - 1].q_len if i else 0) for i, s in enumerate(segs))
    k_contiguous = all(s.k_start == segs[i - 1].k_start + segs[i - 1].k_len for i, s in enumerate(segs) if i)
    k_offset = segs[0].k_start if (segs and k_contiguous) else 0
    k_index = None if k_contiguous else _concat_ranges([s.k_start for s in segs], k_lens)
    if kv_order is not None and segs:
        rows = kv_order[arange(k_offset, k_offset + host_cu_k[-1]) if k_index is None else k_index]
        # Still one slice of the buffer (e.g. contiguous placement: received rows precede own rows).
        k_contiguous = bool(torch.equal(rows, arange(int(rows[0]), int(rows[0]) + rows.numel())))
        k_index, k_offset = (None, int(rows[0])) if k_contiguous else (rows, 0)
    plan = VarlenPlan(
        batch_size=batch_size,
        q_rows=q_rows,
        kv_rows=kv_rows,
        kv_ranges=tuple(kv_ranges) if kv_ranges is not None else ((0, kv_rows),),
        segments=segs,
        cu_seqlens_q=torch.tensor(host_cu_q, dtype=torch.int32),
        cu_seqlens_k=torch.tensor(host_cu_k, dtype=torch.int32),
        host_cu_q=tuple(host_cu_q),
        host_cu_k=tuple(host_cu_k),
        max_seqlen_q=max(q_lens, default=0),
        max_seqlen_k=max(k_lens, default=0),
        q_index=None if q_contiguous else _concat_ranges([s.q_start for s in segs], q_lens),
        k_index=k_index,
        k_offset=k_offset,
        parts=parts,
    )
    if validate:
        plan.validate()
    return plan


def build_varlen_plan(doc_ids: torch.Tensor | Sequence[int], *, local_len: int | None = None, row_offset: int = 0,
                      pieces: Sequence[QueryPiece] | None = None, kv_ranges: Sequence[tuple[int, int]] | None = None,
                      kv_positions: torch.Tensor | None = None, window: int | None = None,
                      batch_size: int | None = None, validate: bool = True,
                      documents: tuple[np.ndarray, np.ndarray] | None = None,
                      blocks: BlockSpans | None = None) -> VarlenPlan:
    """Plan the local rows of one rank from full-row document ids.

    Args:
        doc_ids: ``[S]`` or ``[B, S]`` integer ids over the full (all-rank) row, 0 = padding.
        local_len: ``L``, local query rows per batch row (default: ``S - row_offset``).
        row_offset: global position of local row 0 (contiguous sharding); ignored with ``pieces``.
        pieces: where the local rows sit in the full row, for non-contiguous placements.
        kv_ranges: global ranges the K/V buffer holds, in order (default: the whole row).
        kv_positions: ``[S_kv]`` global position of every K/V buffer row, in any order (one row,
            ``B = 1``; replaces ``kv_ranges``): the buffer an exchange produced.
        window: a sliding window: a segment's keys start at ``max(document start, first query -
            window + 1)`` (earlier keys are invisible to every query of the segment).
        batch_size: ``B`` to expand a 1-D ``doc_ids`` to.
        validate: check the plan before returning it.
        documents: the :func:`~hf_blockdiag_cp.planning.documents.document_runs` of a one-row ``doc_ids``, if the
            caller has them (else computed here: one pass over each row).
        blocks: the rows' bidirectional blocks (:mod:`.blocks`): their query runs become non-causal segments.

    Returns:
        A CPU :class:`VarlenPlan`; move it with :meth:`VarlenPlan.to` once per step.
    """
    ids = as_doc_ids(doc_ids, batch_size=batch_size)
    num_rows, full_len = ids.shape
    if local_len is None:
        local_len = full_len - row_offset
    if pieces is None:
        if row_offset < 0 or local_len < 0 or row_offset + local_len > full_len:
            raise PlanError(f"row_offset={row_offset} + L={local_len} exceeds the row length S={full_len}")
        pieces = [QueryPiece(b, 0, row_offset, local_len) for b in range(num_rows)]
    kv_order = None
    if kv_positions is not None:
        if num_rows != 1 or kv_ranges is not None:
            raise PlanError("kv_positions describes the buffer of one row (B=1) and replaces kv_ranges")
        positions = kv_positions.detach().to("cpu", torch.int64).numpy()
        # A stable sort (numpy's merges presorted runs): an exchange's buffer is a few sorted runs (one per
        # source, then the own rows), several times faster than a general sort; positions are distinct, so any
        # sort gives this order.
        order = np.argsort(positions, kind="stable")
        ordered, kv_order = torch.from_numpy(positions[order]), torch.from_numpy(order)
        if ordered.numel() and (bool((ordered[1:] == ordered[:-1]).any()) or int(ordered[0]) < 0
                                or int(ordered[-1]) >= full_len):
            raise PlanError(f"kv_positions must be distinct positions in [0, {full_len})")
        breaks = (torch.nonzero(ordered[1:] != ordered[:-1] + 1).flatten() + 1).tolist()
        firsts = [0, *breaks]
        lasts = [*breaks, ordered.numel()]
        kv_ranges = [(int(ordered[a]), int(ordered[b - 1]) + 1) for a, b in zip(firsts, lasts) if b > a]
    if window is not None and window < 1:
        raise PlanError(f"window={window} must be >= 1")
    ranges = tuple(kv_ranges) if kv_ranges is not None else ((0, full_len),)
    range_starts, range_offsets, acc = [], [], 0
    for lo, hi in ranges:
        if not 0 <= lo <= hi <= full_len or (range_starts and lo < ranges[len(range_starts) - 1][1]):
            raise PlanError(f"kv_ranges={ranges} must be sorted, disjoint ranges within [0, {full_len})")
        range_starts.append(lo)
        range_offsets.append(acc)
        acc += hi - lo
    kv_rows = acc

    def buffer_row(lo: int, hi: int) -> int:
        """Buffer row of global position ``lo``; ``[lo, hi)`` must lie inside one held range."""
        i = bisect.bisect_right(range_starts, lo) - 1
        if i < 0 or hi > ranges[i][1]:
            raise PlanError(f"the K/V buffer (kv_ranges={ranges}) does not hold the keys [{lo}, {hi}) a local "
                            f"query needs")
        return range_offsets[i] + lo - range_starts[i]

    spans_cache: dict[int, tuple[list[tuple[int, int]], list[int]]] = {}
    segments: list[Segment] = []
    for piece in pieces:
        b, gs, n = piece.batch_row, piece.global_start, piece.length
        if not 0 <= b < num_rows:
            raise PlanError(f"QueryPiece.batch_row={b} outside [0, {num_rows})")
        if n < 0 or gs < 0 or gs + n > full_len or piece.local_start < 0 or piece.local_start + n > local_len:
            raise PlanError(f"{piece} does not fit L={local_len}, S={full_len}")
        # Expanded 1-D doc ids share one row: find its documents once.
        key = 0 if ids.stride(0) == 0 else b
        if key not in spans_cache:
            spans = document_spans(ids[b], documents if num_rows == 1 else None)
            spans_cache[key] = (spans, [s for s, _ in spans])
        spans, starts = spans_cache[key]
        first = max(bisect.bisect_right(starts, gs) - 1, 0)
        for ds, de in spans[first:]:
            if ds >= gs + n:
                break
            qa, qb = max(ds, gs), min(de, gs + n)
            if qa >= qb:
                continue
            q_first = b * local_len + piece.local_start - gs  # local row of global position 0 of this piece
            for ra, rb, block_end in _query_runs(qa, qb, None if blocks is None else blocks.row(b)):
                if block_end is None:  # causal run: bottom-right causal, the kernel applies the window
                    ks = ds if window is None else max(ds, ra - window + 1)
                    segments.append(Segment(q_first + ra, rb - ra, b * kv_rows + buffer_row(ks, rb), rb - ks))
                    continue
                for xa, xb, ks in _block_key_starts(ra, rb, ds, window):
                    segments.append(Segment(q_first + xa, xb - xa, b * kv_rows + buffer_row(ks, block_end),
                                            block_end - ks, causal=False))
    return plan_from_segments(segments, batch_size=num_rows, q_rows=local_len, kv_rows=kv_rows, kv_ranges=ranges,
                              kv_order=kv_order, validate=validate)


def _query_runs(qa: int, qb: int, row_blocks: tuple[np.ndarray, np.ndarray] | None
                ) -> list[tuple[int, int, int | None]]:
    """The queries ``[qa, qb)`` of one document cut at block boundaries: ``(start, end, block end or None)``."""
    if row_blocks is None or not row_blocks[0].size:
        return [(qa, qb, None)]
    starts, ends = row_blocks
    runs: list[tuple[int, int, int | None]] = []
    pos = qa
    i = max(int(np.searchsorted(ends, qa, side="right")), 0)  # first block ending after qa
    while i < starts.size and starts[i] < qb:
        a, e = max(int(starts[i]), qa), min(int(ends[i]), qb)
        if pos < a:
            runs.append((pos, a, None))
        runs.append((a, e, int(ends[i])))
        pos = e
        i += 1
    if pos < qb:
        runs.append((pos, qb, None))
    return runs


def _block_key_starts(ra: int, rb: int, doc_start: int, window: int | None) -> list[tuple[int, int, int]]:
    """The block queries ``[ra, rb)`` grouped by their first key ``lo(t) = max(doc_start, t - window + 1)``:
    ``(start, end, lo)``; one group without a window, else one for the queries whose window reaches the document
    start and one per later query."""
    if window is None:
        return [(ra, rb, doc_start)]
    reach = min(rb, max(ra, doc_start + window))  # queries t < reach have t - window + 1 <= doc_start
    groups = [(ra, reach, doc_start)] if reach > ra else []
    groups.extend((t, t + 1, t - window + 1) for t in range(reach, rb))
    return groups


def _validate(plan: VarlenPlan) -> None:
    n = plan.num_segments
    total_q_rows = plan.batch_size * plan.q_rows
    total_k_rows = plan.batch_size * plan.kv_rows
    prev_end = 0
    for i, s in enumerate(plan.segments):
        if s.q_len < 1:
            raise PlanError(f"segments[{i}].q_len={s.q_len} must be >= 1")
        if s.k_len < s.q_len:
            raise PlanError(f"segments[{i}].k_len={s.k_len} < q_len={s.q_len}: bottom-right causal needs k_len >= "
                            f"q_len")
        if s.q_start < prev_end:
            raise PlanError(f"segments[{i}].q_start={s.q_start} overlaps the previous segment (ends at {prev_end})")
        if s.q_start + s.q_len > total_q_rows:
            raise PlanError(f"segments[{i}] query rows end at {s.q_start + s.q_len} > B*L={total_q_rows}")
        if s.k_start < 0 or s.k_start + s.k_len > total_k_rows:
            raise PlanError(f"segments[{i}] key rows [{s.k_start}, {s.k_start + s.k_len}) outside [0, "
                            f"B*S_kv={total_k_rows})")
        if s.q_start // plan.q_rows != (s.q_start + s.q_len - 1) // plan.q_rows:
            raise PlanError(f"segments[{i}] query rows cross a batch row boundary")
        if s.k_start // plan.kv_rows != (s.k_start + s.k_len - 1) // plan.kv_rows:
            raise PlanError(f"segments[{i}] key rows cross a batch row boundary")
        prev_end = s.q_start + s.q_len
    total_q = sum(s.q_len for s in plan.segments)
    total_k = sum(s.k_len for s in plan.segments)
    for name, cu, lens, total, host_cu in (
            ("cu_seqlens_q", plan.cu_seqlens_q, [s.q_len for s in plan.segments], total_q, plan.host_cu_q),
            ("cu_seqlens_k", plan.cu_seqlens_k, [s.k_len for s in plan.segments], total_k, plan.host_cu_k)):
        if cu.dtype != torch.int32:
            raise PlanError(f"{name} must be int32, got {cu.dtype}")
        if cu.dim() != 1 or cu.numel() != n + 1:
            raise PlanError(f"{name} must have shape [{n + 1}], got {tuple(cu.shape)}")
        if cu.device.type == "cpu" and tuple(cu.tolist()) != tuple(host_cu):  # validation runs before the move
            raise PlanError(f"{name} disagrees with the plan's host offsets")
        if len(host_cu) != n + 1 or host_cu[0] != 0:
            raise PlanError(f"{name} must start at 0 and have {n + 1} entries, got {list(host_cu[:8])}...")
        if any(b <= a for a, b in zip(host_cu, host_cu[1:])):
            raise PlanError(f"{name} must strictly increase: {list(host_cu[:8])}...")
        if [b - a for a, b in zip(host_cu, host_cu[1:])] != lens:
            raise PlanError(f"{name} disagrees with the segment lengths")
        if host_cu[-1] != total:
            raise PlanError(f"{name}[-1]={host_cu[-1]} != total {total}")
    if plan.max_seqlen_q != max((s.q_len for s in plan.segments), default=0):
        raise PlanError(f"max_seqlen_q={plan.max_seqlen_q} is not the exact maximum")
    if plan.max_seqlen_k != max((s.k_len for s in plan.segments), default=0):
        raise PlanError(f"max_seqlen_k={plan.max_seqlen_k} is not the exact maximum")
    for name, index, total, bound in (("q_index", plan.q_index, total_q, total_q_rows),
                                      ("k_index", plan.k_index, total_k, total_k_rows)):
        if index is None:
            continue
        if index.dtype != torch.int64 or index.dim() != 1 or index.numel() != total:
            raise PlanError(f"{name} must be int64 [{total}], got {index.dtype} {tuple(index.shape)}")
        if index.device.type == "cpu" and total and (int(index.min()) < 0 or int(index.max()) >= bound):
            raise PlanError(f"{name} has rows outside [0, {bound})")
    if plan.k_index is None and total_k and not 0 <= plan.k_offset <= total_k_rows - total_k:
        raise PlanError(f"k_offset={plan.k_offset} + Tk={total_k} exceeds B*S_kv={total_k_rows}")
    if plan.cu_seqlens_k.device != plan.cu_seqlens_q.device:
        raise PlanError("cu_seqlens_q and cu_seqlens_k live on different devices")
