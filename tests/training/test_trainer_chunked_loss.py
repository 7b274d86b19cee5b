"""``CPTrainer(chunked_loss=...)``: on by default where exact, the same step as the model's own loss, never
projecting more than one chunk; refused (or off by default) where not exact. One process, no mesh."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
from tests.reference import TINY, tiny_model

SEQ_LEN, CHUNK = 48, 16


def _trainer(tmp: str, model: torch.nn.Module, **kwargs) -> bd.CPTrainer:
    from transformers import TrainingArguments

    gen = torch.Generator().manual_seed(5)
    examples = [{"input_ids": torch.randint(1, 97, (n,), generator=gen).tolist()} for n in (9, 14, 1, 20, 30, 5, 11)]
    args = TrainingArguments(output_dir=tmp, use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             logging_steps=1, max_steps=1, per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, train_sampling_strategy="sequential", max_grad_norm=0.0,
                             lr_scheduler_type="constant", warmup_steps=0)
    return bd.CPTrainer(model=model, args=args, train_dataset=examples,
                        data_collator=bd.PackingCollator(SEQ_LEN, pad_token_id=0), mesh=None,
                        optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None), **kwargs)


def _step(tmp: str, chunked: bool | None) -> tuple[float, dict, int]:
    """Loss, parameters after one step, and the most positions ``lm_head`` projected in one call."""
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    rows: list[int] = []
    model.lm_head.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[:-1].numel()))
    trainer = _trainer(tmp, model, chunked_loss=chunked, chunked_loss_chunk_size=CHUNK)
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][0]
    return loss, {n: p.detach().clone() for n, p in model.named_parameters()}, max(rows)


@pytest.mark.slow
def test_trainer_step_with_the_chunked_loss_equals_the_models_own(tmp_path):
    own_loss, own_params, own_rows = _step(str(tmp_path), chunked=False)
    loss, params, rows = _step(str(tmp_path), chunked=None)  # the default: on, Llama's head is exact
    assert own_rows >= SEQ_LEN and rows <= CHUNK  # the own loss projects the whole micro-batch, this one chunks
    assert loss == pytest.approx(own_loss, rel=1e-6)
    for name, value in own_params.items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_chunked_loss_off_or_refused_where_not_exact(tmp_path):
    import transformers

    class MyLlama(transformers.LlamaForCausalLM):  # an unknown head: its forward may differ
        pass

    def model() -> torch.nn.Module:
        m = MyLlama(transformers.LlamaConfig(**TINY))
        m.set_attn_implementation("blockdiag_cp")
        return m

    with pytest.raises(NotImplementedError, match="chunked_loss=True.*MyLlama"):
        _trainer(str(tmp_path), model(), chunked_loss=True)
    trainer = _trainer(str(tmp_path), model())  # default: the model's own loss
    assert trainer._chunked_loss_refusal(trainer.model) is not None
    trainer.train()
    assert trainer.state.global_step == 1
