"""Every third-party private name in hf_blockdiag_cp/compat.py still exists and behaves as the package
assumes (one test per entry): an upgrade that renames or changes one fails here, not in a user's run."""

from __future__ import annotations

import datetime
import math

import pytest
import torch
import torch.distributed as dist

from hf_blockdiag_cp import compat

# ---- torch: the CPU flash-attention ops (kernels/sdpa_doc.py) ----------------------------------------------

def _qkv(requires_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 6, 8, generator=gen, requires_grad=requires_grad) for _ in range(3))


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float):
    """Float64 attention output and log-sum-exp by brute force."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_flash_attention_returns_output_and_logsumexp(causal):
    assert compat.CPU_FLASH_ATTENTION is not None, "torch.ops.aten._scaled_dot_product_flash_attention_for_cpu is gone"
    q, k, v = _qkv()
    out, lse = compat.CPU_FLASH_ATTENTION(q, k, v, 0.0, causal, scale=0.3)[:2]
    ref_out, ref_lse = _reference(q, k, v, causal, 0.3)
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=0)


def test_cpu_flash_attention_backward_gives_the_gradients():
    assert compat.CPU_FLASH_ATTENTION_BACKWARD is not None
    q, k, v = _qkv(requires_grad=True)
    grad_out = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(1))
    out, lse = compat.CPU_FLASH_ATTENTION(q.detach(), k.detach(), v.detach(), 0.0, True, scale=0.3)[:2]
    grads = compat.CPU_FLASH_ATTENTION_BACKWARD(grad_out, q.detach(), k.detach(), v.detach(), out, lse, 0.0, True,
                                                scale=0.3)
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3).backward(grad_out)
    for got, tensor in zip(grads[:3], (q, k, v)):
        torch.testing.assert_close(got, tensor.grad, atol=1e-5, rtol=0)


# ---- torch: module hook dictionaries (model/prepare.py) ---------------------------------------------------

def test_forward_hooks_lists_the_hooks_registered_on_a_module():
    module = torch.nn.Linear(2, 2)

    def pre(m, a):
        return None

    def post(m, a, o):
        return None

    module.register_forward_pre_hook(pre)
    handle = module.register_forward_hook(post)
    assert compat.forward_hooks(module) == ([pre], [post])
    handle.remove()
    assert compat.forward_hooks(module) == ([pre], [])


# ---- torch.distributed: process-group timeouts and names (distributed/groups.py) --------------------------

@pytest.fixture
def single_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=123))
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_backend_timeouts_read_the_default_groups_timeout(single_process_group):
    found = compat.backend_timeouts(dist.group.WORLD)  # one entry per device type gloo serves (cpu, cuda)
    assert found and set(found) == {datetime.timedelta(seconds=123)}, found
    assert compat.backend_timeouts(object()) is None  # not a process group: None, no error


def test_backend_options_set_a_new_groups_timeout(single_process_group):
    """torch's device mesh reads the options' timeout (``pg_options._timeout``) for the groups it creates."""
    from torch.distributed.device_mesh import init_device_mesh

    options = compat.backend_options("gloo", datetime.timedelta(seconds=77))
    assert options is not None and compat.backend_options("mpi-like", datetime.timedelta(seconds=1)) is None
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "cp"),
                            backend_override={"dp": ("gloo", options), "cp": ("gloo", options)})
    found = compat.backend_timeouts(mesh["cp"].get_group())
    assert found and set(found) == {datetime.timedelta(seconds=77)}, found


def test_resolve_process_group_finds_a_group_by_name(single_process_group):
    group = dist.new_group(ranks=[0], backend="gloo")
    assert compat.resolve_process_group(group.group_name) is group
    with pytest.raises((KeyError, RuntimeError, ValueError)):
        compat.resolve_process_group("no-such-group")


# ---- transformers Trainer (training/trainer.py) -----------------------------------------------------------

def test_trainer_has_the_private_methods_cptrainer_relies_on():
    from transformers import Trainer

    compat.check_trainer_internals(Trainer)

    class Renamed:
        def _get_data_loader(self, dataset, description, batch_size, sampler_fn=None, is_training=False,
                             dataloader_key=None):
            return None

    with pytest.raises(ImportError, match="Trainer._get_dataloader"):
        compat.check_trainer_internals(Renamed)


def test_trainer_builds_every_loader_through_get_dataloader(tmp_path):
    from transformers import Trainer, TrainingArguments

    from tests.reference import tiny_model

    seen = []

    class Spy(Trainer):
        def _get_dataloader(self, dataset, description, *args, **kwargs):
            seen.append(description)
            return super()._get_dataloader(dataset, description, *args, **kwargs)

    rows = [{"input_ids": torch.arange(1, 5), "labels": torch.arange(1, 5)}] * 2
    trainer = Spy(model=tiny_model("llama"), train_dataset=rows, eval_dataset=rows,
                  args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[]))
    trainer.get_train_dataloader()
    trainer.get_eval_dataloader()
    trainer.get_test_dataloader(rows)
    assert [d.lower() for d in seen] == ["training", "evaluation", "test"]


def test_cached_eval_dataloader_is_the_one_the_trainer_reuses(tmp_path):
    """``get_eval_dataloader`` returns the loader cache_eval_dataloader stored (persistent workers), not a new one."""
    from transformers import Trainer, TrainingArguments

    from tests.reference import tiny_model

    rows = [{"input_ids": torch.arange(1, 5), "labels": torch.arange(1, 5)}] * 2
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], dataloader_num_workers=1,
                             dataloader_persistent_workers=True)
    trainer = Trainer(model=tiny_model("llama"), eval_dataset=rows, args=args)
    cached = object()
    compat.cache_eval_dataloader(trainer, "eval", cached)
    assert trainer.get_eval_dataloader() is cached


# ---- TRL SFTTrainer (training/trl.py) ----------------------------------------------------------------------

def test_sft_trainer_has_the_private_method_cpsfttrainer_overrides():
    trl = pytest.importorskip("trl")

    compat.check_sft_trainer_internals(trl.SFTTrainer)

    class Renamed:  # an upgrade that renames it (or changes its parameters) must fail here, not train silently
        def _prepare_dataset(self, dataset, tokenizer, args, packing, formatting_func, dataset_name):
            return dataset

    with pytest.raises(ImportError, match=r"trl.SFTTrainer._prepare_dataset.*CPSFTTrainer"):
        compat.check_sft_trainer_internals(Renamed)
    with pytest.raises(ImportError, match="_prepare_dataset"):
        compat.check_sft_trainer_internals(object)


# ---- accelerate (training/trainer.py, data/sharding.py) -----------------------------------------------------

def test_accelerate_dispatching_processes_sees_the_active_dispatcher():
    """0 outside a dispatcher's iteration; inside one (one process here), its process count."""
    from accelerate import Accelerator, DataLoaderConfiguration

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([torch.ones(2)] * 2)

    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    loader = accelerator.prepare(torch.utils.data.DataLoader(Stream(), batch_size=1))
    assert compat.accelerate_dispatching_processes() == 0
    seen = [compat.accelerate_dispatching_processes() for _ in loader]
    assert seen == [1, 1], seen
    assert compat.accelerate_dispatching_processes() == 0  # the iteration ended: no active loader


