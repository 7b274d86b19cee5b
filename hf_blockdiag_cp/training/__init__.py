"""Training on a (dp, cp) mesh: the mesh, data sharding over dp, loss normalisation, set-up checks."""

from .checks import check_batch, check_collator, guard_model
from .data import DataParallelShard, dp_dataloader
from .loss import global_num_items, normalize_num_items, reduce_loss_for_logging
from .mesh import cp_coordinates, init_device_mesh
from .trainer import CPTrainer

__all__ = [
    "CPTrainer",
    "DataParallelShard",
    "check_batch",
    "check_collator",
    "cp_coordinates",
    "dp_dataloader",
    "global_num_items",
    "guard_model",
    "init_device_mesh",
    "normalize_num_items",
    "reduce_loss_for_logging",
]
