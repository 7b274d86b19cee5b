"""Every private name of a third-party library the package relies on, in one place.

Each entry has a test in tests/package/test_compat.py that fails when the upstream name or its
behaviour changes; pyproject.toml bounds the dependencies to the versions those tests cover (torch 2.13,
transformers 5.25, accelerate 1.16, trl 1.16). This module imports no part of the package (it sits below every
subpackage) and no optional or slow dependency: callers pass the objects in. The transformers methods
the package wraps are listed, and tested, in :mod:`hf_blockdiag_cp.integration`.
"""

from __future__ import annotations

import datetime
import importlib.util
import inspect
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group, _set_pg_timeout

__all__ = ["CHECKPOINT_FUNC_ATTR", "CONFIG_ATTN_PROPERTY", "CPU_FLASH_ATTENTION", "CPU_FLASH_ATTENTION_BACKWARD",
           "KERNEL_FUNCS_ATTR",
           "MASK_CLOSURES", "RGLRU_SCAN_METHOD", "kernel_functions", "kernels_available",
           "MULTIMODAL_ENCODER_KEYWORD", "SFT_TRAINER_PRIVATE_METHODS", "TRAINER_PRIVATE_METHODS",
           "accelerate_dispatching_processes", "accelerate_prepared", "backend_options", "backend_timeouts",
           "cache_eval_dataloader", "can_set_attn_implementation", "check_sft_trainer_internals",
           "check_trainer_internals", "config_attn_implementation", "encoder_output_is_sequence",
           "forget_accelerate_prepared", "forward_hooks", "forwards_loss_kwargs", "in_autograd_backward",
           "model_from_config",
           "resolve_process_group", "rope_index_function", "set_config_attn_implementation", "set_group_timeout",
           "stock_attn_implementation"]

# ---- transformers -----------------------------------------------------------------------------------------

#: ``use_kernelized_func`` (transformers' ``integrations/hub_kernels.py``, with the ``kernels`` package installed)
#: keeps each recurrent mixer instance's private wrappers, one per replaceable function, in this instance attribute;
#: ``kernels.kernelize`` replaces a wrapper's ``forward`` on the instance, and so does
#: :mod:`hf_blockdiag_cp.mixer_hooks`.
KERNEL_FUNCS_ATTR = "_kernel_funcs"
#: RecurrentGemma's RG-LRU runs its scan in this private method ``(hidden_states, recurrent_gate, reset,
#: recurrent_states, acc_dtype)``: served by an instance attribute of the same name.
RGLRU_SCAN_METHOD = "_rnn_scan"
#: transformers' per-layer activation-checkpoint function (set by ``gradient_checkpointing_enable`` on every
#: ``GradientCheckpointingLayer``; called as ``func(partial(forward, layer, **kwargs), *args)``, so what it is given
#: is what the backward's recompute runs).
CHECKPOINT_FUNC_ATTR = "_gradient_checkpointing_func"


def kernel_functions(module: object) -> dict[str, Any] | None:
    """The private per-instance wrappers of a mixer decorated with ``use_kernelized_func`` (``None``: none)."""
    funcs = getattr(module, "__dict__", {}).get(KERNEL_FUNCS_ATTR)
    return funcs if isinstance(funcs, dict) and funcs else None


def kernels_available() -> bool:
    """Whether the ``kernels`` package is importable (without it, transformers' mixers call their functions directly
    and hold no wrappers the package could serve)."""
    return importlib.util.find_spec("kernels") is not None


#: Vision-language models: the names the package relies on to carry images (tests/package/test_compat.py).
#: - ``get_rope_index(self, input_ids, mm_token_type_ids, image_grid_thw=, video_grid_thw=, ...)`` of the base model
#:   class (``MODEL_MAPPING_NAMES[model_type]``), which reads only ``self.config`` and
#:   ``self.get_vision_position_ids``: run on a stand-in holding the config (:func:`rope_index_function`).
#: - ``mm_encoder_outputs={"image": ..., "video": ...}``: the forward keyword through which a VLM takes encoder
#:   outputs instead of pixels (each a ``get_image_features`` / ``get_video_features`` output whose
#:   ``pooler_output`` holds the feature rows in placeholder order, qwen3_vl's ``deepstack_features`` too).
MULTIMODAL_ENCODER_KEYWORD = "mm_encoder_outputs"


