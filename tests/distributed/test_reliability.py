"""Issue 13 regressions: position ids under CP (item 3), Dv != D attention at CP=2 (item 4), and the
smaller items 5 (finite timeouts, all-ignored labels, ids outside the vocabulary), plus the process-group
timeouts of item 2 (the fault matrix itself is tests/distributed/test_faults.py)."""

from __future__ import annotations

import datetime
import math
import warnings

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.distributed.groups import group_options
from tests.launch import run_ranks
from tests.reference import tiny_model

# ---- item 3: position ids are part of a CP step -------------------------------------------------------


class _Recorder(torch.nn.Module):
    """Stands in for a model: records the position ids its forward got."""

    def forward(self, input_ids=None, position_ids=None, **kwargs):
        self.seen = position_ids
        return input_ids


def _rank1_batch() -> dict:
    """CP rank 1 of 2 on a 16-token row whose second document (10 tokens) straddles the boundary at 8."""
    collator = bd.PackingCollator(16, cp_size=2, cp_rank=1, pad_token_id=0, placement="contiguous")
    return collator([{"input_ids": list(range(1, 11))}, {"input_ids": list(range(20, 24))}])


def test_guard_supplies_missing_position_ids_from_the_cp_context():
    batch = _rank1_batch()
    expected = batch.pop("position_ids")
    assert expected[0, 0] == 8  # the straddling document continues on rank 1 (the model would use 0)
    ctx = batch["cp_context"]
    torch.testing.assert_close(ctx.local_position_ids, expected, rtol=0, atol=0)
    model = bd.guard_model(_Recorder())
    model(input_ids=batch["input_ids"], cp_context=ctx)
    torch.testing.assert_close(model.seen, expected, rtol=0, atol=0)
    model(batch["input_ids"], None, cp_context=ctx)  # position_ids passed positionally, as None
    torch.testing.assert_close(model.seen, expected, rtol=0, atol=0)
    given = torch.arange(8)[None]
    model(input_ids=batch["input_ids"], position_ids=given, cp_context=ctx)  # given ones are kept
    assert model.seen is given


def test_guard_raises_when_a_cp_batch_has_no_position_ids_and_the_context_does_not_know_them():
    ctx = bd.BlockDiagCPContext.build(torch.tensor([1] * 10 + [2] * 6), cp_rank=1, cp_size=2)
    model = bd.guard_model(_Recorder())
    with pytest.raises(ValueError, match="no position_ids .* from 0 instead of by their place in the row"):
        model(input_ids=torch.ones(1, 8, dtype=torch.long), cp_context=ctx)
    with pytest.raises(ValueError, match="position_ids has 16 positions per row .* L=8"):
        model(input_ids=torch.ones(1, 8, dtype=torch.long), position_ids=torch.arange(16)[None], cp_context=ctx)
    # At CP=1 a context without positions leaves the model's own numbering (one row, nothing shifted).
    single = bd.BlockDiagCPContext.build(torch.tensor([1] * 16))
    model(input_ids=torch.ones(1, 16, dtype=torch.long), cp_context=single)
    assert model.seen is None


def test_context_build_checks_position_ids_and_group():
    with pytest.raises(ValueError, match="position_ids has shape"):
        bd.BlockDiagCPContext.build(torch.ones(16, dtype=torch.long), position_ids=torch.arange(15))


# ---- item 5: timeouts that are numbers, all-ignored labels, vocabulary ---------------------------------


@pytest.mark.parametrize("raw", ["inf", "nan", "-1", "0", "1e12"])
def test_collective_timeout_env_must_be_a_finite_positive_number(monkeypatch, raw):
    monkeypatch.setenv("HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S"):
        bd.BlockDiagCPConfig()


def test_process_group_timeout_is_the_collective_timeout_plus_a_margin():
    assert bd.BlockDiagCPConfig().process_group_timeout == datetime.timedelta(seconds=660)
    assert bd.BlockDiagCPConfig(collective_timeout_s=5).process_group_timeout == datetime.timedelta(seconds=15)
    assert bd.BlockDiagCPConfig(collective_timeout_s=3600).process_group_timeout == datetime.timedelta(seconds=3960)
    options = group_options("gloo", datetime.timedelta(seconds=7))
    assert options._timeout == datetime.timedelta(seconds=7)
    assert group_options("mpi", datetime.timedelta(seconds=7)) is None


def _all_ignored_batch() -> dict:
    collator = bd.PackingCollator(16, pad_token_id=0)
    with pytest.warns(RuntimeWarning, match="no targets .* num_items_in_batch=0"):
        return collator([{"input_ids": [5, 6, 7, 8], "labels": [-100] * 4},
                         {"input_ids": [9, 10], "labels": [-100] * 2}])


