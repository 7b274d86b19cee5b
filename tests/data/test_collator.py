"""PackingCollator, PackedDataset and from_flattened: layout, sharding, validation, iteration."""

from __future__ import annotations

import logging
import pickle

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_blockdiag_cp import (
    BlockDiagCPConfig,
    BlockDiagCPContext,
    PackedDataset,
    PackedRow,
    PackingCollator,
    from_flattened,
)
from tests.layouts import unshard

KEYS = {"input_ids", "position_ids", "labels", "shift_labels", "num_items_in_batch", "cp_context", "use_cache"}


def docs(*lengths: int, start: int = 1) -> list[dict]:
    """Examples with unique, increasing token ids (so layouts can be read back)."""
    out = []
    for n in lengths:
        out.append({"input_ids": list(range(start, start + n))})
        start += n
    return out


# ---------------------------------------------------------------------------------------------------
# Layout and round trip (acceptance 1)
# ---------------------------------------------------------------------------------------------------

def test_single_row_layout_by_hand():
    examples = [{"input_ids": [11, 12, 13], "labels": [-100, 12, 13]}, {"input_ids": [21, 22, 23, 24, 25]}]
    b = PackingCollator(12, pad_token_id=0)(examples)
    assert set(b) == KEYS and "attention_mask" not in b
    # Inside a row documents keep their example order.
    assert b["input_ids"].tolist() == [[11, 12, 13, 21, 22, 23, 24, 25, 0, 0, 0, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 0, 0, 0]]
    assert b["labels"].tolist() == [[-100, 12, 13, -100, 22, 23, 24, 25, -100, -100, -100, -100]]
    assert b["shift_labels"].tolist() == [[12, 13, -100, 22, 23, 24, 25, -100, -100, -100, -100, -100]]
    assert type(b["num_items_in_batch"]) is int and b["num_items_in_batch"] == 6
    ctx = b["cp_context"]
    assert isinstance(ctx, BlockDiagCPContext) and ctx.doc_ids.dtype == torch.int32
    assert ctx.doc_ids.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2, 0, 0, 0, 0]]
    assert b["use_cache"] is False
    for key in ("input_ids", "position_ids", "labels", "shift_labels"):
        assert b[key].dtype == torch.int64


def test_several_rows_at_cp1_and_one_row_per_rank_under_cp():
    examples = docs(7, 5, 3, 6, 2)  # 23 tokens, rows of 8: BFD makes [7], [6, 2], [5, 3]
    b = PackingCollator(8, pad_token_id=0)(examples)
    assert b["input_ids"].shape == (3, 8) and b["cp_context"].doc_ids.shape == (3, 8)
    assert sorted(t for t in b["input_ids"].flatten().tolist() if t) == list(range(1, 24))
    assert int(b["num_items_in_batch"]) == 23 - 5
    with pytest.raises(ValueError, match="PackedDataset"):
        PackingCollator(8, cp_size=2, cp_rank=0, pad_token_id=0)(examples)
    one_row = PackingCollator(8, cp_size=2, cp_rank=1, pad_token_id=0, placement="contiguous")(docs(5, 3))
    assert one_row["input_ids"].tolist() == [[5, 6, 7, 8]]


