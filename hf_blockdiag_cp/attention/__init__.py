"""Attention entry points: the public function, the plan runner and the transformers integration."""

from .core import attend_flat, blockdiag_attention
from .hf import ATTN_IMPLEMENTATION, BlockDiagMask, blockdiag_cp_attention, blockdiag_cp_mask, register

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockDiagMask",
    "attend_flat",
    "blockdiag_attention",
    "blockdiag_cp_attention",
    "blockdiag_cp_mask",
    "register",
]
