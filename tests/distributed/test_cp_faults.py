"""Acceptance 4-5 (exchange): rank agreement on backends, failures that reach every rank in bounded
time, mismatched data caught before any exchange, and no host reads in CP attention layers."""

from __future__ import annotations

import time

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

LENGTHS = [5, 20, 3, 12, 8]  # 48 tokens over 2 ranks of 24: the second document straddles


def _inputs(rank: int, world: int, seed: int = 0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    doc_ids = torch.repeat_interleave(torch.arange(1, len(LENGTHS) + 1), torch.tensor(LENGTHS))
    ids = torch.randint(0, 97, (1, doc_ids.numel()), generator=gen)
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    local = doc_ids.numel() // world
    return doc_ids, ids, pos, slice(rank * local, (rank + 1) * local)


def _fallback_worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
    from hf_blockdiag_cp.attention.layer import step_backends
    from tests.reference import tiny_model

    doc_ids, ids, pos, sl = _inputs(rank, world)
    config = BlockDiagCPConfig()  # rank 1's environment disables sdpa_doc
    ctx = BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=rank, cp_size=world, group=dist.group.WORLD,
                                   config=config)
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    logits = model(ids[:, sl], position_ids=pos[:, sl], cp_context=ctx, use_cache=False).logits[0]
    ref = tiny_model("llama", attn_implementation="blockdiag_cp")(ids, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(logits, ref[sl], atol=1e-5, rtol=0)
    return {"disabled": config.disabled_backends, "backends": sorted(set(step_backends(ctx).values()))}


def test_one_rank_without_the_backend_makes_every_rank_fall_back_together():
    results = run_ranks(_fallback_worker, 2, env={1: {"HF_BLOCKDIAG_CP_DISABLE_BACKENDS": "sdpa_doc"}})
    assert results[0]["disabled"] == () and results[1]["disabled"] == ("sdpa_doc",)
    assert results[0]["backends"] == results[1]["backends"] == ["sdpa_mask"]


def _kernel_failure_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    import hf_blockdiag_cp.kernels.sdpa_doc as sdpa_doc
    from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
    from tests.reference import tiny_model

    if rank == 1:
        def broken(*args, **kwargs):
            raise RuntimeError("injected kernel fault")
        sdpa_doc.attention = broken
    doc_ids, ids, pos, sl = _inputs(rank, world)
    config = BlockDiagCPConfig(collective_timeout_s=30)
    ctx = BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=rank, cp_size=world, group=dist.group.WORLD,
                                   config=config)
    model = tiny_model("llama", attn_implementation="blockdiag_cp", num_hidden_layers=3)
    model.train()
    out = model(ids[:, sl], position_ids=pos[:, sl], labels=ids[:, sl], cp_context=ctx, use_cache=False)
    out.loss.backward()


def test_a_kernel_fault_on_one_rank_fails_every_rank_in_bounded_time():
    start = time.monotonic()
    outcome = run_ranks(_kernel_failure_worker, 2, timeout=120, expect_failure=True)
    elapsed = time.monotonic() - start
    assert [status for status, _ in outcome] == ["error", "error"], outcome
    assert "CPKernelError" in outcome[1][1] and "injected kernel fault" in outcome[1][1]
    assert "CollectiveError" in outcome[0][1], outcome[0][1]  # the peer stops at its next exchange
    assert elapsed < 100


def _mismatch_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPContext
    from tests.reference import tiny_model

    doc_ids, ids, pos, sl = _inputs(rank, world, seed=rank)  # each rank got different tokens
    ctx = BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=rank, cp_size=world, group=dist.group.WORLD,
                                   input_ids=ids)
    tiny_model("llama", attn_implementation="blockdiag_cp")(ids[:, sl], position_ids=pos[:, sl], cp_context=ctx,
                                                             use_cache=False)


def _collated_mismatch_worker(rank: int, world: int) -> None:
    import torch
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    # The same document lengths (the same layout) but other tokens on each rank, through the collator.
    gen = torch.Generator().manual_seed(100 + rank)
    docs = [{"input_ids": torch.randint(1, 97, (n,), generator=gen).tolist()} for n in (5, 11, 7)]
    batch = bd.PackingCollator(24, group=dist.group.WORLD, pad_token_id=0)(docs)
    tiny_model("llama", attn_implementation="blockdiag_cp")(**batch)


@pytest.mark.parametrize("worker", [_mismatch_worker, _collated_mismatch_worker], ids=["context", "collator"])
def test_ranks_with_different_data_all_raise_before_exchanging(worker):
    outcome = run_ranks(worker, 2, timeout=120, expect_failure=True)
    for status, message in outcome:
        assert status == "error" and "AgreementError" in message and "different packed rows" in message, message


def _sync_worker(rank: int, world: int) -> list[list[str]]:
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
    from hf_blockdiag_cp.integration import blockdiag_cp_attention
    from tests.reference import tiny_model
    from tests.spies import registered_attention
    from tests.sync_counter import SyncCounter

    counter, per_call = SyncCounter(), []

    def counted(*args, **kwargs):
        before = len(counter.calls)
        with counter.region():
            out = blockdiag_cp_attention(*args, **kwargs)
        per_call.append(counter.calls[before:])
        return out

    doc_ids, ids, pos, sl = _inputs(rank, world)
    with registered_attention("blockdiag_cp_counted", counted):
        model = tiny_model("llama", attn_implementation="blockdiag_cp_counted", num_hidden_layers=3)
        model.train()
        model.activation_checkpointing_enable()
        for strategy in ("a2a", "halo", "allgather"):
            ctx = BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=rank, cp_size=world,
                                           group=dist.group.WORLD, config=BlockDiagCPConfig(kv_exchange=strategy))
            with counter.patched():
                out = model(ids[:, sl], position_ids=pos[:, sl], labels=ids[:, sl], cp_context=ctx,
                            use_cache=False)
                out.loss.backward()
    return per_call


def test_no_host_reads_in_cp_attention_layers():
    for per_call in run_ranks(_sync_worker, 2):
        assert len(per_call) == 3 * 6  # 3 steps x (3 layers + 3 recomputed)
        for step in range(3):
            calls = per_call[6 * step: 6 * step + 6]
            # The step's first layer reads the 3-int agreement table (a CPU tensor, gloo) once; no layer
            # reads anything else, and the recompute during backward reads nothing.
            assert calls[0] == ["tolist"], calls
            assert all(c == [] for c in calls[1:]), calls
