"""The sparse attention over selected keys (hf_blockdiag_cp/sparse/attention.py) against a float64 dense reference:
softmax over exactly the selected keys a query may see, outputs and gradients of q, k, v; also through a ``key_rows``
map (the CP buffer, its rows in another order than the positions), chunked, with GQA; and the plain-path switch."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.sparse import selects_everything, sparse_attention
from hf_blockdiag_cp.sparse.attention import query_bounds


def _inputs(n=20, heads=4, kv_heads=2, dim=6, vdim=5, width=5, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(n, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(n, kv_heads, vdim, generator=gen, dtype=torch.float64)
    # distinct keys per query (as an indexer selects them), some slots empty (-1), some beyond the query
    idx = torch.stack([torch.randperm(n, generator=gen)[:width] for _ in range(n)])[None]
    idx[:, ::4, -1] = -1
    lo = torch.tensor([0] * 8 + [8] * 12)  # two documents: rows 0-7 and 8-19
    hi = torch.arange(n)
    hi[3] = -1  # a padding query: sees nothing
    return q, k, v, idx, lo, hi


def _dense(q, k, v, idx, lo, hi, scale):
    """Float64 reference: a [n, n] mask of the selected, visible keys; softmax; zeros where nothing is visible."""
    n, heads = q.shape[:2]
    groups = heads // k.shape[1]
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        for j in idx[0, i].tolist():
            if j >= 0 and lo[i] <= j <= hi[i]:
                mask[i, j] = True
    kr, vr = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("nhd,mhd->hnm", q, kr) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    return torch.einsum("hnm,mhd->nhd", probs, vr)


@pytest.mark.parametrize("q_chunk", [None, 3])
def test_outputs_and_gradients_equal_the_dense_reference(q_chunk):
    q, k, v, idx, lo, hi = _inputs()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = sparse_attention(*leaves, idx, (lo, hi), scale=0.4, q_chunk=q_chunk)
    want = _dense(*refs, idx, lo, hi, 0.4)
    torch.testing.assert_close(out, want)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for got, ref in zip(leaves, refs):
        torch.testing.assert_close(got.grad, ref.grad)
    assert out[3].abs().max() == 0  # the padding query


def test_key_rows_map_positions_to_buffer_rows():
    """The CP form: global positions in indices and bounds, rows of k / v in buffer order (a permutation)."""
    q, k, v, idx, lo, hi = _inputs(seed=1)
    perm = torch.randperm(k.shape[0], generator=torch.Generator().manual_seed(2))  # buffer row b holds position perm[b]
    key_rows = torch.empty_like(perm)
    key_rows[perm] = torch.arange(perm.numel())
    leaves = [t.clone().requires_grad_() for t in (q, k[perm], v[perm])]
    out = sparse_attention(*leaves, idx, (lo, hi), scale=0.3, key_rows=key_rows, q_chunk=4)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _dense(*refs, idx, lo, hi, 0.3)
    torch.testing.assert_close(out, want)
    out.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(leaves[0].grad, refs[0].grad)
    torch.testing.assert_close(leaves[1].grad, refs[1].grad[perm])
    torch.testing.assert_close(leaves[2].grad, refs[2].grad[perm])


def test_plain_path_switch_reads_the_plan():
    from hf_blockdiag_cp.planning import build_varlen_plan

    plan = build_varlen_plan(torch.tensor([1] * 5 + [2] * 9 + [0] * 2))
    assert selects_everything(plan, 9) and not selects_everything(plan, 8)
    lo, hi = query_bounds(plan, torch.device("cpu"))
    assert lo[6] == 5 and hi[6] == 6 and lo[15] > hi[15]


def test_dropout_path_runs_the_same_math():
    q, k, v, idx, lo, hi = _inputs(seed=3)
    plain = sparse_attention(q, k, v, idx, (lo, hi), scale=0.5)
    dropped = sparse_attention(q, k, v, idx, (lo, hi), scale=0.5, dropout_p=1e-12, training=True, q_chunk=7)
    torch.testing.assert_close(dropped, plain)
