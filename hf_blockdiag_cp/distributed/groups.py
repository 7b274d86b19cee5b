"""Process groups that survive pickling (DataLoader workers return batches holding a context).

A ``ProcessGroup`` cannot be pickled; its name can, and the receiving process (the main training
process, which created the group) resolves the name back to the same group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["GroupRef", "group_to_ref", "ref_to_group"]


@dataclass(frozen=True)
class GroupRef:
    """A picklable stand-in for a process group: its registered name."""

    name: str


def group_to_ref(group: Any) -> Any:
    """``group`` itself if picklable (``None``), else a :class:`GroupRef`."""
    if group is None or isinstance(group, GroupRef):
        return group
    name = getattr(group, "group_name", None)
    if name is None:
        raise TypeError(f"cannot pickle the process group {group!r}: it has no group_name")
    return GroupRef(name)


def ref_to_group(ref: Any) -> Any:
    """The live group a :class:`GroupRef` names (``ref`` unchanged if it cannot be resolved here,
    e.g. inside a DataLoader worker, so that the next hop can resolve it)."""
    if not isinstance(ref, GroupRef) or not dist.is_initialized():
        return ref
    try:
        return _resolve_process_group(ref.name)
    except (KeyError, RuntimeError, ValueError):
        return ref
