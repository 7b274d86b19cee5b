"""Fail-fast checks of a training set-up (each error names what to change)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..attention.hf import ATTN_IMPLEMENTATION
from ..context import BlockDiagCPContext
from .mesh import cp_coordinates

__all__ = ["check_batch", "check_collator", "context_position_ids", "guard_model"]


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


def context_position_ids(ctx: Any, given: Any, like: torch.Tensor | None) -> torch.Tensor | None:
    """The ``position_ids`` a forward with context ``ctx`` must get when it was given ``given``: ``None``
    to keep what it has, else this rank's ``[B, L]`` positions from the context (on ``like``'s device).

    Under CP positions are part of the step: without them the model would number each rank's shard
    from 0, which is wrong on every rank but the first (silently, for RoPE and absolute positions).
    Raises ``ValueError`` when they are missing and the context does not know them, or when the given
    ones do not have the context's local length. Host-side only (shapes, no device reads).
    """
    if not isinstance(ctx, BlockDiagCPContext):
        return None
    if given is not None:
        if isinstance(given, torch.Tensor) and given.shape[-1] != ctx.local_len:
            raise ValueError(f"position_ids has {given.shape[-1]} positions per row but the cp_context plans "
                             f"L={ctx.local_len} local rows; pass the collator's position_ids")
        return None
    positions = ctx.local_position_ids
    if positions is None:
        if ctx.cp_size > 1:
            raise ValueError(
                "a context-parallel batch has no position_ids and its cp_context does not know them: the model "
                f"would number CP rank {ctx.cp_rank}'s rows from 0 instead of {ctx.row_offset}; pass the "
                "collator's position_ids (or build the context with BlockDiagCPContext.build(..., position_ids=))")
        return None
    return positions.to(like.device) if like is not None else positions


def _positional_index(model: torch.nn.Module, name: str) -> int | None:
    """Index of parameter ``name`` among ``model.forward``'s positional parameters (``None``: keyword only)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None


def guard_model(model: torch.nn.Module) -> torch.nn.Module:
    """Install the fail-fast checks as a forward pre-hook on ``model`` (idempotent); returns ``model``.

    The hook runs :func:`check_batch`, and supplies a batch's missing ``position_ids`` from its
    ``cp_context`` (or raises under CP when the context does not know them): see
    :func:`context_position_ids`.
    """
    if getattr(model, "_blockdiag_cp_guarded", False):
        return model
    position_arg = _positional_index(model, "position_ids")

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
        check_batch(module, kwargs)
        given = kwargs.get("position_ids")
        if given is None and position_arg is not None and len(args) > position_arg:
            given = args[position_arg]
        tensors = [kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args]
        like = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
        positions = context_position_ids(kwargs.get("cp_context"), given, like)
        if positions is None:
            return None
        if position_arg is not None and len(args) > position_arg:  # passed positionally, as None
            return (*args[:position_arg], positions, *args[position_arg + 1:]), kwargs
        return args, {**kwargs, "position_ids": positions}

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