def test_accelerate_prepared_mark_and_models_list_are_undone():
    from accelerate import Accelerator

    accelerator, model = Accelerator(cpu=True), torch.nn.Linear(2, 2)
    accelerator.prepare_model(model, evaluation_mode=True)
    assert compat.accelerate_prepared(model) and model in accelerator._models
    compat.forget_accelerate_prepared(accelerator, model)
    assert not compat.accelerate_prepared(model) and model not in accelerator._models
    assert math.isfinite(float(model(torch.ones(1, 2)).detach().sum()))  # the model itself is untouched


# ---- transformers: mask closures, the AttentionInterface heuristic, _from_config ----------------------------

def test_mask_closures_name_transformers_building_blocks():
    """Each qualname the mask reader dispatches on is a function (or the closure a factory returns) of
    transformers.masking_utils, with the closure variables the reader takes by name."""
    import transformers.masking_utils as mu

    closures = compat.MASK_CLOSURES
    assert mu.causal_mask_function.__qualname__ == closures["causal"]
    assert mu.bidirectional_mask_function.__qualname__ == closures["bidirectional"]
    both = mu.and_masks(mu.causal_mask_function)
    assert both.__qualname__ == closures["and"] and "mask_functions" in both.__code__.co_freevars
    either = mu.or_masks(mu.causal_mask_function)
    assert either.__qualname__ == closures["or"] and "mask_functions" in either.__code__.co_freevars
    window = mu.sliding_window_overlay(4)
    assert window.__qualname__ == closures["sliding_window"] and "sliding_window" in window.__code__.co_freevars
    chunk = mu.chunked_overlay(4, None)
    assert chunk.__qualname__ == closures["chunked"] and "chunk_size" in chunk.__code__.co_freevars
    padding = mu.padding_mask_function(torch.ones(1, 4, dtype=torch.bool))
    assert padding.__qualname__ == closures["padding"] and "padding_mask" in padding.__code__.co_freevars
    packed = mu.packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long))
    assert packed.__qualname__ == closures["packed_sequence"]
    assert "packed_sequence_mask" in packed.__code__.co_freevars
    for role in ("remap_positions", "bidirectional_sliding_window"):
        factory = getattr(mu, closures[role].split(".")[0])
        assert callable(factory), role


