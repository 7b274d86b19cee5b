"""The (dp, cp) device mesh: data parallelism over groups of context-parallel ranks.

Rule: consecutive global ranks form a CP group (rank = dp_index * cp_size + cp_index), so with
``torchrun``/``accelerate launch`` numbering a CP group stays inside a node whenever ``cp_size``
divides the GPUs per node — the K/V exchange then rides NVLink, and only the gradient reduction
crosses nodes.
"""

from __future__ import annotations

import datetime
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from .._validate import check_int
from ..config import ENV_VARS, BlockDiagCPConfig
from ..distributed.groups import group_options, group_timeout, record_cp_mesh
from ..distributed.ulysses import UlyssesGroups, create_ulysses_groups

__all__ = ["CPCoordinates", "check_group_timeouts", "cp_coordinates", "init_device_mesh", "ulysses_groups"]


def init_device_mesh(cp_size: int, *, device_type: str | None = None,
                     config: BlockDiagCPConfig | None = None) -> DeviceMesh:
    """A 2-D ``DeviceMesh`` with dims ``("dp", "cp")`` over the whole world.

    Args:
        cp_size: ranks per CP group; must divide the world size.
        device_type: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` when the default process group is
            NCCL, else ``"cpu"`` (gloo).
        config: whose :attr:`~hf_blockdiag_cp.BlockDiagCPConfig.process_group_timeout` bounds every
            process group (default ``BlockDiagCPConfig()``, i.e. ``HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S``).

    Use ``mesh["cp"]`` as the collator's ``group`` and ``mesh["dp"]`` to shard data (every rank of a
    CP group must see the same documents). If ``torch.distributed`` is not initialised yet but the
    launcher's environment is set (``WORLD_SIZE``), it is initialised here (NCCL with CUDA, else gloo)
    with the config's process-group timeout; an already initialised default group (``accelerate``,
    the ``Trainer``) whose timeout is longer raises ``ValueError`` (see :func:`check_group_timeouts`).
    The mesh's own ``dp``/``cp`` groups get that timeout too (torch would give them 30 minutes).
    """
    check_int("cp_size", cp_size, minimum=1)
    config = config or BlockDiagCPConfig()
    timeout = config.process_group_timeout
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError("init_device_mesh needs torch.distributed: launch with `accelerate launch` or "
                               "`torchrun`, or call torch.distributed.init_process_group first")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", timeout=timeout)
    check_group_timeouts(None, config)
    world = dist.get_world_size()
    if world % cp_size:
        raise ValueError(f"the world size {world} is not divisible by cp_size={cp_size}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    options = group_options("nccl" if device_type == "cuda" else "gloo", timeout)
    override = None if options is None else {"dp": options, "cp": options}
    mesh = torch_init_device_mesh(device_type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"),
                                  backend_override=override)
    check_group_timeouts(mesh, config)
    record_cp_mesh(cp_size)
    return mesh


def check_group_timeouts(mesh: DeviceMesh | None, config: BlockDiagCPConfig | None = None) -> None:
    """Raise ``ValueError`` if the default process group (and the mesh's ``dp``/``cp`` groups) would wait
    longer than ``config.process_group_timeout`` for a stalled peer.

    Every collective outside this package (DDP's buffer broadcast and gradient all-reduce, FSDP, the
    ``dp`` reduction of the loss count) waits for its group's timeout, torch's default being 30 minutes;
    bounding the groups by the package's setting ends every rank within it when one rank stalls.
    """
    config = config or BlockDiagCPConfig()
    bound = config.process_group_timeout
    groups = [("the default process group", dist.group.WORLD)]
    if mesh is not None:
        groups += [(f"the mesh's {name!r} group", mesh[name].get_group()) for name in ("dp", "cp")]
    for what, group in groups:
        timeout = group_timeout(group)
        if timeout is not None and timeout > bound:
            raise ValueError(
                f"{what} has a timeout of {_seconds(timeout)} s, longer than the {_seconds(bound)} s that "
                f"collective_timeout_s={config.collective_timeout_s:g} allows (plus margin): a stalled rank would "
                f"block its peers in DDP/FSDP collectives for {_seconds(timeout)} s. Create the process group with "
                f"timeout=BlockDiagCPConfig().process_group_timeout (accelerate: Accelerator(kwargs_handlers="
                f"[InitProcessGroupKwargs(timeout=...)]); Trainer: TrainingArguments(ddp_timeout="
                f"{int(bound.total_seconds())}), which transformers ignores with use_cpu=True; torch: "
                f"init_process_group(timeout=...)), or let hf_blockdiag_cp.init_device_mesh create it before "
                f"anything else does, or raise {ENV_VARS['collective_timeout_s']} to at "
                f"least {_seconds(timeout)}")


def _seconds(delta: datetime.timedelta) -> str:
    return f"{delta.total_seconds():g}"


class CPCoordinates(NamedTuple):
    """Where this process sits in a ``("dp", "cp")`` mesh."""

    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_size: int


def cp_coordinates(mesh: DeviceMesh | None) -> CPCoordinates:
    """``(dp_rank, dp_size, cp_rank, cp_size)`` of this process (``(0, 1, 0, 1)`` without a mesh)."""
    if mesh is None:
        return CPCoordinates(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    if mesh.mesh_dim_names != ("dp", "cp"):
        raise ValueError(f"expected a ('dp', 'cp') mesh from hf_blockdiag_cp.init_device_mesh, got "
                         f"{mesh.mesh_dim_names}")
    return CPCoordinates(dp_rank=mesh.get_local_rank("dp"), dp_size=mesh.size(0),
                         cp_rank=mesh.get_local_rank("cp"), cp_size=mesh.size(1))


def ulysses_groups(mesh: DeviceMesh | None = None, sizes: int | str | tuple[int, ...] | None = None, *,
                   config: BlockDiagCPConfig | None = None) -> UlyssesGroups:
    """Create, at setup, the head-parallel subgroups a :class:`~hf_blockdiag_cp.PackingCollator` with
    ``ulysses_size`` needs (pass the result as its ``ulysses_groups``).

    Args:
        mesh: the ``("dp", "cp")`` mesh of :func:`init_device_mesh`; ``None``: the whole world is one
            CP group.
        sizes: the ``ulysses_size`` values steps may use: an int, ``"auto"`` (every divisor of the CP
            size above 1: what ``auto`` may pick) or a tuple; default ``config.ulysses_size``.
        config: whose ``process_group_timeout`` bounds the new groups (default ``BlockDiagCPConfig()``).

    Collective over the default process group (``new_group``): every process calls it, once, with the
    same arguments, never per step.
    """
    config = config or BlockDiagCPConfig()
    if not dist.is_initialized():
        raise RuntimeError("ulysses_groups needs an initialised torch.distributed (call init_device_mesh first)")
    if mesh is None:
        cp_groups = [list(range(dist.get_world_size()))]
    else:
        if mesh.mesh_dim_names != ("dp", "cp"):
            raise ValueError(f"expected a ('dp', 'cp') mesh from hf_blockdiag_cp.init_device_mesh, got "
                             f"{mesh.mesh_dim_names}")
        cp_groups = mesh.mesh.reshape(-1, mesh.size(1)).tolist()
    cp_size = len(cp_groups[0])
    sizes = config.ulysses_size if sizes is None else sizes
    if sizes == "auto":
        sizes = tuple(u for u in range(2, cp_size + 1) if cp_size % u == 0)
    elif isinstance(sizes, int):
        sizes = (sizes,)
    for u in sizes:
        check_int("sizes", u, minimum=1)
        if cp_size % u:
            raise ValueError(f"sizes: ulysses_size={u} does not divide the CP group size {cp_size}")
    return create_ulysses_groups(cp_groups, sizes, timeout_s=config.process_group_timeout.total_seconds())
