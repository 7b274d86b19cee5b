"""The host plan of a row's image exchange (planning/media.py) against a brute-force simulation of the all-to-all:
every rank ends with the feature rows of exactly its placeholder tokens, in their order; each item is encoded once;
the assignment balances encoder work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_blockdiag_cp.planning.media import assign_encoders, plan_media, transfer_bytes


def _simulate(kinds, rows, work, positions, owner, size):
    """Run every rank's plan on tagged rows: feature row ``(item, j)`` carries the value ``1000 * item + j``."""
    plans = [plan_media(kinds, rows, work, positions, owner, rank=r, size=size) for r in range(size)]
    order = [i for k in dict.fromkeys(kinds) for i in range(len(kinds)) if kinds[i] == k]
    assert order == list(range(len(kinds))), "items must come images first, then videos"
    buffers = []
    for p in plans:
        tags = [1000 * i + j for i in p.encode for j in range(rows[i])]
        buffers.append(torch.tensor(tags, dtype=torch.int64))
    sent = [buf.index_select(0, p.send_index) for buf, p in zip(buffers, plans)]
    chunks = [list(s.split(list(p.send_splits))) for s, p in zip(sent, plans)]
    received = [torch.cat([chunks[src][dst] for src in range(size)]) for dst in range(size)]
    for r, p in enumerate(plans):
        assert received[r].numel() == p.recv_rows == sum(p.recv_splits)
        assert [int(c[r].numel()) for c in chunks] == list(p.recv_splits)
    return plans, received


def _expected(kinds, rows, positions, owner, rank, kind):
    """Tags of the placeholder tokens of ``kind`` that ``rank`` holds, in position order."""
    tags, cursor = [], 0
    for i, k in enumerate(kinds):
        if k != kind:
            continue
        for j in range(rows[i]):
            if owner[positions[kind][cursor + j]] == rank:
                tags.append((positions[kind][cursor + j], 1000 * i + j))
        cursor += rows[i]
    return [t for _, t in sorted(tags)]


@pytest.mark.parametrize("seed", range(25))
def test_every_rank_gets_its_placeholders_rows_in_order(seed):
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 6))
    length = 16 * size * int(rng.integers(2, 6))
    n_img, n_vid = int(rng.integers(0, 5)), int(rng.integers(0, 3))
    kinds = ["image"] * n_img + ["video"] * n_vid
    rows = [int(rng.integers(1, 9)) for _ in kinds]
    work = [r * int(rng.integers(1, 5)) for r in rows]
    slots = rng.permutation(length)[:sum(rows)]
    positions = {}
    cursor = 0
    for k in ("image", "video"):
        n = sum(r for r, kk in zip(rows, kinds) if kk == k)
        if n:
            positions[k] = np.sort(slots[cursor:cursor + n])
            cursor += n
    owner = rng.permutation(np.repeat(np.arange(size), length // size))
    plans, received = _simulate(kinds, rows, work, positions, owner, size)
    encoded = sorted(i for p in plans for i in p.encode)
    assert encoded == list(range(len(kinds))), "each item is encoded by exactly one rank"
    for r, p in enumerate(plans):
        for k in positions:
            got = received[r].index_select(0, p.gather[k]).tolist()
            assert got == _expected(kinds, rows, positions, owner, r, k), (seed, r, k)
        sent_bytes, recv_bytes = transfer_bytes(p, 8, 4)
        off_sent = sum(rows[i] for i in p.encode) - p.send_splits[r]
        assert sent_bytes == off_sent * 32
        assert recv_bytes == (p.recv_rows - p.recv_splits[r]) * 32
        assert p.key == plans[0].key


def test_assignment_balances_work_then_prefers_the_holder():
    holders = [np.array([0, 5]), np.array([5, 0]), np.array([1, 1])]
    # equal work: the first item goes to the rank holding it, the second to the other (least load)
    assert assign_encoders([10, 10, 1], holders, 2)[:2] == [1, 0]
    # one large image and many small ones: the large one alone on one rank
    enc = assign_encoders([100, 10, 10, 10, 10], [np.array([1, 1])] * 5, 2)
    assert enc[0] not in enc[1:]


def test_mismatched_rows_are_refused():
    with pytest.raises(ValueError, match="placeholder"):
        plan_media(["image"], [5], [5], {"image": np.arange(4)}, np.zeros(8, dtype=np.int64), rank=0, size=1)
    with pytest.raises(ValueError, match="fill"):
        plan_media(["image"], [3], [3], {"image": np.arange(4)}, np.zeros(8, dtype=np.int64), rank=0, size=1)
