"""``from_flattened``: the output of ``transformers.DataCollatorWithFlattening`` -> one CP rank's batch."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..config import BlockDiagCPConfig
from ..planning.documents import arange, doc_ids_from_flattening, run_boundaries, run_starts
from ..planning.media import IMAGE, VIDEO, item_keys
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
        batch: ``input_ids [1, T]``; document boundaries from ``cu_seq_lens_k`` / ``cu_seq_lens_q``
            (equal when both are given, ending at ``T``), else ``seq_idx``, else ``position_ids`` (a new
            document wherever the position does not continue by +1). ``labels [1, T]`` are HF's
            unshifted labels (``separator_id``, by default -100, at each document's first token);
            without them they are ``input_ids`` with -100 at document starts. ``position_ids`` are kept (else they
            restart at 0 per document).
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
    media = [k for k in (*item_keys(IMAGE), *item_keys(VIDEO)) if batch.get(k) is not None]
    if media:  # dropping them would leave the placeholders with their text embeddings: silently another model
        raise ValueError(f"batch: has {', '.join(media)}; from_flattened carries text only (DataCollatorWithFlattening "
                         "flattens no images): pack vision-language examples with "
                         "PackingCollator(..., model_config=model.config)")
    input_ids = _row(batch, "input_ids")
    if input_ids is None:
        raise ValueError("batch: missing field 'input_ids'")
    total = int(input_ids.numel())
    if total == 0:
        raise ValueError("batch: input_ids is empty")
    if int(input_ids.min()) < 0:
        raise ValueError(f"batch: input_ids contains a negative token id {int(input_ids.min())}")
    full_len = -(-total // multiple) * multiple

    position_ids = _row(batch, "position_ids")
    doc_ids = doc_ids_from_flattening(total, cu_seq_lens_q=_row(batch, "cu_seq_lens_q"),
                                      cu_seq_lens_k=_row(batch, "cu_seq_lens_k"), seq_idx=_row(batch, "seq_idx"),
                                      position_ids=position_ids)
    if position_ids is None:
        position_ids = arange(total) - run_starts(doc_ids)

    labels = _row(batch, "labels")
    if labels is None:
        # HF's rule: a document's first token has no predictor.
        labels = input_ids.masked_fill(run_boundaries(doc_ids), -100)
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
