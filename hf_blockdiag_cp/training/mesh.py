"""The (dp, cp) device mesh: data parallelism over groups of context-parallel ranks.

Rule: consecutive global ranks form a CP group (rank = dp_index * cp_size + cp_index), so with
``torchrun``/``accelerate launch`` numbering a CP group stays inside a node whenever ``cp_size``
divides the GPUs per node — the K/V exchange then rides NVLink, and only the gradient reduction
crosses nodes.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh

from .._validate import check_int

__all__ = ["cp_coordinates", "init_device_mesh"]


def init_device_mesh(cp_size: int, *, device_type: str | None = None) -> DeviceMesh:
    """A 2-D ``DeviceMesh`` with dims ``("dp", "cp")`` over the whole world.

    Args:
        cp_size: ranks per CP group; must divide the world size.
        device_type: ``"cuda"`` or ``"cpu"``; default ``"cuda"`` when the default process group is
            NCCL, else ``"cpu"`` (gloo).

    Use ``mesh["cp"]`` as the collator's ``group`` and ``mesh["dp"]`` to shard data (every rank of a
    CP group must see the same documents). If ``torch.distributed`` is not initialised yet but the
    launcher's environment is set (``WORLD_SIZE``), it is initialised here (NCCL with CUDA, else gloo).
    """
    check_int("cp_size", cp_size, minimum=1)
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            raise RuntimeError("init_device_mesh needs torch.distributed: launch with `accelerate launch` or "
                               "`torchrun`, or call torch.distributed.init_process_group first")
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size()
    if world % cp_size:
        raise ValueError(f"the world size {world} is not divisible by cp_size={cp_size}")
    if device_type is None:
        device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"

    return torch_init_device_mesh(device_type, (world // cp_size, cp_size), mesh_dim_names=("dp", "cp"))


def cp_coordinates(mesh: DeviceMesh | None) -> dict[str, int]:
    """``dp_rank, dp_size, cp_rank, cp_size`` of this process (all 0/1 without a mesh)."""
    if mesh is None:
        return {"dp_rank": 0, "dp_size": 1, "cp_rank": 0, "cp_size": 1}
    if mesh.mesh_dim_names != ("dp", "cp"):
        raise ValueError(f"expected a ('dp', 'cp') mesh from hf_blockdiag_cp.init_device_mesh, got {mesh.mesh_dim_names}")
    return {"dp_rank": mesh.get_local_rank("dp"), "dp_size": mesh.size(0),
            "cp_rank": mesh.get_local_rank("cp"), "cp_size": mesh.size(1)}