def test_a_step_without_targets_gives_loss_zero_and_zero_gradients_after_normalize_num_items():
    model = tiny_model("llama", attn_implementation="blockdiag_cp").train()
    batch = _all_ignored_batch()
    assert batch["num_items_in_batch"] == 0
    raw = model(**batch).loss
    assert math.isnan(raw.item())  # what the model alone computes (0 / 0): the collator's warning says so
    loss = model(**bd.normalize_num_items(batch, None)).loss
    assert loss.item() == 0.0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.count_nonzero(g) == 0 for g in grads)


def test_cp_trainer_step_without_targets_is_zero_and_fills_the_collator_vocabulary(tmp_path):
    from transformers import TrainingArguments

    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    collator = bd.PackingCollator(16, pad_token_id=0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                             disable_tqdm=True, logging_steps=1, max_steps=1, per_device_train_batch_size=2)
    examples = [{"input_ids": [5, 6, 7, 8], "labels": [-100] * 4}, {"input_ids": [9, 10], "labels": [-100] * 2}]
    trainer = bd.CPTrainer(model=model, args=args, train_dataset=examples, data_collator=collator)
    assert collator.vocab_size == 97  # the model's embedding rows
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses == [0.0]
    for name, value in model.named_parameters():  # zero gradients: AdamW leaves every weight as it was
        torch.testing.assert_close(value.detach(), before[name], rtol=0, atol=0)


def test_ids_outside_the_vocabulary_raise_naming_the_example_and_field():
    collator = bd.PackingCollator(16, pad_token_id=0, vocab_size=50)
    good = {"input_ids": [1, 2, 3]}
    with pytest.raises(ValueError, match=r"example 2: input_ids\[1\]=60 is not below the model's vocab_size=50"):
        collator([good, good, {"input_ids": [1, 60, 2]}])
    with pytest.raises(ValueError, match=r"example 1: labels\[2\]=77 is not below"):
        collator([good, {"input_ids": [1, 2, 3], "labels": [-100, 2, 77]}])
    rows = list(bd.PackedDataset([good, {"input_ids": [4, 99]}], 16))
    with pytest.raises(ValueError, match=r"a PackedRow.*dataset example 1: input_ids\[1\]=99"):
        collator(rows)
    with pytest.raises(ValueError, match="vocab_size=8 must be None or an int above pad_token_id=9"):
        bd.PackingCollator(16, pad_token_id=9, vocab_size=8)
    assert collator([good, {"input_ids": [49]}])["input_ids"].max() == 49  # the largest valid id passes
    unchecked = bd.PackingCollator(16, pad_token_id=0)  # without vocab_size nothing is checked (as before)
    assert unchecked([{"input_ids": [1, 60]}])["input_ids"].max() == 60


# ---- item 2 (timeouts of process groups) and item 3 at CP=2, on real ranks ------------------------------


def _documents_alone(reference: torch.nn.Module, docs: list[torch.Tensor], ctx) -> torch.Tensor:
    """``[L, V]`` logits of this rank's rows, each document run alone through ``reference`` (documents of
    distinct lengths, laid out in the packed row's order)."""
    logits = {len(d): reference(d[None], use_cache=False).logits[0] for d in docs}
    ids = ctx.doc_ids[0]
    order = [int((ids == i).sum()) for i in torch.unique_consecutive(ids) if i != 0]
    return torch.cat([logits[n] for n in order])[ctx.local_index]


