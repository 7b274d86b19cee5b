"""Acceptance 2-3 (core): tiny Llama / Qwen2 (sliding window) / Mistral with attn_implementation
"blockdiag_cp" on packed rows equal each document run alone with the stock implementation, logits
and parameter gradients; generate() gives the same tokens as "sdpa"."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp
from hf_blockdiag_cp import BlockDiagCPContext
from hf_blockdiag_cp.attention.mask import BlockDiagMask
from tests.reference import tiny_model

LENGTHS = [7, 1, 12, 4, 9]  # 12 and 9 exceed the Qwen2 (5) and Mistral (6) sliding windows


def _docs(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 97, (n,), generator=gen) for n in LENGTHS]


def _reference(kind: str, docs: list[torch.Tensor], reference_impl: str):
    """Logits of each document alone (stock attention) and the gradients of their summed loss."""
    model = tiny_model(kind, attn_implementation=reference_impl)
    logits = [model(d[None], use_cache=False).logits[0] for d in docs]
    loss = sum(_loss(lg, d) for lg, d in zip(logits, docs))
    loss.backward()
    return torch.cat(logits).detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _loss(logits: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document (a packed run must not predict across documents)."""
    return torch.nn.functional.cross_entropy(logits[:-1], doc[1:], reduction="sum")


def _packed_run(kind: str, docs: list[torch.Tensor], **packing_kwargs):
    model = tiny_model(kind, attn_implementation="blockdiag_cp")
    ids = torch.cat(docs)[None]
    logits = model(ids, use_cache=False, **packing_kwargs).logits[0]
    bounds = torch.tensor([0] + LENGTHS).cumsum(0).tolist()
    loss = sum(_loss(logits[a:b], d) for a, b, d in zip(bounds, bounds[1:], docs))
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _position_ids() -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in LENGTHS])[None]


def _cu_kwargs() -> dict:
    cu = torch.tensor([0] + LENGTHS).cumsum(0).to(torch.int32)
    return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(LENGTHS), max_length_k=max(LENGTHS),
                position_ids=_position_ids())


def _context_kwargs() -> dict:
    doc_ids = torch.repeat_interleave(torch.arange(1, len(LENGTHS) + 1), torch.tensor(LENGTHS))
    return dict(cp_context=BlockDiagCPContext.build(doc_ids), position_ids=_position_ids())


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("reference_impl", ["sdpa", "eager"])
@pytest.mark.parametrize("source", ["cu_seq_lens", "position_ids", "cp_context"])
def test_packed_equals_documents_alone(kind, reference_impl, source):
    docs = _docs()
    ref_logits, ref_grads = _reference(kind, docs, reference_impl)
    kwargs = {"cu_seq_lens": _cu_kwargs, "position_ids": lambda: dict(position_ids=_position_ids()),
              "cp_context": _context_kwargs}[source]()
    logits, grads = _packed_run(kind, docs, **kwargs)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert ref_grads.keys() == grads.keys()
    for name in ref_grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_unpacked_padded_batch_matches_sdpa():
    """A right-padded batch with a 2-D attention mask: padding must not leak (the mask hook)."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (2, 10), generator=gen)
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    ref = tiny_model("llama", attn_implementation="sdpa")(ids, attention_mask=mask, use_cache=False).logits
    got = tiny_model("llama", attn_implementation="blockdiag_cp")(ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, :6], ref[1, :6], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_matches_sdpa(kind, cache):
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 97, (2, 7), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :3] = 0  # left padding, as generate() expects
    outputs = {}
    for impl in ("sdpa", "blockdiag_cp"):
        model = tiny_model(kind, attn_implementation=impl)
        outputs[impl] = model.generate(prompt, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                       pad_token_id=0, cache_implementation=cache)
    assert torch.equal(outputs["sdpa"], outputs["blockdiag_cp"])


def test_from_pretrained_with_blockdiag_cp(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=hf_blockdiag_cp.ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == "blockdiag_cp"
    docs = _docs()
    out = model(torch.cat(docs)[None], position_ids=_position_ids(), use_cache=False).logits[0]
    ref = torch.cat([tiny_model("llama")(d[None], use_cache=False).logits[0] for d in docs])
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_register_is_idempotent_and_registers_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    hf_blockdiag_cp.register()
    hf_blockdiag_cp.register()
    assert hf_blockdiag_cp.ATTN_IMPLEMENTATION == "blockdiag_cp"
    assert AttentionInterface._global_mapping["blockdiag_cp"] is hf_blockdiag_cp.blockdiag_cp_attention
    mask_fn = AttentionMaskInterface._global_mapping["blockdiag_cp"]
    info = mask_fn(batch_size=2, q_length=4096, kv_length=4096, attention_mask=torch.ones(2, 4096, dtype=torch.bool))
    # No dense [B, 1, L, S] mask: only the 2-D padding view travels to the layers.
    assert isinstance(info, BlockDiagMask) and info.padding_mask.shape == (2, 4096)


def test_gradient_checkpointing_and_dropout_run():
    model = tiny_model("llama", attn_implementation="blockdiag_cp", attention_dropout=0.1)
    model.activation_checkpointing_enable()
    model.train()
    out = model(torch.cat(_docs())[None], labels=torch.cat(_docs())[None], use_cache=False, **_context_kwargs())
    out.loss.backward()
    assert torch.isfinite(out.loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())
