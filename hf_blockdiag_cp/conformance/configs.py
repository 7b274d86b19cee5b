"""Tiny configs of any causal-LM architecture: generic shrinking of a default config (hidden 64, two layers
covering every layer type, four heads, a 256-token vocabulary, windows of 6, chunks of 8) plus
:data:`CONFIG_FIXES`, the per-architecture corrections the generic rules get wrong."""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..mixer_table import METHODS, SCAN_MODULES, SCANS, STATEFUL, WINDOWED

__all__ = [
    "CHUNK_SIZE",
    "CONFIG_FIXES",
    "SLIDING_WINDOW",
    "VOCAB",
    "causal_lm_names",
    "causal_lm_types",
    "composite_reason",
    "pick_layers",
    "shrink_overrides",
    "text_config",
    "tiny_config",
]

#: Sliding windows and attention chunks of the tiny configs: smaller than the test documents, so they matter.
SLIDING_WINDOW = 6
CHUNK_SIZE = 8
#: Vocabulary of the tiny configs (special token ids are remapped into it).
VOCAB = 256

_HIDDEN = ("hidden_size", "d_model", "n_embd", "dim", "embedding_size", "embedding_dim", "emb_dim",
           "input_embedding_size", "output_embedding_size", "word_embed_proj_dim", "attention_hidden_size",
           "lru_width", "hidden_dim", "hidden_size_global")
_FFN = ("intermediate_size", "ffn_dim", "d_ff", "dff", "dim_ff", "n_inner", "ffn_hidden_size", "feed_forward_size",
        "intermediate_size_mlp", "d_inner", "decoder_ffn_dim", "encoder_ffn_dim", "dense_intermediate_size")
_MOE_FFN = ("moe_intermediate_size", "expert_ffn_hidden_size", "shared_expert_intermediate_size",
            "moe_shared_expert_intermediate_size", "shared_intermediate_size", "shared_experts_intermediate_size",
            "router_hidden_size")
_HEAD_DIM = ("head_dim", "dim_head", "d_head", "attention_head_dim", "kv_channels", "attention_head_size",
             "v_head_dim", "qk_nope_head_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_head_dim",
             "mamba_d_head", "mamba_head_dim", "mamba_headdim", "index_head_dim")
_SMALL_DIM = ("qk_rope_head_dim", "state_size", "ssm_state_size", "mamba_d_state", "time_step_rank",
              "mamba_dt_rank", "rotary_dim")
_LORA = ("kv_lora_rank", "q_lora_rank", "o_lora_rank")
_LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers")
_HEADS = ("num_attention_heads", "n_head", "n_heads", "decoder_attention_heads", "encoder_attention_heads",
          "linear_num_value_heads", "mamba_n_heads", "mamba_num_heads", "index_n_heads", "linear_num_heads")
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "num_query_groups",
             "linear_num_key_heads")
_EXPERTS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
_TOP_K = ("num_experts_per_tok", "moe_k", "top_k", "moe_topk", "num_experts_per_token")
_WINDOWS = ("sliding_window", "window_size", "attention_window_size", "local_attention", "sliding_window_size",
            "local_attention_window_len")

#: Per-architecture corrections on top of the generic shrinking (what the generic rules get wrong).
CONFIG_FIXES: dict[str, dict[str, Any]] = {
    "ministral": {"head_dim": 16},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    "nemotron": {"num_key_value_heads": 2},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "qwen4_exp_text": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                       "indexer_compress_ratio": 2},
    "gemma3n_text": {"num_kv_shared_layers": 0, "hidden_size_per_layer_input": 16, "laurel_rank": 8},
    "gemma4_assistant": {"text_config": {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0}},
    "reformer": {"is_decoder": True, "axial_pos_embds": False},
    # Default configs without the architecture's characteristic layers: add one of each kind.
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": [1]},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    # Hybrids whose default two layers are both recurrent: one attention layer, so that a packed row checks both
    # mixers (granitemoehybrid's attention gets no position_ids from its decoder: issue 35, item 0).
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
}


