"""Attention math and plumbing: the plan runner, the CP exchange paths and the run-time state of a step.

Knows nothing of transformers models: the registered attention function lives in
:mod:`hf_blockdiag_cp.integration`, model preparation in :mod:`hf_blockdiag_cp.model`.
"""

from .core import attend_flat, blockdiag_attention
from .mask import BlockDiagMask, blockdiag_cp_mask

__all__ = [
    "BlockDiagMask",
    "attend_flat",
    "blockdiag_attention",
    "blockdiag_cp_mask",
]