def test_rows_are_best_fit_decreasing():
    """[2, 5, 4, 7, 1, 3, 8] into rows of 10: greedy first-fit needs 4 rows, best-fit-decreasing 3."""
    b = PackingCollator(10, pad_token_id=0)(docs(2, 5, 4, 7, 1, 3, 8))
    assert sorted(sum(t != 0 for t in row) for row in b["input_ids"].tolist()) == [10, 10, 10]
    assert len(list(PackedDataset(docs(2, 5, 4, 7, 1, 3, 8), 10))) == 3


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_round_trip_across_ranks(cp_size):
    seq_len = 24
    examples = docs(9, 1, 14, 0, 30, 4)
    for e in examples[::2]:
        e["labels"] = [t if t % 3 else -100 for t in e["input_ids"]]
    per_rank = [PackingCollator(seq_len, cp_size=cp_size, cp_rank=r, pad_token_id=0).micro_batches(examples)
                for r in range(cp_size)]
    reference = PackingCollator(seq_len, pad_token_id=0).micro_batches(examples)
    tokens = []
    for row, ref in enumerate(reference):
        batches = [per_rank[r][row] for r in range(cp_size)]
        for key in ("input_ids", "position_ids", "shift_labels", "labels"):
            assert torch.equal(unshard(batches, key), ref[key][0]), key
        ids = ref["input_ids"][0]
        n = int((ids != 0).sum())
        assert (ids[:n] != 0).all() and (ids[n:] == 0).all(), "padding only at the tail"
        tokens += ids[:n].tolist()
        # positions restart at 0 per document (the 30-token document continues at 24 after the cut)
        pos, starts = ref["position_ids"][0], ref["cp_context"].doc_ids[0]
        firsts = [t for t in range(n) if t == 0 or starts[t] != starts[t - 1]]
        assert all(int(pos[t]) in (0, 24) for t in firsts)
        assert all(int(pos[t]) == int(pos[t - 1]) + 1 for t in range(1, n) if t not in firsts)
    assert sorted(tokens) == list(range(1, 59)), "every input token exactly once"


def test_shift_labels_cross_rank_boundaries():
    """The last local token of rank r is labelled with rank r+1's first token: a local re-shift gets it wrong."""
    examples = docs(16)
    batches = [PackingCollator(16, cp_size=4, cp_rank=r, pad_token_id=0, placement="contiguous")(examples)
               for r in range(4)]
    for r in range(3):
        assert int(batches[r]["shift_labels"][0, -1]) == int(batches[r + 1]["input_ids"][0, 0])
        assert int(batches[r]["shift_labels"][0, -1]) == int(batches[r + 1]["labels"][0, 0])
        local_reshift = torch.cat([batches[r]["labels"][0, 1:], torch.tensor([-100])])
        assert not torch.equal(local_reshift, batches[r]["shift_labels"][0])
    assert {int(b["num_items_in_batch"]) for b in batches} == {15}