def rope_index_function(config: Any, model_class: type | None) -> Any:
    """``model_class.get_rope_index`` (the base model of ``config``'s architecture, e.g. ``Qwen2_5_VLModel``) as a
    function of its inputs for mrope models, else ``None``."""
    cls, name = model_class, getattr(model_class, "__name__", "")
    if cls is None or not hasattr(cls, "get_rope_index") or not hasattr(cls, "get_vision_position_ids"):
        return None
    stand_in = object.__new__(cls)  # no parameters: the method reads self.config and a method of the class only
    stand_in.__dict__.update(config=config, _modules={}, _parameters={}, _buffers={})
    return _RopeIndex(name, stand_in.get_rope_index)


def encoder_output_is_sequence(model: Any) -> bool:
    """Whether ``model``'s forward reads ``mm_encoder_outputs["image"].pooler_output`` as a sequence of per-item
    tensors (it concatenates them: llava, the Qwen family) rather than as one tensor (gemma3, internvl, paligemma).

    Read from the source of the forward that consumes it (the innermost module whose forward does); cached per
    class. A forward that accepts both (idefics3, smolvlm: a sequence is concatenated further on) reads as a tensor.
    """
    for module in model.modules():
        cls = type(module)
        if cls not in _SEQUENCE_FORMAT:
            try:
                source = inspect.getsource(cls.forward)
            except (OSError, TypeError):
                source = ""
            at = source.find('mm_encoder_outputs["image"].pooler_output')
            _SEQUENCE_FORMAT[cls] = None if at < 0 else "torch.cat(" in source[max(0, at - 20):at + 400]
        if _SEQUENCE_FORMAT[cls] is not None:
            return bool(_SEQUENCE_FORMAT[cls])
    return True


#: Per model class: does its forward concatenate ``pooler_output`` (``None``: it does not read it). This module's
#: one cache (classes are few and live as long as the process).
_SEQUENCE_FORMAT: dict[type, bool | None] = {}


def forwards_loss_kwargs(model: Any) -> bool:
    """Whether ``model``'s forward passes its ``**kwargs`` to ``self.loss_function`` (read from its source): then the
    Trainer's ``num_items_in_batch`` reaches the loss whatever the class's ``accepts_loss_kwargs`` says."""
    try:
        source = inspect.getsource(type(model).forward)
    except (OSError, TypeError):
        return False
    at = source.find("self.loss_function(")
    if at < 0:
        return False
    depth, end = 0, at + len("self.loss_function")
    for end in range(end, len(source)):  # the call's argument list, to its closing parenthesis
        depth += {"(": 1, ")": -1}.get(source[end], 0)
        if depth == 0:
            break
    return "**kwargs" in source[at:end]


class _RopeIndex:
    """A model class's ``get_rope_index`` bound to a stand-in (picklable by the collator: the config goes along)."""

    def __init__(self, name: str, method: Any) -> None:
        self.name, self.method = name, method

    def __reduce__(self) -> tuple[Any, tuple[Any, type]]:
        return rope_index_function, (self.method.__self__.config, type(self.method.__self__))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)

    def __repr__(self) -> str:
        return f"{self.name}.get_rope_index"


