"""The transformers integration: the ``"blockdiag_cp"`` attention function and its mask function.

transformers calls the mask function once per forward (per mask kind) and hands its result to every
layer as ``attention_mask``. Ours never builds a dense ``[B, 1, L, S]`` mask: it returns a small
:class:`BlockDiagMask` with the padding mask, cache offsets and the pattern transformers' mask function
composes (:mod:`.mask_spec`: causal, sliding window, Llama 4 chunks, transformers' own packed-document
detection), which also owns the plan derived from keyword arguments, so layers of one forward (and
their recompute) plan once.

Document boundaries, in order of precedence: ``cp_context`` (the collator's per-step context: no
host reads at all in the layers), ``cu_seq_lens_q/k`` (``DataCollatorWithFlattening``), packed
``position_ids`` as transformers detected them in the mask hook (this also serves models that do not
pass ``position_ids`` to their layers), packed ``position_ids`` in the layer's keywords (a position
that does not continue the previous one by +1 starts a document), a 2-D padding mask, else one causal
sequence per row; with a KV cache the queries are the last ``L`` positions (bottom-right), which is
what ``generate()`` needs.

What cannot be computed exactly is refused with ``NotImplementedError`` naming the cause, never
dropped: attention keywords this function does not implement (``position_bias``, sparse
``indices``, ...), mask patterns other than the above, bidirectional masks, model code that uses the
mask itself; model-level refusals (other token mixers, absolute positions, attention that bypasses
``AttentionInterface``) live in :mod:`hf_blockdiag_cp.model`.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..config import ATTN_IMPLEMENTATION, BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..kernels import BackendUnavailable
from ..model import mark_attention_call, patch_transformers
from ..planning import (
    VarlenPlan,
    build_varlen_plan,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    plan_from_segments,
)
from ..planning.varlen import Segment
from .core import attend_flat, autocast_like_sdpa, check_qkv, flat_rows, kernel_spec, resolve_backend
from .cp import cp_attention
from .mask_spec import MaskSpec, describe_mask_function

__all__ = ["ATTN_IMPLEMENTATION", "BlockDiagMask", "blockdiag_cp_attention", "blockdiag_cp_mask", "register"]


#: Keywords the attention function reads.
_USED_KEYWORDS = frozenset({
    "cp_context", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "is_causal",
    "output_attentions", "s_aux",
})
#: Keywords that reach attention functions but do not change what attention computes (transformers'
#: sdpa and flash integrations ignore them too): model/cache/output bookkeeping, loss inputs that the
#: loss reads from the same kwargs, kernel-only hints.
_IGNORED_KEYWORDS = frozenset({
    "use_cache", "cache_position", "past_key_values", "past_key_value", "cache", "layer_idx",
    "output_hidden_states", "output_router_logits", "return_dict", "num_items_in_batch", "labels", "shift_labels",
    "seq_idx", "target_dtype", "deterministic", "position_embeddings", "logits_to_keep", "token_type_ids",
})
#: What the refused keywords mean, for the error message.
_KEYWORD_MEANING = {
    "sinks": "attention sinks in the inkling2 convention",
    "position_bias": "an additive position bias",
    "indices": "sparse attention indices (a DSA-style indexer)",
    "block_indices": "sparse block indices",
    "head_mask": "a head mask",
}


class MaskConsumedError(NotImplementedError):
    """Model code used the attention mask itself (outside the attention function)."""


def _mask_consumed(mask: BlockDiagMask, what: str) -> MaskConsumedError:
    return MaskConsumedError(
        f"{mask.model_type} reads the attention mask itself ({what}); blockdiag_cp cannot serve it: the mask it hands "
        "to the layers is not a tensor, and building the dense [B, 1, L, S] mask would defeat the point. Use "
        "attn_implementation='sdpa' or 'eager' for this model")


@dataclass(eq=False)
class BlockDiagMask:
    """What the mask hook hands to every layer instead of a dense mask.

    Attributes:
        padding_mask: ``[B, kv_length]`` bool (True = real token) for the K/V positions of this
            forward, or ``None``.
        q_offset / kv_offset: absolute position of the first query / key (non-zero with a cache).
        q_length / kv_length: query / key lengths transformers sized the mask for.
        source: the 2-D padding mask transformers passed in (``None`` if none).
        spec: the pattern transformers' mask function asks for (:class:`MaskSpec`: causal, window,
            chunks, transformers' packed-document boundaries, or why it cannot be served).
        model_type: ``config.model_type`` of the model (for messages).
        plans: per-forward plans derived from keyword arguments, by ``(B, L, S)`` of the layer's query
            and keys (owned here, reused by every layer of the forward and by its recompute).

    ``generate()`` with a compilable (static) cache builds the mask once and feeds it back to the
    model as ``attention_mask``; for that round trip the object presents itself as the 2-D padding
    mask it came from (``ndim == 2``, ``.to()`` is a no-op) and :func:`blockdiag_cp_mask` unwraps it.
    Any other use by model code (indexing, arithmetic, tensor attributes, torch functions) raises
    :class:`MaskConsumedError` naming the model, instead of a confusing ``TypeError``.
    """

    padding_mask: torch.Tensor | None
    q_offset: int
    kv_offset: int
    q_length: int
    kv_length: int
    source: torch.Tensor | None = None
    spec: MaskSpec = field(default_factory=lambda: describe_mask_function(None))
    model_type: str = "this model"
    plans: dict[tuple[int, int, int], VarlenPlan] = field(default_factory=dict, repr=False)

    ndim = 2

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.source.shape) if self.source is not None else (0, self.kv_offset + self.kv_length)

    def to(self, *args: Any, **kwargs: Any) -> BlockDiagMask:
        return self

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes the class does not define: model code treating the mask as a tensor.
        if name.startswith("__") or name in _FIELD_NAMES:
            raise AttributeError(name)
        raise _mask_consumed(self, f"attention_mask.{name}")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        mask = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, BlockDiagMask)), None)
        raise _mask_consumed(mask if mask is not None else cls(None, 0, 0, 0, 0),
                             f"{getattr(func, '__name__', func)}(attention_mask, ...)")


def _refuse_operator(name: str) -> Any:
    def operator(self: BlockDiagMask, *args: Any, **kwargs: Any) -> Any:
        raise _mask_consumed(self, f"attention_mask.{name}")
    operator.__name__ = name
    return operator


_FIELD_NAMES = frozenset({"padding_mask", "q_offset", "kv_offset", "q_length", "kv_length", "source", "spec",
                          "model_type", "plans"})
for _op in ("__getitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__and__", "__rand__", "__or__", "__ror__", "__invert__", "__neg__", "__lt__", "__le__", "__gt__",
            "__ge__", "__iter__", "__len__", "__array__", "__float__", "__int__", "__index__"):
    setattr(BlockDiagMask, _op, _refuse_operator(_op))
del _op


def blockdiag_cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                      kv_offset: int = 0, mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                      config: Any = None, **kwargs: Any) -> BlockDiagMask:
    """Mask hook registered with ``AttentionMaskInterface``: records the facts, builds no mask.

    Called once per forward and mask kind; ``mask_function`` is read for the pattern it composes
    (:func:`describe_mask_function`), including transformers' own packed-document detection from
    ``position_ids``, which works even for models that do not pass ``position_ids`` to their layers.
    """
    if isinstance(attention_mask, BlockDiagMask):  # our own mask fed back by generate()
        attention_mask = attention_mask.source
    padding, source = None, attention_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"blockdiag_cp expects a 2-D padding attention_mask, got shape {tuple(attention_mask.shape)}")
        padding = attention_mask.to(torch.bool)
        end = kv_offset + kv_length
        if padding.shape[-1] < end:  # static caches size keys beyond what was seen: those are not real
            padding = torch.nn.functional.pad(padding, (0, end - padding.shape[-1]))
        padding = padding[:, kv_offset:end]
    q_offset = int(q_offset)  # a tensor only for static caches; once per forward, not per layer
    model_type = getattr(config, "model_type", None) or "this model"
    return BlockDiagMask(padding, q_offset, int(kv_offset), int(q_length), int(kv_length), source,
                         spec=describe_mask_function(mask_function), model_type=model_type)


def _split_chunks(doc_ids: torch.Tensor, positions: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, S]`` ids where each document is cut at multiples of ``chunk_size`` of ``positions [B, S]``
    (Llama 4's chunked attention: a query sees only the keys of its own chunk)."""
    chunk = torch.div(positions, chunk_size, rounding_mode="floor")
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = (doc_ids[:, 1:] != doc_ids[:, :-1]) | (chunk[:, 1:] != chunk[:, :-1])
    return torch.where(doc_ids != 0, torch.cumsum(starts.to(torch.int64), dim=1), 0)


