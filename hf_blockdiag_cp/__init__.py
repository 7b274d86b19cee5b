"""hf-blockdiag-cp: block-diagonal causal attention for packed documents, across context-parallel ranks.

``import hf_blockdiag_cp`` registers ``attn_implementation="blockdiag_cp"`` (and its mask function)
with transformers; see the README for the data flow::

    PackingCollator -> BlockDiagCPContext (host plan, once per step) -> blockdiag_cp attention
    -> K/V exchange (CP ranks) -> kernel backend (flash / te / torch_varlen / flex / sdpa_doc / sdpa_mask)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import config as _config
from . import training
from .attention import blockdiag_attention
from .attention.layer import comm_stats
from .config import KV_EXCHANGES as KV_EXCHANGES
from .config import PLACEMENTS as PLACEMENTS
from .config import BlockDiagCPConfig
from .context import BlockDiagCPContext
from .data import PackedDataset, PackedRow, PackingCollator, from_flattened, sliding_windows
from .errors import (
    AgreementError,
    BlockDiagCPError,
    CollectiveError,
    CPKernelError,
    UnsupportedModel,
)
from .errors import BackendUnavailable as BackendUnavailable
from .errors import ExchangeSizeError as ExchangeSizeError
from .errors import ParameterMismatchError as ParameterMismatchError
from .errors import PlanError as PlanError
from .integration import ATTN_IMPLEMENTATION, register
from .integration import blockdiag_cp_attention as blockdiag_cp_attention
from .model import prepare_model
from .planning.layout import HeadShape
from .training import (
    check_chunked_loss,
    check_collator,
    check_parameters_consistent,
    chunked_causal_lm_loss,
    cp_coordinates,
    dp_dataloader,
    init_device_mesh,
    normalize_num_items,
    reduce_loss_for_logging,
    ulysses_groups,
)
from .training import guard_model as guard_model

if TYPE_CHECKING:
    from .training import CPSFTTrainer, CPTrainer

__version__ = "0.1.0"

#: What users call (at most 30 names). Also importable here, for code written against earlier versions, but not
#: listed: the other exceptions (all in :mod:`hf_blockdiag_cp.errors`, all subclasses of BlockDiagCPError),
#: ``KV_EXCHANGES`` / ``PLACEMENTS`` (:mod:`.config`), ``guard_model`` (the alias of ``prepare_model(model,
#: strict=True)``: model preparation has one name), and the registered attention function with its ``register``
#: (:mod:`.integration`, run on import).
__all__ = [
    "ATTN_IMPLEMENTATION",
    "AgreementError",
    "BACKENDS",
    "BlockDiagCPConfig",
    "BlockDiagCPContext",
    "BlockDiagCPError",
    "CPKernelError",
    "CPSFTTrainer",
    "CPTrainer",
    "CollectiveError",
    "HeadShape",
    "PackedDataset",
    "PackedRow",
    "PackingCollator",
    "UnsupportedModel",
    "blockdiag_attention",
    "check_chunked_loss",
    "check_collator",
    "check_parameters_consistent",
    "chunked_causal_lm_loss",
    "comm_stats",
    "cp_coordinates",
    "dp_dataloader",
    "from_flattened",
    "init_device_mesh",
    "normalize_num_items",
    "prepare_model",
    "reduce_loss_for_logging",
    "sliding_windows",
    "ulysses_groups",
]
register()


def __getattr__(name: str) -> Any:
    if name == "BACKENDS":  # every registered backend, read when asked for (see hf_blockdiag_cp.config)
        return _config.backend_choices()
    # CPTrainer (and whatever else training/ loads lazily) is imported on first use only.
    if name in training._LAZY:
        return getattr(training, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
