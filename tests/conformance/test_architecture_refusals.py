"""Issue 17: the three architectures the sweep found silently wrong are refused with their cause.

- stablelm / nemotron: their decoder layers call ``self_attn`` without the model's ``**kwargs``, so at
  CP = 2 the ``cp_context`` never reaches attention through the keywords; since issue 24 the attention takes the
  context the model's forward was given (held by its pre-hook), and they are exact.
- deepseek_v4: its attention appends compressed keys (more keys than queries without a cache): refused
  with that cause, also with a ``cp_context`` and in left-padded ``generate()``.
- whisper (causal LM): its own loss ignores ``shift_labels`` / ``num_items_in_batch``: refused when the
  batch carries them (logits alone stay exact: tests/conformance/test_conformance.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.model.detect import loss_refusal
from tests.launch import run_ranks
from tests.reference import documents_alone

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LENGTHS = (7, 12, 5, 9)
APPENDS_KEYS = "appends keys of its own"


def _docs(vocab: int = 97) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _build(config: transformers.PretrainedConfig, model_cls: type) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_cls(config).eval()
    model.set_attn_implementation("blockdiag_cp")
    return model


def _stablelm() -> torch.nn.Module:
    return _build(transformers.StableLmConfig(**TINY), transformers.StableLmForCausalLM)


def _nemotron() -> torch.nn.Module:
    return _build(transformers.NemotronConfig(**TINY, head_dim=16), transformers.NemotronForCausalLM)


def _llama() -> torch.nn.Module:
    return _build(transformers.LlamaConfig(**TINY), transformers.LlamaForCausalLM)


def _deepseek_v4() -> torch.nn.Module:
    config = transformers.DeepseekV4Config(
        vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, q_lora_rank=32, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, sliding_window=6, o_groups=8, o_lora_rank=32, index_n_heads=4, index_head_dim=16,
        qk_rope_head_dim=8, max_position_embeddings=256,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _build(config, transformers.DeepseekV4ForCausalLM)


def _whisper() -> torch.nn.Module:
    config = transformers.WhisperConfig(
        vocab_size=97, d_model=64, encoder_layers=1, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=8,
        max_source_positions=32, max_target_positions=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1)
    return _build(config, transformers.WhisperForCausalLM)


def _collated(model: torch.nn.Module, *, group=None) -> dict:
    collator = bd.PackingCollator(sum(LENGTHS) + 1, group=group, pad_token_id=0,
                                  config=bd.BlockDiagCPConfig(collective_timeout_s=30))
    return collator([{"input_ids": d.tolist()} for d in _docs()])


# ---------------------------------------------------------------- stablelm / nemotron at CP = 2


def _drop_worker(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist

    outcome = {}
    for name, build in (("stablelm", _stablelm), ("nemotron", _nemotron), ("llama", _llama)):
        model = build()
        alone = documents_alone(name, _docs(), model, backward=False).logits
        batch = _collated(model, group=dist.group.WORLD)
        ctx = batch["cp_context"]
        out = model(**batch)
        out.loss.backward()
        real = ctx.doc_ids[0, ctx.local_index] != 0
        err = (out.logits[0][real] - alone[ctx.local_index[real]]).abs().max().item()
        outcome[name] = "exact" if err < 1e-4 else f"logits differ by {err:.2e}"
    return outcome


@pytest.mark.slow
def test_layers_that_drop_cp_context_are_exact_at_cp2():
    """Issue 24: their attention layers get the context the model's forward was given (held by its pre-hook)."""
    outcomes = run_ranks(_drop_worker, 2, timeout=240)
    for rank, outcome in enumerate(outcomes):
        for name in ("stablelm", "nemotron", "llama"):
            assert outcome[name] == "exact", (rank, name, outcome[name])


@pytest.mark.parametrize("build", [_stablelm, _nemotron])
def test_layers_that_drop_cp_context_stay_exact_at_cp1(build):
    model = build()
    docs = _docs()
    alone = documents_alone(model.config.model_type, docs, model, backward=False).logits
    with torch.no_grad():
        batch = _collated(model)
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                       cp_context=batch["cp_context"], use_cache=False).logits[0, : sum(LENGTHS)]
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------- deepseek_v4: keys appended by the model


