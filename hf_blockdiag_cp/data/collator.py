"""``PackingCollator``: examples (or rows from :class:`PackedDataset`) -> one CP rank's batch for ``model(**batch)``."""

from __future__ import annotations

import dataclasses
import logging
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._validate import check_int
from ..config import PLACEMENTS, BlockDiagCPConfig
from ..distributed.groups import group_to_ref, ref_to_group
from ..model.heads import head_shape
from ..planning.hybrid_placement import choose_placement
from ..planning.layout import CostModel, HeadShape
from ..planning.recurrent_cost import recurrent_shape
from .examples import Document, read_example
from .multimodal import media_spec
from .packing import check_overflow, rows_of_documents
from .rows import PackedRow, assemble_rows
from .sharding import rank_batch, resolve_cp, row_multiple
from .windows import sliding_windows as model_sliding_windows

__all__ = ["PackingCollator"]

logger = logging.getLogger("hf_blockdiag_cp.data")
#: Where the step layouts ``ulysses_size="auto"`` chooses are logged (INFO, once per distinct choice).
layout_logger = logging.getLogger("hf_blockdiag_cp")


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
            splitting as few documents as possible), ``"contiguous"``, ``"zigzag"`` or ``"mirror"`` (zigzag with
            split points that balance work: at most two recurrent state summaries per rank); default
            ``config.placement`` (``HF_BLOCKDIAG_CP_PLACEMENT``, else ``"balanced"``). Left unset with the
            ``model_config`` of a hybrid model (recurrent layers), the placement is chosen per step by
            :func:`hf_blockdiag_cp.planning.hybrid_placement.choose_placement` (docs/placement.md).
        sliding_windows: the model's attention windows, ``None`` for full-attention layers (see
            :func:`hf_blockdiag_cp.sliding_windows`): windowed layers then receive only the K/V
            inside their window, and the balanced placement weighs work by them.
        vocab_size: the model's vocabulary size, if known: a token or label id ``>= vocab_size`` then
            raises ``ValueError`` naming the example and field (instead of an ``IndexError`` deep in the
            embedding or the loss). :class:`~hf_blockdiag_cp.CPTrainer` fills it from the model.
        ulysses_size: ``u``, CP ranks per head-parallel (Ulysses) subgroup: an int dividing ``cp_size``,
            or ``"auto"`` (chosen per step by the cost model of :mod:`hf_blockdiag_cp.planning.layout`);
            default ``config.ulysses_size`` (``HF_BLOCKDIAG_CP_ULYSSES_SIZE``, else 1: sequence
            parallelism only). See docs/layouts.md.
        heads / model_config: the attention heads (a :class:`~hf_blockdiag_cp.planning.layout.HeadShape`),
            or the model config (or model) to read them from; needed when ``ulysses_size != 1``. For a
            vision-language model ``model_config`` is needed for examples with images or videos: its placeholder
            tokens, its per-token type ids and (Qwen2-VL family, Qwen3-VL, Qwen3.5) its 3-D rope positions, built
            per document on the host (see docs/multimodal.md).
        ulysses_groups: the subgroups from :func:`hf_blockdiag_cp.ulysses_groups`, created at setup for
            every ``u`` a step may use; needed when ``ulysses_size != 1``.

    Calling it on a list of examples (mappings with ``input_ids`` and optional ``labels``) packs them
    best-fit-decreasing and returns one batch dict: ``[B, S]`` at ``cp_size == 1`` (``B`` rows),
    exactly one row ``[1, L]`` under CP (more rows raise; see :meth:`micro_batches` and
    :class:`PackedDataset`). Calling it on :class:`PackedRow` items (from :class:`PackedDataset`)
    lays each out as one row without re-packing.
    """

    def __init__(self, seq_len: int, *, cp_size: int | None = None, cp_rank: int | None = None, group: Any = None,
                 pad_token_id: int, label_pad_id: int = -100, pad_to_multiple_of: int | None = None,
                 overflow: str = "split", config: BlockDiagCPConfig | None = None, placement: str | None = None,
                 sliding_windows: Sequence[int | None] | None = None, vocab_size: int | None = None,
                 ulysses_size: int | str | None = None, heads: HeadShape | None = None, model_config: Any = None,
                 ulysses_groups: Any = None) -> None:
        self.cp_rank, self.cp_size, self.group = resolve_cp(group, cp_rank, cp_size)
        if self.group is None and self.cp_size > 1 and dist.is_initialized():
            # Not the default group in its place: DDP's gradient all-reduce runs on it, and collectives of one
            # group issued in a different order on different ranks (the CP backward's and DDP's) would mis-pair.
            warnings.warn(f"PackingCollator(cp_size={self.cp_size}, cp_rank={self.cp_rank}) without group= while "
                          "torch.distributed is initialised: its contexts carry no process group, so a forward "
                          "outside CPTrainer (which attaches its mesh's) refuses them; pass group=mesh['cp']",
                          UserWarning, stacklevel=2)
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
            raise ValueError(f"placement='zigzag' needs seq_len={seq_len} divisible by 2 * cp_size = "
                             f"{2 * self.cp_size}")
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or not pad_token_id < vocab_size):
            raise ValueError(f"vocab_size={vocab_size!r} must be None or an int above pad_token_id={pad_token_id}")
        self.vocab_size = vocab_size
        self.sliding_windows = tuple(sliding_windows or ())
        if ulysses_size is not None:
            self.config = dataclasses.replace(self.config, ulysses_size=ulysses_size)
        self.heads, self.ulysses_groups = _layout_inputs(self.config, self.cp_size, heads, model_config, ulysses_groups)
        self.media = media_spec(model_config)
        if self.media is not None and self.media.blocks is not None and sliding_windows is None:
            # A window cuts a bidirectional block's keys only with its own plan: take the model's windows.
            self.sliding_windows = tuple(model_sliding_windows(model_config))
        self._layouts_logged: set[Any] = set()
        # A hybrid model's placement is chosen per step (attention balance against recurrent state traffic) unless
        # one is asked for; sequence parallelism only (a head-parallel layout places its groups itself).
        self.recurrent = (recurrent_shape(model_config) if placement is None and self.cp_size > 1
                          and self.config.ulysses_size == 1 else None)
        for window in self.sliding_windows:
            if window is not None:
                check_int("sliding_windows", window, minimum=1)

    def __getstate__(self) -> dict[str, Any]:
        # DataLoader workers started with "spawn" receive the collator pickled: send the CP group
        # by name (the contexts built there carry the name back to the main process).
        state = {**self.__dict__, "group": group_to_ref(self.group)}
        state.pop("_buffers", None)  # per-process scratch (thread-local): a worker makes its own
        return state

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
        docs = [read_example(e, index=i, label_pad_id=self.label_pad_id, media=self.media)
                for i, e in enumerate(examples)]
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
                              label_pad_id=self.label_pad_id, media=self.media) for r in rows]
        num_items = sum(f.num_items for f in full)
        return [self._log_layout(rank_batch(
            f, cp_rank=self.cp_rank, cp_size=self.cp_size, group=self.group, config=self.config,
            placement=self._placement_of(f), sliding_windows=self.sliding_windows, num_items=num_items,
            heads=self.heads, ulysses_groups=self.ulysses_groups)) for f in full]

    def _placement_of(self, full: Any) -> Any:
        """The step's placement: the configured kind, or for a hybrid model the cheapest candidate (logged with its
        reason once per distinct choice)."""
        if self.recurrent is None:
            return self.placement
        choice = choose_placement(full.doc_ids[0], self.cp_size, self.recurrent,
                                  tolerance=self.config.balance_tolerance, windows=self.sliding_windows or (None,),
                                  model=CostModel(flops_per_byte=self.config.layout_flops_per_byte))
        if choice.cost.name not in self._layouts_logged:
            self._layouts_logged.add(choice.cost.name)
            layout_logger.info("%s", choice.reason())
        return choice.placement

    def _log_layout(self, batch: dict[str, Any]) -> dict[str, Any]:
        """Log the layout ``ulysses_size="auto"`` chose, once per distinct ``(u, c)``."""
        layout = batch["cp_context"].layout
        if layout is not None and layout.requested == "auto":
            choice = (layout.ulysses_size, layout.seq_groups)
            if choice not in self._layouts_logged:
                self._layouts_logged.add(choice)
                layout_logger.info("layout: %s", layout.summary())  # the logger's name says whose
        return batch

    def __call__(self, examples: Sequence[Any]) -> dict[str, Any]:
        """This rank's batch for ``examples``: ``[B, S]`` tensors at ``cp_size == 1``, ``[1, L]`` under CP."""
        rows = self.pack(examples)
        if self.cp_size > 1 and len(rows) > 1:
            raise ValueError(
                f"the {len(examples)} examples need {len(rows)} rows of seq_len={self.seq_len}, but under context "
                f"parallelism (cp_size={self.cp_size}) one call returns one row; feed rows from "
                f"hf_blockdiag_cp.PackedDataset with batch size 1, or use PackingCollator.micro_batches()")
        # One row (always under CP): its full-row tensors go into this collator's reusable buffers; the batch and
        # context keep only copies (gathers of this rank's positions, planned runs), never the buffers.
        full = assemble_rows([r.documents for r in rows], self.seq_len, pad_token_id=self.pad_token_id,
                             label_pad_id=self.label_pad_id, scratch=self._row_buffers() if len(rows) == 1 else None,
                             media=self.media)
        return self._log_layout(rank_batch(
            full, cp_rank=self.cp_rank, cp_size=self.cp_size, group=self.group, config=self.config,
            placement=self._placement_of(full), sliding_windows=self.sliding_windows, heads=self.heads,
            ulysses_groups=self.ulysses_groups))

    def _row_buffers(self) -> dict[str, Any]:
        """This thread's reusable full-row buffers (a collator called from several threads gives each its own)."""
        local = self.__dict__.get("_buffers")
        if local is None:
            local = self.__dict__.setdefault("_buffers", threading.local())
        if not hasattr(local, "rows"):
            local.rows = {}
        return local.rows

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



