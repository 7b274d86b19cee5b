"""Issue 18 on the host: the collator and context under ``ulysses_size`` (no process group needed).

The layout's placement row becomes ``local_index``; the plans are the sequence group's (``u * L``
query rows); ``u = 1`` (also when ``auto`` chooses it) is today's plan; the fingerprint carries ``u``;
missing heads or subgroups are refused by name; the ``auto`` choice is logged once per choice.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.distributed.ulysses import UlyssesGroups
from hf_blockdiag_cp.planning.layout import HeadShape

ROW = torch.tensor([1] * 9 + [2] * 20 + [3] * 3 + [0] * 8)  # S = 40
GROUPS = UlyssesGroups({2: (None, None), 4: (None, None)})  # host planning only: no live groups needed


def _ctx(rank: int, u, heads=HeadShape(4, 1, 8), windows=(None, 5), **config):
    return bd.BlockDiagCPContext.build(ROW, cp_rank=rank, cp_size=4, heads=heads, ulysses_groups=GROUPS,
                                       config=bd.BlockDiagCPConfig(ulysses_size=u, **config), sliding_windows=windows)


@pytest.mark.parametrize("u", [2, 4])
def test_layout_context_holds_its_group_plans(u):
    contexts = [_ctx(r, u) for r in range(4)]
    held = torch.cat([c.local_index for c in contexts])
    assert sorted(held.tolist()) == list(range(40))  # every position on exactly one rank
    for rank, ctx in enumerate(contexts):
        layout = ctx.layout
        group, head_rank = divmod(rank, u)
        assert ctx.ulysses_size == u and ctx.local_len == 10
        assert torch.equal(ctx.local_index, layout.group_placement.index[group][head_rank * 10:(head_rank + 1) * 10])
        assert ctx.plan.q_rows == u * 10  # the group's tokens after the head all-to-all
        assert ctx.exchange.cp_size == 4 // u and sorted(ctx.window_plans) == [5]
        assert ctx.plan_fingerprint.fields["ulysses_size"] == u and ctx.plan_fingerprint.fields["layout"] != 0
    assert len({int(c.plan_fingerprint) for c in contexts}) == 1  # the ranks agree


def test_u1_is_todays_plan_and_auto_choosing_u1_too():
    for rank in range(4):
        today = bd.BlockDiagCPContext.build(ROW, cp_rank=rank, cp_size=4, sliding_windows=(None, 5))
        one = _ctx(rank, 1)
        assert one.layout is None and one.ulysses_size == 1
        assert torch.equal(one.local_index, today.local_index) and int(one.plan_fingerprint) == int(
            today.plan_fingerprint)
        # A huge flops-per-byte ratio makes bytes free... the opposite (bytes expensive) makes u = 1 win.
        auto = _ctx(rank, "auto", layout_flops_per_byte=1e9)
        assert auto.ulysses_size == 1 and auto.layout is not None
        assert torch.equal(auto.local_index, today.local_index)
        assert torch.equal(auto.plan.cu_seqlens_q, today.plan.cu_seqlens_q)
        assert auto.plan_fingerprint.fields["layout"] == 0
    assert _ctx(0, 2).plan_fingerprint.fields != _ctx(0, 1).plan_fingerprint.fields


def test_layout_context_pickles_and_refusals():
    ctx = _ctx(1, 2)
    back = pickle.loads(pickle.dumps(ctx))
    assert back.ulysses_size == 2 and torch.equal(back.local_index, ctx.local_index)
    assert int(back.plan_fingerprint) == int(ctx.plan_fingerprint)
    with pytest.raises(ValueError, match="head shape"):
        _ctx(0, 2, heads=None)
    with pytest.raises(ValueError, match="ulysses_size=3"):
        _ctx(0, 3)
    with pytest.raises(ValueError, match="num_attention_heads"):
        _ctx(0, 4, heads=HeadShape(6, 1, 8))
    with pytest.raises(ValueError, match="subgroups"):
        bd.BlockDiagCPContext.build(ROW, cp_rank=0, cp_size=4, heads=HeadShape(4, 1, 8),
                                    config=bd.BlockDiagCPConfig(ulysses_size=2))
    with pytest.raises(ValueError, match="model_config"):
        bd.PackingCollator(40, cp_size=4, cp_rank=0, pad_token_id=0, ulysses_size=2, ulysses_groups=GROUPS)
    with pytest.raises(ValueError, match="ulysses_groups"):
        bd.PackingCollator(40, cp_size=4, cp_rank=0, pad_token_id=0, ulysses_size=2, heads=HeadShape(4, 1, 8))


def test_collator_logs_the_auto_choice_once(caplog):
    collator = bd.PackingCollator(40, cp_size=4, cp_rank=2, pad_token_id=0, ulysses_size="auto",
                                  heads=HeadShape(4, 4, 8), ulysses_groups=GROUPS)
    examples = [{"input_ids": list(range(1, 30))}, {"input_ids": list(range(1, 6))}]
    with caplog.at_level(logging.INFO, logger="hf_blockdiag_cp"):
        batches = [collator(examples) for _ in range(3)]
    lines = [r.getMessage() for r in caplog.records if r.name == "hf_blockdiag_cp"]
    assert len(lines) == 1 and "ulysses_size=auto -> u=" in lines[0], lines
    ctx = batches[0]["cp_context"]
    assert batches[0]["input_ids"].shape == (1, 10) and ctx.layout.requested == "auto"


def test_collator_pickles_with_its_subgroups():
    # DataLoader workers get the collator pickled: the subgroups travel by name (here: none live).
    collator = bd.PackingCollator(40, cp_size=4, cp_rank=1, pad_token_id=0, ulysses_size=2,
                                  heads=HeadShape(4, 1, 8), ulysses_groups=GROUPS)
    copy = pickle.loads(pickle.dumps(collator))
    assert copy.ulysses_groups.sizes() == (2, 4) and copy.config.ulysses_size == 2
    examples = [{"input_ids": list(range(1, 30))}, {"input_ids": list(range(1, 6))}]
    a, b = collator(examples)["cp_context"], copy(examples)["cp_context"]
    assert torch.equal(a.local_index, b.local_index) and int(a.plan_fingerprint) == int(b.plan_fingerprint)
