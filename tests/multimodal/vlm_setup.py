import torch, copy
from transformers import AutoConfig, AutoModelForImageTextToText

def tiny_qwen(model_type="qwen2_5_vl"):
    cfg = AutoConfig.for_model(model_type)
    tc = cfg.text_config
    tc.hidden_size = 64; tc.intermediate_size = 128; tc.num_hidden_layers = 2; tc.num_attention_heads = 4
    tc.num_key_value_heads = 2; tc.vocab_size = 256; tc.head_dim = 16
    if hasattr(tc, "layer_types") and tc.layer_types:
        lt = list(dict.fromkeys(tc.layer_types))
        tc.layer_types = (lt * 2)[:2]
    rp = dict(tc.rope_parameters or {}); 
    rp["mrope_section"] = [2, 3, 3]; rp.setdefault("mrope_interleaved", True) if model_type.startswith("qwen3") else None
    tc.rope_parameters = rp
    vc = cfg.vision_config
    for k, v in dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, embed_dim=32).items():
        if hasattr(vc, k): setattr(vc, k, v)
    if hasattr(vc, "fullatt_block_indexes"): vc.fullatt_block_indexes = [1]
    if hasattr(vc, "deepstack_visual_indexes"): vc.deepstack_visual_indexes = [0]
    vc.patch_size = 4; vc.temporal_patch_size = 1 if model_type=="qwen2_vl" else 2
    if model_type == "qwen2_vl": vc.temporal_patch_size = 2
    cfg.image_token_id = 250; cfg.video_token_id = 251; cfg.vision_start_token_id = 252; cfg.vision_end_token_id = 253
    return cfg

def image_doc(cfg, g, grids, text=(5, 7)):
    vc = cfg.vision_config; m = vc.spatial_merge_size
    ids = list(torch.randint(0, 200, (text[0],), generator=g).tolist()); pv = []
    for (t, h, w) in grids:
        ids += [cfg.vision_start_token_id] + [cfg.image_token_id] * (t * h * w // (m * m)) + [cfg.vision_end_token_id]
        ids += torch.randint(0, 200, (text[1],), generator=g).tolist()
        pv.append(torch.randn(t * h * w, 3 * vc.temporal_patch_size * vc.patch_size ** 2, generator=g))
    ex = {"input_ids": torch.tensor(ids)}
    if grids:
        ex["pixel_values"] = torch.cat(pv); ex["image_grid_thw"] = torch.tensor(grids)
        mm = torch.zeros(len(ids), dtype=torch.long); mm[ex["input_ids"] == cfg.image_token_id] = 1
        ex["mm_token_type_ids"] = mm
    return ex