def test_can_set_attn_implementation_is_transformers_heuristic():
    from tests.reference import tiny_model

    assert compat.can_set_attn_implementation(type(tiny_model("llama"))) is True
    assert compat.can_set_attn_implementation(object) is None


def test_config_attn_implementation_reads_what_set_attn_implementation_wrote():
    from tests.reference import tiny_model

    model = tiny_model("llama", attn_implementation="eager")
    assert compat.config_attn_implementation(model.config) == "eager"
    model.set_attn_implementation("sdpa")
    assert compat.config_attn_implementation(model.config) == "sdpa"
    assert compat.config_attn_implementation(None) is None


def test_model_from_config_builds_a_model_of_the_given_class():
    import transformers

    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = compat.model_from_config(transformers.LlamaForCausalLM, config, attn_implementation="sdpa")
    assert isinstance(model, transformers.LlamaForCausalLM) and model.config._attn_implementation == "sdpa"


def test_in_autograd_backward_is_true_only_inside_a_backward():
    seen = []

    def record(grad):
        seen.append(compat.in_autograd_backward())
        return grad

    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(record)
    assert not compat.in_autograd_backward()
    y.sum().backward()
    assert seen == [True]


# ---- transformers: the config setter that spreads an attention implementation (model/subconfigs.py) ----------

def test_config_attn_setter_spreads_strings_and_dicts_per_sub_config():
    """A string reaches every sub-config; a dict names each one's (a key left out keeps its value); None resets."""
    import transformers

    prop = vars(transformers.PreTrainedConfig).get(compat.CONFIG_ATTN_PROPERTY)
    assert isinstance(prop, property) and prop.fset is not None
    config = transformers.AutoConfig.for_model("llava")
    compat.set_config_attn_implementation(config, "eager")
    assert {config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation} == {"eager"}
    compat.set_config_attn_implementation(config, {"": "sdpa", "vision_config": None})
    assert (config._attn_implementation, config.text_config._attn_implementation,
            config.vision_config._attn_implementation) == ("sdpa", "eager", None)


def test_from_config_and_from_pretrained_write_the_keyword_through_the_config_setter(tmp_path, monkeypatch):
    import transformers

    from hf_blockdiag_cp import integration

    seen = []
    original = integration.spread_attn_implementation
    monkeypatch.setattr(integration, "spread_attn_implementation",
                        lambda config, value: seen.append(value) or original(config, value))
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    assert "eager" in seen
    model.save_pretrained(tmp_path)
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa")
    assert "sdpa" in seen


def test_stock_attn_implementation_is_sdpa_else_eager():
    import transformers

    from tests.reference import tiny_model

    assert compat.stock_attn_implementation(tiny_model("llama")) == "sdpa"
    with torch.device("meta"):  # GOT-OCR2's SAM vision encoder declares no sdpa support
        got = transformers.AutoModelForImageTextToText.from_config(transformers.AutoConfig.for_model("got_ocr2"))
    assert compat.stock_attn_implementation(got.model.vision_tower) == "eager"


