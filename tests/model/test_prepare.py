"""Issue 16, model preparation: one owner (``prepare_model``) installs one ordered hook pair, whatever is
called in which order; a guarded GPT-2 (absolute positions) gets its per-document positions filled before the
refusals run; every transformers method the import wraps is installed and called."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import transformers
from transformers import GPT2Config, GPT2LMHeadModel

import hf_blockdiag_cp as bd
from hf_blockdiag_cp import integration as transformers_patches
from hf_blockdiag_cp.model import UnsupportedModel, package_hooks, prepare, prepare_model, unprepare_model
from tests.reference import documents_alone, tiny_model

LENGTHS = (7, 3, 11, 5)  # one packed row of 26 tokens, no padding


def _gpt2(attn_implementation: str, seed: int = 0) -> GPT2LMHeadModel:
    """A tiny GPT-2 built from its config (same weights for every implementation with the same seed)."""
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=97, n_positions=64, bos_token_id=1,
                        eos_token_id=1, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


def _docs() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 97, (n,), generator=gen) for n in LENGTHS]


def _packed_without_positions(docs: list[torch.Tensor]) -> dict:
    """A PackingCollator batch (cp_size=1) with its position_ids dropped: the context still knows them."""
    batch = bd.PackingCollator(sum(LENGTHS), cp_size=1, pad_token_id=0)([{"input_ids": d.tolist()} for d in docs])
    assert batch["cp_context"].local_position_ids is not None
    return {"input_ids": batch["input_ids"], "cp_context": batch["cp_context"]}


def _summed_loss(logits: torch.Tensor, docs: list[torch.Tensor]) -> torch.Tensor:
    """Sum over documents of their own next-token losses (``logits`` [sum(LENGTHS), V])."""
    loss, start = logits.new_zeros(()), 0
    for doc in docs:
        loss = loss + torch.nn.functional.cross_entropy(logits[start:start + len(doc) - 1], doc[1:], reduction="sum")
        start += len(doc)
    return loss


def _tree_hooks(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``name -> (pre, post)`` counts of the package's hooks on every module of ``model`` that has any."""
    counts = {name: tuple(map(len, package_hooks(sub))) for name, sub in model.named_modules()}
    return {name: c for name, c in counts.items() if c != (0, 0)}


# ---- acceptance: GPT-2 under guard_model -----------------------------------------------------------------