@pytest.fixture(scope="module")
def deepseek_v4() -> torch.nn.Module:
    return _deepseek_v4()


def test_deepseek_v4_packed_position_ids_refused(deepseek_v4):
    docs = _docs()
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with pytest.raises(NotImplementedError, match=APPENDS_KEYS):
        deepseek_v4(input_ids=ids, position_ids=positions, use_cache=False)


def test_deepseek_v4_single_document_refused(deepseek_v4):
    with pytest.raises(NotImplementedError, match=APPENDS_KEYS):  # wrong even unpacked (logits 0.58 off)
        deepseek_v4(input_ids=_docs()[1][None], use_cache=False)


def test_deepseek_v4_collator_refused_with_its_cause_not_a_kv_cache(deepseek_v4):
    batch = _collated(deepseek_v4)
    with pytest.raises(NotImplementedError, match=APPENDS_KEYS) as caught:
        deepseek_v4(**batch)
    assert "KV cache" not in str(caught.value).split("(")[0]


def test_deepseek_v4_left_padded_generate_refused_cleanly(deepseek_v4):
    prompt = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0
    with pytest.raises(NotImplementedError, match=APPENDS_KEYS):
        deepseek_v4.generate(prompt, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)


# ---------------------------------------------------------------- whisper: a loss that ignores shift_labels


def test_whisper_loss_that_ignores_shift_labels_is_refused():
    model = _whisper()
    assert "computes its loss itself" in (loss_refusal(model) or "")
    batch = _collated(model)
    assert batch.get("shift_labels") is not None
    with pytest.raises(NotImplementedError, match="whisper cannot take shift_labels"):
        model(**batch)
    docs = _docs()
    ids = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs])[None]
    with pytest.raises(NotImplementedError, match="labels with packed position_ids"):
        model(input_ids=ids, position_ids=positions, labels=ids)
    # Logits alone (the loss computed by the caller from shift_labels) are still served, exactly.
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0]
    alone = documents_alone(model.config.model_type, docs, model, backward=False).logits
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2", "mistral", "gemma3_text", "stablelm", "gpt_neox", "bert"])
def test_models_using_loss_function_are_not_refused(name):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[name])
    model = cls.__new__(cls)  # loss_refusal reads the class and its forward's source only
    torch.nn.Module.__init__(model)
    assert loss_refusal(model) is None


def test_gemma3n_row_padding_with_its_zero_embedding_token_is_refused_and_another_pad_id_is_exact():
    """The CP = 2 sweep found gemma3n's gradients NaN: the padding the collator adds (token 0, the embedding's
    zero ``padding_idx`` row) attends to nothing, keeps a constant hidden state, and activation sparsity's
    standard deviation has a NaN gradient there. Refused with that cause; padding with another id is exact."""
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model, grad_error, make_documents, packed_run, reference_run
    from hf_blockdiag_cp.data import Document, PackedRow

    config = tiny_config("gemma3n_text")
    stock = build_model(config, None, 0)
    ours = build_model(config, "blockdiag_cp", 0)
    ours.load_state_dict(stock.state_dict())
    docs = make_documents(config, 0)
    ref_logits, ref_grads = reference_run(stock, docs)
    row = PackedRow(tuple(Document(d, d.clone(), 0, i) for i, d in enumerate(docs)))
    seq_len = sum(len(d) for d in docs) + 3  # three padding tokens at the end of the row
    for pad in (0, 2):
        batch = bd.PackingCollator(seq_len, pad_token_id=pad)([row])
        inputs = {k: batch[k] for k in ("input_ids", "position_ids", "cp_context")}
        if pad == 0:
            with pytest.raises(NotImplementedError, match=r"row padding with token 0.*activation sparsity"):
                packed_run(ours, docs, inputs)
            continue
        logits, grads = packed_run(ours, docs, inputs)
        assert all(torch.isfinite(g).all() for g in grads.values())
        assert float((logits - ref_logits).abs().max()) <= 1e-5
        assert grad_error(grads, ref_grads) <= 1e-4
