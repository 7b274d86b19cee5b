"""Document-id helpers of ``planning/documents.py`` against brute-force Python loops, and their errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

from hf_blockdiag_cp.planning.documents import (
    check_cu_seqlens,
    doc_ids_from_cu_seqlens,
    doc_ids_from_flattening,
    doc_ids_from_position_ids,
    document_spans,
    run_boundaries,
    run_starts,
)

FAST = settings(max_examples=80, deadline=None)

# Few distinct values so that runs of equal ids (and ids that come back later) are common.
rows_strategy = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=4).map(
    lambda rows: [r + [0] * (max(map(len, rows)) - len(r)) for r in rows])


def loop_run_starts(row: list[int]) -> list[int]:
    out = []
    for t, value in enumerate(row):
        out.append(t if t == 0 or value != row[t - 1] else out[t - 1])
    return out


@FAST
@given(rows_strategy)
def test_run_starts_and_boundaries_match_a_loop(rows):
    ids = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), -1)
    expected = [loop_run_starts(r) for r in rows]
    assert run_starts(ids).tolist() == expected
    assert run_boundaries(ids).tolist() == [[s == t for t, s in enumerate(r)] for r in expected]
    for b, r in enumerate(rows):  # the 1-D form gives the same answer per row
        assert run_starts(ids[b]).tolist() == expected[b]
        runs: list[list[int]] = []
        for t, value in enumerate(r):
            if t and value == r[t - 1]:
                runs[-1][1] = t + 1
            else:
                runs.append([t, t + 1])
        assert document_spans(ids[b]) == [(lo, hi) for lo, hi in runs if r[lo] != 0]


def test_run_starts_by_hand():
    assert run_starts(torch.tensor([5, 5, 0, 0, 5, 7, 7])).tolist() == [0, 0, 2, 2, 4, 5, 5]
    assert run_starts(torch.zeros(0, dtype=torch.int64)).tolist() == []
    assert run_boundaries(torch.tensor([[1, 1, 2], [3, 4, 4]])).tolist() == [[True, False, True],
                                                                             [True, True, False]]


@FAST
@given(st.lists(st.integers(0, 4), min_size=1, max_size=30))
def test_doc_ids_from_position_ids_match_a_loop(pos):
    expected, doc = [], 0
    for t, p in enumerate(pos):
        doc += t == 0 or p != pos[t - 1] + 1
        expected.append(doc)
    assert doc_ids_from_position_ids(torch.tensor(pos)).tolist() == [expected]


@FAST
@given(st.lists(st.integers(0, 5), max_size=8), st.integers(0, 6))
def test_doc_ids_from_cu_seqlens_match_a_loop(lens, pad):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    length = cu[-1] + pad
    expected = [0] * length
    for doc, (lo, hi) in enumerate(zip(cu, cu[1:]), start=1):
        for t in range(lo, hi):
            expected[t] = doc
    assert doc_ids_from_cu_seqlens(cu, length).tolist() == expected
    assert check_cu_seqlens(torch.tensor([cu], dtype=torch.int32), length).tolist() == cu


@pytest.mark.parametrize("cu, bound, kwargs, match", [
    ([], 4, {}, r"cu_seq_lens is empty"),
    ([1, 3], 4, {}, r"cu_seq_lens must start at 0, got \[1, 3\]"),
    ([0, 3, 2, 4], 4, {}, r"cu_seq_lens must be non-decreasing, but cu_seq_lens\[2\]=2 < cu_seq_lens\[1\]=3"),
    ([0, 5], 4, {"name": "cu_seq_lens_k"}, r"cu_seq_lens_k ends at 5, beyond the sequence length 4"),
    ([0, 3], 4, {"name": "cu_seq_lens_q", "exact": True}, r"cu_seq_lens_q ends at 3, but the row has 4 tokens"),
    ([0.0, 2.0], 4, {}, r"cu_seq_lens must hold integers, got dtype torch.float32"),
    ([[0, 1], [0, 2]], 4, {}, r"cu_seq_lens must be 1-D \[N \+ 1\], got shape \(2, 2\)"),
    ([[0], [1, 2]], 4, {}, r"cu_seq_lens must be a 1-D sequence of ints"),
])
def test_check_cu_seqlens_errors_name_the_field(cu, bound, kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_cu_seqlens(cu, bound, **kwargs)


FLAT_DOCS = [{"input_ids": [5, 6, 7]}, {"input_ids": [8]}, {"input_ids": [9, 10, 11, 12]}, {"input_ids": [13, 14]}]


@pytest.mark.parametrize("field", ["cu_seq_lens_q", "cu_seq_lens_k", "seq_idx", "position_ids"])
def test_doc_ids_from_flattening_agree_on_hf_output(field):
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)(FLAT_DOCS)
    ids = doc_ids_from_flattening(10, **{field: hf[field].flatten()})
    assert ids.tolist() == [1, 1, 1, 2, 3, 3, 3, 3, 4, 4]


def test_doc_ids_from_flattening_priority_and_errors():
    # cu_seq_lens win over seq_idx, which wins over position_ids
    assert doc_ids_from_flattening(4, cu_seq_lens_k=[0, 1, 4], seq_idx=[0, 0, 0, 0],
                                   position_ids=[0, 0, 0, 0]).tolist() == [1, 2, 2, 2]
    assert doc_ids_from_flattening(4, seq_idx=[7, 7, 2, 2], position_ids=[0, 1, 2, 3]).tolist() == [1, 1, 2, 2]
    with pytest.raises(ValueError, match="needs cu_seq_lens_k, seq_idx or position_ids"):
        doc_ids_from_flattening(4)
    with pytest.raises(ValueError, match=r"cu_seq_lens_q=\[0, 2, 4\] and cu_seq_lens_k=\[0, 1, 4\] differ"):
        doc_ids_from_flattening(4, cu_seq_lens_q=[0, 2, 4], cu_seq_lens_k=[0, 1, 4])
    with pytest.raises(ValueError, match="cu_seq_lens_k ends at 3, but the row has 4 tokens"):
        doc_ids_from_flattening(4, cu_seq_lens_k=[0, 3])
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must start at 0"):
        doc_ids_from_flattening(4, cu_seq_lens_q=[1, 4])
    # every given field is checked, also one that is not used
    with pytest.raises(ValueError, match=r"seq_idx has shape \(3,\), expected \[4\]"):
        doc_ids_from_flattening(4, cu_seq_lens_k=[0, 4], seq_idx=[0, 0, 0])
    with pytest.raises(ValueError, match=r"position_ids has shape \(1, 4\), expected \[4\]"):
        doc_ids_from_flattening(4, position_ids=[[0, 1, 2, 3]])
