"""Packed image rows under CP on gloo ranks vs each document alone through the stock model: logits, loss and the
gradients of every part (vision tower included); the vision tower runs once per image; the feature all-to-all moves
the bytes its formula gives."""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

#: (model type, placement, documents: per document (leading text, grids, text after each image)).
QWEN_DOCS = [(5, [(1, 4, 4)], 7), (4, [], 0), (30, [(1, 8, 16), (1, 4, 4)], 6)]
#: With videos (kind per document): a two-frame video cut between the ranks, an image, a short video.
VIDEO_DOCS = [(5, [(1, 4, 4)], 7, "image"), (30, [(2, 8, 8)], 6, "video"), (4, [(2, 4, 4)], 3, "video")]
LLAVA_DOCS = [(5, [1], 7), (4, [], 0), (30, [1, 1], 6)]


def _scenario(model_type: str, placement: str, rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.model.media import media_stats
    from tests.multimodal.vlm_setup import IMAGE_TOKEN, VIDEO_TOKEN, document, documents_alone, group_errors, models

    model_type, _, variant = model_type.partition("+")
    videos = variant == "video"
    stock, ours = models(model_type)
    if variant == "ckpt":  # activation checkpointing of every layer, the vision tower's too
        ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    g = torch.Generator().manual_seed(1)
    if videos:
        docs = [document(stock.config, g, grids, (lead, after), kind) for lead, grids, after, kind in VIDEO_DOCS]
    else:
        layout = LLAVA_DOCS if model_type == "llava" else QWEN_DOCS
        docs = [document(stock.config, g, grids, (lead, after)) for lead, grids, after in layout]
    ref_logits, ref_grads = documents_alone(stock, docs)
    patch_rows = []
    tower = ours.model.vision_tower if model_type == "llava" else ours.model.visual
    tower.register_forward_hook(lambda m, a, o: patch_rows.append(a[0].shape[0]))
    collator = bd.PackingCollator(128, group=dist.group.WORLD, pad_token_id=0, model_config=ours.config,
                                  placement=placement)
    batch = collator(docs)
    ctx = batch["cp_context"]
    out = ours(**batch)
    out.loss.backward()
    for p in ours.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    packed = collator.pack(docs)[0].documents
    full = torch.cat([ref_logits[d.index] for d in packed])
    local = ctx.local_index
    real = local < full.shape[0]
    logits_err = float((out.logits[0].detach()[real] - full[local[real]]).abs().max() / full.abs().max())
    # Independent bytes formula: rows of images encoded elsewhere whose placeholders this rank holds, and back.
    row = torch.cat([d.input_ids for d in collator.pack(docs)[0].documents])  # the packed order
    owner = torch.empty(128, dtype=torch.int64)
    for r in range(world):
        owner[ctx.placement.positions(r)] = r
    t = ctx.media
    # The plan's item order: images (row order), then videos; each item's rows are its kind's next placeholders.
    positions = torch.cat([torch.nonzero(row == IMAGE_TOKEN).flatten(), torch.nonzero(row == VIDEO_TOKEN).flatten()])
    item_of = torch.repeat_interleave(torch.arange(len(t.rows)), torch.tensor(t.rows))
    enc_of = torch.tensor(t.encoder)[item_of]
    width = ours.config.text_config.hidden_size * (1 + len(getattr(ours.config.vision_config,
                                                                   "deepstack_visual_indexes", None) or ()))
    recv = int(((owner[positions] == rank) & (enc_of != rank)).sum()) * width * 4
    sent = int(((owner[positions] != rank) & (enc_of == rank)).sum()) * width * 4
    media = media_stats(ctx)
    split = [len(set(owner[positions[item_of == i]].tolist())) > 1 for i in range(len(t.rows))]
    return {"logits": logits_err, "grads": group_errors(ours, ref_grads), "patch_rows": sum(patch_rows),
            "bytes": media.per_call, "formula": [("forward", sent, recv), ("backward", recv, sent)],
            "split": any(split), "loss": float(out.loss)}


def _worker(rank: int, world: int, scenarios: list[tuple[str, str]]) -> list[dict]:
    return [_scenario(m, p, rank, world) for m, p in scenarios]


def _check(results: list[list[dict]], scenarios: list[tuple[str, str]], total_patches: dict[str, int]) -> None:
    for s, (model_type, placement) in enumerate(scenarios):
        per_rank = [r[s] for r in results]
        label = f"{model_type}/{placement}"
        for r, res in enumerate(per_rank):
            assert res["logits"] < 1e-5, (label, r, res)
            assert max(res["grads"].values()) < 1e-4, (label, r, res["grads"])
            assert res["bytes"] == res["formula"], (label, r, res)
        assert sum(res["patch_rows"] for res in per_rank) == total_patches[model_type], (label, per_rank)
        assert any(res["split"] for res in per_rank), f"{label}: no image straddles two ranks"


PATCHES = {"qwen2_5_vl": 16 + 128 + 16, "qwen3_vl": 16 + 128 + 16, "qwen3_5": 16 + 128 + 16, "llava": 3,
           "qwen2_5_vl+video": 16 + 128 + 32, "qwen3_vl+video": 16 + 128 + 32, "qwen3_vl+ckpt": 16 + 128 + 16}


def test_qwen_family_cp2() -> None:
    scenarios = [("qwen2_5_vl", "balanced"), ("qwen2_5_vl", "contiguous"), ("qwen2_5_vl", "zigzag"),
                 ("qwen3_vl", "balanced"), ("qwen3_5", "balanced"), ("qwen3_5", "mirror"), ("llava", "contiguous"),
                 ("qwen2_5_vl+video", "balanced"), ("qwen3_vl+video", "contiguous"), ("qwen3_vl+ckpt", "balanced")]
    _check(run_ranks(_worker, 2, scenarios, timeout=360), scenarios, PATCHES)


@pytest.mark.slow
def test_cp4() -> None:
    scenarios = [("qwen2_5_vl", "balanced"), ("qwen3_vl", "zigzag"), ("llava", "balanced")]
    _check(run_ranks(_worker, 4, scenarios, timeout=360), scenarios, PATCHES)


FAULT_TIMEOUT_S = 5


def _fault_worker(rank: int, world: int) -> dict:
    """Rank 1's vision encoder raises (an OOM-like error) while rank 0 waits in the feature all-to-all: rank 0 must
    get a CollectiveError naming the exchange within the collective timeout, not hang."""
    import time

    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.errors import CollectiveError
    from tests.multimodal.vlm_setup import document, models

    _, ours = models("qwen2_5_vl")
    g = torch.Generator().manual_seed(1)
    docs = [document(ours.config, g, grids, (lead, after)) for lead, grids, after in QWEN_DOCS]
    group = dist.new_group(list(range(world)))  # its own group: the failure leaves it unusable
    collator = bd.PackingCollator(128, group=group, pad_token_id=0, model_config=ours.config,
                                  config=bd.BlockDiagCPConfig(collective_timeout_s=FAULT_TIMEOUT_S))
    batch = collator(docs)
    assert batch["cp_context"].media.encode, "every rank must encode an image for this fault"
    if rank == 1:
        def fail(*args, **kwargs):
            raise RuntimeError("injected: out of memory in the vision tower")
        ours.model.get_image_features = fail
        ours.get_image_features = fail
    start = time.monotonic()
    try:
        ours(**batch)
    except CollectiveError as err:
        return {"error": "CollectiveError", "message": str(err), "seconds": time.monotonic() - start}
    except RuntimeError as err:
        return {"error": "RuntimeError", "message": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.timeout(120)
def test_an_encoder_failure_on_one_rank_fails_the_exchange_in_bounded_time():
    outcome = run_ranks(_fault_worker, 2, timeout=90, expect_failure=True)
    (status0, rank0), (status1, rank1) = outcome
    assert status0 == "ok" and status1 == "ok", outcome
    assert rank1["error"] == "RuntimeError" and "injected" in rank1["message"], rank1
    assert rank0["error"] == "CollectiveError", rank0
    assert "image/video feature all-to-all" in rank0["message"] and "CP rank 0" in rank0["message"], rank0
    assert rank0["seconds"] < FAULT_TIMEOUT_S + 10, rank0
