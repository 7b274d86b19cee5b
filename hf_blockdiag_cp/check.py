"""Conformance check: does ``attn_implementation="blockdiag_cp"`` compute exactly what an architecture asks for?

``python -m hf_blockdiag_cp.check MODEL_TYPE_OR_PATH [--cp-size N]`` builds a tiny random model of that
architecture (a ``model_type`` of transformers' causal-LM mapping, or a local ``config.json`` / model
folder, shrunk to a tiny size) and compares packed documents under ``"blockdiag_cp"`` with each
document run alone under the model's stock attention:

- logits (max abs difference) and parameter gradients of the summed next-token loss (relative
  difference of all gradients together), for packed ``position_ids``, for
  ``DataCollatorWithFlattening``-style ``cu_seq_lens_*`` keywords and for :class:`PackingCollator`
  batches (``cp_context``); with ``--cp-size N`` the collator path also runs on ``N`` gloo ranks;
- ``generate()`` (greedy, left-padded batch) token for token against stock attention.

It prints ``exact``, ``refused (why)`` (the package raised ``NotImplementedError`` naming the cause),
``FAIL`` (different numbers, or another error) or ``n/a`` (a composite/multimodal wrapper, or the stock
model itself fails). ``--all`` sweeps every causal LM of the installed transformers, one subprocess per
architecture with a timeout, and writes a Markdown table (``--markdown docs/models.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import inspect
import io
import json
import os
import queue as queue_module
import resource
import socket
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .data import Document, PackedRow, PackingCollator

__all__ = ["CheckResult", "check_model", "main", "tiny_config"]

#: Tolerances of the issue's definition of "exact" (fp32).
LOGITS_ATOL = 1e-4
GRAD_RTOL = 1e-4
#: Document lengths of the packed row: windows (6) and chunks (8) are exceeded, one document has one token.
LENGTHS = (7, 1, 12, 4, 9)
SLIDING_WINDOW = 6
CHUNK_SIZE = 8
VOCAB = 256

EXACT, REFUSED, FAIL, NOT_APPLICABLE = "exact", "refused", "FAIL", "n/a"


@dataclass
class CheckResult:
    """Outcome of one architecture's check.

    Attributes:
        model: the model type or path checked.
        status: ``exact`` / ``refused`` / ``FAIL`` / ``n/a``.
        reason: the refusal message, the failure, or why it does not apply.
        logits_err: worst max-abs logits difference over the packed variants that ran.
        grad_err: worst relative gradient difference over the packed variants that ran.
        generate: ``equal``, ``different``, ``refused``, ``n/a (...)`` or ``not run``.
        variants: per packed variant, ``ok`` / ``refused: ...`` / ``FAIL ...`` / ``skipped: ...``.
        cp_size: ranks of the collator variant.
        seconds: wall time of the check.
    """

    model: str
    status: str = EXACT
    reason: str = ""
    logits_err: float | None = None
    grad_err: float | None = None
    generate: str = "not run"
    variants: dict[str, str] = field(default_factory=dict)
    cp_size: int = 1
    seconds: float = 0.0

    def line(self) -> str:
        nums = []
        if self.logits_err is not None:
            nums.append(f"logits {self.logits_err:.1e}")
        if self.grad_err is not None:
            nums.append(f"grads {self.grad_err:.1e}")
        nums.append(f"generate {self.generate}")
        head = f"{self.model}: {self.status}" + (f" ({self.reason})" if self.reason else "")
        return f"{head} | {', '.join(nums)} | cp_size={self.cp_size} | {self.seconds:.1f} s"


# --------------------------------------------------------------------------------------------- configs

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
}


def _pick_layers(layer_types: Sequence[Any]) -> list[int]:
    """Indices of a small subset of layers covering every distinct layer type (at least two layers)."""
    first: dict[str, int] = {}
    for i, kind in enumerate(layer_types):
        first.setdefault(repr(kind), i)
    picked = sorted(first.values())
    if len(picked) < 2 and len(layer_types) >= 2:
        picked = [picked[0], picked[0] + 1 if picked[0] + 1 < len(layer_types) else picked[0] - 1]
        picked.sort()
    return picked


def _shrink(defaults: dict[str, Any]) -> dict[str, Any]:
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
            picked = _pick_layers(layer_types)
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
    for h, d, e in (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("mamba_num_heads", "mamba_head_dim", "mamba_expand"),
                    ("num_heads", "head_dim", "expand"), ("mamba_n_heads", "mamba_headdim", "mamba_expand"),
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


def _text_config(config: Any) -> Any:
    try:
        return config.get_text_config()
    except (ValueError, AttributeError):
        return config


def tiny_config(model: str) -> Any:
    """A tiny fp32 config of ``model`` (a ``model_type`` or a local config / model folder)."""
    path = Path(model)
    if path.exists():
        base = AutoConfig.from_pretrained(str(path))
        defaults = base.to_dict()
        overrides = {**_shrink(defaults), **CONFIG_FIXES.get(base.model_type, {})}
        return type(base).from_dict({**defaults, **overrides})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            base = AutoConfig.for_model(model)
        except Exception:  # a default config this transformers version rejects (e.g. gemma4_assistant)
            base = AutoConfig.for_model(model, **CONFIG_FIXES.get(model, {}))
        text = _text_config(base)
        if text is not base:
            text_type = getattr(text, "model_type", None)
            if text_type in _causal_lm_names() or text_type is None:
                return base  # a composite wrapper whose text model is its own entry: not checked here
            # The causal LM of a composite type runs on its text config (e.g. mllama, emu3).
            config = AutoConfig.for_model(text_type, **_shrink(vars(text)), **CONFIG_FIXES.get(model, {}))
            config.architectures = [_causal_lm_names()[model]]
            config.torch_dtype = torch.float32
            return config
        overrides = _shrink(vars(base))
        for name in getattr(base, "sub_configs", {}) or {}:  # a model made of several sub-models (e.g. blt)
            sub = getattr(base, name, None)
            if sub is not None and hasattr(sub, "to_dict"):
                overrides[name] = _shrink(vars(sub))
        overrides.update(CONFIG_FIXES.get(model, {}))
        config = AutoConfig.for_model(model, **overrides)
    config.torch_dtype = torch.float32
    return config


# ---------------------------------------------------------------------------------------------- models

def _causal_lm_names() -> dict[str, str]:
    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _composite_reason(model_type: str, config: Any) -> str | None:
    try:
        text = config.get_text_config()
    except ValueError:
        return f"{model_type} is a composite model with several text configs (audio / multimodal)"
    if text is config:
        return None
    text_type = getattr(text, "model_type", "?")
    tested = " (checked separately)" if text_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else ""
    return f"composite/multimodal wrapper; its text model is {text_type}{tested}"


def build_model(config: Any, attn_implementation: str | None, seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` with random weights (seeded), fp32, eval mode."""
    torch.manual_seed(seed)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    names = _causal_lm_names()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A copy: from_config records the attention implementation on the config object it is given.
        config = copy.deepcopy(config)
        if getattr(config, "model_type", None) in names:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32, **kwargs)
        else:  # the text config of a composite type, with its causal LM class named in `architectures`
            model = getattr(transformers, config.architectures[0])._from_config(config, torch_dtype=torch.float32,
                                                                                **kwargs)
    if hasattr(model, "set_default_language"):  # X-MOD needs a language adapter chosen
        model.set_default_language(list(getattr(config, "languages", ["en_XX"]))[0])
    return model.float().eval()


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        for name, value in vars(cfg).items():
            if ("token_id" in name or "token_index" in name) and isinstance(value, int):
                ids.add(value)
            elif ("token_id" in name) and isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def make_documents(config: Any, seed: int = 0, lengths: Sequence[int] = LENGTHS) -> list[torch.Tensor]:
    """Random documents of ``lengths`` tokens avoiding the config's special token ids."""
    vocab = int(getattr(_text_config(config), "vocab_size", VOCAB) or VOCAB)
    allowed = torch.tensor([t for t in range(3, min(vocab, VOCAB)) if t not in _special_ids(config)])
    gen = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, allowed.numel(), (n,), generator=gen)] for n in lengths]


