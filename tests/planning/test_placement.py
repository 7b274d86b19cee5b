"""Placements and the plans that serve them: every placement is a permutation with exactly L positions
per rank, every rank's plan validates, and the exchange moves exactly the brute-force need (each
needed remote row once, nothing else), with and without a sliding window."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
from hf_blockdiag_cp.planning.exchange import plan_exchange
from hf_blockdiag_cp.planning.placement import make_placement, rank_work
from tests.benchmark_module import load_benchmark


def brute_need(row: list[int], positions: list[int], window: int | None) -> set[int]:
    """Every key position some real query in ``positions`` attends (plain loops)."""
    need = set()
    for p in positions:
        if row[p] == 0:
            continue
        q = p
        while q >= 0 and row[q] == row[p] and (window is None or q > p - window):
            need.add(q)
            q -= 1
    return need


def row_of(lengths: list[int], pad: int) -> list[int]:
    row = [doc + 1 for doc, n in enumerate(lengths) for _ in range(n)]
    return row + [0] * pad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cp_size=st.integers(1, 8), kind=st.sampled_from(["contiguous", "zigzag", "balanced", "mirror"]),
       window=st.sampled_from([None, 1, 3, 8]), strategy=st.sampled_from(["auto", "a2a", "allgather"]))
def test_every_placement_is_served_exactly(data, cp_size, kind, window, strategy):
    per_rank = data.draw(st.integers(1, 12), label="per_rank") * (2 if kind == "zigzag" else 1)
    full_len = cp_size * per_rank
    lengths = data.draw(st.lists(st.integers(1, full_len), min_size=0, max_size=12), label="lengths")
    row = row_of(lengths, 0)[:full_len]
    row += [0] * (full_len - len(row))
    ids = torch.tensor(row)
    placement = make_placement(ids, cp_size, kind)
    held = placement.index
    assert held.shape == (cp_size, per_rank) and held.dtype == torch.int64
    assert bool((held[:, 1:] > held[:, :-1]).all())  # every rank's positions ascend
    assert torch.equal(torch.sort(held.flatten()).values, torch.arange(full_len))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_exchange(ids, cp_size=cp_size, config=BlockDiagCPConfig(kv_exchange=strategy),
                             placement=placement, window=window)
    owner, _ = placement.owner()
    for rank in range(cp_size):
        positions = held[rank].tolist()
        remote = {q for q in brute_need(row, positions, window) if int(owner[q]) != rank}
        transfer = plan.for_rank(rank)
        assert transfer.need == len(remote) == plan.remote_rows(rank)
        received = transfer.buffer_positions[:transfer.recv_rows].tolist()
        if plan.strategy in ("a2a", "halo", "none"):
            assert sorted(received) == sorted(remote), f"rank {rank}: receives exactly its need"
            assert len(received) == len(set(received)), "each needed row once"
        else:
            assert plan.strategy == "allgather" and remote <= set(transfer.buffer_positions.tolist())
        # What every rank sends to this one is exactly what it receives from them.
        for src in range(cp_size) if plan.strategy in ("a2a", "halo") else ():
            sent = plan.for_rank(src)
            offset = sum(sent.send_splits[:rank])
            rows = sent.send_index[offset:offset + sent.send_splits[rank]]
            assert sent.send_splits[rank] == transfer.recv_splits[src]
            assert torch.equal(held[src][rows], torch.tensor(
                [p for p in received if int(owner[p]) == src], dtype=torch.int64))
        # The rank's context plans validate (built through the same placement and window).
        ctx = BlockDiagCPContext.build(ids, cp_rank=rank, cp_size=cp_size, placement=placement,
                                       sliding_windows=(window,), config=BlockDiagCPConfig(kv_exchange=strategy))
        ctx.plan.validate()
        for varlen, _ in ctx.window_plans.values():
            varlen.validate()


def _bench():
    return load_benchmark("bench_balance")


@pytest.mark.parametrize("rows,imbalance,remote", [
    # Fixed seeds of the benchmark (P = 8, S = 16384): a regression in balance or traffic fails CI.
    ("lognormal_8", 1.10, 0.40),
    ("lognormal_32", 1.06, 0.15),
    ("heavy_tail", 1.10, 0.45),
])
def test_balanced_placement_keeps_its_benchmark_numbers(rows, imbalance, remote):
    bench = _bench()
    got = bench.summarize(rows, 8, "balanced", range(10), 16384)
    base = bench.summarize(rows, 8, "contiguous", range(10), 16384)
    assert got["imbalance_mean"] <= imbalance, got
    assert got["remote_mean"] <= remote, got
    assert base["imbalance_mean"] > 1.5, "contiguous placement is the unbalanced baseline"


def test_one_document_filling_the_row_is_balanced():
    ids = torch.ones(16384, dtype=torch.int64)
    for cp_size in (2, 4, 8):
        work = rank_work(ids, make_placement(ids, cp_size, "balanced"))
        assert float(work.max() / work.mean()) <= 1.02


def test_zigzag_needs_a_row_divisible_by_2p_and_bad_kinds_are_named():
    from hf_blockdiag_cp import PackingCollator
    from hf_blockdiag_cp.planning import PlanError

    with pytest.raises(PlanError, match="divisible by 2 \\* cp_size"):
        make_placement(torch.ones(12, dtype=torch.int64), 4, "zigzag")
    with pytest.raises(ValueError, match="placement='spiral'"):
        make_placement(torch.ones(12, dtype=torch.int64), 4, "spiral")
    with pytest.raises(ValueError, match="placement='spiral'"):
        PackingCollator(16, cp_size=2, cp_rank=0, pad_token_id=0, placement="spiral")
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_PLACEMENT"):
        BlockDiagCPConfig(placement="spiral")
