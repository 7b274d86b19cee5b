"""Issue 25: the run-based planners give the token-based plans bit for bit, on random rows.

The references (``reference_plans.py``) expand every rank's queries and keys token by token; the package plans on
runs (pieces of documents). Compared: every rank's splits, send rows, buffer positions and need, the strategy and
halo validity, the balanced placement, the varlen plans a context builds from them, the shard checksums, and the
between-group exchanges of head-parallel layouts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp import BlockDiagCPConfig, BlockDiagCPContext
from hf_blockdiag_cp.planning.exchange import Strategy, plan_exchange
from hf_blockdiag_cp.planning.fingerprint import checksum_weights, shard_checksum
from hf_blockdiag_cp.planning.layout import HeadShape, plan_layout
from hf_blockdiag_cp.planning.placement import Placement, make_placement

from .reference_plans import (
    reference_balanced_placement,
    reference_exchange,
    reference_shard_checksum,
    reference_transfer,
)

PLACEMENT_KINDS = ("contiguous", "zigzag", "balanced", "mirror")


@st.composite
def rows(draw):
    """``(doc_ids [S], cp_size)``: random document lengths, padding runs anywhere (id 0), S divisible by 2P."""
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    full_len = 2 * cp_size * draw(st.integers(1, 12))
    lengths = draw(st.lists(st.integers(1, full_len), min_size=0, max_size=12))
    pads = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    ids, doc = [], 1
    for n, pad in zip(lengths, pads):
        ids += [0 if pad else doc] * n
        doc += 1
    ids = (ids + [0] * full_len)[:full_len]
    return torch.tensor(ids, dtype=torch.int64), cp_size


def _check_exchange(row, placement, window, kv_exchange):
    config = BlockDiagCPConfig(kv_exchange=kv_exchange)
    plan = plan_exchange(row, cp_size=placement.cp_size, config=config, placement=placement, window=window)
    recv, counts, halo_valid = reference_exchange(row, placement, window)
    assert plan.halo_valid == halo_valid
    moved = any(any(c) for c in counts)
    if kv_exchange == "auto":
        assert plan.strategy == (Strategy.NONE if not moved else Strategy.HALO if halo_valid else Strategy.A2A)
    for rank in range(placement.cp_size):
        transfer = plan.for_rank(rank)
        assert transfer.need == sum(counts[rank])
        if plan.strategy in (Strategy.HALO, Strategy.A2A):
            send_index, buffer = reference_transfer(recv, placement, rank)
            assert transfer.recv_splits == tuple(counts[rank])
            assert transfer.send_splits == tuple(counts[d][rank] for d in range(placement.cp_size))
            assert transfer.recv_rows == sum(counts[rank])
            assert torch.equal(transfer.send_index, send_index)
            assert torch.equal(transfer.buffer_positions, buffer)
        elif plan.strategy == Strategy.ALLGATHER:
            assert torch.equal(transfer.buffer_positions, placement.index.flatten())
            assert transfer.send_index.numel() == 0
        else:
            assert torch.equal(transfer.buffer_positions, placement.index[rank])
            assert transfer.send_index.numel() == 0
    return plan


@pytest.mark.filterwarnings("ignore:kv_exchange='halo' cannot serve")
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from(PLACEMENT_KINDS), st.sampled_from([None, 1, 2, 3, 7, 100]),
       st.sampled_from(["auto", "a2a", "allgather", "halo"]))
def test_run_exchange_equals_the_token_reference(case, kind, window, kv_exchange):
    row, cp_size = case
    placement = make_placement(row, cp_size, kind, windows=(window,))
    _check_exchange(row, placement, window, kv_exchange)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from([(None,), (4,), (None, 3), (2, 5, None)]), st.sampled_from([0.0, 0.05, 0.5]))
def test_balanced_placement_equals_the_reference(case, windows, tolerance):
    row, cp_size = case
    fast = make_placement(row, cp_size, "balanced", tolerance=tolerance, windows=windows)
    if cp_size > 1:
        slow = reference_balanced_placement(row, cp_size, tolerance=tolerance, windows=windows)
        assert torch.equal(fast.index, slow.index)
        # The runs the balanced placement sets from its pieces = those computed from its index.
        fresh = Placement(fast.kind, fast.index).runs
        for name in ("start", "length", "rank", "local_start"):
            got, want = getattr(fast.runs, name), getattr(fresh, name)
            assert got.dtype == want.dtype and np.array_equal(got, want), name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from(PLACEMENT_KINDS), st.sampled_from([(), (3,), (None, 5)]), st.data())
def test_context_plans_equal_those_built_on_the_reference_exchange(case, kind, windows, data):
    row, cp_size = case
    if cp_size == 1:
        return
    rank = data.draw(st.integers(0, cp_size - 1))
    ids = torch.randint(0, 1000, (1, row.numel()), generator=torch.Generator().manual_seed(int(row.sum())))
    positions = torch.arange(row.numel())[None]
    ctx = BlockDiagCPContext.build(row, cp_rank=rank, cp_size=cp_size, placement=kind, sliding_windows=windows,
                                   input_ids=ids, position_ids=positions)
    index = ctx.placement.index[rank]
    assert ctx.shard_checksum == (int(shard_checksum(ids[:, index])), int(shard_checksum(positions[:, index])))
    for window in (None, *[w for w in windows if w is not None]):
        plan, exchange = ctx.plans_for(window)
        _, counts, _ = reference_exchange(row, ctx.placement, window)
        assert [t.need for t in exchange.transfers] == [sum(c) for c in counts]
        recv, _, _ = reference_exchange(row, ctx.placement, window)
        if exchange.strategy in (Strategy.HALO, Strategy.A2A):
            _, buffer = reference_transfer(recv, ctx.placement, rank)
            assert torch.equal(exchange.for_rank(rank).buffer_positions, buffer)
        assert plan.kv_rows == exchange.for_rank(rank).buffer_positions.numel()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from(["auto", 2, 4]), st.sampled_from([(None,), (None, 3)]))
def test_layout_exchanges_equal_the_token_reference(case, ulysses_size, windows):
    row, cp_size = case
    if cp_size < 2 or (ulysses_size != "auto" and cp_size % ulysses_size):
        return
    heads = HeadShape(num_q_heads=8, num_kv_heads=8, head_dim=4)
    layout = plan_layout(row, cp_size=cp_size, heads=heads, windows=windows,
                         config=BlockDiagCPConfig(ulysses_size=ulysses_size))
    for window, exchange in zip(layout.windows, layout.exchanges):
        _check_exchange(row, layout.group_placement, window, "auto")
        assert exchange.strategy == plan_exchange(row, cp_size=layout.seq_groups, placement=layout.group_placement,
                                                  window=window).strategy


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=300))
def test_checksum_equals_the_python_reference(values):
    t = torch.tensor(values, dtype=torch.int64)
    assert int(shard_checksum(t)) == reference_shard_checksum(t)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-2**63, 2**63 - 1), min_size=1, max_size=300))
def test_host_checksum_equals_the_tensor_formula_a_device_runs(values):
    """The collator's host checksum (a numpy dot with cached weights) = the tensor formula a forward runs on its
    device, also where the int64 sums wrap."""
    t = torch.tensor(values, dtype=torch.int64)
    formula = (((t + 1) * checksum_weights(t.numel())).sum() * 1000003 + t.numel()).bitwise_and((1 << 62) - 1)
    assert int(shard_checksum(t)) == int(formula)


def test_checksum_weights_do_not_repeat_within_a_row():
    weights = checksum_weights(1 << 20)
    assert torch.unique(weights).numel() == weights.numel()
    assert int(weights.min()) >= 1 and int(weights.max()) <= 2**32
    # Positions far apart (up to 2**32 - 1) keep distinct weights: the weight is a bijection of i mod 2**32.
    far = torch.tensor([0, 251, 2**31, 2**32 - 1, 2**32 - 2], dtype=torch.int64)
    w = (far * 2654435761).bitwise_and(2**32 - 1) + 1
    assert torch.unique(w).numel() == far.numel()
    assert torch.equal(checksum_weights(300)[far[:2]], w[:2])  # the formula checksum_weights uses


def test_swapping_two_tokens_changes_the_checksum_at_any_distance():
    values = torch.arange(70_000) % 50_021  # distinct tokens at every distance tried
    base = int(shard_checksum(values))
    for i, distance in [(0, 1), (3, 251), (10, 502), (7, 251 * 7), (100, 1024), (5, 4096), (0, 65_536),
                        (1, 69_998)]:
        j = i + distance
        assert values[i] != values[j]
        swapped = values.clone()
        swapped[[i, j]] = values[[j, i]]
        assert int(shard_checksum(swapped)) != base, distance


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from([(None,), (None, 3)]))
def test_balanced_placement_equals_the_reference_through_the_ordered_scan(case, windows):
    """Every item's rank comes from the scan over ranks in (load, -room, rank) order (ties in work, full ranks, ranks
    already holding the document, spills at tolerance 0): the same placement as the reference's loop."""
    row, cp_size = case
    if cp_size == 1:
        return
    fast = make_placement(row, cp_size, "balanced", tolerance=0.0, windows=windows)
    slow = reference_balanced_placement(row, cp_size, tolerance=0.0, windows=windows)
    assert torch.equal(fast.index, slow.index)


