"""Data for (dp, cp) training: the ranks of a CP group read the same rows, DP groups different ones.

One stream, one count: an iterable dataset's rows are numbered once over the whole stream (across passes when
the passes run back to back, and across DataLoader workers), and row ``i`` goes to data-parallel group
``i % dp_size``; inside a group the group's ``k``-th row goes to worker ``k % num_workers``. The DataLoader
takes its workers' items in turn, so every process sees its rows in stream order whatever ``num_workers`` is,
and the rows of an optimizer step are the same with or without a mesh, with any number of workers.

A map-style dataset whose pass does not divide over the DP groups: ``DistributedSampler`` gives every group the same
number of rows by repeating the pass's first rows; those repeats reach the step with no targets (see
:class:`PaddingWithoutTargets`), so every step is the token mean of the rows one process would train on.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from ..data import PackingCollator
from ..data.rows import PackedRow
from ..errors import Refusal
from .mesh import cp_coordinates

__all__ = ["DataParallelShard", "PaddingWithoutTargets", "dp_dataloader"]


def _one_pass(dataset: IterableDataset) -> tuple[Iterator[Any], bool]:
    """``(items of the current pass, whole)``: ``whole`` when the items are the whole pass even inside a DataLoader
    worker (a dataset with ``rows()``, e.g. :class:`~hf_blockdiag_cp.PackedDataset`); otherwise the dataset splits
    itself among workers, as PyTorch's contract for iterable datasets says, and only it knows how."""
    rows = getattr(dataset, "rows", None)
    if callable(rows):
        return iter(rows()), True
    return iter(dataset), False


class DataParallelShard(IterableDataset):
    """Every ``dp_size``-th item of an iterable dataset's stream, starting at ``dp_rank`` (all CP ranks of a DP
    group get the same items in the same order), split over DataLoader workers with the same count.

    ``endless``: the passes back to back, pass ``k`` after ``set_epoch(epoch + k)``, counted as one stream (what
    :class:`~hf_blockdiag_cp.CPTrainer` trains on). Under DP the groups may hold different numbers of rows per pass;
    if a group's pass ended early the Trainer would start a new epoch (or a short accumulation step) there alone
    and the collectives of the groups would pair up wrongly or hang; and even on one process the stock Trainer
    runs a pass's last short accumulation step together with the next pass's first micro-batch as one optimizer
    step, each normalised to its own count. An endless stream gives every group ``max_steps *
    gradient_accumulation_steps`` micro-batches, each step the next rows of the stream.
    """

    def __init__(self, dataset: IterableDataset, dp_rank: int = 0, dp_size: int = 1, *, endless: bool = False) -> None:
        super().__init__()
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.dataset, self.dp_rank, self.dp_size, self.endless = dataset, dp_rank, dp_size, endless
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        epoch, index = self.epoch, 0
        while True:
            if self.endless and hasattr(self.dataset, "set_epoch"):
                self.dataset.set_epoch(epoch)
            items, whole = _one_pass(self.dataset)
            # A dataset that splits itself among the workers: count within this worker's share only.
            stride, offset = (self.dp_size * workers, self.dp_rank + self.dp_size * worker) if whole \
                else (self.dp_size, self.dp_rank)
            produced = False
            for item in items:
                produced = True
                if index % stride == offset:
                    yield item
                index += 1
            if not self.endless:
                return
            if not produced:
                raise ValueError("the training dataset yields nothing (in this DataLoader worker): give it more data "
                                 "or lower dataloader_num_workers")
            epoch += 1


def dp_dataloader(dataset: Dataset | IterableDataset, mesh: DeviceMesh | None, *, collate_fn: Callable,
                  batch_size: int = 1, shuffle: bool = False, seed: int = 0, drop_last: bool = True,
                  num_workers: int = 0, endless: bool = False, **kwargs: Any) -> DataLoader:
    """A ``DataLoader`` sharded over the mesh's ``dp`` dimension only.

    Map-style datasets use a ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)``; iterable
    ones (e.g. :class:`~hf_blockdiag_cp.PackedDataset`) are wrapped in :class:`DataParallelShard` (``endless``:
    the passes back to back). With ``drop_last`` every DP group runs the same number of steps (a group without
    data would leave the others hanging in the gradient all-reduce). Without it, a map-style pass that does not
    divide over the groups has its first rows repeated for the groups' shares to be equal; the repeats reach the
    collator without targets (:class:`PaddingWithoutTargets`; :class:`~hf_blockdiag_cp.errors.Refusal` when the
    collator or the examples cannot take that).
    """
    coords = cp_coordinates(mesh)
    return shard_loader(dataset, coords.dp_rank, coords.dp_size, collate_fn=collate_fn, batch_size=batch_size,
                        shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers, endless=endless,
                        **kwargs)