@pytest.mark.parametrize("reference_impl", ["eager", "sdpa"])
def test_guarded_gpt2_packed_without_position_ids_equals_documents_alone(reference_impl):
    docs = _docs()
    reference = _gpt2(reference_impl)
    ref_logits, ref_grads = documents_alone("gpt2", docs, reference, reduction="sum")

    model = bd.guard_model(_gpt2("blockdiag_cp"))  # prepared at construction, then guarded: the buggy order
    assert _tree_hooks(model) == {"": (1, 1)}
    logits = model(**_packed_without_positions(docs), use_cache=False).logits[0]
    _summed_loss(logits, docs).backward()

    torch.testing.assert_close(logits.detach(), ref_logits.detach(), atol=1e-5, rtol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_grads[name], atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_gpt2_without_guard_model_refuses_a_packed_batch_without_position_ids():
    model = _gpt2("blockdiag_cp")
    with pytest.raises(UnsupportedModel, match="gpt2 adds absolute position embeddings .*guard_model"):
        model(**_packed_without_positions(_docs()), use_cache=False)


def test_filling_runs_before_refusing_in_the_one_pre_hook(monkeypatch):
    """The refusal sees the arguments as filled: spy on it through the module it is looked up in."""
    seen = []
    original = prepare._refuse
    monkeypatch.setattr(prepare, "_refuse",
                        lambda m, p, a, k: seen.append(k.get("position_ids")) or original(m, p, a, k))
    batch = _packed_without_positions(_docs())
    bd.guard_model(_gpt2("blockdiag_cp"))(**batch, use_cache=False)
    assert len(seen) == 1 and torch.equal(seen[0], batch["cp_context"].local_position_ids)


# ---- one ordered pair, whatever the order of calls --------------------------------------------------------

def test_one_pair_after_load_guard_guard_and_switch_again():
    model = _gpt2("blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}  # GPT2Model's own pair (post_init runs inner first) was taken over
    bd.guard_model(model)
    assert _tree_hooks(model) == {"": (1, 1)}
    bd.guard_model(model)
    assert _tree_hooks(model) == {"": (1, 1)}
    model.set_attn_implementation("blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}
    model(**_packed_without_positions(_docs()), use_cache=False)  # still strict: the positions are filled


def test_one_pair_when_guarded_before_switching_to_blockdiag_cp():
    model = _gpt2("sdpa")
    assert _tree_hooks(model) == {}
    bd.guard_model(model)
    assert _tree_hooks(model) == {"": (1, 1)}
    with pytest.raises(ValueError, match="attn_implementation is 'sdpa'"):  # strict: the context would be ignored
        model(**_packed_without_positions(_docs()), use_cache=False)
    model.set_attn_implementation("blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}
    model(**_packed_without_positions(_docs()), use_cache=False)  # strict survived the switch


def test_one_pair_on_a_nested_llama_and_prepare_model_is_idempotent():
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}
    prepare_model(prepare_model(model))
    assert _tree_hooks(model) == {"": (1, 1)}
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1  # nobody else's hooks either


class _Wrapper(torch.nn.Module):
    """A module around a model (as a PEFT model is): not a PreTrainedModel."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, **kwargs):
        return self.inner(input_ids, position_ids=position_ids, **kwargs)


def test_a_guarded_wrapper_fills_before_the_wrapped_model_refuses_and_leaves_its_pair():
    docs = _docs()
    inner = _gpt2("blockdiag_cp")
    wrapper = bd.guard_model(_Wrapper(inner))
    assert _tree_hooks(wrapper) == {"": (1, 1), "inner": (1, 1)}
    logits = wrapper(**_packed_without_positions(docs), use_cache=False).logits[0]
    reference = _gpt2("eager")
    expected = documents_alone("gpt2", docs, reference, backward=False).logits
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0)
    with pytest.raises(UnsupportedModel, match="absolute position embeddings"):  # unwrapped: refuses again
        inner(**_packed_without_positions(docs), use_cache=False)


def test_unprepare_model_removes_everything_and_switching_prepares_again():
    model = bd.guard_model(_gpt2("blockdiag_cp"))
    assert unprepare_model(model) is model
    assert _tree_hooks(model) == {}
    assert not any(prepare.PROBE_ATTR in sub.__dict__ or prepare.PREPARATION_ATTR in sub.__dict__
                   for sub in model.modules())
    model.set_attn_implementation("blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}
    with pytest.raises(UnsupportedModel, match="absolute position embeddings"):  # not strict any more
        model(**_packed_without_positions(_docs()), use_cache=False)


# ---- the transformers methods the import wraps ------------------------------------------------------------

@pytest.mark.parametrize("qualified", sorted(transformers_patches.PATCHED_METHODS))
def test_wrapped_transformers_method_exists_and_is_ours(qualified):
    method = transformers_patches.patched_function(qualified)
    assert getattr(method, transformers_patches.WRAPPED_ATTR, False), f"transformers.{qualified} is not wrapped"
    assert method.__wrapped__.__module__ in ("transformers.modeling_utils", "transformers.configuration_utils")
    assert method.__wrapped__.__name__ == qualified.partition(".")[2]


def test_post_init_wrapper_is_called_by_from_config():
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    ours = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="blockdiag_cp")
    assert _tree_hooks(ours) == {"": (1, 1)}
    stock = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    assert _tree_hooks(stock) == {} and not any(prepare.PROBE_ATTR in m.__dict__ for m in stock.modules())


def test_set_attn_implementation_wrapper_prepares_a_switched_model():
    model = tiny_model("llama", attn_implementation="sdpa")  # tiny_model switches through set_attn_implementation
    assert _tree_hooks(model) == {}
    model.set_attn_implementation("blockdiag_cp")
    assert _tree_hooks(model) == {"": (1, 1)}


def test_check_and_adjust_wrapper_refuses_a_bypassing_model_at_load(monkeypatch):
    calls = []
    original = transformers_patches.refuse_bypassing_model
    monkeypatch.setattr(transformers_patches, "refuse_bypassing_model", lambda m: calls.append(m) or original(m))
    tiny_model("llama", attn_implementation="blockdiag_cp")
    assert calls, "transformers no longer calls _check_and_adjust_attn_implementation"
    config = transformers.OpenAIGPTConfig(vocab_size=97, n_embd=32, n_layer=1, n_head=2, n_positions=32)
    with pytest.raises(UnsupportedModel, match="does not route attention through"):
        transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(**config.to_diff_dict(),
                                                                       attn_implementation="blockdiag_cp"))
    stock = transformers.OpenAIGPTLMHeadModel(config)
    stock.set_attn_implementation("blockdiag_cp")  # transformers itself declines to switch it (a warning)
    assert stock.config._attn_implementation != "blockdiag_cp" and _tree_hooks(stock) == {}


# ---- one place for the attention name and for "does the model use it" -----------------------------------

def test_one_definition_of_the_attention_name_and_one_reader_of_the_models_implementation():
    package = Path(bd.__file__).parent
    assignments, readers = [], []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            constant = isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            if constant and node.value.value == "blockdiag_cp":
                assignments.append(str(path.relative_to(package)))
            if isinstance(node, ast.Attribute) and node.attr == "_attn_implementation":
                readers.append(str(path.relative_to(package)))
            if isinstance(node, ast.Constant) and node.value == "_attn_implementation":  # getattr(config, "...")
                readers.append(str(path.relative_to(package)))
    assert assignments == ["config.py"], assignments
    assert set(readers) == {"compat.py"}, readers
