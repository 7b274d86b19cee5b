"""Every covered vision-language architecture on packed image rows, at CP = 1 and on 2 gloo ranks (balanced
placement), against each document alone through the stock model: logits, the token-sum loss and the gradients of
every parameter, the vision tower's included (:mod:`hf_blockdiag_cp.conformance.multimodal`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.conformance.multimodal import (
    build_vlm,
    compare,
    documents_alone,
    make_stateful,
    synthetic_documents,
    tiny_vlm_config,
)
from tests.launch import run_ranks

#: Every covered architecture (gemma3 / paligemma: with their bidirectional image blocks).
SERVED = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "idefics3", "smolvlm", "mistral3", "internvl",
          "gemma3", "paligemma")
OURS = {"text_config": "blockdiag_cp", "vision_config": "sdpa", "": "blockdiag_cp"}
SEQ_LEN = 512


#: Document sets for the CP test (each with at least two documents and one with two images).
SPECS = (dict(num_docs=4, seed=7, images=(1, 2, 0, 1)), dict(num_docs=3, seed=7, images=(2, 1, 0), text_len=(10, 40)),
         dict(num_docs=2, seed=3, images=(2, 0), text_len=(4, 10)), dict(num_docs=2, seed=5, images=(2, 1),
                                                                         text_len=(2, 6)),
         dict(num_docs=2, seed=0, images=(2, 1), text_len=(4, 10)), dict(num_docs=2, seed=0, images=(2, 1),
                                                                         text_len=(10, 40)))


def _setup(model_type: str, spec: dict | None = None):
    config = tiny_vlm_config(model_type)
    stock = build_vlm(config, "sdpa")
    make_stateful(stock)  # qwen3_5's gated-delta state must survive document pieces (tiny configs forget at once)
    ours = build_vlm(config, OURS)
    ours.load_state_dict(stock.state_dict())
    docs = synthetic_documents(config, **(spec or SPECS[0]))
    return stock, ours, docs, documents_alone(stock, docs)


def _packed_order(collator, docs) -> list[int]:
    return [d.index for d in collator.pack(docs)[0].documents]


@pytest.mark.parametrize("model_type", SERVED)
def test_packed_row_at_cp1(model_type):
    stock, ours, docs, alone = _setup(model_type)
    collator = bd.PackingCollator(SEQ_LEN, pad_token_id=0, model_config=ours.config)
    batch = collator(docs)
    out = ours(**batch)
    (out.loss * batch["num_items_in_batch"]).backward()
    logits, start = [None] * len(docs), 0
    for i in _packed_order(collator, docs):
        n = len(docs[i]["input_ids"])
        logits[i] = out.logits[0, start:start + n].detach()
        start += n
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    err = compare(logits, out.loss.detach() * batch["num_items_in_batch"], grads, alone)
    assert max(err.values()) < 1e-4, (model_type, err)


def _cp_step_errors(ours, batch: dict, collator, docs: list, alone) -> dict[str, float]:
    """One CP training step of ``batch`` on this rank (gradients and token-sum loss summed over the ranks) against
    the reference: this rank's logits at its rows, the loss and every gradient."""
    import torch.distributed as dist

    out = ours(**batch)
    (out.loss * batch["num_items_in_batch"]).backward()
    for p in ours.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
    loss = out.loss.detach() * batch["num_items_in_batch"]
    dist.all_reduce(loss)
    ref = torch.cat([alone.logits[i] for i in _packed_order(collator, docs)])
    local = batch["cp_context"].local_index
    real = local < ref.shape[0]
    return compare([out.logits[0].detach()[real]], loss, {n: p.grad for n, p in ours.named_parameters()},
                   dataclasses.replace(alone, logits=[ref[local[real]]]))


