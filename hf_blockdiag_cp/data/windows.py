"""The attention windows of a model, for the collator's per-window plans and the work model."""

from __future__ import annotations

from typing import Any

__all__ = ["sliding_windows"]


def sliding_windows(model_or_config: Any) -> tuple[int | None, ...]:
    """Distinct attention windows of a transformers model or config: ``None`` for full-attention
    layers, an int for sliding-window layers (``config.layer_types`` where the model has it, else
    ``config.sliding_window`` for every layer).

    Pass the result as ``PackingCollator(..., sliding_windows=...)``. A wrong answer is never
    inexact: a layer whose window was not planned uses the full plans (it only moves more K/V).
    """
    config = getattr(model_or_config, "config", model_or_config)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return (None,)
    types = getattr(config, "layer_types", None)
    if types:
        found = {window if kind == "sliding_attention" else None for kind in types}
    else:
        found = {window if getattr(config, "use_sliding_window", True) else None}
    return tuple(sorted(found, key=lambda w: (w is not None, w or 0)))
