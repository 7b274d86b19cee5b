"""Sequence bookkeeping shared by the chunked recurrent ops.

Legend: ``T`` packed tokens, ``N`` sequences, ``L`` chunk size, ``C`` chunks (each sequence is cut into
``ceil(len / L)`` chunks that never straddle a sequence start; the last one is padded with zero rows).

Chunks are stored *step-major*: all first chunks (sequences sorted by chunk count, longest first), then all
second chunks, ... so that step ``j`` of the inter-chunk scan is the contiguous slice
``[step_offsets[j], step_offsets[j] + n_active[j])`` and its rows are sorted sequences ``0 .. n_active[j] - 1``.
The scan then carries one state per sorted sequence and never loops over tokens or sequences in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def seq_lens_of(cu_seqlens: torch.Tensor | None, seq_lens_host: list[int] | None, batch: int,
                length: int) -> list[int]:
    """Host sequence lengths for an op's ``[B, T, ...]`` input.

    Without ``cu_seqlens`` every row is one sequence of ``length``. With it, ``B`` must be 1 and the lengths come
    from ``seq_lens_host`` when given (no device sync), else from ``cu_seqlens.tolist()`` (one sync).
    """
    if cu_seqlens is None:
        if seq_lens_host is not None:
            raise ValueError("seq_lens_host was given without cu_seqlens; pass both or neither")
        return [length] * batch
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of one row (B == 1), got B={batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be 1-D with >= 2 entries, got shape {tuple(cu_seqlens.shape)}")
    if seq_lens_host is None:
        cu = [int(c) for c in cu_seqlens.tolist()]  # one host sync; callers with host lengths avoid it
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {cu[0]}")
        lens = [b - a for a, b in zip(cu, cu[1:])]
    else:
        lens = [int(n) for n in seq_lens_host]
        if len(lens) != cu_seqlens.numel() - 1:
            raise ValueError(f"seq_lens_host has {len(lens)} entries, cu_seqlens describes {cu_seqlens.numel() - 1}")
    if any(n < 0 for n in lens):
        raise ValueError(f"cu_seqlens must be non-decreasing, lengths {lens}")
    if sum(lens) != length:
        raise ValueError(f"cu_seqlens covers {sum(lens)} tokens but the input has T={length}")
    return lens


@dataclass(frozen=True)
class ChunkLayout:
    """Where each token sits in the step-major chunk layout (see the module docstring).

    gather_idx: [C * L] row of the packed input for each chunk slot (``T`` = the zero padding row).
    scatter_idx: [T] slot of each packed token in the flattened ``[C * L]`` chunk layout.
    order: [N] original index of each sorted sequence; inverse_order: [N] its inverse.
    n_active[j]: sequences that have a chunk at step j; step_offsets[j]: first chunk row of step j.
    """

    seq_lens: tuple[int, ...]
    chunk_size: int
    n_chunks: int
    n_active: tuple[int, ...]
    step_offsets: tuple[int, ...]
    gather_idx: torch.Tensor
    scatter_idx: torch.Tensor
    order: torch.Tensor
    inverse_order: torch.Tensor

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    def to_chunks(self, x_TF: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [C, L, ...] with zero rows in the padding slots (differentiable)."""
        padded = torch.cat([x_TF, x_TF.new_zeros((1,) + tuple(x_TF.shape[1:]))], dim=0)
        out = padded.index_select(0, self.gather_idx)
        return out.view((self.n_chunks, self.chunk_size) + tuple(x_TF.shape[1:]))

    def from_chunks(self, x_CLF: torch.Tensor) -> torch.Tensor:
        """[C, L, ...] -> [T, ...] (padding slots dropped)."""
        flat = x_CLF.reshape((self.n_chunks * self.chunk_size,) + tuple(x_CLF.shape[2:]))
        return flat.index_select(0, self.scatter_idx)

    def steps(self, x_C: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[C, ...] -> per step j its rows ``[n_active[j], ...]``: one ``split`` (whose backward is one ``cat``), not
        a slice per step (each slice's backward would write a full-size zero gradient: quadratic in the steps)."""
        return x_C.split(list(self.n_active), dim=0)

    def finished_after(self, step: int) -> tuple[int, int]:
        """Sorted sequences ``[lo, hi)`` whose last chunk is step ``step`` (step -1: empty sequences)."""
        hi = self.num_seqs if step < 0 else self.n_active[step]
        lo = self.n_active[step + 1] if step + 1 < len(self.n_active) else 0
        return lo, hi


def chunk_layout(seq_lens: list[int], chunk_size: int, device: torch.device) -> ChunkLayout:
    """Build the step-major layout on the host (O(C) Python work) and move its index tensors to ``device``."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    total = sum(seq_lens)
    counts = [-(-n // chunk_size) for n in seq_lens]
    order = sorted(range(len(seq_lens)), key=lambda s: -counts[s])  # stable: ties keep document order
    max_steps = counts[order[0]] if order else 0
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    n_active, step_offsets = [], []
    gather = torch.full((sum(counts), chunk_size), total, dtype=torch.long)
    scatter = torch.empty(total, dtype=torch.long)
    row = 0
    for j in range(max_steps):
        active = sum(1 for s in order if counts[s] > j)
        n_active.append(active)
        step_offsets.append(row)
        for s in order[:active]:
            lo = starts[s] + j * chunk_size
            n = min(chunk_size, starts[s + 1] - lo)
            gather[row, :n] = torch.arange(lo, lo + n)
            scatter[lo:lo + n] = torch.arange(row * chunk_size, row * chunk_size + n)
            row += 1
    order_t = torch.tensor(order, dtype=torch.long)
    inverse = torch.empty_like(order_t)
    inverse[order_t] = torch.arange(len(order), dtype=torch.long)
    return ChunkLayout(
        seq_lens=tuple(seq_lens), chunk_size=chunk_size, n_chunks=row, n_active=tuple(n_active),
        step_offsets=tuple(step_offsets), gather_idx=gather.view(-1).to(device), scatter_idx=scatter.to(device),
        order=order_t.to(device), inverse_order=inverse.to(device),
    )


def segment_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Per sequence of ``cu_seqlens`` (``N + 1`` offsets), the sum of its rows of ``values [T, ...]``: ``[N, ...]``.

    Summed per segment (device-side, no host lengths), not as differences of one running sum over the row: a
    non-finite value then stays in its own sequence's sum."""
    cu = cu_seqlens.long()
    segment = torch.searchsorted(cu[1:], torch.arange(values.shape[0], device=values.device), right=True)
    return values.new_zeros(cu.numel() - 1, *values.shape[1:]).index_add(0, segment, values)


def initial_states(given: torch.Tensor | None, shape: tuple[int, ...], like: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
    """``given`` (one state per sequence, ``shape``) in ``dtype``, zeros like ``like`` when ``None``."""
    if given is None:
        return like.new_zeros(shape)
    if tuple(given.shape) != tuple(shape):
        raise ValueError(f"initial_state must be {list(shape)} (one state per sequence), got {tuple(given.shape)}")
    return given.to(dtype)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 for half/fp32 inputs, fp64 when any input is fp64 (the tests' exact-gradient path)."""
    dtype = torch.float32
    for t in tensors:
        if t is not None and t.is_floating_point():
            dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def scan_states(layout: ChunkLayout, state0_sorted: torch.Tensor, step_fn) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run the inter-chunk recurrence over the steps.

    state0_sorted: [N, ...] initial states in sorted order. ``step_fn(j, rows: slice, state [n_j, ...])`` returns the
    state after chunk step j for the active sequences. Returns (the state *entering* each step, as a list of
    [n_j, ...] tensors in step order = chunk-row order, final states [N, ...] in the ORIGINAL sequence order).
    """
    finals: list[torch.Tensor | None] = [None] * (len(layout.n_active) + 1)
    lo, hi = layout.finished_after(-1)
    finals[-1] = state0_sorted[lo:hi]
    state = state0_sorted[:layout.n_active[0]] if layout.n_active else state0_sorted[:0]
    entering = []
    for j, n in enumerate(layout.n_active):
        state = state[:n]
        entering.append(state)
        off = layout.step_offsets[j]
        state = step_fn(j, slice(off, off + n), state)
        lo, hi = layout.finished_after(j)
        finals[j] = state[lo:hi]
    # finished pieces, in sorted order: the longest sequences finish last, so read the steps backwards
    pieces = [finals[j] for j in range(len(layout.n_active) - 1, -1, -1)] + [finals[-1]]
    final_sorted = torch.cat(pieces, dim=0)
    return entering, final_sorted.index_select(0, layout.inverse_order)
