"""TRL's ``SFTTrainer`` under CP (issue 11, part 2): ``CPSFTTrainer``.

(a) examples/sft_trl_cp.py on 2 CPU processes started as ``accelerate launch`` starts them (``run_example``; the
    real launcher runs this script in test_launch_settings.py) (no ``--cp-size``: all processes form the CP
    group), chat prompt/completion data through TRL's chat template and completion-only
    loss: the first step's loss and gradients, and the eval_loss (with an eval row whose second CP shard is all
    padding), equal one process running every document alone through stock sdpa;
(b) on one process, TRL's other dataset types (plain prompt/completion, plain text, one example per row) give the
    eval_loss of the documents run alone, with TRL's completion mask;
(c) set-ups CPSFTTrainer cannot run exactly are refused with the setting named;
(d) 12 steps at CP = 2 log the loss and grad norm of one process, in float32 and float64.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import run_example, run_ranks

pytest.importorskip("trl")
pytest.importorskip("datasets")

from tests.training.trl_setup import SEQ_LEN
from tests.training.trl_setup import documents as _documents
from tests.training.trl_setup import example as _example
from tests.training.trl_setup import setup as _setup
from tests.training.trl_setup import sft_args as _sft_args


@pytest.mark.distributed
@pytest.mark.slow
def test_sft_example_two_processes_matches_documents_alone(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in _documents()))
    summary_path = tmp_path / "summary.json"
    proc = run_example("sft_trl_cp.py", "--data", str(data), "--eval-docs", "3", "--seq-len", str(SEQ_LEN),
                       "--grad-accum", "2", "--steps", "2", "--check-parity", "--no-progress", "--summary-json",
                       str(summary_path), timeout=240)
    output = proc.output
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["world"] == 2 and summary["dp_size"] == 1 and summary["cp_size"] == 2  # the default CP size
    assert "mesh: world 2 = dp 1 x cp 2" in output
    assert all(math.isfinite(x) for x in summary["losses"]) and len(summary["losses"]) == 2
    parity = summary["parity"]
    assert parity["documents"] >= 3 and parity["targets"] > 300, parity  # two rows of several documents
    assert parity["abs_loss_diff"] <= 1e-5, parity
    assert parity["max_grad_diff"] <= 1e-5, parity
    assert len(parity["grads_compared"]) > 10 and parity["min_max_abs_grad"] > 0, parity
    assert parity["eval_rows_with_a_padding_only_shard"] >= 1, parity
    assert parity["abs_eval_loss_diff"] <= 1e-5, parity
    assert summary["kv_exchange_bytes_per_step_per_rank"][0] > 0  # the rows really straddle the CP boundary
    assert "parity: loss with CP (dp 1 x cp 2)" in output and "parity: eval_loss with CP (dp 1 x cp 2)" in output


# ---- one process ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt,packing", [("prompt-completion", True), ("text", True), ("conversational", False)])
def test_eval_loss_on_one_process_matches_documents_alone(tmp_path, fmt, packing):
    import copy

    import datasets
    import torch

    from hf_blockdiag_cp.training.trl import CPSFTTrainer

    model, tokenizer, examples = _setup(fmt)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    trainer = CPSFTTrainer(model=model, args=_sft_args(tmp_path, packing=packing),
                           train_dataset=datasets.Dataset.from_list(examples[:4]),
                           eval_dataset=datasets.Dataset.from_list(examples), processing_class=tokenizer)
    rows = trainer.eval_dataset.rows
    if packing:
        assert len(rows) < len(examples)
    else:
        assert len(rows) == len(examples) and all(len(r.documents) == 1 for r in rows)
    labels = torch.cat([d.labels for r in rows for d in r.documents])
    masked = (labels == -100).float().mean().item()
    # TRL's completion-only loss leaves the prompts out of the labels; plain text trains on every token.
    assert (masked == 0.0) if fmt == "text" else (0.02 < masked < 0.5), masked
    got = trainer.evaluate()["eval_loss"]
    assert got == pytest.approx(_example().eval_reference(reference, rows, 1, torch.device("cpu")), rel=1e-5)


def test_refused_setups_name_the_setting(tmp_path):
    import datasets

    from hf_blockdiag_cp.training.trl import CPSFTTrainer

    model, tokenizer, examples = _setup("prompt-completion")
    data = datasets.Dataset.from_list(examples[:4])

    def message(**kwargs) -> str:
        kwargs = {"model": model, "train_dataset": data, "processing_class": tokenizer, **kwargs}
        with pytest.raises(ValueError) as err:
            CPSFTTrainer(**kwargs)
        return str(err.value)

    from transformers import TrainingArguments

    assert "trl.SFTConfig" in message(args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    assert "max_length=None" in message(args=_sft_args(tmp_path, max_length=None))
    assert "packing_strategy='wrapped'" in message(args=_sft_args(tmp_path, packing_strategy="wrapped"))
    sdpa_model, _, _ = _setup("text")
    sdpa_model.set_attn_implementation("sdpa")
    assert "attn_implementation" in message(model=sdpa_model, args=_sft_args(tmp_path))


# ---- the trajectory at CP = 2 equals one process ---------------------------------------------------------

TRAJECTORY_STEPS = 12  # 8 packed rows, 2 per step: three passes, re-shuffled each


def _trajectory(tmp: str, mesh, dtype_name: str, bf16: bool) -> list[tuple[float, float]]:
    """``(loss, grad_norm)`` logged at each of 12 steps of ``CPSFTTrainer`` (chat data, completion-only loss,
    clipping at 1.0, which binds) from the same float32 initial weights, cast to ``dtype_name``."""
    import datasets
    import torch

    from hf_blockdiag_cp.training.trl import CPSFTTrainer

    model, tokenizer, examples = _setup("conversational")
    args = _sft_args(tmp, max_steps=TRAJECTORY_STEPS, gradient_accumulation_steps=2, logging_steps=1,
                     learning_rate=1e-3, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, seed=7,
                     bf16=bf16, ddp_find_unused_parameters=False)
    trainer = CPSFTTrainer(model=model.to(getattr(torch, dtype_name)), args=args, processing_class=tokenizer,
                           train_dataset=datasets.Dataset.from_list(examples[:14]), mesh=mesh)
    trainer.train()
    return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]


RUNS = (("float32", False), ("float64", False))  # (parameters, bf16 autocast)


def _trajectories(tmp: str, cp_size: int | None) -> dict[str, list]:
    import hf_blockdiag_cp as bd

    mesh = None if cp_size is None else bd.init_device_mesh(cp_size)
    return {f"{d}{' bf16' if b else ''}": _trajectory(f"{tmp}/{d}{b}", mesh, d, b) for d, b in RUNS}


def _cp2_trajectories(rank: int, world: int, tmp: str) -> dict[str, list]:
    return _trajectories(f"{tmp}/rank{rank}", 2)


def _max_diffs(got: list, want: list) -> tuple[float, float]:
    assert len(got) == len(want) == TRAJECTORY_STEPS, (got, want)
    return (max(abs(a[0] - b[0]) for a, b in zip(got, want)), max(abs(a[1] - b[1]) for a, b in zip(got, want)))


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_trajectory_at_cp2_equals_one_process_step_for_step(tmp_path):
    """12 steps of CPSFTTrainer at CP = 2 log the loss and grad norm of one process (issue 35, item 7).

    float64 is the reference that says which side is right: in float32 both sides equal it within 1e-5. (The
    issue's gap was bf16 autocast, ``SFTConfig``'s default ``bf16=True``, also on CPU: each rank rounds its own
    shard's products; both sides are then ~1e-2 from float64 and ~2e-3 apart, CP no further than one process,
    measured with these runs and ``bf16=True``; see docs/trl_peft.md.)"""
    env = {r: {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1"} for r in range(2)}
    cp2 = run_ranks(_cp2_trajectories, 2, str(tmp_path / "cp2"), timeout=400, env=env)
    one = _trajectories(str(tmp_path / "one"), None)
    assert cp2[0] == cp2[1]  # every rank logs the global values
    exact = 1e-5
    for label in ("float32", "float64"):
        loss_diff, norm_diff = _max_diffs(cp2[0][label], one[label])
        assert loss_diff <= exact and norm_diff <= exact, (label, loss_diff, norm_diff)
    for side in (one, cp2[0]):
        loss_diff, norm_diff = _max_diffs(side["float32"], one["float64"])
        assert loss_diff <= exact and norm_diff <= exact, ("float32 vs float64", loss_diff, norm_diff)
