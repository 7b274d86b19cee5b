"""Argument checks both stand-ins share (the cu_seqlens contract is the same in flash-attn and TE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch


def check_cu_seqlens(name: str, cu: object, total: int, device: torch.device,
                     fail: Callable[[str], NoReturn]) -> tuple[int, ...]:
    """``cu`` as host offsets after checking it is a contiguous 1-D int32 tensor on ``device`` that
    starts at 0, never decreases and ends at ``total`` packed rows; else ``fail(message)``."""
    if not isinstance(cu, torch.Tensor):
        fail(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        fail(f"{name} must be int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 1:
        fail(f"{name} must be 1-D with >= 1 entry, got shape {tuple(cu.shape)}")
    if cu.device != device:
        fail(f"{name} lives on {cu.device}, q on {device}")
    if not cu.is_contiguous():
        fail(f"{name} must be contiguous")
    host = tuple(int(x) for x in cu.tolist())  # a stand-in may sync; the real kernels read it on device
    if host[0] != 0:
        fail(f"{name}[0]={host[0]} must be 0")
    if any(b < a for a, b in zip(host, host[1:])):
        fail(f"{name} must be non-decreasing: {list(host)}")
    if host[-1] != total:
        fail(f"{name}[-1]={host[-1]} must equal the number of packed rows {total}")
    return host
