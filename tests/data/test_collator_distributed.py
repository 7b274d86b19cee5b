"""cp_rank / cp_size default from a real process group or 1-D DeviceMesh (2 gloo processes)."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]


def _check_group_resolution(rank: int, world_size: int) -> str:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hf_blockdiag_cp import PackingCollator, from_flattened

    examples = [{"input_ids": list(range(1, 6))}, {"input_ids": list(range(10, 13))}]
    explicit = PackingCollator(8, cp_size=world_size, cp_rank=rank, pad_token_id=0)(examples)
    by_group = PackingCollator(8, group=dist.group.WORLD, pad_token_id=0)
    assert (by_group.cp_rank, by_group.cp_size) == (rank, world_size)
    batch = by_group(examples)
    assert batch["cp_context"].group is dist.group.WORLD and batch["cp_context"].cp_rank == rank
    for key in ("input_ids", "position_ids", "labels", "shift_labels"):
        assert torch.equal(batch[key], explicit[key]), key

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    by_mesh = PackingCollator(8, group=mesh, pad_token_id=0)
    assert (by_mesh.cp_rank, by_mesh.cp_size) == (rank, world_size)
    assert by_mesh(examples)["cp_context"].group is mesh.get_group()
    flat = from_flattened({"input_ids": [[1, 2, 3, 4]], "position_ids": [[0, 1, 0, 1]]}, group=mesh)
    assert flat["cp_context"].cp_rank == rank and flat["input_ids"].shape == (1, 2)

    for kwargs, match in ((dict(cp_size=3), "cp_size=3 disagrees"), (dict(cp_rank=1 - rank), "disagrees")):
        try:
            PackingCollator(8, group=dist.group.WORLD, pad_token_id=0, **kwargs)
        except ValueError as err:
            assert match in str(err), err
        else:
            raise AssertionError(f"{kwargs} should raise")
    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    try:
        PackingCollator(8, group=mesh_2d, pad_token_id=0)
    except ValueError as err:
        assert "must be 1-D" in str(err)
    else:
        raise AssertionError("a 2-D mesh should raise")
    return "ok"


def test_cp_rank_and_size_from_group_and_mesh():
    assert run_ranks(_check_group_resolution, 2, timeout=150) == ["ok", "ok"]
