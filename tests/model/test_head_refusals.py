"""Issue 27, findings 2 and 3: row-pooling heads and ``logits_to_keep`` with packed or CP-sharded rows.

A sequence-classification head scores the row's last non-pad token: wrong for a packed row (one score per row) and,
under CP, on the rank without the row's last token (off by 0.128). ``logits_to_keep=k`` under CP kept the last ``k``
positions of each shard (off by 0.76). Both are refused on every rank before any exchange; what stays exact is
checked against stock ``sdpa``.
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_blockdiag_cp as bd
from tests.reference import TINY


def _classifier(kind: str, attn: str):
    config = transformers.LlamaConfig(**TINY, num_labels=3, pad_token_id=0)
    cls = getattr(transformers, f"Llama{kind}")
    torch.manual_seed(0)
    model = cls(config).eval()
    model.set_attn_implementation(attn)
    return model


def _packed():
    lengths = [5, 7, 4]
    doc_ids = torch.repeat_interleave(torch.arange(1, 4), torch.tensor(lengths))
    ids = torch.randint(1, 97, (1, doc_ids.numel()), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return doc_ids, ids, pos


@pytest.mark.parametrize("kind", ["ForSequenceClassification", "ForQuestionAnswering"])
def test_row_pooling_heads_refuse_packed_rows_and_cp_shards(kind):
    model = _classifier(kind, "blockdiag_cp")
    doc_ids, ids, pos = _packed()
    with pytest.raises(NotImplementedError, match=f"Llama{kind} pools each row"):
        model(ids, position_ids=pos)  # packed at CP = 1: one answer per row, not per document
    ctx = bd.BlockDiagCPContext.build(doc_ids, cp_rank=1, cp_size=2, group=None, input_ids=ids, position_ids=pos)
    with pytest.raises(NotImplementedError, match="under CP each rank pools its own shard"):
        model(ids[:, ctx.local_index], position_ids=pos[:, ctx.local_index], cp_context=ctx)
    # One document per row (padded), no CP: the model's own computation, as with stock sdpa.
    rows = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
    mask = (rows != 0).long()
    got = model(rows, attention_mask=mask, use_cache=False)
    ref = _classifier(kind, "sdpa")(rows, attention_mask=mask, use_cache=False)
    for key in (k for k in got.keys() if k.endswith("logits")):
        keep = mask.bool() if got[key].shape == mask.shape else slice(None)  # QA: per-token logits, pads undefined
        torch.testing.assert_close(got[key][keep], ref[key][keep], rtol=1e-5, atol=1e-5)


def test_token_classification_on_a_packed_row_matches_each_document_alone():
    model = _classifier("ForTokenClassification", "blockdiag_cp")
    ref = _classifier("ForTokenClassification", "sdpa")
    doc_ids, ids, pos = _packed()
    got = model(ids, position_ids=pos).logits
    alone = torch.cat([ref(ids[:, doc_ids == d]).logits for d in (1, 2, 3)], dim=1)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("keep", [3, torch.tensor([0, 5])])
def test_logits_to_keep_is_refused_under_cp(keep):
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    doc_ids, ids, pos = _packed()
    doc_ids, ids, pos = doc_ids[:16], ids[:, :16], pos[:, :16]
    ctx = bd.BlockDiagCPContext.build(doc_ids, cp_rank=0, cp_size=2, group=None, input_ids=ids, position_ids=pos)
    with pytest.raises(NotImplementedError, match="logits_to_keep"):
        model(ids[:, ctx.local_index], position_ids=pos[:, ctx.local_index], cp_context=ctx, logits_to_keep=keep)


def test_logits_to_keep_on_a_packed_row_at_cp1_is_the_rows_last_positions():
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    ref = tiny_model("llama", attn_implementation="sdpa")
    _, ids, pos = _packed()
    got = model(ids, position_ids=pos, logits_to_keep=3, use_cache=False).logits
    full = ref(ids, position_ids=pos, use_cache=False).logits  # stock sdpa: exact on packed position_ids
    torch.testing.assert_close(got, full[:, -3:], rtol=1e-5, atol=1e-5)
