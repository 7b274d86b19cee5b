"""``CPTrainer``: the HF Trainer under context parallelism on real gloo processes (issue 5, acceptance 3).

(a) examples/trainer_packed_cp.py through the real ``accelerate launch`` on 2 CPU processes;
(b) one Trainer step on a (dp=1, cp=2) mesh gives the parameters of one process running every document
    alone through stock ``sdpa`` (after an ``evaluate()`` whose loss is checked too, and with DataLoader
    workers); a (dp=2, cp=1) mesh with rows split unevenly over the DP groups trains and evaluates;
(c) set-ups that would be silently wrong fail fast with a message naming what to change.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from transformers import TrainerCallback

from tests.launch import launch_example, run_ranks
from tests.training.trainer_setup import SEQ_LEN
from tests.training.trainer_setup import documents as _documents
from tests.training.trainer_setup import rank_env as _rank_env
from tests.training.trainer_setup import reference_eval_loss as _reference_eval_loss
from tests.training.trainer_setup import reference_step as _reference_step
from tests.training.trainer_setup import training_args as _training_args

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]
def _one_step_worker(rank: int, world: int, tmp: str) -> dict:
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(world)
    ref_before, ref_after, ref_loss = _reference_step()
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    logged = {}
    # DataLoader workers with a collator built from cp_rank/cp_size (no group): CPTrainer attaches the group.
    for label, workers, collator in [
            ("group", 0, bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)),
            ("workers", 2, bd.PackingCollator(SEQ_LEN, cp_rank=rank, cp_size=world, pad_token_id=0))]:
        model = tiny_model("llama", attn_implementation="blockdiag_cp")
        trainer = bd.CPTrainer(model=model, args=_training_args(tmp, dataloader_num_workers=workers),
                               train_dataset=examples, data_collator=collator, mesh=mesh,
                               optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
        if label == "group":  # evaluation on the same mesh: the exact eval loss, before any update
            logged["eval"] = trainer.evaluate(eval_dataset=examples)["eval_loss"]
            assert logged["eval"] == pytest.approx(_reference_eval_loss(), rel=1e-5), logged["eval"]
        trainer.train()
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), ref_after[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{label} {n}: {m}")
            # The update itself (lr = 1: the gradient), which the parameters' size would hide.
            torch.testing.assert_close(ref_before[name] - value.detach(), ref_before[name] - ref_after[name],
                                       rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{label} update {n}: {m}")
        logged[label] = [h["loss"] for h in trainer.state.log_history if "loss" in h][0]
        assert logged[label] == pytest.approx(ref_loss, rel=1e-5), (label, logged[label], ref_loss)

    # dp=2 (cp=1) on an iterable dataset whose 3 rows per pass split unevenly over the DP groups, with 2
    # rows per step: the groups must still run the same steps (no hang, no mis-paired collectives).
    # per_device_eval_batch_size=1: one row per eval step.
    dp_mesh = bd.init_device_mesh(1)
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    rows = bd.PackedDataset(examples, 32)
    assert len(list(rows)) == 3
    args = _training_args(tmp, per_device_train_batch_size=1, per_device_eval_batch_size=1, max_steps=3)
    trainer = bd.CPTrainer(model=model, args=args, train_dataset=rows,
                           data_collator=bd.PackingCollator(32, pad_token_id=0), mesh=dp_mesh)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 3 and len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # Evaluation gathers every step over all processes: the uneven rows must give every group the same steps.
    logged["uneven dp eval"] = trainer.evaluate(eval_dataset=rows)["eval_loss"]
    assert math.isfinite(logged["uneven dp eval"])
    logged["uneven dp"] = losses
    return logged


@pytest.mark.slow
def test_one_trainer_step_matches_documents_run_alone(tmp_path):
    """Two micro-batches (rows) per step on cp=2: the Trainer's own token counting and loss scaling give
    the exact token mean over both rows; the data path gives both CP ranks the same rows; an evaluate()
    before train() does not leave the model without DDP."""
    results = run_ranks(_one_step_worker, 2, str(tmp_path), timeout=240, env=_rank_env(2))
    assert results[0] == results[1]  # every rank logs the same global mean


class _DropShiftLabels:
    """A CP collator whose batches lose ``shift_labels`` (what a hand-written collator might do)."""

    def __init__(self, inner) -> None:
        self.inner, self.cp_size, self.cp_rank = inner, inner.cp_size, inner.cp_rank

    def __call__(self, examples):
        batch = self.inner(examples)
        del batch["shift_labels"]
        return batch


def _fail_fast_worker(rank: int, world: int, tmp: str) -> dict:
    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(world)
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    collator = bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)
    messages = {}

    def expect(key: str, build, *, train: bool = False, model=None, args=None, data=examples, coll=collator) -> None:
        model = model if model is not None else tiny_model("llama", attn_implementation="blockdiag_cp")
        try:
            trainer = bd.CPTrainer(model=model, args=args or _training_args(tmp), train_dataset=data,
                                   data_collator=coll, mesh=mesh, **build)
            if train:
                trainer.train()
        except ValueError as err:
            messages[key] = str(err)
        else:
            raise AssertionError(f"{key}: no ValueError")

    # Raised at construction.
    expect("sdpa model", {}, model=tiny_model("llama", attn_implementation="sdpa"))
    expect("collator cp_size", {}, coll=bd.PackingCollator(SEQ_LEN, pad_token_id=0))
    expect("token average", {}, args=_training_args(tmp, average_tokens_across_devices=False))
    expect("label smoothing", {}, args=_training_args(tmp, label_smoothing_factor=0.1))
    expect("compute_loss_func", {"compute_loss_func": lambda outputs, labels, num_items_in_batch=None: 0})
    # Raised when the data loader is built, before any step.
    expect("packed batch size", {}, train=True, data=bd.PackedDataset(examples, SEQ_LEN))
    # Raised by the model guard on the first forward.
    switched = tiny_model("llama", attn_implementation="blockdiag_cp")
    expect("switched to sdpa", {"callbacks": [_SwitchToSdpa()]}, train=True, model=switched)
    expect("no shift_labels", {}, train=True, coll=_DropShiftLabels(collator))
    return messages


class _SwitchToSdpa(TrainerCallback):
    """Switches the model to sdpa after the Trainer's construction-time check (caught by the forward guard)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.set_attn_implementation("sdpa")


