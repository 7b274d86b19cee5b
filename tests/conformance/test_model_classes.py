"""One regression test per class of the architecture sweep (issue 12): every class is either computed
exactly (packed documents vs each document alone under stock attention) or refused with an error
naming the cause. Tiny models come from ``hf_blockdiag_cp.conformance.tiny_config``; the reference is the
unmodified model run on one document at a time."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp import BlockDiagCPContext
from hf_blockdiag_cp.attention.mask_spec import describe_mask_function
from hf_blockdiag_cp.conformance import (
    build_model,
    check_generate,
    make_documents,
    packed_inputs,
    packed_run,
    reference_run,
    tiny_config,
)
from hf_blockdiag_cp.integration import blockdiag_cp_attention, blockdiag_cp_mask
from tests.reference import dense_reference

ATOL = 1e-4


def _pair(model_type: str, **overrides):
    """Stock model and the same weights under blockdiag_cp, plus documents."""
    config = tiny_config(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    ours.load_state_dict(stock.state_dict())
    return stock, ours, make_documents(config)


def _assert_exact(model_type: str, variant: str = "position_ids", **overrides) -> None:
    stock, ours, docs = _pair(model_type, **overrides)
    ref_logits, ref_grads = reference_run(stock, docs)
    logits, grads = packed_run(ours, docs, packed_inputs(docs, variant))
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=ATOL * max(1.0, float(g.abs().max())), rtol=0,
                                   msg=lambda m, n=name: f"{n}: {m}")


def _refusal(model_type: str, variant: str = "position_ids") -> str:
    _, ours, docs = _pair(model_type)
    with pytest.raises(NotImplementedError) as info:
        packed_run(ours, docs, packed_inputs(docs, variant))
    return str(info.value)


# 1. Boundaries from transformers' own packed detection (models that do not pass position_ids down).

@pytest.mark.parametrize("model_type", ["ctrl", "persimmon", "gpt_bigcode"])
def test_models_dropping_position_ids_keep_documents_apart(model_type):
    _assert_exact(model_type)


def test_mask_hook_reads_packed_boundaries_from_the_mask_function():
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        packed_sequence_mask_function,
        remap_positions_for_packed_sequence,
    )

    packed = torch.tensor([[0, 0, 0, 1, 1, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0]])
    fn = and_masks(remap_positions_for_packed_sequence(causal_mask_function, positions),
                   packed_sequence_mask_function(packed))
    mask = blockdiag_cp_mask(1, 6, 6, mask_function=fn)
    assert mask.spec.causal and mask.spec.refusal is None and torch.equal(mask.spec.packed, packed)
    # The layer needs no position_ids: the boundaries come with the mask.
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    out, _ = blockdiag_cp_attention(torch.nn.Module(), q, k, v, mask)
    alone = blockdiag_cp_attention(torch.nn.Module(), q[:, :, 3:5], k[:, :, 3:5], v[:, :, 3:5], None)[0]
    torch.testing.assert_close(out[0, 3:5], alone[0], atol=1e-6, rtol=0)


# 2. Mask restrictions: chunked attention is implemented, anything not a restriction is refused.

def test_llama4_chunked_attention_is_exact():
    _assert_exact("llama4_text")
    _assert_exact("llama4_text", variant="collator")


def test_chunked_attention_changes_the_result():
    """The chunk restriction is really applied (the same model without chunks gives other logits)."""
    stock, ours, docs = _pair("llama4_text")
    chunked, _ = packed_run(ours, docs, packed_inputs(docs, "position_ids"))
    _, unchunked_model, _ = _pair("llama4_text", attention_chunk_size=10_000)
    unchunked_model.load_state_dict(stock.state_dict())
    unchunked, _ = packed_run(unchunked_model, docs, packed_inputs(docs, "position_ids"))
    assert float((chunked - unchunked).abs().max()) > 1e-3


def test_bidirectional_masks_are_refused():
    from transformers.masking_utils import bidirectional_mask_function

    mask = blockdiag_cp_mask(1, 4, 4, mask_function=bidirectional_mask_function)
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="bidirectional"):
        blockdiag_cp_attention(torch.nn.Module(), q, q, q, mask)


def test_unknown_or_union_mask_functions_are_refused():
    from transformers.masking_utils import and_masks, causal_mask_function, or_masks

    def image_blocks(b, h, q, kv):
        return q == kv

    assert "union" in describe_mask_function(or_masks(causal_mask_function, image_blocks)).refusal
    assert "image_blocks" in describe_mask_function(and_masks(causal_mask_function, image_blocks)).refusal
    mask = blockdiag_cp_mask(1, 4, 4, mask_function=or_masks(causal_mask_function, image_blocks))
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="union of patterns"):
        blockdiag_cp_attention(torch.nn.Module(), q, q, q, mask)


# 3. Model code that consumes the mask itself.

@pytest.mark.parametrize("model_type", ["doge", "axk2"])
def test_models_reading_the_mask_are_refused_by_name(model_type):
    assert f"{model_type} reads the attention mask itself" in _refusal(model_type)


def test_mask_object_refuses_tensor_use_with_the_model_name():
    from transformers import LlamaConfig

    mask = blockdiag_cp_mask(1, 4, 4, config=LlamaConfig())
    for use in (lambda m: m[:, :, :2], lambda m: torch.zeros(1) + m, lambda m: m.size(), lambda m: m.dtype):
        with pytest.raises(NotImplementedError, match="llama reads the attention mask itself"):
            use(mask)


# 4. Accepted but never called.

@pytest.mark.parametrize("model_type", ["openai-gpt", "xlnet", "bloom"])  # falcon routes through it since 5.25
def test_models_bypassing_the_attention_interface_are_refused_at_load(model_type):
    config = tiny_config(model_type)
    build_model(config, None)  # the stock model builds
    with pytest.raises(NotImplementedError, match="does not route attention through transformers' AttentionInterface"):
        build_model(config, "blockdiag_cp")


def test_attention_never_called_in_a_packed_forward_is_refused(monkeypatch):
    """The runtime backstop for models the load-time heuristic misses: mamba has no attention at all;
    with its per-document scans removed and its refusal switched off, the packed forward must still be refused."""
    from hf_blockdiag_cp.mixer_hooks import uninstall_recurrent
    from hf_blockdiag_cp.model import prepare

    monkeypatch.setattr(prepare, "packing_refusal", lambda model: None)
    stock, ours, docs = _pair("mamba")
    uninstall_recurrent(ours)
    ids = docs[2][None]
    torch.testing.assert_close(ours(ids).logits, stock(ids).logits, atol=1e-6, rtol=0)  # unpacked: fine
    with pytest.raises(NotImplementedError, match="never called it in a forward with packed position_ids"):
        packed_run(ours, docs, packed_inputs(docs, "position_ids"))


# 5. Other sequence mixers; 6. positions counted from the row start.

MIXES = "carry state across the whole row"
ROW_POSITIONS = "forward takes no position_ids"


@pytest.mark.parametrize("model_type,cause", [("inkling2_text", MIXES), ("bart", ROW_POSITIONS),
                                              ("marian", ROW_POSITIONS)])
def test_models_that_mix_documents_outside_attention_are_refused(model_type, cause):
    message = _refusal(model_type)
    assert model_type in message and cause in message


@pytest.mark.parametrize("model_type,missing", [
    ("inkling2_text", "inkling2_text's dynamic short convolution with per-token taps, outside transformers' "
                      "replaceable causal_conv1d functions (Inkling2DynamicShortConvolution at "
                      "model.layers.1.self_attn.k_proj.sconv) has no per-document reset"),
])
def test_refusal_names_the_mixer_that_is_missing(model_type, missing):
    assert missing in _refusal(model_type)


def test_refused_mixers_still_run_one_document_per_row():
    stock, ours, docs = _pair("bamba")
    ids = docs[2][None]
    torch.testing.assert_close(ours(ids, use_cache=False).logits, stock(ids, use_cache=False).logits,
                               atol=1e-5, rtol=0)


def test_mixers_refuse_context_parallel_shards_even_with_one_document():
    _, ours, docs = _pair("inkling2_text")
    ids = docs[2][None]
    ctx = BlockDiagCPContext.build(torch.ones(ids.shape[1] - 1, dtype=torch.long), cp_rank=0, cp_size=1)
    object.__setattr__(ctx, "cp_size", 2)  # what a CP rank's context looks like to the model-level guard
    with pytest.raises(NotImplementedError, match="context-parallel shard"):
        ours(ids[:, :-1], cp_context=ctx, use_cache=False)


# 7. Logit softcapping and attention sinks: exact per-document CPU kernels (sdpa_doc's chunked path).

@pytest.mark.parametrize("model_type", ["gpt_oss", "gemma2"])
def test_sinks_and_softcap_models_are_exact(model_type):
    _assert_exact(model_type)
    _assert_exact(model_type, variant="collator")


# 8. Keywords that change attention are refused, bookkeeping keywords are not.

@pytest.mark.parametrize("name,meaning", [("position_bias", "additive position bias"), ("sinks", "sinks"),
                                          ("indices", "does not serve per document"), ("block_indices", "sparse"),
                                          ("head_mask", "head mask"), ("alibi", "does not know")])
def test_attention_changing_keywords_are_refused(name, meaning):
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match=f"{name}=.*{meaning}"):
        blockdiag_cp_attention(torch.nn.Module(), q, q, q, None, **{name: torch.zeros(1)})


def test_bookkeeping_keywords_are_accepted():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=gen) for _ in range(3))  # [B, H, L, D]
    out, weights = blockdiag_cp_attention(torch.nn.Module(), q, k, v, None, num_items_in_batch=3,
                                          seq_idx=torch.zeros(1, 4), use_cache=False, output_hidden_states=True,
                                          position_bias=None, shift_labels=q)
    # The keywords change nothing: one causal document, as the float64 brute force computes it.
    expected = dense_reference(q, k, v, [1, 1, 1, 1]).transpose(1, 2)  # [B, L, H, D]
    torch.testing.assert_close(out, expected.float(), atol=1e-6, rtol=0)
    assert weights is None


# 9. A layer whose is_causal flag is stale while its mask is causal.

def test_bigbird_pegasus_decoder_is_not_falsely_refused():
    """Its decoder attention says is_causal=False but gets a causal mask: one document per row is served
    (packing is refused for it for another reason: learned positions counted from the row start)."""
    stock, ours, docs = _pair("bigbird_pegasus")
    assert not any(getattr(m, "is_causal", True) for m in ours.modules() if type(m).__name__.endswith("Attention"))
    ref_logits, ref_grads = reference_run(stock, docs[2:3])
    logits, grads = packed_run(ours, docs[2:3], {"input_ids": docs[2][None]})
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    assert check_generate(stock, ours, tiny_config("bigbird_pegasus"), seed=0) == "equal"


def test_packed_keywords_without_position_ids():
    """cu_seq_lens alone: exact for rotary positions (relative), refused for absolute position embeddings."""
    def cu_only(docs):
        inputs = packed_inputs(docs, "cu_seq_lens")
        del inputs["position_ids"]
        return inputs

    stock, ours, docs = _pair("llama")
    ref_logits, _ = reference_run(stock, docs)
    logits, _ = packed_run(ours, docs, cu_only(docs))
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    _, ours, docs = _pair("gpt2")
    with pytest.raises(NotImplementedError, match="absolute position embeddings but this packed batch has no"):
        packed_run(ours, docs, cu_only(docs))
