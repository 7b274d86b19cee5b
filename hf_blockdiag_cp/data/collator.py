"""``PackingCollator``: examples (or rows from :class:`PackedDataset`) -> one CP rank's batch for ``model(**batch)``."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from .._validate import check_int
from ..config import PLACEMENTS, BlockDiagCPConfig
from ..distributed.groups import group_to_ref, ref_to_group
from .examples import Document, read_example
from .packing import check_overflow, rows_of_documents
from .rows import PackedRow, assemble_rows
from .sharding import rank_batch, resolve_cp, row_multiple

__all__ = ["PackingCollator"]

logger = logging.getLogger("hf_blockdiag_cp.data")


class PackingCollator:
    """Pack documents into rows of ``seq_len`` tokens and return this CP rank's share of them.

    Usable as ``collate_fn`` of a ``DataLoader`` and as ``data_collator`` of the HF ``Trainer``.

    Args:
        seq_len: ``S``, tokens per packed row (all ranks together); must be divisible by
            ``cp_size * pad_to_multiple_of`` so that every rank holds ``L = S / cp_size`` tokens.
        cp_size / cp_rank: the CP group size and this rank; default from ``group``, else 1 / 0.
        group: the CP ``ProcessGroup`` or a 1-D ``DeviceMesh`` (stored in the context for the exchange).
        pad_token_id: input id written at padding (its value never reaches the loss or attention).
        label_pad_id: ignore value of ``labels`` / ``shift_labels`` (also recognised in input labels
            besides ``-100``); HF's loss ignores ``-100`` unless told otherwise.
        pad_to_multiple_of: every rank's shard length must be a multiple of this (kernel tiles).
        overflow: documents longer than ``seq_len``: ``"split"`` into ``seq_len`` pieces (each its own
            document, positions continuing), ``"truncate"``, or ``"error"``.
        config: the :class:`BlockDiagCPConfig` of every context built.
        placement: which row positions each CP rank holds: ``"balanced"`` (balances attention work,
            splitting as few documents as possible), ``"contiguous"`` or ``"zigzag"``; default
            ``config.placement`` (``HF_BLOCKDIAG_CP_PLACEMENT``, else ``"balanced"``).
        sliding_windows: the model's attention windows, ``None`` for full-attention layers (see
            :func:`hf_blockdiag_cp.sliding_windows`): windowed layers then receive only the K/V
            inside their window, and the balanced placement weighs work by them.
        vocab_size: the model's vocabulary size, if known: a token or label id ``>= vocab_size`` then
            raises ``ValueError`` naming the example and field (instead of an ``IndexError`` deep in the
            embedding or the loss). :class:`~hf_blockdiag_cp.CPTrainer` fills it from the model.

    Calling it on a list of examples (mappings with ``input_ids`` and optional ``labels``) packs them
    best-fit-decreasing and returns one batch dict: ``[B, S]`` at ``cp_size == 1`` (``B`` rows),
    exactly one row ``[1, L]`` under CP (more rows raise; see :meth:`micro_batches` and
    :class:`PackedDataset`). Calling it on :class:`PackedRow` items (from :class:`PackedDataset`)
    lays each out as one row without re-packing.
    """

    def __init__(self, seq_len: int, *, cp_size: int | None = None, cp_rank: int | None = None, group: Any = None,
                 pad_token_id: int, label_pad_id: int = -100, pad_to_multiple_of: int | None = None,
                 overflow: str = "split", config: BlockDiagCPConfig | None = None, placement: str | None = None,
                 sliding_windows: Sequence[int | None] | None = None, vocab_size: int | None = None) -> None:
        self.cp_rank, self.cp_size, self.group = resolve_cp(group, cp_rank, cp_size)
        self.seq_len = check_int("seq_len", seq_len, minimum=1)
        multiple = row_multiple(self.cp_size, pad_to_multiple_of)
        if seq_len % multiple:
            raise ValueError(f"seq_len={seq_len} is not divisible by cp_size * pad_to_multiple_of = "
                             f"{self.cp_size} * {pad_to_multiple_of or 1} = {multiple}")
        self.pad_token_id = check_int("pad_token_id", pad_token_id, minimum=0,
                                      hint="e.g. tokenizer.pad_token_id or eos_token_id")
        self.label_pad_id = check_int("label_pad_id", label_pad_id)
        self.pad_to_multiple_of = pad_to_multiple_of
        self.overflow = check_overflow(overflow)
        self.config = config or BlockDiagCPConfig()
        self.placement = self.config.placement if placement is None else placement
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} is not one of {', '.join(PLACEMENTS)}")
        if self.placement == "zigzag" and seq_len % (2 * self.cp_size):
            raise ValueError(f"placement='zigzag' needs seq_len={seq_len} divisible by 2 * cp_size = {2 * self.cp_size}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not pad_token_id < vocab_size):
            raise ValueError(f"vocab_size={vocab_size!r} must be None or an int above pad_token_id={pad_token_id}")
        self.vocab_size = vocab_size
        self.sliding_windows = tuple(sliding_windows or ())
        for window in self.sliding_windows:
            if window is not None:
                check_int("sliding_windows", window, minimum=1)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers started with "spawn" receive the collator pickled: send the CP group
        # by name (the contexts built there carry the name back to the main process).
        return {**self.__dict__, "group": group_to_ref(self.group)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update({**state, "group": ref_to_group(state["group"])})

    @property
    def local_len(self) -> int:
        """``L``: tokens per rank per row."""
        return self.seq_len // self.cp_size

    def __repr__(self) -> str:
        return (f"PackingCollator(seq_len={self.seq_len}, cp_size={self.cp_size}, cp_rank={self.cp_rank}, "
                f"pad_token_id={self.pad_token_id}, label_pad_id={self.label_pad_id}, "
                f"pad_to_multiple_of={self.pad_to_multiple_of}, overflow={self.overflow!r}, "
                f"placement={self.placement!r}, sliding_windows={self.sliding_windows})")

    def pack(self, examples: Sequence[Any]) -> list[PackedRow]:
        """Validate ``examples`` and pack them into rows (best-fit-decreasing; no tensors built yet).

        ``PackedRow`` items are taken as they are, one row each (checked against ``seq_len``).
        Empty documents are dropped (and counted in an INFO log line of ``hf_blockdiag_cp.data``).
        """
        if isinstance(examples, (PackedRow, dict)) or not isinstance(examples, Sequence):
            raise ValueError(f"examples must be a list of examples, got {type(examples).__name__}")
        if not examples:
            raise ValueError("examples is empty: nothing to pack")
        kinds = {isinstance(e, PackedRow) for e in examples}
        if kinds == {True}:
            rows = self._check_rows(examples)
            for i, row in enumerate(rows):
                self._check_vocabulary(row.documents, f"example {i} (a PackedRow), document of dataset example ")
            return rows
        if len(kinds) > 1:
            raise ValueError("examples mixes PackedRow items (from PackedDataset) and plain examples")
        docs = [read_example(e, index=i, label_pad_id=self.label_pad_id) for i, e in enumerate(examples)]
        self._check_vocabulary(docs, "example ")
        empty = [d.index for d in docs if len(d) == 0]
        if empty:
            logger.info("PackingCollator dropped %d empty document(s) (examples %s)", len(empty), empty[:16])
        if len(empty) == len(docs):
            raise ValueError(f"all {len(docs)} examples have empty input_ids: nothing to train on")
        return rows_of_documents(docs, self.seq_len, self.overflow)

    def micro_batches(self, examples: Sequence[Any]) -> list[dict[str, Any]]:
        """One batch dict per packed row (each ``[1, L]`` for this rank), for manual loops.

        ``num_items_in_batch`` of every micro-batch is the target count of *all* rows, so summing
        ``model(**mb).loss`` (or calling ``backward`` on each) over the list gives the exact
        token mean of the whole list, as the HF ``Trainer`` does over gradient accumulation.
        """
        rows = self.pack(examples)
        full = [assemble_rows([r.documents], self.seq_len, pad_token_id=self.pad_token_id,
                              label_pad_id=self.label_pad_id) for r in rows]
        num_items = sum(f.num_items for f in full)
        return [rank_batch(f, cp_rank=self.cp_rank, cp_size=self.cp_size, group=self.group, config=self.config,
                           placement=self.placement, sliding_windows=self.sliding_windows,
                           num_items=num_items) for f in full]

    def __call__(self, examples: Sequence[Any]) -> dict[str, Any]:
        """This rank's batch for ``examples``: ``[B, S]`` tensors at ``cp_size == 1``, ``[1, L]`` under CP."""
        rows = self.pack(examples)
        if self.cp_size > 1 and len(rows) > 1:
            raise ValueError(
                f"the {len(examples)} examples need {len(rows)} rows of seq_len={self.seq_len}, but under context "
                f"parallelism (cp_size={self.cp_size}) one call returns one row; feed rows from "
                f"hf_blockdiag_cp.PackedDataset with batch size 1, or use PackingCollator.micro_batches()")
        full = assemble_rows([r.documents for r in rows], self.seq_len, pad_token_id=self.pad_token_id,
                             label_pad_id=self.label_pad_id)
        return rank_batch(full, cp_rank=self.cp_rank, cp_size=self.cp_size, group=self.group, config=self.config,
                          placement=self.placement, sliding_windows=self.sliding_windows)

    def _check_vocabulary(self, docs: Sequence[Document], where: str) -> None:
        """Raise if a token or label id of ``docs`` is not below ``vocab_size`` (``where`` + ``doc.index``
        names the example)."""
        if self.vocab_size is None:
            return
        for doc in docs:
            for name, ids in (("input_ids", doc.input_ids), ("labels", doc.labels)):
                bad = torch.nonzero(ids >= self.vocab_size)
                if bad.numel():
                    pos = int(bad[0])
                    raise ValueError(f"{where}{doc.index}: {name}[{doc.position_start + pos}]={int(ids[pos])} is not "
                                     f"below the model's vocab_size={self.vocab_size}")

    def _check_rows(self, rows: Sequence[PackedRow]) -> list[PackedRow]:
        for i, row in enumerate(rows):
            if len(row) > self.seq_len:
                raise ValueError(f"example {i}: PackedRow holds {len(row)} tokens, more than seq_len={self.seq_len}; "
                                 f"build the PackedDataset with the collator's seq_len")
            if not row.documents:
                raise ValueError(f"example {i}: PackedRow holds no documents")
        return list(rows)

