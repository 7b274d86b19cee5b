"""Issue 27, finding 6: a CP batch with targets but without ``num_items_in_batch`` is refused (it would be each shard's
own mean: losses summed over the ranks 11.45 vs 5.72) by the model's own loss and by ``chunked_causal_lm_loss``, before
any exchange (the pre-hook); with the count, or at CP = 1, nothing changes."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
from tests.reference import tiny_model


def _shard():
    lengths = [5, 20, 3, 12, 8]
    doc_ids = torch.repeat_interleave(torch.arange(1, 6), torch.tensor(lengths))
    ids = torch.randint(0, 97, (1, doc_ids.numel()), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ctx = bd.BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=0, cp_size=2, group=None,
                                      input_ids=ids, position_ids=pos)
    sl = slice(ctx.row_offset, ctx.row_offset + ctx.local_len)
    shift = torch.full_like(ids, -100)
    shift[0, :-1] = torch.where(doc_ids[1:] == doc_ids[:-1], ids[0, 1:], -100)
    return ctx, {"input_ids": ids[:, sl], "position_ids": pos[:, sl], "shift_labels": shift[:, sl],
                 "labels": shift[:, sl], "cp_context": ctx, "use_cache": False}


@pytest.mark.parametrize("guarded", [False, True])
def test_the_models_loss_without_a_count_is_refused_under_cp(guarded):
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    if guarded:
        model = bd.guard_model(model)
    _, batch = _shard()
    with pytest.raises(ValueError, match="no num_items_in_batch"):
        model(**batch)


def test_chunked_loss_without_a_count_is_refused_under_cp():
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    _, batch = _shard()
    batch.pop("labels")
    with pytest.raises(ValueError, match="chunked_causal_lm_loss would be each shard's own mean"):
        bd.chunked_causal_lm_loss(model, batch)


def test_cp1_without_a_count_is_the_stock_mean():
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=ids, use_cache=False)
    ref = tiny_model("llama", attn_implementation="sdpa")(ids, labels=ids, use_cache=False)
    torch.testing.assert_close(out.loss, ref.loss)