#: ``transformers.masking_utils`` mask building blocks as attention/mask_spec.py recognises them: role ->
#: the ``__qualname__`` of the function (or of the closure the factory returns). Their closure variables
#: (``mask_functions``, ``sliding_window``, ``chunk_size``, ``left_padding``, ``packed_sequence_mask``,
#: ``mask_function``, ``padding_mask``) are read by name: private, and tested in tests/package/test_compat.py.
MASK_CLOSURES: dict[str, str] = {
    "causal": "causal_mask_function",
    "bidirectional": "bidirectional_mask_function",
    "and": "and_masks.<locals>.and_mask",
    "or": "or_masks.<locals>.or_mask",
    "sliding_window": "sliding_window_overlay.<locals>.inner_mask",
    "chunked": "chunked_overlay.<locals>.inner_mask",
    "packed_sequence": "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions": "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "padding": "padding_mask_function.<locals>.inner_mask",
    "bidirectional_sliding_window": "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "blockwise": "blockwise_overlay.<locals>.inner_mask",
}


def config_attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers config names (its private ``_attn_implementation``, which
    ``from_pretrained(attn_implementation=...)`` and ``set_attn_implementation`` write); ``None`` when absent."""
    return getattr(config, "_attn_implementation", None)


def set_config_attn_implementation(config: Any, value: str | dict | None) -> None:
    """Write the attention implementation of ``config`` through its private ``_attn_implementation`` setter, which
    spreads it onto the sub-configs: a string (or ``None``) onto all of them, a dict ``{"": own, key: value}`` one value
    per ``sub_configs`` key (a key left out keeps its value). ``from_pretrained(attn_implementation=...)`` and
    ``from_config(..., attn_implementation=...)`` write the keyword through this setter too."""
    config._attn_implementation = value


#: The property of ``transformers.PreTrainedConfig`` whose setter spreads an implementation onto the sub-configs
#: (wrapped by :mod:`hf_blockdiag_cp.integration`).
CONFIG_ATTN_PROPERTY = "_attn_implementation"


def stock_attn_implementation(model: Any) -> str:
    """What transformers gives ``model`` when no implementation is named (``get_correct_attn_implementation(None)``,
    also what a model built from a sub-config holding ``None`` resolves to): ``"sdpa"`` where it supports it, else
    ``"eager"``."""
    return model.get_correct_attn_implementation(None)


def can_set_attn_implementation(model_class: type) -> bool | None:
    """transformers' own source heuristic of whether ``model_class`` routes attention through
    ``AttentionInterface`` (the private classmethod ``_can_set_attn_implementation``); ``None`` when absent."""
    can_set = getattr(model_class, "_can_set_attn_implementation", None)
    return None if can_set is None else bool(can_set())


def model_from_config(model_class: type, config: Any, **kwargs: Any) -> Any:
    """``model_class._from_config(config, **kwargs)``: a model of a class that no Auto class maps the config's
    type to (the text model of a composite type), built like ``from_config`` builds one."""
    return model_class._from_config(config, **kwargs)


# ---- torch ----------------------------------------------------------------------------------------------

#: ATen's CPU flash-attention forward ``(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None) ->
#: (out, logsumexp)`` on ``[B, H, L, D]`` inputs (``None`` where this torch build lacks it); kernels/sdpa_doc.py
#: calls it to get the log-sum-exp that ``scaled_dot_product_attention`` does not return.
CPU_FLASH_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
#: Its backward ``(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None) ->
#: (grad_q, grad_k, grad_v)``.
CPU_FLASH_ATTENTION_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def in_autograd_backward() -> bool:
    """Whether this thread is running autograd's backward now (an activation-checkpoint recompute runs there),
    read from torch's private ``_current_graph_task_id`` (-1 outside a backward)."""
    return torch._C._current_graph_task_id() != -1


def forward_hooks(module: torch.nn.Module) -> tuple[list[Any], list[Any]]:
    """The forward pre-hooks and forward hooks registered on ``module`` itself, in call order."""
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


def backend_timeouts(group: Any) -> list[datetime.timedelta] | None:
    """The timeout of each per-device backend of process group ``group``, or ``None`` when torch does
    not expose them for it (torch 2.13 has no public getter: ``options._timeout`` of each backend)."""
    try:
        return [group._get_backend(torch.device(device)).options._timeout for device in group._device_types]
    except (AttributeError, RuntimeError, ValueError):
        return None


