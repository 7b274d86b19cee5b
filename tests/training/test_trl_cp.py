"""TRL's ``SFTTrainer`` under CP (issue 11, part 2): ``CPSFTTrainer``.

(a) examples/sft_trl_cp.py on 2 CPU processes started as ``accelerate launch`` starts them (``run_example``; the
    real launcher runs this script in test_launch_settings.py) (no ``--cp-size``: all processes form the CP
    group), chat prompt/completion data through TRL's chat template and completion-only
    loss: the first step's loss and gradients, and the eval_loss (with an eval row whose second CP shard is all
    padding), equal one process running every document alone through stock sdpa;
(b) on one process, TRL's other dataset types (plain prompt/completion, plain text, one example per row) give the
    eval_loss of the documents run alone, with TRL's completion mask;
(c) set-ups CPSFTTrainer cannot run exactly are refused with the setting named.
"""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest

from tests.launch import run_example

pytest.importorskip("trl")
pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
SEQ_LEN = 512


def _documents() -> list[str]:
    """Small code-like documents: 14 for training, then 3 for evaluation whose packing leaves one eval row of
    fewer than SEQ_LEN / 2 tokens (its second CP shard is all padding: where per-rank means go wrong)."""
    rng = random.Random(0)

    def doc(i: int, lines: int) -> str:
        body = "".join(f"    y = y * {rng.randint(2, 99)} + {rng.randint(0, 9)}\n" for _ in range(lines))
        return f"def step_{i}(y):\n{body}    return y\n"

    return [doc(i, rng.randint(1, 12)) for i in range(14)] + [doc(100, 10), doc(101, 7), doc(102, 1)]


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


def _example():
    """examples/sft_trl_cp.py as a module (its helpers: the offline model and tokenizer, the reference)."""
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    import sft_trl_cp

    return sft_trl_cp


def _setup(fmt: str):
    import torch

    example = _example()
    model, tokenizer = example.load_model(str(ROOT / "configs" / "model" / "tiny-llama.json"), dtype=torch.float32)
    return model, tokenizer, example.sft_examples(_documents(), fmt)


def _sft_args(tmp_path, **overrides):
    from trl import SFTConfig

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                bf16=False, max_length=SEQ_LEN, packing=True, per_device_train_batch_size=1,
                per_device_eval_batch_size=1, max_steps=1, gradient_checkpointing=False, dataset_num_proc=None)
    return SFTConfig(**{**base, **overrides})


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
