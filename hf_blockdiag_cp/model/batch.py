"""What a prepared model's pre-forward hook reads from, and fills into, one batch's arguments.

Host-side only: names, shapes and the context's CPU fields; tensor values are read only by
:func:`packing`, and only for models that will be refused anyway.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from ..context import BlockDiagCPContext
from ..distributed.groups import created_cp_size
from ..planning.documents import run_boundaries
from .detect import require_blockdiag_cp

__all__ = ["arguments", "check_batch", "check_cp_batch", "context_position_ids", "fill_position_ids", "packing",
           "positional_index"]


def check_batch(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Raise ``ValueError`` if a batch with a ``cp_context`` would be silently mis-computed by ``model`` (warn, via
    :func:`check_cp_batch`, when a process with a CP mesh runs a batch without one)."""
    ctx = kwargs.get("cp_context")
    if ctx is None:
        check_cp_batch(kwargs)
        return
    require_blockdiag_cp(model, "the batch carries a cp_context, which its attention would ignore (attending within "
                                "each shard only, or across documents)", allow_unknown=True)
    if getattr(ctx, "cp_size", 1) > 1 and kwargs.get("labels") is not None and kwargs.get("shift_labels") is None:
        raise ValueError(
            "a context-parallel batch carries labels but no shift_labels: the model would shift the labels of "
            "each shard locally, which is wrong at every rank boundary; build batches with "
            "hf_blockdiag_cp.PackingCollator (it adds shift_labels computed on the full row)")


def check_cp_batch(kwargs: dict[str, Any]) -> None:
    """Warn (once per process: Python's default warning filter) when a forward without a ``cp_context`` runs on a
    process for which :func:`~hf_blockdiag_cp.init_device_mesh` built a mesh with ``cp_size > 1``.

    Such a batch (e.g. from ``DataCollatorForLanguageModeling`` in a manual loop) is not sharded: every CP rank runs
    all of it, the CP group does the work of one rank ``cp_size`` times over, and nothing fails. ``CPTrainer``
    refuses such a collator; a model guarded by :func:`~hf_blockdiag_cp.guard_model` says so here. Forwards that are
    meant to run without CP on such a process (``generate()``, a per-rank evaluation) can ignore the warning.
    """
    if kwargs.get("cp_context") is not None:
        return
    cp_size = created_cp_size()
    if cp_size > 1:
        warnings.warn(
            f"this forward has no cp_context, but hf_blockdiag_cp.init_device_mesh built a mesh with cp_size={cp_size} "
            "on this process: the batch is not sharded, so every CP rank runs all of it. Build training batches with "
            "hf_blockdiag_cp.PackingCollator(seq_len, group=mesh['cp'], ...) (or from_flattened(..., "
            "group=mesh['cp'])); forwards meant to run without CP (generate(), a per-rank evaluation) may ignore this",
            UserWarning, stacklevel=3)


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
                f"would number CP rank {ctx.cp_rank}'s rows from 0 instead of by their place in the row; pass the "
                "collator's position_ids (or build the context with BlockDiagCPContext.build(..., position_ids=))")
        return None
    return positions.to(like.device) if like is not None else positions


def positional_index(model: torch.nn.Module, name: str) -> int | None:
    """Index of parameter ``name`` among ``model.forward``'s positional parameters (``None``: keyword only)."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return positional.index(name) if name in positional else None


def fill_position_ids(position_arg: int | None, args: tuple,
                      kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """``(args, kwargs)`` with the ``position_ids`` the batch's ``cp_context`` supplies (see
    :func:`context_position_ids`), or ``None`` to keep them as they are.

    ``position_arg``: where ``position_ids`` stands among the forward's positional parameters (a caller
    may pass it positionally, as ``None``).
    """
    positional = position_arg is not None and len(args) > position_arg
    given = kwargs.get("position_ids")
    if given is None and positional:
        given = args[position_arg]
    tensors = [kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args]
    like = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    positions = context_position_ids(kwargs.get("cp_context"), given, like)
    if positions is None:
        return None
    if positional:
        return (*args[:position_arg], positions, *args[position_arg + 1:]), kwargs
    return args, {**kwargs, "position_ids": positions}


def arguments(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (positional ones bound to the signature, ``**kwargs`` flattened)."""
    if not args:
        return kwargs
    try:
        bound = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
    except TypeError:
        return kwargs
    named = dict(bound)
    for name, param in inspect.signature(module.forward).parameters.items():
        if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
            named.update(named.pop(name))
    return named


def _packed_position_ids(position_ids: Any) -> bool:
    """Whether ``position_ids`` restart inside a row (one host read; only for models being refused)."""
    if not isinstance(position_ids, torch.Tensor) or position_ids.dim() == 0 or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] != position_ids[..., :-1] + 1).any())


def packing(named: dict[str, Any]) -> str | None:
    """What in these forward arguments puts more than one document in a row (or shards a row), or ``None``."""
    ctx = named.get("cp_context")
    if ctx is not None:
        if getattr(ctx, "cp_size", 1) > 1:
            return f"a context-parallel shard (cp_size={ctx.cp_size})"
        ids = getattr(ctx, "doc_ids", None)
        if isinstance(ids, torch.Tensor) and ids.numel():
            if int((run_boundaries(ids) & (ids != 0)).sum(dim=1).max()) > 1:
                return "cp_context with more than one document per row"
    cu = named.get("cu_seq_lens_q")
    if cu is None:
        cu = named.get("cu_seq_lens_k")
    if isinstance(cu, torch.Tensor) and cu.numel() > 2:
        return f"cu_seq_lens_* with {cu.numel() - 1} documents"
    if named.get("past_key_values") is None and named.get("cache") is None:
        if _packed_position_ids(named.get("position_ids")):
            return "packed position_ids (positions restart inside a row)"
    return None
