"""Every covered vision-language architecture on packed image rows, at CP = 1 and on 2 gloo ranks (balanced
placement), against each document alone through the stock model: logits, the token-sum loss and the gradients of
every parameter, the vision tower's included (:mod:`hf_blockdiag_cp.conformance.multimodal`)."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.conformance.multimodal import (
    build_vlm,
    compare,
    documents_alone,
    make_stateful,
    synthetic_documents,
    tiny_vlm_config,
)
from tests.launch import run_ranks

#: Served with images at CP = 1 and under CP (gemma3 / paligemma: bidirectional image blocks, their own tests).
SERVED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "idefics3", "smolvlm", "mistral3", "internvl")
OURS = {"text_config": "blockdiag_cp", "vision_config": "sdpa", "": "blockdiag_cp"}
SEQ_LEN = 512


def _setup(model_type: str):
    config = tiny_vlm_config(model_type)
    stock = build_vlm(config, "sdpa")
    make_stateful(stock)  # qwen3_5's gated-delta state must survive document pieces (tiny configs forget at once)
    ours = build_vlm(config, OURS)
    ours.load_state_dict(stock.state_dict())
    docs = synthetic_documents(config, num_docs=4, seed=7, images=(1, 2, 0, 1))
    return stock, ours, docs, documents_alone(stock, docs)


def _packed_order(collator, docs) -> list[int]:
    return [d.index for d in collator.pack(docs)[0].documents]


@pytest.mark.parametrize("model_type", SERVED)
def test_packed_row_at_cp1(model_type):
    stock, ours, docs, alone = _setup(model_type)
    collator = bd.PackingCollator(SEQ_LEN, pad_token_id=0, model_config=ours.config)
    batch = collator(docs)
    out = ours(**batch)
    (out.loss * batch["num_items_in_batch"]).backward()
    logits, start = [None] * len(docs), 0
    for i in _packed_order(collator, docs):
        n = len(docs[i]["input_ids"])
        logits[i] = out.logits[0, start:start + n].detach()
        start += n
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    err = compare(logits, out.loss.detach() * batch["num_items_in_batch"], grads, alone)
    assert max(err.values()) < 1e-4, (model_type, err)


def _cp_worker(rank: int, world: int, types: tuple[str, ...]) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    results = {}
    for model_type in types:
        stock, ours, docs, alone = _setup(model_type)
        collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, model_config=ours.config)
        batch = collator(docs)
        out = ours(**batch)
        (out.loss * batch["num_items_in_batch"]).backward()
        for p in ours.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        loss = out.loss.detach() * batch["num_items_in_batch"]
        dist.all_reduce(loss)
        ref = torch.cat([alone.logits[i] for i in _packed_order(collator, docs)])
        local = batch["cp_context"].local_index
        real = local < ref.shape[0]
        err = compare([out.logits[0].detach()[real]], loss, {n: p.grad for n, p in ours.named_parameters()},
                      alone._replace(logits=[ref[local[real]]]) if hasattr(alone, "_replace") else
                      type(alone)([ref[local[real]]], alone.loss, alone.grads))
        results[model_type] = err
    return results


@pytest.mark.distributed
@pytest.mark.timeout(600)
def test_packed_rows_at_cp2():
    for rank, res in enumerate(run_ranks(_cp_worker, 2, SERVED, timeout=500)):
        for model_type, err in res.items():
            assert max(err.values()) < 1e-4, (rank, model_type, err)
