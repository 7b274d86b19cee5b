"""Fail-fast checks of a training set-up (each error names what to change)."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..attention.hf import ATTN_IMPLEMENTATION
from .mesh import cp_coordinates

__all__ = ["check_batch", "check_collator", "guard_model"]


def check_batch(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise if a batch with a ``cp_context`` would be silently mis-computed by ``model``."""
    ctx = kwargs.get("cp_context")
    if ctx is None:
        return
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation is not None and implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"the batch carries a cp_context but the model's attn_implementation is {implementation!r}: its "
            "attention would ignore the context and attend within each shard only (or across documents). Load it "
            f"with attn_implementation={ATTN_IMPLEMENTATION!r} or call model.set_attn_implementation"
            f"({ATTN_IMPLEMENTATION!r})")
    if getattr(ctx, "cp_size", 1) > 1 and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "a context-parallel batch carries labels but no shift_labels: the model would shift the labels of "
            "each shard locally, which is wrong at every rank boundary; build batches with "
            "hf_blockdiag_cp.PackingCollator (it adds shift_labels computed on the full row)")


def guard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Install :func:`check_batch` as a forward pre-hook on ``model`` (idempotent); returns ``model``."""
    if getattr(model, "_blockdiag_cp_guarded", False):
        return model

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        check_batch(module, kwargs)

    model.register_forward_pre_hook(hook, with_kwargs=True)
    model._blockdiag_cp_guarded = True
    return model


def check_collator(collator: Any, mesh: DeviceMesh | None) -> None:
    """Raise if the collator's CP layout disagrees with the mesh."""
    coords = cp_coordinates(mesh)
    size, rank = getattr(collator, "cp_size", 1), getattr(collator, "cp_rank", 0)
    if size != coords["cp_size"] or rank != coords["cp_rank"]:
        raise ValueError(f"the collator shards rows for cp_size={size}, cp_rank={rank} but the mesh has "
                         f"cp_size={coords['cp_size']}, cp_rank={coords['cp_rank']}; build it with group=mesh['cp']")
