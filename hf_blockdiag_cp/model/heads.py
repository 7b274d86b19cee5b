"""What the package reads from a transformers model config: attribute values (also when set per layer) and the
attention head geometry. The planning code takes a :class:`~hf_blockdiag_cp.planning.layout.HeadShape` and
knows no model config."""

from __future__ import annotations

from typing import Any

from ..errors import Refusal, UnsupportedModel
from ..planning.layout import HeadShape

__all__ = ["config_int", "config_values", "head_shape", "text_config"]


def text_config(config: object) -> object:
    """The text (language model) config of ``config`` (multimodal configs), else ``config`` itself."""
    text = getattr(config, "get_text_config", None)
    return text() if callable(text) else config


def config_values(config: object, name: str) -> tuple[Any, ...]:
    """Attribute ``name`` of a model config: ``(value,)`` (``None`` when absent), or one value per layer when the
    config sets it per layer (transformers' heterogeneous configs, e.g. gemma4's ``head_dim``, refuse a global
    read of such an attribute with ``AmbiguousGlobalPerLayerAttributeError``)."""
    try:
        return (getattr(config, name, None),)
    except RuntimeError as err:
        layers = getattr(config, "per_layer_config", None)
        if type(err).__name__ != "AmbiguousGlobalPerLayerAttributeError" or layers is None:
            raise
        return tuple(getattr(layer, name, None) for layer in layers)


def config_int(config: object, name: str) -> int:
    """A model config's int attribute as one number for the forward agreement: the value (0 when unset), or for
    one set per layer (heterogeneous configs) a position-weighted sum of the layers' values, so that ranks whose
    layers differ disagree."""
    values = config_values(config, name)
    if len(values) == 1:
        return int(values[0] or 0)
    return sum((i + 1) * int(v or 0) for i, v in enumerate(values))


def head_shape(config: object) -> HeadShape:
    """The attention heads of a transformers model config (or a model: its ``.config``; multimodal
    configs: their text config). MLA configs (``qk_nope_head_dim + qk_rope_head_dim``, ``v_head_dim``)
    give ``D != Dv``. :class:`UnsupportedModel` when the config has no attention heads (a pure state-space
    model), ``ValueError`` when it names them in a form this function does not read."""
    config = text_config(getattr(config, "config", config))

    def one(name: str) -> Any:
        values = set(config_values(config, name))
        if len(values) > 1:
            raise Refusal(
                f"{type(config).__name__} sets {name} per layer ({sorted(values, key=str)}): a head-parallel "
                "layout plans one head shape for every layer; use ulysses_size=1 for this model")
        return values.pop()

    hq = one("num_attention_heads")
    if hq is None:  # a pure state-space model (mamba, mamba2, falcon_mamba): no attention heads to split
        raise UnsupportedModel(
            f"{type(config).__name__} names no attention heads (num_attention_heads): a head-parallel layout "
            "(ulysses_size > 1) splits attention heads, and this model has none; use ulysses_size=1 (its recurrent "
            "layers run under CP with recurrent_layout='state' or 'heads'), or pass heads=HeadShape(...) if its heads "
            "go by another name")
    if not isinstance(hq, int):
        raise ValueError(f"{type(config).__name__} has no int num_attention_heads; pass heads=HeadShape(...)")
    hkv = one("num_key_value_heads") or hq
    if one("qk_rope_head_dim") and one("v_head_dim"):
        return HeadShape(hq, hkv, one("qk_nope_head_dim") + one("qk_rope_head_dim"), one("v_head_dim"))
    head_dim = one("head_dim") or (one("hidden_size") or 0) // hq
    return HeadShape(hq, hkv, head_dim)