def _accepts(model: torch.nn.Module, name: str) -> bool:
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    if _accepts(model, "use_cache"):
        kwargs.setdefault("use_cache", False)
    out = model(input_ids=input_ids, **kwargs)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits


def _doc_loss(logits: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document (``logits [n, V]``): a packed run must not predict across documents."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``||g - g_ref|| / ||g_ref||`` over all parameters together (a missing gradient counts in full)."""
    num, den = 0.0, 0.0
    for name, g_ref in ref.items():
        g = grads.get(name, torch.zeros_like(g_ref))
        num += float((g.double() - g_ref.double()).pow(2).sum())
        den += float(g_ref.double().pow(2).sum())
    for name, g in grads.items():
        if name not in ref:
            num += float(g.double().pow(2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-30)


def reference_run(model: torch.nn.Module, docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each document alone through ``model`` (stock attention): ``(logits [T, V], gradients)``."""
    model.zero_grad(set_to_none=True)
    logits = [_forward(model, d[None])[0] for d in docs]
    sum(_doc_loss(lg, d) for lg, d in zip(logits, docs)).backward()
    return torch.cat(logits).detach().float(), _grads(model)


def packed_inputs(docs: Sequence[torch.Tensor], variant: str, pad_token_id: int = 0) -> dict[str, Any]:
    """``model(**inputs)`` for the packed row of ``docs`` in the given variant."""
    lengths = [len(d) for d in docs]
    ids = torch.cat(list(docs))[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    if variant == "position_ids":
        return {"input_ids": ids, "position_ids": position_ids}
    if variant == "cu_seq_lens":
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        return {"input_ids": ids, "position_ids": position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": max(lengths), "max_length_k": max(lengths)}
    if variant == "collator":
        return _collated(docs, cp_size=1, cp_rank=0, group=None, pad_token_id=pad_token_id)
    raise ValueError(f"variant={variant!r}")


def _collated(docs: Sequence[torch.Tensor], *, cp_size: int, cp_rank: int, group: Any, pad_token_id: int
              ) -> dict[str, Any]:
    """A :class:`PackingCollator` batch of ``docs`` laid out in order in one row (model inputs only)."""
    total = sum(len(d) for d in docs)
    seq_len = -(-total // cp_size) * cp_size
    collator = PackingCollator(seq_len, cp_size=cp_size, cp_rank=cp_rank, group=group, pad_token_id=pad_token_id)
    row = PackedRow(tuple(Document(d, d.clone(), 0, i) for i, d in enumerate(docs)))
    batch = collator([row])
    return {k: batch[k] for k in ("input_ids", "position_ids", "cp_context")} | {"_shift_labels": batch["shift_labels"]}


def packed_run(model: torch.nn.Module, docs: Sequence[torch.Tensor], inputs: dict[str, Any]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The packed row through ``model``: ``(logits of the real tokens [T, V], gradients)``."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in inputs.items() if not k.startswith("_")}
    logits = _forward(model, **inputs)[0]
    bounds = [0]
    for d in docs:
        bounds.append(bounds[-1] + len(d))
    sum(_doc_loss(logits[a:b], d) for a, b, d in zip(bounds, bounds[1:], docs)).backward()
    return logits[: bounds[-1]].detach().float(), _grads(model)


def _is_refusal(err: BaseException) -> bool:
    seen = err
    while seen is not None:
        if isinstance(seen, NotImplementedError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _first_line(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _generate(model: torch.nn.Module, config: Any, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed + 1)
    vocab = int(getattr(_text_config(config), "vocab_size", VOCAB) or VOCAB)
    prompt = torch.randint(3, min(vocab, VOCAB), (2, 6), generator=gen)
    mask = torch.ones_like(prompt)
    mask[1, :2] = 0  # left padding, as generate() expects
    pad = getattr(_text_config(config), "pad_token_id", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(prompt, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=pad if isinstance(pad, int) else 0)


def check_model(model_name: str, *, cp_size: int = 1, seed: int = 0, generate: bool = True,
                variants: Sequence[str] = ("position_ids", "cu_seq_lens", "collator")) -> CheckResult:
    """Run the packed-vs-alone check of one architecture (see the module docstring)."""
    start = time.monotonic()
    result = CheckResult(model=model_name, cp_size=cp_size)
    try:
        _check(model_name, result, cp_size=cp_size, seed=seed, generate=generate, variants=variants)
    except Exception as err:  # the config or the stock model cannot be built: nothing to compare
        result.status, result.reason = FAIL, f"check crashed: {_first_line(err)}"
        result.variants["traceback"] = traceback.format_exc()[-2000:]
    result.seconds = time.monotonic() - start
    return result


def _check(model_name: str, result: CheckResult, *, cp_size: int, seed: int, generate: bool,
           variants: Sequence[str]) -> None:
    try:
        config = tiny_config(model_name)
    except Exception as err:
        result.status, result.reason = NOT_APPLICABLE, f"no tiny config: {_first_line(err, 200)}"
        return
    composite = _composite_reason(getattr(config, "model_type", model_name), config)
    if composite is not None:
        result.status, result.reason = NOT_APPLICABLE, composite
        return
    try:
        stock = build_model(config, None, seed)
    except Exception as err:
        result.status, result.reason = NOT_APPLICABLE, f"stock model cannot be built: {_first_line(err, 200)}"
        return
    try:  # before the reference: a model refused at load time is refused whatever the stock model does
        ours = build_model(config, "blockdiag_cp", seed)
        ours.load_state_dict(stock.state_dict())
    except Exception as err:
        result.status, result.reason = (REFUSED if _is_refusal(err) else FAIL), _first_line(err)
        return
    docs = make_documents(config, seed)
    try:
        ref_logits, ref_grads = reference_run(stock, docs)
    except Exception as err:
        result.status, result.reason = NOT_APPLICABLE, f"stock model fails on a document alone: {_first_line(err, 200)}"
        return
    pad = getattr(_text_config(config), "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < VOCAB else 0
    worst_logits, worst_grads, refusals, failures = 0.0, 0.0, [], []
    for variant in variants:
        try:
            inputs = packed_inputs(docs, variant, pad_token_id=pad)
            missing = [k for k in inputs if not k.startswith("_") and not _accepts(ours, k)]
            if missing:
                result.variants[variant] = f"skipped: forward takes no {', '.join(missing)}"
                continue
            if variant == "collator" and cp_size > 1:
                logits, grads = run_cp(model_name, config, docs, cp_size, seed, pad)
            else:
                logits, grads = packed_run(ours, docs, inputs)
        except Exception as err:
            if _is_refusal(err):
                result.variants[variant] = f"refused: {_first_line(err)}"
                refusals.append(_first_line(err))
            else:
                result.variants[variant] = f"FAIL: {_first_line(err)}"
                failures.append(f"{variant}: {_first_line(err)}")
                result.variants[f"{variant}_traceback"] = traceback.format_exc()[-2000:]
            continue
        if logits.shape != ref_logits.shape:
            failures.append(f"{variant}: logits shape {tuple(logits.shape)} != {tuple(ref_logits.shape)}")
            result.variants[variant] = "FAIL: shape"
            continue
        err_l = float((logits - ref_logits).abs().max())
        err_g = _grad_error(grads, ref_grads)
        worst_logits, worst_grads = max(worst_logits, err_l), max(worst_grads, err_g)
        ok = err_l <= LOGITS_ATOL and err_g <= GRAD_RTOL
        result.variants[variant] = f"{'ok' if ok else 'FAIL'} logits {err_l:.1e} grads {err_g:.1e}"
        if not ok:
            failures.append(f"{variant}: logits {err_l:.1e}, grads {err_g:.1e}")
    if any(v.startswith(("ok", "FAIL ")) for v in result.variants.values()):
        result.logits_err, result.grad_err = worst_logits, worst_grads
    if generate:
        result.generate = _check_generate(stock, ours, config, seed)
        if result.generate == "different":
            failures.append("generate() differs from stock attention")
        elif result.generate.startswith("refused"):
            refusals.append(f"generate: {result.generate}")
        elif result.generate.startswith("FAIL"):
            failures.append(f"generate: {result.generate}")
    ran = [v for v in result.variants.values() if v.startswith(("ok", "FAIL"))]
    if failures:
        result.status, result.reason = FAIL, "; ".join(failures)
    elif refusals:
        result.status, result.reason = REFUSED, refusals[0]
    elif not ran:
        result.status = REFUSED
        result.reason = "; ".join(f"{k}: {v}" for k, v in result.variants.items())


def _check_generate(stock: torch.nn.Module, ours: torch.nn.Module, config: Any, seed: int) -> str:
    try:
        expected = _generate(stock, config, seed)
    except Exception as err:
        return f"n/a (stock generate fails: {_first_line(err, 120)})"
    try:
        got = _generate(ours, config, seed)
    except Exception as err:
        if _is_refusal(err):
            return f"refused: {_first_line(err, 300)}"
        return f"FAIL: {_first_line(err, 300)}"
    return "equal" if got.shape == expected.shape and torch.equal(got, expected) else "different"


# ------------------------------------------------------------------------------------------ CP on gloo

def run_cp(model_name: str, config: Any, docs: Sequence[torch.Tensor], cp_size: int, seed: int, pad: int
           ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The collator path on ``cp_size`` spawned gloo ranks: ``(logits of the real tokens, gradients)``
    (logits all-gathered, gradients all-reduced over the ranks)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_cp_rank, args=(r, cp_size, port, config, [d.tolist() for d in docs], seed, pad, queue))
             for r in range(cp_size)]
    for p in procs:
        p.start()
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + 300
    try:
        while len(outcome) < cp_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"CP ranks did not finish within 300 s (finished: {sorted(outcome)})")
            try:
                rank, payload = queue.get(timeout=min(remaining, 1.0))
                outcome[rank] = payload
            except queue_module.Empty:
                if all(not p.is_alive() for p in procs) and len(outcome) < cp_size:
                    raise RuntimeError(f"CP ranks exited without a result (codes {[p.exitcode for p in procs]})")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [payload for payload in outcome.values() if isinstance(payload, tuple) and payload[0] == "error"]
    if errors:
        kind, message = errors[0][1], errors[0][2]
        raise (NotImplementedError if kind == "refused" else RuntimeError)(message)
    grads = {name: torch.from_numpy(g) for name, g in outcome[0]["grads"].items()}
    return torch.from_numpy(outcome[0]["logits"]), grads


def _cp_rank(rank: int, world: int, port: int, config: Any, docs: list[list[int]], seed: int, pad: int,
             queue: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        model = build_model(config, "blockdiag_cp", seed)
        tensors = [torch.tensor(d) for d in docs]
        batch = _collated(tensors, cp_size=world, cp_rank=rank, group=dist.group.WORLD, pad_token_id=pad)
        shift = batch.pop("_shift_labels")[0]
        local_index = batch["cp_context"].local_index  # this rank's positions in the row (any placement)
        logits = _forward(model, **batch)[0]
        torch.nn.functional.cross_entropy(logits.float(), shift, ignore_index=-100, reduction="sum").backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            dist.all_reduce(g)
            grads[name] = g
        gathered = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(gathered, logits.detach().contiguous())
        where = [torch.empty_like(local_index) for _ in range(world)]
        dist.all_gather(where, local_index)
        full = torch.empty(world * logits.shape[0], logits.shape[1], dtype=logits.dtype)
        full[torch.cat(where)] = torch.cat(gathered)
        total = sum(len(d) for d in docs)
        full = full[:total].float()
        # numpy arrays, not tensors: torch would send tensors through shared memory that this process frees on exit.
        payload = {"logits": full.numpy(), "grads": {n: g.detach().numpy() for n, g in grads.items()}}
        queue.put((rank, payload if rank == 0 else {"ok": True}))
    except Exception as err:
        queue.put((rank, ("error", "refused" if _is_refusal(err) else "error", _first_line(err))))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ sweep

def causal_lm_types() -> list[str]:
    """Every ``model_type`` of the installed transformers' causal-LM mapping."""
    return list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _limit_memory() -> None:
    """Cap a sweep subprocess's address space (``HF_BLOCKDIAG_CP_CHECK_MAX_GB``, default 10): a config the
    generic shrinking misses raises MemoryError instead of waking the kernel's OOM killer."""
    limit = int(float(os.environ.get("HF_BLOCKDIAG_CP_CHECK_MAX_GB", "10")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _run_isolated(model: str, cp_size: int, timeout: float, python: str) -> CheckResult:
    """One architecture's check in a subprocess (a crash or hang cannot stop the sweep)."""
    cmd = [python, "-m", "hf_blockdiag_cp.check", model, "--cp-size", str(cp_size), "--json"]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ},
                              preexec_fn=_limit_memory)
    except subprocess.TimeoutExpired:
        return CheckResult(model=model, status=FAIL, reason=f"timed out after {timeout:.0f} s", cp_size=cp_size,
                           seconds=time.monotonic() - start)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            result = CheckResult(**json.loads(line))
            result.seconds = time.monotonic() - start  # wall time, process start-up included
            return result
    tail = (proc.stderr or proc.stdout)[-300:].replace("\n", " ")
    return CheckResult(model=model, status=FAIL, reason=f"check process exited with {proc.returncode}: {tail}",
                       cp_size=cp_size, seconds=time.monotonic() - start)


#: Refusal causes by a phrase of their message (first match wins), for the summary of the table.
REFUSAL_CAUSES: tuple[tuple[str, str], ...] = (
    ("does not route attention through", "attention computed outside `AttentionInterface` (refused when the model "
                                         "is loaded)"),
    ("carry state across the whole row", "other token mixers (state-space / linear-attention scans, sequence "
                                         "convolutions, recurrent cells): packed rows with more than one document "
                                         "and CP shards refused"),
    ("forward takes no position_ids", "position embeddings counted from the row start: packed rows refused"),
    ("padding_idx + 1", "positions offset by `padding_idx + 1` (RoBERTa family): packed rows refused"),
    ("reads the attention mask itself", "model code uses the attention mask itself (indexers, additive masks)"),
    ("s_aux", "attention sinks (`s_aux`): no exact kernel yet"),
    ("softcap", "logit softcapping: no exact CPU kernel yet"),
    ("bidirectional", "bidirectional (encoder) attention"),
    ("not causal", "non-causal attention layers (e.g. cross-attention of a composite sub-model)"),
    ("to its attention function", "an attention keyword blockdiag_cp does not implement"),
    ("mask", "a mask pattern blockdiag_cp does not implement"),
)


def refusal_cause(reason: str) -> str:
    """The :data:`REFUSAL_CAUSES` entry a refusal message belongs to (``other`` if none)."""
    return next((cause for phrase, cause in REFUSAL_CAUSES if phrase in reason), "other")


def markdown_table(results: Sequence[CheckResult], *, title: str, seconds: float | None,
                   cp2: Sequence[CheckResult] = ()) -> str:
    """The sweep as Markdown: counts, refusal causes, the CP = 2 sample, then one row per architecture."""
    counts = {s: sum(r.status == s for r in results) for s in (EXACT, REFUSED, FAIL, NOT_APPLICABLE)}
    wall = (seconds if seconds else sum(r.seconds for r in (*results, *cp2))) / 60
    took = f" in {wall:.0f} min on 2 CPU cores (one subprocess per architecture and CP size)"
    lines = [
        f"# {title}",
        "",
        f"Generated by `python -m hf_blockdiag_cp.check --all --cp2-sample 12 --markdown docs/models.md` with "
        f"transformers {transformers.__version__}, torch {torch.__version__.split('+')[0]} (CPU, fp32): "
        f"{len(results)} architectures (every entry of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`){took}.",
        "",
        f"**{counts[EXACT]} exact, {counts[REFUSED]} refused, {counts[FAIL]} FAIL, {counts[NOT_APPLICABLE]} not "
        "applicable.**",
        "",
        "Each architecture is built from a tiny random config (hidden size 64, two layers covering every layer "
        f"type of the architecture, sliding windows of {SLIDING_WINDOW}, chunks of {CHUNK_SIZE}) and a row of "
        f"documents of {', '.join(map(str, LENGTHS))} tokens is compared with each document run alone under the "
        "model's stock attention:",
        "",
        "- *exact*: packed `position_ids`, `cu_seq_lens_*` keywords (as `DataCollatorWithFlattening` emits them) "
        f"and `PackingCollator` batches (`cp_context`) all give logits within {LOGITS_ATOL:g} and gradients within "
        f"{GRAD_RTOL:g} (relative) of the reference, and `generate()` (greedy, left-padded batch) gives the same "
        "tokens as stock attention.",
        "- *refused*: blockdiag_cp raises `NotImplementedError` naming the cause instead of computing something else "
        "(the cause is shown; most refusals concern packed rows only, and one document per row still works).",
        "- *FAIL*: different numbers or another error: a bug.",
        "- *n/a*: composite / multimodal wrappers whose text model is checked as its own entry, and architectures "
        "whose stock model cannot be built or run from a default config in this transformers version.",
        "",
        "Check your own model (a `model_type` or a local config / model folder, shrunk to a tiny size): "
        "`python -m hf_blockdiag_cp.check MODEL_TYPE_OR_PATH [--cp-size 2]`, also installed as "
        "`hf-blockdiag-cp-check`.",
        "",
    ]
    refused = [r for r in results if r.status == REFUSED]
    if refused:
        by_cause: dict[str, list[str]] = {}
        for r in refused:
            by_cause.setdefault(refusal_cause(r.reason), []).append(r.model)
        lines += ["## Why architectures are refused", "", "| cause | architectures |", "|---|---|"]
        for cause, models in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| {cause} | {len(models)}: " + ", ".join(f"`{m}`" for m in models) + " |")
        lines.append("")
    if cp2:
        ok = sum(r.status == EXACT for r in cp2)
        lines += ["## Context parallelism", "",
                  f"At CP = 2 (two gloo ranks, `PackingCollator` batches with the K/V exchange) {ok} of the "
                  f"{len(cp2)} sampled exact architectures are exact:", "",
                  "| model type | result | logits | grads | detail |", "|---|---|---|---|---|"]
        for r in cp2:
            detail = r.reason.replace("|", "\\|")[:300]
            lines.append(f"| `{r.model}` | {r.status} | {_num(r.logits_err)} | {_num(r.grad_err)} | {detail} |")
        lines.append("")
    lines += ["## Every architecture", "", "| model type | result | logits | grads | generate | detail |",
              "|---|---|---|---|---|---|"]
    for r in results:
        detail = r.reason.replace("|", "\\|")
        if len(detail) > 300:
            detail = detail[:297] + "..."
        gen = r.generate if len(r.generate) < 40 else r.generate.split(":")[0]
        lines.append(f"| `{r.model}` | {r.status} | {_num(r.logits_err)} | {_num(r.grad_err)} | "
                     f"{gen.replace('|', '/')} | {detail} |")
    return "\n".join(lines) + "\n"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.0e}"


def read_jsonl(path: Path) -> tuple[list[CheckResult], list[CheckResult]]:
    """``(CP = 1 results, CP > 1 results)`` of a sweep's JSON lines (the last line per model wins)."""
    one: dict[str, CheckResult] = {}
    more: dict[str, CheckResult] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            r = CheckResult(**json.loads(line))
            (one if r.cp_size == 1 else more)[r.model] = r
    return list(one.values()), list(more.values())


def sweep(models: Sequence[str], *, cp_size: int, timeout: float, jsonl: Path | None) -> list[CheckResult]:
    """Check ``models`` one subprocess each; prints one line per model, appends JSON lines to ``jsonl``."""
    done: dict[str, CheckResult] = {}
    if jsonl is not None and jsonl.exists():  # resume an interrupted sweep
        for line in jsonl.read_text().splitlines():
            if line.strip():
                r = CheckResult(**json.loads(line))
                if r.cp_size == cp_size:
                    done[r.model] = r
    results = []
    for i, model in enumerate(models):
        if model in done:
            results.append(done[model])
            continue
        r = _run_isolated(model, cp_size, timeout, sys.executable)
        results.append(r)
        print(f"[{i + 1}/{len(models)}] {r.line()}", flush=True)
        if jsonl is not None:
            with jsonl.open("a") as f:
                f.write(json.dumps(asdict(r)) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hf-blockdiag-cp-check", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="*", help="model_type(s) of transformers' causal-LM mapping, or local "
                                                 "config.json / model folders")
    parser.add_argument("--cp-size", type=int, default=1, help="also run the collator path on N gloo ranks")
    parser.add_argument("--all", action="store_true", help="sweep every causal LM of the installed transformers")
    parser.add_argument("--markdown", type=Path, help="with --all: write the Markdown table here")
    parser.add_argument("--jsonl", type=Path, help="with --all: append results here (and resume from it)")
    parser.add_argument("--timeout", type=float, default=300.0, help="with --all: seconds per architecture")
    parser.add_argument("--cp2-sample", type=int, default=0,
                        help="with --all: also check this many exact architectures at CP=2")
    parser.add_argument("--from-jsonl", action="store_true",
                        help="with --jsonl and --markdown: only rewrite the table from a finished sweep")
    parser.add_argument("--no-generate", action="store_true", help="skip the generate() comparison")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON line")
    parser.add_argument("--verbose", action="store_true", help="print every variant and tracebacks")
    args = parser.parse_args(argv)
    if args.from_jsonl:
        if args.jsonl is None or args.markdown is None:
            parser.error("--from-jsonl needs --jsonl and --markdown")
        one, more = read_jsonl(args.jsonl)
        args.markdown.write_text(markdown_table(one, title="Architecture conformance", seconds=None, cp2=more))
        return 0
    if args.all:
        start = time.monotonic()
        results = sweep(causal_lm_types(), cp_size=1, timeout=args.timeout, jsonl=args.jsonl)
        cp2: list[CheckResult] = []
        if args.cp2_sample:
            exact = [r.model for r in results if r.status == EXACT]
            step = max(1, len(exact) // args.cp2_sample)
            cp2 = sweep(exact[::step][: args.cp2_sample], cp_size=2, timeout=args.timeout, jsonl=args.jsonl)
        seconds = time.monotonic() - start
        counts = {s: sum(r.status == s for r in results) for s in (EXACT, REFUSED, FAIL, NOT_APPLICABLE)}
        print(f"{len(results)} architectures: " + ", ".join(f"{v} {k}" for k, v in counts.items())
              + f" ({seconds / 60:.1f} min)")
        if args.markdown is not None:
            text = markdown_table(results, title="Architecture conformance", seconds=seconds, cp2=cp2)
            args.markdown.write_text(text)
        return 1 if counts[FAIL] else 0
    if not args.model:
        parser.error("name a model type or path, or pass --all")
    status = 0
    for model in args.model:
        sink = io.StringIO() if args.json else None
        with contextlib.redirect_stdout(sink) if sink is not None else contextlib.nullcontext():
            result = check_model(model, cp_size=args.cp_size, generate=not args.no_generate)
        if args.json:
            data = asdict(result)
            if not args.verbose:
                data["variants"] = {k: v for k, v in data["variants"].items() if not k.endswith("traceback")}
            print(json.dumps(data))
        else:
            print(result.line())
            if args.verbose or result.status == FAIL:
                for name, value in result.variants.items():
                    print(f"  {name}: {value}")
        status = status or int(result.status == FAIL)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
