"""The ``"blockdiag_cp"`` mask function and what it hands to the layers: :class:`BlockDiagMask`.

transformers calls the mask function once per forward (per mask kind) and hands its result to every
layer as ``attention_mask``. Ours never builds a dense ``[B, 1, L, S]`` mask: it returns a small
:class:`BlockDiagMask` with the padding mask, cache offsets and the pattern transformers' mask function
composes (:mod:`.mask_spec`: causal, sliding window, Llama 4 chunks, transformers' own packed-document
detection), which also owns the plans derived from keyword arguments, so layers of one forward (and
their recompute) plan once. Model code that uses the mask itself is refused (:class:`MaskConsumedError`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import BlockDiagCPConfig
from ..errors import MaskConsumedError
from ..runtime import DevicePlan
from .mask_spec import MaskSpec, describe_mask_function

__all__ = ["BlockDiagMask", "IndexerMask", "MaskConsumedError", "blockdiag_cp_mask"]


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
        plans: per-forward device plans (with their kernel schedules) derived from keyword arguments, by
            ``(B, L, S)`` of the layer's query and keys (owned here, reused by every layer of the forward
            and by its recompute).
        config: the configuration of calls without a ``cp_context``, read (environment variables included)
            once per forward, when transformers builds the mask, not in every layer.

    ``generate()`` with a compilable (static) cache builds the mask once and feeds it back to the
    model as ``attention_mask``; for that round trip the object presents itself as the 2-D padding
    mask it came from (``ndim == 2``, ``.to()`` is a no-op) and :func:`blockdiag_cp_mask` unwraps it.
    Any other use by model code (indexing, arithmetic, tensor attributes, torch functions) raises
    :class:`MaskConsumedError` naming the model, instead of a confusing ``TypeError``; the one exception is
    ``attention_mask[:, 0, :, :]``, what DSA attention layers hand their indexer: an :class:`IndexerMask`, which
    the package's served indexers read (:mod:`hf_blockdiag_cp.sparse.indexer`) and which refuses every other use.
    """

    padding_mask: torch.Tensor | None
    q_offset: int
    kv_offset: int
    q_length: int
    kv_length: int
    source: torch.Tensor | None = None
    spec: MaskSpec = field(default_factory=lambda: describe_mask_function(None))
    model_type: str = "this model"
    plans: dict[tuple[int, int, int], DevicePlan] = field(default_factory=dict, repr=False)
    config: BlockDiagCPConfig = field(default_factory=BlockDiagCPConfig, repr=False)

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


#: ``attention_mask[:, 0, :, :]`` (and ``[:, 0]``): DSA attention layers' mask for their indexer ``[B, S, T]``.
_INDEXING = "attention_mask.__getitem__"
_INDEXER_KEYS = ((slice(None), 0, slice(None), slice(None)), (slice(None), 0))


def _getitem(self: BlockDiagMask, key: Any) -> IndexerMask:
    if isinstance(key, tuple) and all(type(x) in (slice, int) for x in key) and key in _INDEXER_KEYS:
        return IndexerMask(self)
    raise _mask_consumed(self, _INDEXING)


@dataclass(eq=False)
class IndexerMask:
    """``mask[:, 0, :, :]`` of a :class:`BlockDiagMask`: what a DSA attention layer hands its indexer.

    Served indexers (:mod:`hf_blockdiag_cp.sparse.indexer`) read ``mask`` (padding, offsets, model type) and take
    the documents from the forward's preparation; any other use (a stock indexer's ``masked_fill``, ``dtype``)
    raises :class:`MaskConsumedError` naming the indexing (``attention_mask.__getitem__``), as the full mask did
    before indexers were served. It is not an attention mask: an attention function given one refuses it.
    """

    mask: BlockDiagMask

    ndim = 3

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "mask":
            raise AttributeError(name)
        raise _mask_consumed(self.mask, _INDEXING)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        found = next((a for a in (*args, *(kwargs or {}).values()) if isinstance(a, IndexerMask)), None)
        mask = found.mask if found is not None else BlockDiagMask(None, 0, 0, 0, 0)
        raise _mask_consumed(mask, _INDEXING)


def _refuse_operator(name: str) -> Any:
    def operator(self: BlockDiagMask | IndexerMask, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, IndexerMask):
            raise _mask_consumed(self.mask, _INDEXING)
        raise _mask_consumed(self, f"attention_mask.{name}")
    operator.__name__ = name
    return operator


_FIELD_NAMES = frozenset({"padding_mask", "q_offset", "kv_offset", "q_length", "kv_length", "source", "spec",
                          "model_type", "plans"})
for _op in ("__getitem__", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
            "__and__", "__rand__", "__or__", "__ror__", "__invert__", "__neg__", "__lt__", "__le__", "__gt__",
            "__ge__", "__iter__", "__len__", "__array__", "__float__", "__int__", "__index__"):
    setattr(BlockDiagMask, _op, _refuse_operator(_op))
    setattr(IndexerMask, _op, _refuse_operator(_op))
del _op
BlockDiagMask.__getitem__ = _getitem


def blockdiag_cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                      kv_offset: int = 0, mask_function: Any = None, attention_mask: torch.Tensor | None = None,
                      config: Any = None, **kwargs: Any) -> BlockDiagMask:
    """Mask hook registered with ``AttentionMaskInterface``: records the facts, builds no mask.

    Called once per forward and mask kind; ``mask_function`` is read for the pattern it composes
    (:func:`describe_mask_function`), including transformers' own packed-document detection from
    ``position_ids``, which works even for models that do not pass ``position_ids`` to their layers.
    """
    outer = None
    if isinstance(attention_mask, BlockDiagMask):  # our own mask fed back (generate(), or an inner text model)
        outer, attention_mask = attention_mask, attention_mask.source
    padding, source = None, attention_mask
    if attention_mask is not None:
        if attention_mask.dim() != 2:
            raise ValueError(f"blockdiag_cp expects a 2-D padding attention_mask, got shape "
                             f"{tuple(attention_mask.shape)}")
        padding = attention_mask.to(torch.bool)
        end = kv_offset + kv_length
        if padding.shape[-1] < end:  # static caches size keys beyond what was seen: those are not real
            padding = torch.nn.functional.pad(padding, (0, end - padding.shape[-1]))
        padding = padding[:, kv_offset:end]
    q_offset = int(q_offset)  # a tensor only for static caches; once per forward, not per layer
    model_type = getattr(config, "model_type", None) or "this model"
    spec = describe_mask_function(mask_function)
    if outer is not None:
        _keep_outer(spec, outer.spec)
    return BlockDiagMask(padding, q_offset, int(kv_offset), int(q_length), int(kv_length), source,
                         spec=spec, model_type=model_type)


def _keep_outer(spec: MaskSpec, outer: MaskSpec) -> None:
    """A composite model's text model (PaliGemma's Gemma) builds its mask again from the mask the outer model
    built: what the outer one asked for beyond the inner causal pattern (a refusal) must not be lost."""
    if outer.refusal is not None:
        spec.refuse(outer.refusal)
    if outer.blocks is not None and spec.blocks is None:
        spec.blocks, spec.block_window_exempt = outer.blocks, outer.block_window_exempt
