"""Attention functions registered under test-only names, removed again when the test is done."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from hf_blockdiag_cp.integration import blockdiag_cp_mask


@contextlib.contextmanager
def registered_attention(name: str, fn: Callable, mask: Callable = blockdiag_cp_mask) -> Iterator[str]:
    """Register ``fn`` (and the package's mask hook) as ``attn_implementation=name`` for the block."""
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, mask)
    try:
        yield name
    finally:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)
