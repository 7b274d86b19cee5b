"""The collator on vision-language documents: per-document 3-D positions equal the model's own, the batch keys are
the row's images in order (or, under CP, the images this rank encodes), and bad input raises naming the example."""

from __future__ import annotations

import pickle

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.errors import UnsupportedModel
from tests.multimodal.vlm_setup import IMAGE_TOKEN, document, models


@pytest.fixture(scope="module")
def qwen():
    stock, ours = models("qwen2_5_vl")
    g = torch.Generator().manual_seed(3)
    docs = [document(stock.config, g, [(1, 4, 4)]), document(stock.config, g, []),
            document(stock.config, g, [(1, 4, 8), (1, 4, 4)], (3, 9))]
    return stock, ours, docs


def test_positions_are_each_documents_own(qwen):
    stock, _, docs = qwen
    batch = bd.PackingCollator(128, pad_token_id=0, model_config=stock.config)(docs)
    positions = batch["position_ids"]
    assert positions.shape == (4, 1, 128)
    start = 0
    for d in docs:
        n = len(d["input_ids"])
        assert torch.equal(positions[0, 0, start:start + n], torch.arange(n))
        if "image_grid_thw" in d:  # the real model's rule on the document alone (not the collator's stand-in)
            own, _ = stock.model.get_rope_index(d["input_ids"][None], d["mm_token_type_ids"][None],
                                                image_grid_thw=d["image_grid_thw"])
            assert torch.equal(positions[1:, 0, start:start + n], own[:, 0])
        else:
            assert torch.equal(positions[1:, 0, start:start + n], torch.arange(n).expand(3, -1))
        start += n
    assert torch.equal(batch["pixel_values"], torch.cat([d["pixel_values"] for d in docs if "pixel_values" in d]))
    assert torch.equal(batch["image_grid_thw"], torch.tensor([[1, 4, 4], [1, 4, 8], [1, 4, 4]]))
    assert torch.equal(batch["mm_token_type_ids"][0, :start], torch.cat([
        d.get("mm_token_type_ids", torch.zeros(len(d["input_ids"]), dtype=torch.int64)) for d in docs]))


def test_cp_ranks_share_the_images_once(qwen):
    stock, _, docs = qwen
    per_rank = [bd.PackingCollator(128, cp_size=2, cp_rank=r, pad_token_id=0, model_config=stock.config)(docs)
                for r in range(2)]
    grids = [tuple(map(tuple, b["image_grid_thw"].tolist())) if "image_grid_thw" in b else () for b in per_rank]
    assert sorted(g for rank in grids for g in rank) == sorted([(1, 4, 4), (1, 4, 8), (1, 4, 4)])
    for b in per_rank:
        ctx = b["cp_context"]
        assert b["position_ids"].shape == (4, 1, 64)
        assert int((b["input_ids"] == IMAGE_TOKEN).sum()) == sum(ctx.media.local_rows(k) for k in ctx.media.gather)
        if "pixel_values" in b:
            assert b["pixel_values"].shape[0] == int(b["image_grid_thw"].prod(-1).sum())
    assert per_rank[0]["cp_context"].data_fingerprint == per_rank[1]["cp_context"].data_fingerprint


def test_collator_and_context_pickle(qwen):
    stock, _, docs = qwen
    collator = bd.PackingCollator(128, cp_size=2, cp_rank=1, pad_token_id=0, model_config=stock.config)
    again = pickle.loads(pickle.dumps(collator))
    a, b = collator(docs), again(docs)
    assert torch.equal(a["position_ids"], b["position_ids"])
    ctx = pickle.loads(pickle.dumps(a["cp_context"]))
    assert ctx.media.encode == a["cp_context"].media.encode


def _bad(docs, **edit):
    out = [dict(d) for d in docs]
    out[2].update(edit)
    return out


