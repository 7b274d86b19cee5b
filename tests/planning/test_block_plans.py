"""Planning with bidirectional blocks: the exchange plan's need equals the brute-force need of every rank's queries
(``[lo(t), hi(t)]`` from the dense staircase's bounds), for every placement and window; every varlen segment's keys
are exactly what its queries see."""

from __future__ import annotations

import pytest

from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
from hf_blockdiag_cp.planning.exchange import needed_positions
from tests.attention.blocks_reference import key_bounds, random_row


def _brute_need(doc, blk, positions, window):
    lo, hi = key_bounds(doc, blk, window)
    need = set()
    for t in positions.tolist():
        if doc[t] != 0:
            need.update(range(int(lo[t]), int(hi[t]) + 1))
    return need


@pytest.mark.parametrize("placement", ["contiguous", "zigzag", "balanced"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seed", range(3))
def test_exchange_need_covers_block_queries_later_keys(placement, window, seed):
    world, local_len = 4, 12
    doc, blk = random_row(world * local_len, seed, padding=2)
    config = BlockDiagCPConfig(placement=placement, kv_exchange="a2a")
    for rank in range(world):
        ctx = BlockDiagCPContext.build(doc, cp_rank=rank, cp_size=world, config=config, block_ids=blk,
                                       sliding_windows=[window])
        plan, exchange = ctx.plans_for(window)
        own = set(ctx.local_index.tolist())
        need = _brute_need(doc, blk, ctx.local_index, window)
        assert exchange.remote_rows(rank) == len(need - own)
        assert set(needed_positions(doc, ctx.local_index, window, blk).tolist()) == need
        buffer = exchange.for_rank(rank).buffer_positions
        assert need <= set(buffer.tolist())
        # Every segment: its queries' keys, exactly (bottom-right causal for causal segments).
        lo, hi = key_bounds(doc, blk, window)
        for s in plan.segments:
            queries = ctx.local_index[s.q_start:s.q_start + s.q_len]
            if not s.causal:
                assert len({int(lo[t]) for t in queries}) == 1 and len({int(hi[t]) for t in queries}) == 1
                assert s.k_len == int(hi[queries[0]]) - int(lo[queries[0]]) + 1
            else:
                assert all(int(hi[t]) == int(t) for t in queries)
