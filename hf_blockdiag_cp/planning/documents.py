"""Document ids: validation and conversion from the other ways documents are described.

A *document* is a maximal run of equal non-zero ids in one row; id 0 marks padding. Every way of
finding runs goes through :func:`run_boundaries` / :func:`run_starts`, and every ``cu_seqlens``
through :func:`check_cu_seqlens`. Everything here runs on the host, once per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

__all__ = [
    "arange",
    "as_doc_ids",
    "check_cu_seqlens",
    "doc_ids_from_cu_seqlens",
    "doc_ids_from_flattening",
    "doc_ids_from_position_ids",
    "document_runs",
    "document_spans",
    "run_boundaries",
    "run_starts",
]


def arange(start: int, end: int | None = None, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.arange(start, end)`` as int64, made by numpy on the host: torch's int64 CPU ``arange`` is not
    vectorised (measured on torch 2.13: 7-16 ms for 1M positions, numpy's 0.5 ms), and host plans make
    several row-long ones per step. Elsewhere (``device`` not the CPU) torch's own."""
    if device is not None and torch.device(device).type != "cpu":
        return torch.arange(start, end, device=device) if end is not None else torch.arange(start, device=device)
    values = np.arange(start, dtype=np.int64) if end is None else np.arange(start, end, dtype=np.int64)
    return torch.from_numpy(values)


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
    # int64 wraps uint64 ids >= 2**63 to negatives: the message below undoes that, to quote them as given.
    wrapped = doc_ids.dtype == torch.uint64
    doc_ids = doc_ids.detach().to(device="cpu", dtype=torch.int64)
    if doc_ids.dim() == 1:
        doc_ids = doc_ids.unsqueeze(0).expand(batch_size or 1, -1)
    if batch_size is not None and doc_ids.shape[0] != batch_size:
        raise ValueError(f"{name} has batch size {doc_ids.shape[0]}, expected {batch_size}")
    if length is not None and doc_ids.shape[1] != length:
        raise ValueError(f"{name} has length {doc_ids.shape[1]}, expected S={length} (the key length)")
    if doc_ids.numel() and int(doc_ids.min()) < 0:
        if wrapped:
            raise ValueError(f"{name} must be < 2**63 (int64), found {int(doc_ids.min()) + 2 ** 64}")
        raise ValueError(f"{name} must be >= 0 (0 = padding), found {int(doc_ids.min())}")
    return doc_ids


def run_boundaries(ids: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` bool, True where a run of equal values of ``ids [..., S]`` begins (always at 0)."""
    out = torch.ones_like(ids, dtype=torch.bool)
    out[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return out


def run_starts(ids: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` int64: for every position of ``ids [..., S]``, the first position of its run of equal values."""
    index = arange(ids.shape[-1], device=ids.device).expand_as(ids)
    # Each boundary carries its own index and everything else 0; the running max is then the last
    # boundary at or before each position.
    return torch.cummax(torch.where(run_boundaries(ids), index, 0), dim=-1).values


def _number_runs(values: torch.Tensor) -> torch.Tensor:
    """``[..., S]`` int64 ids 1, 2, ... numbering the runs of equal ``values`` along the last dim."""
    return torch.cumsum(run_boundaries(values).to(torch.int64), dim=-1)


def document_runs(row: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """``(start [D], end [D])`` int64 numpy: the half-open runs of the documents (maximal runs of one non-zero id)
    of ``row [S]``, in row order. One pass over the row: a context computes them once per step and hands them to
    the placement, the exchange and the varlen planners (``documents=``), which otherwise each scan the row."""
    ids = row.detach().reshape(-1).cpu().numpy()
    if ids.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    # The positions where the id changes start the runs.
    starts = np.concatenate([[0], np.flatnonzero(ids[1:] != ids[:-1]) + 1]).astype(np.int64)
    ends = np.append(starts[1:], ids.size).astype(np.int64)
    keep = ids[starts] != 0
    return starts[keep], ends[keep]


def document_spans(row: torch.Tensor, documents: tuple[np.ndarray, np.ndarray] | None = None
                   ) -> list[tuple[int, int]]:
    """Half-open ``(start, end)`` of every document (maximal run of one non-zero id) in ``row [S]`` (from
    ``documents``, the row's :func:`document_runs`, when given)."""
    start, end = document_runs(row) if documents is None else documents
    return list(zip(start.tolist(), end.tolist()))


def check_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], bound: int, *, name: str = "cu_seq_lens",
                     exact: bool = False) -> torch.Tensor:
    """Validate cumulative sequence lengths and return them as a CPU int64 tensor ``[N + 1]``.

    Args:
        cu_seqlens: ``[N + 1]`` (or ``[1, N + 1]``) integers: document ``i`` is rows ``[cu[i], cu[i + 1])``.
        bound: the row length; ``cu[-1]`` must be ``<= bound`` (rows past it are padding).
        name: the field quoted in errors (``cu_seq_lens_q``, ``cu_seq_lens_k``, ...).
        exact: require ``cu[-1] == bound`` (a flattened batch has no padding).

    Raises:
        ValueError: naming ``name``, unless the values are integers, start at 0 and never decrease,
            and end within (or, with ``exact``, at) ``bound``.
    """
    try:
        cu = cu_seqlens.detach() if isinstance(cu_seqlens, torch.Tensor) else torch.as_tensor(cu_seqlens)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name} must be a 1-D sequence of ints: {err}") from err
    if cu.dim() == 2 and cu.shape[0] == 1:
        cu = cu[0]
    if cu.dim() != 1:
        raise ValueError(f"{name} must be 1-D [N + 1], got shape {tuple(cu.shape)}")
    if cu.numel() == 0:
        raise ValueError(f"{name} is empty; it must start at 0")
    if cu.dtype == torch.bool or cu.dtype.is_floating_point or cu.dtype.is_complex:
        raise ValueError(f"{name} must hold integers, got dtype {cu.dtype}")
    cu = cu.to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {cu[:4].tolist()}")
    decreasing = torch.nonzero(cu[1:] < cu[:-1]).flatten()
    if decreasing.numel():
        i = int(decreasing[0]) + 1
        raise ValueError(f"{name} must be non-decreasing, but {name}[{i}]={int(cu[i])} < {name}[{i - 1}]="
                         f"{int(cu[i - 1])}")
    end = int(cu[-1])
    if end > bound:
        raise ValueError(f"{name} ends at {end}, beyond the sequence length {bound}")
    if exact and end != bound:
        raise ValueError(f"{name} ends at {end}, but the row has {bound} tokens")
    return cu