def set_group_timeout(group: Any, timeout: datetime.timedelta) -> None:
    """Set the timeout of every backend of the live process group ``group`` (torch 2.13: the private
    ``distributed_c10d._set_pg_timeout``)."""
    _set_pg_timeout(timeout, group)


def backend_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Options for a new ``backend`` (``"gloo"``/``"nccl"``) process group whose collectives time out after
    ``timeout``; ``None`` for other backends or where the backend is not built."""
    if backend == "gloo" and dist.is_gloo_available():
        options = dist.ProcessGroupGloo._Options()
    elif backend == "nccl" and dist.is_nccl_available():
        options = dist.ProcessGroupNCCL.Options()
    else:
        return None
    options._timeout = timeout
    return options


def resolve_process_group(name: str) -> Any:
    """The live process group registered under ``name`` (raises ``KeyError``/``RuntimeError``/``ValueError``
    when there is none)."""
    return _resolve_process_group(name)


# ---- transformers Trainer (training/trainer.py overrides or calls these) --------------------------------

#: ``Trainer`` methods ``CPTrainer`` overrides or calls, with the parameters it relies on.
TRAINER_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    # Every loader (train, eval, test) is built here; CPTrainer replaces it to shard over dp only.
    "_get_dataloader": ("dataset", "description", "batch_size", "sampler_fn", "is_training", "dataloader_key"),
    "_remove_unused_columns": ("dataset", "description"),
    "_get_collator_with_removed_columns": ("data_collator", "description"),
    "_get_num_items_in_batch": ("batch_samples", "device"),
    "_prepare_inputs": ("inputs",),
}


def _check_private_methods(cls: type, table: dict[str, tuple[str, ...]], owner: str, user: str) -> None:
    """Raise ``ImportError`` if ``cls`` lacks a method of ``table`` or its leading parameters changed."""
    library = owner.split(".")[0]
    for name, expected in table.items():
        method = getattr(cls, name, None)
        params = tuple(inspect.signature(method).parameters)[1:] if callable(method) else None
        if params is None or params[:len(expected)] != expected:
            raise ImportError(f"{owner}.{name}{'' if params is None else params} is not "
                              f"{name}(self, {', '.join(expected)}) in this {library} version: {user} relies on "
                              f"it; use a {library} version within the bounds in hf-blockdiag-cp's pyproject.toml")


def check_trainer_internals(trainer_cls: type) -> None:
    """Raise ``ImportError`` if ``trainer_cls`` (``transformers.Trainer``) lacks a method of
    :data:`TRAINER_PRIVATE_METHODS` or its parameters changed: an override nobody calls would let the
    stock loaders shard CP batches over all processes without a word."""
    _check_private_methods(trainer_cls, TRAINER_PRIVATE_METHODS, "transformers.Trainer", "CPTrainer")


def cache_eval_dataloader(trainer: Any, dataloader_key: str, loader: Any) -> None:
    """Keep ``loader`` where ``Trainer.get_eval_dataloader`` looks for a persistent-workers loader to reuse (the
    private dict ``_eval_dataloaders``), as the stock ``_get_dataloader`` does."""
    if not hasattr(trainer, "_eval_dataloaders"):
        trainer._eval_dataloaders = {}
    trainer._eval_dataloaders[dataloader_key] = loader


# ---- TRL SFTTrainer (training/trl.py overrides these) ------------------------------------------------------

#: ``trl.SFTTrainer`` methods ``CPSFTTrainer`` overrides, with the parameters it passes on.
SFT_TRAINER_PRIVATE_METHODS: dict[str, tuple[str, ...]] = {
    # Tokenisation and TRL's packing; CPSFTTrainer calls it with packing=False and packs the rows itself.
    "_prepare_dataset": ("dataset", "processing_class", "args", "packing", "formatting_func", "dataset_name"),
}


def check_sft_trainer_internals(sft_trainer_cls: type) -> None:
    """Raise ``ImportError`` if ``sft_trainer_cls`` (``trl.SFTTrainer``) lacks a method of
    :data:`SFT_TRAINER_PRIVATE_METHODS` or its parameters changed: a renamed method would leave TRL packing the
    data its own way (without a word) under CPSFTTrainer."""
    _check_private_methods(sft_trainer_cls, SFT_TRAINER_PRIVATE_METHODS, "trl.SFTTrainer", "CPSFTTrainer")


# ---- accelerate -----------------------------------------------------------------------------------------

def accelerate_prepared(model: torch.nn.Module) -> bool:
    """Whether accelerate marked ``model`` as prepared (``prepare_model`` sets ``_is_accelerate_prepared``)."""
    return bool(getattr(model, "_is_accelerate_prepared", False))


def accelerate_dispatching_processes() -> int:
    """How many processes accelerate's active ``DataLoaderDispatcher`` collates for (0 when accelerate is not
    imported, its state is not initialised, or the active loader is no dispatcher). Reads accelerate's
    ``GradientState().active_dataloader`` and its ``state.num_processes``; imports and creates nothing."""
    state, loaders = sys.modules.get("accelerate.state"), sys.modules.get("accelerate.data_loader")
    # Only an Accelerator prepares a dispatcher, and it initialises the state: nothing is created here.
    if state is None or loaders is None or not state.is_initialized():
        return 0
    active = state.GradientState().active_dataloader
    return active.state.num_processes if isinstance(active, loaders.DataLoaderDispatcher) else 0


def forget_accelerate_prepared(accelerator: Any, model: torch.nn.Module) -> None:
    """Undo what ``accelerator.prepare_model(model, evaluation_mode=True)`` recorded: the mark on the model
    and its entry in ``accelerator._models``, so that a later ``prepare`` wraps it (DDP) again."""
    if "_is_accelerate_prepared" in model.__dict__:
        del model._is_accelerate_prepared
    if model in accelerator._models:
        accelerator._models.remove(model)


# ---- transformers: DSA indexers (hf_blockdiag_cp/sparse/indexer.py) ---------------------------------------------

#: Indexer class -> (its modeling module, the RoPE function it applies to the first ``qk_rope_head_dim`` dims of its
#: queries and key, called with ``unsqueeze_dim=2``): DeepSeek-V3.2 rotates half-split, GLM-MoE-DSA interleaved.
SPARSE_INDEXERS: dict[str, tuple[str, str]] = {
    "DeepseekV32Indexer": ("transformers.models.deepseek_v32.modeling_deepseek_v32", "apply_rotary_pos_emb"),
    "GlmMoeDsaIndexer": ("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "apply_rotary_pos_emb_interleave"),
}
#: The parameters of their ``forward`` (the attention layer passes ``attention_mask[:, 0, :, :]`` as the fourth).
SPARSE_INDEXER_PARAMS = ("self", "hidden_states", "q_resid", "position_embeddings", "attention_mask", "position_ids",
                         "cache")
#: The attributes the served forward reads (projections, norms, sizes).
SPARSE_INDEXER_ATTRS = ("wq_b", "wk", "k_norm", "weights_proj", "n_heads", "head_dim", "qk_rope_head_dim",
                        "index_topk", "softmax_scale", "layer_idx")
#: The attention classes that own those indexers and pass the selection to the attention function as ``indices=``
#: (every implementation but eager / sdpa); GLM's ``"shared"`` layers (``indexer is None``) reuse the previous
#: layer's selection (``prev_topk_indices``).
SPARSE_ATTENTIONS = frozenset({"DeepseekV32Attention", "GlmMoeDsaAttention"})


def indexer_rope(module: Any) -> Any:
    """The RoPE function ``module`` (an indexer of :data:`SPARSE_INDEXERS`) applies, from its modeling module."""
    module_name, function = SPARSE_INDEXERS[type(module).__name__]
    return getattr(sys.modules[module_name], function)
