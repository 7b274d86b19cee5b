"""PackingCollator as the ``data_collator`` of ``transformers.Trainer`` on CPU (acceptance 3).

A spy attention function, registered under a test-only name, delegates to ``blockdiag_cp_attention``
and records what reached it. Step losses are checked exactly against documents run one by one.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Trainer, TrainingArguments

from hf_blockdiag_cp import BlockDiagCPContext, PackedDataset, PackingCollator
from hf_blockdiag_cp.integration import blockdiag_cp_attention
from tests.reference import tiny_model
from tests.spies import registered_attention

SPY = "blockdiag_cp_test_spy"


class AttentionSpy:
    """Delegates to the real attention function; remembers each call's ``cp_context``."""

    def __init__(self) -> None:
        self.contexts: list[object] = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        ctx = kwargs.get("cp_context")
        self.contexts.append(ctx)
        if isinstance(ctx, BlockDiagCPContext):
            assert ctx.local_len == query.shape[2] and ctx.batch_size == query.shape[0]
        return blockdiag_cp_attention(module, query, key, value, attention_mask, **kwargs)


@pytest.fixture()
def spy():
    spy = AttentionSpy()
    with registered_attention(SPY, spy):
        yield spy


def corpus() -> list[dict]:
    g = torch.Generator().manual_seed(1)
    base = [{"input_ids": torch.randint(1, 97, (n,), generator=g).tolist()} for n in (5, 9, 14, 20, 27, 33, 6, 11)]
    for doc in base[::3]:
        doc["labels"] = [-100] * 3 + doc["input_ids"][3:]
    return base * 4  # a repeated tiny corpus: the loss must fall


@torch.no_grad()
def reference_mean(model, examples: list[dict]) -> float:
    """Mean next-token loss of the examples run one by one through the stock sdpa model."""
    model.eval()
    total, count = 0.0, 0
    for e in examples:
        logits = model(input_ids=torch.tensor([e["input_ids"]]), use_cache=False).logits[0]
        labels = e.get("labels", e["input_ids"])
        target = torch.tensor(labels[1:] + [-100])
        total += float(torch.nn.functional.cross_entropy(logits.double(), target, reduction="sum"))
        count += int((target != -100).sum())
    return total / count


def run_trainer(tmp_path, model, dataset, collator, **args):
    """Train; return per-micro-step losses, the num_items_in_batch Trainer passed, and the collated inputs."""
    seen_inputs: list[dict] = []

    def data_collator(examples):
        seen_inputs.append(examples)
        return collator(examples)

    trainer = Trainer(model=model, train_dataset=dataset, data_collator=data_collator,
                      args=TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no",
                                             logging_steps=1, learning_rate=3e-3, warmup_steps=0, seed=0,
                                             dataloader_num_workers=0, disable_tqdm=True, **args))
    steps: list[tuple[float, int]] = []
    original = trainer.training_step

    def training_step(model, inputs, num_items_in_batch=None):
        assert isinstance(inputs["cp_context"], BlockDiagCPContext), "the context survives the Trainer's input prep"
        loss = original(model, inputs, num_items_in_batch)
        steps.append((float(loss), int(num_items_in_batch), int(inputs["num_items_in_batch"])))
        return loss

    trainer.training_step = training_step
    trainer.train()
    return steps, seen_inputs, trainer


def test_trainer_map_dataset_cp1(tmp_path, spy):
    model = tiny_model("llama", attn_implementation=SPY, seed=0)
    start = tiny_model("llama", attn_implementation="sdpa", seed=0)
    start.load_state_dict(model.state_dict())
    steps, seen, trainer = run_trainer(tmp_path, model, corpus(), PackingCollator(64, pad_token_id=0),
                                       per_device_train_batch_size=6, max_steps=10)
    losses = [s[0] for s in steps]
    assert len(losses) == 10 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.1, losses
    assert spy.contexts and all(isinstance(c, BlockDiagCPContext) for c in spy.contexts)
    # Trainer counts shift_labels itself; its count equals the collator's, and step 1 is the exact mean.
    assert all(trainer_count == ours for _, trainer_count, ours in steps)
    assert losses[0] == pytest.approx(reference_mean(start, seen[0]), rel=1e-5)
    assert [h["loss"] for h in trainer.state.log_history if "loss" in h][0] == pytest.approx(losses[0], abs=1e-4)


def test_trainer_packed_dataset_with_gradient_accumulation(tmp_path, spy):
    """One row per micro-batch; over 2 accumulated rows the two micro-losses sum to the step's token mean."""
    model = tiny_model("llama", attn_implementation=SPY, seed=0)
    start = tiny_model("llama", attn_implementation="sdpa", seed=0)
    start.load_state_dict(model.state_dict())
    dataset = PackedDataset(corpus(), 64, buffer_size=16)
    steps, seen, _ = run_trainer(tmp_path, model, dataset, PackingCollator(64, pad_token_id=0),
                                 per_device_train_batch_size=1, gradient_accumulation_steps=2, max_steps=3)
    assert len(steps) == 6 and all(len(rows) == 1 for rows in seen)
    first_step = [doc for rows in seen[:2] for doc in rows[0].documents]
    examples = [{"input_ids": d.input_ids.tolist(), "labels": d.labels.tolist()} for d in first_step]
    assert steps[0][1] == steps[1][1] == steps[0][2] + steps[1][2], "Trainer's count spans the accumulated rows"
    assert steps[0][0] + steps[1][0] == pytest.approx(reference_mean(start, examples), rel=1e-5)
    assert all(isinstance(c, BlockDiagCPContext) for c in spy.contexts)
