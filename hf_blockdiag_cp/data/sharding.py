"""From full rows to one CP rank's batch: resolve the CP topology, build the context, gather.

The context's placement decides which ``L = S / cp_size`` positions of the full row of ``S`` tokens
a rank holds (``BlockDiagCPContext.local_index``, ascending); every per-token tensor of the batch is
the full row's tensor at those positions. Labels are shifted on the full row before this, so
permuting tokens never changes what a token predicts.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from .._validate import check_int
from ..compat import accelerate_dispatching_processes
from ..config import BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..planning.media import plan_media
from .multimodal import RowMedia, media_batch
from .rows import FullRows

__all__ = ["check_not_dispatched", "rank_batch", "resolve_cp", "row_multiple"]

#: What to do when accelerate dispatches batches (see :func:`check_not_dispatched`).
DISPATCH_FIX = ("pass TrainingArguments(accelerator_config={'dispatch_batches': False}) so that every process "
                "collates its own rows, or use hf_blockdiag_cp.CPTrainer (it does so itself)")


def resolve_cp(group: Any, cp_rank: int | None, cp_size: int | None) -> tuple[int, int, Any]:
    """``(cp_rank, cp_size, process_group)`` from a ``ProcessGroup``, a 1-D ``DeviceMesh`` or explicit ints.

    Explicit ``cp_rank`` / ``cp_size`` must agree with ``group`` when both are given.
    """
    process_group = group
    if group is not None:
        if isinstance(group, DeviceMesh):
            if group.ndim != 1:
                raise ValueError(f"group: a DeviceMesh must be 1-D (the CP dimension), got {group.ndim}-D "
                                 f"{group.mesh_dim_names}; pass mesh['cp']")
            group_rank, group_size, process_group = group.get_local_rank(), group.size(), group.get_group()
        else:
            if not dist.is_initialized():
                raise ValueError("group: torch.distributed is not initialized")
            group_rank, group_size = dist.get_rank(group), dist.get_world_size(group)
            if group_rank < 0:
                raise ValueError("group: this process is not a member of the given process group")
        if cp_size is not None and cp_size != group_size:
            raise ValueError(f"cp_size={cp_size} disagrees with the group's size {group_size}")
        if cp_rank is not None and cp_rank != group_rank:
            raise ValueError(f"cp_rank={cp_rank} disagrees with this process's rank {group_rank} in the group")
        cp_rank, cp_size = group_rank, group_size
    cp_size = check_int("cp_size", 1 if cp_size is None else cp_size, minimum=1)
    if cp_rank is None:
        if cp_size > 1:
            raise ValueError(f"cp_rank is required with cp_size={cp_size} when no group is given")
        cp_rank = 0
    check_int("cp_rank", cp_rank, minimum=0, below=("cp_size", cp_size))
    return cp_rank, cp_size, process_group


def row_multiple(cp_size: int, pad_to_multiple_of: int | None) -> int:
    """Rows are a multiple of this many tokens: every rank's shard is a multiple of ``pad_to_multiple_of``."""
    if pad_to_multiple_of is not None:
        check_int("pad_to_multiple_of", pad_to_multiple_of, minimum=1, hint="or None")
    return cp_size * (pad_to_multiple_of or 1)


def check_not_dispatched() -> None:
    """Raise ``ValueError`` when called while accelerate's ``DataLoaderDispatcher`` iterates for several processes.

    That loader (accelerate's default for an ``IterableDataset`` such as :class:`PackedDataset` under the stock
    ``Trainer`` on several processes) collates every process's batch on process 0 and concatenates them, which a
    batch with a ``cp_context`` and an int ``num_items_in_batch`` cannot survive (accelerate's own error is
    ``TypeError: Can only concatenate tensors but got <class 'int'>``). Reads only what is already imported:
    without accelerate loaded there is no dispatcher.
    """
    processes = accelerate_dispatching_processes()
    if processes > 1:
        raise ValueError(
            f"accelerate's DataLoaderDispatcher (its default for an iterable dataset such as PackedDataset on "
            f"{processes} processes) concatenates every process's batch on process 0, which "
            f"cannot carry this batch's cp_context: {DISPATCH_FIX}")


