"""Adding a backend is one module: a stand-in backend declared through its ``CAPABILITIES`` only is accepted by the
configuration, reported (un)available from its capabilities, and runs attention end to end."""

from __future__ import annotations

import types

import pytest
import torch

import hf_blockdiag_cp.config as config_module
import hf_blockdiag_cp.kernels as kernels
from hf_blockdiag_cp import BlockDiagCPConfig, blockdiag_attention
from hf_blockdiag_cp.kernels import Capabilities, KernelCall, KernelSpec, register_backend, unavailable_reason
from hf_blockdiag_cp.kernels.base import token_coordinates, visible
from tests.reference import dense_reference

NAME = "standin_dense"


def _standin_module(calls: list[KernelCall]) -> types.ModuleType:
    """A backend module written as a user would: NAME, CAPABILITIES, attention (dense masked softmax in float64)."""
    module = types.ModuleType("standin_dense_backend")
    module.NAME = NAME
    module.CAPABILITIES = Capabilities(NAME, "the stand-in dense backend", devices=("cpu",), sinks=False,
                                       softcap=False)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall) -> torch.Tensor:
        calls.append(call)
        q_seg, q_pos, k_seg, k_pos = token_coordinates(call)
        allowed = visible(q_seg[:, None], q_pos[:, None], k_seg[None, :], k_pos[None, :], call.window)  # [Tq, Tk]
        groups = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(groups, dim=1)
        vv = v.double().repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * call.scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1).nan_to_num(0.0)
        return torch.einsum("hqk,khd->qhd", probs, vv).to(q.dtype)

    module.attention = attention
    return module


@pytest.fixture
def registered(monkeypatch):
    calls: list[KernelCall] = []
    monkeypatch.setattr(kernels, "_BACKENDS", dict(kernels._BACKENDS))
    monkeypatch.setattr(config_module, "_REGISTERED", [])
    kernels.auto_order.cache_clear()
    register_backend(_standin_module(calls))
    yield calls
    kernels.auto_order.cache_clear()


def test_a_registered_backend_runs_attention(registered):
    torch.manual_seed(0)
    doc_ids = torch.tensor([1, 1, 1, 2, 2, 3, 3, 3, 3, 0])
    q = torch.randn(1, 4, 10, 8)
    k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    out = blockdiag_attention(q, k, v, doc_ids, backend=NAME)
    assert registered, "the stand-in backend was not called"
    torch.testing.assert_close(out.double(), dense_reference(q, k, v, doc_ids), atol=1e-6, rtol=0)
    assert BlockDiagCPConfig(backend=NAME).backend == NAME  # the configuration accepts the name


def test_a_registered_backends_availability_comes_from_its_capabilities(registered):
    plain = KernelSpec("cpu", torch.float32, 8, 8, 4, 2)
    assert unavailable_reason(NAME, plain) is None
    assert "CUDA" not in (unavailable_reason(NAME, KernelSpec("cuda", torch.float32, 8, 8, 4, 2)) or "")
    assert "not supported on cuda" in unavailable_reason(NAME, KernelSpec("cuda", torch.float32, 8, 8, 4, 2))
    assert "softcapping" in unavailable_reason(NAME, KernelSpec("cpu", torch.float32, 8, 8, 4, 2, softcap=5.0))
    assert NAME not in kernels.auto_order("cpu")[0]  # declared no "auto" rank: never picked automatically


def test_a_module_without_capabilities_is_refused():
    with pytest.raises(TypeError, match="CAPABILITIES"):
        register_backend(types.ModuleType("bare"))


def test_backends_names_every_registered_backend(registered):
    import hf_blockdiag_cp as bd

    assert bd.BACKENDS == config_module.BACKENDS == ("auto", *kernels.backend_names())
    assert NAME in bd.BACKENDS and bd.BACKENDS[:len(config_module.BUILTIN_BACKENDS)] == config_module.BUILTIN_BACKENDS
