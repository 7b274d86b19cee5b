"""The transformers integration, in one module: the ``"blockdiag_cp"`` attention function, its mask function's
registration, and every patch of transformers' ``PreTrainedModel`` the package makes.

This module sits above :mod:`hf_blockdiag_cp.attention` (the math, which knows nothing of models) and
:mod:`hf_blockdiag_cp.model` (preparation and refusals); neither imports it.

transformers calls the registered mask function (:mod:`.attention.mask`) once per forward and hands its
:class:`~.attention.mask.BlockDiagMask` to every layer as ``attention_mask``; the layer's attention function here
takes its documents from ``cp_context`` (the collator's per-step context: no host reads at all in the
layers), else from the keyword arguments (:mod:`.attention.keywords`), and runs the plan (:mod:`.attention.core`, or
:mod:`.attention.cp` for a CP shard).

What cannot be computed exactly is refused with ``NotImplementedError`` naming the cause, never
dropped: attention keywords this function does not implement, mask patterns other than those of
:mod:`.attention.mask_spec`, bidirectional masks, model code that uses the mask itself; model-level refusals
(other token mixers, absolute positions, attention that bypasses ``AttentionInterface``) live in
:mod:`hf_blockdiag_cp.model`.

Everything ``import hf_blockdiag_cp`` patches in transformers (:data:`PATCHED_METHODS`): three ``PreTrainedModel``
methods and one ``PreTrainedConfig`` property setter, wrapped.

- ``post_init`` (the end of every model's ``__init__``: ``from_pretrained`` / ``from_config`` /
  ``Model(config)``): prepare a model built with ``attn_implementation="blockdiag_cp"``
  (:func:`~.model.prepare.prepare_model`), so users who only pass the attention name get its refusals; a nested
  sub-config of a vision / audio tower that no model resolved takes the tower's implementation
  (:func:`~.model.subconfigs.fill_unresolved`);
- ``set_attn_implementation``: the string ``"blockdiag_cp"`` on a composite (multimodal) model becomes the
  per-sub-config dict with each tower's stock implementation (:func:`~.model.subconfigs.switch_attn_implementation`),
  then the model switched to ``"blockdiag_cp"`` is prepared (its outermost models using it);
- ``_check_and_adjust_attn_implementation`` (transformers' check of a requested implementation, at
  ``__init__`` and in ``set_attn_implementation``): refuse a model whose attention bypasses
  ``AttentionInterface`` (:func:`~.model.detect.refuse_bypassing_model`) before it is switched;
- ``PreTrainedConfig._attn_implementation``'s setter, where transformers spreads the ``attn_implementation`` of
  ``from_pretrained`` / ``from_config`` / ``Config(attn_implementation=...)`` onto every sub-config: the string
  ``"blockdiag_cp"`` on a composite config is turned into the equivalent dict first, with ``None`` (transformers'
  default: ``"sdpa"`` where the tower supports it, else ``"eager"``) for the towers of other modalities
  (:func:`~.model.subconfigs.spread_attn_implementation`). The text model keeps ``"blockdiag_cp"``, so
  ``AutoModelForImageTextToText.from_pretrained(path, attn_implementation="blockdiag_cp")`` runs images exactly;
  a dict the user gives (``{"text_config": "blockdiag_cp", "vision_config": "blockdiag_cp", ...}``) is applied as
  given (a tower on ``"blockdiag_cp"`` is then refused at its forward).

Models using other implementations are untouched. Each wrapper carries ``_blockdiag_cp_wrapped``; a
transformers release that renames a method makes :func:`patch_transformers` raise ``ImportError``
naming it (tests/model/test_prepare.py checks each one is installed and called).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedConfig, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface

from .attention.core import attend_flat, flat_rows, layer_inputs, resolve_backend
from .attention.cp import attend_sequence
from .attention.keywords import check_keywords, chunked_context_plan, plan_from_kwargs, refuse_appended_keys
from .attention.layer import LayerCall
from .attention.mask import BlockDiagMask, IndexerMask, blockdiag_cp_mask
from .attention.ulysses_path import head_parallel_attention
from .compat import CONFIG_ATTN_PROPERTY
from .config import ATTN_IMPLEMENTATION, BlockDiagCPConfig
from .context import BlockDiagCPContext
from .errors import Refusal
from .kernels import BackendUnavailable
from .model.detect import refuse_bypassing_model, uses_blockdiag_cp
from .model.prepare import attention_context, held_positions, prepare_model
from .model.subconfigs import fill_unresolved, spread_attn_implementation, switch_attn_implementation
from .runtime import DevicePlan, device_plan
from .sparse import query_bounds, selects_everything, served_indices_refusal, sparse_attention
from .sparse.cp import attend_cp

__all__ = ["ATTN_IMPLEMENTATION", "PATCHED_METHODS", "STRATEGIES", "WRAPPED_ATTR", "BlockDiagMask", "LayerCall",
           "blockdiag_cp_attention", "blockdiag_cp_mask", "patch_transformers", "patched_function",
           "prepare_blockdiag_models", "register"]


def _model_type(module: torch.nn.Module, mask: BlockDiagMask | None) -> str:
    if mask is not None and mask.model_type != "this model":
        return mask.model_type
    return getattr(getattr(module, "config", None), "model_type", None) or type(module).__name__


def blockdiag_cp_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: Any, dropout: float = 0.0, scaling: float | None = None,
                           sliding_window: int | None = None, softcap: float | None = None,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention function registered as ``"blockdiag_cp"``.

    Args:
        module: the calling attention layer.
        query: ``[B, Hq, L, D]`` (RoPE applied).
        key, value: ``[B, Hkv, S, D]`` (GQA heads not repeated).
        attention_mask: a :class:`BlockDiagMask` from :func:`blockdiag_cp_mask`, ``None``, or a
            user-made 4-D mask (then run as dense SDPA with that exact mask).
        dropout: attention dropout (transformers passes 0 outside training).
        scaling: softmax scale.
        sliding_window: keys visible to a query (itself included), ``None`` = unlimited; a window in the
            mask function (what transformers' sdpa and eager apply) takes precedence.
        softcap: logit softcapping (flash / flex backends only).
        **kwargs: ``cp_context``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ``indices`` (``[B, L, K]``
            keys selected by a DSA indexer served per document, :mod:`hf_blockdiag_cp.sparse`), ...; any other keyword
            that would change the attention raises ``NotImplementedError``.

    Returns:
        ``(out [B, L, Hq, D], None)``.
    """
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    model_type = _model_type(module, mask)
    check_keywords(module, model_type, kwargs)
    # The one call into model/ per layer: counts the call, and gives layers that drop the model's kwargs (stablelm,
    # nemotron, falcon) the context their forward was given (refusing a call that never got one).
    ctx = kwargs["cp_context"] = attention_context(module, kwargs.get("cp_context"))
    if ctx is None and all(kwargs.get(k) is None for k in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")):
        # A layer its model handed no boundaries (granitemoehybrid): the model's own packed position_ids.
        held = held_positions(module, key.shape[2]) if query.shape[2] == key.shape[2] else None
        if held is not None:
            kwargs["position_ids"] = held
    if isinstance(attention_mask, IndexerMask):
        raise Refusal(f"{model_type}: {type(module).__name__} passed its indexer's mask "
                                  "(attention_mask[:, 0]) to attention; blockdiag_cp cannot serve it")
    if kwargs.get("indices") is not None:
        refusal = served_indices_refusal(module)
        if refusal is not None:
            raise Refusal(f"{model_type}: {refusal}; blockdiag_cp refuses rather than ignore them")
    if not _latent_buffer(kwargs):  # a CP DSA layer's keys are its exchange buffer (hf_blockdiag_cp/sparse/cp.py)
        refuse_appended_keys(mask, query.shape[2], key.shape[2], model_type)  # neither the local rows nor a cache
    if mask is not None:
        if mask.spec.refusal is not None:
            raise Refusal(f"{model_type}: {mask.spec.refusal}; blockdiag_cp cannot serve this mask")
        if mask.spec.bidirectional or not mask.spec.causal:
            raise Refusal(f"{model_type} builds a bidirectional (encoder) attention mask for "
                          f"{type(module).__name__}; blockdiag_cp implements causal attention only")
        # The mask is what transformers' sdpa and eager apply; a layer's own is_causal flag can be stale.
        sliding_window = mask.spec.window
        _check_blocks(module, mask, ctx, model_type, sliding_window)
    elif not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise Refusal(f"{model_type}: blockdiag_cp implements causal (decoder) attention only "
                      f"({type(module).__name__} is not causal)")
    if kwargs.get("output_attentions"):
        warnings.warn("blockdiag_cp does not return attention weights (output_attentions=True is ignored)",
                      stacklevel=2)
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    strategy = _strategy(attention_mask, mask, ctx, kwargs.get("indices") is not None, query.shape, key.shape)
    sinks = kwargs.get("s_aux")
    query, key, value, spec, autocast_off = layer_inputs(query, key, value, dropout_p=dropout, window=sliding_window,
                                                         softcap=softcap, sinks=sinks, check=strategy != "user_mask")
    call = LayerCall(query, key, value, spec, attention_mask, mask, None if mask is None else mask.spec.chunk_size,
                     dropout, scale, sliding_window, softcap, sinks, ctx, kwargs)
    with autocast_off:
        out = STRATEGIES[strategy](call)  # [B*L, Hq, Dv] (or [B, L, Hq, Dv])
    return out.reshape(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _latent_buffer(kwargs: dict[str, Any]) -> bool:
    """Whether the keys are a DSA layer's CP exchange buffer (its served ``expand_kv`` moved the MLA latent)."""
    ctx = kwargs.get("cp_context")
    return kwargs.get("indices") is not None and isinstance(ctx, BlockDiagCPContext) and ctx.cp_size > 1


def _check_blocks(module: torch.nn.Module, mask: BlockDiagMask, ctx: Any, model_type: str,
                  window: int | None) -> None:
    """Bidirectional blocks ("causal, or same block": gemma3's image tokens, PaliGemma's prefix) are served only
    when the model's mask asks for them *and* the step's context carries them (``block_ids``); a mismatch either
    way would compute another pattern, so it is refused (host attribute reads only)."""
    blocks = getattr(ctx, "blocks", None) if isinstance(ctx, BlockDiagCPContext) else None
    spec = mask.spec
    if spec.blocks is not None and blocks is not None and not blocks.count:
        return  # the collator read the rows' token types and found no block (text only): the mask is causal
    if spec.blocks is None:
        if blocks is not None and blocks.count:
            raise Refusal(
                f"{model_type}: the cp_context carries bidirectional blocks (block_ids) but the model's mask for "
                f"{type(module).__name__} has none (e.g. no token_type_ids were given to the model): pass the "
                "documents' token_type_ids to the model, or build the context without block_ids")
        _refuse_bidirectional_layer(module, model_type)
        return
    if blocks is None:
        raise Refusal(
            f"{model_type} builds bidirectional blocks into its attention mask (token_type_ids: gemma3's image "
            "tokens, PaliGemma's image + prompt prefix); blockdiag_cp serves them only from the step's cp_context: "
            "use PackingCollator with the documents' token_type_ids, or BlockDiagCPContext.build(..., "
            "block_ids=...)")
    if window is not None and window not in ctx.window_plans and blocks.reach > window:
        raise Refusal(
            f"{model_type}: {type(module).__name__} has a sliding window of {window} that cuts a bidirectional "
            f"block's keys (a block ends {blocks.reach} tokens after its document start), and the cp_context has no "
            "plan for that window: build it with sliding_windows=hf_blockdiag_cp.sliding_windows(model) "
            "(PackingCollator(sliding_windows=...))")
    if spec.chunk_size is not None:
        raise Refusal(f"{model_type}: bidirectional blocks together with chunked attention "
                      f"(chunk_size={spec.chunk_size}) are not implemented by blockdiag_cp")
    if spec.block_window_exempt and window is not None and blocks.max_len > window:
        raise Refusal(
            f"{model_type}: the mask's sliding window ({window}) does not limit a block's keys, and a block of "
            f"{blocks.max_len} tokens is longer than the window; blockdiag_cp limits every key by the window, "
            "which equals the model's mask only for blocks no longer than the window")


def _refuse_bidirectional_layer(module: torch.nn.Module, model_type: str) -> None:
    """A layer whose config sets ``use_bidirectional_attention`` (PaliGemma's default: its image + prompt prefix is
    bidirectional) under a mask with no bidirectional part: stock attention is not causal there (with no mask to
    apply, sdpa runs the layer unmasked), so the causal result would silently differ."""
    if getattr(module, "is_causal", True) or not getattr(getattr(module, "config", None),
                                                         "use_bidirectional_attention", False):
        return
    raise Refusal(
        f"{model_type}: {type(module).__name__} has use_bidirectional_attention=True (is_causal=False: e.g. "
        "PaliGemma's bidirectional image + prompt prefix) but its mask has no bidirectional blocks; blockdiag_cp "
        "computes causal attention there, which differs. Pass the documents' token_type_ids (the prefix becomes a "
        "bidirectional block) or use attn_implementation='sdpa'")


def _strategy(attention_mask: Any, mask: BlockDiagMask | None, ctx: Any, sparse: bool, q_shape: torch.Size,
              k_shape: torch.Size) -> str:
    """Which entry of :data:`STRATEGIES` serves a call (host attribute reads and shapes only)."""
    if isinstance(attention_mask, torch.Tensor):
        if sparse:
            raise Refusal("blockdiag_cp cannot apply sparse indexer indices together with a "
                                      "user-supplied dense attention_mask")
        return "user_mask"
    if ctx is None:
        return "sparse" if sparse else "keywords"
    if not isinstance(ctx, BlockDiagCPContext):
        raise TypeError(f"cp_context must be a BlockDiagCPContext, got {type(ctx).__name__}")
    buffer = sparse and ctx.cp_size > 1  # the keys are the exchange buffer, checked by the sparse path
    if mask is not None and (mask.q_offset or mask.kv_offset or (k_shape[2] != q_shape[2] and not buffer)):
        raise ValueError("cp_context cannot be combined with a KV cache; pass use_cache=False when training")
    ctx.check_local(q_shape[0], q_shape[2])
    if sparse:
        return "sparse"
    if ctx.cp_size == 1:
        return "local"
    return "sequence" if ctx.ulysses_size == 1 else "head_parallel"


def _run_local(call: LayerCall, plan: DevicePlan, config: BlockDiagCPConfig) -> torch.Tensor:
    """One process holds every row: the plan's kernel over the layer's own K/V (no exchange)."""
    backend = resolve_backend(config, dataclasses.replace(call.spec, noncausal=plan.plan.has_blocks))
    return attend_flat(flat_rows(call.query), flat_rows(call.key), flat_rows(call.value), plan.plan, backend,
                       scale=call.scale, dropout_p=call.dropout, window=call.window, softcap=call.softcap,
                       sinks=call.sinks, config=config, schedules=plan.schedules)


def _user_mask(call: LayerCall) -> torch.Tensor:
    if call.sinks is not None:
        raise Refusal("blockdiag_cp cannot apply attention sinks (s_aux) with a user-supplied "
                      "dense mask")
    return _dense_user_mask(call.query, call.key, call.value, call.attention_mask, call.dropout, call.scale,
                            call.softcap)


def _keywords(call: LayerCall) -> torch.Tensor:
    """No context: the documents come from the keyword arguments (cu_seq_lens / position_ids)."""
    # The mask (built once per forward) read the configuration; without one (a direct call) read it here.
    config = call.mask.config if call.mask is not None else BlockDiagCPConfig()
    return _run_local(call, plan_from_kwargs(call.query, call.key, call.mask, call.kwargs, config), config)


def _local(call: LayerCall) -> torch.Tensor:
    """A context with ``cp_size == 1``: the context's plan (or the chunked one), no exchange."""
    ctx = call.ctx
    if call.chunk_size is None:
        plan = device_plan(ctx, call.query.device, call.window)
    else:
        plan = chunked_context_plan(ctx, call.mask, call.query.device)
    return _run_local(call, plan, ctx.config)


def _sparse(call: LayerCall) -> torch.Tensor:
    """``indices=`` from a DSA indexer served per document: attention over the selected keys, within the same
    plan's bounds as the dense path (the context's, else the keyword arguments'); under CP over the exchange buffer
    of the MLA latent (:func:`~hf_blockdiag_cp.sparse.cp.attend_cp`). When no query may see more keys than it
    selects, the plain block-diagonal kernel (the same result)."""
    for what, value in (("a sliding window", call.window), ("softcap", call.softcap), ("attention sinks", call.sinks),
                        ("chunked attention", call.chunk_size)):
        if value is not None:
            raise Refusal(f"blockdiag_cp's sparse indexer attention does not implement {what}")
    if call.ctx is not None and call.ctx.cp_size > 1:
        return attend_cp(call.ctx, call.query, call.key, call.value, call.kwargs["indices"], scale=call.scale,
                         dropout_p=call.dropout)
    if call.ctx is not None:
        plan, config = device_plan(call.ctx, call.query.device, None), call.ctx.config
    else:
        config = call.mask.config if call.mask is not None else BlockDiagCPConfig()
        plan = plan_from_kwargs(call.query, call.key, call.mask, call.kwargs, config)
    indices = call.kwargs["indices"]
    batch, local_len = call.query.shape[0], call.query.shape[2]
    if indices.dim() != 3 or tuple(indices.shape[:2]) != (batch, local_len):
        raise ValueError(f"indices must be [B={batch}, L={local_len}, K], got shape {tuple(indices.shape)}")
    if selects_everything(plan.plan, indices.shape[-1]):
        return _run_local(call, plan, config)
    return sparse_attention(flat_rows(call.query), flat_rows(call.key), flat_rows(call.value), indices,
                            query_bounds(plan.plan, call.query.device), scale=call.scale, dropout_p=call.dropout,
                            training=call.dropout > 0)


#: How a layer's call is served, by :func:`_strategy`'s answer: each returns ``[B*L, Hq, Dv]`` (or
#: ``[B, L, Hq, Dv]``). A new layout adds one entry and one function in :mod:`hf_blockdiag_cp.attention`.
STRATEGIES: dict[str, Callable[[LayerCall], torch.Tensor]] = {
    "user_mask": _user_mask,  # a caller-built 4-D mask: dense SDPA with that exact mask
    "keywords": _keywords,  # no cp_context: plan from cu_seq_lens / position_ids
    "local": _local,  # cp_context with cp_size == 1
    "sparse": _sparse,  # indices= from a DSA indexer served per document, any CP size (hf_blockdiag_cp/sparse)
    "sequence": attend_sequence,  # cp_size > 1, ulysses_size == 1 (attention/cp.py)
    "head_parallel": head_parallel_attention,  # cp_size > 1, ulysses_size > 1 (attention/ulysses_path.py)
}


def _dense_user_mask(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, dropout: float,
                     scale: float, softcap: float | None) -> torch.Tensor:
    """A caller-built 4-D mask is honoured exactly with dense SDPA (no planning possible)."""
    if softcap is not None:
        raise BackendUnavailable("blockdiag_cp cannot apply softcap with a user-supplied dense mask")
    if mask.dim() != 4:
        raise ValueError(f"attention_mask tensors must be 4-D [B, 1, L, S], got shape {tuple(mask.shape)}")
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., : key.shape[2]],
                                                           dropout_p=dropout, scale=scale,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2)


