"""Bidirectional blocks ("causal, or same block") at CP = 1: ``blockdiag_attention(block_ids=...)`` and a context
built with ``block_ids`` against the float64 dense staircase mask, outputs and q/k/v gradients, on the CPU kernels
(sdpa_doc, sdpa_mask) and the flash adapter through its stand-in; backends without non-causal segments are not
chosen; a windowed layer without its plan is refused where the window cuts a block."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.attention.core import attend_flat, flat_rows
from hf_blockdiag_cp.kernels import KernelSpec, available_backends, get_backend
from hf_blockdiag_cp.runtime import device_plan
from tests.attention.blocks_reference import dense_attention, random_row, staircase_mask
from tests.standins import standins  # noqa: F401 (fixture)

CAPABILITIES = {name: get_backend(name).CAPABILITIES for name in ("te", "torch_varlen", "flex")}

HQ, HKV, D = 4, 2, 8


def _qkv(length: int, seed: int, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    make = [torch.randn(1, h, length, D, generator=g, dtype=dtype).requires_grad_() for h in (HQ, HKV, HKV)]
    return make, torch.randn(1, HQ, length, D, generator=g, dtype=dtype)


def _check(out, q, k, v, grad, doc, blk, window, tol=1e-12):
    want = dense_attention(q, k, v, staircase_mask(doc, blk, window), D ** -0.5)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert (out.double() - want).abs().max().item() < tol
    for a, b in zip(got_grads, want_grads):
        assert (a.double() - b).abs().max().item() < tol


@pytest.mark.parametrize("backend", ["sdpa_doc", "sdpa_mask"])
@pytest.mark.parametrize("window", [None, 3, 7])
@pytest.mark.parametrize("seed", range(2))
def test_blockdiag_attention_with_blocks_matches_the_dense_staircase(backend, window, seed):
    doc, blk = random_row(40, seed, padding=3 if seed % 2 else 0)
    (q, k, v), grad = _qkv(40, seed)
    out = bd.blockdiag_attention(q, k, v, doc, sliding_window=window, backend=backend, block_ids=blk)
    _check(out, q, k, v, grad, doc, blk, window)


@pytest.mark.parametrize("window", [None, 5])
def test_context_plan_with_blocks_matches_the_dense_staircase(window):
    doc, blk = random_row(48, 11)
    ctx = bd.BlockDiagCPContext.build(doc, block_ids=blk, sliding_windows=[window])
    (q, k, v), grad = _qkv(48, 11)
    plan = device_plan(ctx, q.device, window)
    assert plan.plan.has_blocks
    out = attend_flat(flat_rows(q), flat_rows(k), flat_rows(v), plan.plan, "sdpa_doc", scale=D ** -0.5,
                      window=window, schedules=plan.schedules)
    out = out.view(1, 48, HQ, D).transpose(1, 2)
    _check(out, q, k, v, grad, doc, blk, window)


def test_a_row_of_block_queries_only_and_a_block_as_long_as_its_document():
    doc = torch.tensor([1] * 6 + [2] * 4)
    blk = torch.tensor([1] * 6 + [2] * 4)  # every query is in a block: the causal part is empty
    (q, k, v), grad = _qkv(10, 3)
    out = bd.blockdiag_attention(q, k, v, doc, backend="sdpa_doc", block_ids=blk)
    _check(out, q, k, v, grad, doc, blk, None)


def test_flash_adapter_runs_the_non_causal_part(standins):
    doc, blk = random_row(32, 5)
    (q, k, v), grad = _qkv(32, 5, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent fallback to another backend would fail here
        out = bd.blockdiag_attention(q, k, v, doc, backend="flash", block_ids=blk)
    calls = standins.flash.calls
    assert any(not c.causal for c in calls) and any(c.causal for c in calls)
    _check(out, q, k, v, grad, doc, blk, None, tol=1e-4)


def test_backends_without_non_causal_segments_are_not_available():
    spec = KernelSpec(device_type="cuda", dtype=torch.bfloat16, head_dim=64, value_dim=64, num_q_heads=4,
                      num_kv_heads=2, noncausal=True)
    for name in ("te", "torch_varlen", "flex"):
        table = dataclasses.replace(CAPABILITIES[name], module=None, devices=None, dtypes=None)  # the entry alone
        assert "non-causal" in (table.unavailable_reason(spec) or "")
    assert "sdpa_doc" in available_backends(spec)
    spec_cpu = KernelSpec(device_type="cpu", dtype=torch.float32, head_dim=8, value_dim=8, num_q_heads=4,
                          num_kv_heads=2, noncausal=True, softcap=30.0)
    assert "sdpa_doc" not in available_backends(spec_cpu)


def test_block_ids_are_validated_on_the_host():
    doc = torch.tensor([1, 1, 1, 2, 2, 0])
    with pytest.raises(ValueError, match="crosses the document boundary at position 3"):
        bd.BlockDiagCPContext.build(doc, block_ids=torch.tensor([0, 1, 1, 1, 0, 0]))
    with pytest.raises(ValueError, match="on padding"):
        bd.BlockDiagCPContext.build(doc, block_ids=torch.tensor([0, 0, 0, 0, 0, 4]))
    with pytest.raises(ValueError, match="shape"):
        bd.BlockDiagCPContext.build(doc, block_ids=torch.tensor([0, 0, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        bd.BlockDiagCPContext.build(doc, block_ids=torch.tensor([0, -1, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="integer"):
        bd.BlockDiagCPContext.build(doc, block_ids=torch.zeros(6))
    # All zero: no block (plain causal plans), recorded as an empty set (the collator read the rows' token types).
    empty = bd.BlockDiagCPContext.build(doc, block_ids=torch.zeros(6, dtype=torch.long))
    assert empty.blocks is not None and empty.blocks.count == 0 and not empty.plan.has_blocks