def _setup_and_positions_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.distributed_c10d import _set_pg_timeout
    from transformers import TrainingArguments

    from hf_blockdiag_cp.distributed.groups import group_timeout

    out = {}
    # The harness made the default group with torch's 30-minute default, like accelerate and the Trainer.
    assert group_timeout() == datetime.timedelta(minutes=30)
    try:
        bd.init_device_mesh(2)
    except ValueError as err:
        out["world_too_long"] = str(err)
    relaxed = bd.BlockDiagCPConfig(collective_timeout_s=1800)  # or the package's bound is raised to match
    relaxed_mesh = bd.init_device_mesh(2, config=relaxed)
    out["relaxed"] = [group_timeout(relaxed_mesh[d].get_group()).total_seconds() for d in ("dp", "cp")]

    _set_pg_timeout(datetime.timedelta(seconds=60))  # a default group within the bound...
    mesh = torch_mesh("cpu", (1, 2), mesh_dim_names=("dp", "cp"))  # ...but torch gives new groups 30 minutes
    collator = bd.PackingCollator(16, group=mesh["cp"], pad_token_id=0)
    try:
        bd.CPTrainer(model=tiny_model("llama", attn_implementation="blockdiag_cp"), data_collator=collator, mesh=mesh,
                     args=TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], max_steps=1))
    except ValueError as err:
        out["trainer"] = str(err)
    mesh = bd.init_device_mesh(2)
    out["mesh"] = [group_timeout(mesh[d].get_group()).total_seconds() for d in ("dp", "cp")]

    # Item 3 end to end: a batch without position_ids through a guarded model equals the per-document
    # reference; without the guard, rank 1 would number its rows from 0 and the straddling document would be
    # wrong: the forward agreement (issue 17) refuses it on every rank.
    docs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in (12, 14, 9, 5)]
    batch = bd.PackingCollator(40, group=mesh["cp"], pad_token_id=0)([{"input_ids": d.tolist()} for d in docs])
    ctx = batch["cp_context"]
    expected = _documents_alone(tiny_model("llama", attn_implementation="sdpa"), docs, ctx)
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    without = {k: v for k, v in batch.items() if k != "position_ids"}
    try:
        model(**without)
        out["unguarded"] = "no error"
    except bd.AgreementError as err:
        out["unguarded"] = str(err)
    guarded = bd.guard_model(model)(**without).logits[0]
    torch.testing.assert_close(guarded, expected, rtol=1e-4, atol=1e-5)

    # normalize_num_items over dp=2 with one group without targets: the exact count, not clamped per group.
    dp_mesh = bd.init_device_mesh(1)
    counts = {0: 0, 1: 6}
    normalized = bd.normalize_num_items({"num_items_in_batch": counts[rank]}, dp_mesh)
    out["normalized"] = normalized["num_items_in_batch"].item()
    out["normalized_zero"] = bd.normalize_num_items({"num_items_in_batch": 0}, dp_mesh)["num_items_in_batch"].item()
    dist.barrier()
    return out


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_process_group_timeouts_and_position_ids_on_two_ranks(tmp_path):
    # What a launcher sets: accelerate then runs MULTI_CPU on the harness's group.
    env = {r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1"} for r in range(2)}
    for rank, out in enumerate(run_ranks(_setup_and_positions_worker, 2, str(tmp_path), timeout=200,
                                         pg_timeout_s=1800, env=env)):
        msg = out["world_too_long"]
        assert "the default process group has a timeout of 1800 s, longer than the 660 s" in msg, msg
        for fix in ("InitProcessGroupKwargs", "ddp_timeout=660", "HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S"):
            assert fix in msg, (fix, msg)
        assert out["relaxed"] == [1980.0, 1980.0]
        assert "the mesh's 'dp' group has a timeout of 1800 s" in out["trainer"], out["trainer"]
        assert out["mesh"] == [660.0, 660.0]
        # Every rank refuses the unguarded forward, naming rank 1, whose straddling document would be wrong.
        assert "position_ids on" in out["unguarded"] and "rank 1 (checksum" in out["unguarded"], out["unguarded"]
        assert out["normalized"] == 3.0 and out["normalized_zero"] == 0.5


# ---- item 4: value head dim != query/key head dim (MLA, DeepSeek-V3 shaped) at CP=2 --------------------


MLA = dict(vocab_size=97, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
           topk_group=1, first_k_dense_replace=2, kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=8,
           qk_nope_head_dim=16, v_head_dim=16, max_position_embeddings=512)
MLA_LENGTHS = (5, 12, 3, 20, 8)  # one row in this order: the 20-token document (20..39) straddles L=24


def _mla_model(attn_implementation: str):
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**MLA)).eval()
    model.set_attn_implementation(attn_implementation)
    return model


def _mla_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    docs = [torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(n)) for n in MLA_LENGTHS]
    count = sum(len(d) - 1 for d in docs)
    # Reference: each document alone through the stock model (sdpa), loss = mean over all targets.
    reference = _mla_model("sdpa")
    ref_loss = sum(torch.nn.functional.cross_entropy(reference(d[None], use_cache=False).logits[0, :-1], d[1:],
                                                     reduction="sum") for d in docs) / count
    ref_loss.backward()

    mesh = bd.init_device_mesh(world)
    batch = bd.PackingCollator(48, group=mesh["cp"], pad_token_id=0)([{"input_ids": d.tolist()} for d in docs])
    ctx = batch["cp_context"]
    ids, half = ctx.doc_ids[0], ctx.local_len
    # A document with keys on rank 0 and several queries on rank 1: sdpa_doc's prefix-merge segment.
    assert ids[half - 1] == ids[half + 1] != 0, ids
    with torch.no_grad():
        expected = _documents_alone(reference, docs, ctx)
    model = bd.guard_model(_mla_model("blockdiag_cp"))
    out = model(**batch)  # the loss is this rank's share of the global token mean
    torch.testing.assert_close(out.logits[0], expected, rtol=1e-4, atol=1e-5)
    out.loss.backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)  # the CP ranks' shares add up to the full row's gradient
        torch.testing.assert_close(grad, ref.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_mla_shaped_attention_at_cp2_matches_documents_alone():
    run_ranks(_mla_worker, 2, timeout=200)
