"""Loss normalisation for (dp, cp) training: the exact global token mean, whatever the layout.

Each rank's HF causal-LM loss is ``S_r / num_items_in_batch`` where ``S_r`` is the summed
cross-entropy of its local ``shift_labels``. DDP and FSDP average gradients over the ``W = dp * cp``
ranks, so the gradient of the global mean ``sum_r S_r / N`` (``N`` = targets of every row of the
step, over all DP groups) needs ``num_items_in_batch = N / W`` on every rank. CP ranks of one group
share their rows, so ``N`` is the sum of the collator's row counts over the ``dp`` dimension.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .mesh import cp_coordinates

__all__ = ["global_num_items", "normalize_num_items", "reduce_loss_for_logging"]

#: Per default process group: ``"normalized"`` once :func:`normalize_num_items` ran on it, ``"warned"`` once
#: :func:`reduce_loss_for_logging` warned that it had not. Writers: those two functions; an entry goes with its group.
_LOSS_NORMALISATION: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def global_num_items(num_items: int | torch.Tensor, mesh: DeviceMesh | None,
                     device: torch.device | str = "cpu") -> torch.Tensor:
    """``N``: the step's targets summed over the DP groups (one collective over ``dp``; no host read)."""
    total = torch.as_tensor(num_items, dtype=torch.float64 if torch.device(device).type == "cpu" else torch.float32,
                            device=device).clone()
    if mesh is not None and cp_coordinates(mesh).dp_size > 1:
        dist.all_reduce(total, group=mesh["dp"].get_group())
    return total


def normalize_num_items(batch: dict[str, Any], mesh: DeviceMesh | None, *, world_size: int | None = None,
                        device: torch.device | str = "cpu") -> dict[str, Any]:
    """Return ``batch`` with ``num_items_in_batch = N / W`` for gradient-averaging wrappers (DDP/FSDP).

    Args:
        batch: a collator batch (its ``num_items_in_batch`` counts the rows of this micro-batch,
            or of all micro-batches of the step when they came from ``micro_batches``).
        mesh: the (dp, cp) mesh (``None`` on one process).
        world_size: ``W``, the ranks the gradient is averaged over (default: the mesh's size).
        device: where to put the count (the model's device).

    A step without any target (``N = 0``; the collator warns) gets ``N = 1``: its loss is then 0 with
    zero gradients instead of ``0 / 0 = NaN`` (a device-side clamp, no host read).
    """
    if "num_items_in_batch" not in batch:
        raise ValueError("batch has no num_items_in_batch: build it with hf_blockdiag_cp.PackingCollator")
    total = global_num_items(batch["num_items_in_batch"], mesh, device).clamp_min(1)
    world = world_size if world_size is not None else (mesh.size() if mesh is not None else 1)
    if dist.is_initialized():
        _LOSS_NORMALISATION[dist.group.WORLD] = "normalized"
    return {**batch, "num_items_in_batch": total / world}


def reduce_loss_for_logging(loss: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """The true global mean from per-rank losses normalised by :func:`normalize_num_items`.

    ``loss_r = W * S_r / N`` so ``sum_r loss_r / W = sum_r S_r / N``; one all-reduce over the world. Warns once
    (``UserWarning``) when :func:`normalize_num_items` never ran on this process: a loss normalised by the
    collator's own count is already the token mean of the row on every CP rank, and this would return it divided
    by the world size.
    """
    value = loss.detach().clone()
    if mesh is None:
        return value
    world_group = dist.group.WORLD
    if mesh.size() > 1 and _LOSS_NORMALISATION.get(world_group) is None:
        _LOSS_NORMALISATION[world_group] = "warned"
        warnings.warn("reduce_loss_for_logging expects losses of batches passed through normalize_num_items(batch, "
                      "mesh) (num_items_in_batch = N / world size); normalize_num_items has not run on this process, "
                      f"so the value returned is the mean divided by {mesh.size()}", UserWarning, stacklevel=2)
    dist.all_reduce(value)
    return value / mesh.size()
