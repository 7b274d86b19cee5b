"""Model level, CP = 1: two packed documents with one synthetic image each through tiny gemma3 (each image's tokens a
bidirectional block) and PaliGemma (the image + prompt prefix a block), the context built with ``block_ids``, against
each document alone through the stock model (sdpa): logits and every parameter gradient. A mismatch between the
model's mask and the context is refused with the cause."""

from __future__ import annotations

import pytest
import torch

from tests.attention.vlm_models import (
    context,
    gemma3_document,
    model_pair,
    packed,
    paligemma_document,
    tiny_gemma3_config,
    tiny_paligemma_config,
)
from tests.reference import documents_alone

TOL = 1e-4


def _documents(model_type: str):
    if model_type == "gemma3":
        return [gemma3_document(3, 4, seed=1), gemma3_document(0, 5, seed=2)]
    return [paligemma_document(2, 5, seed=1), paligemma_document(3, 2, seed=2)]


def _config(model_type: str, **kwargs):
    return tiny_gemma3_config(**kwargs) if model_type == "gemma3" else tiny_paligemma_config()


def _inputs(row, ctx=None, **extra):
    inputs = {"input_ids": row["input_ids"], "pixel_values": row["pixel_values"], "use_cache": False,
              "token_type_ids": row["token_type_ids"], "position_ids": row["position_ids"], **extra}
    if ctx is not None:
        inputs["cp_context"] = ctx
    return inputs


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _packed_loss(logits, docs):
    """The reference's loss over the packed row's logits: next-token cross entropy within each document."""
    loss, count = 0.0, 0
    for out, d in zip(torch.split(logits, [d.input_ids.numel() for d in docs]), docs):
        loss = loss + torch.nn.functional.cross_entropy(out[:-1].double(), d.input_ids[1:], reduction="sum")
        count += d.input_ids.numel() - 1
    return loss / count


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("model_type,sliding_window", [("gemma3", 512), ("gemma3", 3), ("paligemma", None)])
def test_packed_documents_with_images_match_each_document_alone(model_type, sliding_window):
    ref, ours = model_pair(_config(model_type, sliding_window=sliding_window) if model_type == "gemma3"
                           else _config(model_type))
    docs = _documents(model_type)
    row = packed(docs, model_type)
    windows = [sliding_window] if sliding_window is not None else []
    ctx = context(row, sliding_windows=windows)
    out = ours(**_inputs(row, ctx))
    _packed_loss(out.logits[0], docs).backward()
    got_grads = _grads(ours)
    alone = documents_alone(model_type, [d.input_ids for d in docs], ref, inputs=[
        {"pixel_values": d.pixel_values, "token_type_ids": d.token_type_ids[None], "position_ids": d.position_ids[None]}
        for d in docs])
    want, want_grads = alone.logits, alone.grads
    assert _rel(out.logits[0].float(), want) < TOL
    assert set(got_grads) == set(want_grads)
    # A key bias's gradient is zero up to rounding (softmax ignores it): measured against the largest gradient.
    floor = 1e-3 * max(g.norm() for g in want_grads.values())
    errors = {n: ((got_grads[n] - g).norm() / max(g.norm(), floor)).item() for n, g in want_grads.items()}
    worst = max(errors.values())
    assert worst < TOL, sorted((e, n) for n, e in errors.items())[-3:]


def test_a_window_that_cuts_a_block_without_its_plan_is_refused():
    _, ours = model_pair(tiny_gemma3_config(sliding_window=3))
    row = packed(_documents("gemma3"), "gemma3")
    with pytest.raises(NotImplementedError, match="sliding_windows"):
        ours(**_inputs(row, context(row)))  # the context planned no window


@pytest.mark.parametrize("model_type", ["gemma3", "paligemma"])
def test_block_mask_without_block_ids_in_the_context_is_refused(model_type):
    _, ours = model_pair(_config(model_type))
    row = packed(_documents(model_type), model_type)
    with pytest.raises(NotImplementedError, match="PackingCollator with the documents' token_type_ids"):
        ours(**_inputs(row, context(row, with_blocks=False)))
    with pytest.raises(NotImplementedError, match="block_ids"):
        ours(**_inputs(row))  # no context at all


def test_context_blocks_without_the_models_block_mask_are_refused():
    _, ours = model_pair(tiny_gemma3_config())
    row = packed(_documents("gemma3"), "gemma3")
    inputs = _inputs(row, context(row))
    del inputs["token_type_ids"]
    with pytest.raises(NotImplementedError, match="carries bidirectional blocks"):
        ours(**inputs)