@pytest.mark.slow
def test_bad_setups_fail_fast(tmp_path):
    for messages in run_ranks(_fail_fast_worker, 2, str(tmp_path), timeout=240, env=_rank_env(2)):
        assert "attn_implementation" in messages["sdpa model"]
        assert "attn_implementation" in messages["switched to sdpa"] and "cp_context" in messages["switched to sdpa"]
        assert "cp_size=1" in messages["collator cp_size"] and "cp_size=2" in messages["collator cp_size"]
        assert "average_tokens_across_devices" in messages["token average"]
        assert "label_smoothing_factor" in messages["label smoothing"]
        assert "compute_loss_func" in messages["compute_loss_func"]
        assert "per_device_train_batch_size" in messages["packed batch size"]
        assert "shift_labels" in messages["no shift_labels"]


@pytest.mark.slow
def test_example_two_processes_with_accelerate_launch(tmp_path):
    """The real launcher and example: 2 CPU processes (cp=2), loss falls, first step matches no-CP."""
    summary_path = tmp_path / "summary.json"
    proc = launch_example("trainer_packed_cp.py", "--cp-size", "2", "--max-docs", "24", "--seq-len", "512",
                          "--steps", "12", "--check-parity", "--no-progress", "--output-dir", str(tmp_path / "model"),
                          "--summary-json", str(summary_path))
    output = proc.output
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads(summary_path.read_text())
    losses = summary["losses"]
    assert summary["world"] == 2 and summary["cp_size"] == 2 and len(losses) == 12
    assert all(math.isfinite(x) for x in losses), losses
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, losses
    parity = summary["parity"]
    assert parity["abs_loss_diff"] <= 1e-5, parity
    assert parity["max_grad_diff"] <= 1e-5, parity
    assert "parity: loss with CP" in output and "|dloss|" in output and "max|dgrad|" in output
    assert summary["tokens_per_s"] > 0 and len(summary["peak_memory_gib_per_rank"]) == 2
    # --output-dir: Trainer.save_model wrote a normal checkpoint that loads back with the plugin.
    import torch
    from transformers import AutoModelForCausalLM

    import hf_blockdiag_cp as bd

    assert bd.ATTN_IMPLEMENTATION == "blockdiag_cp"  # importing the package registered it

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="blockdiag_cp")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), use_cache=False).logits).all()
