"""``bd.chunked_causal_lm_loss`` against the model's own loss (fp32: loss 1e-6 relative, every parameter's gradient
1e-5 relative in norm), per accepted head; refusals; memory (no ``[L, V]`` tensor, measured op by op); and a CP = 2
step on gloo (through DDP, loss normalised by ``normalize_num_items``) against the documents run alone."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.training.chunked_loss import HEADS
from tests.launch import run_ranks
from tests.memory import TensorMemory
from tests.reference import TINY, tiny_model


def _model(kind: str) -> torch.nn.Module:
    """Tiny fp32 models with each accepted head (weights of the head scaled up so softcap / scaling matter)."""
    import transformers

    torch.manual_seed(0)
    common = {**TINY, "head_dim": 16}
    if kind in ("llama", "qwen2"):
        model = tiny_model(kind)
    elif kind == "tied":
        model = tiny_model("llama", tie_word_embeddings=True)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    elif kind == "bias":
        model = tiny_model("llama")
        model.lm_head = torch.nn.Linear(TINY["hidden_size"], TINY["vocab_size"], bias=True)
    elif kind == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, final_logit_softcapping=2.0, attn_logit_softcapping=None, sliding_window=8))
    elif kind == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(**common, logit_scale=0.3))
    elif kind == "granite":
        model = transformers.GraniteForCausalLM(transformers.GraniteConfig(**common, logits_scaling=3.0))
    elif kind == "lora":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(tiny_model("llama"), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj", "lm_head"]))
        for name, p in model.named_parameters():
            if "lora_B" in name:  # LoRA starts at B = 0: make the adapters change the logits
                torch.nn.init.normal_(p, std=0.5)
    else:
        raise KeyError(kind)
    model.set_attn_implementation("eager")  # gemma2 has no sdpa; the attention is not what is compared
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # logits of a few units: the softcap bends them
    return model.train()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _assert_same(own: torch.Tensor, chunked: torch.Tensor, g_own: dict, g_chunked: dict, what: str) -> None:
    assert abs(chunked.item() - own.item()) <= 1e-6 * abs(own.item()), f"{what}: loss {chunked.item()} vs {own.item()}"
    assert g_own.keys() == g_chunked.keys(), f"{what}: different parameters got gradients"
    for name, g in g_own.items():
        err = (g_chunked[name] - g).norm() / g.norm().clamp_min(1e-30)
        assert err <= 1e-5, f"{what}: gradient of {name} off by {err:.2e} (relative, norm)"


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "cohere", "granite", "tied", "bias", "lora"])
@pytest.mark.parametrize("targets", ["labels", "shift_labels+num_items"])
def test_chunked_loss_equals_the_models_own(kind, targets):
    model = _model(kind)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, TINY["vocab_size"], (2, 37), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100  # a prompt without targets
    batch = {"input_ids": ids, "use_cache": False}
    if targets == "labels":
        batch["labels"] = labels
    else:  # as the package's collator: pre-shifted targets, a count from elsewhere (e.g. N / W)
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        batch.update(labels=labels, shift_labels=shift, num_items_in_batch=torch.tensor(123.0, dtype=torch.float64))
    own = model(**batch).loss
    own.backward()
    g_own = _grads(model)
    chunked = bd.chunked_causal_lm_loss(model, batch, chunk_size=16)  # 74 tokens: 5 chunks, the last short
    chunked.backward()
    _assert_same(own, chunked, g_own, _grads(model), kind)
    if kind == "gemma2":  # the softcap really bends these logits (else an ignored cap could pass)
        with torch.no_grad():
            raw = model.lm_head(model.model(input_ids=ids).last_hidden_state)
        assert raw.abs().max() > 2 * model.config.final_logit_softcapping


def test_head_table_matches_transformers_sources():
    """Each accepted class's forward does exactly what HEADS says between ``lm_head`` and its only loss term:
    fails when transformers changes a head (or adds a loss term) upstream."""
    import transformers

    expected = {
        "identity": "",
        "final_logit_softcapping": "if self.config.final_logit_softcapping is not None: logits = logits / "
                                   "self.config.final_logit_softcapping logits = torch.tanh(logits) logits = logits * "
                                   "self.config.final_logit_softcapping",
        "logit_scale": "logits = logits * self.logit_scale",
        "logits_scaling": "logits = logits / self.config.logits_scaling",
    }
    for name, kind in HEADS.items():
        source = inspect.getsource(getattr(transformers, name).forward)
        source = re.sub(r"#[^\n]*", "", source)
        head = re.search(r"logits = self\.lm_head\(hidden_states\)(.*?)loss = None", source, re.S)
        assert head is not None, name
        assert " ".join(head.group(1).split()) == expected[kind], f"{name}: {head.group(1)!r}"
        assert source.count("self.loss_function(") == 1 and "aux_loss" not in source, name
        assert "hidden_states = outputs.last_hidden_state" in source, name
        assert re.search(r"outputs(: \w+)? = self\.model\(", source), name  # the body whose output is hooked
        assert "slice_logits_to_keep(hidden_states, logits_to_keep)" in source, name


def test_refusals_name_the_model():
    import transformers

    mixtral = transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY, num_local_experts=2))
    with pytest.raises(NotImplementedError, match="MixtralForCausalLM"):
        bd.chunked_causal_lm_loss(mixtral, {"input_ids": torch.ones(1, 4, dtype=torch.long)})

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    with pytest.raises(NotImplementedError, match="MyLlama"):
        bd.check_chunked_loss(MyLlama(transformers.LlamaConfig(**TINY)))
    model = tiny_model("llama")
    model.lm_head = torch.nn.Sequential(torch.nn.Linear(TINY["hidden_size"], TINY["vocab_size"]))
    with pytest.raises(NotImplementedError, match="LlamaForCausalLM.lm_head is a Sequential"):
        bd.check_chunked_loss(model)
    model = tiny_model("llama")
    model.loss_function = lambda *a, **k: 0.0
    with pytest.raises(NotImplementedError, match="ForCausalLMLoss"):
        bd.check_chunked_loss(model)
    with pytest.raises(ValueError, match="chunk_size"):
        bd.chunked_causal_lm_loss(tiny_model("llama"), {"input_ids": torch.ones(1, 4, dtype=torch.long)}, chunk_size=0)


@pytest.mark.slow
def test_no_tensor_of_L_by_V_exists():
    """L = 1,024, V = 32,000, hidden 64: every tensor any op creates in forward + backward is recorded
    (tests/memory.py), as are the tensors saved for backward. The model's own loss is measured the same way and
    must show the ``[L, V]`` logits (so the measurement can fail); the chunked loss never builds more than one
    chunk's ``[chunk, V]``, and its peak of live tensors is a fraction of the own loss's."""
    import transformers

    length, vocab, chunk = 1024, 32000, 128
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **{**TINY, "vocab_size": vocab, "num_hidden_layers": 1, "max_position_embeddings": length})).train()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, vocab, (1, length))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False}
    results = {}
    for name, loss_fn in (("own", lambda: model(**batch).loss),
                          ("chunked", lambda: bd.chunked_causal_lm_loss(model, batch, chunk_size=chunk))):
        saved: list[int] = []
        with TensorMemory() as mem:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t.numel()), t)[1], lambda t: t):
                loss = loss_fn()
            loss.backward()
        model.zero_grad(set_to_none=True)
        results[name] = (mem.peak_bytes, mem.largest_numel, max(saved))
    own, chunked = results["own"], results["chunked"]
    assert own[1] >= length * vocab and own[2] >= length * vocab  # the reference does hold [L, V]
    assert chunked[1] <= chunk * vocab and chunked[2] < chunk * vocab, results
    assert chunked[0] * 4 < own[0], results


def _cp_worker(rank: int, world: int, lengths: list[int]) -> float:
    from tests.reference import documents_alone, tiny_model

    gen = torch.Generator().manual_seed(7)
    docs = [torch.randint(1, TINY["vocab_size"], (n,), generator=gen) for n in lengths]
    # Reference: each document alone through stock sdpa, the mean next-token loss over all documents.
    ref = tiny_model("llama", attn_implementation="sdpa")
    ref_loss = documents_alone("llama", docs, ref).loss
    model = tiny_model("llama", attn_implementation="blockdiag_cp").train()
    mesh = bd.init_device_mesh(cp_size=2)
    collator = bd.PackingCollator(96, group=mesh["cp"], pad_token_id=0, placement="balanced",
                                  config=bd.BlockDiagCPConfig(collective_timeout_s=60))
    batch = bd.normalize_num_items(collator([{"input_ids": d.tolist()} for d in docs]), mesh)  # N / W
    # Through DDP, as in training: its gradient average over the W ranks gives the global token mean.
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    loss = bd.chunked_causal_lm_loss(ddp, batch, chunk_size=10)  # 48 local tokens: chunks cross documents
    loss.backward()
    total = bd.reduce_loss_for_logging(loss, mesh)
    for name, p in model.named_parameters():
        err = (p.grad - dict(ref.named_parameters())[name].grad).norm() / p.grad.norm()
        assert err <= 1e-5, f"rank {rank}: gradient of {name} off by {err:.2e} vs documents alone"
    assert abs(total.item() - ref_loss) <= 1e-5 * ref_loss, (total.item(), ref_loss)
    return total.item()


@pytest.mark.slow
@pytest.mark.distributed
def test_cp2_step_equals_documents_alone():
    losses = run_ranks(_cp_worker, 2, [9, 40, 1, 17, 6, 12, 11], timeout=180)
    assert losses[0] == losses[1]
