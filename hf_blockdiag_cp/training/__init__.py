"""Training on a (dp, cp) mesh: the mesh, data sharding over dp, loss normalisation, set-up checks,
parameter consistency across the CP group, ending the process groups at exit.

``CPTrainer`` is loaded on first use: importing ``transformers.trainer`` is most of the package's
import time, and every spawned rank would pay it even when it never builds a Trainer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .checks import check_collator, guard_model
from .chunked_loss import check_chunked_loss, chunked_causal_lm_loss
from .consistency import ParameterMismatchError, check_parameters_consistent
from .data import DataParallelShard, dp_dataloader
from .loss import global_num_items, normalize_num_items, reduce_loss_for_logging
from .mesh import CPCoordinates, check_group_timeouts, cp_coordinates, init_device_mesh, ulysses_groups
from .shutdown import close_process_groups

if TYPE_CHECKING:
    from .trainer import CPTrainer
    from .trl import CPSFTTrainer

#: Public names loaded lazily, and the module that defines each.
_LAZY: dict[str, str] = {"CPTrainer": ".trainer", "CPSFTTrainer": ".trl"}  # .trl needs the [trl] extra

__all__ = [
    "CPCoordinates",
    "CPSFTTrainer",
    "CPTrainer",
    "DataParallelShard",
    "ParameterMismatchError",
    "check_chunked_loss",
    "check_collator",
    "close_process_groups",
    "check_parameters_consistent",
    "chunked_causal_lm_loss",
    "check_group_timeouts",
    "cp_coordinates",
    "dp_dataloader",
    "global_num_items",
    "guard_model",
    "init_device_mesh",
    "normalize_num_items",
    "reduce_loss_for_logging",
    "ulysses_groups",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value  # later lookups skip this hook
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
