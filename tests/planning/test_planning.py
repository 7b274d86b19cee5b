"""Host-side planning: the plan's visibility equals a brute-force dense mask; bad plans never pass."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.planning import (
    PlanError,
    QueryPiece,
    Segment,
    build_varlen_plan,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    document_spans,
    plan_from_segments,
)


def brute_force_mask(doc: torch.Tensor, q_positions: list[int]) -> torch.Tensor:
    """``[len(q_positions), S]`` bool: same run of one non-zero id and key <= query."""
    full_len = doc.numel()
    run = torch.zeros(full_len, dtype=torch.long)
    run[1:] = (doc[1:] != doc[:-1]).long()
    run = run.cumsum(0)
    rows = []
    for p in q_positions:
        k = torch.arange(full_len)
        rows.append((run == run[p]) & (doc != 0) & (doc[p] != 0) & (k <= p))
    return torch.stack(rows) if rows else torch.zeros(0, full_len, dtype=torch.bool)


def plan_mask(plan, local_len: int, kv_positions: list[int]) -> torch.Tensor:
    """Visibility the plan encodes, as ``[B*L, S_global]`` over global key positions (B=1)."""
    full_len = max(kv_positions) + 1 if kv_positions else 0
    mask = torch.zeros(plan.batch_size * local_len, len(kv_positions) and full_len, dtype=torch.bool)
    for s in plan.segments:
        for i in range(s.q_len):
            last = s.k_start + s.k_len - s.q_len + i  # bottom-right alignment
            for j in range(s.k_start, last + 1):
                mask[s.q_start + i, kv_positions[j]] = True
    return mask


doc_lists = st.lists(st.integers(min_value=0, max_value=4), min_size=1, max_size=40)


@settings(max_examples=200, deadline=None)
@given(doc=doc_lists, data=st.data())
def test_contiguous_plan_equals_brute_force(doc, data):
    doc = torch.tensor(doc)
    full_len = doc.numel()
    offset = data.draw(st.integers(0, full_len - 1))
    local_len = data.draw(st.integers(1, full_len - offset))
    plan = build_varlen_plan(doc, local_len=local_len, row_offset=offset)
    q_positions = list(range(offset, offset + local_len))
    expected = brute_force_mask(doc, q_positions)
    got = plan_mask(plan, local_len, list(range(full_len)))
    assert torch.equal(got, expected)
    # Exact maxima and offsets.
    assert plan.max_seqlen_q == max((s.q_len for s in plan.segments), default=0)
    assert plan.cu_seqlens_q.dtype == torch.int32 and plan.cu_seqlens_k.dtype == torch.int32
    assert plan.total_q == int((doc[offset:offset + local_len] != 0).sum())


@settings(max_examples=150, deadline=None)
@given(doc=doc_lists, data=st.data())
def test_partial_kv_buffer_and_pieces(doc, data):
    """A K/V buffer holding only the needed range, and local rows placed as several pieces."""
    doc = torch.tensor(doc)
    full_len = doc.numel()
    cut = data.draw(st.integers(1, full_len))
    pieces = [QueryPiece(0, 0, cut - 1, 1)]
    if cut < full_len:
        pieces.append(QueryPiece(0, 1, data.draw(st.integers(cut, full_len - 1)), 1))
    local_len = len(pieces)
    q_positions = [p.global_start for p in pieces]
    expected = brute_force_mask(doc, q_positions)
    # The buffer holds [lo, S) where lo is the start of the earliest needed document.
    needed = expected.any(0).nonzero().flatten().tolist()
    lo = needed[0] if needed else 0
    plan = build_varlen_plan(doc, local_len=local_len, pieces=pieces, kv_ranges=[(lo, full_len)])
    got = plan_mask(plan, local_len, list(range(lo, full_len)))
    assert torch.equal(got[:, lo:], expected[:, lo:]) and not got[:, :lo].any()


def test_straddling_first_segment_has_more_keys_than_queries():
    doc = torch.tensor([1] * 10 + [2] * 6)
    plan = build_varlen_plan(doc, local_len=8, row_offset=8)
    assert plan.segments[0] == Segment(q_start=0, q_len=2, k_start=0, k_len=10)
    assert plan.prefix_segments == (0,)
    assert [(s.q_len, s.k_len) for s in plan.segments[1:]] == [(6, 6)]
    assert plan.q_index is None and plan.k_index is None  # slices, no gathers


def test_batch_rows_gather_only_when_needed():
    doc = torch.tensor([[1, 1, 2, 0], [3, 3, 3, 3]])
    plan = build_varlen_plan(doc, local_len=4)
    assert plan.q_index.tolist() == [0, 1, 2, 4, 5, 6, 7]
    assert plan.k_index.tolist() == [0, 1, 2, 4, 5, 6, 7]
    full = build_varlen_plan(torch.tensor([[1, 1, 2, 2], [3, 3, 3, 3]]), local_len=4)
    assert full.q_index is None and full.k_index is None


def test_kv_buffer_missing_needed_keys_is_a_plan_error():
    with pytest.raises(PlanError, match="does not hold the keys"):
        build_varlen_plan(torch.tensor([1] * 8), local_len=4, row_offset=4, kv_ranges=[(2, 8)])


def _good_plan():
    return build_varlen_plan(torch.tensor([1] * 5 + [2] * 3 + [3] * 4), local_len=6, row_offset=6)


@pytest.mark.parametrize("field,value,match", [
    ("cu_seqlens_q", torch.tensor([0, 2, 6], dtype=torch.int64), "int32"),
    ("cu_seqlens_q", torch.tensor([0, 2, 7], dtype=torch.int32), "cu_seqlens_q"),
    ("cu_seqlens_k", torch.tensor([1, 4, 8], dtype=torch.int32), "cu_seqlens_k"),
    ("host_cu_q", (0, 3, 6), "cu_seqlens_q"),
    ("host_cu_k", (0, 4, 4), "cu_seqlens_k"),
    ("max_seqlen_q", 5, "max_seqlen_q"),
    ("max_seqlen_k", 99, "max_seqlen_k"),
    ("q_index", torch.tensor([0, 1, 2, 3, 4, 9]), "q_index"),
    ("k_offset", 7, "k_offset"),
    ("segments", (Segment(0, 2, 0, 1), Segment(2, 4, 2, 4)), "k_len"),
    ("segments", (Segment(0, 4, 0, 5), Segment(2, 4, 5, 4)), "overlaps"),
])
def test_corrupted_plans_raise_before_any_kernel(field, value, match):
    plan = dataclasses.replace(_good_plan(), **{field: value})
    with pytest.raises(PlanError, match=match):
        plan.validate()


def test_good_plan_validates_and_moves():
    plan = _good_plan()
    plan.validate()
    moved = plan.to("cpu")
    assert moved is plan  # already there: no copy, same schedule cache
    assert "segments=2" in plan.describe()


def test_from_segments_rejects_bad_geometry():
    with pytest.raises(PlanError, match="batch row"):
        plan_from_segments([Segment(2, 4, 0, 4)], batch_size=2, q_rows=4, kv_rows=4)


def test_document_ids_conversions():
    assert document_spans(torch.tensor([0, 1, 1, 2, 0, 2, 2])) == [(1, 3), (3, 4), (5, 7)]
    assert doc_ids_from_cu_seqlens([0, 2, 5], 7).tolist() == [1, 1, 2, 2, 2, 0, 0]
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 5, 6]])
    assert doc_ids_from_position_ids(pos).tolist() == [[1, 1, 1, 2, 2, 3, 4, 4]]
    with pytest.raises(ValueError, match="cu_seq_lens"):
        doc_ids_from_cu_seqlens([0, 3, 2], 4)
    with pytest.raises(ValueError, match="beyond"):
        doc_ids_from_cu_seqlens([0, 5], 4)
