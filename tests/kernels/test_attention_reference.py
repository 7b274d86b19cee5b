"""Acceptance 1 (core): every CPU backend equals a float64 brute-force dense reference, outputs and
q/k/v gradients, over the layouts that matter."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp import blockdiag_attention
from tests.layouts import runs as _runs
from tests.reference import dense_reference

CPU_BACKENDS = ["sdpa_doc", "sdpa_mask"]


# name -> (doc_ids over S, row_offset, L)
LAYOUTS = {
    "many_1_token_docs": (list(range(1, 49)), 0, 48),
    "one_doc_everything": ([7] * 48, 0, 48),
    "first_doc_straddles_offset": (_runs((1, 20), (2, 17), (3, 11)), 24, 24),
    "straddle_from_far_back": (_runs((5, 40), (6, 8)), 32, 16),
    "padding_tail": (_runs((1, 13), (2, 19), (0, 16)), 0, 48),
    "all_padding_rows": (_runs((1, 30), (0, 18)), 32, 16),
    "mixed_short_docs": (_runs((1, 1), (2, 2), (3, 1), (4, 9), (5, 3), (6, 3), (7, 3), (8, 26)), 8, 40),
    "repeated_ids_make_new_runs": (_runs((1, 6), (2, 6), (1, 6), (3, 30)), 0, 48),
}


def _inputs(layout: str, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            seed: int = 0):
    doc, offset, local_len = LAYOUTS[layout]
    full_len = len(doc)
    gen = torch.Generator().manual_seed(seed)
    # transformers hands attention [B, H, seq, D] transposed views of [B, seq, H, D] tensors.
    q = torch.randn(batch, local_len, num_q_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, full_len, num_kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(batch, full_len, num_kv_heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v)], torch.tensor(doc), offset


def _compare(backend, layout, batch=1, num_q_heads=8, num_kv_heads=2, head_dim=64, window=None,
             dtype=torch.float32, doc_ids_per_row=False):
    (q, k, v), doc, offset = _inputs(layout, batch, num_q_heads, num_kv_heads, head_dim, dtype)
    if doc_ids_per_row:  # a different layout per batch row: row b rolls the ids
        doc = torch.stack([torch.roll(doc, 5 * b) for b in range(batch)])
    out = blockdiag_attention(q, k, v, doc, offset, sliding_window=window, backend=backend)
    ref = dense_reference(q.detach(), k.detach(), v.detach(), doc, offset, window=window)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got_grads = torch.autograd.grad(out, (q, k, v), grad.to(dtype))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(dense_reference(q64, k64, v64, doc, offset, window=window), (q64, k64, v64), grad)
    assert out.shape == ref.shape and out.dtype == dtype
    return out, ref, got_grads, ref_grads


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fp32_matches_dense_reference(backend, layout):
    out, ref, grads, ref_grads = _compare(backend, layout)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    for name, g, r in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0, msg=lambda m, n=name: f"grad {n}: {m}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 1, 7, 20])
@pytest.mark.parametrize("layout", ["first_doc_straddles_offset", "straddle_from_far_back", "mixed_short_docs"])
def test_gqa_head_dims_and_windows(backend, head_dim, window, layout):
    out, ref, grads, ref_grads = _compare(backend, layout, batch=2, head_dim=head_dim, window=window,
                                          doc_ids_per_row=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 8), (8, 1), (4, 2)])
def test_head_ratios(backend, num_q_heads, num_kv_heads):
    out, ref, grads, ref_grads = _compare(backend, "first_doc_straddles_offset", num_q_heads=num_q_heads,
                                          num_kv_heads=num_kv_heads, head_dim=32)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0)


def _floor(ref: torch.Tensor, dtype: torch.dtype) -> tuple[float, float]:
    """(max, mean) error of rounding the exact result to ``dtype``: no kernel can beat it."""
    err = (ref.to(dtype).double() - ref).abs()
    return err.max().item(), err.mean().item()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["first_doc_straddles_offset", "mixed_short_docs", "padding_tail",
                                    "one_doc_everything"])
def test_bf16_within_twice_the_rounding_floor(backend, layout):
    out, ref, grads, ref_grads = _compare(backend, layout, dtype=torch.bfloat16)
    floor_max, floor_mean = _floor(ref, torch.bfloat16)
    err = (out.double() - ref).abs()
    assert err.max().item() <= 2 * floor_max + 1e-6
    assert err.mean().item() <= 2 * floor_mean + 1e-6
    # Gradients pass through a bf16 backward (P and dS rounded): bound them relative to their scale.
    for g, r in zip(grads, ref_grads):
        scale = r.abs().max().item() + 1e-12
        floor_max, floor_mean = _floor(r, torch.bfloat16)
        g_err = (g.double() - r).abs()
        assert g_err.mean().item() <= 4 * floor_mean + 1e-3 * scale
        assert g_err.max().item() <= 0.05 * scale


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_all_padding_gives_zeros_and_finite_connected_grads(backend):
    (q, k, v), _, _ = _inputs("one_doc_everything", 1, 4, 2, 16, torch.float32)
    out = blockdiag_attention(q, k, v, torch.zeros(48, dtype=torch.long), 0, backend=backend)
    assert torch.count_nonzero(out) == 0
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    for g in (gq, gk, gv):
        assert g is not None and torch.isfinite(g).all() and torch.count_nonzero(g) == 0


def test_scale_and_dropout_reach_the_kernel():
    (q, k, v), doc, offset = _inputs("mixed_short_docs", 1, 4, 2, 16, torch.float32)
    out = blockdiag_attention(q, k, v, doc, offset, scale=0.3)
    ref = dense_reference(q.detach(), k.detach(), v.detach(), doc, offset, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)
    torch.manual_seed(0)
    dropped = blockdiag_attention(q, k, v, doc, offset, dropout_p=0.5)
    assert not torch.allclose(dropped, blockdiag_attention(q, k, v, doc, offset))
