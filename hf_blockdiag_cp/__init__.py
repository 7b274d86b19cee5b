"""hf-blockdiag-cp: block-diagonal causal attention for packed documents, across context-parallel ranks.

``import hf_blockdiag_cp`` registers ``attn_implementation="blockdiag_cp"`` (and its mask function)
with transformers; see the README for the data flow::

    PackingCollator -> BlockDiagCPContext (host plan, once per step) -> blockdiag_cp attention
    -> K/V exchange (CP ranks) -> kernel backend (flash / te / torch_varlen / flex / sdpa_doc / sdpa_mask)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import training
from .attention import BlockDiagMask, blockdiag_attention
from .integration import ATTN_IMPLEMENTATION, blockdiag_cp_attention, register
from .config import BACKENDS, KV_EXCHANGES, PLACEMENTS, BlockDiagCPConfig
from .attention.layer import CPKernelError, comm_stats
from .context import BlockDiagCPContext
from .distributed import AgreementError, CollectiveError, ExchangeSizeError
from .kernels import BackendUnavailable
from .data import PackedDataset, PackedRow, PackingCollator, from_flattened, sliding_windows
from .planning import PlanError, VarlenPlan, build_varlen_plan
from .planning.layout import HeadShape
from .training import (
    ParameterMismatchError,
    check_chunked_loss,
    check_collator,
    check_parameters_consistent,
    chunked_causal_lm_loss,
    cp_coordinates,
    dp_dataloader,
    guard_model,
    init_device_mesh,
    normalize_num_items,
    reduce_loss_for_logging,
    ulysses_groups,
)

if TYPE_CHECKING:
    from .training import CPSFTTrainer, CPTrainer

__version__ = "0.1.0"

__all__ = [
    "AgreementError",
    "BackendUnavailable",
    "CPKernelError",
    "CPSFTTrainer",
    "CollectiveError",
    "ExchangeSizeError",
    "HeadShape",
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "BlockDiagCPConfig",
    "BlockDiagCPContext",
    "BlockDiagMask",
    "CPTrainer",
    "KV_EXCHANGES",
    "PLACEMENTS",
    "PackedDataset",
    "PackedRow",
    "PackingCollator",
    "ParameterMismatchError",
    "PlanError",
    "VarlenPlan",
    "blockdiag_attention",
    "blockdiag_cp_attention",
    "build_varlen_plan",
    "check_chunked_loss",
    "check_collator",
    "check_parameters_consistent",
    "chunked_causal_lm_loss",
    "cp_coordinates",
    "dp_dataloader",
    "guard_model",
    "init_device_mesh",
    "normalize_num_items",
    "reduce_loss_for_logging",
    "from_flattened",
    "register",
    "sliding_windows",
    "ulysses_groups",
]

register()


def __getattr__(name: str) -> Any:
    # CPTrainer (and whatever else training/ loads lazily) is imported on first use only.
    if name in training._LAZY:
        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
