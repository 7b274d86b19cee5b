"""Bidirectional blocks under CP = 2 and 4 (real gloo ranks): every placement, with a block split across ranks, a
full and a windowed layer, outputs and q/k/v gradients of each rank's rows against the float64 dense staircase;
the exchange moves what the planning tests check it needs (tests/planning/test_block_plans.py)."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

PLACEMENTS = ["contiguous", "zigzag", "balanced"]


def _row(world: int, local_len: int):
    import torch

    full = world * local_len
    doc = torch.tensor([1] * 5 + [2] * (full - 9) + [3] * 4)
    blk = torch.zeros(full, dtype=torch.long)
    blk[1:4] = 1  # inside document 1
    blk[local_len - 3:local_len + 4] = 2  # straddles the first rank boundary (contiguous placement)
    blk[full - 3:full - 1] = 3  # inside the last document
    return doc, blk


def _worker(rank: int, world: int, local_len: int) -> dict:
    import torch
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
    from hf_blockdiag_cp.attention.cp import sequence_attention
    from tests.attention.blocks_reference import dense_attention, staircase_mask

    doc, blk = _row(world, local_len)
    full = doc.numel()
    hq, hkv, d = 4, 2, 8
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, h, full, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    g = torch.randn(1, hq, full, d, generator=gen, dtype=torch.float64)
    results = {}
    for placement in PLACEMENTS:
        for window in (None, 4):
            config = BlockDiagCPConfig(backend="sdpa_doc", collective_timeout_s=60, placement=placement)
            ctx = BlockDiagCPContext.build(doc, cp_rank=rank, cp_size=world, group=dist.group.WORLD, config=config,
                                           block_ids=blk, sliding_windows=[window])
            ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = dense_attention(*ref_in, staircase_mask(doc, blk, window), d ** -0.5)
            ref_grads = torch.autograd.grad(ref, ref_in, g)
            idx = ctx.local_index
            local = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
            out = sequence_attention(ctx, *local, dropout_p=0.0, scale=d ** -0.5, window=window, softcap=None)
            out = out.view(1, local_len, hq, d).transpose(1, 2)
            grads = torch.autograd.grad(out, local, g[:, :, idx])
            # Each rank's own rows of the key gradients: the exchange's backward returned the others' shares.
            errors = [(out - ref[:, :, idx]).abs().max().item()]
            errors += [(a - b[:, :, idx]).abs().max().item() for a, b in zip(grads, ref_grads)]
            _, exchange = ctx.plans_for(window)
            results[(placement, window)] = dict(errors=errors, strategy=str(exchange.strategy))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_blocks_under_cp_match_the_dense_staircase(world):
    local_len = 8
    per_rank = run_ranks(_worker, world, local_len, timeout=240)
    for rank, results in enumerate(per_rank):
        for (placement, window), r in results.items():
            where = f"rank {rank} {placement} window={window} ({r['strategy']})"
            assert max(r["errors"]) < 1e-10, f"{where}: errors {r['errors']}"
