"""What the sparse-indexer path refuses, each with a clear error: a cache with packed rows or a cp_context (under CP on
every rank), the head-parallel layout, indices it did not select, an indexer left unserved. And what it keeps:
``generate()`` (one document per row, left padding, a cache) equals the stock model with the same tie rule."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.conformance.runs import collated_batch, packed_inputs
from hf_blockdiag_cp.errors import MaskConsumedError
from hf_blockdiag_cp.integration import blockdiag_cp_attention
from hf_blockdiag_cp.model.prepare import unprepare_model
from tests.launch import run_ranks
from tests.sparse.harness import documents, models, stable_indexer_topk


def _cp2_worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from hf_blockdiag_cp.config import BlockDiagCPConfig
    from tests.sparse.harness import documents, models

    messages = {}
    for model_type in ("deepseek_v32", "glm_moe_dsa"):
        _, ours, config = models(model_type)
        docs = documents(config)
        batch = collated_batch(docs, cp_size=world, cp_rank=rank, group=dist.group.WORLD, pad_token_id=0)
        try:
            ours(**{k: v for k, v in batch.items() if not k.startswith("_")}, use_cache=True)
            messages[model_type] = "no error"
        except ValueError as err:
            messages[model_type] = str(err)
    # The head-parallel layout splits heads over ranks; the latent is shared by every head: refused before exchanging.
    from hf_blockdiag_cp import PackingCollator, ulysses_groups

    collator = PackingCollator(96, group=dist.group.WORLD, pad_token_id=0, ulysses_size=2, model_config=config,
                               ulysses_groups=ulysses_groups(None, 2), config=BlockDiagCPConfig(ulysses_size=2))
    batch = collator([{"input_ids": d.tolist()} for d in docs])
    try:
        ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_context=batch["cp_context"],
             use_cache=False)
        messages["ulysses"] = "no error"
    except NotImplementedError as err:
        messages["ulysses"] = str(err)
    return messages


@pytest.mark.distributed
def test_under_cp_a_cache_and_the_head_parallel_layout_are_refused_on_every_rank():
    for messages in run_ranks(_cp2_worker, 2, timeout=120):
        for model_type in ("deepseek_v32", "glm_moe_dsa"):
            assert "cache with packed rows" in messages[model_type] and "use_cache=False" in messages[model_type], \
                messages
        assert "head-parallel layout (ulysses_size=2)" in messages["ulysses"], messages


def test_a_cache_with_packed_rows_is_refused():
    _, ours, config = models("deepseek_v32")
    docs = documents(config)
    batch = collated_batch(docs, cp_size=1, cp_rank=0, group=None, pad_token_id=0)
    with pytest.raises(ValueError, match="cache with packed rows .a cp_context.*use_cache=False"):
        ours(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_context=batch["cp_context"],
             use_cache=True)
    with pytest.raises(ValueError, match="cache with packed rows.*use_cache=False"):
        ours(**packed_inputs(docs, "position_ids"), use_cache=True)


def test_an_unserved_indexer_is_refused():
    _, ours, config = models("deepseek_v32")
    unprepare_model(ours)
    with pytest.raises(MaskConsumedError, match="deepseek_v32 reads the attention mask itself"):
        ours(**packed_inputs(documents(config), "position_ids"), use_cache=False)


def test_indices_not_selected_by_a_served_indexer_are_refused():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="indexer blockdiag_cp does not serve"):
        blockdiag_cp_attention(torch.nn.Module(), q, q, q, None, indices=torch.zeros(1, 4, 2, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="dense attention_mask"):
        module = type("DeepseekV32Attention", (torch.nn.Module,), {})()
        blockdiag_cp_attention(module, q, q, q, torch.ones(1, 1, 4, 4, dtype=torch.bool),
                               indices=torch.zeros(1, 4, 2, dtype=torch.int32))


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_generate_left_padded_equals_the_stock_model(model_type):
    stock, ours, config = models(model_type)
    a, b = documents(config, lengths=(14, 10))
    ids = torch.zeros(2, 14, dtype=torch.long)
    mask = torch.zeros(2, 14, dtype=torch.long)
    ids[0], mask[0] = a, 1
    ids[1, 4:], mask[1, 4:] = b, 1
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with stable_indexer_topk(stock):
        want = stock.generate(ids, **kwargs)
    assert torch.equal(ours.generate(ids, **kwargs), want)


def test_qwen4_exp_text_qsa_indexer_is_refused_naming_what_is_missing():
    """Its block-compressed indexer hands attention a dense selection mask: refused with the reason, not a generic
    mask error; with a tensor mask (sdpa) the indexer is the stock one."""
    import copy

    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model, forward_logits, make_documents

    config = copy.deepcopy(tiny_config("qwen4_exp_text"))
    config.num_hidden_layers = 1
    config.layer_types = config.layer_types[:1]
    if "full_attention" not in config.layer_types:
        config.layer_types = ["full_attention"]
    ours, stock = build_model(config, "blockdiag_cp"), build_model(config, "sdpa")
    docs = make_documents(config, lengths=(9, 7))
    with pytest.raises(MaskConsumedError, match=r"qwen4_exp_text: its QSA indexer .* no indices= channel"):
        ours(**packed_inputs(docs, "position_ids"), use_cache=False)
    assert torch.isfinite(forward_logits(stock, docs[0][None])).all()
