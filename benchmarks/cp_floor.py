"""The no-CP floor of ``bench_recurrent_layers.py --part cp --floor``: what P processes cost without CP.

Splitting a tiny model's row over P processes on a small machine costs CPU time that no CP code causes: each op's
fixed cost (dispatch, the MoE's routing, the norms) is paid per process on 1 / P of the tokens, and P processes share
the cores' caches. The floor measures it: each rank's shard, as the collator places it for CP = P, runs as a
one-process packed row (its fragments as documents, no process group), the P processes at once. A cut document's
fragments then attend only within themselves, fewer pairs than CP must compute, so the floor swaps the shard's own
attention time for an exact share of CP = 1's (:func:`floor_cpu`). :class:`AttentionClock` times the attention layers'
forward and backward (main thread CPU: the autograd engine runs a CPU backward on the calling thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import time
from typing import Any

import torch

from hf_blockdiag_cp.planning.fragments import local_fragments

__all__ = ["AttentionClock", "floor_cpu", "keep_heap", "shard_documents"]


def shard_documents(batch: dict[str, Any]) -> list[list[int]]:
    """The token ids of this rank's fragments in local order (the package's own
    :func:`~hf_blockdiag_cp.planning.fragments.local_fragments`) from a CP collator's ``batch`` of one row; padding
    dropped."""
    ctx = batch["cp_context"]
    if ctx.batch_size != 1:
        raise ValueError(f"shard_documents reads one packed row, got {ctx.batch_size}")
    tokens = batch["input_ids"][0].tolist()
    (row,) = local_fragments(ctx.doc_ids, ctx.local_index)
    return [tokens[f.start:f.start + f.length] for f in row if f.doc != 0]


class _Mark(torch.autograd.Function):
    """Identity whose backward reads the thread's CPU clock into ``clock`` (the start or the end of a layer's
    backward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: AttentionClock, start: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.clock, ctx.start = clock, start
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        ctx.clock.tick(ctx.start)
        return grad, None, None


class AttentionClock:
    """Main-thread CPU seconds spent in the model's attention layers (every decoder layer's child whose class name
    ends in ``Attention``), forward and backward, since the last :meth:`reset`."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds, self._since = 0.0, 0.0
        found = [m for layer in model.model.layers for m in layer.children() if type(m).__name__.endswith("Attention")]
        if not found:
            raise ValueError(f"{type(model).__name__} has no attention layer to time (a child of a decoder layer "
                             "whose class name ends in 'Attention')")
        for module in found:
            module.register_forward_pre_hook(self._enter, with_kwargs=True)
            module.register_forward_hook(self._leave)

    def reset(self) -> None:
        self.seconds = 0.0

    def tick(self, start: bool) -> None:
        now = time.thread_time()
        if start:
            self._since = now
        else:
            self.seconds += now - self._since

    def _enter(self, module, args, kwargs):
        self._since = time.thread_time()
        if args:  # the backward ends when the gradient leaves the layer's input
            return (_Mark.apply(args[0], self, False), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": _Mark.apply(kwargs["hidden_states"], self, False)}

    def _leave(self, module, args, out):
        self.seconds += time.thread_time() - self._since
        if isinstance(out, tuple):  # the backward starts when the gradient reaches the layer's output
            return (_Mark.apply(out[0], self, True), *out[1:])
        return _Mark.apply(out, self, True)


def floor_cpu(alone: list[tuple[float, float]], one_attention: float, world: int) -> float:
    """The floor of CP = ``world``'s busiest rank: over the shard-alone processes' ``(CPU, attention CPU)``, the most
    of ``CPU - attention CPU + one_attention / world`` (CP = 1's attention time in an exact share)."""
    return max(cpu - attention + one_attention / world for cpu, attention in alone)


def keep_heap() -> bool:
    """Fix glibc's heap trim threshold (and its mmap threshold at its 32 MiB maximum) so a process stops returning
    its heap to the kernel at the end of each step and page-faulting it back in the next; glibc otherwise moves both
    thresholds with the largest block freed lately, which differs between CP sizes. False where libc is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_trim_threshold, 2 ** 31 - 1)) and bool(mallopt(m_mmap_threshold, 32 * 2 ** 20))
