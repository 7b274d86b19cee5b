"""Issue 32, vision attention is right by default: ``attn_implementation="blockdiag_cp"`` as a string on a
vision-language model keeps the text model on blockdiag_cp and gives the vision tower transformers' default exact
attention (sdpa, else eager), through from_config, from_pretrained and set_attn_implementation; an explicit
per-sub-config dict is applied as given (a tower on blockdiag_cp is refused at its forward, never run wrongly)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

import hf_blockdiag_cp  # noqa: F401  (registers blockdiag_cp)
from hf_blockdiag_cp.model import prepare
from hf_blockdiag_cp.model.subconfigs import spread_attn_implementation
from tests.reference import documents_alone

IMAGE = 100  # the image placeholder id of every tiny config (vocabulary 128)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_channels=3,
           image_size=16, patch_size=4)  # a 16 x 16 image: 4 x 4 patches
QWEN_VIT = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, in_channels=3, patch_size=4,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32)
QWEN_IDS = dict(image_token_id=IMAGE, video_token_id=101, vision_start_token_id=102, vision_end_token_id=103)
MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}

#: model type -> (text_config, vision_config, top-level) overrides of AutoConfig.for_model(model type).
SPECS = {
    "qwen2_5_vl": ({"rope_parameters": MROPE}, dict(QWEN_VIT, window_size=16, fullatt_block_indexes=[0]), QWEN_IDS),
    "qwen3_vl": ({"rope_parameters": {**MROPE, "mrope_interleaved": True}},
                 dict(QWEN_VIT, num_position_embeddings=16, deepstack_visual_indexes=[0]), QWEN_IDS),
    "llava": ({}, dict(VIT, num_hidden_layers=2, projection_dim=32),
              dict(image_token_index=IMAGE, image_seq_length=16)),
    "idefics3": ({}, VIT, dict(image_token_id=IMAGE, scale_factor=2, pad_token_id=0)),
    "smolvlm": ({}, VIT, dict(image_token_id=IMAGE, scale_factor=2, pad_token_id=0)),
    "internvl": ({}, dict(VIT, image_size=[16, 16], patch_size=[4, 4]),
                 dict(image_token_id=IMAGE, image_seq_length=4, downsample_ratio=0.5)),
    "mistral3": ({}, dict(VIT, head_dim=16), dict(image_token_index=IMAGE, spatial_merge_size=2)),
    # Images make bidirectional blocks in gemma3's text mask (handled elsewhere): routing only here.
    "gemma3": ({"sliding_window": 4}, VIT,
               dict(image_token_index=IMAGE, boi_token_index=104, eoi_token_index=105, mm_tokens_per_image=4)),
}
NUMERIC = [t for t in SPECS if t != "gemma3"]
#: What a user had to write before: the text model on blockdiag_cp, the tower on sdpa.
EXPLICIT = {"": "blockdiag_cp", "text_config": "blockdiag_cp", "vision_config": "sdpa"}


def _config(model_type: str):
    text, vision, top = SPECS[model_type]
    return AutoConfig.for_model(model_type, text_config={**TEXT, **text}, vision_config=dict(vision), **top)


def _model(model_type: str, attn_implementation, seed: int = 0):
    torch.manual_seed(seed)  # same seed, same weights, whatever the implementation
    return AutoModelForImageTextToText.from_config(_config(model_type), attn_implementation=attn_implementation).eval()


def _image_batch(model_type: str) -> dict:
    """One document with one synthetic image: ``input_ids [1, T]`` and the image keyword arguments."""
    gen = torch.Generator().manual_seed(0)

    def text(n: int) -> list[int]:
        return torch.randint(3, 90, (n,), generator=gen).tolist()

    if model_type in ("qwen2_5_vl", "qwen3_vl"):  # 4 x 4 patches of 2 frames, merged 2 x 2: 4 image tokens
        ids = text(5) + [102] + [IMAGE] * 4 + [103] + text(6)
        extra = dict(pixel_values=torch.randn(16, 3 * 2 * 4 * 4, generator=gen),
                     image_grid_thw=torch.tensor([[1, 4, 4]]),
                     mm_token_type_ids=torch.tensor([[int(i == IMAGE) for i in ids]]))
    elif model_type == "llava":  # 16 patches, the CLS feature dropped
        ids, extra = text(5) + [IMAGE] * 16 + text(6), dict(pixel_values=torch.randn(1, 3, 16, 16, generator=gen))
    elif model_type in ("idefics3", "smolvlm"):  # 16 patches, pixel shuffle by 2
        ids, extra = text(5) + [IMAGE] * 4 + text(6), dict(pixel_values=torch.randn(1, 1, 3, 16, 16, generator=gen))
    elif model_type == "internvl":  # 16 patches, downsampled by 0.5
        ids, extra = text(5) + [IMAGE] * 4 + text(6), dict(pixel_values=torch.randn(1, 3, 16, 16, generator=gen))
    else:  # mistral3: 4 x 4 patches merged 2 x 2
        ids = text(5) + [IMAGE] * 4 + text(6)
        extra = dict(pixel_values=torch.randn(1, 3, 16, 16, generator=gen), image_sizes=torch.tensor([[16, 16]]))
    return dict(input_ids=torch.tensor([ids]), use_cache=False, **extra)


def _implementations(model) -> tuple[str, str, str]:
    config = model.config
    return config._attn_implementation, config.get_text_config()._attn_implementation, \
        config.vision_config._attn_implementation


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    rel = float((got - want).abs().max() / want.abs().max())
    assert rel <= 1e-5, rel


def _attention_calls(model) -> int:
    return model.__dict__[prepare.PROBE_ATTR].attention_calls


# ---- routing ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", sorted(SPECS))
def test_string_keeps_the_text_model_and_gives_the_tower_stock_attention(model_type):
    model = _model(model_type, "blockdiag_cp")
    top, text, vision = _implementations(model)
    assert (top, text) == ("blockdiag_cp", "blockdiag_cp")
    assert vision in ("sdpa", "eager")
    assert prepare.package_hooks(model) == ([prepare._pre_forward], [prepare._post_forward])  # prepared, as before


def test_a_tower_without_sdpa_gets_eager():
    """GOT-OCR2's SAM vision encoder has no sdpa: transformers' default gives it eager (built on meta: no weights)."""
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.for_model("got_ocr2"),
                                                        attn_implementation="blockdiag_cp")
    assert model.config.vision_config._attn_implementation == "eager"
    assert model.config.text_config._attn_implementation == "blockdiag_cp"


def test_user_dict_is_applied_as_given():
    model = _model("llava", {"": "blockdiag_cp", "text_config": "blockdiag_cp", "vision_config": "eager"})
    assert _implementations(model) == ("blockdiag_cp", "blockdiag_cp", "eager")


def test_text_only_models_are_untouched():
    config = AutoConfig.for_model("llama", **{k: v for k, v in TEXT.items() if k != "head_dim"})
    assert spread_attn_implementation(config, "blockdiag_cp") == "blockdiag_cp"
    assert spread_attn_implementation(_config("llava"), "sdpa") == "sdpa"
    model = AutoModelForCausalLM.from_config(config, attn_implementation="blockdiag_cp")
    assert model.config._attn_implementation == "blockdiag_cp"


# ---- numerics: one document with one image ---------------------------------------------------------------------

@pytest.mark.parametrize("model_type", NUMERIC)
def test_image_logits_equal_the_explicit_dict_and_stock_sdpa(model_type):
    batch = _image_batch(model_type)
    ours = _model(model_type, "blockdiag_cp")
    calls = _attention_calls(ours)
    with torch.no_grad():
        logits = ours(**batch).logits
    assert _attention_calls(ours) > calls, "the text model did not call blockdiag_cp"
    with torch.no_grad():
        explicit = _model(model_type, dict(EXPLICIT))(**batch).logits
        stock = _model(model_type, "sdpa")(**batch).logits
    _assert_close(logits, explicit)
    _assert_close(logits, stock)


@pytest.mark.parametrize("model_type", ["llava", "mistral3"])
def test_packed_text_rows_of_a_vlm_equal_each_document_alone(model_type):
    """The text model still runs blockdiag_cp on a packed row (two documents, positions restarting)."""
    ours, stock = _model(model_type, "blockdiag_cp"), _model(model_type, "sdpa")
    docs = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 5)]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    calls = _attention_calls(ours)
    with torch.no_grad():
        packed = ours(input_ids=torch.cat(docs)[None], position_ids=positions, use_cache=False).logits[0]
    alone = documents_alone(model_type, docs, stock, backward=False).logits
    assert _attention_calls(ours) > calls
    _assert_close(packed, alone)


# ---- from_pretrained and set_attn_implementation --------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llava", "qwen2_5_vl"])
def test_saved_vlm_loaded_with_the_string(model_type, tmp_path):
    batch = _image_batch(model_type)
    stock = _model(model_type, "sdpa")
    stock.save_pretrained(tmp_path)
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path, attn_implementation="blockdiag_cp").eval()
    top, text, vision = _implementations(loaded)
    assert (top, text, vision) == ("blockdiag_cp", "blockdiag_cp", "sdpa")
    with torch.no_grad():
        _assert_close(loaded(**batch).logits, stock(**batch).logits)


def test_set_attn_implementation_on_a_loaded_vlm():
    batch = _image_batch("idefics3")
    model = _model("idefics3", "sdpa")
    with torch.no_grad():
        want = model(**batch).logits
    model.set_attn_implementation("blockdiag_cp")
    assert _implementations(model) == ("blockdiag_cp", "blockdiag_cp", "sdpa")
    calls = _attention_calls(model)
    with torch.no_grad():
        _assert_close(model(**batch).logits, want)
    assert _attention_calls(model) > calls


# ---- a tower the user puts on blockdiag_cp ---------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["llava", "idefics3"])
def test_tower_set_to_blockdiag_cp_by_a_dict_is_refused_at_its_forward(model_type):
    model = _model(model_type, {"": "blockdiag_cp", "text_config": "blockdiag_cp", "vision_config": "blockdiag_cp"})
    assert _implementations(model) == ("blockdiag_cp",) * 3
    with pytest.raises(NotImplementedError, match="not causal|bidirectional"):
        model(**_image_batch(model_type))

