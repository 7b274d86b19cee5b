"""The indexer's running top-k (hf_blockdiag_cp/sparse/topk.py) against a brute force: the full score matrix of
one document, ranked by (score descending, position ascending), with exact ties forced (keys that score 0)."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.sparse import document_topk
from hf_blockdiag_cp.sparse.topk import index_scores


def _inputs(n: int, m: int, heads: int = 3, dim: int = 8, seed: int = 0, zero_keys: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen)
    k = torch.randn(m, dim, generator=gen)
    w = torch.randn(n, heads, generator=gen).abs()  # positive weights: a zero key scores exactly 0, others > 0
    if zero_keys:  # keys whose ReLU is 0 in every head: exact ties at 0
        k[torch.randperm(m, generator=gen)[:zero_keys]] = 0
    return q, k, w


def _brute(q, k, w, scale, topk, q_offset=0, key_valid=None):
    n, m = q.shape[0], k.shape[0]
    scores = index_scores(q, k, w, scale)  # [n, m]
    out = torch.full((n, min(topk, m)), -1, dtype=torch.int64)
    for i in range(n):
        keys = [j for j in range(m) if j <= q_offset + i and (key_valid is None or bool(key_valid[j]))]
        ranked = sorted(keys, key=lambda j: (-float(scores[i, j]), j))[:topk]
        out[i, :len(ranked)] = torch.tensor(ranked, dtype=torch.int64)
    return out


def _as_sets(sel):
    return [sorted(int(j) for j in row if j >= 0) for row in sel]


@pytest.mark.parametrize("q_block,k_block", [(1024, 1024), (3, 4), (5, 1), (1, 7)])
@pytest.mark.parametrize("zero_keys", [0, 9])
def test_running_topk_equals_the_brute_force(q_block, k_block, zero_keys):
    q, k, w = _inputs(30, 30, zero_keys=zero_keys)
    got = document_topk(q, k, w, 0.3, 6, q_block=q_block, k_block=k_block)
    ref = _brute(q, k, w, 0.3, 6)
    assert torch.equal(got, ref)  # the same keys in the same order (best first, ties by position)


def test_ties_pick_the_lower_positions():
    q, k, w = _inputs(12, 12)
    k[:] = 0  # every key scores exactly 0: the first positions win
    sel = document_topk(q, k, w, 1.0, 4, k_block=3)
    for i in range(12):
        assert _as_sets(sel[i:i + 1])[0] == list(range(min(4, i + 1)))


def test_selection_is_relative_to_the_document():
    """The same document inside a longer key run (its keys shifted by a prefix that none of its queries may see is
    not what the indexer gets; it gets the document's own slice): the selection depends on nothing else."""
    q, k, w = _inputs(20, 20, zero_keys=6)
    alone = document_topk(q, k, w, 0.5, 5)
    again = document_topk(q.clone(), k.clone(), w.clone(), 0.5, 5, q_block=7, k_block=2)
    assert torch.equal(alone, again)


def test_cache_offset_and_padding_keys():
    q, k, w = _inputs(4, 15, zero_keys=5, seed=1)
    valid = torch.ones(15, dtype=torch.bool)
    valid[:3] = False  # left padding
    got = document_topk(q, k, w, 0.4, 6, q_offset=11, key_valid=valid, k_block=4)
    assert torch.equal(got, _brute(q, k, w, 0.4, 6, q_offset=11, key_valid=valid))
    assert not (got[(got >= 0)] < 3).any()


def test_short_documents_select_every_earlier_key():
    q, k, w = _inputs(5, 5, zero_keys=2)
    sel = document_topk(q, k, w, 0.5, 8)
    assert sel.shape == (5, 5)
    assert _as_sets(sel) == [list(range(i + 1)) for i in range(5)]
    # the shortcut equals the scored path's set
    assert _as_sets(sel) == _as_sets(_brute(q, k, w, 0.5, 8))
