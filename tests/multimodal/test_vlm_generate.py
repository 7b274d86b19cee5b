"""generate() of a vision-language model loaded with attn_implementation="blockdiag_cp" (no packing, a KV cache):
the same tokens as stock sdpa with an image in the prompt, or a refusal naming the cause."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp  # noqa: F401  (registers the attention)
from hf_blockdiag_cp.conformance.multimodal import build_vlm, model_inputs, synthetic_documents, tiny_vlm_config


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "llava"])
def test_generate_with_an_image_equals_stock(model_type):
    config = tiny_vlm_config(model_type)
    stock, ours = build_vlm(config, "sdpa"), build_vlm(config, "blockdiag_cp")
    ours.load_state_dict(stock.state_dict())
    inputs = model_inputs(config, synthetic_documents(config, num_docs=1, seed=3, images=(1,))[0])
    expected = stock.generate(**inputs, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours.generate(**inputs, max_new_tokens=6, do_sample=False), expected)


def test_generate_with_gemma3_image_blocks_is_refused():
    config = tiny_vlm_config("gemma3")
    inputs = model_inputs(config, synthetic_documents(config, num_docs=1, seed=3, images=(1,))[0])
    with pytest.raises(NotImplementedError, match="bidirectional blocks"):
        build_vlm(config, "blockdiag_cp").generate(**inputs, max_new_tokens=2, do_sample=False)
