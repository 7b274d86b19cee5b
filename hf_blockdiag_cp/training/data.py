"""Data for (dp, cp) training: the ranks of a CP group read the same rows, DP groups different ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .mesh import cp_coordinates

__all__ = ["DataParallelShard", "dp_dataloader"]


class DataParallelShard(IterableDataset):
    """Every ``dp_size``-th item of an iterable dataset, starting at ``dp_rank`` (all CP ranks of a DP
    group get the same items in the same order)."""

    def __init__(self, dataset: IterableDataset, dp_rank: int, dp_size: int) -> None:
        super().__init__()
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.dataset, self.dp_rank, self.dp_size = dataset, dp_rank, dp_size

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataset, "set_epoch"):
            self.dataset.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        for i, item in enumerate(self.dataset):
            if i % self.dp_size == self.dp_rank:
                yield item


def dp_dataloader(dataset: Dataset | IterableDataset, mesh: DeviceMesh | None, *, collate_fn: Callable,
                  batch_size: int = 1, shuffle: bool = False, seed: int = 0, drop_last: bool = True,
                  num_workers: int = 0, **kwargs: Any) -> DataLoader:
    """A ``DataLoader`` sharded over the mesh's ``dp`` dimension only.

    Map-style datasets use a ``DistributedSampler(num_replicas=dp_size, rank=dp_rank)``; iterable
    ones (e.g. :class:`~hf_blockdiag_cp.PackedDataset`) are wrapped in :class:`DataParallelShard`.
    With ``drop_last`` every DP group runs the same number of steps (a group without data would
    leave the others hanging in the gradient all-reduce).
    """
    coords = cp_coordinates(mesh)
    if isinstance(dataset, IterableDataset):
        if shuffle:
            raise ValueError("shuffle=True needs a map-style dataset; give PackedDataset a seed instead")
        if coords.dp_size > 1:
            dataset = DataParallelShard(dataset, coords.dp_rank, coords.dp_size)
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate_fn, num_workers=num_workers,
                          drop_last=drop_last, **kwargs)
    sampler = DistributedSampler(dataset, num_replicas=coords.dp_size, rank=coords.dp_rank, shuffle=shuffle,
                                 seed=seed, drop_last=drop_last)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                      num_workers=num_workers, drop_last=drop_last, **kwargs)