# ---- vision-language models (issue 32) --------------------------------------------------------------------

_VLMS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "idefics3", "smolvlm", "mistral3", "internvl",
         "gemma3", "paligemma")


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5"])
def test_rope_index_on_a_stand_in_equals_the_model_method(model_type):
    """``get_rope_index`` reads only ``self.config`` and ``get_vision_position_ids``: the collator's stand-in (no
    weights) gives what the built model's method gives."""
    import transformers

    from hf_blockdiag_cp.conformance.multimodal import build_vlm, synthetic_documents, tiny_vlm_config
    from hf_blockdiag_cp.data.multimodal import media_spec

    config = tiny_vlm_config(model_type)
    doc = synthetic_documents(config, num_docs=1, seed=2, images=(2,))[0]
    cls = getattr(transformers, transformers.models.auto.modeling_auto.MODEL_MAPPING_NAMES[model_type])
    rope = compat.rope_index_function(config, cls)
    args = (doc["input_ids"][None], doc["mm_token_type_ids"][None])
    got, _ = rope(*args, image_grid_thw=doc["image_grid_thw"])
    want, _ = build_vlm(config).model.get_rope_index(*args, image_grid_thw=doc["image_grid_thw"])
    assert torch.equal(got, want)
    assert media_spec(config).mrope and media_spec(tiny_vlm_config("llava")).rope_index is None


@pytest.mark.parametrize("model_type", _VLMS)
def test_vlm_forwards_take_encoder_outputs_and_read_them_as_the_package_assumes(model_type):
    """Every covered VLM's forward takes ``mm_encoder_outputs``, and its ``pooler_output`` format (one tensor per
    image, or one tensor) is what :func:`compat.encoder_output_is_sequence` reads from the source."""
    import inspect

    from hf_blockdiag_cp.conformance.multimodal import build_vlm, tiny_vlm_config

    model = build_vlm(tiny_vlm_config(model_type))
    assert compat.MULTIMODAL_ENCODER_KEYWORD in inspect.signature(type(model).forward).parameters
    assert compat.MULTIMODAL_ENCODER_KEYWORD in inspect.signature(type(model.model).forward).parameters
    # gemma3 / paligemma / internvl call .pooler_output.to(...); idefics3 / smolvlm take both forms (read as one tensor)
    expected = model_type not in ("gemma3", "paligemma", "internvl", "idefics3", "smolvlm")
    assert compat.encoder_output_is_sequence(model) is expected


# ---- transformers: DSA indexers (sparse/indexer.py) ---------------------------------------------------------------

@pytest.mark.parametrize("class_name", sorted(compat.SPARSE_INDEXERS))
def test_sparse_indexers_keep_their_signature_attributes_and_rope(class_name):
    import importlib
    import inspect

    from hf_blockdiag_cp.conformance.configs import tiny_config

    module_name, rope_name = compat.SPARSE_INDEXERS[class_name]
    modeling = importlib.import_module(module_name)
    cls = getattr(modeling, class_name)
    assert tuple(inspect.signature(cls.forward).parameters)[:len(compat.SPARSE_INDEXER_PARAMS)] == \
        compat.SPARSE_INDEXER_PARAMS
    model_type = "deepseek_v32" if "Deepseek" in class_name else "glm_moe_dsa"
    indexer = cls(tiny_config(model_type), 0)
    assert all(hasattr(indexer, a) for a in compat.SPARSE_INDEXER_ATTRS)
    assert compat.indexer_rope(indexer) is getattr(modeling, rope_name)
    # the attention classes pass attention_mask[:, 0, :, :] to the indexer and indices= to the attention function
    source = "".join(inspect.getsource(getattr(modeling, name)) for name in dir(modeling)
                     if name in compat.SPARSE_ATTENTIONS)
    assert "attention_mask[:, 0, :, :]" in source and "indices=sparse_indices" in source
    # the RoPE function rotates [B, S, H, D] with unsqueeze_dim=2 (as the indexer calls it)
    q, k = torch.randn(1, 3, 2, 8), torch.randn(1, 3, 1, 8)
    cos, sin = torch.randn(1, 3, 8), torch.randn(1, 3, 8)
    q_rot, k_rot = compat.indexer_rope(indexer)(q, k, cos, sin, unsqueeze_dim=2)
    assert q_rot.shape == q.shape and k_rot.shape == k.shape


