"""Which CP rank encodes each image (video) of a row, and where its feature rows go: one all-to-all per step.

Under CP the text of a row is spread over the ranks, and an image's placeholder tokens may sit on several of them
(the balanced placement cuts long documents anywhere). Running the vision encoder on every rank would encode every
image ``P`` times; instead each image is encoded by ONE rank and its feature rows (deepstack levels side by side in
the same row) go to the ranks that hold its placeholder tokens, in one ``all_to_all_single`` (backward: the reverse
all-to-all returns the feature gradients to the encoding rank).

Notation: the row has items ``i = 0 .. n-1`` (images in row order, then videos in row order), item ``i`` fills
``rows[i]`` placeholder tokens of its kind, which are the next ``rows[i]`` placeholder positions of that kind in the
row; ``owner[p]`` is the rank holding position ``p``. Feature row ``(i, j)`` goes from ``encoder[i]`` to
``owner[position(i, j)]``.

- A rank's encode buffer: its images in row order, then its videos, each item's rows in order (what
  ``get_image_features`` / ``get_video_features`` return for the items the collator gave it).
- Sent rows are grouped by destination rank, within a group by (kind, position); so the received buffer is grouped
  by source rank, within a group by (kind, position), and ``gather[kind]`` reorders it into the rank's local
  placeholder order of that kind (ascending position: the order ``masked_scatter`` fills).

Assignment (:func:`assign_encoders`): items by decreasing encoder work (patch rows), each to the rank with the
least work so far, ties to the rank holding most of its placeholder tokens (fewer rows to send), then the lowest
rank. Pure host code on small integer arrays; the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["IMAGE", "VIDEO", "MediaTransfer", "assign_encoders", "item_keys", "plan_media", "transfer_bytes"]

IMAGE = "image"
VIDEO = "video"

#: Batch keys that belong to one image / video (split along dim 0, one entry per item, unless grid-sized).
_ITEM_KEYS: dict[str, tuple[str, ...]] = {
    IMAGE: ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask", "image_position_ids"),
    VIDEO: ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"),
}


def item_keys(kind: str) -> tuple[str, ...]:
    """The batch keys that belong to one image (``kind="image"``) or video."""
    return _ITEM_KEYS[kind]


@dataclass(frozen=True, eq=False)
class MediaTransfer:
    """One rank's share of a row's media exchange.

    Attributes:
        rank / size: this rank and the CP group size ``P``.
        kinds: the kind of every item of the row (row order per kind, images first).
        rows: feature rows of every item.
        encoder: the rank encoding every item.
        encode: the items this rank encodes, in its encode-buffer order.
        send_index: ``[n_send]`` int64 rows of the encode buffer in send order (grouped by destination).
        send_splits / recv_splits: rows sent to / received from each rank (``P`` entries each).
        gather: per kind, ``[n_local]`` int64 rows of the received buffer in local placeholder order.
        key: a hash input of the plan (every rank must plan alike).
    """

    rank: int
    size: int
    kinds: tuple[str, ...]
    rows: tuple[int, ...]
    encoder: tuple[int, ...]
    encode: tuple[int, ...]
    send_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    gather: dict[str, torch.Tensor]
    key: bytes

    @property
    def recv_rows(self) -> int:
        return sum(self.recv_splits)

    def local_rows(self, kind: str) -> int:
        g = self.gather.get(kind)
        return 0 if g is None else int(g.numel())


def assign_encoders(work: Sequence[int], holders: Sequence[np.ndarray], size: int) -> list[int]:
    """The encoding rank of each item: least work so far, then most of its placeholder tokens, then lowest rank.

    Args:
        work: encoder cost of each item (patch rows).
        holders: per item, ``[P]`` counts of its placeholder tokens on each rank.
        size: ``P``.
    """
    load = np.zeros(size, dtype=np.int64)
    encoder = [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        # lexicographic (load, -held, rank): np.lexsort sorts by the last key first
        best = int(np.lexsort((np.arange(size), -holders[i], load))[0])
        encoder[i] = best
        load[best] += work[i]
    return encoder


def plan_media(kinds: Sequence[str], rows: Sequence[int], work: Sequence[int], positions: dict[str, np.ndarray],
               owner: np.ndarray, *, rank: int, size: int) -> MediaTransfer:
    """Rank ``rank``'s :class:`MediaTransfer` for a row's items.

    Args:
        kinds / rows / work: per item (images in row order, then videos): kind, feature rows, encoder work.
        positions: per kind, the row positions of its placeholder tokens, ascending (``sum(rows)`` of that kind).
        owner: ``[S]`` the rank holding each row position (from the placement).
        rank / size: this rank and ``P``.
    """
    n = len(kinds)
    item_pos: list[np.ndarray] = []
    cursor = {k: 0 for k in positions}
    for i in range(n):
        k = kinds[i]
        pos = positions[k][cursor[k]:cursor[k] + rows[i]]
        if pos.size != rows[i]:
            raise ValueError(f"item {i} ({k}) has {rows[i]} feature rows but only {pos.size} {k} placeholder "
                             "positions are left in the row")
        cursor[k] += rows[i]
        item_pos.append(pos)
    for k, used in cursor.items():
        if used != positions[k].size:
            raise ValueError(f"the row holds {positions[k].size} {k} placeholder tokens but its {k}s fill {used}")
    holders = [np.bincount(owner[p], minlength=size) for p in item_pos]
    encoder = assign_encoders(work, holders, size)
    kind_order = {k: j for j, k in enumerate(dict.fromkeys(kinds))}
    # Every feature row: (encoder, destination, kind, position, offset in the encoder's buffer).
    offsets = np.zeros(size, dtype=np.int64)
    cols = []
    for i in range(n):  # items are in encode-buffer order per rank already (images in row order, then videos)
        e = encoder[i]
        local = offsets[e] + np.arange(rows[i], dtype=np.int64)
        offsets[e] += rows[i]
        pos = item_pos[i]
        cols.append(np.stack([np.full(rows[i], e), owner[pos], np.full(rows[i], kind_order[kinds[i]]), pos, local]))
    table = np.concatenate(cols, axis=1) if cols else np.zeros((5, 0), dtype=np.int64)
    enc, dest, kind, pos, local = table
    mine = np.flatnonzero(enc == rank)
    mine = mine[np.lexsort((pos[mine], kind[mine], dest[mine]))]
    send_index = torch.from_numpy(np.ascontiguousarray(local[mine]))
    send_splits = tuple(int(c) for c in np.bincount(dest[mine], minlength=size))
    incoming = np.flatnonzero(dest == rank)
    incoming = incoming[np.lexsort((pos[incoming], kind[incoming], enc[incoming]))]  # the received buffer's order
    recv_splits = tuple(int(c) for c in np.bincount(enc[incoming], minlength=size))
    gather = {}
    for k, j in kind_order.items():
        slots = np.flatnonzero(kind[incoming] == j)
        slots = slots[np.argsort(pos[incoming][slots], kind="stable")]
        gather[k] = torch.from_numpy(np.ascontiguousarray(slots.astype(np.int64)))
    key = np.asarray([size, *rows, *encoder, *(kind_order[k] for k in kinds)], dtype=np.int64).tobytes()
    encode = tuple(i for i in range(n) if encoder[i] == rank)
    return MediaTransfer(rank, size, tuple(kinds), tuple(rows), tuple(encoder), encode, send_index, send_splits,
                         recv_splits, gather, key)


def transfer_bytes(transfer: MediaTransfer, row_width: int, element_size: int) -> tuple[int, int]:
    """Bytes this rank sends to and receives from OTHER ranks in the forward all-to-all (rows of ``row_width``
    elements; the backward moves the same amounts the other way)."""
    r = transfer.rank
    sent = sum(n for p, n in enumerate(transfer.send_splits) if p != r)
    received = sum(n for p, n in enumerate(transfer.recv_splits) if p != r)
    return sent * row_width * element_size, received * row_width * element_size
