"""The per-rank shard checksums a context carries for the per-forward agreement (issue 17)."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp import BlockDiagCPContext
from hf_blockdiag_cp.planning.fingerprint import shard_checksum


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
    for ctx in contexts:
        assert len(ctx.shard_checksums) == 2
        for r, other in enumerate(contexts):  # every rank knows every rank's expected shard
            index = other.local_index
            assert ctx.shard_checksums[r] == (int(shard_checksum(ids[:, index])), int(shard_checksum(pos[:, index])))
    assert contexts[0].shard_checksums[0] != contexts[0].shard_checksums[1]


def test_context_without_tokens_or_positions_marks_them_unknown():
    doc_ids, _, _ = _row()
    ctx = BlockDiagCPContext.build(doc_ids, cp_rank=1, cp_size=2)
    assert ctx.shard_checksums == ((-1, -1), (-1, -1))
    assert BlockDiagCPContext.build(doc_ids).shard_checksums == ()  # one rank: no agreement


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
