"""Issue 5 acceptance 4: bad training set-ups fail fast with a message that says what to change."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
from tests.launch import run_ranks
from tests.reference import tiny_model


def _cp_batch(cp_size: int = 2, cp_rank: int = 0) -> dict:
    collator = bd.PackingCollator(16, cp_size=cp_size, cp_rank=cp_rank, pad_token_id=0)
    return collator([{"input_ids": list(range(1, 11))}, {"input_ids": list(range(20, 24))}])


def test_cp_context_on_a_model_with_another_attention_raises():
    model = bd.guard_model(tiny_model("llama", attn_implementation="sdpa"))
    batch = _cp_batch(cp_size=1)
    with pytest.raises(ValueError, match="attn_implementation is 'sdpa'"):
        model(**batch)
    # The same batch on a blockdiag_cp model runs.
    model.set_attn_implementation("blockdiag_cp")
    assert torch.isfinite(model(**batch).loss)


def test_cp_batch_with_labels_but_no_shift_labels_raises():
    model = bd.guard_model(tiny_model("llama", attn_implementation="blockdiag_cp"))
    batch = _cp_batch()
    batch.pop("shift_labels")
    with pytest.raises(ValueError, match="no shift_labels"):
        model(**batch)


def test_guard_is_idempotent():
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    before = (len(model._forward_pre_hooks), len(model._forward_hooks))  # the import-time preparation's pair
    assert before == (1, 1)
    assert bd.guard_model(bd.guard_model(model)) is model
    assert (len(model._forward_pre_hooks), len(model._forward_hooks)) == before  # the same pair, now strict


def _mesh_errors(rank: int, world: int) -> dict:
    out = {}
    try:
        bd.init_device_mesh(3)
    except ValueError as err:
        out["indivisible"] = str(err)
    mesh = bd.init_device_mesh(2)
    try:
        bd.check_collator(bd.PackingCollator(16, cp_size=1, pad_token_id=0), mesh)
    except ValueError as err:
        out["collator"] = str(err)
    try:
        bd.PackingCollator(16, cp_size=4, group=mesh["cp"], pad_token_id=0)
    except ValueError as err:
        out["collator_group"] = str(err)
    bd.check_collator(bd.PackingCollator(16, group=mesh["cp"], pad_token_id=0), mesh)  # the right way passes
    return out


@pytest.mark.distributed
def test_mesh_and_collator_mismatches_raise():
    for out in run_ranks(_mesh_errors, 2, timeout=120):
        assert "world size 2 is not divisible by cp_size=3" in out["indivisible"]
        assert "cp_size=1" in out["collator"] and "group=mesh['cp']" in out["collator"]
        assert "cp_size=4 disagrees with the group's size 2" in out["collator_group"]
