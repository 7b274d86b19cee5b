"""The shard checksums a context carries for the per-forward agreement (issue 17), and the data fingerprint
the ranks compare (issue 25: computed on document runs and a weighted token sum, not by hashing every byte)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp import BlockDiagCPContext
from hf_blockdiag_cp.planning.fingerprint import data_fingerprint, shard_checksum


def _row():
    lengths = [5, 20, 3, 12, 8]
    doc_ids = torch.repeat_interleave(torch.arange(1, 6), torch.tensor(lengths))
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return doc_ids, ids, pos


@pytest.mark.parametrize("placement", ["contiguous", "zigzag", "balanced"])
def test_context_checksums_are_those_of_each_ranks_shard(placement):
    doc_ids, ids, pos = _row()
    contexts = [BlockDiagCPContext.build(doc_ids, cp_rank=r, cp_size=2, placement=placement, input_ids=ids,
                                         position_ids=pos) for r in range(2)]
    for ctx in contexts:  # each rank knows its own expected shard (a gather of its L positions)
        index = ctx.local_index
        assert ctx.shard_checksum == (int(shard_checksum(ids[:, index])), int(shard_checksum(pos[:, index])))
    assert contexts[0].shard_checksum != contexts[1].shard_checksum


def test_context_without_tokens_or_positions_marks_them_unknown():
    doc_ids, _, _ = _row()
    ctx = BlockDiagCPContext.build(doc_ids, cp_rank=1, cp_size=2)
    assert ctx.shard_checksum == (-1, -1)
    assert BlockDiagCPContext.build(doc_ids).shard_checksum == ()  # one rank: no agreement


def test_checksum_sees_one_edit_a_swap_a_shift_and_a_shape():
    _, ids, pos = _row()
    base = int(shard_checksum(ids))
    edited = ids.clone()
    edited[0, 3] += 1
    swapped = ids.clone()
    swapped[0, [3, 4]] = ids[0, [4, 3]]
    assert ids[0, 3] != ids[0, 4]
    assert len({base, int(shard_checksum(edited)), int(shard_checksum(swapped)), int(shard_checksum(ids[:, :-1]))}) == 4
    assert int(shard_checksum(pos + 7)) != int(shard_checksum(pos))
    assert base >= 0 and int(shard_checksum(ids.view(-1))) == base  # flattened rows in order


def test_data_fingerprint_tells_rows_apart():
    doc_ids, ids, _ = _row()
    doc_ids = doc_ids[None].to(torch.int32)
    base = data_fingerprint(doc_ids, ids)
    assert base == data_fingerprint(doc_ids.clone(), ids.clone())  # a pure function of the values
    moved = doc_ids.clone()
    moved[0, 5] = 1  # the first document one token longer, the second one shorter
    renamed = doc_ids.clone()
    renamed[0, doc_ids[0] == 3] = 9
    padded = doc_ids.clone()
    padded[0, -1] = 0
    edited = ids.clone()
    edited[0, 7] += 1
    swapped = ids.clone()
    swapped[0, [3, 4]] = ids[0, [4, 3]]
    assert ids[0, 3] != ids[0, 4]
    two_rows = torch.cat([doc_ids[:, :24], doc_ids[:, 24:]])  # the same values cut into two batch rows
    prints = [base, data_fingerprint(moved, ids), data_fingerprint(renamed, ids), data_fingerprint(padded, ids),
              data_fingerprint(doc_ids, edited), data_fingerprint(doc_ids, swapped), data_fingerprint(doc_ids),
              data_fingerprint(two_rows, ids.view(2, 24))]
    assert len(set(prints)) == len(prints)
    assert all(0 <= p < 2**62 for p in prints)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=1, max_size=8), st.integers(0, 2**30 - 1), st.data())
def test_data_fingerprint_sees_every_single_token_change(lengths, vocab, data):
    doc_ids = torch.repeat_interleave(torch.arange(1, len(lengths) + 1, dtype=torch.int32), torch.tensor(lengths))[None]
    ids = torch.randint(0, vocab + 1, doc_ids.shape, generator=torch.Generator().manual_seed(vocab))
    pos = data.draw(st.integers(0, doc_ids.numel() - 1))
    new = data.draw(st.integers(0, 2**30 - 1).filter(lambda v: v != int(ids[0, pos])))
    changed = ids.clone()
    changed[0, pos] = new
    assert data_fingerprint(doc_ids, ids) != data_fingerprint(doc_ids, changed)
