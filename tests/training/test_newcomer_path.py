"""A newcomer's path (issue 28): the set-ups a first script gets wrong are refused with the fix, or work."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

SEQ_LEN = 32


def test_packed_dataset_without_examples_or_tokens_raises():
    import hf_blockdiag_cp as bd

    with pytest.raises(ValueError, match="examples is empty"):
        bd.PackedDataset([], SEQ_LEN)
    only_empty = bd.PackedDataset([{"input_ids": []}, {"input_ids": []}], SEQ_LEN)
    with pytest.raises(ValueError, match="no tokens"):
        list(only_empty)


def test_ulysses_size_not_dividing_cp_size_is_named_before_the_heads():
    import hf_blockdiag_cp as bd

    with pytest.raises(ValueError, match="ulysses_size=3 does not divide cp_size=2"):
        bd.PackingCollator(SEQ_LEN, cp_size=2, cp_rank=0, pad_token_id=0, ulysses_size=3)


def _rank_env(world: int) -> dict[int, dict[str, str]]:
    return {r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1"} for r in range(world)}


def _two_rank_worker(rank: int, world: int, tmp: str) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import TrainingArguments

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    out = {}
    examples = [{"input_ids": list(range(1, n))} for n in (9, 12, 5, 20, 7)]
    # cp_rank/cp_size without group= after init_process_group: a warning at construction naming group=, and the
    # forward's refusal names it too (the default group is not taken: DDP's all-reduce runs on it).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        collator = bd.PackingCollator(SEQ_LEN, cp_size=2, cp_rank=rank, pad_token_id=0)
    out["construction"] = [str(w.message) for w in caught]
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    try:
        model(**collator(examples[:3]))
    except RuntimeError as err:
        out["forward"] = str(err)
    with torch.no_grad():
        grouped = bd.PackingCollator(SEQ_LEN, cp_size=2, cp_rank=rank, pad_token_id=0, group=dist.group.WORLD)
        out["sharded"] = float(model(**grouped(examples[:3])).loss)  # this rank's S_r / N
        out["one process"] = float(model(**bd.PackingCollator(SEQ_LEN, pad_token_id=0)(examples[:3])).loss)

    # reduce_loss_for_logging on a loss whose count was not normalised: one warning naming normalize_num_items.
    mesh = bd.init_device_mesh(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bd.reduce_loss_for_logging(torch.tensor(2.0), mesh)
        bd.reduce_loss_for_logging(torch.tensor(2.0), mesh)
    out["warnings"] = [str(w.message) for w in caught if "normalize_num_items" in str(w.message)]

    # CPTrainer.evaluate() under CP with TrainingArguments' default per_device_eval_batch_size (8): one row per batch.
    def trainer(**overrides):
        args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], max_steps=1, disable_tqdm=True,
                                 per_device_train_batch_size=1, **overrides)
        return bd.CPTrainer(model=model, args=args, mesh=mesh, eval_dataset=bd.PackedDataset(examples, SEQ_LEN),
                            data_collator=bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0))

    default = trainer()
    out["eval batch size"] = default.get_eval_dataloader().batch_size
    out["eval_loss"] = default.evaluate()["eval_loss"]
    try:
        trainer(per_device_eval_batch_size=4).get_eval_dataloader()
    except ValueError as err:
        out["explicit 4"] = str(err)
    return out


@pytest.mark.distributed
def test_collator_without_group_names_it_and_cp_evaluation_takes_one_row(tmp_path):
    results = run_ranks(_two_rank_worker, 2, str(tmp_path), timeout=240, env=_rank_env(2))
    for rank, out in enumerate(results):
        assert any("without group=" in w and "group=mesh['cp']" in w for w in out["construction"]), out
        assert "group=mesh['cp']" in out["forward"], out
        assert len(out["warnings"]) == 1, out["warnings"]
        assert out["eval batch size"] == 1 and out["eval_loss"] > 0, out
        assert "per_device_eval_batch_size=4" in out["explicit 4"], out
    # The shards' losses add up to the row's token mean: the contexts carried the group.
    assert results[0]["sharded"] + results[1]["sharded"] == pytest.approx(results[0]["one process"], rel=1e-5)
