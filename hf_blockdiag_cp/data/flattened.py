"""``from_flattened``: the output of ``transformers.DataCollatorWithFlattening`` -> one CP rank's batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import BlockDiagCPConfig
from ..planning import doc_ids_from_cu_seqlens, doc_ids_from_position_ids
from .examples import token_tensor
from .rows import FullRows, shift_row_labels
from .sharding import rank_batch, resolve_cp, row_multiple

__all__ = ["from_flattened"]


def _row(batch: Mapping[str, Any], key: str) -> torch.Tensor | None:
    """``batch[key]`` as a 1-D int64 CPU tensor (``[1, T]`` or ``[T]`` accepted), or ``None``."""
    value = batch.get(key)
    if value is None:
        return None
    tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    if tensor.dim() == 2:
        if tensor.shape[0] != 1:
            raise ValueError(f"batch[{key!r}] has {tensor.shape[0]} rows; a flattened batch is one row [1, T]")
        tensor = tensor[0]
    return token_tensor(tensor, index=None, field=key)


def from_flattened(batch: Mapping[str, Any], *, cp_size: int | None = None, cp_rank: int | None = None,
                   group: Any = None, pad_token_id: int = 0, label_pad_id: int = -100,
                   pad_to_multiple_of: int | None = None, config: BlockDiagCPConfig | None = None) -> dict[str, Any]:
    """Turn a ``DataCollatorWithFlattening`` batch into this CP rank's batch (the :class:`PackingCollator` format).

    Args:
        batch: ``input_ids [1, T]``; document boundaries from ``cu_seq_lens_k`` (or ``cu_seq_lens_q``),
            else ``seq_idx``, else ``position_ids`` (a new document wherever the position does not
            continue by +1). ``labels [1, T]`` are HF's unshifted labels (``separator_id``, by default
            -100, at each document's first token); without them they are ``input_ids`` with -100 at
            document starts. ``position_ids`` are kept (else they restart at 0 per document).
        cp_size / cp_rank / group: as for :class:`PackingCollator`.
        pad_token_id / label_pad_id: fill values of the tail padding (``-100`` and ``label_pad_id``
            in ``labels`` both count as ignored).
        pad_to_multiple_of: each rank's shard length is a multiple of it; the row is padded at the
            tail to a multiple of ``cp_size * pad_to_multiple_of``.
        config: the :class:`BlockDiagCPConfig` of the context.

    Returns:
        The same keys as :class:`PackingCollator`: ``shift_labels`` is exactly what
        ``ForCausalLMLoss`` would compute from the flattened ``labels``, so the loss equals that of
        the flattened batch; ``cu_seq_lens_*`` / ``max_length_*`` / ``seq_idx`` are not passed on
        (the context replaces them).
    """
    cp_rank, cp_size, process_group = resolve_cp(group, cp_rank, cp_size)
    multiple = row_multiple(cp_size, pad_to_multiple_of)
    input_ids = _row(batch, "input_ids")
    if input_ids is None:
        raise ValueError("batch: missing field 'input_ids'")
    total = int(input_ids.numel())
    if total == 0:
        raise ValueError("batch: input_ids is empty")
    if int(input_ids.min()) < 0:
        raise ValueError(f"batch: input_ids contains a negative token id {int(input_ids.min())}")
    full_len = -(-total // multiple) * multiple

    cu = _row(batch, "cu_seq_lens_k")
    cu = _row(batch, "cu_seq_lens_q") if cu is None else cu
    seq_idx = _row(batch, "seq_idx")
    position_ids = _row(batch, "position_ids")
    for name, value in (("position_ids", position_ids), ("seq_idx", seq_idx)):
        if value is not None and value.numel() != total:
            raise ValueError(f"batch: {name} has length {value.numel()} but input_ids has length {total}")
    if cu is not None:
        if int(cu[-1]) != total:
            raise ValueError(f"batch: cu_seq_lens end at {int(cu[-1])} but input_ids has {total} tokens")
        doc_ids = doc_ids_from_cu_seqlens(cu, total, name="cu_seq_lens_k")
    elif seq_idx is not None:
        change = torch.ones(total, dtype=torch.bool)
        change[1:] = seq_idx[1:] != seq_idx[:-1]
        doc_ids = torch.cumsum(change.to(torch.int64), 0)
    elif position_ids is not None:
        doc_ids = doc_ids_from_position_ids(position_ids)[0]
    else:
        raise ValueError("batch: needs cu_seq_lens_k, seq_idx or position_ids to find the document boundaries")
    starts = torch.ones(total, dtype=torch.bool)
    starts[1:] = doc_ids[1:] != doc_ids[:-1]
    if position_ids is None:
        index = torch.arange(total)
        position_ids = index - torch.cummax(torch.where(starts, index, torch.zeros_like(index)), 0).values

    labels = _row(batch, "labels")
    if labels is None:
        labels = input_ids.masked_fill(starts, -100)  # HF's rule: a document's first token has no predictor
    elif labels.numel() != total:
        raise ValueError(f"batch: labels has length {labels.numel()} but input_ids has length {total}")
    ignored = (labels == -100) | (labels == label_pad_id)
    if bool(((labels < 0) & ~ignored).any()):
        raise ValueError(f"batch: labels contains a negative value {int(labels[(labels < 0) & ~ignored][0])} that is "
                         f"not an ignore value (-100 or label_pad_id={label_pad_id})")

    def padded(row: torch.Tensor, fill: int) -> torch.Tensor:
        out = torch.full((1, full_len), fill, dtype=torch.int64)
        out[0, :total] = row
        return out

    full_labels = padded(labels.masked_fill(ignored, label_pad_id), label_pad_id)
    full = FullRows(input_ids=padded(input_ids, pad_token_id), labels=full_labels,
                    position_ids=padded(position_ids, 0), doc_ids=padded(doc_ids, 0),
                    shift_labels=shift_row_labels(full_labels, label_pad_id), label_pad_id=label_pad_id)
    return rank_batch(full, cp_rank=cp_rank, cp_size=cp_size, group=process_group, config=config)
