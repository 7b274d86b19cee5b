"""The backward of the all-gather of fixed-shape buffers (recurrent state summaries, K/V rows) on gloo goes as direct
sends to every peer, not gloo's reduce-scatter (2-3x less CPU per call on CPU ranks, see ``exchange._direct``). On
real gloo ranks, over the whole world and over CP subgroups whose group ranks are not their global ranks (a (dp, cp)
mesh): the output is every rank's rows in rank order, the backward gives each rank the sum of every rank's gradient
of its rows, a deferred gather gives the same, and the collective path (what NCCL runs) gives the same numbers; the
bytes counted are the collective's."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

ROWS, WIDTH = 3, 5


def _buffer(rank: int):
    import torch
    return torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(100 + rank), dtype=torch.float64)


def _weights(rank: int, size: int):
    import torch
    return torch.randn(size * ROWS, WIDTH, generator=torch.Generator().manual_seed(200 + rank), dtype=torch.float64)


def _worker(rank: int, world: int) -> dict:
    import datetime

    import torch
    import torch.distributed as dist

    from hf_blockdiag_cp.distributed import exchange
    from hf_blockdiag_cp.distributed.exchange import CommStats, Deferred, GatherGroup, all_gather

    subgroups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank makes every group, in one order
    report = {}
    for name, group, members in (("world", dist.group.WORLD, list(range(world))),
                                 ("subgroup", subgroups[rank % 2], [rank % 2, rank % 2 + 2])):
        size, me = len(members), members.index(rank)
        results = {}
        for path in ("direct", "collective"):
            on = GatherGroup(size, me, group, datetime.timedelta(seconds=60), CommStats(),
                             tuple(dist.get_global_rank(group, r) for r in range(size)))
            forced = exchange._direct
            exchange._direct = (lambda ex: True) if path == "direct" else (lambda ex: False)
            try:
                for deferred in (None, Deferred()):
                    buf = _buffer(rank).requires_grad_()
                    out = all_gather(buf, on, "test all-gather", deferred)
                    if deferred is not None:
                        deferred.wait()
                    (out * _weights(rank, size)).sum().backward()
                    results[path, deferred is not None] = (out.detach(), buf.grad)
            finally:
                exchange._direct = forced
            report[name, path, "bytes"] = (on.stats.sent_bytes, on.stats.received_bytes)
        expected_out = torch.cat([_buffer(g) for g in members])
        expected_grad = sum(_weights(g, size)[me * ROWS:(me + 1) * ROWS] for g in members)
        for key, (out, grad) in results.items():
            report[(name, *key)] = (torch.equal(out, expected_out), (grad - expected_grad).abs().max().item())
        report[name, "direct on gloo"] = exchange._direct(on)
    return report


@pytest.mark.timeout(300)
def test_the_direct_gather_equals_the_collective_over_the_world_and_subgroups() -> None:
    reports = run_ranks(_worker, 4, timeout=240)
    for rank, report in enumerate(reports):
        for name in ("world", "subgroup"):
            assert report[name, "direct on gloo"], (rank, name)
            size = 4 if name == "world" else 2
            moved = 4 * (size - 1) * ROWS * WIDTH * 8  # two gathers per path, each forward and backward
            assert report[name, "direct", "bytes"] == report[name, "collective", "bytes"] == (moved, moved)
            for path in ("direct", "collective"):
                for deferred in (False, True):
                    same, err = report[name, path, deferred]
                    assert same and err < 1e-12, (rank, name, path, deferred, err)
