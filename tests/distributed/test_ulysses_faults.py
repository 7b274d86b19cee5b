"""Issue 18 (primitive, faults): a peer that stalls before the head all-to-all, or dies, makes the
waiting rank raise ``CollectiveError`` within the collective timeout (+ 10 s), not hang."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4.0


def _worker(rank: int, world: int) -> dict:
    import os
    import time

    import torch

    from hf_blockdiag_cp.distributed.exchange import CollectiveError
    from hf_blockdiag_cp.distributed.ulysses import HeadA2A, heads_to_tokens, new_subgroups
    from hf_blockdiag_cp.planning.layout import HeadSplit

    # Both groups exist before anything fails (group creation is collective over every process).
    # Their own timeout (connecting included) is longer, as BlockDiagCPConfig.process_group_timeout is.
    stalled_group, _ = new_subgroups([list(range(world))], world, timeout_s=60)
    dead_group, _ = new_subgroups([list(range(world))], world, timeout_s=60)
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    elapsed = {}
    for name, group in (("stalled", stalled_group), ("died", dead_group)):
        if rank == 1:
            if name == "stalled":
                time.sleep(TIMEOUT_S + 4)  # never enters this all-to-all
                continue
            os._exit(3)  # dies without a word before the all-to-all
        ex = HeadA2A.build(HeadSplit(world, 4, 2), rank, group, timeout_s=TIMEOUT_S)
        start = time.monotonic()
        try:
            heads_to_tokens(q, kv, kv, ex)
        except CollectiveError as err:
            elapsed[name] = (time.monotonic() - start, str(err))
        else:
            elapsed[name] = (None, "no error")
    return elapsed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stalled_or_dead_peer_fails_the_head_all_to_all_in_bounded_time():
    outcome = run_ranks(_worker, 2, timeout=180, expect_failure=True)
    status, result = outcome[0]
    assert status == "ok", result
    for name in ("stalled", "died"):
        seconds, message = result[name]
        assert seconds is not None, f"{name}: the all-to-all returned although the peer never entered it"
        assert seconds < TIMEOUT_S + 10, f"{name}: {seconds:.1f} s"
        assert "Ulysses q/k/v all-to-all" in message and "CP rank 0" in message, message
    assert outcome[1][0] == "error"  # rank 1 exited on purpose