def test_bad_input_names_the_example(qwen):
    stock, _, docs = qwen
    collator = bd.PackingCollator(128, pad_token_id=0, model_config=stock.config)
    ids = docs[2]["input_ids"]
    fewer = ids[ids != IMAGE_TOKEN][:20]
    cases = [
        (_bad(docs, image_grid_thw=torch.tensor([[1, 4, 8], [1, 8, 8]]), pixel_values=torch.randn(96, 96)),
         "example 2: its images give .* feature rows"),
        (_bad(docs, input_ids=fewer, mm_token_type_ids=torch.zeros(20, dtype=torch.int64)),
         "example 2: has pixel_values but its input_ids hold no image placeholder"),
        ([dict(d) for d in docs[:2]] + [{"input_ids": ids}], "example 2: input_ids hold 12 image placeholder"),
        (_bad(docs, pixel_values=torch.randn(95, 96)), "example 2: pixel_values has 95 patch rows"),
    ]
    for examples, message in cases:
        with pytest.raises(ValueError, match=message):
            collator(examples)
    with pytest.raises(ValueError, match="example 2: a document with images .* does not fit the row"):
        bd.PackingCollator(32, pad_token_id=0, model_config=stock.config)(docs)
    with pytest.raises(ValueError, match="pass model_config=model.config"):
        bd.PackingCollator(128, pad_token_id=0)(docs)
    for rank in range(2):  # the same error on every CP rank (the collator is host code on the same examples)
        with pytest.raises(ValueError, match="example 2: pixel_values has 95 patch rows"):
            bd.PackingCollator(128, cp_size=2, cp_rank=rank, pad_token_id=0,
                               model_config=stock.config)(_bad(docs, pixel_values=torch.randn(95, 96)))


def test_flat_positions_with_grids_are_refused(qwen):
    _, ours, docs = qwen
    batch = bd.PackingCollator(128, pad_token_id=0, model_config=ours.config)(docs)
    batch = {**batch, "position_ids": batch["position_ids"][0]}
    with pytest.raises(UnsupportedModel, match="1-D position_ids"):
        ours(**batch)


def test_from_flattened_refuses_images(qwen):
    _, _, docs = qwen
    flat = {"input_ids": torch.cat([d["input_ids"] for d in docs])[None], "pixel_values": docs[0]["pixel_values"]}
    with pytest.raises(ValueError, match="from_flattened carries text only"):
        bd.from_flattened(flat)


def test_an_all_zero_idefics3_tile_is_refused():
    from hf_blockdiag_cp.conformance.multimodal import synthetic_documents, tiny_vlm_config

    config = tiny_vlm_config("idefics3")
    doc = synthetic_documents(config, num_docs=1, seed=1, images=(1,))[0]
    doc["pixel_values"] = doc["pixel_values"].clone()
    doc["pixel_values"][0] = 0
    with pytest.raises(ValueError, match="example 0: tile 0 of its pixel_values is all zeros"):
        bd.PackingCollator(512, pad_token_id=0, model_config=config)([doc])


def test_images_of_an_unchecked_architecture_are_refused():
    from hf_blockdiag_cp.conformance.multimodal import synthetic_documents, tiny_vlm_config
    from hf_blockdiag_cp.errors import Refusal

    config = tiny_vlm_config("llava")
    docs = synthetic_documents(config, num_docs=2, seed=1, images=(1,))
    config.model_type = "llava_next"  # the same layout under a name whose rules are not checked
    for cp_size, rank in ((1, 0), (2, 0), (2, 1)):
        with pytest.raises(Refusal, match="example 0: llava_next documents with images"):
            bd.PackingCollator(128, cp_size=cp_size, cp_rank=rank, pad_token_id=0, model_config=config)(docs)
    text_only = [{"input_ids": d["input_ids"][d["input_ids"] != config.image_token_index]} for d in docs]
    assert bd.PackingCollator(128, pad_token_id=0, model_config=config)(text_only)["input_ids"].shape == (1, 128)
