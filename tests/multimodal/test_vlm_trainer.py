"""``CPTrainer`` on packed image rows at CP = 2 (gloo): one SGD step equals one process running every
document alone through the stock model, for the language model, the projector and the vision tower."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks
from tests.training.trainer_setup import rank_env, training_args

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _worker(rank: int, world: int, tmp: str) -> dict:
    import torch

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.multimodal import build_vlm, documents_alone, synthetic_documents, tiny_vlm_config

    config = tiny_vlm_config("qwen2_5_vl")
    docs = synthetic_documents(config, num_docs=4, seed=7, images=(1, 2, 0, 1))
    stock = build_vlm(config, "sdpa")
    before = {n: p.detach().clone() for n, p in stock.named_parameters()}
    alone = documents_alone(stock, docs)
    mesh = bd.init_device_mesh(world)
    model = build_vlm(config, "blockdiag_cp")
    model.load_state_dict(stock.state_dict())
    model.train()
    collator = bd.PackingCollator(172, group=mesh["cp"], pad_token_id=0, model_config=model.config)
    targets = collator(docs)["num_items_in_batch"]
    # Vision-language models under DDP: a rank may encode no image in a step (its vision tower then has no gradient).
    args = training_args(tmp, per_device_train_batch_size=4, gradient_accumulation_steps=1,
                         ddp_find_unused_parameters=True)
    # lr = the step's target count: the update is the token-SUM gradient, large enough to read from the parameters.
    trainer = bd.CPTrainer(model=model, args=args, train_dataset=docs, data_collator=collator, mesh=mesh,
                           optimizers=(torch.optim.SGD(model.parameters(), lr=float(targets)), None))
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h][0]
    worst = {}
    for name, value in model.named_parameters():
        grad = alone.grads.get(name, torch.zeros_like(value))
        update = before[name] - value.detach()
        part = "vision" if name.startswith("model.visual.blocks") else "rest"
        err = float((update - grad).norm() / grad.norm().clamp_min(1e-12)) if grad.norm() > 1e-8 else 0.0
        worst[part] = max(worst.get(part, 0.0), err)
    return {"loss": loss, "reference": float(alone.loss) / targets, "worst": worst}


def test_cp_trainer_step_with_images_equals_each_document_alone(tmp_path):
    results = run_ranks(_worker, 2, str(tmp_path), timeout=240, env=rank_env(2))
    for res in results:
        assert res["loss"] == pytest.approx(res["reference"], rel=1e-5), res
        assert max(res["worst"].values()) < 1e-4, res
