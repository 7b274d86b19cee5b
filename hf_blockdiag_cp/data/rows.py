"""Full (unsharded) packed rows: lay documents into ``[B, S]`` tensors and shift the labels.

Everything here describes the whole row, identical on every CP rank; :mod:`.sharding` cuts it.
Conventions (the same as ``transformers.DataCollatorWithFlattening``):

- ``labels`` are unshifted (``labels[t]`` is the target *of* token ``t``) and ignored
  (``label_pad_id``) at every document's first token and at padding, so that shifting a full row
  never makes a document predict the next one.
- ``shift_labels[t] = labels[t + 1]`` over the full row (``label_pad_id`` after the last column):
  what ``ForCausalLMLoss`` would compute on the unsharded row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .examples import Document

__all__ = ["FullRows", "PackedRow", "assemble_rows", "shift_row_labels"]


@dataclass(frozen=True, eq=False)
class PackedRow:
    """One packed row of documents (in row order), not yet padded; what :class:`PackedDataset` yields.

    It is deliberately not a ``dict``: the HF ``Trainer`` strips unknown keys from dict examples of
    iterable datasets before the collator sees them, and passes other objects through untouched.
    """

    documents: tuple[Document, ...]

    def __len__(self) -> int:
        return sum(len(d) for d in self.documents)


@dataclass(frozen=True, eq=False)
class FullRows:
    """``[B, S]`` CPU tensors of full packed rows.

    Attributes:
        input_ids: int64 token ids, ``pad_token_id`` at padding.
        labels: int64 unshifted labels, ``label_pad_id`` at document starts, ignored tokens, padding.
        position_ids: int64 position of every token in its document (continuing for split pieces),
            0 at padding.
        doc_ids: int64 document ids 1, 2, ... per document in row order, 0 at padding.
        shift_labels: int64 next-token targets computed on the full row (:func:`assemble_rows` gives a view of
            the storage of ``labels`` one column on: read-only, like every field).
        label_pad_id: the ignore value used in ``labels`` / ``shift_labels``.
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    shift_labels: torch.Tensor
    label_pad_id: int

    @property
    def num_items(self) -> int:
        """Targets that count towards the loss (non-ignored ``shift_labels``) over all rows."""
        return int((self.shift_labels != self.label_pad_id).sum())


def shift_row_labels(labels: torch.Tensor, label_pad_id: int = -100) -> torch.Tensor:
    """``[B, S]`` next-token targets of full rows ``labels [B, S]``: ``out[:, t] = labels[:, t + 1]``."""
    pad = torch.full_like(labels[:, :1], label_pad_id)
    return torch.cat([labels[:, 1:], pad], dim=1)


def assemble_rows(rows: Sequence[Sequence[Document]], length: int, *, pad_token_id: int,
                  label_pad_id: int = -100) -> FullRows:
    """Lay each row's documents back to back and pad the tail to ``length``.

    Args:
        rows: ``B`` rows, each a sequence of documents (``Document.labels`` use ``-100`` for ignored).
        length: ``S``; every row must hold at most ``S`` tokens.
        pad_token_id / label_pad_id: fill values for padding input ids / ignored labels.
    """
    batch = len(rows)
    if batch == 0:
        empty = torch.zeros((0, length), dtype=torch.int64)
        return FullRows(empty, empty, empty, empty, empty, label_pad_id)
    # Each row is written once, by concatenation (documents, then the padding tail): a handful of passes over
    # the row, not a fill followed by copies. The labels get one column more (ignored): ``shift_labels`` is then
    # the same storage one column on, no pass of its own.
    columns: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": [], "doc_ids": []}
    for b, docs in enumerate(rows):
        lens = torch.tensor([len(d) for d in docs], dtype=torch.int64)
        total = int(lens.sum())
        if total > length:
            raise ValueError(f"row {b} holds {total} tokens, more than the row length {length}")
        tail = length - total
        starts = torch.cumsum(lens, 0) - lens
        row_labels = torch.cat([*(d.labels for d in docs), torch.full((tail + 1,), -100, dtype=torch.int64)])
        # No token of the row predicts a document's first token (its predecessor is another document).
        row_labels[starts[lens > 0]] = -100
        if label_pad_id != -100:
            row_labels.masked_fill_(row_labels == -100, label_pad_id)
        # Position of token t = t - (row start of its document) + (position of the document's first token), 0 at
        # padding: one repeat over the whole row (numpy's: several times faster than torch.repeat_interleave on
        # long rows), then the arange added in place over the documents.
        offsets = torch.tensor([d.position_start for d in docs], dtype=torch.int64) - starts
        lens_np = np.append(lens.numpy(), tail)
        positions = np.repeat(np.append(offsets.numpy(), 0), lens_np)
        positions[:total] += np.arange(total, dtype=np.int64)
        columns["input_ids"].append(torch.cat([*(d.input_ids for d in docs),
                                               torch.full((tail,), pad_token_id, dtype=torch.int64)]))
        columns["labels"].append(row_labels)
        columns["position_ids"].append(torch.from_numpy(positions))
        ids = np.append(np.arange(1, len(docs) + 1, dtype=np.int64), 0)  # documents 1..n, then padding
        columns["doc_ids"].append(torch.from_numpy(np.repeat(ids, lens_np)))
    input_ids, label_columns, position_ids, doc_ids = (
        torch.stack(columns[k]) if batch > 1 else columns[k][0][None]
        for k in ("input_ids", "labels", "position_ids", "doc_ids"))
    # shift_labels[:, t] = labels[:, t + 1]; the extra last column is the ignore value after the row's end.
    return FullRows(input_ids, label_columns[:, :length], position_ids, doc_ids, label_columns[:, 1:], label_pad_id)
