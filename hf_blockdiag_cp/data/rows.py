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
from .multimodal import MediaSpec, RowMedia, row_media

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
        media: the rows' images, videos, mrope positions and token types (:class:`~.multimodal.RowMedia`), or
            ``None`` (text rows).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    shift_labels: torch.Tensor
    label_pad_id: int
    media: RowMedia | None = None

    @property
    def num_items(self) -> int:
        """Targets that count towards the loss (non-ignored ``shift_labels``) over all rows."""
        # numpy: a counting pass, no bool tensor summed (several times faster on long rows).
        return int(np.count_nonzero(self.shift_labels.numpy() != self.label_pad_id))


def shift_row_labels(labels: torch.Tensor, label_pad_id: int = -100) -> torch.Tensor:
    """``[B, S]`` next-token targets of full rows ``labels [B, S]``: ``out[:, t] = labels[:, t + 1]``."""
    pad = torch.full_like(labels[:, :1], label_pad_id)
    return torch.cat([labels[:, 1:], pad], dim=1)


def assemble_rows(rows: Sequence[Sequence[Document]], length: int, *, pad_token_id: int,
                  label_pad_id: int = -100, scratch: dict[str, torch.Tensor] | None = None,
                  media: MediaSpec | None = None) -> FullRows:
    """Lay each row's documents back to back and pad the tail to ``length``.

    Args:
        rows: ``B`` rows, each a sequence of documents (``Document.labels`` use ``-100`` for ignored).
        length: ``S``; every row must hold at most ``S`` tokens.
        pad_token_id / label_pad_id: fill values for padding input ids / ignored labels.
        scratch: buffers the caller owns and reuses from call to call (one row, ``B == 1``; ignored otherwise):
            the returned rows are written into them, so the caller must keep nothing of them but copies, and not
            call again while it reads them. Fresh row-long arrays cost page faults on top of their writes (on
            this project's machine about as much again as the writes), every step.
        media: the model's :class:`~.multimodal.MediaSpec`: the rows' media are laid out too (``FullRows.media``).
    """
    batch = len(rows)
    if batch == 0:
        empty = torch.zeros((0, length), dtype=torch.int64)
        return FullRows(empty, empty, empty, empty, empty, label_pad_id)
    if batch != 1:
        scratch = None
    # Each row is written once into its buffers: the documents (and the padding tail) by concatenation, the
    # positions and document ids as running sums of their steps (one fill and one in-place cumsum each). The
    # labels get one column more (ignored): ``shift_labels`` is then the same storage one column on.
    columns: dict[str, list[torch.Tensor]] = {"input_ids": [], "labels": [], "position_ids": [], "doc_ids": []}
    for b, docs in enumerate(rows):
        lens = np.fromiter((len(d) for d in docs), dtype=np.int64, count=len(docs))
        total = int(lens.sum())
        if total > length:
            raise ValueError(f"row {b} holds {total} tokens, more than the row length {length}")
        tail = length - total
        out = _row_buffers(scratch, length)
        torch.cat([*(d.input_ids for d in docs), torch.full((tail,), pad_token_id, dtype=torch.int64)],
                  out=out["input_ids"])
        row_labels = torch.cat([*(d.labels for d in docs), torch.full((tail + 1,), -100, dtype=torch.int64)],
                               out=out["labels"])
        # No token of the row predicts a document's first token (its predecessor is another document).
        real = np.flatnonzero(lens)  # non-empty documents (an empty one still takes an id)
        starts = (np.cumsum(lens) - lens)[real]
        row_labels[torch.from_numpy(starts)] = -100
        if label_pad_id != -100:
            row_labels.masked_fill_(row_labels == -100, label_pad_id)
        # Position of token t = t - (row start of its document) + (position of the document's first token), 0 at
        # padding; document ids 1..n in list order, 0 at padding: both as running sums of their steps.
        first_pos = np.fromiter((docs[k].position_start for k in real), dtype=np.int64, count=real.size)
        last_pos = first_pos + lens[real] - 1
        _running(out["position_ids"].numpy(), 1, starts, first_pos, last_pos, total)
        ids = real + 1
        _running(out["doc_ids"].numpy(), 0, starts, ids, ids, total)
        for name in columns:
            columns[name].append(out[name])
    input_ids, label_columns, position_ids, doc_ids = (
        torch.stack(columns[k]) if batch > 1 else columns[k][0][None]
        for k in ("input_ids", "labels", "position_ids", "doc_ids"))
    # shift_labels[:, t] = labels[:, t + 1]; the extra last column is the ignore value after the row's end.
    return FullRows(input_ids, label_columns[:, :length], position_ids, doc_ids, label_columns[:, 1:], label_pad_id,
                    row_media(rows, length, position_ids, media))


def _row_buffers(scratch: dict[str, torch.Tensor] | None, length: int) -> dict[str, torch.Tensor]:
    """The int64 buffers of one row: ``scratch``'s (made on first use, remade for another length), else fresh."""
    sizes = {"input_ids": length, "labels": length + 1, "position_ids": length, "doc_ids": length}
    if scratch is None:
        return {name: torch.empty(size, dtype=torch.int64) for name, size in sizes.items()}
    if scratch.get("length") != length:
        scratch.clear()
        scratch.update({name: torch.empty(size, dtype=torch.int64) for name, size in sizes.items()}, length=length)
    return scratch


def _running(out: np.ndarray, step: int, starts: np.ndarray, first: np.ndarray, last: np.ndarray,
             total: int) -> None:
    """Write into ``out [S]`` the row whose run ``k`` starts at ``starts[k]`` with value ``first[k]``, grows by
    ``step`` per token up to ``last[k]`` (at its end; runs back to back from 0 up to ``total``), and is 0 from
    ``total`` on: the steps, then one in-place cumulative sum."""
    out.fill(step)
    out[total:] = 0
    if starts.size:
        out[starts] = first - np.append(0, last[:-1])  # the jump from the previous run's last value
        if total < out.size:
            out[total] = -last[-1]
    np.cumsum(out, out=out)
