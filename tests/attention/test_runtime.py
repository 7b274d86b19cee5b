"""The context and its plans stay frozen data; what layers fill in during a step lives in one
StepRuntime (hf_blockdiag_cp/runtime.py), created once per step and shared by the context's device copies."""

from __future__ import annotations

import dataclasses
import gc
import pickle
import weakref

import pytest
import torch

from hf_blockdiag_cp import BlockDiagCPContext, runtime
from hf_blockdiag_cp.attention.layer import comm_stats, step_backends
from hf_blockdiag_cp.planning import VarlenPlan
from hf_blockdiag_cp.runtime import PlanKey, device_plan, step_runtime
from tests.reference import tiny_model

LENGTHS = [7, 1, 12, 4]
DATA_FIELDS = {"doc_ids", "cp_rank", "cp_size", "group", "row_offset", "local_len", "local_index", "plan", "exchange",
               "data_fingerprint", "config", "placement", "window_plans", "local_position_ids", "plan_fingerprint",
               "layout", "head_group", "seq_group",
               "shard_checksum", "media", "blocks"}  # media, blocks: issue 32 (images under CP, bidirectional blocks)


def _doc_ids() -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(1, len(LENGTHS) + 1), torch.tensor(LENGTHS))


def _forward(ctx: BlockDiagCPContext) -> None:
    """One forward (and backward) of a two-layer tiny Llama on the context's packed row."""
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    ids = torch.randint(0, 97, (1, ctx.full_len), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    model(ids, use_cache=False, cp_context=ctx, position_ids=positions).logits.sum().backward()


def test_context_and_plans_pickle_to_the_same_bytes_after_a_forward():
    ctx = BlockDiagCPContext.build(_doc_ids())
    before_ctx, before_plan = pickle.dumps(ctx), pickle.dumps(ctx.plan)
    _forward(ctx)
    filled = step_runtime(ctx)
    assert filled.plans and filled.plans[PlanKey(torch.device("cpu"), None)].schedules.by_backend  # the layers ran
    assert pickle.dumps(ctx) == before_ctx and pickle.dumps(ctx.plan) == before_plan
    copy = pickle.loads(before_ctx)
    assert copy.origin is None and step_runtime(copy) is not filled and not step_runtime(copy).plans


def test_context_fields_are_data_and_nothing_else_is_attached():
    ctx = BlockDiagCPContext.build(_doc_ids(), cp_rank=1, cp_size=2, sliding_windows=[3])
    assert {f.name for f in dataclasses.fields(ctx)} == DATA_FIELDS
    assert "derived" not in {f.name for f in dataclasses.fields(VarlenPlan)}
    device_plan(ctx, torch.device("cpu"), 3)
    assert set(vars(ctx)) == DATA_FIELDS | {"origin"} and ctx.origin is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.plan = None


def test_runtime_is_created_once_per_step(monkeypatch):
    created = []

    class Counted(runtime.StepRuntime):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(runtime, "StepRuntime", Counted)
    ctx = BlockDiagCPContext.build(_doc_ids())
    _forward(ctx)  # two layers, forward and backward
    assert len(created) == 1 and step_runtime(ctx) is created[0]
    assert list(created[0].plans) == [PlanKey(torch.device("cpu"), None)]  # one device plan for every layer
    _forward(BlockDiagCPContext.build(_doc_ids()))  # the next step
    assert len(created) == 2


def test_device_copies_share_the_runtime_and_it_dies_with_the_context():
    ctx = BlockDiagCPContext.build(_doc_ids(), cp_rank=0, cp_size=2, sliding_windows=[3])
    meta = ctx.to("meta")
    assert meta is not ctx and meta.origin is ctx and meta.plan.device.type == "meta"
    assert meta.to("meta") is meta and ctx.to("cpu") is ctx
    assert step_runtime(meta) is step_runtime(ctx)
    assert comm_stats(meta) is comm_stats(ctx) and step_backends(meta) is step_backends(ctx)
    # One device copy per device and planned window; an unplanned window uses the full plans.
    on_meta = device_plan(ctx, torch.device("meta"), 3)
    assert device_plan(meta, torch.device("meta"), 3) is on_meta and on_meta.plan.device.type == "meta"
    assert device_plan(ctx, torch.device("meta"), 5) is device_plan(ctx, torch.device("meta"), None)
    assert device_plan(ctx, torch.device("cpu"), None).plan is ctx.plan  # already there: not copied
    # A context built from this one by dataclasses.replace is another step's.
    assert step_runtime(dataclasses.replace(ctx, group=None)) is not step_runtime(ctx)
    alive = weakref.ref(ctx)
    del ctx, meta, on_meta
    gc.collect()
    assert alive() is None  # the runtime map does not keep contexts alive