def _layout_inputs(config: BlockDiagCPConfig, cp_size: int, heads: HeadShape | None, model_config: Any,
                   ulysses_groups: Any) -> tuple[HeadShape | None, Any]:
    """The head shape and subgroups a head-parallel layout needs; clear errors when ``u != 1`` lacks them."""
    if heads is not None and not isinstance(heads, HeadShape):
        raise TypeError(f"heads must be a hf_blockdiag_cp.planning.layout.HeadShape, got {type(heads).__name__}")
    u = config.ulysses_size
    if u == 1 or cp_size == 1:
        return heads, ulysses_groups
    if isinstance(u, int) and cp_size % u:  # first: no head count can fix it
        raise ValueError(f"ulysses_size={u} does not divide cp_size={cp_size}")
    if heads is None and model_config is not None:
        heads = head_shape(model_config)
    if heads is None:
        raise ValueError(f"ulysses_size={u!r} splits attention heads over CP ranks: give the collator the model's "
                         "heads (model_config=model.config, or heads=HeadShape(num_q_heads, num_kv_heads, head_dim))")
    if ulysses_groups is None:
        raise ValueError(f"ulysses_size={u!r} needs the head-parallel subgroups: create them once at setup with "
                         "hf_blockdiag_cp.ulysses_groups(mesh, sizes=...) and pass ulysses_groups=")
    return heads, ulysses_groups
