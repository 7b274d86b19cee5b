"""Pure-PyTorch stand-ins for the optional kernel libraries, installed into ``sys.modules`` per test.

Usage in a test module::

    from tests.standins import standins  # noqa: F401  (the pytest fixture)

    def test_x(standins):
        out = blockdiag_attention(..., backend="flash")
        assert [c.fn for c in standins.flash.calls] == [...]

The fixture installs fresh ``flash_attn`` / ``transformer_engine(.pytorch)`` modules, clears the
package's import cache and TE module cache, and makes the ``flash`` and ``te`` adapters' availability
checks treat the (CPU, float32) call as if it were a CUDA half-precision one, so the adapters run
end to end on this machine. Everything is undone (and the caches cleared again) afterwards.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

import pytest

from hf_blockdiag_cp.kernels import flash as flash_adapter
from hf_blockdiag_cp.kernels import te as te_adapter
from hf_blockdiag_cp.kernels._imports import optional_import
from hf_blockdiag_cp.kernels.base import Capabilities

from . import flash_attn as flash_standin
from . import transformer_engine as te_standin
from .flash_attn import ContractError as FlashContractError
from .flash_attn import FlashCall
from .transformer_engine import ContractError as TEContractError
from .transformer_engine import TECall, TEConstruction

__all__ = ["FlashCall", "FlashContractError", "Standins", "TECall", "TEConstruction", "TEContractError",
           "as_if_cuda_capabilities", "clear_caches", "install", "standins"]


@dataclass
class Standins:
    """The installed stand-in modules (``None`` when not installed)."""

    flash: ModuleType | None
    te: ModuleType | None  # ``transformer_engine.pytorch``


def clear_caches() -> None:
    """Forget imported optional modules and cached TE modules (they may belong to another stand-in)."""
    optional_import.cache_clear()
    te_adapter._dot_product_attention.cache_clear()


def as_if_cuda_capabilities(caps: Capabilities) -> Capabilities:
    """An adapter's capabilities with the device/dtype gate lifted (the stand-ins accept any float dtype on any
    device); every other declared limit (import, dropout, softcap, head dims, sinks) still applies."""
    return dataclasses.replace(caps, devices=None, dtypes=None)


def install(mp: pytest.MonkeyPatch, *, flash: bool = True, te: bool = True, as_if_cuda: bool = True) -> Standins:
    """Install stand-ins with ``mp`` (undo with ``mp.undo()`` then :func:`clear_caches`)."""
    clear_caches()
    flash_module = te_module = None
    if flash:
        flash_module = flash_standin.make_module()
        mp.setitem(sys.modules, "flash_attn", flash_module)
    if te:
        package, te_module = te_standin.make_modules()
        mp.setitem(sys.modules, "transformer_engine", package)
        mp.setitem(sys.modules, "transformer_engine.pytorch", te_module)
    if as_if_cuda:
        mp.setattr(flash_adapter, "CAPABILITIES", as_if_cuda_capabilities(flash_adapter.CAPABILITIES))
        mp.setattr(te_adapter, "CAPABILITIES", as_if_cuda_capabilities(te_adapter.CAPABILITIES))
    return Standins(flash_module, te_module)


@pytest.fixture
def standins() -> Iterator[Standins]:
    """Both stand-ins installed, adapters enabled on CPU; removed again after the test."""
    with pytest.MonkeyPatch.context() as mp:
        try:
            yield install(mp)
        finally:
            mp.undo()
            clear_caches()