def register() -> None:
    """Register ``"blockdiag_cp"`` with transformers' attention and mask interfaces and have every model that
    uses it prepared (:func:`hf_blockdiag_cp.model.prepare_model`); idempotent."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)
    patch_transformers()


WRAPPED_ATTR = "_blockdiag_cp_wrapped"


def prepare_blockdiag_models(module: torch.nn.Module) -> None:
    """Prepare the outermost models in ``module`` (itself included) that use ``blockdiag_cp``."""
    if isinstance(module, PreTrainedModel) and uses_blockdiag_cp(module):
        prepare_model(module)
        return
    for child in module.children():
        prepare_blockdiag_models(child)


def _wrap_post_init(original: Callable) -> Callable:
    @functools.wraps(original)
    def post_init(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        if uses_blockdiag_cp(self):
            fill_unresolved(self.config)
            prepare_model(self)
        return out
    return post_init


def _wrap_set_attn_implementation(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_attn_implementation(self: PreTrainedModel, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, switch_attn_implementation(self, attn_implementation), *args, **kwargs)
        prepare_blockdiag_models(self)
        return out
    return set_attn_implementation


def _wrap_check_and_adjust(original: Callable) -> Callable:
    @functools.wraps(original)
    def check_and_adjust(self: PreTrainedModel, attn_implementation: Any, *args: Any, **kwargs: Any) -> Any:
        if attn_implementation == ATTN_IMPLEMENTATION:
            refuse_bypassing_model(self)
        return original(self, attn_implementation, *args, **kwargs)
    return check_and_adjust


def _wrap_attn_implementation_setter(original: Callable) -> Callable:
    @functools.wraps(original)
    def _attn_implementation(self: PreTrainedConfig, value: Any) -> None:
        original(self, spread_attn_implementation(self, value))
    return _attn_implementation


#: ``"Owner.attribute"`` of transformers (5.x) -> the function that wraps it; for a property, its setter is wrapped.
PATCHED_METHODS: dict[str, Callable[[Callable], Callable]] = {
    "PreTrainedModel.post_init": _wrap_post_init,
    "PreTrainedModel.set_attn_implementation": _wrap_set_attn_implementation,
    "PreTrainedModel._check_and_adjust_attn_implementation": _wrap_check_and_adjust,
    f"PreTrainedConfig.{CONFIG_ATTN_PROPERTY}": _wrap_attn_implementation_setter,
}

_OWNERS: dict[str, type] = {"PreTrainedModel": PreTrainedModel, "PreTrainedConfig": PreTrainedConfig}


def patched_function(qualified: str) -> Callable | None:
    """The function now installed for ``qualified`` (a key of :data:`PATCHED_METHODS`): the method, or the
    property's setter; ``None`` when transformers has no such attribute."""
    owner, _, name = qualified.partition(".")
    attribute = inspect.getattr_static(_OWNERS[owner], name, None)
    return attribute.fset if isinstance(attribute, property) else attribute


def patch_transformers() -> None:
    """Wrap the :data:`PATCHED_METHODS` of ``PreTrainedModel`` and ``PreTrainedConfig`` (idempotent)."""
    for qualified, wrap in PATCHED_METHODS.items():
        owner_name, _, name = qualified.partition(".")
        owner = _OWNERS[owner_name]
        original = patched_function(qualified)
        if original is None:
            raise ImportError(f"transformers.{qualified} does not exist in this transformers version: "
                              "hf_blockdiag_cp cannot install its model preparation; use a transformers version "
                              "within the bounds in hf-blockdiag-cp's pyproject.toml")
        if getattr(original, WRAPPED_ATTR, False):
            continue
        wrapper = wrap(original)
        setattr(wrapper, WRAPPED_ATTR, True)
        attribute = inspect.getattr_static(owner, name)
        setattr(owner, name, attribute.setter(wrapper) if isinstance(attribute, property) else wrapper)