def _positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` index of every key within its document (maximal run of one id)."""
    index = torch.arange(doc_ids.shape[1]).expand_as(doc_ids)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run_start = torch.cummax(torch.where(starts, index, 0), dim=1).values
    return index - run_start


def _chunked(doc_ids: torch.Tensor, spec: MaskSpec, packed: bool, first_key: int) -> torch.Tensor:
    """Apply ``spec.chunk_size`` to ``doc_ids [B, S]``: chunk positions count from each packed document's
    start, or (one sequence per row) from the row start shifted by transformers' left-padding count."""
    if packed:
        positions = _positions_in_documents(doc_ids)
    else:
        positions = torch.arange(first_key, first_key + doc_ids.shape[1]).expand_as(doc_ids)
        if spec.chunk_left_padding is not None:
            left = torch.as_tensor(spec.chunk_left_padding).detach().to("cpu", torch.int64).reshape(-1, 1)
            positions = positions - left
    return _split_chunks(doc_ids, positions, spec.chunk_size)


def _plan_from_kwargs(query: torch.Tensor, key: torch.Tensor, mask: BlockDiagMask | None, kwargs: dict[str, Any],
                      config: BlockDiagCPConfig) -> VarlenPlan:
    """Plan for calls without a ``cp_context`` (one host read per forward, cached on the mask).

    Documents come from ``cu_seq_lens_q/k``, else transformers' packed-sequence detection carried by
    the mask function, else packed ``position_ids`` in the keywords, else the padding mask.
    """
    batch, local_len, key_len = query.shape[0], query.shape[2], key.shape[2]
    cache_key = (batch, local_len, key_len)
    if mask is not None and cache_key in mask.plans:
        return mask.plans[cache_key]
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    position_ids = kwargs.get("position_ids")
    spec = mask.spec if mask is not None else None
    padding, row_offset = None, key_len - local_len  # by default the queries are the last rows (bottom-right)
    first_key = 0  # absolute position of key 0
    if mask is not None:
        padding = mask.padding_mask
        if mask.kv_length == key_len and 0 <= mask.q_offset - mask.kv_offset <= key_len - local_len:
            row_offset = mask.q_offset - mask.kv_offset  # static caches: keys past the queries are unused slots
        elif padding is not None:
            padding = padding[:, -key_len:]  # a cache layer keeping fewer keys than the mask was sized for
        first_key = mask.q_offset - row_offset
        if spec.padding is not None:
            extra = spec.padding.to(torch.bool)[:, mask.kv_offset:mask.kv_offset + mask.kv_length][:, -key_len:]
            padding = extra if padding is None else padding & extra
    doc_ids, packed = None, False
    if cu_q is not None or cu_k is not None:
        doc_ids, plan = _plan_from_cu_seqlens(cu_q, cu_k, kwargs, batch, local_len, key_len, config)
        if doc_ids is None:
            if spec is not None and spec.chunk_size is not None:
                raise NotImplementedError(f"{mask.model_type}: chunked attention (attention_chunk_size="
                                          f"{spec.chunk_size}) with cu_seq_lens_q != cu_seq_lens_k is not implemented")
            if mask is not None:
                mask.plans[cache_key] = plan.to(query.device)
            return plan.to(query.device)
        doc_ids, packed = doc_ids.expand(batch, -1), True
    elif spec is not None and spec.packed is not None and local_len == key_len == spec.packed.shape[-1]:
        doc_ids, packed = spec.packed.detach().to("cpu", torch.int64).expand(batch, -1) + 1, True
    elif position_ids is not None and local_len == key_len and row_offset == 0:
        if position_ids.shape[-1] != key_len:
            raise ValueError(f"position_ids has length {position_ids.shape[-1]}, expected {key_len}")
        doc_ids, packed = doc_ids_from_position_ids(position_ids.expand(batch, -1)), True
    else:
        doc_ids = torch.ones(batch, key_len, dtype=torch.int64)
    if padding is not None:
        doc_ids = doc_ids * padding.to("cpu", torch.int64)
    if spec is not None and spec.chunk_size is not None:
        doc_ids = _chunked(doc_ids, spec, packed, first_key)
    plan = build_varlen_plan(doc_ids, local_len=local_len, row_offset=row_offset, validate=config.validate)
    plan = plan.to(query.device)
    if mask is not None:
        mask.plans[cache_key] = plan
    return plan


def _plan_from_cu_seqlens(cu_q: Any, cu_k: Any, kwargs: dict[str, Any], batch: int, local_len: int, key_len: int,
                          config: BlockDiagCPConfig) -> tuple[torch.Tensor | None, VarlenPlan | None]:
    """``(doc_ids [S], None)`` when queries and keys share the boundaries, else ``(None, plan)``."""
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    if batch != 1:
        raise ValueError(f"cu_seq_lens_* describe one flattened row, but the batch has B={batch} rows")
    host_q = torch.as_tensor(cu_q).detach().to("cpu", torch.int64).flatten().tolist()
    host_k = torch.as_tensor(cu_k).detach().to("cpu", torch.int64).flatten().tolist()
    if len(host_q) != len(host_k):
        raise ValueError(f"cu_seq_lens_q has {len(host_q)} entries but cu_seq_lens_k has {len(host_k)}")
    for name, host, bound in (("cu_seq_lens_q", host_q, local_len), ("cu_seq_lens_k", host_k, key_len)):
        if not host or host[0] != 0 or any(b < a for a, b in zip(host, host[1:])) or host[-1] > bound:
            raise ValueError(f"{name}={host[:8]}... must start at 0, not decrease and end <= {bound}")
    lens_q = [b - a for a, b in zip(host_q, host_q[1:])]
    lens_k = [b - a for a, b in zip(host_k, host_k[1:])]
    for name, given, lens in (("max_length_q", kwargs.get("max_length_q"), lens_q),
                              ("max_length_k", kwargs.get("max_length_k"), lens_k)):
        if given is not None and int(given) != max(lens, default=0):
            raise ValueError(f"{name}={int(given)} is not the longest segment ({max(lens, default=0)})")
    if host_q == host_k and local_len == key_len:
        return doc_ids_from_cu_seqlens(host_k, key_len)[None], None
    segments = []
    for i, (nq, nk) in enumerate(zip(lens_q, lens_k)):
        if nq == 0:
            continue
        if nk < nq:
            raise ValueError(f"segment {i} has {nq} queries but only {nk} keys (cu_seq_lens_q/k)")
        segments.append(Segment(host_q[i], nq, host_k[i], nk))
    return None, plan_from_segments(segments, batch_size=1, q_rows=local_len, kv_rows=key_len,
                                    validate=config.validate)


def _check_keywords(module: torch.nn.Module, model_type: str, kwargs: dict[str, Any]) -> None:
    """Refuse every keyword that would change the attention and that this function does not implement."""
    for name, value in kwargs.items():
        if value is None or name in _IGNORED_KEYWORDS or name in _USED_KEYWORDS:
            continue
        meaning = _KEYWORD_MEANING.get(name, "a keyword blockdiag_cp does not know")
        raise NotImplementedError(
            f"{model_type} passes {name}=<{type(value).__name__}> ({meaning}) to its attention function "
            f"({type(module).__name__}); blockdiag_cp does not implement it and refuses rather than ignore it"
            + ("" if name in _KEYWORD_MEANING else
               ". If it does not change attention, leave it out of the batch passed to model(...)"))


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
        **kwargs: ``cp_context``, ``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ...; any
            other keyword that would change the attention raises ``NotImplementedError``.

    Returns:
        ``(out [B, L, Hq, D], None)``.
    """
    mark_attention_call(module)
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    model_type = _model_type(module, mask)
    _check_keywords(module, model_type, kwargs)
    if mask is not None:
        if mask.spec.refusal is not None:
            raise NotImplementedError(f"{model_type}: {mask.spec.refusal}; blockdiag_cp cannot serve this mask")
        if mask.spec.bidirectional or not mask.spec.causal:
            raise NotImplementedError(f"{model_type} builds a bidirectional (encoder) attention mask for "
                                      f"{type(module).__name__}; blockdiag_cp implements causal attention only")
        # The mask is what transformers' sdpa and eager apply; a layer's own is_causal flag can be stale.
        sliding_window = mask.spec.window
    elif not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        raise NotImplementedError(f"{model_type}: blockdiag_cp implements causal (decoder) attention only "
                                  f"({type(module).__name__} is not causal)")
    if kwargs.get("output_attentions"):
        warnings.warn("blockdiag_cp does not return attention weights (output_attentions=True is ignored)",
                      stacklevel=2)
    if sliding_window is not None and sliding_window <= 0:
        sliding_window = None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    query, key, value, autocast_off = autocast_like_sdpa(query, key, value)
    with autocast_off:
        out = _attention(query, key, value, attention_mask, dropout, scale, sliding_window, softcap, kwargs)
    return out.reshape(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, dropout: float,
               scale: float, sliding_window: int | None, softcap: float | None, kwargs: dict[str, Any]) -> torch.Tensor:
    """The body of :func:`blockdiag_cp_attention` on same-dtype inputs: ``[B*L, Hq, Dv]`` (or ``[B, L, Hq, Dv]``)."""
    ctx: BlockDiagCPContext | None = kwargs.get("cp_context")
    batch, local_len = query.shape[0], query.shape[2]
    sinks = kwargs.get("s_aux")  # gpt-oss attention sinks: [Hq] logits joining every softmax denominator
    if isinstance(attention_mask, torch.Tensor):
        if sinks is not None:
            raise NotImplementedError("blockdiag_cp cannot apply attention sinks (s_aux) with a user-supplied dense mask")
        return _dense_user_mask(query, key, value, attention_mask, dropout, scale, softcap)
    mask = attention_mask if isinstance(attention_mask, BlockDiagMask) else None
    chunk_size = mask.spec.chunk_size if mask is not None else None
    if ctx is not None:
        if not isinstance(ctx, BlockDiagCPContext):
            raise TypeError(f"cp_context must be a BlockDiagCPContext, got {type(ctx).__name__}")
        if mask is not None and (mask.q_offset or mask.kv_offset or key.shape[2] != local_len):
            raise ValueError("cp_context cannot be combined with a KV cache; pass use_cache=False when training")
        ctx.check_local(batch, local_len)
        config = ctx.config
        if ctx.cp_size > 1:
            if chunk_size is not None:
                # Chunks only remove keys: the same exchange serves them, with a finer plan over its buffer.
                ctx = dataclasses.replace(ctx, plan=_chunked_context_plan(ctx, mask, query.device))
            return cp_attention(ctx, query, key, value, dropout_p=dropout, scale=scale, window=sliding_window,
                                softcap=softcap, sinks=sinks)
        check_qkv(query, key, value)
        if chunk_size is None:
            plan = ctx.to(query.device).plan
        else:
            plan = _chunked_context_plan(ctx, mask, query.device)
    else:
        check_qkv(query, key, value)
        config = BlockDiagCPConfig()
        plan = _plan_from_kwargs(query, key, mask, kwargs, config)
    spec = kernel_spec(query, key, value, dropout_p=dropout, window=sliding_window, softcap=softcap, sinks=sinks)
    backend = resolve_backend(config, spec)
    return attend_flat(flat_rows(query), flat_rows(key), flat_rows(value), plan, backend, scale=scale,
                       dropout_p=dropout, window=sliding_window, softcap=softcap, sinks=sinks, config=config)


def _chunked_context_plan(ctx: BlockDiagCPContext, mask: BlockDiagMask, device: torch.device) -> VarlenPlan:
    """This rank's plan with every document cut into chunks, over the same K/V buffer as the context's
    plan (built once per forward, on the mask; on ``device``, so the context's device cache is not used)."""
    cache_key = (-1, ctx.batch_size, ctx.local_len)
    if cache_key not in mask.plans:
        doc_ids = _chunked(ctx.doc_ids.to(torch.int64), mask.spec, packed=True, first_key=0)
        if ctx.exchange is None:
            plan = build_varlen_plan(doc_ids, local_len=ctx.local_len, validate=ctx.config.validate)
        else:  # the rank's placement, keys looked up through the exchanged buffer's positions
            plan = build_varlen_plan(doc_ids, local_len=ctx.local_len, pieces=ctx.placement.pieces(ctx.cp_rank),
                                     kv_positions=ctx.exchange.for_rank(ctx.cp_rank).buffer_positions,
                                     validate=ctx.config.validate)
        mask.plans[cache_key] = plan.to(device)
    return mask.plans[cache_key]


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