def test_overflow_split_and_truncate():
    long = {"input_ids": list(range(1, 21))}
    split = PackingCollator(8, pad_token_id=0, overflow="split")([long])
    assert split["input_ids"].shape == (3, 8)
    assert sorted(split["position_ids"][:, 0].tolist()) == [0, 8, 16], "pieces continue the document's positions"
    assert int(split["num_items_in_batch"]) == 20 - 3, "each cut loses one target (the piece start)"
    trunc = PackingCollator(8, pad_token_id=0, overflow="truncate")([long, {"input_ids": [50, 51]}])
    assert trunc["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [50, 51, 0, 0, 0, 0, 0, 0]]


def test_label_pad_id_and_pad_to_multiple_of():
    b = PackingCollator(8, pad_token_id=9, label_pad_id=-1, pad_to_multiple_of=4)(
        [{"input_ids": [1, 2, 3], "labels": [1, -100, -1]}])
    assert b["input_ids"].tolist() == [[1, 2, 3, 9, 9, 9, 9, 9]]
    assert b["labels"].tolist() == [[-1, -1, -1, -1, -1, -1, -1, -1]]
    assert int(b["num_items_in_batch"]) == 0
    PackingCollator(16, cp_size=2, cp_rank=0, pad_token_id=0, pad_to_multiple_of=8)  # 16 = 2 * 8


def test_micro_batches_share_the_step_count():
    mbs = PackingCollator(8, cp_size=2, cp_rank=0, pad_token_id=0).micro_batches(docs(7, 5, 3, 6, 2))
    assert len(mbs) == 3 and all(mb["input_ids"].shape == (1, 4) for mb in mbs)
    assert {int(mb["num_items_in_batch"]) for mb in mbs} == {23 - 5}
    assert sum(int((mb["shift_labels"] != -100).sum()) for mb in mbs) < 23 - 5  # rank 0 holds only part


def test_context_moves_and_pickles():
    b = PackingCollator(8, pad_token_id=0, config=BlockDiagCPConfig(backend="sdpa_doc"))(docs(3, 4))
    ctx = b["cp_context"]
    assert ctx.to("cpu") is ctx and ctx.config.backend == "sdpa_doc"
    again = pickle.loads(pickle.dumps(b))  # DataLoader workers send batches through pickle
    assert torch.equal(again["cp_context"].doc_ids, ctx.doc_ids)


def test_empty_documents_are_dropped_and_logged(caplog):
    with caplog.at_level(logging.INFO, logger="hf_blockdiag_cp.data"):
        b = PackingCollator(8, pad_token_id=0)([{"input_ids": []}, {"input_ids": [4, 5]},
                                                {"input_ids": torch.tensor([], dtype=torch.long)}])
    assert b["input_ids"].tolist() == [[4, 5, 0, 0, 0, 0, 0, 0]]
    assert "dropped 2 empty document(s) (examples [0, 2])" in caplog.text


# ---------------------------------------------------------------------------------------------------
# Validation (acceptance 5)
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("examples, match", [
    ([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3], "labels": [1, 2]}],
     r"example 1: labels has length 2 but input_ids has length 3"),
    ([{"input_ids": [1, 2.5]}], r"example 0: input_ids must contain integers"),
    ([{"input_ids": [1]}, {"input_ids": torch.tensor([1.0, 2.0])}], r"example 1: input_ids must contain integers"),
    ([{"input_ids": [1, True]}], r"example 0: input_ids must contain ints"),
    ([{"input_ids": "hello"}], r"example 0: input_ids must be a sequence of ints"),
    ([{"input_ids": [1]}, {"input_ids": [1]}, {"input_ids": [3, -1]}], r"example 2: input_ids\[1\]=-1 is negative"),
    ([{"input_ids": [[1, 2]]}], r"example 0: input_ids must be 1-D"),
    ([{"input_ids": [1, 2], "labels": [1, -7]}], r"example 0: labels\[1\]=-7 is negative"),
    ([{"input_ids": [1, 2], "labels": [1.0, 2.0]}], r"example 0: labels must contain integers"),
    ([{"text": "x"}], r"example 0: missing field 'input_ids'"),
    ([{"input_ids": [1]}, [1, 2]], r"example 1 must be a mapping"),
    ([{"input_ids": []}], r"all 1 examples have empty input_ids"),
])
def test_bad_examples_raise_naming_index_and_field(examples, match):
    with pytest.raises(ValueError, match=match):
        PackingCollator(8, pad_token_id=0)(examples)


def test_overflow_error_names_the_example():
    with pytest.raises(ValueError, match=r"example 2: input_ids has 9 tokens, more than seq_len=8"):
        PackingCollator(8, pad_token_id=0, overflow="error")(docs(1, 0, 9))


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=12, cp_size=3, cp_rank=0, pad_to_multiple_of=8),
     r"seq_len=12 is not divisible by cp_size \* pad_to_multiple_of = 3 \* 8 = 24"),
    (dict(seq_len=10, cp_size=4, cp_rank=0), r"seq_len=10 is not divisible by .* 4"),
    (dict(seq_len=8, cp_size=2, cp_rank=2), r"cp_rank=2 must be an int in \[0, cp_size=2\)"),
    (dict(seq_len=8, cp_size=2), r"cp_rank is required"),
    (dict(seq_len=8, cp_size=0, cp_rank=0), r"cp_size=0"),
    (dict(seq_len=8, overflow="wrap"), r"overflow='wrap'"),
    (dict(seq_len=0), r"seq_len=0"),
    (dict(seq_len=8, pad_to_multiple_of=0), r"pad_to_multiple_of=0"),
])
def test_bad_configuration_raises(kwargs, match):
    seq_len = kwargs.pop("seq_len")
    with pytest.raises(ValueError, match=match):
        PackingCollator(seq_len, pad_token_id=0, **kwargs)
    with pytest.raises(ValueError, match="pad_token_id=-1"):
        PackingCollator(8, pad_token_id=-1)


