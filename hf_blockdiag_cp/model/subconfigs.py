"""Which attention a composite (multimodal) model's sub-configs get when it is asked for ``"blockdiag_cp"``.

transformers spreads a string ``attn_implementation`` onto every sub-config, so ``"blockdiag_cp"`` would also reach
the vision / audio towers, whose attention is bidirectional over one image or clip: blockdiag_cp refuses them, and
every forward with ``pixel_values`` would fail. A tower never sees the packed text row (it runs over each image on
its own), so transformers' own exact attention computes it exactly. The string is therefore turned into the
per-sub-config form transformers also accepts (``{"": ..., "text_config": ..., "vision_config": ...}``) before it is
spread (:func:`spread_attn_implementation`):

- the model itself, its text config and every sub-config that holds the text config keep ``"blockdiag_cp"``;
- a sub-config named after another modality (:data:`OTHER_MODALITY`: ``vision_config``, ``audio_config``,
  ``video_config``, ``speech_config``, ``image_config``, ...) gets ``None``, which transformers resolves when it
  builds that tower to its default: ``"sdpa"`` where the tower supports it, else ``"eager"``
  (:func:`tower_attn_implementation` when the model is already built);
- every other sub-config (a Q-Former, a perceiver resampler, an adapter, the text encoder of an encoder-decoder,
  a speech model's ``encoder_config``) keeps ``"blockdiag_cp"``: it may read the packed text row, so it gets the
  package's attention or its refusal, never a silent stock attention over the whole row.

A dict the user gives is applied as given. A nested sub-config of a tower that no model resolved takes the
tower's implementation afterwards (:func:`fill_unresolved`), as a string spread would have given it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from transformers import PreTrainedModel

from ..compat import config_attn_implementation, set_config_attn_implementation, stock_attn_implementation
from ..config import ATTN_IMPLEMENTATION

__all__ = ["OTHER_MODALITY", "fill_unresolved", "routed_subconfigs", "spread_attn_implementation",
           "switch_attn_implementation", "tower_attn_implementation"]

#: Names (sub-config keys, module paths) of another modality's encoder: it runs over images / audio, not the text row.
OTHER_MODALITY = re.compile(r"(^|[._])(audio|vision|visual|image|speech|video)", re.IGNORECASE)


def _text_config(config: Any) -> Any:
    """The decoder's text config of ``config`` (``None`` when transformers finds several)."""
    try:
        return config.get_text_config(decoder=True)
    except (ValueError, AttributeError):
        return None


def _holds(config: Any, target: Any) -> bool:
    """Whether ``target`` is ``config`` or nested in it."""
    if config is target:
        return True
    return any(_holds(sub, target) for _, sub in _subconfigs(config))


def _subconfigs(config: Any) -> Iterator[tuple[str, Any]]:
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield key, sub


def routed_subconfigs(config: Any) -> dict[str, Any]:
    """``key -> sub-config`` of ``config``'s towers of other modalities (empty for a model without a separate text
    config): the sub-configs :func:`spread_attn_implementation` takes off ``"blockdiag_cp"``."""
    text = _text_config(config)
    if text is None or text is config:
        return {}
    return {key: sub for key, sub in _subconfigs(config) if OTHER_MODALITY.search(key) and not _holds(sub, text)}


def spread_attn_implementation(config: Any, value: Any) -> Any:
    """What ``config`` should spread in place of ``value``: the per-sub-config dict for the string ``"blockdiag_cp"``
    on a composite config (towers of other modalities ``None``), ``value`` itself otherwise."""
    if not isinstance(value, str) or value != ATTN_IMPLEMENTATION:
        return value
    towers = routed_subconfigs(config)
    if not towers:
        return value
    return {"": value, **{key: (None if key in towers else value) for key, _ in _subconfigs(config)}}


def tower_attn_implementation(model: torch.nn.Module, config: Any) -> str:
    """transformers' default attention for the tower of ``model`` built from ``config`` (``"sdpa"`` where it supports
    it, else ``"eager"``); ``"eager"`` when no model in ``model`` is built from ``config`` (nothing to ask)."""
    tower = next((sub for sub in model.modules() if isinstance(sub, PreTrainedModel) and sub.config is config), None)
    return "eager" if tower is None else stock_attn_implementation(tower)


def fill_unresolved(config: Any) -> None:
    """Give every sub-config below a tower of ``config`` whose implementation is still ``None`` (no model in the
    tower was built from it) its parent's implementation."""
    def fill(parent: Any) -> None:
        for _, sub in _subconfigs(parent):
            if config_attn_implementation(sub) is None and config_attn_implementation(parent) is not None:
                set_config_attn_implementation(sub, config_attn_implementation(parent))
            fill(sub)

    for tower in routed_subconfigs(config).values():
        fill(tower)


def switch_attn_implementation(model: torch.nn.Module, value: Any) -> Any:
    """What ``model.set_attn_implementation`` should apply in place of ``value``: for the string ``"blockdiag_cp"`` on
    a composite model, the per-sub-config dict with each tower's :func:`tower_attn_implementation` (a built model can
    be asked; transformers' ``set_attn_implementation`` refuses ``None`` for a sub-config no model was built from)."""
    config = getattr(model, "config", None)
    if not isinstance(value, str) or value != ATTN_IMPLEMENTATION or config is None:
        return value
    towers = routed_subconfigs(config)
    if not towers:
        return value
    return {"": value, **{key: (tower_attn_implementation(model, sub) if key in towers else value)
                          for key, sub in _subconfigs(config)}}
