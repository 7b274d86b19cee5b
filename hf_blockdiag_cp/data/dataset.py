"""``PackedDataset``: a stream of examples -> a stream of packed rows, one row per item.

With ``DataLoader(..., batch_size=1, collate_fn=PackingCollator(...))`` (or the ``Trainer`` with
``per_device_train_batch_size=1``) every micro-batch is one packed row at any ``cp_size``, and
gradient accumulation iterates rows.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .._validate import check_int
from .examples import Document, read_example
from .multimodal import media_spec
from .packing import check_overflow, rows_of_documents
from .rows import PackedRow

__all__ = ["PackedDataset"]


class PackedDataset(torch.utils.data.IterableDataset):
    """Group examples into rows of at most ``seq_len`` tokens, best-fit-decreasing over a buffer.

    Args:
        examples: a re-iterable source of examples (list, ``datasets.Dataset``, ...): mappings with
            ``input_ids`` and optional ``labels``; iterated once per epoch.
        seq_len: the row length; use the collator's ``seq_len``.
        overflow: ``"split"`` / ``"truncate"`` / ``"error"`` for documents longer than ``seq_len``.
        buffer_size: examples packed together (more = less padding, more host memory and latency).
        label_pad_id: a second ignore value in input labels besides ``-100``.
        seed: if given, the rows of each buffer are shuffled (deterministically from ``seed``, the
            epoch and the buffer number) so that rows of long documents do not come first.
        model_config: the model (or its config) for vision-language models: examples with ``pixel_values`` are
            read with its placeholder tokens and position rule (:func:`~.multimodal.media_spec`).

    Yields :class:`PackedRow` items. Every CP rank of one group must iterate the same examples in the
    same order (same source and seed) and must not shard them among themselves. With
    ``num_workers > 1`` each DataLoader worker packs the whole stream and yields every
    ``num_workers``-th row, so the rows and their order are the same as with one worker.
    Empty documents are dropped.
    """

    def __init__(self, examples: Iterable[Any], seq_len: int, *, overflow: str = "split", buffer_size: int = 1000,
                 label_pad_id: int = -100, seed: int | None = None, model_config: Any = None) -> None:
        super().__init__()
        self.media = media_spec(model_config)
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        self.overflow = check_overflow(overflow)
        self.buffer_size = check_int("buffer_size", buffer_size, minimum=1)
        if iter(examples) is examples:
            raise ValueError("examples must be re-iterable (a list or dataset, not an iterator/generator): "
                             "every epoch and every DataLoader worker iterates it from the start")
        if hasattr(examples, "__len__") and len(examples) == 0:
            raise ValueError("examples is empty: PackedDataset would yield no rows (and the collator refuses an "
                             "empty batch); give it at least one example with input_ids")
        self.examples = examples
        self.label_pad_id = label_pad_id
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Called by the HF ``Trainer`` before each epoch; changes the row shuffle (if ``seed`` is set)."""
        self.epoch = int(epoch)

    def _rows(self) -> Iterator[PackedRow]:
        buffer: list[Document] = []
        buffer_no = 0
        for index, example in enumerate(self.examples):
            doc = read_example(example, index=index, label_pad_id=self.label_pad_id, media=self.media)
            if len(doc):
                buffer.append(doc)
            if len(buffer) == self.buffer_size:
                yield from self._pack(buffer, buffer_no)
                buffer, buffer_no = [], buffer_no + 1
        if buffer:
            yield from self._pack(buffer, buffer_no)

    def _pack(self, buffer: list[Document], buffer_no: int) -> list[PackedRow]:
        rows = rows_of_documents(buffer, self.seq_len, self.overflow)
        if self.seed is not None:
            # A string seed is hashed deterministically (unlike hash() of a tuple across processes).
            random.Random(f"{self.seed}/{self.epoch}/{buffer_no}").shuffle(rows)
        return rows

    def rows(self) -> Iterator[PackedRow]:
        """Every row of the current epoch in order, in any process (no split among DataLoader workers).

        Raises ``ValueError`` when the examples give no row at all (every document is empty)."""
        produced = False
        for row in self._rows():
            produced = True
            yield row
        if not produced:
            raise ValueError("PackedDataset: the examples hold no tokens (every document is empty), so there is no "
                             "row to yield")

    def __iter__(self) -> Iterator[PackedRow]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i, row in enumerate(self.rows()):
            if i % workers == worker:
                yield row
