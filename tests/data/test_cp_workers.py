"""Under CP the collator may run in DataLoader worker processes: the batch (and its context) comes
back pickled, the CP group by name, and resolves to the live group in the training process."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int) -> list:
    import pickle
    from unittest import mock

    import torch
    from torch.utils.data import DataLoader

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.distributed.groups import GroupRef
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(world)
    group = mesh["cp"].get_group()
    collator = bd.PackingCollator(32, group=mesh["cp"], pad_token_id=0)
    docs = [{"input_ids": list(range(1 + i, 9 + 3 * i))} for i in range(6)]
    rows = bd.PackedDataset(docs, 32)
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    seen = []
    for context, workers in (("fork", 2), ("spawn", 1)):  # spawned workers start slowly: one is enough
        loader = DataLoader(rows, batch_size=1, collate_fn=collator, num_workers=workers,
                            multiprocessing_context=context)
        for batch in loader:
            ctx = batch["cp_context"]
            assert ctx.group is group, f"{context}: the group did not resolve ({ctx.group!r})"
            logits = model(**batch).logits[0]
            # The same row on one process (CP = 1), rebuilt from every rank's shard.
            full = {}
            where = [torch.empty_like(ctx.local_index) for _ in range(world)]
            torch.distributed.all_gather(where, ctx.local_index)  # each rank's global positions
            for key in ("input_ids", "position_ids"):
                parts = [torch.empty_like(batch[key]) for _ in range(world)]
                torch.distributed.all_gather(parts, batch[key])
                full[key] = torch.empty(1, ctx.full_len, dtype=batch[key].dtype)
                full[key][0, torch.cat(where)] = torch.cat(parts, dim=1)[0]
            one = bd.BlockDiagCPContext.build(ctx.doc_ids)
            ref = model(**full, cp_context=one, use_cache=False).logits[0, ctx.local_index]
            real = ctx.doc_ids[0, ctx.local_index] != 0
            torch.testing.assert_close(logits[real], ref[real], atol=1e-5, rtol=0)
            seen.append(context)
    # A context unpickled in a process without the group (a DataLoader worker) keeps the group's
    # name, and resolves it once it reaches the process that has the group.
    blob = pickle.dumps(batch["cp_context"])
    with mock.patch.object(torch.distributed, "is_initialized", return_value=False):
        detached = pickle.loads(blob)
    assert isinstance(detached.group, GroupRef) and detached.group.name == group.group_name, detached.group
    assert pickle.loads(pickle.dumps(detached)).group is group
    return seen


@pytest.mark.slow
def test_collating_in_worker_processes_under_cp():
    for seen in run_ranks(_worker, 2, timeout=240):
        assert "fork" in seen and "spawn" in seen
