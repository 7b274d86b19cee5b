"""Acceptance 2 (exchange): a full tiny Llama training step on P = 2 and 4 gloo ranks equals the
CP=1 packed run and the documents run one by one with stock "sdpa": logits of every rank and the
parameter gradients all-reduced over CP ranks (fp32, rel 1e-4), also with activation checkpointing."""

from __future__ import annotations

import pytest

from tests.distributed import run_ranks

pytestmark = pytest.mark.distributed

LENGTHS = [9, 30, 1, 17, 6, 22, 11]  # 96 tokens; with P=4, L=24: documents straddle and span ranks


def _row(world: int):
    import torch

    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(0, 97, (n,), generator=gen) for n in LENGTHS]
    total = sum(LENGTHS)
    full = -(-total // world) * world
    pad = full - total
    ids = torch.cat(docs + [torch.zeros(pad, dtype=torch.long)])[None]
    doc_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(LENGTHS)] + [torch.zeros(pad, dtype=torch.long)])
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS] + [torch.zeros(pad, dtype=torch.long)])[None]
    # Next-token labels on the full row: -100 at each document's last token and at padding.
    labels = torch.full((full,), -100)
    start = 0
    for d in docs:
        labels[start:start + len(d) - 1] = d[1:]
        start += len(d)
    return docs, ids, doc_ids, position_ids, labels


def _token_loss(logits, labels, count):
    import torch

    return torch.nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum") / count


def _model_worker(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
    from hf_blockdiag_cp.attention.cp import step_backends
    from tests.reference import tiny_model

    docs, ids, doc_ids, position_ids, labels = _row(world)
    count = int((labels != -100).sum())
    full = ids.shape[1]
    local_len = full // world
    lo, hi = rank * local_len, (rank + 1) * local_len

    # (b) reference: each document alone with stock sdpa.
    ref_model = tiny_model("llama", attn_implementation="sdpa")
    ref_logits = [ref_model(d[None], use_cache=False).logits[0] for d in docs]
    loss = sum(_token_loss(lg[:-1], d[1:], count) for lg, d in zip(ref_logits, docs))
    loss.backward()
    ref_logits = torch.cat(ref_logits).detach()
    ref_grads = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    real = (doc_ids != 0)

    # (a) reference: the packed row on one rank (CP=1).
    one = tiny_model("llama", attn_implementation="blockdiag_cp")
    ctx1 = BlockDiagCPContext.build(doc_ids)
    out1 = one(ids, position_ids=position_ids, cp_context=ctx1, use_cache=False).logits[0]
    _token_loss(out1, labels, count).backward()
    cp1_grads = {n: p.grad.clone() for n, p in one.named_parameters()}

    report = {}
    for strategy in ("auto", "allgather", "a2a"):
        for checkpointing in (False, True):
            model = tiny_model("llama", attn_implementation="blockdiag_cp")
            model.train()
            if checkpointing:
                model.activation_checkpointing_enable()
            config = BlockDiagCPConfig(kv_exchange=strategy, collective_timeout_s=60)
            ctx = BlockDiagCPContext.build(doc_ids, cp_rank=rank, cp_size=world, group=dist.group.WORLD,
                                           config=config, input_ids=ids)
            logits = model(ids[:, lo:hi], position_ids=position_ids[:, lo:hi], cp_context=ctx,
                           use_cache=False).logits[0]
            _token_loss(logits, labels[lo:hi], count).backward()
            for p in model.parameters():
                dist.all_reduce(p.grad)
            grads = {n: p.grad for n, p in model.named_parameters()}
            mask = real[lo:hi]
            key = f"{strategy}/ckpt={checkpointing}"
            torch.testing.assert_close(logits[mask], out1[lo:hi][mask].detach(), rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{key} logits vs CP=1: {m}")
            torch.testing.assert_close(logits[mask], ref_logits[torch.arange(lo, hi)[mask]], rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"{key} logits vs documents alone: {m}")
            for name in grads:
                torch.testing.assert_close(grads[name], cp1_grads[name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name: f"{key} grad {n} vs CP=1: {m}")
                torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-4, atol=1e-6,
                                           msg=lambda m, n=name: f"{key} grad {n} vs documents alone: {m}")
            report[key] = (ctx.exchange.strategy, sorted(set(step_backends(ctx).values())))
    return report


@pytest.mark.parametrize("world", [2, 4])
def test_training_step_matches_single_process_and_documents_alone(world):
    reports = run_ranks(_model_worker, world, timeout=300)
    assert all(r == reports[0] for r in reports)  # every rank resolved the same strategy and backend
    assert reports[0]["allgather/ckpt=False"][0] == "allgather"
    assert reports[0]["auto/ckpt=False"][0] in ("halo", "a2a")
