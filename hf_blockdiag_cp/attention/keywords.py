"""Reading transformers' attention keywords into a plan, and refusing the ones that cannot be served.

Without a ``cp_context``, document boundaries come, in order of precedence, from ``cu_seq_lens_q/k``
(``DataCollatorWithFlattening``), packed ``position_ids`` as transformers detected them in the mask hook
(this also serves models that do not pass ``position_ids`` to their layers), packed ``position_ids`` in
the layer's keywords (a position that does not continue the previous one by +1 starts a document), a
2-D padding mask, else one causal sequence per row; with a KV cache the queries are the last ``L``
positions (bottom-right), which is what ``generate()`` needs. Llama 4's chunked attention cuts those
documents (and a ``cp_context``'s) at chunk boundaries. The plan is made once per forward and kept on
the :class:`~.mask.BlockDiagMask`.

Attention keywords this package does not implement (``position_bias``, sparse ``block_indices``, ...) are
refused with ``NotImplementedError`` naming the cause, never dropped.
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..errors import Refusal
from ..planning import (
    VarlenPlan,
    build_varlen_plan,
    doc_ids_from_cu_seqlens,
    doc_ids_from_position_ids,
    plan_from_segments,
)
from ..planning.documents import check_cu_seqlens, run_boundaries, run_starts
from ..planning.varlen import Segment
from ..runtime import DevicePlan
from .mask import BlockDiagMask
from .mask_spec import MaskSpec

__all__ = ["check_keywords", "chunked_context_plan", "plan_from_kwargs", "refuse_appended_keys"]

#: Keywords the attention function reads.
_USED_KEYWORDS = frozenset({
    "cp_context", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "is_causal",
    "output_attentions", "s_aux", "indices",
})
#: Keywords that reach attention functions but do not change what attention computes (transformers'
#: sdpa and flash integrations ignore them too): model/cache/output bookkeeping, loss inputs that the
#: loss reads from the same kwargs, kernel-only hints. (``logits_to_keep`` does not change attention; what it does to
#: the head under CP is refused by the model's pre-hook: :mod:`hf_blockdiag_cp.model.head_refusals`.)
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


def check_keywords(module: torch.nn.Module, model_type: str, kwargs: dict[str, Any]) -> None:
    """Refuse every keyword that would change the attention and that this function does not implement."""
    for name, value in kwargs.items():
        if value is None or name in _IGNORED_KEYWORDS or name in _USED_KEYWORDS:
            continue
        meaning = _KEYWORD_MEANING.get(name, "a keyword blockdiag_cp does not know")
        raise Refusal(
            f"{model_type} passes {name}=<{type(value).__name__}> ({meaning}) to its attention function "
            f"({type(module).__name__}); blockdiag_cp does not implement it and refuses rather than ignore it"
            + ("" if name in _KEYWORD_MEANING else
               ". If it does not change attention, leave it out of the batch passed to model(...)"))


def refuse_appended_keys(mask: BlockDiagMask | None, local_len: int, key_len: int, model_type: str) -> None:
    """Refuse keys the model appended to its local rows itself (neither these rows nor a KV cache).

    ``deepseek_v4``'s attention appends compressed entries to the keys and values (260 keys for 258
    queries) and extends only tensor masks: the mask of this forward says there is no cache (no offsets,
    as many keys as queries), yet the keys are more. Taken for a cache, the extra keys would shift every
    query's document (bottom-right alignment); with a ``cp_context`` they would be blamed on a cache.
    Lengths and the mask's host fields only: ``local_len`` = ``L`` of ``query [B, Hq, L, D]``, ``key_len`` = ``S`` of
    ``key [B, Hkv, S, D]``.
    """
    if mask is None or mask.q_offset or mask.kv_offset:
        return
    if mask.q_length == mask.kv_length == local_len and key_len != local_len:
        raise Refusal(
            f"{model_type} appends keys of its own to the attention ({key_len} keys for {local_len} queries, with no "
            "KV cache in this forward): blockdiag_cp cannot place them in the documents of a packed row or a CP "
            "shard, and refuses rather than take them for a cache")


def _split_chunks(doc_ids: torch.Tensor, positions: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, S]`` ids where each document is cut at multiples of ``chunk_size`` of ``positions [B, S]``
    (Llama 4's chunked attention: a query sees only the keys of its own chunk)."""
    chunk = torch.div(positions, chunk_size, rounding_mode="floor")
    starts = run_boundaries(doc_ids) | run_boundaries(chunk)
    return torch.where(doc_ids != 0, torch.cumsum(starts.to(torch.int64), dim=1), 0)


def _positions_in_documents(doc_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` index of every key within its document (maximal run of one id)."""
    return torch.arange(doc_ids.shape[1]).expand_as(doc_ids) - run_starts(doc_ids)


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


def plan_from_kwargs(query: torch.Tensor, key: torch.Tensor, mask: BlockDiagMask | None, kwargs: dict[str, Any],
                     config: BlockDiagCPConfig) -> DevicePlan:
    """Plan on ``query.device`` for calls without a ``cp_context`` (one host read per forward, cached on the mask).

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
                raise Refusal(f"{mask.model_type}: chunked attention (attention_chunk_size="
                              f"{spec.chunk_size}) with cu_seq_lens_q != cu_seq_lens_k is not implemented")
            found = DevicePlan(plan.to(query.device))
            if mask is not None:
                mask.plans[cache_key] = found
            return found
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
    found = DevicePlan(plan.to(query.device))
    if mask is not None:
        mask.plans[cache_key] = found
    return found


def _plan_from_cu_seqlens(cu_q: Any, cu_k: Any, kwargs: dict[str, Any], batch: int, local_len: int, key_len: int,
                          config: BlockDiagCPConfig) -> tuple[torch.Tensor | None, VarlenPlan | None]:
    """``(doc_ids [S], None)`` when queries and keys share the boundaries, else ``(None, plan)``."""
    if cu_q is None or cu_k is None:
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be given together")
    if batch != 1:
        raise ValueError(f"cu_seq_lens_* describe one flattened row, but the batch has B={batch} rows")
    host_q = check_cu_seqlens(cu_q, local_len, name="cu_seq_lens_q").tolist()
    host_k = check_cu_seqlens(cu_k, key_len, name="cu_seq_lens_k").tolist()
    if len(host_q) != len(host_k):
        raise ValueError(f"cu_seq_lens_q has {len(host_q)} entries but cu_seq_lens_k has {len(host_k)}")
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


def chunked_context_plan(ctx: BlockDiagCPContext, mask: BlockDiagMask, device: torch.device) -> DevicePlan:
    """This rank's plan with every document cut into chunks, over the same K/V buffer as the context's
    plan (built once per forward, on the mask, on ``device``; the step's runtime keeps the context's own plans)."""
    cache_key = (-1, ctx.batch_size, ctx.local_len)
    if cache_key not in mask.plans:
        doc_ids = _chunked(ctx.doc_ids.to(torch.int64), mask.spec, packed=True, first_key=0)
        if ctx.exchange is None:
            plan = build_varlen_plan(doc_ids, local_len=ctx.local_len, validate=ctx.config.validate)
        else:  # the rank's placement, keys looked up through the exchanged buffer's positions
            plan = build_varlen_plan(doc_ids, local_len=ctx.local_len, pieces=ctx.placement.pieces(ctx.cp_rank),
                                     kv_positions=ctx.exchange.for_rank(ctx.cp_rank).buffer_positions,
                                     validate=ctx.config.validate)
        mask.plans[cache_key] = DevicePlan(plan.to(device))
    return mask.plans[cache_key]