def _cp_worker(rank: int, world: int, types: tuple[str, ...]) -> dict[str, dict[str, float]]:
    import torch.distributed as dist

    results = {}
    for model_type in types:
        spec, placement, length = _straddling_case(model_type, world)
        stock, ours, docs, alone = _setup(model_type, spec)
        collator = bd.PackingCollator(length, group=dist.group.WORLD, pad_token_id=0, model_config=ours.config,
                                      placement=placement)
        batch = collator(docs)
        err = _cp_step_errors(ours, batch, collator, docs, alone)
        results[model_type] = {**err, "split": float(_splits_an_image(collator, docs, batch["cp_context"], world)),
                               "balanced": float(placement == "balanced")}
    return results


def _straddling_case(model_type: str, world: int) -> tuple[dict, str, int]:
    """A document set, placement (balanced first) and row length at which an image is cut between two ranks: the case
    the exchange must get right (host-only search, the same on every rank)."""
    config = tiny_vlm_config(model_type)
    for placement in ("balanced", "contiguous"):
        for spec in SPECS:
            docs = synthetic_documents(config, **spec)
            total = sum(len(d["input_ids"]) for d in docs)
            for length in range(-(-total // (2 * world)) * 2 * world, total + 200, 2 * world):
                probe = bd.PackingCollator(length, cp_size=world, cp_rank=0, pad_token_id=0, model_config=config,
                                           placement=placement)
                if _splits_an_image(probe, docs, probe(docs)["cp_context"], world):
                    return spec, placement, length
    raise AssertionError(f"{model_type}: no row length splits an image: change the test documents")


def _splits_an_image(collator, docs, ctx, world: int) -> bool:
    """Whether some image (tile) of the row has placeholder tokens on two ranks."""
    row = torch.cat([d.input_ids for d in collator.pack(docs)[0].documents])
    owner = torch.empty(ctx.full_len, dtype=torch.int64)
    for r in range(world):
        owner[ctx.placement.positions(r)] = r
    token = collator.media.token_ids["image"]
    positions = torch.nonzero(row == token).flatten()
    spans = torch.tensor(ctx.media.rows).cumsum(0).tolist()
    return any(len(set(owner[positions[a:b]].tolist())) > 1 for a, b in zip([0, *spans[:-1]], spans))


@pytest.mark.distributed
@pytest.mark.slow  # ~9 s: every VLM family at CP = 2 in one spawn
@pytest.mark.timeout(600)
def test_packed_rows_at_cp2():
    for rank, res in enumerate(run_ranks(_cp_worker, 2, SERVED, timeout=500)):
        for model_type, err in res.items():
            split, balanced = err.pop("split"), err.pop("balanced")
            assert max(err.values()) < 1e-4, (rank, model_type, err)
            assert split, f"{model_type}: no image straddles the two ranks"
            assert balanced, f"{model_type}: no balanced row cuts an image (another placement was used)"


@pytest.mark.slow
def test_saved_vlm_loaded_with_the_plain_string_trains_with_images(tmp_path):
    from transformers import AutoModelForImageTextToText

    stock, _, docs, alone = _setup("qwen2_5_vl")
    stock.save_pretrained(tmp_path)
    model = AutoModelForImageTextToText.from_pretrained(tmp_path, attn_implementation="blockdiag_cp")
    assert model.config.get_text_config()._attn_implementation == "blockdiag_cp"
    assert model.config.vision_config._attn_implementation in ("sdpa", "eager")
    collator = bd.PackingCollator(SEQ_LEN, pad_token_id=0, model_config=model.config)
    batch = collator(docs)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for step in range(4):
        out = model(**batch)
        (out.loss * batch["num_items_in_batch"]).backward()
        if step == 0:  # the first step is the reference's, gradients of the vision tower included
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            err = compare([alone.logits[i] for i in range(len(docs))], out.loss.detach() * batch["num_items_in_batch"],
                          grads, alone)
            assert err["loss"] < 1e-5 and err["grads"] < 1e-4, err
            assert any(n.startswith("model.visual") for n in grads)
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= batch["num_items_in_batch"]
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss))
    assert losses[-1] < losses[0], losses


