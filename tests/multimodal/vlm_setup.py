"""Tiny vision-language models and synthetic image documents for the multimodal tests, and the reference: each
document alone through the stock model (sdpa), its logits and the gradients of the summed token loss."""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForImageTextToText

#: The attention implementations of a package model (the vision tower keeps sdpa).
OURS = {"text_config": "blockdiag_cp", "vision_config": "sdpa", "": "blockdiag_cp"}
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 250, 251, 252, 253


def tiny_config(model_type: str) -> Any:
    """A tiny random config of ``model_type`` (qwen2_5_vl, qwen3_vl, qwen3_5, llava): text hidden 64, 2 layers."""
    cfg = AutoConfig.for_model(model_type)
    tc = cfg.text_config
    tc.hidden_size, tc.intermediate_size, tc.num_hidden_layers = 64, 128, 2
    tc.num_attention_heads, tc.num_key_value_heads, tc.vocab_size, tc.head_dim = 4, 2, 256, 16
    if getattr(tc, "layer_types", None):
        kinds = list(dict.fromkeys(tc.layer_types))
        tc.layer_types = (kinds * 2)[:2]
    vc = cfg.vision_config
    if model_type == "llava":
        vc.hidden_size, vc.intermediate_size, vc.num_hidden_layers, vc.num_attention_heads = 32, 64, 2, 2
        vc.image_size, vc.patch_size, vc.projection_dim = 16, 4, 32
        cfg.image_token_index, cfg.image_seq_length, cfg.vision_feature_layer = IMAGE_TOKEN, 16, -1
        return cfg
    rope = dict(tc.rope_parameters or {})
    rope["mrope_section"] = [2, 3, 3]
    if model_type.startswith("qwen3"):
        rope.setdefault("mrope_interleaved", True)
    tc.rope_parameters = rope
    for k, v in dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64).items():
        if hasattr(vc, k):
            setattr(vc, k, v)
    if hasattr(vc, "fullatt_block_indexes"):
        vc.fullatt_block_indexes = [1]
    if hasattr(vc, "deepstack_visual_indexes"):
        vc.deepstack_visual_indexes = [0]
    vc.patch_size, vc.temporal_patch_size = 4, 2
    cfg.image_token_id, cfg.video_token_id = IMAGE_TOKEN, VIDEO_TOKEN
    cfg.vision_start_token_id, cfg.vision_end_token_id = VISION_START, VISION_END
    return cfg


def models(model_type: str, seed: int = 0) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(stock, ours)``: the same weights, stock sdpa everywhere vs ``blockdiag_cp`` for the text model."""
    cfg = tiny_config(model_type)
    torch.manual_seed(seed)
    stock = AutoModelForImageTextToText.from_config(copy.deepcopy(cfg), attn_implementation="sdpa")
    ours = AutoModelForImageTextToText.from_config(copy.deepcopy(cfg), attn_implementation=OURS)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def document(cfg: Any, g: torch.Generator, grids: list[tuple[int, int, int]], text: tuple[int, int] = (5, 7),
             kind: str = "image") -> dict[str, Any]:
    """One document as a processor returns it: ``text[0]`` tokens, then per image (video) its placeholder run and
    ``text[1]`` tokens. Qwen family: patch rows and grids; llava: ``grids`` only counts images (16 tokens each)."""
    ids = torch.randint(0, 200, (text[0],), generator=g).tolist()
    if cfg.model_type == "llava":
        for _ in grids:
            ids += [IMAGE_TOKEN] * 16 + torch.randint(0, 200, (text[1],), generator=g).tolist()
        out: dict[str, Any] = {"input_ids": torch.tensor(ids)}
        if grids:
            out["pixel_values"] = torch.randn(len(grids), 3, 16, 16, generator=g)
        return out
    vc = cfg.vision_config
    merge, token = vc.spatial_merge_size, IMAGE_TOKEN if kind == "image" else VIDEO_TOKEN
    pixels = []
    for t, h, w in grids:
        if kind == "video" and cfg.model_type.startswith("qwen3"):  # one run per frame, each after its timestamp
            for _ in range(t):
                ids += [int(torch.randint(0, 200, (), generator=g)), VISION_START]
                ids += [token] * (h * w // merge ** 2) + [VISION_END]
        else:
            ids += [VISION_START] + [token] * (t * h * w // merge ** 2) + [VISION_END]
        ids += torch.randint(0, 200, (text[1],), generator=g).tolist()
        pixels.append(torch.randn(t * h * w, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g))
    out = {"input_ids": torch.tensor(ids)}
    if grids:
        key, grid_key = ("pixel_values", "image_grid_thw") if kind == "image" else ("pixel_values_videos",
                                                                                     "video_grid_thw")
        out[key], out[grid_key] = torch.cat(pixels), torch.tensor(grids)
        types = torch.zeros(len(ids), dtype=torch.int64)
        types[out["input_ids"] == token] = 1 if kind == "image" else 2
        out["mm_token_type_ids"] = types
    return out


_PER_TOKEN = ("input_ids", "mm_token_type_ids", "labels")


def documents_alone(stock: torch.nn.Module, docs: list[dict[str, Any]]) -> tuple[list[torch.Tensor], dict]:
    """Each document alone through ``stock``: its logits ``[n_i, V]`` and the gradients of the token-mean loss of
    all documents together (every document's own targets, shifted within it)."""
    stock.zero_grad(set_to_none=True)
    logits, total, loss = [], 0, 0.0
    for d in docs:
        out = stock(**{k: (v[None] if k in _PER_TOKEN else v) for k, v in d.items()}, labels=d["input_ids"][None],
                    use_cache=False)
        n = len(d["input_ids"]) - 1
        loss, total = loss + out.loss * n, total + n
        logits.append(out.logits[0].detach())
    (loss / total).backward()
    return logits, {n: p.grad.clone() for n, p in stock.named_parameters() if p.grad is not None}


def group_errors(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """``||g - g_ref|| / ||g_ref||`` per part of the model (vision tower, projector, language model)."""
    def part(name: str) -> str:
        if any(k in name for k in ("visual.merger", "multi_modal_projector", "deepstack_merger")):
            return "projector"
        return "vision" if any(k in name for k in ("visual", "vision_tower")) else "language"
    num: dict[str, float] = {}
    den: dict[str, float] = {}
    for name, p in model.named_parameters():
        r = ref.get(name)
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        r = torch.zeros_like(p) if r is None else r
        k = part(name)
        num[k] = num.get(k, 0.0) + float((g.double() - r.double()).pow(2).sum())
        den[k] = den.get(k, 0.0) + float(r.double().pow(2).sum())
    return {k: (num[k] ** 0.5) / max(den[k] ** 0.5, 1e-30) for k in num}
