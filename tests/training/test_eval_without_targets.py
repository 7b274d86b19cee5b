"""Issue 27, finding 5: ``CPTrainer.evaluate()`` with an evaluation step that has no targets.

The stock loop drops such a step's ``NaN`` loss from ``eval_loss`` (the mean over the steps with targets); the
training-only clamp of the target count to 1 made it a loss of 0 averaged in (stock 5.710, CPTrainer 2.855).
Reference: the first document alone through stock ``sdpa``, its token mean. CP = 1 here and CP = 2 on two gloo ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.launch import run_ranks

DOC = list(range(3, 13))  # 10 tokens with targets
EMPTY = {"input_ids": [20, 21, 22, 23, 24, 25], "labels": [-100] * 6}  # a row without a target


def _reference() -> float:
    from tests.reference import documents_alone

    return documents_alone("llama", [torch.tensor(DOC)], backward=False).loss


def _eval_loss(tmp: str, mesh=None, group=None) -> float:
    from transformers import TrainingArguments

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             per_device_eval_batch_size=1)
    collator = bd.PackingCollator(16, pad_token_id=0, group=group)
    trainer = bd.CPTrainer(model=model, args=args, data_collator=collator, mesh=mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the collator warns about the row without targets
        return trainer.evaluate(eval_dataset=[{"input_ids": DOC}, EMPTY])["eval_loss"]


def test_an_eval_step_without_targets_is_left_out_of_eval_loss_at_cp1(tmp_path):
    assert _eval_loss(str(tmp_path)) == pytest.approx(_reference(), rel=1e-5)


def _worker(rank: int, world: int, tmp: str) -> float:
    import hf_blockdiag_cp as bd

    mesh = bd.init_device_mesh(world)
    return _eval_loss(f"{tmp}/{rank}", mesh=mesh, group=mesh["cp"])


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_an_eval_step_without_targets_is_left_out_of_eval_loss_at_cp2(tmp_path):
    from tests.training.trainer_setup import rank_env

    losses = run_ranks(_worker, 2, str(tmp_path), timeout=240, env=rank_env(2))
    reference = _reference()
    assert losses == [pytest.approx(reference, rel=1e-5)] * 2, (losses, reference)
