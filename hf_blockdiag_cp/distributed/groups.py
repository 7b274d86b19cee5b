"""Process groups: references that survive pickling, and their timeouts.

A ``ProcessGroup`` cannot be pickled; its name can, and the receiving process (the main training
process, which created the group) resolves the name back to the same group (DataLoader workers
return batches holding a context).

A group's timeout bounds how long its collectives wait for a stalled peer (DDP's gradient all-reduce
included); torch 2.13 exposes it only through private names, read and written in :mod:`hf_blockdiag_cp.compat`.
"""

from __future__ import annotations

import datetime
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..compat import backend_options, backend_timeouts, resolve_process_group

__all__ = ["GroupRef", "group_options", "group_timeout", "group_to_ref", "ref_to_group"]


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
        return resolve_process_group(ref.name)
    except (KeyError, RuntimeError, ValueError):
        return ref


def group_timeout(group: Any = None) -> datetime.timedelta | None:
    """The longest timeout of ``group``'s backends (default group when ``None``), or ``None`` when
    torch does not expose it for this backend."""
    found = backend_timeouts(dist.group.WORLD if group is None else group)
    return max(found) if found else None


def group_options(backend: str, timeout: datetime.timedelta) -> Any:
    """Options for a new ``backend`` group (``"gloo"``/``"nccl"``) whose collectives time out after
    ``timeout``; ``None`` for other backends (their groups get torch's default timeout)."""
    return backend_options(backend, timeout)


#: The largest ``cp_size`` of the meshes built on this process, per default process group. Its one writer is
#: :func:`record_cp_mesh` (called by :func:`~hf_blockdiag_cp.init_device_mesh`), its one reader
#: :func:`created_cp_size`; an entry goes with its process group.
_CP_SIZE_BY_WORLD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def record_cp_mesh(cp_size: int) -> None:
    """Remember that a mesh with ``cp_size`` CP ranks was built on this process's default group."""
    world_group = dist.group.WORLD
    _CP_SIZE_BY_WORLD[world_group] = max(cp_size, _CP_SIZE_BY_WORLD.get(world_group, 1))


def created_cp_size() -> int:
    """The largest ``cp_size`` of a mesh built on this process's current default process group (1 when none,
    or when torch.distributed is not initialised)."""
    if not dist.is_initialized():
        return 1
    return _CP_SIZE_BY_WORLD.get(dist.group.WORLD, 1)