def pick_layers(layer_types: Sequence[Any]) -> list[int]:
    """Indices of a small subset of layers covering every distinct layer type (at least two layers)."""
    first: dict[str, int] = {}
    for i, kind in enumerate(layer_types):
        first.setdefault(repr(kind), i)
    picked = sorted(first.values())
    if len(picked) < 2 and len(layer_types) >= 2:
        picked = [picked[0], picked[0] + 1 if picked[0] + 1 < len(layer_types) else picked[0] - 1]
        picked.sort()
    return picked


def shrink_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """Overrides that make a config with these default attributes tiny (hidden 64, 2 layers, 4 heads)."""
    out: dict[str, Any] = {}

    def has_int(name: str) -> bool:
        value = defaults.get(name)
        return isinstance(value, int) and not isinstance(value, bool)

    for names, value in ((_HIDDEN, 64), (_FFN, 128), (_MOE_FFN, 32), (_HEAD_DIM, 16), (_SMALL_DIM, 8), (_LORA, 32),
                         (_EXPERTS, 4), (_TOP_K, 2)):
        for name in names:
            if has_int(name):
                out[name] = min(value, defaults[name]) if names in (_EXPERTS, _TOP_K) else value
    heads = next((defaults[n] for n in _HEADS if has_int(n)), None)
    for name in _HEADS:
        if has_int(name):
            out[name] = 4
    for name in _KV_HEADS:
        if has_int(name):
            out[name] = 1 if defaults[name] == 1 else (2 if heads and defaults[name] < heads else 4)
    for name in ("n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups"):
        if has_int(name):
            out[name] = 1
    if has_int("n_shared_experts"):
        out["n_shared_experts"] = min(defaults["n_shared_experts"], 1)
    for name in defaults:
        if ("vocab_size" in name or name.endswith("_vocab")) and has_int(name) and defaults[name] > VOCAB:
            out[name] = VOCAB
    for name in _WINDOWS:
        if has_int(name):
            out[name] = SLIDING_WINDOW
    if defaults.get("is_decoder") is False and "add_cross_attention" in defaults:
        out["is_decoder"] = True  # encoder-style models (BERT family) are causal LMs only as decoders
    if has_int("attention_chunk_size"):
        out["attention_chunk_size"] = CHUNK_SIZE
    for name in ("max_position_embeddings", "n_positions", "max_target_positions", "max_seq_len", "n_ctx"):
        if has_int(name) and defaults[name] > 512:
            out[name] = 512
    num_layers_name = next((n for n in _LAYERS if has_int(n)), None)
    layer_types = defaults.get("layer_types")
    if num_layers_name is not None:
        total = defaults[num_layers_name]
        if isinstance(layer_types, (list, tuple)) and len(layer_types) == total and total > 2:
            picked = pick_layers(layer_types)
        else:
            picked = list(range(min(2, total)))
        for name in _LAYERS:
            if has_int(name):
                out[name] = len(picked)
        for name, value in defaults.items():  # per-layer lists follow the picked layers
            if isinstance(value, (list, tuple)) and len(value) == total and total > len(picked) and name not in out:
                out[name] = [value[i] for i in picked]
    # Dimensions that were equal stay equal (e.g. MLA's head_dim == qk_rope_head_dim), sums stay sums.
    dims = [n for n in (*_HEAD_DIM, *_SMALL_DIM) if n in out]
    for a in dims:
        for b in dims:
            if a < b and defaults[a] == defaults[b] and out[a] != out[b]:
                out[a] = out[b] = min(out[a], out[b])
    if has_int("qk_head_dim") and "qk_nope_head_dim" in out and "qk_rope_head_dim" in out:
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    # State-space heads: heads * head_dim == expand * hidden.
    hidden = next((out[n] for n in _HIDDEN if n in out), None)
    for h, d, e in (("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                    ("mamba_num_heads", "mamba_head_dim", "mamba_expand"), ("num_heads", "head_dim", "expand"),
                    ("mamba_n_heads", "mamba_headdim", "mamba_expand"),
                    ("mamba_num_heads", "mamba_head_dim", "expand")):
        if hidden and all(has_int(n) for n in (h, d, e)) and defaults[h] * defaults[d] == defaults[e] * next(
                defaults[n] for n in _HIDDEN if n in out):
            out[h] = max(1, defaults[e] * hidden // out.get(d, defaults[d]))
    # Special token ids must stay inside the small vocabulary (ids that were equal stay equal).
    remap: dict[int, int] = {}
    for name, value in defaults.items():
        if name.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
            out[name] = remap.setdefault(value, VOCAB - 1 - len(remap))
    return out


def text_config(config: Any) -> Any:
    try:
        return config.gettext_config()
    except (ValueError, AttributeError):
        return config


def tiny_config(model: str) -> Any:
    """A tiny fp32 config of ``model`` (a ``model_type`` or a local config / model folder)."""
    path = Path(model)
    if path.exists():
        base = AutoConfig.from_pretrained(str(path))
        defaults = base.to_dict()
        overrides = {**shrink_overrides(defaults), **CONFIG_FIXES.get(base.model_type, {})}
        return type(base).from_dict({**defaults, **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            base = AutoConfig.for_model(model)
        except Exception:  # a default config this transformers version rejects (e.g. gemma4_assistant)
            base = AutoConfig.for_model(model, **CONFIG_FIXES.get(model, {}))
        text = text_config(base)
        if text is not base:
            text_type = getattr(text, "model_type", None)
            if text_type in causal_lm_names() or text_type is None:
                return base  # a composite wrapper whose text model is its own entry: not checked here
            # The causal LM of a composite type runs on its text config (e.g. mllama, emu3).
            config = AutoConfig.for_model(text_type, **shrink_overrides(vars(text)), **CONFIG_FIXES.get(model, {}))
            config.architectures = [causal_lm_names()[model]]
            config.dtype = torch.float32
            return config
        overrides = shrink_overrides(vars(base))
        for name in getattr(base, "sub_configs", {}) or {}:  # a model made of several sub-models (e.g. blt)
            sub = getattr(base, name, None)
            if sub is not None and hasattr(sub, "to_dict"):
                overrides[name] = shrink_overrides(vars(sub))
        overrides.update(CONFIG_FIXES.get(model, {}))
        config = AutoConfig.for_model(model, **overrides)
    config.dtype = torch.float32
    return config


def causal_lm_names() -> dict[str, str]:
    """``model_type -> causal-LM class name`` of the installed transformers."""
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def causal_lm_types() -> list[str]:
    """Every ``model_type`` of the installed transformers' causal-LM mapping."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def composite_reason(model_type: str, config: Any) -> str | None:
    """Why ``config`` is not checked itself (a composite / multimodal wrapper), or ``None``."""
    try:
        text = config.get_text_config()
    except ValueError:
        return f"{model_type} is a composite model with several text configs (audio / multimodal)"
    if text is config:
        return None
    text_type = getattr(text, "model_type", "?")
    tested = " (checked separately)" if text_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
    return f"composite/multimodal wrapper; its text model is {text_type}{tested}"


def recurrent_model_types() -> list[str]:
    """Every causal-LM ``model_type`` whose modeling file names a recurrent mixer the package serves
    (:mod:`hf_blockdiag_cp.mixer_table`), composite wrappers included (their text model has its own entry)."""
    names = (*SCANS, *METHODS, *WINDOWED, *STATEFUL, *SCAN_MODULES)
    found = []
    for model_type, cls_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        try:
            source = inspect.getsource(inspect.getmodule(getattr(importlib.import_module("transformers"), cls_name)))
        except (AttributeError, ImportError, OSError, TypeError):  # a class this install cannot import
            continue
        if any(name in source for name in names):
            found.append(model_type)
    return found
