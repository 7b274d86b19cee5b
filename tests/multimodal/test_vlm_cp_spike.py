import copy
import torch
import pytest
from tests.launch import run_ranks
from tests.multimodal.vlm_setup import tiny_qwen, image_doc


def _worker(rank, world, model_type, placement):
    import torch.distributed as dist
    import hf_blockdiag_cp as bd
    from transformers import AutoModelForImageTextToText
    cfg = tiny_qwen(model_type); torch.manual_seed(0)
    ref = AutoModelForImageTextToText.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    model = AutoModelForImageTextToText.from_config(copy.deepcopy(cfg), attn_implementation={"text_config": "blockdiag_cp", "vision_config": "sdpa", "": "blockdiag_cp"})
    model.load_state_dict(ref.state_dict())
    g = torch.Generator().manual_seed(1)
    docs = [image_doc(cfg, g, [(1, 4, 4)]), image_doc(cfg, g, []), image_doc(cfg, g, [(1, 4, 8), (1, 4, 4)], text=(3, 30))]
    for d in docs:
        d["labels"] = d["input_ids"].clone()
    # reference: each doc alone, summed loss over all tokens / total count
    logits_ref, total = [], 0
    loss_sum = 0
    for d in docs:
        kw = {k: (v[None] if k in ("input_ids", "mm_token_type_ids", "labels") else v) for k, v in d.items()}
        out = ref(**kw, use_cache=False)
        n = len(d["input_ids"]) - 1
        loss_sum = loss_sum + out.loss * n; total += n
        logits_ref.append(out.logits[0].detach())
    (loss_sum / total).backward()
    calls = []
    model.model.visual.register_forward_hook(lambda m, a, o: calls.append(a[0].shape[0]))
    col = bd.PackingCollator(128, group=dist.group.WORLD, pad_token_id=0, model_config=model.config, placement=placement)
    batch = col(docs)
    out = model(**batch)
    out.loss.backward()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    ctx = batch["cp_context"]
    full = torch.cat(logits_ref)
    idx = ctx.local_index
    real = idx < full.shape[0]
    err = ((out.logits[0][real] - full[idx[real]]).abs().max() / full.abs().max()).item()
    gerr = max(((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-12)).item()
               for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
    vis = [n for n, _ in model.named_parameters() if "visual" in n]
    return err, gerr, sum(calls), len(vis), ctx.media.encode


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_cp2(model_type):
    res = run_ranks(_worker, 2, model_type, "balanced", timeout=240)
    print(res)
    for err, gerr, calls, _, _ in res:
        assert err < 1e-5 and gerr < 1e-4, res
    assert sum(r[2] for r in res) == 16 + 32 + 16
