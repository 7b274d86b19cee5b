"""Data parallelism without CP (dp=2, cp=1) on 2 gloo processes, with PackedDataset + PackingCollator: the
documented DP-only paths train exactly (the stock ``Trainer`` with ``dispatch_batches=False`` and
``CPTrainer(mesh=None)``), and the stock ``Trainer``'s default (accelerate dispatches the batches of an
iterable dataset, which cannot carry a ``cp_context``) is refused with the fix in the message instead of
accelerate's ``TypeError: Can only concatenate tensors but got <class 'int'>``.
"""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

SEQ_LEN = 32
DOC_LENGTHS = [9, 14, 1, 20, 30, 5, 11, 2]


def _rank_env(world: int) -> dict[int, dict[str, str]]:
    """What a launcher would set: accelerate reads it to run MULTI_CPU on the already-initialised group."""
    return {r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world),
                "MASTER_ADDR": "127.0.0.1"} for r in range(world)}


def _examples() -> list[dict]:
    import torch

    gen = torch.Generator().manual_seed(5)
    return [{"input_ids": torch.randint(1, 97, (n,), generator=gen).tolist()} for n in DOC_LENGTHS]


def _dp_only_worker(rank: int, world: int, tmp: str) -> dict:
    import torch
    from transformers import Trainer, TrainingArguments

    import hf_blockdiag_cp as bd
    from tests.reference import per_document_sgd_step, tiny_model

    rows = list(bd.PackedDataset(_examples(), SEQ_LEN))
    assert len(rows) >= world + 1  # the rows split unevenly over the processes
    # One step of one row per process: the reference runs the documents of the first `world` rows alone.
    _, ref_after, ref_loss = per_document_sgd_step([d.input_ids for row in rows[:world] for d in row.documents])

    def args(**overrides) -> TrainingArguments:
        base = dict(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                    logging_steps=1, max_steps=1, per_device_train_batch_size=1, max_grad_norm=0.0,
                    lr_scheduler_type="constant", warmup_steps=0, ddp_find_unused_parameters=False)
        return TrainingArguments(**{**base, **overrides})

    def build(trainer_cls, training_args, **kwargs):
        model = tiny_model("llama", attn_implementation="blockdiag_cp")
        trainer = trainer_cls(model=model, args=training_args, train_dataset=bd.PackedDataset(_examples(), SEQ_LEN),
                              data_collator=bd.PackingCollator(SEQ_LEN, pad_token_id=0),
                              optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None), **kwargs)
        return model, trainer

    logged = {}
    for label, trainer_cls, training_args, kwargs in [
            ("CPTrainer(mesh=None)", bd.CPTrainer, args(), {"mesh": None}),
            ("Trainer, dispatch_batches=False", Trainer, args(accelerator_config={"dispatch_batches": False}), {})]:
        model, trainer = build(trainer_cls, training_args, **kwargs)
        trainer.train()
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), ref_after[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{label} {n}: {m}")
        logged[label] = [h["loss"] for h in trainer.state.log_history if "loss" in h][0]
        assert logged[label] == pytest.approx(ref_loss, rel=1e-5), (label, logged[label], ref_loss)

    # CPTrainer(mesh=None) refuses dispatching asked for explicitly (on every process, at construction).
    try:
        build(bd.CPTrainer, args(accelerator_config={"dispatch_batches": True}), mesh=None)
    except ValueError as err:
        logged["explicit dispatch"] = str(err)

    # Last, as it ends the group: the stock default dispatches; process 0 (which collates) raises our message,
    # the others, waiting for process 0's batch, then fail on the closed connection instead of hanging.
    _, trainer = build(Trainer, args())
    try:
        trainer.train()
    except Exception as err:  # noqa: BLE001 - process 1's error comes from gloo
        logged["stock default"] = f"{type(err).__name__}: {err}"
    return logged


@pytest.mark.slow
def test_dp_only_trainers_with_packed_rows(tmp_path):
    results = run_ranks(_dp_only_worker, 2, str(tmp_path), timeout=300, env=_rank_env(2), pg_timeout_s=60)
    for rank, logged in enumerate(results):
        assert "dispatch_batches" in logged.get("explicit dispatch", ""), logged
        assert "stock default" in logged, f"rank {rank}: the stock Trainer's default did not fail: {logged}"
    assert results[0]["CPTrainer(mesh=None)"] == results[1]["CPTrainer(mesh=None)"]
    message = results[0]["stock default"]
    assert message.startswith("ValueError") and "dispatch_batches': False" in message and "CPTrainer" in message, \
        message
