"""DSA models (deepseek_v32, glm_moe_dsa with a "shared" layer) under context parallelism on real gloo ranks, against
each document alone through the stock model with the stable tie rule in its indexer: logits, loss and gradients
(rel 1e-4), every placement and exchange strategy, a document (41 tokens) split across ranks.

Each rank computes the reference itself (tiny models), runs its shard with a :class:`PackingCollator` batch and
all-reduces the gradients; the logits of its rows are compared through ``cp_context.local_index``. Several scenarios
share one spawn (each spawn costs seconds). The latent exchange is checked too: the bytes a layer's exchange moved
equal rows x (kv_lora_rank + qk_rope_head_dim) for the latent plus rows x index_head_dim for a full layer's indexer.
"""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

SEQ_LEN = 96  # divisible by 2P for zigzag at P = 2, 4
LENGTHS = (9, 23, 5, 41, 12)  # 90 tokens and 6 padding; 41 > S/P: split across ranks
# (model type, placement, kv_exchange, activation checkpointing, index_topk); index_topk 64: no document is longer,
# so every rank takes the plain block-diagonal kernel over the latent buffer and the indexer moves nothing.
CASES = (
    ("deepseek_v32", "contiguous", "auto", False, 8),
    ("deepseek_v32", "zigzag", "auto", False, 8),
    ("deepseek_v32", "balanced", "allgather", False, 8),
    ("glm_moe_dsa", "contiguous", "a2a", True, 8),
    ("glm_moe_dsa", "zigzag", "auto", False, 8),
    ("glm_moe_dsa", "balanced", "auto", False, 8),
    ("deepseek_v32", "zigzag", "auto", False, 64),
)


def _reference(stock, docs):
    from tests.sparse.harness import reference

    return reference(stock, docs)


def _shard_run(model, docs, placement, strategy):
    """This rank's shard of the packed row: ``(logits of its real rows, their row positions, summed loss, grads,
    context)``; gradients and loss summed over the CP ranks."""
    import torch
    import torch.distributed as dist

    import hf_blockdiag_cp as bd

    collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, placement=placement,
                                  config=bd.BlockDiagCPConfig(kv_exchange=strategy, collective_timeout_s=60))
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    ctx = batch["cp_context"]
    model.zero_grad(set_to_none=True)
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_context=ctx, use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits[0].float(), batch["shift_labels"][0], ignore_index=-100,
                                             reduction="sum")
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads[name] = g
    total = loss.detach().clone()
    dist.all_reduce(total)
    real = ctx.doc_ids[0, ctx.local_index] != 0
    return out.logits[0][real].detach(), ctx.local_index[real], total, grads, ctx


def _cases_worker(rank: int, world: int, cases: tuple) -> dict:

    from hf_blockdiag_cp.attention.layer import comm_stats
    from hf_blockdiag_cp.conformance.runs import grad_error
    from tests.sparse.harness import documents, models

    report = {}
    refs = {}
    for model_type, placement, strategy, checkpointing, topk in cases:
        stock, ours, config = models(model_type, topk=topk)
        if (model_type, topk) not in refs:
            docs = documents(config, LENGTHS)
            refs[model_type, topk] = (docs, *_reference(stock, docs))
        docs, ref_logits, ref_loss, ref_grads = refs[model_type, topk]
        ours.train()
        if checkpointing:
            ours.activation_checkpointing_enable()
        logits, where, loss, grads, ctx = _shard_run(ours, docs, placement, strategy)
        key = f"{model_type}/{placement}/{strategy}/ckpt={checkpointing}/topk={topk}"
        want = ref_logits[where]
        err = float((logits - want).abs().max() / ref_logits.abs().max()) if where.numel() else 0.0
        assert err <= 1e-4, f"{key}: logits differ by {err:.2e}"
        assert abs(float(loss - ref_loss)) <= 1e-4 * float(ref_loss), f"{key}: loss {float(loss)} vs {float(ref_loss)}"
        assert grad_error(grads, ref_grads) <= 1e-4, f"{key}: gradients differ by {grad_error(grads, ref_grads):.2e}"
        transfer = ctx.exchange.for_rank(ctx.cp_rank)
        forward = sum(r for phase, _, r in comm_stats(ctx).per_call if phase == "forward")
        report[key] = (str(ctx.exchange.strategy), transfer.recv_rows, comm_stats(ctx).forward_calls, forward)
    return report


def _expected_bytes(config, recv_rows: int) -> int:
    """Forward bytes one rank receives in one step: per layer the latent + rope key, and the indexer keys of a full
    layer (fp32) when a document is longer than index_topk."""
    layers = config.num_hidden_layers
    full = layers if config.model_type == "deepseek_v32" else config.indexer_types.count("full")
    full = full if max(LENGTHS) > config.index_topk else 0
    return 4 * recv_rows * (layers * (config.kv_lora_rank + config.qk_rope_head_dim) + full * config.index_head_dim)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_cp_matches_documents_alone_for_every_placement(world):
    from tests.sparse.harness import dsa_config

    reports = run_ranks(_cases_worker, world, CASES, timeout=300)
    for rank, report in enumerate(reports):
        for key, (strategy, recv_rows, calls, received) in report.items():
            config = dsa_config(key.split("/")[0], topk=int(key.split("topk=")[1]))
            if strategy == "none":
                continue
            # Forward exchanges (activation checkpointing replays the forward ones in backward: counted twice).
            per_step = _expected_bytes(config, recv_rows)
            assert received in (per_step, 2 * per_step), f"rank {rank} {key}: {received} bytes vs {per_step}"
    strategies = {key: v[0] for key, v in reports[0].items()}
    assert strategies["deepseek_v32/balanced/allgather/ckpt=False/topk=8"] == "allgather"
    assert any(s in ("halo", "a2a") for s in strategies.values())
    assert any(v[1] > 0 for r in reports for v in r.values()), "no rank received a key row: nothing was split"