def test_packed_rows_are_checked():
    rows = list(PackedDataset(docs(5, 6), 8))
    with pytest.raises(ValueError, match=r"example 0: PackedRow holds 6 tokens, more than seq_len=4"):
        PackingCollator(4, pad_token_id=0)(rows)
    with pytest.raises(ValueError, match="mixes PackedRow"):
        PackingCollator(8, pad_token_id=0)([rows[0], docs(2)[0]])


# ---------------------------------------------------------------------------------------------------
# PackedDataset: one row per item
# ---------------------------------------------------------------------------------------------------

def test_packed_dataset_yields_rows_of_every_document_once():
    examples = docs(*[(7 * i) % 23 for i in range(40)])  # includes empty docs and docs > seq_len
    rows = list(PackedDataset(examples, 16, buffer_size=7))
    assert all(isinstance(r, PackedRow) and 0 < len(r) <= 16 for r in rows)
    tokens = sorted(t for r in rows for d in r.documents for t in d.input_ids.tolist())
    assert tokens == list(range(1, 1 + sum((7 * i) % 23 for i in range(40))))
    collator = PackingCollator(16, cp_size=4, cp_rank=3, pad_token_id=0)
    loader = torch.utils.data.DataLoader(PackedDataset(examples, 16, buffer_size=7), batch_size=1, collate_fn=collator)
    batches = list(loader)
    assert len(batches) == len(rows) and all(b["input_ids"].shape == (1, 4) for b in batches)
    for row, b in zip(rows, batches):
        assert int(b["num_items_in_batch"]) == sum(max(len(d) - 1, 0) for d in row.documents)


def test_packed_dataset_workers_keep_rows_and_order():
    examples = docs(*[(5 * i) % 13 + 1 for i in range(30)])
    collator = PackingCollator(16, pad_token_id=0)
    serial = list(torch.utils.data.DataLoader(PackedDataset(examples, 16, buffer_size=10), batch_size=1,
                                              collate_fn=collator))
    parallel = list(torch.utils.data.DataLoader(PackedDataset(examples, 16, buffer_size=10), batch_size=1,
                                                collate_fn=collator, num_workers=2))
    assert len(serial) == len(parallel)
    for a, b in zip(serial, parallel):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["cp_context"].doc_ids, b["cp_context"].doc_ids)


def test_packed_dataset_shuffle_and_validation():
    examples = docs(*range(1, 30))
    first = [tuple(d.index for d in r.documents) for r in PackedDataset(examples, 32, seed=1)]
    assert first == [tuple(d.index for d in r.documents) for r in PackedDataset(examples, 32, seed=1)]
    plain = [tuple(d.index for d in r.documents) for r in PackedDataset(examples, 32)]
    assert sorted(first) == sorted(plain) and first != plain
    shuffled = PackedDataset(examples, 32, seed=1)
    shuffled.set_epoch(1)
    assert [tuple(d.index for d in r.documents) for r in shuffled] != first
    with pytest.raises(ValueError, match="re-iterable"):
        PackedDataset(iter(examples), 32)
    with pytest.raises(ValueError, match=r"example 3: input_ids has 4 tokens"):
        list(PackedDataset(docs(1, 2, 3, 4), 3, overflow="error"))


# ---------------------------------------------------------------------------------------------------
# from_flattened (DataCollatorWithFlattening output)
# ---------------------------------------------------------------------------------------------------

FLAT_DOCS = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9], "labels": [9]},
             {"input_ids": [10, 11, 12, 13, 14, 15], "labels": [10, 11, 12, 13, 14, 15]}]


@pytest.mark.parametrize("hf_kwargs", [dict(), dict(return_flash_attn_kwargs=True),
                                       dict(return_seq_idx=True, return_position_ids=False),
                                       dict(return_flash_attn_kwargs=True, return_position_ids=False)])
