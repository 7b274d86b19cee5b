"""The hybrid placement cost model: bytes formula, slots, the choice; placements unchanged without recurrent layers."""

from __future__ import annotations

import torch

from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.data.collator import PackingCollator
from hf_blockdiag_cp.planning.fragments import plan_fragments
from hf_blockdiag_cp.planning.hybrid_placement import choose_placement, hybrid_placement, placement_cost
from hf_blockdiag_cp.planning.placement import make_placement, rank_work
from hf_blockdiag_cp.planning.recurrent_cost import RecurrentShape, recurrent_bytes, recurrent_shape, summary_slots


def _row(lengths: list[int], pad: int = 0) -> torch.Tensor:
    return torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(pad, dtype=torch.int64)])


ROWS = [_row([700, 60, 30, 200, 34]), _row([1024]), _row([5] * 150 + [274]), _row([400, 300], pad=324)]


def test_shapes_of_known_configs() -> None:
    q = recurrent_shape(tiny_config("qwen3_next"))
    # conv C (K - 1) with C = 2 Hk Dk + Hv Dv, plus Hv Dk Dv + Hv Dk Dk
    assert (q.family, q.layers, q.attention_layers) == ("gdn", 1, 1)
    assert q.width == (2 * 4 * 16 + 4 * 16) * 3 + 4 * 16 * 16 * 2
    b = recurrent_shape(tiny_config("bamba"))
    assert (b.family, b.layers, b.attention_layers) == ("ssd", 1, 1)
    assert b.width == (8 * 16 + 2 * 8) * 3 + 8 * 16 * 8 + 8
    c = recurrent_shape(tiny_config("lfm2"))
    assert (c.family, c.layers, c.width) == ("conv", 1, 64 * 2)
    assert recurrent_shape(tiny_config("llama")) is None


def test_bytes_formula() -> None:
    shape = RecurrentShape("gdn", 36, 1000, 12, 16, 256, 256)
    assert recurrent_bytes(shape, 8, 3) == 7 * 3 * 1000 * 4


def test_slots_equal_the_fragment_plan() -> None:
    for row in ROWS:
        for p in (2, 4, 8):
            for placement in (make_placement(row, p, "balanced"), make_placement(row, p, "zigzag"),
                              make_placement(row, p, "contiguous"), hybrid_placement(row, p)):
                assert summary_slots(row, placement) == plan_fragments(row[None], placement.index).slots


def test_hybrid_placement_is_a_placement_and_balances() -> None:
    for row in ROWS:
        for p in (2, 4):
            placement = hybrid_placement(row, p)
            assert torch.equal(placement.index.flatten().sort().values, torch.arange(row.numel()))
            work = rank_work(row, placement)
            assert float(work.max() / work.mean()) <= float(
                rank_work(row, make_placement(row, p, "contiguous")).max() / work.mean()) + 1e-9


def test_chooses_contiguous_when_the_recurrent_cost_dominates() -> None:
    row = ROWS[0]
    heavy_state = RecurrentShape("gdn", 64, 10 ** 9, 1, 1, 1, 1)
    choice = choose_placement(row, 4, heavy_state)
    assert choice.cost.name == "contiguous" and choice.cost.slots == 1
    assert "contiguous" in choice.reason()
    light_state = RecurrentShape("gdn", 1, 1, 48, 64, 128, 128)
    assert choose_placement(row, 4, light_state).cost.imbalance < placement_cost(
        "contiguous", row, make_placement(row, 4, "contiguous"), light_state).imbalance


def test_collator_unchanged_without_recurrent_layers() -> None:
    docs = [{"input_ids": list(range(3, 3 + n))} for n in (700, 60, 30, 200, 34)]
    for config in (None, tiny_config("llama")):
        plain = PackingCollator(1024, cp_size=4, cp_rank=1, pad_token_id=0)(docs)["cp_context"]
        told = PackingCollator(1024, cp_size=4, cp_rank=1, pad_token_id=0, model_config=config)(docs)["cp_context"]
        assert told.placement.kind == "balanced"
        assert torch.equal(told.placement.index, plain.placement.index)


def test_collator_chooses_for_a_hybrid_model_and_keeps_an_override() -> None:
    docs = [{"input_ids": list(range(3, 3 + n))} for n in (700, 60, 30, 200, 34)]
    config = tiny_config("qwen3_next")
    chosen = PackingCollator(1024, cp_size=4, cp_rank=0, pad_token_id=0, model_config=config)(docs)["cp_context"]
    row = chosen.doc_ids[0]
    assert chosen.placement.kind == choose_placement(row, 4, recurrent_shape(config)).placement.kind
    kept = PackingCollator(1024, cp_size=4, cp_rank=0, pad_token_id=0, model_config=config,
                           placement="zigzag")(docs)["cp_context"]
    assert kept.placement.kind == "zigzag"
