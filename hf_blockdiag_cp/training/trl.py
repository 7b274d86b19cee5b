"""``CPSFTTrainer``: TRL's ``SFTTrainer`` on a (dp, cp) mesh, with packing done by this package.

Optional: needs ``pip install "hf-blockdiag-cp[trl]"`` (TRL, and PEFT for LoRA). Imported only when used.

What TRL keeps doing: the dataset handling of ``SFTTrainer`` — conversational and prompt-completion data, chat
templates, its tokenisation, EOS handling, completion-only and assistant-only loss (as ``labels`` with -100), its
truncation — and its loss (the fused LM head, which scores the collator's pre-shifted ``shift_labels`` as given)
and metrics. What this class replaces, and why (TRL 1.16, verified):

- packing. ``SFTConfig(packing=True)`` makes TRL pack rows itself and switch to padding-free batches, which refuse
  a custom collator; under CP every rank needs a shard of the same row plus a ``cp_context``. Here TRL prepares the
  data *unpacked*, and this class packs it into :class:`~hf_blockdiag_cp.data.rows.PackedRow` rows of
  ``max_length`` tokens (best-fit-decreasing, the same rows on every CP rank) for a
  :class:`~hf_blockdiag_cp.PackingCollator` built on the mesh.
- the data loaders (through :class:`~hf_blockdiag_cp.CPTrainer`): sharded over ``dp`` only.
- ``prediction_step``: TRL's calls ``compute_loss`` without ``num_items_in_batch``, so each rank divides its
  shard's loss sum by its own target count, and ``eval_loss`` becomes the mean of per-rank shard means (exactly
  half the true loss when one rank holds only padding). Here the evaluation step passes the global count, as the
  stock ``Trainer.prediction_step`` does: ``eval_loss`` is the exact token mean.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Dataset
from torch.utils.data import IterableDataset as TorchIterableDataset

from ..compat import check_sft_trainer_internals
from ..config import ATTN_IMPLEMENTATION, BlockDiagCPConfig
from ..data import PackedDataset, PackedRow, PackingCollator
from ..errors import Refusal
from ..model import require_blockdiag_cp
from .mesh import cp_coordinates, ulysses_groups
from .trainer import CPTrainer

try:
    from trl import SFTConfig, SFTTrainer
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("hf_blockdiag_cp.training.trl needs TRL: pip install 'hf-blockdiag-cp[trl]' "
                      f"(trl>=1.16, peft>=0.21, datasets); the import failed with: {err}") from err

__all__ = ["CPSFTTrainer", "PackedRows"]

check_sft_trainer_internals(SFTTrainer)  # the private method overridden below (ImportError if renamed)


class PackedRows(Dataset):
    """A map-style dataset of packed rows (one :class:`PackedRow` per item), built once from a sized dataset.

    Map-style, unlike :class:`~hf_blockdiag_cp.PackedDataset`, so that the Trainer knows its length: epochs
    (``num_train_epochs``) work, and the rows are shuffled per epoch by the data-parallel sampler (the same order
    on every CP rank).
    """

    def __init__(self, rows: Iterable[PackedRow]) -> None:
        self.rows = list(rows)
        if not self.rows:
            raise ValueError("the dataset packs into no row (every example is empty)")

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> PackedRow:
        return self.rows[index]

    def __iter__(self) -> Iterator[PackedRow]:
        return iter(self.rows)


def _is_rows(dataset: Any) -> bool:
    return isinstance(dataset, (PackedRows, PackedDataset))


def _token_columns(dataset: Any) -> Any:
    """Only ``input_ids`` / ``labels`` of a ``datasets`` dataset (the text columns TRL keeps are not read)."""
    names = getattr(dataset, "column_names", None)
    if isinstance(names, list) and "input_ids" in names:
        return dataset.select_columns([c for c in ("input_ids", "labels") if c in names])
    return dataset


class CPSFTTrainer(CPTrainer, SFTTrainer):
    """``trl.SFTTrainer`` for block-diagonal context parallelism on a (dp, cp) mesh.

    Takes every ``SFTTrainer`` argument plus ``mesh`` (from :func:`~hf_blockdiag_cp.init_device_mesh`, or ``None``
    for no CP), ``cp_config`` (the :class:`~hf_blockdiag_cp.BlockDiagCPConfig` of every context) and
    ``packing_buffer_size`` (examples packed together, best-fit-decreasing). ``args`` must be a ``trl.SFTConfig``:

    - ``max_length`` is the packed row length ``S`` (all CP ranks together; divisible by ``cp_size``);
    - ``packing=True`` packs many examples per row; ``packing=False`` lays one example per row (padded to ``S``);
      ``eval_packing`` likewise for evaluation. ``packing_strategy`` ``"bfd"`` truncates examples longer than ``S``
      (TRL's truncation, ``truncation_mode``), ``"bfd_split"`` splits them into pieces; ``"wrapped"`` is refused
      (it cuts documents at row edges and lets them attend across);
    - under CP ``per_device_train_batch_size`` / ``per_device_eval_batch_size`` must be 1 (one row per micro-batch;
      use ``gradient_accumulation_steps``).

    The model must use ``attn_implementation="blockdiag_cp"`` (for a model given by name:
    ``model_init_kwargs={"attn_implementation": "blockdiag_cp"}``). ``data_collator`` may be a
    :class:`~hf_blockdiag_cp.PackingCollator` (or any collator of :class:`PackedRow` items that exposes its CP
    topology); by default one is built from ``max_length``, the tokenizer's pad token, the mesh and ``cp_config``
    (with ``cp_config.ulysses_size != 1`` also the model's heads and the head-parallel subgroups of
    :func:`~hf_blockdiag_cp.ulysses_groups`, created in the constructor: every process builds its trainer). Every
    :class:`~hf_blockdiag_cp.CPTrainer` check applies (``label_smoothing_factor``, ``compute_loss_func`` and
    accelerate's own ``parallelism_config`` are refused under CP; ``compute_metrics`` gets rows in order).
    """

    #: TRL's own loss already projects in chunks (its fused LM head, which also feeds its entropy / accuracy
    #: metrics): ``chunked_loss=None`` keeps it; ``chunked_loss=True`` uses
    #: :func:`~hf_blockdiag_cp.chunked_causal_lm_loss`.
    _chunked_loss_by_default = False

    def __init__(self, model: Any, args: SFTConfig | None = None, data_collator: Any = None,
                 train_dataset: Any = None, eval_dataset: Any = None, processing_class: Any = None, *,
                 mesh: Any = None, cp_config: BlockDiagCPConfig | None = None, packing_buffer_size: int = 1000,
                 **kwargs: Any) -> None:
        if not isinstance(args, SFTConfig):
            raise ValueError(f"args must be a trl.SFTConfig (its max_length is the packed row length), got "
                             f"{type(args).__name__}")
        if args.max_length is None:
            raise ValueError("args.max_length=None: CPSFTTrainer packs rows of max_length tokens; set it (e.g. 4096)")
        if args.packing_strategy not in ("bfd", "bfd_split"):
            raise ValueError(f"args.packing_strategy={args.packing_strategy!r} is not supported: it cuts documents at "
                             "row edges and lets the pieces attend across; use 'bfd' (truncate over-long examples) "
                             "or 'bfd_split' (split them)")
        if isinstance(packing_buffer_size, bool) or not isinstance(packing_buffer_size, int) or packing_buffer_size < 1:
            raise ValueError(f"packing_buffer_size={packing_buffer_size!r} must be an int >= 1")
        cp_size = cp_coordinates(mesh).cp_size
        if args.max_length % cp_size:
            raise ValueError(f"args.max_length={args.max_length} is not divisible by the mesh's cp_size={cp_size}: "
                             "every rank holds max_length / cp_size tokens of each row")
        if cp_size > 1:
            for name in ("per_device_train_batch_size", "per_device_eval_batch_size"):
                if getattr(args, name) != 1:
                    raise ValueError(f"args.{name}={getattr(args, name)}: under CP a micro-batch is one packed row "
                                     f"(the context and exchange are planned per row); set {name}=1 and use "
                                     "gradient_accumulation_steps for more rows per step")
        # TRL refuses a custom collator whenever it would pack (padding-free), so the collator is installed after
        # TRL has prepared the data; TRL's own collator, built meanwhile, is never used.
        self._cp_collator, self._cp_config, self._packing_buffer_size = data_collator, cp_config, packing_buffer_size
        super().__init__(model=model, args=args, data_collator=None, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class, mesh=mesh, **kwargs)

    # ---- data -----------------------------------------------------------------------------------------

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: SFTConfig, packing: bool,
                         formatting_func: Any, dataset_name: str) -> Any:
        """TRL's preparation without its packing: tokenised examples with ``input_ids`` and ``labels``.

        With ``packing_strategy="bfd_split"`` TRL's truncation is skipped (over-long examples are split into
        pieces when the rows are packed); otherwise TRL truncates to ``max_length`` as it does without packing.
        """
        if packing and args.packing_strategy == "bfd_split":
            args = copy.copy(args)  # a shallow copy: only max_length differs, the caller's args stay as they are
            args.max_length = None
        return super()._prepare_dataset(dataset, processing_class, args, False, formatting_func, dataset_name)

    def _packing_for(self, description: str) -> bool:
        args = self.args
        if description == "Training":
            return args.packing
        return args.packing if args.eval_packing is None else args.eval_packing

    def _as_rows(self, dataset: Any, packing: bool) -> PackedRows | PackedDataset:
        """Tokenised examples -> packed rows of ``max_length`` (one example per row without ``packing``)."""
        if dataset is None or _is_rows(dataset):
            return dataset
        args = self.args
        overflow = "split" if args.packing_strategy == "bfd_split" else "truncate"
        buffer_size = self._packing_buffer_size if packing else 1
        examples = _token_columns(dataset)
        if isinstance(examples, TorchIterableDataset) or not isinstance(examples, Sized):
            return PackedDataset(examples, args.max_length, overflow=overflow, buffer_size=buffer_size)
        return PackedRows(PackedDataset(examples, args.max_length, overflow=overflow, buffer_size=buffer_size))

    def _setup_cp(self) -> None:
        """Install the CP collator and the packed rows, then run :class:`CPTrainer`'s checks."""
        args, mesh = self.args, self.mesh
        if self._is_vision_dataset:
            raise Refusal("CPSFTTrainer does not support vision datasets: TRL prepares them in its own "
                          "collator at every step, so they cannot be packed into rows beforehand")
        collator = self._cp_collator
        if collator is None:
            config = self._cp_config or BlockDiagCPConfig()
            # A head-parallel layout needs the model's heads and the subgroups, created here once (a collective
            # over the world: every process builds its trainer) for every u a step may use.
            groups = None
            if mesh is not None and mesh["cp"].size() > 1 and config.ulysses_size != 1:
                groups = ulysses_groups(mesh, config=config)
            collator = PackingCollator(args.max_length, group=mesh["cp"] if mesh is not None else None,
                                       pad_token_id=self._tokenizer.pad_token_id,
                                       overflow="split" if args.packing_strategy == "bfd_split" else "truncate",
                                       config=config, model_config=getattr(self.model, "config", None),
                                       ulysses_groups=groups)
        elif isinstance(collator, PackingCollator) and collator.seq_len != args.max_length:
            raise ValueError(f"the data_collator's seq_len={collator.seq_len} but args.max_length={args.max_length}: "
                             "the rows are packed to max_length; build the collator with the same length")
        self.data_collator = collator
        self.train_dataset = self._as_rows(self.train_dataset, self._packing_for("Training"))
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {k: self._as_rows(v, self._packing_for("Evaluation"))
                                 for k, v in self.eval_dataset.items()}
        else:
            self.eval_dataset = self._as_rows(self.eval_dataset, self._packing_for("Evaluation"))
        require_blockdiag_cp(self.model, f"packed rows need {ATTN_IMPLEMENTATION!r} (for a model given by name, pass "
                                         f"model_init_kwargs={{'attn_implementation': {ATTN_IMPLEMENTATION!r}}})")
        super()._setup_cp()

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, sampler_fn: Any = None,
                        is_training: bool = False, dataloader_key: str | None = None) -> torch.utils.data.DataLoader:
        """Datasets given later (``evaluate(eval_dataset=...)``, prepared by TRL there) are packed here."""
        dataset = self._as_rows(dataset, self._packing_for(description))
        return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, dataloader_key)

    # ---- evaluation -----------------------------------------------------------------------------------

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """The evaluation loss with the step's global target count (TRL's own step passes none; see the module).

        Every rank returns ``W * S_r / N`` (``S_r`` its shard's loss sum, ``N`` the targets of this step on all
        ``W`` processes); the evaluation loop averages over processes: the exact token mean ``sum_r S_r / N``.
        """
        if not prediction_loss_only:  # logits for compute_metrics: CPTrainer's step (rows in order under CP)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        inputs = self._prepare_inputs(inputs)
        num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
        with torch.no_grad(), self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        return loss.detach(), None, None
