"""Everything ``import hf_blockdiag_cp`` patches in transformers: three ``PreTrainedModel`` methods, wrapped.

- ``post_init`` (the end of every model's ``__init__``: ``from_pretrained`` / ``from_config`` /
  ``Model(config)``): prepare a model built with ``attn_implementation="blockdiag_cp"``
  (:func:`~.prepare.prepare_model`), so users who only pass the attention name get its refusals;
- ``set_attn_implementation``: prepare a model switched to ``"blockdiag_cp"`` (its outermost models
  using it);
- ``_check_and_adjust_attn_implementation`` (transformers' check of a requested implementation, at
  ``__init__`` and in ``set_attn_implementation``): refuse a model whose attention bypasses
  ``AttentionInterface`` (:func:`~.detect.refuse_bypassing_model`) before it is switched.

Models using other implementations are untouched. Each wrapper carries ``_blockdiag_cp_wrapped``; a
transformers release that renames a method makes :func:`patch_transformers` raise ``ImportError``
naming it (tests/attention/test_prepare.py checks each one is installed and called).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel

from ..config import ATTN_IMPLEMENTATION
from .detect import refuse_bypassing_model, uses_blockdiag_cp
from .prepare import prepare_model

__all__ = ["PATCHED_METHODS", "WRAPPED_ATTR", "patch_transformers", "prepare_blockdiag_models"]

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
            prepare_model(self)
        return out
    return post_init


def _wrap_set_attn_implementation(original: Callable) -> Callable:
    @functools.wraps(original)
    def set_attn_implementation(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
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


#: ``PreTrainedModel`` method name -> the function that wraps it (transformers 5.x).
PATCHED_METHODS: dict[str, Callable[[Callable], Callable]] = {
    "post_init": _wrap_post_init,
    "set_attn_implementation": _wrap_set_attn_implementation,
    "_check_and_adjust_attn_implementation": _wrap_check_and_adjust,
}


def patch_transformers() -> None:
    """Wrap the :data:`PATCHED_METHODS` of ``PreTrainedModel`` (idempotent)."""
    for name, wrap in PATCHED_METHODS.items():
        original = getattr(PreTrainedModel, name, None)
        if original is None:
            raise ImportError(f"transformers.PreTrainedModel has no {name} in this transformers version: "
                              "hf_blockdiag_cp cannot install its model preparation; use a transformers version "
                              "within the bounds in hf-blockdiag-cp's pyproject.toml")
        if getattr(original, WRAPPED_ATTR, False):
            continue
        wrapper = wrap(original)
        setattr(wrapper, WRAPPED_ATTR, True)
        setattr(PreTrainedModel, name, wrapper)
