"""The mirror placement (issue 36): a placement of two stretches per rank, at most two recurrent state summaries per
rank, zigzag where zigzag is right, and attention balanced within 5% on the benchmark's rows."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp import BlockDiagCPConfig, PackingCollator
from hf_blockdiag_cp.planning import PlanError
from hf_blockdiag_cp.planning.documents import document_runs
from hf_blockdiag_cp.planning.fragments import plan_fragments
from hf_blockdiag_cp.planning.hybrid_placement import choose_placement
from hf_blockdiag_cp.planning.mirror_placement import _order_work, _units, _window_min, _works, mirror_placement
from hf_blockdiag_cp.planning.placement import make_placement, rank_work, zigzag_placement
from hf_blockdiag_cp.planning.recurrent_cost import RecurrentShape, summary_slots
from tests.benchmark_module import load_benchmark

#: Qwen3-Next-80B-A3B: 36 gated-delta-rule layers of summary width W, 12 attention layers of 16 heads of 256.
QWEN3_NEXT = RecurrentShape("gdn", 36, (2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128 * 2, 12, 16, 256, 256)


def _bench():
    return load_benchmark("bench_balance")


def _imbalance(row: torch.Tensor, placement, windows=(None,)) -> float:
    work = rank_work(row, placement, windows)
    return float(work.max() / work.mean())


@st.composite
def rows(draw):
    """``(doc_ids [S], cp_size)``: random document lengths, padding runs anywhere (id 0), S divisible by P."""
    cp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    full_len = cp_size * draw(st.integers(1, 24))
    lengths = draw(st.lists(st.integers(1, full_len), min_size=0, max_size=12))
    pads = draw(st.lists(st.booleans(), min_size=len(lengths), max_size=len(lengths)))
    ids = [0 if pad else doc + 1 for doc, (n, pad) in enumerate(zip(lengths, pads)) for _ in range(n)]
    return torch.tensor((ids + [0] * full_len)[:full_len], dtype=torch.int64), cp_size


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows(), st.sampled_from([(None,), (3,), (None, 5)]))
def test_is_a_placement_with_at_most_two_summaries_per_rank(drawn, windows):
    row, cp_size = drawn
    placement = mirror_placement(row, cp_size, windows=windows)
    held = placement.index
    local_len = row.numel() // cp_size
    assert placement.kind == "mirror" and held.shape == (cp_size, local_len)
    assert bool((held[:, 1:] > held[:, :-1]).all())  # every rank's positions ascend
    assert torch.equal(held.flatten().sort().values, torch.arange(row.numel()))
    for rank in range(cp_size):  # the runs (what planning reads) say the same as the table
        assert torch.equal(placement.positions(rank), held[rank])
    slots = summary_slots(row, placement)
    assert slots <= 2 and slots == plan_fragments(row[None], held).slots
    again = mirror_placement(row, cp_size, windows=windows, documents=document_runs(row))
    assert torch.equal(again.index, held)


@settings(max_examples=40, deadline=None)
@given(rows(), st.sampled_from([(None,), (4,), (None, 2)]), st.data())
def test_its_work_model_is_rank_work(drawn, windows, data):
    row, cp_size = drawn
    local_len = row.numel() // cp_size
    fronts = data.draw(st.lists(st.integers(0, local_len), min_size=cp_size - 1, max_size=cp_size - 1))
    placement = mirror_placement(row, cp_size, windows=windows, fronts=fronts, sort=False)
    start, length, padding = _units(row.numpy(), None)
    prefix = np.concatenate([[0], np.cumsum(_order_work(length, padding, windows))])
    points = [0, *np.cumsum(fronts).tolist()]
    points.append(points[-1] + local_len)
    expected = rank_work(row, placement, windows).numpy() * len(windows)
    np.testing.assert_allclose(_works(prefix, cp_size, points), expected, rtol=1e-12)


def _best_of_every_split(row: torch.Tensor, cp_size: int) -> float:
    """The least most-loaded rank's work over every choice of front lengths of the mirror placement's order."""
    local_len = row.numel() // cp_size
    return min(float(rank_work(row, mirror_placement(row, cp_size, fronts=list(fronts))).max())
               for fronts in itertools.product(range(local_len + 1), repeat=cp_size - 1))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda p: st.tuples(st.just(p), st.integers(1, 6))), st.data())
def test_its_split_points_are_the_best_of_every_split(sizes, data):
    cp_size, local_len = sizes
    full_len = cp_size * local_len
    lengths = data.draw(st.lists(st.integers(1, full_len), min_size=1, max_size=6), label="lengths")
    row = torch.tensor(([d + 1 for d, n in enumerate(lengths) for _ in range(n)] + [0] * full_len)[:full_len])
    assert float(rank_work(row, mirror_placement(row, cp_size)).max()) == _best_of_every_split(row, cp_size)


@pytest.mark.parametrize("runs,cp_size", [([(1, 8), (0, 4)], 3), ([(1, 11), (2, 2), (3, 3)], 4),
                                          ([(1, 4), (2, 2), (3, 18)], 4), ([(1, 8), (2, 4), (0, 8)], 4)])
def test_its_search_beats_equal_shares(runs, cp_size):
    """Rows (``(id, length)`` runs) where giving each rank, outside in, the work nearest an equal share of what is
    left is not the best split."""
    row = torch.tensor([doc for doc, n in runs for _ in range(n)])
    assert float(rank_work(row, mirror_placement(row, cp_size)).max()) == _best_of_every_split(row, cp_size)


def test_window_minimum_against_a_loop():
    gen = np.random.default_rng(0)
    for _ in range(300):
        values = gen.normal(size=int(gen.integers(1, 40)))
        first, count, width = int(gen.integers(-45, 45)), int(gen.integers(1, 40)), int(gen.integers(1, 50))
        expected = [min(values[max(first + j, 0):max(first + j + width, 0)], default=np.inf) for j in range(count)]
        np.testing.assert_array_equal(_window_min(values, first, count, width), expected)


def test_half_fronts_in_row_order_and_one_document_are_zigzag():
    gen = torch.Generator().manual_seed(0)
    for full_len, cp_size in ((96, 4), (4096, 8), (2048, 2)):
        local_len = full_len // cp_size
        lengths = torch.randint(1, full_len // 3, (40,), generator=gen).tolist()
        row = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)])[:full_len]
        forced = mirror_placement(row, cp_size, fronts=[local_len // 2] * (cp_size - 1), sort=False)
        assert torch.equal(forced.index, zigzag_placement(full_len, cp_size).index)
        one = torch.ones(full_len, dtype=torch.int64)
        assert torch.equal(mirror_placement(one, cp_size).index, zigzag_placement(full_len, cp_size).index)


@pytest.mark.parametrize("kind", ["lognormal_8", "lognormal_32", "heavy_tail"])
def test_balances_the_benchmark_rows_at_128k_on_8_ranks(kind):
    bench = _bench()
    for seed in range(3):
        row = bench.make_row(kind, 128 * 1024, seed)
        placement = mirror_placement(row, 8)
        assert _imbalance(row, placement) <= 1.05
        assert summary_slots(row, placement) <= 2
        assert _imbalance(row, zigzag_placement(row.numel(), 8)) > 1.2  # what fixed split points give


def test_respects_sliding_windows():
    bench = _bench()
    row = bench.make_row("heavy_tail", 32768, 1)
    blind = mirror_placement(row, 8)
    for windows, worse in (((1024,), 1.2), ((None, 512), 1.01)):  # work per rank averaged over the windows
        aware = mirror_placement(row, 8, windows=windows)
        assert _imbalance(row, aware, windows) <= 1.001 and _imbalance(row, blind, windows) > worse


def test_choose_placement_picks_it_for_qwen3_next_sizes():
    bench = _bench()
    row = bench.make_row("lognormal_8", 128 * 1024, 0)
    choice = choose_placement(row, 8, QWEN3_NEXT)
    assert [c.name for c in choice.table][0] == "balanced" and choice.table[-1].name == "mirror"
    assert choice.cost.name == "mirror" and choice.placement.kind == "mirror"
    assert choice.cost.slots <= 2 and choice.cost.imbalance <= 1.05
    assert "placement -> mirror" in choice.reason()


def test_mirror_is_a_placement_kind_everywhere():
    docs = [{"input_ids": list(range(3, 3 + n))} for n in (700, 60, 30, 200, 34)]
    assert BlockDiagCPConfig(placement="MIRROR").placement == "mirror"
    row = torch.repeat_interleave(torch.arange(1, 6), torch.tensor([700, 60, 30, 200, 34]))
    assert make_placement(row, 4, "mirror").kind == "mirror"
    for rank in range(4):
        ctx = PackingCollator(1024, cp_size=4, cp_rank=rank, pad_token_id=0, placement="mirror")(docs)["cp_context"]
        assert ctx.placement.kind == "mirror"
        assert torch.equal(ctx.local_index, mirror_placement(ctx.doc_ids[0], 4).index[rank])
    with pytest.raises(PlanError, match="divisible by cp_size"):
        mirror_placement(torch.ones(10, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="fronts="):
        mirror_placement(torch.ones(8, dtype=torch.int64), 4, fronts=[1, 3])
