"""Packing of lengths (pure functions) and property tests of packing + sharding through the collator."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp import PackingCollator
from hf_blockdiag_cp.data.packing import Piece, best_fit_decreasing, pack_pieces, split_overflow
from tests.benchmark_module import load_benchmark
from tests.layouts import unshard

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _load_bench():
    return load_benchmark("bench_packing")


bench = _load_bench()
first_fit, next_fit, padding_fraction = bench.first_fit, bench.next_fit, bench.padding_fraction


# ---------------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------------

def naive_best_fit_decreasing(sizes: list[int], capacity: int) -> list[list[int]]:
    """O(n * bins) best-fit-decreasing written from the definition."""
    bins: list[list[int]] = []
    for item in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        fits = [(capacity - sum(sizes[j] for j in b), k) for k, b in enumerate(bins)
                if capacity - sum(sizes[j] for j in b) >= sizes[item]]
        if fits:
            bins[min(fits)[1]].append(item)
        else:
            bins.append([item])
    return bins


def check_packing(bins: list[list[int]], sizes: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(sizes))), "every item exactly once"
    fills = [sum(sizes[i] for i in b) for b in bins]
    assert all(0 < f <= capacity for f in fills)


sizes_strategy = st.integers(1, 40).flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=40)))


@FAST
@given(sizes_strategy)
def test_best_fit_decreasing_matches_naive_reference(case):
    capacity, sizes = case
    bins = best_fit_decreasing(sizes, capacity)
    check_packing(bins, sizes, capacity)
    assert bins == naive_best_fit_decreasing(sizes, capacity)


@FAST
@given(sizes_strategy)
def test_any_fit_packers_leave_no_two_bins_mergeable(case):
    """An any-fit packer opens a bin only when the item fits nowhere, so any two bins overflow together."""
    capacity, sizes = case
    for packer in (best_fit_decreasing, first_fit):
        bins = packer(sizes, capacity)
        check_packing(bins, sizes, capacity)
        fills = [sum(sizes[i] for i in b) for b in bins]
        assert all(fills[a] + fills[b] > capacity for a in range(len(fills)) for b in range(a + 1, len(fills)))
        assert len(bins) >= math.ceil(sum(sizes) / capacity)
    check_packing(next_fit(sizes, capacity), sizes, capacity)


def test_first_fit_and_next_fit_by_hand():
    assert first_fit([6, 5, 4, 3], 10) == [[0, 2], [1, 3]]
    sizes = [2, 5, 4, 7, 1, 3, 8]
    assert first_fit(sizes, 10) == [[0, 1, 4], [2, 5], [3], [6]]
    assert best_fit_decreasing(sizes, 10) == [[6, 0], [3, 5], [1, 2, 4]]
    assert next_fit([6, 5, 4, 3], 10) == [[0], [1, 2], [3]]
    assert best_fit_decreasing([6, 5, 4, 3], 10) == [[0, 2], [1, 3]]
    assert padding_fraction(2, 18, 10) == pytest.approx(0.1)
    assert padding_fraction(0, 0, 10) == 0.0


@pytest.mark.parametrize("bad", [[0], [11], [-1]])
def test_best_fit_decreasing_rejects_sizes_outside_capacity(bad):
    with pytest.raises(ValueError, match=r"sizes\[0\]"):
        best_fit_decreasing(bad, 10)
    with pytest.raises(ValueError, match="capacity=0"):
        best_fit_decreasing([1], 0)


def realistic_lengths(n: int, seed: int, seq_len: int) -> list[int]:
    rng = random.Random(seed)
    return [min(4 * seq_len, max(1, round(rng.lognormvariate(math.log(seq_len / 8), 1.0)))) for _ in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_decreasing_no_worse_than_greedy_on_realistic_lengths(seed):
    seq_len = 1024
    sizes = [p.length for p in split_overflow(realistic_lengths(600, seed, seq_len), seq_len)]
    pads = {p.__name__: padding_fraction(len(p(sizes, seq_len)), sum(sizes), seq_len)
            for p in (best_fit_decreasing, first_fit, next_fit)}
    assert pads["best_fit_decreasing"] <= pads["first_fit"] <= pads["next_fit"]
    assert pads["best_fit_decreasing"] < 0.02  # near the ceil(sum/capacity) bound at this size


def test_split_overflow_modes():
    assert split_overflow([3, 0, 10, 4], 4, "split") == [
        Piece(0, 0, 3), Piece(2, 0, 4), Piece(2, 4, 4), Piece(2, 8, 2), Piece(3, 0, 4)]
    assert split_overflow([3, 0, 10, 4], 4, "truncate") == [Piece(0, 0, 3), Piece(2, 0, 4), Piece(3, 0, 4)]
    with pytest.raises(ValueError, match=r"example 7: input_ids has 10 tokens.*seq_len=4.*overflow='error'"):
        split_overflow([3, 0, 10], 4, "error", indices=[5, 6, 7])
    with pytest.raises(ValueError, match="overflow='cut'"):
        split_overflow([1], 4, "cut")


@FAST
@given(st.integers(1, 16), st.lists(st.integers(0, 50), max_size=20))
def test_split_overflow_covers_every_token_once(capacity, lengths):
    pieces = split_overflow(lengths, capacity, "split")
    assert all(1 <= p.length <= capacity for p in pieces)
    for doc, length in enumerate(lengths):
        mine = [p for p in pieces if p.doc == doc]
        assert sum(p.length for p in mine) == length
        assert [p.start for p in mine] == list(range(0, length, capacity))
    rows = pack_pieces(pieces, capacity)
    assert sorted((p.doc, p.start) for r in rows for p in r) == sorted((p.doc, p.start) for p in pieces)
    for row in rows:
        assert row == sorted(row, key=lambda p: (p.doc, p.start))  # document order inside a row


# ---------------------------------------------------------------------------------------------------
# Property test of packing + sharding through the collator (acceptance 4)
# ---------------------------------------------------------------------------------------------------

def make_examples(lengths: list[int], label_masks: list[list[bool]]) -> tuple[list[dict], dict[int, tuple]]:
    """Documents whose token ids are unique in the batch; ``where[token] = (doc, offset, label)``."""
    examples, where, next_token = [], {}, 1
    for doc, (n, mask) in enumerate(zip(lengths, label_masks)):
        ids = list(range(next_token, next_token + n))
        next_token += n
        labels = [-100 if ignore else tok + 100_000 for tok, ignore in zip(ids, mask)]
        examples.append({"input_ids": ids, "labels": labels, "extra": "ignored"})
        where.update({tok: (doc, off, lab) for off, (tok, lab) in enumerate(zip(ids, labels))})
    return examples, where


def check_row_against_inputs(ids: torch.Tensor, pos: torch.Tensor, shift: torch.Tensor, doc_ids: torch.Tensor,
                             where: dict[int, tuple], seq_len: int, pad: int) -> tuple[set[int], int]:
    """Check one full row from first principles; return its tokens and its number of loss targets."""
    real = doc_ids != 0
    n_real = int(real.sum())
    assert real[:n_real].all() and not real[n_real:].any(), "padding only at the tail"
    assert (ids[n_real:] == pad).all() and (pos[n_real:] == 0).all() and (shift[n_real:] == -100).all()
    tokens = ids[:n_real].tolist()
    targets = 0
    for t, tok in enumerate(tokens):
        doc, off, _ = where[tok]
        assert pos[t] == off, "position = offset inside the source document (continuing for split pieces)"
        starts_piece = t == 0 or doc_ids[t] != doc_ids[t - 1]
        if starts_piece:
            assert off % seq_len == 0, "a piece starts at 0 or at a multiple of seq_len (split)"
        else:
            assert where[tokens[t - 1]][:2] == (doc, off - 1), "consecutive tokens of one document"
        nxt = t + 1 < n_real and doc_ids[t + 1] == doc_ids[t]
        expected = where[tokens[t + 1]][2] if nxt else -100
        assert shift[t] == expected, f"shift_labels[{t}]"
        targets += expected != -100
    return set(tokens), targets


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), cp_size=st.integers(1, 8), per_rank=st.integers(1, 4),
       overflow=st.sampled_from(["split", "truncate"]), placement=st.sampled_from(["contiguous", "zigzag", "balanced"]))
@pytest.mark.slow
def test_packing_and_sharding_invariants(data, cp_size, per_rank, overflow, placement):
    if placement == "zigzag":
        per_rank *= 2  # zigzag cuts the row into 2 * cp_size equal chunks
    seq_len = cp_size * per_rank
    lengths = data.draw(st.lists(st.one_of(st.just(0), st.just(1), st.integers(0, 3 * seq_len)), min_size=1,
                                 max_size=10).filter(any), label="lengths")
    masks = [data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label=f"mask{i}")
             for i, n in enumerate(lengths)]
    examples, where = make_examples(lengths, masks)
    pad = 0  # token ids start at 1, so padding is distinguishable
    ranks = [PackingCollator(seq_len, cp_size=cp_size, cp_rank=r, pad_token_id=pad, overflow=overflow,
                             placement=placement).micro_batches(examples) for r in range(cp_size)]
    unsharded = PackingCollator(seq_len, pad_token_id=pad, overflow=overflow).micro_batches(examples)
    seen: list[int] = []
    total_targets = 0
    for row, cp1 in enumerate(unsharded):
        batches = [ranks[r][row] for r in range(cp_size)]
        doc_ids = batches[0]["cp_context"].doc_ids[0].to(torch.int64)
        for r, b in enumerate(batches):
            ctx = b["cp_context"]
            assert set(b) == {"input_ids", "position_ids", "labels", "shift_labels", "num_items_in_batch",
                              "cp_context", "use_cache"}
            assert b["input_ids"].shape == (1, per_rank) and ctx.local_len == per_rank
            if placement == "contiguous" or cp_size == 1:
                assert torch.equal(ctx.local_index, torch.arange(r * per_rank, (r + 1) * per_rank))
            assert bool((ctx.local_index[1:] > ctx.local_index[:-1]).all()), "local rows keep row order"
            assert torch.equal(ctx.doc_ids[0].to(torch.int64), doc_ids), "every rank plans the same full row"
            assert (ctx.cp_rank, ctx.cp_size) == (r, cp_size)
            ctx.plan.validate()
        held = torch.sort(torch.cat([b["cp_context"].local_index for b in batches])).values
        assert torch.equal(held, torch.arange(seq_len)), "the ranks hold every position exactly once"
        row_ids, row_pos, row_shift = (unshard(batches, k) for k in ("input_ids", "position_ids", "shift_labels"))
        assert torch.equal(row_ids, cp1["input_ids"][0]) and torch.equal(row_pos, cp1["position_ids"][0])
        assert torch.equal(row_shift, cp1["shift_labels"][0])
        assert torch.equal(unshard(batches, "labels"), cp1["labels"][0])
        # doc ids are 1, 2, ... in row order
        real = doc_ids[doc_ids != 0]
        assert real[0] == 1 and ((real[1:] - real[:-1]) >= 0).all() and ((real[1:] - real[:-1]) <= 1).all()
        tokens, targets = check_row_against_inputs(row_ids, row_pos, row_shift, doc_ids, where, seq_len, pad)
        seen.extend(tokens)
        total_targets += targets
    assert len(seen) == len(set(seen)), "no token appears twice"
    expected_tokens = {tok for tok, (doc, off, _) in where.items() if overflow == "split" or off < seq_len}
    assert set(seen) == expected_tokens, "every input token appears exactly once (truncate keeps the first seq_len)"
    counts = {b["num_items_in_batch"] for rank in ranks + [unsharded] for b in rank}
    assert counts == {total_targets}, "num_items_in_batch: the step's targets, identical everywhere"
    assert len(unsharded) >= math.ceil(len(seen) / seq_len)