def test_from_flattened_matches_hf_flattening(hf_kwargs):
    hf = DataCollatorWithFlattening(**hf_kwargs)(FLAT_DOCS)
    b = from_flattened(hf, cp_size=1, pad_to_multiple_of=4)
    assert set(b) == KEYS
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 0, 0, 1, 2, 3, 4, 5, 0]]
    assert b["cp_context"].doc_ids.tolist() == [[1, 1, 1, 1, 2, 3, 3, 3, 3, 3, 3, 0]]
    # shift_labels is ForCausalLMLoss's own shift of HF's labels, on the full row
    labels = torch.tensor([[-100, -100, 7, 8, -100, -100, 11, 12, 13, 14, 15]])
    assert torch.equal(DataCollatorWithFlattening()(FLAT_DOCS)["labels"], labels)
    hf_shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    assert b["shift_labels"][:, :11].tolist() == hf_shift.tolist() and int(b["shift_labels"][0, 11]) == -100
    assert int(b["num_items_in_batch"]) == int((hf_shift != -100).sum()) == 7


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_from_flattened_round_trip_under_cp(cp_size):
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(FLAT_DOCS)
    ref = from_flattened(hf, cp_size=1, pad_to_multiple_of=cp_size)
    batches = [from_flattened(hf, cp_size=cp_size, cp_rank=r) for r in range(cp_size)]
    assert all(b["input_ids"].shape == (1, ref["input_ids"].shape[1] // cp_size) for b in batches)
    for key in ("input_ids", "position_ids", "labels", "shift_labels"):
        assert torch.equal(unshard(batches, key), ref[key][0]), key
    assert {int(b["num_items_in_batch"]) for b in batches} == {7}


def test_from_flattened_keeps_separator_labels_and_validates():
    hf = DataCollatorWithFlattening(separator_id=99)(FLAT_DOCS[:2])
    b = from_flattened(hf)
    assert b["shift_labels"].tolist() == [[-100, 7, 8, 99, -100]]  # HF's choice: predict the separator
    unlabelled = from_flattened({"input_ids": [[3, 4, 5, 6]], "position_ids": [[0, 1, 0, 1]]})
    assert unlabelled["shift_labels"].tolist() == [[4, -100, 6, -100]]
    with pytest.raises(ValueError, match="needs cu_seq_lens_k, seq_idx or position_ids"):
        from_flattened({"input_ids": [[1, 2]]})
    with pytest.raises(ValueError, match="labels has length 1"):
        from_flattened({"input_ids": [[1, 2]], "labels": [[1]], "position_ids": [[0, 1]]})
    with pytest.raises(ValueError, match="2 rows"):
        from_flattened({"input_ids": [[1, 2], [3, 4]], "position_ids": [[0, 1], [0, 1]]})
    with pytest.raises(ValueError, match=r"cp_rank=3 must be an int in \[0, cp_size=2\)"):
        from_flattened(hf, cp_size=2, cp_rank=3)
    with pytest.raises(ValueError, match="cu_seq_lens_k ends at 3, but the row has 4 tokens"):
        from_flattened({"input_ids": [[1, 2, 3, 4]], "cu_seq_lens_k": [0, 3]})


@pytest.mark.parametrize("cp_size", [1, 2])
def test_batches_do_not_share_the_collators_row_buffers(cp_size):
    """The collator writes each row into buffers it reuses from call to call: a batch and its context hold
    copies, which the next call leaves as they were."""
    collator = PackingCollator(64, cp_size=cp_size, cp_rank=cp_size - 1, pad_token_id=0)
    first = collator([{"input_ids": list(range(1, 20))}, {"input_ids": list(range(5, 30)), "labels": [-100] * 25}])
    tensors = {k: v.clone() for k, v in first.items() if isinstance(v, torch.Tensor)}
    ctx = first["cp_context"]
    kept = (ctx.doc_ids.clone(), ctx.local_position_ids.clone(), ctx.local_index.clone())
    second = collator([{"input_ids": list(range(40, 90))}, {"input_ids": [7] * 9}])
    assert not torch.equal(second["input_ids"], first["input_ids"])
    for key, value in tensors.items():
        assert torch.equal(first[key], value), key
    for now, before in zip((ctx.doc_ids, ctx.local_position_ids, ctx.local_index), kept):
        assert torch.equal(now, before)
