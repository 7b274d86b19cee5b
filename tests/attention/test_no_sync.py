"""Acceptance 4 (core): once the plan exists, attention layers read no tensor values on the host."""

from __future__ import annotations

import torch

from hf_blockdiag_cp import BlockDiagCPContext
from hf_blockdiag_cp.integration import blockdiag_cp_attention
from tests.reference import tiny_model
from tests.spies import registered_attention
from tests.sync_counter import SyncCounter

COUNTED = "blockdiag_cp_sync_counted"


def _counted(counter: SyncCounter, per_call: list[int]):
    """The attention function, counting host reads per call into ``per_call``."""
    def counted_attention(*args, **kwargs):
        before = len(counter.calls)
        with counter.region():
            out = blockdiag_cp_attention(*args, **kwargs)
        per_call.append(len(counter.calls) - before)
        return out

    return registered_attention(COUNTED, counted_attention)


def _batch():
    lengths = [9, 1, 20, 5, 13]
    ids = torch.randint(0, 97, (1, sum(lengths)), generator=torch.Generator().manual_seed(0))
    doc_ids = torch.repeat_interleave(torch.arange(1, 6), torch.tensor(lengths))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    return ids, doc_ids, position_ids


def test_counter_detects_host_reads():
    counter = SyncCounter()
    with counter.patched():
        t = torch.ones(3)
        with counter.region():
            t.sum().item()
            t.tolist()
            bool(t[0])
        t.item() if t.numel() == 1 else t.sum().item()  # outside the region: not counted
    assert counter.calls == ["item", "tolist", "__bool__"]


def test_zero_host_reads_in_attention_layers_with_context():
    counter, per_call = SyncCounter(), []
    ids, doc_ids, position_ids = _batch()
    ctx = BlockDiagCPContext.build(doc_ids)
    with _counted(counter, per_call):
        model = tiny_model("llama", attn_implementation=COUNTED, num_hidden_layers=3)
        model.train()
        model.activation_checkpointing_enable()  # recompute must not re-plan or read either
        with counter.patched():
            out = model(ids, position_ids=position_ids, labels=ids, cp_context=ctx, use_cache=False)
            out.loss.backward()
    assert len(per_call) == 6  # 3 layers forward + 3 recomputed in backward
    assert counter.calls == [], counter.calls


def test_keyword_plans_read_once_per_forward_not_per_layer():
    counter, per_call = SyncCounter(), []
    ids, _, position_ids = _batch()
    with _counted(counter, per_call):
        model = tiny_model("llama", attn_implementation=COUNTED, num_hidden_layers=3)
        with counter.patched():
            model(ids, position_ids=position_ids, use_cache=False)
    assert len(per_call) == 3
    assert per_call[0] > 0 and per_call[1:] == [0, 0], per_call  # the first layer plans, the rest reuse