def shard_loader(dataset: Dataset | IterableDataset, dp_rank: int, dp_size: int, *, collate_fn: Callable,
                 batch_size: int = 1, shuffle: bool = False, seed: int = 0, drop_last: bool = True,
                 num_workers: int = 0, endless: bool = False, repeats_without_targets: bool = True,
                 **kwargs: Any) -> DataLoader:
    """:func:`dp_dataloader` for explicit data-parallel coordinates (``CPTrainer(mesh=None)``: every process).

    ``repeats_without_targets=False``: the rows ``DistributedSampler`` repeats keep their targets (evaluation, where
    the loop gathers whole rows and documents the repeats)."""
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ValueError("shuffle=True needs a map-style dataset; give PackedDataset a seed instead")
        dataset = DataParallelShard(dataset, dp_rank, dp_size, endless=endless)
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                          drop_last=drop_last, **kwargs)
    if repeats_without_targets and not drop_last and len(dataset) % dp_size:  # repeated rows must not count
        check_padding_without_targets(dataset, dp_size, collate_fn)
        sampler = MarkedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed)
        dataset, collate_fn = _MarkedRows(dataset), PaddingWithoutTargets(collate_fn)
    else:
        sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                     drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, drop_last=drop_last, **kwargs)


# ---- map-style passes that do not divide over the DP groups ------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Repeat:
    """A row ``DistributedSampler`` repeated to make the groups' shares equal (its targets are dropped)."""

    example: Any


class MarkedSampler(DistributedSampler):
    """``DistributedSampler(drop_last=False)`` (same rows, same order) yielding ``(index, repeated)``.

    The sampler lays the pass (shuffled with ``seed + epoch``) out once, extends it by its first rows to a multiple
    of ``num_replicas`` and gives rank ``r`` positions ``r, r + num_replicas, ...``: the ``k``-th index of this rank
    is a repeat when its position ``rank + k * num_replicas`` lies past the pass.
    """

    def __init__(self, dataset: Dataset, **kwargs: Any) -> None:
        super().__init__(dataset, drop_last=False, **kwargs)

    def __iter__(self) -> Iterator[tuple[int, bool]]:  # type: ignore[override]
        rows = len(self.dataset)
        for k, index in enumerate(super().__iter__()):
            yield index, self.rank + k * self.num_replicas >= rows


class _MarkedRows(Dataset):
    """The dataset read with :class:`MarkedSampler`'s keys: a repeated row comes back wrapped in ``_Repeat``."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, bool]) -> Any:
        index, repeated = key
        example = self.dataset[index]
        return _Repeat(example) if repeated else example

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)


def without_targets(example: Any) -> Any:
    """``example`` with every label ignored (``-100``), or ``None`` for a kind of example this cannot do."""
    if isinstance(example, PackedRow):
        return PackedRow(tuple(dataclasses.replace(doc, labels=torch.full_like(doc.labels, -100))
                               for doc in example.documents))
    if isinstance(example, Mapping) and "input_ids" in example:
        return {**example, "labels": torch.full_like(torch.as_tensor(example["input_ids"]), -100)}
    return None


class PaddingWithoutTargets:
    """Collate function around ``collate_fn``: rows ``DistributedSampler`` repeated arrive without targets.

    The model still runs them (every DP group needs its micro-batch for the gradient all-reduce), but they add
    nothing to the loss, the gradient or the step's target count: the step is the token mean of the rows of the
    pass, what one process computes.
    """

    def __init__(self, collate_fn: Callable) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        examples = [without_targets(x.example) if isinstance(x, _Repeat) else x for x in items]
        if not all(isinstance(x, _Repeat) for x in items):
            return self.collate_fn(examples)
        with warnings.catch_warnings():  # a micro-batch of repeats only: no targets is what it should have
            warnings.filterwarnings("ignore", message="this batch has no targets", category=RuntimeWarning)
            return self.collate_fn(examples)


def _reads_example_labels(collate_fn: Callable) -> bool:
    """Whether ``collate_fn`` (through Trainer / ``functools.partial`` wrappers) takes the examples' ``labels``."""
    for _ in range(8):
        if isinstance(collate_fn, PackingCollator):
            return True
        inner = collate_fn.func if isinstance(collate_fn, functools.partial) else getattr(collate_fn, "data_collator",
                                                                                            None)
        if inner is None:
            return False
        collate_fn = inner
    return False


def check_padding_without_targets(dataset: Dataset, dp_size: int, collate_fn: Callable) -> None:
    """Raise :class:`~hf_blockdiag_cp.errors.Refusal` when the repeats of a pass cannot be given no targets."""
    rows = len(dataset)
    if rows and _reads_example_labels(collate_fn) and without_targets(dataset[0]) is not None:
        return
    raise Refusal(
        f"the map-style dataset's {rows} rows do not divide over dp_size={dp_size} data-parallel groups: each pass "
        f"repeats {dp_size - rows % dp_size} row(s) so that every group runs the same steps, and these repeats are "
        "kept out of the loss only with a hf_blockdiag_cp.PackingCollator and examples that are mappings with "
        "input_ids or PackedRow items; otherwise a row would be trained twice per pass. Use a PackingCollator, or set "
        "dataloader_drop_last=True (drop_last=True: each pass drops its last rows), or give the dataset a multiple "
        f"of {dp_size} rows, or an iterable dataset (hf_blockdiag_cp.PackedDataset: one stream, nothing repeated)")
