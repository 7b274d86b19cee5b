"""Bidirectional blocks inside documents: "causal, or same block" (gemma3's image tokens, PaliGemma's prefix).

Notation (one packed row, global positions): query ``t`` of the document ``[s, e)`` sees the keys
``[lo(t), hi(t)]`` with ``hi(t) = t`` for a causal token and ``hi(t) = b - 1`` for a token of a bidirectional
block ``[a, b)`` of that document, and ``lo(t) = s``, or ``max(s, t - window + 1)`` in a sliding-window layer (the
window limits block keys too: transformers' ``AND(window, OR(causal, block))``). ``hi`` does not decrease, so a
document splits into *query runs*: causal runs (bottom-right causal segments, as without blocks) and block runs
(every query of the run sees the same keys ``[lo, b)``: a non-causal segment; under a window, the queries whose
``lo`` differs get segments of their own).

:class:`BlockSpans` is the host form the planners take: per batch row, the ``[start, end)`` of every block, from
the ``[B, S]`` ``block_ids`` a collator derives from the documents' ``token_type_ids`` (0 = causal token, ``k > 0``:
member of block ``k``; a block is a maximal run of one id and lies inside one document).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError

__all__ = ["BlockSpans", "block_spans"]


@dataclass(frozen=True, eq=False)
class BlockSpans:
    """The bidirectional blocks of ``B`` packed rows.

    Attributes:
        starts / ends: per batch row, ``[n_b]`` int64 numpy block starts and ends (half-open, ascending).
        reach: the largest ``end - document start`` of a block: a sliding window of at least ``reach`` keys never
            cuts a block query's keys (they start at the document start), so a plan without that window is exact.
    """

    starts: tuple[np.ndarray, ...]
    ends: tuple[np.ndarray, ...]
    reach: int = 0

    @property
    def batch_size(self) -> int:
        return len(self.starts)

    @property
    def count(self) -> int:
        return sum(int(s.size) for s in self.starts)

    @property
    def max_len(self) -> int:
        """The longest block (0 without blocks)."""
        return max((int((e - s).max()) for s, e in zip(self.starts, self.ends) if s.size), default=0)

    def row(self, b: int) -> tuple[np.ndarray, np.ndarray]:
        return self.starts[b], self.ends[b]

    def key(self) -> bytes:
        """Bytes that differ for different blocks (the plan fingerprint hashes them)."""
        h = hashlib.blake2b(digest_size=16)
        for s, e in zip(self.starts, self.ends):
            h.update(np.int64(s.size).tobytes())
            h.update(np.ascontiguousarray(s, np.int64).tobytes())
            h.update(np.ascontiguousarray(e, np.int64).tobytes())
        return h.digest()


def block_spans(block_ids: torch.Tensor, doc_ids: torch.Tensor) -> BlockSpans:
    """Validate ``block_ids [B, S]`` against ``doc_ids [B, S]`` (host) and return the blocks as spans.

    Raises ``ValueError`` naming the field and position: a shape other than ``doc_ids``', a non-integer or
    negative id, a block on padding (document id 0) or one that crosses a document boundary.
    """
    ids = torch.as_tensor(block_ids).detach()
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"block_ids must be an integer tensor (0 = causal token, k > 0 = block k), got {ids.dtype}")
    ids = ids.to("cpu", torch.int64)
    ids = ids.expand(doc_ids.shape[0], -1) if ids.dim() == 1 else ids
    if ids.shape != doc_ids.shape:
        raise ValueError(f"block_ids has shape {tuple(ids.shape)} but doc_ids has {tuple(doc_ids.shape)}; both "
                         "describe the full rows")
    if ids.numel() and int(ids.min()) < 0:
        raise ValueError(f"block_ids must be >= 0 (0 = causal token), found {int(ids.min())}")
    docs = doc_ids.to("cpu", torch.int64)
    starts, ends, reach = [], [], 0
    for b in range(ids.shape[0]):
        row, doc = ids[b].numpy(), docs[b].numpy()
        if row.size == 0:
            starts.append(np.zeros(0, np.int64))
            ends.append(np.zeros(0, np.int64))
            continue
        # A run of one block id is one block; a document boundary inside it is an error, not a cut.
        first = np.concatenate([[0], np.flatnonzero(row[1:] != row[:-1]) + 1]).astype(np.int64)
        last = np.append(first[1:], row.size).astype(np.int64)
        keep = row[first] != 0
        first, last = first[keep], last[keep]
        for a, e in zip(first.tolist(), last.tolist()):
            if doc[a] == 0:
                raise ValueError(f"block_ids[{b}] puts a block on padding at positions [{a}, {e}) (doc_ids 0): "
                                 "a block must lie inside one document")
            if (doc[a:e] != doc[a]).any():
                cross = a + int(np.flatnonzero(doc[a:e] != doc[a])[0])
                raise ValueError(f"block_ids[{b}]: the block at positions [{a}, {e}) crosses the document boundary "
                                 f"at position {cross}: a block must lie inside one document")
        if first.size:
            doc_first = np.concatenate([[0], np.flatnonzero(doc[1:] != doc[:-1]) + 1])
            doc_start = doc_first[np.searchsorted(doc_first, first, side="right") - 1]
            reach = max(reach, int((last - doc_start).max()))
        starts.append(first)
        ends.append(last)
    return BlockSpans(tuple(starts), tuple(ends), reach)


def check_block_spans(blocks: BlockSpans, batch_size: int) -> None:
    if blocks.batch_size != batch_size:
        raise PlanError(f"the blocks describe {blocks.batch_size} rows, the plan {batch_size}")