def _ulysses_worker(rank: int, world: int, model_type: str) -> dict[str, float]:
    """The head-parallel layout (ulysses_size = world) on a packed image row: images travel as under sequence CP."""
    stock, ours, docs, alone = _setup(model_type, SPECS[0])
    mesh = bd.init_device_mesh(cp_size=world)
    collator = bd.PackingCollator(172, group=mesh["cp"], pad_token_id=0, model_config=ours.config,
                                  ulysses_size=world, ulysses_groups=bd.ulysses_groups(mesh, sizes=(world,)))
    batch = collator(docs)
    assert batch["cp_context"].ulysses_size == world
    return _cp_step_errors(ours, batch, collator, docs, alone)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_head_parallel_layout_with_images():
    for rank, err in enumerate(run_ranks(_ulysses_worker, 2, "qwen2_5_vl", timeout=240, init_group=False)):
        assert max(err.values()) < 1e-4, (rank, err)


def _autocast_worker(rank: int, world: int) -> dict:
    """bf16 autocast at CP = 2, one image in the row, cut between the ranks: rank 1 encodes nothing and receives
    rows from rank 0 (the exchange must use one dtype on both)."""
    import torch.distributed as dist

    config = tiny_vlm_config("qwen2_5_vl")
    docs = (synthetic_documents(config, num_docs=1, seed=19, images=(1,))
            + synthetic_documents(config, num_docs=2, seed=8, images=(0,)))
    stock = build_vlm(config, "sdpa")
    ours = build_vlm(config, "blockdiag_cp")
    ours.load_state_dict(stock.state_dict())
    alone = documents_alone(stock, docs, loss=False)
    collator = bd.PackingCollator(60, group=dist.group.WORLD, pad_token_id=0, model_config=ours.config)
    batch = collator(docs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(**batch)
    out.loss.backward()
    ref = torch.cat([alone.logits[i] for i in _packed_order(collator, docs)])
    local = batch["cp_context"].local_index
    real = local < ref.shape[0]
    err = float((out.logits[0].float().detach()[real] - ref[local[real]]).abs().max() / ref.abs().max())
    return {"logits": err, "encode": batch["cp_context"].media.encode,
            "split": _splits_an_image(collator, docs, batch["cp_context"], world)}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(200)
def test_bf16_autocast_with_a_rank_that_encodes_nothing():
    results = run_ranks(_autocast_worker, 2, timeout=150)
    assert [len(r["encode"]) for r in results] == [1, 0] and results[0]["split"], results
    for res in results:
        assert res["logits"] < 3e-2, res  # bf16 against the float32 reference


def _no_image_tokens_worker(rank: int, world: int, types: tuple[str, ...]) -> dict[str, tuple[int, dict]]:
    """One image document and long text documents, contiguous placement: rank 1 holds no image token at all (it
    still takes part in the exchange, with empty rows, in forward and backward)."""
    import torch.distributed as dist

    results = {}
    for model_type in types:
        config = tiny_vlm_config(model_type)
        docs = (synthetic_documents(config, num_docs=1, seed=3, images=(1,))
                + synthetic_documents(config, num_docs=3, seed=8, images=(0,), text_len=(20, 30)))
        stock = build_vlm(config, "sdpa")
        ours = build_vlm(config, "blockdiag_cp")
        ours.load_state_dict(stock.state_dict())
        alone = documents_alone(stock, docs)
        total = sum(len(d["input_ids"]) for d in docs)
        collator = bd.PackingCollator(-(-total // 4) * 4, group=dist.group.WORLD, pad_token_id=0,
                                      model_config=ours.config, placement="contiguous")
        batch = collator(docs)
        held = int((batch["input_ids"] == collator.media.token_ids["image"]).sum())
        results[model_type] = (held, _cp_step_errors(ours, batch, collator, docs, alone))
    return results


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_rank_without_image_tokens():
    types = ("qwen3_vl", "gemma3", "llava")
    results = run_ranks(_no_image_tokens_worker, 2, types, timeout=240)
    for model_type in types:
        assert results[0][model_type][0] > 0 and results[1][model_type][0] == 0, (model_type, results)
        for res in results:
            assert max(res[model_type][1].values()) < 1e-4, (model_type, res[model_type])


@pytest.mark.parametrize("model_type", ["qwen2_5_vl", "gemma3", "idefics3", "mistral3"])
def test_several_rows_at_cp1(model_type):
    """Rows just longer than the longest document: the collator's [B, S] batch (images of every row in row order,
    [4, B, S] positions, blocks per row) against each document alone."""
    config = tiny_vlm_config(model_type)
    docs = synthetic_documents(config, num_docs=5, seed=7, images=(1, 2, 0))
    stock, ours = build_vlm(config, "sdpa"), build_vlm(config, OURS)
    ours.load_state_dict(stock.state_dict())
    alone = documents_alone(stock, docs)
    length = -(-max(len(d["input_ids"]) for d in docs) // 8) * 8
    collator = bd.PackingCollator(length, pad_token_id=0, model_config=ours.config)
    batch = collator(docs)
    assert batch["input_ids"].shape[0] > 1
    out = ours(**batch)
    (out.loss * batch["num_items_in_batch"]).backward()
    logits = [None] * len(docs)
    for r, row in enumerate(collator.pack(docs)):
        start = 0
        for d in row.documents:
            logits[d.index] = out.logits[r, start:start + len(d)].detach()
            start += len(d)
    grads = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    err = compare(logits, out.loss.detach() * batch["num_items_in_batch"], grads, alone)
    assert max(err.values()) < 1e-4, (model_type, err)


def _nan_worker(rank: int, world: int, types: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """NaN pixels in one document's image at CP = 2 (balanced, an image cut between the ranks): every other
    document's logits stay those of the document alone; the poisoned document's are not finite."""
    import torch.distributed as dist

    results = {}
    for model_type in types:
        spec, placement, length = _straddling_case(model_type, world)
        stock, ours, docs, alone = _setup(model_type, spec)
        poisoned = next(i for i, d in enumerate(docs) if "pixel_values" in d)
        nan = torch.full_like(docs[poisoned]["pixel_values"], float("nan"))
        docs[poisoned] = {**docs[poisoned], "pixel_values": nan}
        collator = bd.PackingCollator(length, group=dist.group.WORLD, pad_token_id=0, model_config=ours.config,
                                      placement=placement)
        batch = collator(docs)
        with torch.no_grad():
            logits = ours(**batch).logits[0]
        owner = torch.cat([torch.full((len(d),), d.index) for d in collator.pack(docs)[0].documents])
        ref = torch.cat([alone.logits[i] for i in _packed_order(collator, docs)])
        local = batch["cp_context"].local_index
        real = local < ref.shape[0]
        mine = owner[local[real]]
        clean = mine != poisoned
        got, want = logits[real], ref[local[real]]
        err = float((got[clean] - want[clean]).abs().max() / ref.abs().max()) if clean.any() else 0.0
        finite = float(bool(torch.isfinite(got[~clean]).all())) if (~clean).any() else 0.0
        results[model_type] = {"clean": err, "poisoned_finite": finite}
    dist.barrier()
    return results


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_nan_pixels_stay_in_their_document():
    types = ("qwen2_5_vl", "llava", "gemma3")
    for rank, res in enumerate(run_ranks(_nan_worker, 2, types, timeout=240)):
        for model_type in types:
            assert res[model_type]["clean"] < 1e-5, (rank, model_type, res[model_type])
            assert res[model_type]["poisoned_finite"] == 0.0, (rank, model_type, res[model_type])
