"""Document ids: validation and conversion from the other ways documents are described.

A *document* is a maximal run of equal non-zero ids in one row; id 0 marks padding. Everything here
runs on the host, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "as_doc_ids",
    "document_spans",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_position_ids",
]


def as_doc_ids(doc_ids: torch.Tensor | Sequence[int] | Sequence[Sequence[int]], *, batch_size: int | None = None,
               length: int | None = None, name: str = "doc_ids") -> torch.Tensor:
    """Validate ``doc_ids`` and return them as a CPU ``int64`` tensor ``[B, S]``.

    Args:
        doc_ids: ``[S]`` (shared by every batch row) or ``[B, S]`` integer ids, 0 = padding.
        batch_size: expected ``B``; a 1-D input is expanded to it.
        length: expected ``S``.
        name: field name used in error messages.
    """
    if not isinstance(doc_ids, torch.Tensor):
        try:
            doc_ids = torch.as_tensor(doc_ids)
        except (TypeError, ValueError) as err:
            raise TypeError(f"{name} must be an integer tensor or nested list of ints: {err}") from err
    if doc_ids.dtype.is_floating_point or doc_ids.dtype.is_complex or doc_ids.dtype == torch.bool:
        raise TypeError(f"{name} must have an integer dtype, got {doc_ids.dtype}")
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"{name} must be [S] or [B, S], got shape {tuple(doc_ids.shape)}")
    doc_ids = doc_ids.detach().to(device="cpu", dtype=torch.int64)
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0).expand(batch_size or 1, -1)
    if batch_size is not None and doc_ids.shape[0] != batch_size:
        raise ValueError(f"{name} has batch size {doc_ids.shape[0]}, expected {batch_size}")
    if length is not None and doc_ids.shape[1] != length:
        raise ValueError(f"{name} has length {doc_ids.shape[1]}, expected S={length} (the key length)")
    if doc_ids.numel() and int(doc_ids.min()) < 0:
        raise ValueError(f"{name} must be >= 0 (0 = padding), found {int(doc_ids.min())}")
    return doc_ids


def document_spans(row: torch.Tensor) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` of every document (maximal run of one non-zero id) in ``row [S]``."""
    n = int(row.numel())
    if n == 0:
        return []
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = row[1:] != row[:-1]
    starts = torch.nonzero(change).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    keep = row[starts] != 0
    return list(zip(starts[keep].tolist(), ends[keep].tolist()))


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], length: int,
                            name: str = "cu_seq_lens") -> torch.Tensor:
    """``[length]`` ids (1, 2, ...) for the documents ``[cu[i], cu[i+1])``; rows past ``cu[-1]`` are padding."""
    cu = torch.as_tensor(cu_seqlens).detach().to("cpu", torch.int64).flatten()
    if cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {cu[:4].tolist()}")
    lens = cu[1:] - cu[:-1]
    if lens.numel() and int(lens.min()) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
    if int(cu[-1]) > length:
        raise ValueError(f"{name} ends at {int(cu[-1])}, beyond the sequence length {length}")
    ids = torch.zeros(length, dtype=torch.int64)
    ids[: int(cu[-1])] = torch.repeat_interleave(torch.arange(1, lens.numel() + 1), lens)
    return ids


def doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids from packed ``position_ids``: a new document starts wherever the position
    does not continue the previous one by exactly +1 (transformers' rule)."""
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    return torch.cumsum(starts.to(torch.int64), dim=1)
