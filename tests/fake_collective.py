"""A faked collective for logic that needs no second process (torchtitan's unit tests do the same): the
agreement's one ``all_gather`` answered in this process with the rows of imagined peers.

Peer rows are what the peer itself would send: get them by running the same call as that peer with
:func:`record_row` (the call stops at its collective and hands back its row).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

FAKE_GROUP = object()  # a stand-in process group: nothing reads it but the patched functions


class _Recorded(Exception):
    def __init__(self, row: list[int]) -> None:
        self.row = row


def fake_group(monkeypatch: pytest.MonkeyPatch, module: Any, size: int,
               gather: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """Make ``module``'s collective (``all_gather_single`` + ``wait``) call ``gather(table, row)`` in this process,
    on a gloo-like group of ``size`` ranks."""
    monkeypatch.setattr(module, "all_gather_single", lambda table, row, **kw: gather(table, row))
    monkeypatch.setattr(module, "wait", lambda *args, **kwargs: None)
    monkeypatch.setattr(module.dist, "get_world_size", lambda group=None: size)
    monkeypatch.setattr(module.dist, "get_backend", lambda group=None: "gloo")


def record_row(monkeypatch: pytest.MonkeyPatch, module: Any, size: int, call: Callable[[], Any]) -> list[int]:
    """The row ``call`` sends in ``module``'s collective (the call is stopped there)."""
    def stop(table: torch.Tensor, row: torch.Tensor) -> None:
        raise _Recorded(row.tolist())

    with monkeypatch.context() as patch:
        fake_group(patch, module, size, stop)
        try:
            call()
        except _Recorded as recorded:
            return recorded.row
    raise AssertionError("the call made no collective")


def with_peers(monkeypatch: pytest.MonkeyPatch, module: Any, rank: int, peer_rows: Sequence[list[int] | None]) -> None:
    """``module``'s collective answers with ``peer_rows`` (one per rank; ``None`` at ``rank``: this call's row)."""
    def gather(table: torch.Tensor, row: torch.Tensor) -> None:
        rows = table.view(len(peer_rows), row.numel())
        for r, peer in enumerate(peer_rows):
            rows[r] = row if r == rank else torch.tensor(peer, dtype=row.dtype)

    fake_group(monkeypatch, module, len(peer_rows), gather)
