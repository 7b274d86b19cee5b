"""What a transformers mask function asks for, read from its structure (never by evaluating it).

transformers builds one ``mask_function(batch_idx, head_idx, q_idx, kv_idx) -> bool`` per mask kind and
forward by composing small closures from ``transformers.masking_utils`` (causal, sliding window,
chunked, packed-sequence, ``and_masks`` / ``or_masks``, ...) and hands it to the registered mask hook.
This module walks that composition and returns a :class:`MaskSpec`: the restrictions the
block-diagonal path implements (causal, a sliding window, Llama 4's chunks, transformers' own packed
document boundaries, bidirectional blocks: ``OR(causal, block)`` of gemma3's image tokens and PaliGemma's
prefix), or a ``refusal`` naming what it does not (a bidirectional mask, a union with another pattern, a
model-defined mask function). Nothing is ever dropped silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compat import MASK_CLOSURES

__all__ = ["MaskSpec", "describe_mask_function"]

_MASKING = "transformers.masking_utils"


@dataclass
class MaskSpec:
    """The attention pattern a mask function describes.

    Attributes:
        causal: ``True`` if the base pattern is causal (``kv_idx <= q_idx``).
        bidirectional: ``True`` if the base pattern is bidirectional (an encoder mask).
        window: keys visible to a query, itself included (``kv_idx > q_idx - window``), or ``None``.
        chunk_size: Llama 4 chunked attention (a query sees only keys of its own chunk), or ``None``.
        chunk_left_padding: ``[B]`` left-padding counts the chunk grid is shifted by (transformers'
            ``chunked_overlay``), or ``None``.
        packed: ``[B, L]`` transformers' packed-sequence index per token (from ``position_ids``;
            tokens with equal values form one document), or ``None`` if it found no packing.
        padding: ``[B, S]`` bool, an extra padding restriction inside the function, or ``None``.
        blocks: ``[B, S]`` transformers' ``block_sequence_ids`` when the pattern is "causal, or same block"
            (``OR(causal, blockwise_overlay)``), or ``None``. Never read: the blocks the layers compute come from
            the step's ``cp_context`` (``block_ids``); this says that the model asks for them.
        block_window_exempt: the window limits the causal part only, not the block's keys
            (``OR(window AND causal, block)``, PaliGemma 2), where gemma3 has ``AND(window, OR(causal, block))``.
        refusal: why the block-diagonal path cannot compute this pattern exactly, or ``None``.
    """

    causal: bool = False
    bidirectional: bool = False
    window: int | None = None
    chunk_size: int | None = None
    chunk_left_padding: torch.Tensor | None = field(default=None, repr=False)
    packed: torch.Tensor | None = field(default=None, repr=False)
    padding: torch.Tensor | None = field(default=None, repr=False)
    blocks: torch.Tensor | None = field(default=None, repr=False)
    block_window_exempt: bool = False
    refusal: str | None = None

    def refuse(self, reason: str) -> None:
        if self.refusal is None:
            self.refusal = reason


def _name(fn: Any) -> str:
    module = getattr(fn, "__module__", None) or type(fn).__module__
    qualname = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{qualname}"


def _nonlocals(fn: Callable) -> dict[str, Any]:
    try:
        return dict(inspect.getclosurevars(fn).nonlocals)
    except (TypeError, ValueError):
        return {}


def describe_mask_function(mask_function: Callable | None) -> MaskSpec:
    """Describe ``mask_function`` (``None``: plain causal, what the hook's default means).

    Only compositions of ``transformers.masking_utils`` building blocks are understood; anything
    else sets ``refusal``. Host-side attribute reads only (no tensor values are read).
    """
    spec = MaskSpec()
    if mask_function is None:
        spec.causal = True
        return spec
    _walk(mask_function, spec)
    if not spec.refusal and not (spec.causal or spec.bidirectional):
        spec.refuse(f"the mask function {_name(mask_function)} has no causal base pattern")
    return spec


def _walk(fn: Callable, spec: MaskSpec) -> None:
    """Add what ``fn`` restricts to ``spec`` (all parts of an AND restrict together)."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", "")
    if module != _MASKING:
        spec.refuse(f"the model composes its own mask function {_name(fn)} into the attention mask")
        return
    free = _nonlocals(fn)
    if qualname == MASK_CLOSURES["causal"]:
        spec.causal = True
    elif qualname == MASK_CLOSURES["bidirectional"]:
        spec.bidirectional = True
    elif qualname == MASK_CLOSURES["and"]:
        for part in free.get("mask_functions", ()):
            _walk(part, spec)
    elif qualname == MASK_CLOSURES["or"]:
        if _causal_or_block(free.get("mask_functions", ()), spec):
            return
        parts = ", ".join(_name(p) for p in free.get("mask_functions", ()))
        spec.refuse(f"the mask is a union of patterns ({parts}), e.g. bidirectional blocks for image tokens or a "
                    "prefix, which is not block-diagonal causal attention")
    elif qualname == MASK_CLOSURES["sliding_window"]:
        window = int(free["sliding_window"])
        spec.window = window if spec.window is None else min(spec.window, window)
    elif qualname == MASK_CLOSURES["chunked"]:
        spec.chunk_size = int(free["chunk_size"])
        spec.chunk_left_padding = free.get("left_padding")
    elif qualname == MASK_CLOSURES["packed_sequence"]:
        spec.packed = free["packed_sequence_mask"]
    elif qualname == MASK_CLOSURES["remap_positions"]:
        # Inside one packed document positions are consecutive, so a causal / window / chunk rule on
        # positions is the same rule on indices counted from the document start.
        _walk(free["mask_function"], spec)
    elif qualname == MASK_CLOSURES["padding"]:
        spec.padding = free["padding_mask"]
    elif qualname == MASK_CLOSURES["bidirectional_sliding_window"]:
        spec.bidirectional = True
        spec.refuse("a bidirectional sliding-window (encoder) mask")
    else:
        spec.refuse(f"the mask function {_name(fn)} is not one blockdiag_cp implements")


def _causal_or_block(parts: tuple[Callable, ...], spec: MaskSpec) -> bool:
    """``OR(causal pattern, blockwise_overlay)`` (gemma3's image tokens, PaliGemma's prefix): record it in ``spec``
    and return ``True``; anything else is another union (``False``). The causal pattern may carry a window (then
    the window does not limit the block's keys) and transformers' position remapping, nothing else."""
    blockwise = [p for p in parts if getattr(p, "__module__", None) == _MASKING
                 and getattr(p, "__qualname__", "") == MASK_CLOSURES["blockwise"]]
    others = [p for p in parts if p not in blockwise]
    if len(blockwise) != 1 or len(others) != 1:
        return False
    base = MaskSpec()
    _walk(others[0], base)
    if (base.refusal or not base.causal or base.bidirectional or base.chunk_size is not None
            or base.packed is not None or base.padding is not None or base.blocks is not None):
        return False
    spec.causal = True
    spec.blocks = _nonlocals(blockwise[0]).get("block_sequence_ids")
    if base.window is not None:
        spec.window = base.window if spec.window is None else min(spec.window, base.window)
        spec.block_window_exempt = True
    return True