@pytest.mark.parametrize("model_type,expected", [("qwen2_5_vl", True), ("gemma3", True), ("llava", True)])
def test_vlm_forwards_hand_their_kwargs_to_the_loss(model_type, expected):
    """CPTrainer trusts the source over ``accepts_loss_kwargs = False`` (set by the Qwen VL family and gemma3 although
    their forward passes **kwargs to self.loss_function)."""
    from hf_blockdiag_cp.conformance.multimodal import build_vlm, tiny_vlm_config

    model = build_vlm(tiny_vlm_config(model_type))
    assert compat.forwards_loss_kwargs(model) is expected
    assert not compat.forwards_loss_kwargs(torch.nn.Linear(2, 2))


# ---- transformers / kernels: the recurrent mixers' private wrappers -------------------------------------------

def test_kernelized_mixers_hold_their_wrappers_under_the_private_attribute():
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.mixer_table import SCANS

    model = build_model(tiny_config("qwen3_next"), None)
    mixer = next(m for m in model.modules() if type(m).__name__ == "Qwen3NextGatedDeltaNet")
    funcs = compat.kernel_functions(mixer)
    assert funcs is mixer.__dict__[compat.KERNEL_FUNCS_ATTR]
    assert {"causal_conv1d_fn", "chunk_gated_delta_rule"} <= set(funcs) and set(funcs) & set(SCANS)
    assert all(callable(getattr(w, "forward", None)) for w in funcs.values())  # what kernelize (and we) replace
    assert compat.kernel_functions(torch.nn.Linear(2, 2)) is None


def test_rglru_runs_its_scan_in_the_private_method():
    import inspect

    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    params = tuple(inspect.signature(getattr(RecurrentGemmaRglru, compat.RGLRU_SCAN_METHOD)).parameters)
    assert params[:5] == ("self", "hidden_states", "recurrent_gate", "reset", "recurrent_states")


def test_without_kernels_a_hybrid_is_refused_naming_it():
    """``kernels`` hidden from the interpreter (as if not installed): transformers wires no wrappers, and a packed
    batch of a hybrid is refused naming the missing package (not "no per-document reset")."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['kernels'] = None\n"
        "import hf_blockdiag_cp as bd\n"
        "from hf_blockdiag_cp.errors import Refusal\n"
        "from hf_blockdiag_cp.compat import kernels_available\n"
        "from hf_blockdiag_cp.conformance.configs import tiny_config\n"
        "from hf_blockdiag_cp.conformance.runs import build_model\n"
        "assert not kernels_available()\n"
        "model = build_model(tiny_config('qwen3_next'), 'blockdiag_cp')\n"
        "batch = bd.PackingCollator(32, pad_token_id=0)([{'input_ids': list(range(1, 11))}, "
        "{'input_ids': list(range(1, 15))}])\n"
        "try:\n"
        "    model(**batch)\n"
        "except Refusal as err:\n"
        "    print('REFUSED', err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "REFUSED" in out.stdout, out.stderr[-2000:]
    assert "`kernels` package, which is not installed" in out.stdout
    assert compat.kernels_available()  # this process has it


def test_transformers_checkpoints_a_layer_through_its_private_function():
    """``gradient_checkpointing_enable`` sets :data:`compat.CHECKPOINT_FUNC_ATTR` on every checkpointable layer, and
    a training forward calls it with the function the recompute runs (``forward_runs`` wraps it to carry the
    forward's fragments)."""
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model

    model = build_model(tiny_config("llama"), None).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layer = model.model.layers[0]
    inner = layer.__dict__[compat.CHECKPOINT_FUNC_ATTR]
    calls = []

    def recorder(function, *args, **kwargs):
        calls.append(function)
        return inner(function, *args, **kwargs)

    layer.__dict__[compat.CHECKPOINT_FUNC_ATTR] = recorder
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    assert len(calls) == 1 and callable(calls[0])
