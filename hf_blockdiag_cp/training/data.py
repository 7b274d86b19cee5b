"""Data for (dp, cp) training: the ranks of a CP group read the same rows, DP groups different ones.

One stream, one count: an iterable dataset's rows are numbered once over the whole stream (across passes when
the passes run back to back, and across DataLoader workers), and row ``i`` goes to data-parallel group
``i % dp_size``; inside a group the group's ``k``-th row goes to worker ``k % num_workers``. The DataLoader
takes its workers' items in turn, so every process sees its rows in stream order whatever ``num_workers`` is,
and the rows of an optimizer step are the same with or without a mesh, with any number of workers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .mesh import cp_coordinates

__all__ = ["DataParallelShard", "dp_dataloader"]


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
    data would leave the others hanging in the gradient all-reduce).
    """
    coords = cp_coordinates(mesh)
    return shard_loader(dataset, coords.dp_rank, coords.dp_size, collate_fn=collate_fn, batch_size=batch_size,
                        shuffle=shuffle, seed=seed, drop_last=drop_last, num_workers=num_workers, endless=endless,
                        **kwargs)


def shard_loader(dataset: Dataset | IterableDataset, dp_rank: int, dp_size: int, *, collate_fn: Callable,
                 batch_size: int = 1, shuffle: bool = False, seed: int = 0, drop_last: bool = True,
                 num_workers: int = 0, endless: bool = False, **kwargs: Any) -> DataLoader:
    """:func:`dp_dataloader` for explicit data-parallel coordinates (``CPTrainer(mesh=None)``: every process)."""
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ValueError("shuffle=True needs a map-style dataset; give PackedDataset a seed instead")
        dataset = DataParallelShard(dataset, dp_rank, dp_size, endless=endless)
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                          drop_last=drop_last, **kwargs)
    sampler = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=shuffle, seed=seed,
                                 drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, drop_last=drop_last, **kwargs)
