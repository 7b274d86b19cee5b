"""Map-style passes that do not divide over the DP groups (issue 35, item 6), on one process: the rows
``DistributedSampler`` repeats are found exactly, reach the collator without targets, and set-ups where that cannot
be done are refused naming the fixes. The trajectory at dp = 2 is in test_one_data_path.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.utils.data import DistributedSampler

import hf_blockdiag_cp as bd
from hf_blockdiag_cp.errors import Refusal
from hf_blockdiag_cp.training.data import MarkedSampler, PaddingWithoutTargets, shard_loader, without_targets


@pytest.mark.parametrize("shuffle", [False, True])
def test_marked_sampler_is_distributed_sampler_with_its_repeats_marked(shuffle):
    for rows in range(1, 10):
        for dp in (2, 3, 4):
            data = list(range(rows))
            kept: list[int] = []
            for rank in range(dp):
                plain = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=shuffle, seed=5, drop_last=False)
                marked = MarkedSampler(data, num_replicas=dp, rank=rank, shuffle=shuffle, seed=5)
                for sampler in (plain, marked):
                    sampler.set_epoch(3)
                pairs = list(marked)
                assert [index for index, _ in pairs] == list(plain), (rows, dp, rank)
                kept += [index for index, repeated in pairs if not repeated]
            # Every row of the pass exactly once outside the repeats, whatever the split.
            assert sorted(kept) == data, (rows, dp, kept)


def test_repeats_reach_the_collator_without_targets():
    collator = bd.PackingCollator(32, pad_token_id=0)
    examples = [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": torch.tensor([6, 7, 8])}, {"input_ids": [9, 10]}]
    loader = shard_loader(examples, 1, 2, collate_fn=collator, batch_size=1, drop_last=False)
    batches = list(loader)  # rank 1 of 2: row 1, then the repeat of row 0
    assert [b["num_items_in_batch"] for b in batches] == [2, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a micro-batch of repeats only has no targets on purpose: no warning
        PaddingWithoutTargets(collator)([loader.dataset[(0, True)]])
    row = without_targets(next(iter(bd.PackedDataset(examples, 32))))
    assert all(bool((doc.labels == -100).all()) for doc in row.documents)
    # With drop_last nothing is repeated: the plain DistributedSampler.
    assert type(shard_loader(examples, 1, 2, collate_fn=collator, drop_last=True).sampler) is DistributedSampler


def test_repeats_that_cannot_lose_their_targets_are_refused():
    examples = [{"input_ids": [1, 2, 3]}] * 3
    with pytest.raises(Refusal, match="dataloader_drop_last=True") as err:
        shard_loader(examples, 0, 2, collate_fn=lambda rows: rows, drop_last=False)
    assert "dp_size=2" in str(err.value) and "PackingCollator" in str(err.value)
    with pytest.raises(Refusal, match="PackedDataset"):  # examples the package cannot read
        shard_loader([[1, 2, 3]] * 3, 0, 2, collate_fn=bd.PackingCollator(32, pad_token_id=0), drop_last=False)
    # Evaluation keeps the repeats (documented): no refusal there.
    shard_loader(examples, 0, 2, collate_fn=lambda rows: rows, drop_last=False, repeats_without_targets=False)
