"""Deterministic tensor-memory accounting on CPU: every tensor an ATen op creates, and when its storage dies.

CPU torch has no allocator statistics (``torch.cuda.max_memory_allocated`` has no CPU twin), tracemalloc does not
see torch's allocations, and peak RSS is noisy (glibc keeps freed pages, other threads allocate). A
``TorchDispatchMode`` sees every op, forward and backward (the autograd engine runs CPU backward on the calling
thread with the mode's state), so it can record each output storage's size and drop it when the storage's last
reference goes (a weak reference to the storage): the peak of live bytes is then exact and repeatable, and the
largest single tensor is known too. Storages that existed before the mode (parameters, inputs) are not counted.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class TensorMemory(TorchDispatchMode):
    """``with TensorMemory() as mem: ...`` -> ``mem.peak_bytes`` (live storages created inside, at their peak),
    ``mem.largest_numel`` (the most elements of any tensor an op returned), ``mem.live_bytes`` (still alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, int] = {}  # storage data pointer -> bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.largest_numel = 0
        self._refs: list[Any] = []

    def _release(self, key: int, _ref: Any = None) -> None:
        self.live_bytes -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            self.largest_numel = max(self.largest_numel, t.numel())
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self.live or storage.nbytes() == 0:
                continue  # a view or in-place result of a storage already counted
            self.live[key] = storage.nbytes()
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self._refs.append(weakref.ref(storage, lambda ref, key=key: self._release(key)))
        return out