@pytest.mark.parametrize("cp_size", [16, 40])
def test_balanced_placement_equals_the_reference_on_a_long_row(cp_size):
    """Many documents over many ranks: the heap, the vectorised scans and the run-built index stay exact."""
    gen = torch.Generator().manual_seed(cp_size)
    lengths = torch.exp(torch.randn(60, generator=gen) * 1.0 + 5.0).long() + 1
    lengths = lengths[torch.cumsum(lengths, 0) <= 20_000]
    full_len = 20_480
    row = torch.zeros(full_len, dtype=torch.int64)
    row[:int(lengths.sum())] = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    for windows in ((None,), (None, 256)):
        fast = make_placement(row, cp_size, "balanced", windows=windows)
        slow = reference_balanced_placement(row, cp_size, windows=windows)
        assert torch.equal(fast.index, slow.index)
        _check_exchange(row, fast, windows[-1], "auto")


@settings(max_examples=150, deadline=None)
@given(rows(), st.sampled_from(PLACEMENT_KINDS),
       st.sampled_from([(None,), (3,), (None, 2), (1, 5), (None, 2, 3, 7), (None, 3, 4)]))
def test_rank_work_on_runs_equals_the_token_sum(case, kind, windows):
    """The cost model's per-rank work (layout choice, balance): closed forms on runs = the per-token sum, bit for bit
    (three windows take the token path itself)."""
    from hf_blockdiag_cp.planning.placement import _rank_work_tokens, rank_work

    row, cp_size = case
    placement = make_placement(row, cp_size, kind, windows=windows)
    assert torch.equal(rank_work(row, placement, windows), _rank_work_tokens(row, placement, windows))