def doc_ids_from_cu_seqlens(cu_seqlens: torch.Tensor | Sequence[int], length: int,
                            name: str = "cu_seq_lens") -> torch.Tensor:
    """``[length]`` ids (1, 2, ...) for the documents ``[cu[i], cu[i+1])``; rows past ``cu[-1]`` are padding.

    ``cu_seqlens`` is validated by :func:`check_cu_seqlens` (``bound=length``).
    """
    cu = check_cu_seqlens(cu_seqlens, length, name=name)
    ids = torch.zeros(length, dtype=torch.int64)
    lens = cu[1:] - cu[:-1]
    ids[: int(cu[-1])] = torch.repeat_interleave(arange(1, lens.numel() + 1), lens)
    return ids


def doc_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """``[B, S]`` ids from packed ``position_ids`` ``[B, S]`` (or ``[S]``): a new document starts
    wherever the position does not continue the previous one by exactly +1 (transformers' rule)."""
    pos = position_ids.detach().to("cpu", torch.int64)
    if pos.dim() == 1:
        pos = pos.unsqueeze(0)
    if pos.dim() != 2:
        raise ValueError(f"position_ids must be [B, S], got shape {tuple(position_ids.shape)}")
    # pos[t] - t stays constant exactly while the position grows by +1, so its runs are the documents.
    return _number_runs(pos - arange(pos.shape[1]))


def doc_ids_from_flattening(length: int, *, cu_seq_lens_q: torch.Tensor | Sequence[int] | None = None,
                            cu_seq_lens_k: torch.Tensor | Sequence[int] | None = None,
                            seq_idx: torch.Tensor | Sequence[int] | None = None,
                            position_ids: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
    """``[length]`` ids 1, 2, ... of one flattened row from ``DataCollatorWithFlattening``'s keywords.

    The first given of: ``cu_seq_lens_k`` / ``cu_seq_lens_q`` (equal when both are given; they must
    end exactly at ``length``), ``seq_idx [length]`` (a new document wherever it changes),
    ``position_ids [length]`` (a new document wherever the position does not continue by +1).

    Raises:
        ValueError: naming the field, when none is given or a given one is malformed (every given
            field is checked, also those not used).
    """
    rows = {}
    for name, value in (("seq_idx", seq_idx), ("position_ids", position_ids)):
        if value is not None:
            rows[name] = value.detach().to("cpu") if isinstance(value, torch.Tensor) else torch.as_tensor(value)
            if rows[name].shape != (length,):
                raise ValueError(f"{name} has shape {tuple(rows[name].shape)}, expected [{length}] (the flattened row)")
    cu_k = None if cu_seq_lens_k is None else check_cu_seqlens(cu_seq_lens_k, length, name="cu_seq_lens_k",
                                                               exact=True)
    cu_q = None if cu_seq_lens_q is None else check_cu_seqlens(cu_seq_lens_q, length, name="cu_seq_lens_q",
                                                               exact=True)
    if cu_k is not None and cu_q is not None and not torch.equal(cu_k, cu_q):
        raise ValueError(f"cu_seq_lens_q={cu_q[:8].tolist()} and cu_seq_lens_k={cu_k[:8].tolist()} differ; a "
                         f"flattened row has one set of documents for queries and keys")
    cu = cu_k if cu_k is not None else cu_q
    if cu is not None:
        return doc_ids_from_cu_seqlens(cu, length)
    if "seq_idx" in rows:
        return _number_runs(rows["seq_idx"].to(torch.int64))
    if "position_ids" in rows:
        return doc_ids_from_position_ids(rows["position_ids"])[0]
    raise ValueError("needs cu_seq_lens_k, seq_idx or position_ids to find the document boundaries")