def rank_batch(full: FullRows, *, cp_rank: int, cp_size: int, group: Any = None,
               config: BlockDiagCPConfig | None = None, num_items: int | None = None, placement: str | None = None,
               sliding_windows: Sequence[int | None] = (), heads: Any = None,
               ulysses_groups: Any = None) -> dict[str, Any]:
    """Rank ``cp_rank``'s batch of the full rows ``full`` (``[B, S]``; ``B == 1`` when ``cp_size > 1``).

    ``heads`` / ``ulysses_groups``: see :meth:`BlockDiagCPContext.build` (for ``ulysses_size != 1``).

    Returns:
        ``input_ids``, ``position_ids``, ``labels``, ``shift_labels``: ``[B, L]`` int64 local slices;
        ``num_items_in_batch``: int, ``num_items`` or the targets of the full rows (the same on every
        rank); ``cp_context``: the rank's :class:`BlockDiagCPContext`; ``use_cache``: ``False``.
    """
    check_not_dispatched()
    batch, full_len = full.input_ids.shape
    if cp_size > 1 and batch != 1:
        raise ValueError(f"under context parallelism a micro-batch is one packed row, got {batch} rows")
    # The tokens join the data fingerprint: CP ranks given different rows with the same layout fail
    # the step's agreement instead of training on different data.
    media = full.media
    positions = full.position_ids
    if media is not None and media.positions is not None:
        # mrope models read [4, B, S]: the 1-D text positions (masks, packing), then the 3-D rope rows.
        positions = torch.cat([full.position_ids[None], media.positions])
    context = BlockDiagCPContext.build(full.doc_ids, cp_rank=cp_rank, cp_size=cp_size, group=group, config=config,
                                       input_ids=full.input_ids, placement=placement, sliding_windows=sliding_windows,
                                       position_ids=positions, heads=heads, ulysses_groups=ulysses_groups,
                                       block_ids=None if media is None else media.block_ids)
    extra: dict[str, Any] = {}
    if media is not None:
        context, extra = _media_fields(context, full, media)
    num_items = full.num_items if num_items is None else int(num_items)
    if num_items == 0:
        warnings.warn("this batch has no targets (every label is ignored): num_items_in_batch=0. If the whole step "
                      "has none, normalize_num_items and CPTrainer make its loss 0 with zero gradients; model(**batch) "
                      "on its own returns 0/0 = NaN", RuntimeWarning, stacklevel=3)
    local = context.local_index
    return {
        # index_select: a plain gather, several times faster than advanced indexing on long rows.
        "input_ids": full.input_ids.index_select(1, local),
        "position_ids": positions.index_select(positions.dim() - 1, local),
        "labels": full.labels.index_select(1, local),
        "shift_labels": full.shift_labels.index_select(1, local),
        # A Python int, not a 0-dim tensor: accelerate's batch dispatcher (the Trainer's loader for iterable
        # datasets; on one process, see check_not_dispatched) concatenates every tensor along dim 0, which
        # 0-dim tensors fail.
        "num_items_in_batch": num_items,
        "cp_context": context,
        # A packed training forward must not build a KV cache (config.use_cache defaults to True
        # outside the Trainer); the cp_context path refuses a cache that holds earlier keys.
        "use_cache": False,
        **extra,
    }


def _media_fields(context: BlockDiagCPContext, full: FullRows,
                  media: RowMedia) -> tuple[BlockDiagCPContext, dict[str, Any]]:
    """The batch keys of a row's images / videos for this rank, and the context with its media exchange (CP > 1).

    One process: every item in row order (the model encodes them itself). Under CP: the items this rank encodes
    (:func:`~hf_blockdiag_cp.planning.media.plan_media`); the model's forward pre-hook sends their feature rows to
    the ranks holding their placeholder tokens (:mod:`hf_blockdiag_cp.model.media`).
    """
    local = context.local_index
    extra: dict[str, Any] = {}
    if media.token_types is not None:
        extra[media.spec.token_type_key] = media.token_types.index_select(1, local)
    if not media.items:
        return context, extra
    if context.cp_size == 1:
        return context, {**extra, **media_batch(media.items, media.spec)}
    ordered = media.ordered()
    owner = np.empty(context.full_len, dtype=np.int64)
    index = context.placement.index
    owner[index.reshape(-1).numpy()] = np.repeat(np.arange(index.shape[0]), index.shape[1])
    transfer = plan_media([it.kind for it in ordered], [it.rows for it in ordered], [it.work for it in ordered],
                          media.placeholder_positions(full.input_ids), owner, rank=context.cp_rank,
                          size=context.cp_size)
    extra.update(media_batch([ordered[i] for i in transfer.encode], media.spec))
    return context.with_media(transfer), extra