@st.composite
def many_rank_rows(draw):
    """``(doc_ids [S], cp_size)`` over up to 128 ranks: up to 80 documents of skewed lengths (a few long ones split
    over many ranks, many short ones), padding runs between some of them."""
    cp_size = draw(st.sampled_from([2, 3, 8, 32, 128]))
    local_len = draw(st.integers(1, 48))
    full_len = cp_size * local_len
    scale = draw(st.sampled_from([0.02, 0.1, 0.5, 2.0]))  # document length relative to L
    count = draw(st.integers(0, 80))
    lengths = [max(1, int(local_len * scale * 2.0 ** draw(st.integers(-3, 5)))) for _ in range(count)]
    pads = draw(st.lists(st.integers(0, 3), min_size=count, max_size=count))
    ids, doc = [], 1
    for n, pad in zip(lengths, pads):
        ids += [0] * pad + [doc] * n
        doc += 1
    ids = (ids + [0] * full_len)[:full_len]
    return torch.tensor(ids, dtype=torch.int64), cp_size


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(many_rank_rows(), st.sampled_from([(None,), (None, 7)]), st.sampled_from([0.0, 0.05]))
def test_balanced_placement_equals_the_reference_over_many_ranks(case, windows, tolerance):
    """Up to 128 ranks: the rounds' kept sorted items, the scan over ranks in order and the local search scoring moves
    as swaps with an empty slot give the reference's loops' placement; so do the document runs handed in."""
    from hf_blockdiag_cp.planning.documents import document_runs

    row, cp_size = case
    fast = make_placement(row, cp_size, "balanced", tolerance=tolerance, windows=windows)
    slow = reference_balanced_placement(row, cp_size, tolerance=tolerance, windows=windows)
    assert torch.equal(fast.index, slow.index)
    given_runs = make_placement(row, cp_size, "balanced", tolerance=tolerance, windows=windows,
                                documents=document_runs(row))
    for name in ("start", "length", "rank", "local_start"):
        assert np.array_equal(getattr(fast.runs, name), getattr(given_runs.runs, name)), name
