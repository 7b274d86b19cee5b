"""PaliGemma's text layers are bidirectional over the image + prompt prefix (``use_bidirectional_attention=True``,
its config's default): every forward where blockdiag_cp would compute something else is refused with the cause,
never silently causal (it was: 0.05 relative logit error on one 12-token document)."""

from __future__ import annotations

import pytest
import torch

from tests.attention.vlm_models import model_pair, packed, paligemma_document, tiny_paligemma_config


@pytest.fixture(scope="module")
def paligemma():
    return model_pair(tiny_paligemma_config(), dtype=torch.float32)


def _one_document():
    doc = paligemma_document(2, 6, seed=1, dtype=torch.float32)
    return packed([doc], "paligemma")


@pytest.mark.parametrize("given", ["token_type_ids", "pixel_values_only", "text_only"])
def test_paligemma_without_blocks_in_the_context_is_refused_with_the_cause(paligemma, given):
    _, ours = paligemma
    row = _one_document()
    inputs = {"input_ids": row["input_ids"], "use_cache": False}
    if given == "token_type_ids":
        inputs.update(token_type_ids=row["token_type_ids"], pixel_values=row["pixel_values"])
    elif given == "pixel_values_only":
        inputs.update(pixel_values=row["pixel_values"])
    else:
        inputs["input_ids"] = torch.randint(2, 290, row["input_ids"].shape)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        ours(**inputs)


def test_paligemma_refusal_names_use_bidirectional_attention(paligemma):
    _, ours = paligemma
    with pytest.raises(NotImplementedError, match="use_bidirectional_attention"):
        ours(input_ids=torch.randint(2, 290, (1, 12)), use_cache=False)


def test_paligemma_with_causal_text_layers_is_exact():
    """With ``use_bidirectional_attention=False`` and no token_type_ids the model is causal: served, exact."""
    config = tiny_paligemma_config()
    config.text_config.use_bidirectional_attention = False
    ref, ours = model_pair(config)
    ids = torch.randint(2, 290, (1, 12))
    want = ref(input_ids=ids, use_cache=False).logits
    got = ours(input_ids=ids, use_cache=False).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-10
