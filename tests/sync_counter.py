"""Count host reads of tensor values (the calls that synchronise a GPU) inside chosen code regions."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# Methods that read tensor values on the host; on CUDA each one waits for the device.
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")


class SyncCounter:
    """``with counter.patched(): ... with counter.region(): code`` counts syncing calls in ``code``."""

    def __init__(self) -> None:
        self.active = 0
        self.calls: list[str] = []

    @contextlib.contextmanager
    def region(self) -> Iterator[None]:
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    @contextlib.contextmanager
    def patched(self) -> Iterator["SyncCounter"]:
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

        def wrap(name, original):
            def counted(tensor, *args, **kwargs):
                if self.active:
                    self.calls.append(name)
                return original(tensor, *args, **kwargs)
            return counted

        try:
            for name, original in originals.items():
                setattr(torch.Tensor, name, wrap(name, original))
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)
