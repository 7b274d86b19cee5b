"""Issue 5 acceptance 1: one optimizer step on a (dp, cp) mesh with DDP and with FSDP2 gives the
parameters of a single process training on the same global batch, each document run alone."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

SEQ_LEN = 48
# Documents of each DP group's row (lengths; token values are drawn from a fixed seed).
DP_ROWS = [[9, 14, 1, 20], [30, 5, 11]]


def _documents():
    import torch

    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(1, 97, (n,), generator=gen) for n in row] for row in DP_ROWS]


def _reference_step(dp_size: int):
    """Parameters after one SGD step of one process on the global batch, documents run alone."""
    from tests.reference import per_document_sgd_step

    return per_document_sgd_step([d for row in _documents()[:dp_size] for d in row])


def _parallel_worker(rank: int, world: int, cp_size: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(cp_size)
    coords = bd.cp_coordinates(mesh)
    ref_before, ref_after, ref_loss = _reference_step(coords.dp_size)
    collator = bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)
    bd.check_collator(collator, mesh)
    docs = _documents()[coords.dp_rank]
    batch = collator([{"input_ids": d} for d in docs])
    batch = bd.normalize_num_items(batch, mesh)
    results = {}
    for wrapper in ("ddp", "fsdp2"):
        model = bd.guard_model(tiny_model("llama", attn_implementation="blockdiag_cp"))
        model.train()
        if wrapper == "ddp":
            wrapped = DistributedDataParallel(model)
        else:
            flat = torch_mesh("cpu", (world,))
            for layer in model.model.layers:
                fully_shard(layer, mesh=flat)
            wrapped = fully_shard(model, mesh=flat)
        opt = torch.optim.SGD(wrapped.parameters(), lr=1.0)
        out = wrapped(**batch)
        out.loss.backward()
        opt.step()
        logged = bd.reduce_loss_for_logging(out.loss, mesh).item()
        after = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
                 for n, p in model.named_parameters()}
        for name, value in after.items():
            torch.testing.assert_close(value, ref_after[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{wrapper} {n}: {m}")
            # The update itself (lr = 1: the gradient), which the parameters' size would hide.
            torch.testing.assert_close(ref_before[name] - value, ref_before[name] - ref_after[name], rtol=1e-4,
                                       atol=1e-7, msg=lambda m, n=name: f"{wrapper} update {n}: {m}")
        assert abs(logged - ref_loss) <= 1e-5 * abs(ref_loss), (wrapper, logged, ref_loss)
        results[wrapper] = logged
    dist.barrier()
    return results


@pytest.mark.parametrize("world,cp_size", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow),
                                           pytest.param(4, 4, marks=pytest.mark.slow)])
def test_one_step_matches_single_process_with_ddp_and_fsdp2(world, cp_size):
    results = run_ranks(_parallel_worker, world, cp_size, timeout=300)
    assert all(r == results[0] for r in results)  # every rank logs the same global mean
