"""Mixed precision: under ``torch.autocast`` q/k come out of RoPE in float32 while v is bf16; the
attention casts like SDPA does and stays exact up to the autocast dtype's rounding, at CP=1 and CP=2."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
from tests.launch import run_ranks
from tests.reference import documents_alone, random_documents, tiny_model

LENGTHS = [13, 29, 7, 19]  # 68 tokens, padded to 72 by the collator
SEQ_LEN = 72


def _docs() -> list[torch.Tensor]:
    return random_documents(LENGTHS, seed=3)


def _alone(dtype: torch.dtype | None) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each document alone through stock sdpa (fp32, or under autocast to ``dtype``): logits, grads
    of the summed next-token loss."""
    alone = documents_alone("llama", _docs(), autocast=dtype, reduction="sum")
    return alone.split(_docs()), alone.grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _packed_step(collator: bd.PackingCollator, dtype: torch.dtype) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """This rank's logits ``[L, V]`` and parameter grads of the summed loss, under autocast."""
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    batch = collator([{"input_ids": d} for d in _docs()])
    with torch.autocast("cpu", dtype=dtype):
        out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], cp_context=batch["cp_context"],
                    use_cache=False)
    logits = out.logits[0].float()
    loss = torch.nn.functional.cross_entropy(logits, batch["shift_labels"][0], ignore_index=-100, reduction="sum")
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, batch["cp_context"].local_index


def _by_position(per_doc: list[torch.Tensor], local_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference logits at the packed row's positions ``local_index`` (and which of them are real)."""
    row = torch.cat(per_doc + [torch.zeros(SEQ_LEN - sum(LENGTHS), per_doc[0].shape[1])])
    real = local_index < sum(LENGTHS)
    return row[local_index], real


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_at_cp1_matches_documents_alone(dtype):
    logits, grads, index = _packed_step(bd.PackingCollator(SEQ_LEN, pad_token_id=0), dtype)
    ref32, grads32 = _alone(None)
    ref_ac, grads_ac = _alone(dtype)
    expected32, real = _by_position(ref32, index)
    expected_ac, _ = _by_position(ref_ac, index)
    # Within the autocast dtype's rounding of fp32, and much closer to stock sdpa under the same autocast.
    assert _rel(logits[real], expected32[real]) < 2e-2
    assert _rel(logits[real], expected_ac[real]) < 1e-2
    for name, g in grads.items():
        assert _rel(g, grads32[name]) < 5e-2, name


def test_mixed_dtypes_outside_autocast_still_raise():
    q = torch.randn(1, 4, 8, 16)
    with pytest.raises(TypeError, match="dtypes differ"):
        bd.blockdiag_attention(q, q[:, :2].clone(), q[:, :2].bfloat16(), torch.ones(8, dtype=torch.long))


def test_public_function_under_autocast_casts_like_sdpa():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    v = torch.randn(1, 2, 8, 16).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = bd.blockdiag_attention(q, k, v, torch.tensor([1] * 5 + [2] * 3))
        ref = torch.nn.functional.scaled_dot_product_attention(q[..., :5, :], k[..., :5, :], v[..., :5, :],
                                                               is_causal=True, enable_gqa=True)
    assert out.dtype == torch.bfloat16 == ref.dtype
    torch.testing.assert_close(out[..., :5, :].float(), ref.float(), atol=1e-2, rtol=0)


def _cp2_worker(rank: int, world: int) -> tuple:
    mesh = bd.init_device_mesh(world)
    collator = bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)
    logits, grads, index = _packed_step(collator, torch.bfloat16)
    for g in grads.values():  # parameter gradients of the whole row: the sum over CP ranks
        torch.distributed.all_reduce(g)
    # numpy arrays: tensors would travel through shared memory that dies with this process.
    return logits.numpy(), {n: g.numpy() for n, g in grads.items()}, index.numpy()


@pytest.mark.slow
@pytest.mark.distributed
def test_bf16_autocast_at_cp2_matches_documents_alone():
    results = run_ranks(_cp2_worker, 2, timeout=240)
    ref32, grads32 = _alone(None)
    for logits, _, index in results:
        expected, real = _by_position(ref32, torch.from_numpy(index))
        assert _rel(torch.from_numpy(logits)[real], expected[real]) < 2e-2
    for name, g in results[0][1].items():
        assert _rel(torch.from_numpy(g), grads32[name]) < 5e-2, name


def _trainer_first_loss(tmp_path, bf16: bool) -> float:
    from transformers import TrainingArguments

    rows = bd.PackedDataset([{"input_ids": d.tolist()} for d in _docs()], SEQ_LEN)
    args = TrainingArguments(output_dir=str(tmp_path / f"bf16_{bf16}"), use_cpu=True, bf16=bf16, max_steps=1,
                             per_device_train_batch_size=1, report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True)
    trainer = bd.CPTrainer(model=tiny_model("llama", attn_implementation="blockdiag_cp"), args=args,
                           train_dataset=rows, data_collator=bd.PackingCollator(SEQ_LEN, pad_token_id=0))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h][0]


def test_trainer_with_bf16_matches_fp32(tmp_path):
    """``TrainingArguments(bf16=True)`` runs the forward under CPU autocast: it trains, within bf16 rounding."""
    loss32 = _trainer_first_loss(tmp_path, False)
    loss16 = _trainer_first_loss(tmp_path, True)
    assert abs(loss16 - loss32) <= 2e-2 * abs(loss32), (loss16, loss32)


@pytest.mark.distributed
@pytest.mark.slow
def test_example_with_mixed_precision_bf16_keeps_parity(tmp_path):
    import json

    from tests.launch import run_example

    summary = tmp_path / "summary.json"
    proc = run_example("train_packed_cp.py", "--cp-size", "2", "--seq-len", "512", "--steps", "2",
                          "--max-docs", "24", "--mixed-precision", "bf16", "--check-parity", "--no-progress",
                       "--summary-json", str(summary), timeout=240)
    assert proc.returncode == 0, proc.output[-4000:]
    result = json.loads(summary.read_text())
    assert result["mixed_precision"] == "bf16" and result["cp_size"] == 2
    parity = result["parity"]  # against one process in float32
    assert parity["abs_loss_diff"] <= 2e-2 * abs(parity["loss_no_cp"]), parity
    assert parity["max_grad_diff"] <= 5e-2, parity
