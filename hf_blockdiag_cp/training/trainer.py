"""``CPTrainer``: ``transformers.Trainer`` on a (dp, cp) mesh, without patching the Trainer.

What the transformers 5.24 ``Trainer`` already gets right under CP (see docs/trainer.md for the lines):
it counts every micro-batch's ``shift_labels != -100`` (each CP rank counts its shard), all-gathers and
sums the counts over all processes (``average_tokens_across_devices=True``), passes that global count
``N`` to the model as ``num_items_in_batch`` and multiplies the loss by the number of processes ``W``;
DDP averages gradients over the ``W`` processes, so the step's gradient is that of the exact global token
mean, and the logged loss (the mean of the per-process losses) is that mean too.

What it gets wrong, and this class replaces: its data loaders. accelerate shards or dispatches batches
over *all* processes, so the ranks of one CP group would get different rows, and per-rank CP batches
(with a ``ProcessGroup`` inside ``cp_context``) cannot be dispatched at all. Here every loader is a
:func:`~hf_blockdiag_cp.dp_dataloader`, sharded over the mesh's ``dp`` dimension only.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, IterableDataset
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import is_datasets_available

from ..compat import (
    accelerate_prepared,
    cache_eval_dataloader,
    check_trainer_internals,
    forget_accelerate_prepared,
    forwards_loss_kwargs,
)
from ..config import BlockDiagCPConfig
from ..context import BlockDiagCPContext
from ..data import PackedDataset, PackingCollator
from ..errors import Refusal
from ..model import prepare_model, require_blockdiag_cp
from .checks import check_collator, check_no_accelerate_cp
from .chunked_loss import DEFAULT_CHUNK_SIZE, check_chunked_loss, chunked_causal_lm_loss
from .consistency import check_parameters_consistent
from .data import shard_loader
from .mesh import check_group_timeouts, cp_coordinates
from .predict import gather_over_dp, gather_row_order, mean_over_cp, preprocess_local
from .shutdown import close_process_groups_at_exit, settle_collectives

__all__ = ["CPTrainer"]

check_trainer_internals(Trainer)  # the private Trainer methods overridden or called below (ImportError if renamed)


#: ``TrainingArguments.per_device_eval_batch_size``'s default, which CP replaces by 1 (one row per micro-batch).
_DEFAULT_EVAL_BATCH_SIZE = next(f.default for f in dataclasses.fields(TrainingArguments)
                                if f.name == "per_device_eval_batch_size")


def _is_hf_map_dataset(dataset: Any) -> bool:
    """A ``datasets.Dataset`` (whose unused columns the Trainer drops from the dataset, not in the collator)."""
    if not is_datasets_available():
        return False
    import datasets

    return isinstance(dataset, datasets.Dataset)


def _set_loader_epoch(loader: DataLoader, epoch: int) -> None:
    # What accelerate's DataLoaderShard.set_epoch does: reach the sampler (DistributedSampler shuffle) and
    # the dataset (PackedDataset row shuffle).
    for part in (loader.sampler, loader.dataset):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)


class CPTrainer(Trainer):
    """``transformers.Trainer`` for block-diagonal context parallelism on a (dp, cp) mesh.

    Takes every ``Trainer`` argument plus ``mesh``: the :func:`~hf_blockdiag_cp.init_device_mesh` mesh, or
    ``None`` (no CP, with the set-up checks below; training takes the same data path as with a mesh, each process a
    DP group of one, so a CP run reproduces its one-process run step for step; on several processes every process
    collates its own batches, since accelerate cannot dispatch a ``cp_context``). Use it with a
    :class:`~hf_blockdiag_cp.PackingCollator` built with ``group=mesh["cp"]`` and a model loaded with
    ``attn_implementation="blockdiag_cp"``; feed :class:`~hf_blockdiag_cp.PackedDataset` rows with
    ``per_device_train_batch_size=1``. Launch one process per device (``accelerate launch``/``torchrun``).

    Raises ``ValueError`` at construction for set-ups whose loss or attention would be silently wrong
    under CP (each message names the argument to change), and on a mesh whose process groups wait longer
    than the package's ``collective_timeout_s`` (plus margin) for a stalled peer (set
    ``TrainingArguments(ddp_timeout=...)``); see docs/trainer.md and docs/errors.md. A
    :class:`~hf_blockdiag_cp.PackingCollator` without ``vocab_size`` gets the model's, so out-of-vocabulary
    ids raise in the collator, naming the example.

    ``offload_activations``: run each training forward under ``torch.autograd.graph.save_on_cpu`` (pinned host
    memory on CUDA): every tensor autograd saves for the backward lives in host memory until the backward needs it.
    With ``activation_checkpointing`` that is what is saved outside the recomputed layers; their inputs are saved
    only by reentrant checkpointing (``activation_checkpointing_kwargs={"use_reentrant": True}``), the
    non-reentrant kind keeps them on the device itself. Exact either way (the values are copied, not changed).

    ``chunked_loss``: the training loss through :func:`~hf_blockdiag_cp.chunked_causal_lm_loss` (no ``[L, V]``
    logits; ``chunked_loss_chunk_size`` tokens at a time). ``None`` (default): on where it is exact (the model's
    head is accepted, no ``compute_loss_func`` / label smoothing), else the model's own loss; ``True``: required
    (``NotImplementedError`` naming the cause otherwise); ``False``: the model's own loss.

    ``parameter_check_every`` (default 100, 0 = never): under CP the parameters of the CP group are compared at
    the first step and every that many optimizer steps, raising
    :class:`~hf_blockdiag_cp.training.consistency.ParameterMismatchError` when they differ (cost: one pass over
    the parameters and two small all-gathers per check).
    """

    #: What ``chunked_loss=None`` means: on where exact (a subclass whose own loss already chunks sets ``False``).
    _chunked_loss_by_default = True

    def __init__(self, *args: Any, mesh: DeviceMesh | None = None, chunked_loss: bool | None = None,
                 chunked_loss_chunk_size: int = DEFAULT_CHUNK_SIZE, parameter_check_every: int = 100,
                 offload_activations: bool = False, **kwargs: Any) -> None:
        self.mesh, self.offload_activations = mesh, bool(offload_activations)
        self.chunked_loss, self.chunked_loss_chunk_size = chunked_loss, chunked_loss_chunk_size
        if isinstance(parameter_check_every, bool) or not isinstance(parameter_check_every, int) \
                or parameter_check_every < 0:
            raise ValueError(f"parameter_check_every must be an int >= 0 (0 = never), got {parameter_check_every!r}")
        self.parameter_check_every = parameter_check_every
        # Before the Trainer builds its Accelerator: on CPU accelerate refuses its own CP with a message that does
        # not point here, and a launcher flag it drops would otherwise go unnoticed.
        check_no_accelerate_cp(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        check_no_accelerate_cp(self.args, self.accelerator)
        self._setup_cp()

    def _setup_cp(self) -> None:
        """Checks run once the stock Trainer is built (subclasses that install their own data first extend it)."""
        mesh = self.mesh
        coords = cp_coordinates(mesh)  # also rejects a mesh that is not ("dp", "cp")
        if mesh is not None and mesh.size() != self.args.world_size:
            raise ValueError(f"mesh has {mesh.size()} ranks but the Trainer runs {self.args.world_size} processes; "
                             "build the mesh with hf_blockdiag_cp.init_device_mesh after creating TrainingArguments")
        check_collator(self.data_collator, mesh)
        if mesh is not None:
            config = getattr(self.data_collator, "config", None)
            check_group_timeouts(mesh, config if isinstance(config, BlockDiagCPConfig) else None)
        self._fill_vocab_size()
        if getattr(self.data_collator, "label_pad_id", -100) != -100:
            raise ValueError(f"the collator's label_pad_id={self.data_collator.label_pad_id} but the Trainer counts "
                             "targets as shift_labels != -100 (and the HF loss ignores -100): use label_pad_id=-100")
        if mesh is not None and self.args.train_sampling_strategy not in ("random", "sequential"):
            raise ValueError(f"train_sampling_strategy={self.args.train_sampling_strategy!r} is not supported on a "
                             "mesh (batches are sampled per data-parallel group): use 'random' or 'sequential'")
        if coords.cp_size > 1:
            self._check_cp_arguments()
            if self.parameter_check_every:
                self.add_callback(ParameterConsistencyCallback(mesh, self.parameter_check_every))
        if mesh is None and self.args.world_size > 1:
            self._collate_on_every_process()
        prepare_model(self.model, strict=True)
        if self.chunked_loss and self.model is not None:
            self._chunked_loss_refusal(self.model, raise_=True)

    def _collate_on_every_process(self) -> None:
        """Without a mesh the stock loaders run; keep accelerate from dispatching batches (its default for iterable
        datasets such as PackedDataset): it concatenates every process's batch on process 0, which a batch carrying a
        ``cp_context`` cannot survive. Each process then collates its own rows (accelerate's IterableDatasetShard)."""
        loader_config = self.accelerator.dataloader_config
        if loader_config.dispatch_batches:
            raise ValueError(f"accelerator_config.dispatch_batches=True on {self.args.world_size} processes: "
                             "accelerate would concatenate every process's batch on process 0, which cannot carry the "
                             "collator's cp_context; leave dispatch_batches unset (CPTrainer then collates on every "
                             "process)")
        loader_config.dispatch_batches = False

    def _check_cp_arguments(self) -> None:
        """Settings under which the Trainer's loss or the attention would be silently wrong under CP."""
        args = self.args
        require_blockdiag_cp(self.model, "under CP its attention would only see each rank's shard")
        if not args.average_tokens_across_devices:
            raise ValueError("average_tokens_across_devices=False: under CP each rank would divide its shard's loss "
                             "by its own target count; set average_tokens_across_devices=True (the default) for the "
                             "exact token mean")
        if not self.model_accepts_loss_kwargs and forwards_loss_kwargs(self.accelerator.unwrap_model(self.model)):
            # Vision-language models (Qwen2-VL family, gemma3, ...) set accepts_loss_kwargs = False although their
            # forward hands **kwargs to self.loss_function: the global num_items_in_batch does reach their loss.
            self.model_accepts_loss_kwargs = True
        if not self.model_accepts_loss_kwargs:
            raise ValueError(f"{type(self.model).__name__} does not accept loss kwargs (accepts_loss_kwargs=False): "
                             "the Trainer cannot pass the global num_items_in_batch, so the CP loss would be off by "
                             "the CP size; use a model whose forward takes **kwargs")
        if self.compute_loss_func is not None or self.label_smoother is not None:
            name = "compute_loss_func" if self.compute_loss_func is not None else "label_smoothing_factor"
            raise ValueError(f"{name} is not supported under CP: it gets the rank-local, unshifted labels and "
                             "would shift them inside each shard (losing the target at every rank boundary); use "
                             "the model's own loss (it reads the collator's shift_labels)")
        if args.parallelism_config is not None:
            raise ValueError("parallelism_config (accelerate's own TP/CP/SP) cannot be combined with "
                             "hf_blockdiag_cp's mesh: leave it None")

    # ---- overrides ------------------------------------------------------------------------------------

    def _fill_vocab_size(self) -> None:
        """Give a :class:`PackingCollator` without ``vocab_size`` the model's (and refuse a larger one)."""
        collator = self.data_collator
        embeddings = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        vocab = getattr(embeddings, "num_embeddings", None) or getattr(getattr(self.model, "config", None),
                                                                      "vocab_size", None)
        if not isinstance(collator, PackingCollator) or not isinstance(vocab, int):
            return
        if collator.vocab_size is None:
            if collator.pad_token_id >= vocab:
                raise ValueError(f"the collator's pad_token_id={collator.pad_token_id} is not below the model's "
                                 f"vocabulary size {vocab}")
            collator.vocab_size = vocab
        elif collator.vocab_size > vocab:
            raise ValueError(f"the collator's vocab_size={collator.vocab_size} is larger than the model's input "
                             f"embedding ({vocab} rows)")

    def _get_dataloader(self, dataset: Dataset, description: str, batch_size: int,
                        sampler_fn: Callable | None = None, is_training: bool = False,
                        dataloader_key: str | None = None) -> DataLoader:
        """Every loader (train, eval, test) sharded over ``dp`` only and not passed through accelerate.

        Overridden because the stock builder (``Trainer._get_dataloader``) ends in ``accelerator.prepare``,
        which shards/dispatches over all processes. Device placement still happens in ``_prepare_inputs``.
        """
        args = self.args
        if self.mesh is None and (not is_training or args.parallelism_config is not None
                                  or args.train_sampling_strategy not in ("random", "sequential")):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training,
                                           dataloader_key)
        # Training without a mesh takes the same path as with one (each process its own data-parallel share), so
        # that a CP run reproduces its one-process run step for step, across pass boundaries too.
        if self.mesh is None:
            dp_rank, dp_size, cp_size = args.process_index, args.world_size, 1
        else:
            coords = cp_coordinates(self.mesh)
            dp_rank, dp_size, cp_size = coords.dp_rank, coords.dp_size, coords.cp_size
        if cp_size > 1 and not is_training and batch_size == _DEFAULT_EVAL_BATCH_SIZE \
                and args.per_device_eval_batch_size == _DEFAULT_EVAL_BATCH_SIZE:
            # TrainingArguments' default, not a choice: under CP an evaluation micro-batch is one row.
            batch_size = 1
        if cp_size > 1 and batch_size != 1 and isinstance(dataset, PackedDataset):
            name = "per_device_train_batch_size" if is_training else "per_device_eval_batch_size"
            raise ValueError(f"{name}={batch_size}: under CP a micro-batch is one PackedDataset row (the context "
                             f"and exchange are planned per row); set {name}=1 and use gradient_accumulation_steps")
        collator = self.data_collator
        if _is_hf_map_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description=description)
        else:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        iterable = isinstance(dataset, IterableDataset)
        if iterable and not is_training and dp_size > 1:
            # Evaluation gathers over all processes every step, so every DP group needs the same number of
            # batches: a finite list gets DistributedSampler's padding to equal length.
            dataset = list(dataset)
            iterable = False
        loader = shard_loader(
            dataset, dp_rank, dp_size, collate_fn=collator, batch_size=batch_size,
            shuffle=is_training and not iterable and args.train_sampling_strategy == "random",
            seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
            endless=iterable and is_training, repeats_without_targets=is_training,
            num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers,
            multiprocessing_context=args.dataloader_multiprocessing_context,
            prefetch_factor=args.dataloader_prefetch_factor, in_order=args.dataloader_in_order)
        # The Trainer calls set_epoch on the loader (accelerate's loaders forward it); a plain DataLoader has none.
        loader.set_epoch = functools.partial(_set_loader_epoch, loader)
        if dataloader_key is not None and args.dataloader_persistent_workers:  # as the stock builder caches
            cache_eval_dataloader(self, dataloader_key, loader)
        return loader

    def _prepare_inputs(self, inputs: dict[str, torch.Tensor | Any]) -> dict[str, torch.Tensor | Any]:
        """Attach the mesh's CP group to contexts built without one (a collator made with ``cp_rank``/``cp_size``
        and no ``group``, e.g. for DataLoader workers), then the stock device placement."""
        ctx = inputs.get("cp_context") if isinstance(inputs, Mapping) else None
        if self.mesh is not None and isinstance(ctx, BlockDiagCPContext):
            coords = cp_coordinates(self.mesh)
            # A collator that exposed the right topology at construction may still build other contexts (a
            # function collator is trusted on its attributes): one int comparison per step catches it.
            if (ctx.cp_size, ctx.cp_rank) != (coords.cp_size, coords.cp_rank):
                raise ValueError(f"the batch's cp_context is for cp_size={ctx.cp_size}, cp_rank={ctx.cp_rank} but the "
                                 f"mesh has cp_size={coords.cp_size}, cp_rank={coords.cp_rank}: the "
                                 "data_collator must shard rows with the mesh's CP group (group=mesh['cp'])")
            if ctx.cp_size > 1 and ctx.group is None:
                inputs = {**inputs, "cp_context": dataclasses.replace(ctx, group=self.mesh["cp"].get_group())}
        return super()._prepare_inputs(inputs)

    def _chunked_loss_refusal(self, model: torch.nn.Module, raise_: bool = False) -> str | None:
        """Why the chunked loss would not be exact for ``model`` under this Trainer's settings (``None``: it is)."""
        reason = None
        if self.compute_loss_func is not None or self.label_smoother is not None:
            reason = "compute_loss_func / label_smoothing_factor replace the model's loss"
        elif getattr(self, "aux_loss_enabled", False):  # TRL adds a MoE router loss to the model's own
            reason = "the router auxiliary loss is enabled"
        else:
            try:
                check_chunked_loss(model)
            except NotImplementedError as err:
                reason = str(err)
        if reason is not None and raise_:
            raise Refusal(f"chunked_loss=True: {reason}; pass chunked_loss=None or False")
        return reason

    def compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The stock loss, with the model's forward replaced by :func:`chunked_causal_lm_loss` where it is on.

        Runs ``Trainer.compute_loss`` itself (its ``num_items_in_batch`` and ``W`` scaling stay the stock ones) on
        a callable that returns ``{"loss": chunked loss}``. Calls that want the outputs (the logits, for
        ``prediction_step``) take the model's own path.
        """
        mode = self.chunked_loss if self.chunked_loss is not None or self._chunked_loss_by_default else False
        if return_outputs or mode is False or self._chunked_loss_refusal(model, raise_=bool(mode)) is not None:
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        chunk_size = self.chunked_loss_chunk_size

        def loss_only(**batch: Any) -> dict[str, torch.Tensor]:
            return {"loss": chunked_causal_lm_loss(model, batch, chunk_size=chunk_size)}

        return Trainer.compute_loss(self, loss_only, inputs, num_items_in_batch=num_items_in_batch)

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor | int | None:
        """The stock global target count, in training at least 1: a step whose labels are all ignored gets loss 0 and
        zero gradients instead of ``0 / 0 = NaN`` (the collator warns; a device-side clamp, no host read).

        Not in evaluation: there the stock loop drops a step's ``NaN`` loss from ``eval_loss`` (the true mean over the
        steps with targets), where a clamped 0 would be averaged in.
        """
        count = super()._get_num_items_in_batch(batch_samples, device)
        if not getattr(self.model, "training", True):
            return count
        if isinstance(count, torch.Tensor):
            return count.clamp_min(1)
        return count if count is None else max(count, 1)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``train``; on several processes the process groups are destroyed at a normal exit (see
        :mod:`~hf_blockdiag_cp.training.shutdown`: a finished gloo job could otherwise hang or abort while exiting).

        Also undoes what an ``evaluate()`` before ``train()`` leaves behind (a bug of the stock Trainer too).

        ``evaluation_loop`` prepares the bare model with ``accelerator.prepare_model(evaluation_mode=True)``,
        which wraps nothing but marks it ``_is_accelerate_prepared``; ``train()`` then gets it back unwrapped:
        no DDP, so no gradient all-reduce, and under CP each rank would step on its own shard's gradient.
        """
        model = self.model
        if self.args.world_size > 1 and self.model_wrapped is model and accelerate_prepared(model):
            forget_accelerate_prepared(self.accelerator, model)
        output = super().train(*args, **kwargs)
        if self.args.world_size > 1:
            # The run ended well: let gloo's workers free the last collectives now (a script that drops the trainer
            # next would otherwise free its groups under the GIL) and end the groups at exit (see shutdown.py).
            settle_collectives()
            close_process_groups_at_exit()
        return output

    def _finalize_training(self, trial: Any, num_train_samples: int, start_time: float) -> Any:
        """The stock end of ``train``, the loss of the steps since the last log first averaged over all processes.

        The stock one adds this process's own sum of those steps to the (already global) logged ones, so
        ``TrainOutput.training_loss`` and the logged ``train_loss`` were each rank's shard under CP (each process's
        rows under DP). The mean over processes is what the logging steps use (``nested_gather(...).mean()``).
        """
        pending = getattr(self, "_tr_loss", None)
        if self.args.world_size > 1 and isinstance(pending, torch.Tensor) and dist.is_initialized():
            total = pending.detach().clone()
            dist.all_reduce(total)  # every process ends train() here: one collective over the world
            pending.copy_(total / dist.get_world_size())
        return super()._finalize_training(trial, num_train_samples, start_time)

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The stock step, under ``save_on_cpu`` with ``offload_activations`` (the backward inside the step unpacks)."""
        if not self.offload_activations:
            return super().training_step(*args, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            return super().training_step(*args, **kwargs)

    def evaluation_loop(self, dataloader: DataLoader, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """The stock loop; under CP with predictions, every row in its own order and counted once (see predict.py).

        :meth:`prediction_step` gathers each rank's shard over the CP group into row order (after
        ``preprocess_logits_for_metrics``, which therefore runs on the shard), so the loop's own preprocessing is
        switched off and its ``gather_function`` gathers over ``dp`` only.
        """
        loss_only = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        if self.mesh is None or cp_coordinates(self.mesh).cp_size == 1 or loss_only:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        if "inputs" in self.args.include_for_metrics:
            raise ValueError("include_for_metrics=['inputs'] is not supported under CP: the loop reads each rank's "
                             "shard of input_ids, not the row; use the labels or the dataset's rows")
        preprocess = self.preprocess_logits_for_metrics
        self._cp_predict, self.preprocess_logits_for_metrics = (preprocess,), None
        self.gather_function = functools.partial(gather_over_dp, self.mesh)
        try:
            return super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                           metric_key_prefix)
        finally:
            self._cp_predict, self.preprocess_logits_for_metrics = None, preprocess
            self.gather_function = self.accelerator.gather_for_metrics

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[torch.Tensor | None, Any, Any]:
        """Under CP with predictions (inside :meth:`evaluation_loop`): ``(loss, outputs, labels)`` of the full rows.

        Returns the CP group's mean loss (the same on its ranks; ``eval_loss`` stays the exact token mean), the
        model's outputs except ``loss`` and ``ignore_keys`` (preprocessed on the shard) and the ``label_names``, each
        ``[B, S, ...]`` in the row's own order: what one process running the row returns. Otherwise the stock step.
        """
        ctx = inputs.get("cp_context") if isinstance(inputs, Mapping) else None
        if getattr(self, "_cp_predict", None) is None or prediction_loss_only or not isinstance(
                ctx, BlockDiagCPContext) or ctx.cp_size == 1:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        (preprocess,) = self._cp_predict
        group = self.mesh["cp"].get_group()
        if ignore_keys is None:
            ignore_keys = getattr(getattr(self.model, "config", None), "keys_to_ignore_at_inference", ["cache"])
        inputs = self._prepare_inputs(inputs)
        labels = tuple(inputs.get(name) for name in self.label_names)
        has_labels = bool(labels) and all(label is not None for label in labels)
        with torch.no_grad(), self.compute_loss_context_manager():
            if has_labels:
                num_items_in_batch = self._get_num_items_in_batch([inputs], self.args.device)
                loss, outputs = self.compute_loss(model, inputs, return_outputs=True,
                                                  num_items_in_batch=num_items_in_batch)
                loss = mean_over_cp(loss.detach().mean(), group, ctx.cp_size)
            else:
                loss, outputs = None, model(**inputs)
        items = outputs.items() if isinstance(outputs, Mapping) else enumerate(outputs[1:])
        logits = tuple(v.detach() for k, v in items if k not in [*ignore_keys, "loss"] and v is not None)
        logits = logits[0] if len(logits) == 1 else logits
        labels = (labels[0] if len(labels) == 1 else labels) if has_labels else None
        logits = preprocess_local(preprocess, logits, labels, ctx)
        return (loss, gather_row_order(logits, ctx, group, "the model's outputs"),
                gather_row_order(labels, ctx, group, "labels"))

    def get_total_train_batch_size(self, args: Any) -> int:
        """Rows per optimizer step: the ranks of a CP group share their rows, so only ``dp`` multiplies
        (the stock count divides by accelerate's CP size, which is 1 here). Used for logs and speed metrics."""
        if self.mesh is None:
            return super().get_total_train_batch_size(args)
        return self._train_batch_size * args.gradient_accumulation_steps * cp_coordinates(self.mesh).dp_size

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """Models built by ``model_init`` get the same fail-fast guard as the one given to ``__init__``."""
        return prepare_model(super().call_model_init(trial), strict=True)


class ParameterConsistencyCallback(TrainerCallback):
    """Compare the parameters of the CP group at the first step and every ``every`` optimizer steps
    (:func:`~hf_blockdiag_cp.training.consistency.check_parameters_consistent`; its cost is documented there)."""

    def __init__(self, mesh: DeviceMesh, every: int) -> None:
        self.mesh, self.every = mesh, every

    def on_step_begin(self, args: Any, state: Any, control: Any, model: torch.nn.Module | None = None,
                      **kwargs: Any) -> None:
        if model is not None and state.global_step % self.every == 0:
            check_parameters_consistent(model, self.mesh, step=state.global_step)
