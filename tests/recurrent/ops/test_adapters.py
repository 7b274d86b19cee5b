"""The GPU-library adapters, run on CPU against stand-ins that implement the libraries' documented contracts
(tests/recurrent/ops/standins.py): same outputs, final states and gradients as the float64 reference."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hf_blockdiag_cp.recurrent.ops import adapters

from . import standins
from ._cases import CHUNK, LENS, cu_of, make_case, random_state


@pytest.fixture
def calls(monkeypatch):
    return standins.install(monkeypatch)


def _adapter_run(op: str):
    """The adapter call matching ``_cases``' torch-op call for ``op``."""
    if op == "causal_conv1d":
        return lambda i, p, s0, cu, fs: adapters.cc_causal_conv1d(i["x"], p["weight"], p["bias"], "silu",
                                                                   initial_state=s0, output_final_state=fs,
                                                                   cu_seqlens=cu)
    if op == "ssd_chunk_scan":
        return lambda i, p, s0, cu, fs: adapters.ms_ssd_chunk_scan(
            i["x"], i["dt"], p["A"], i["B"], i["C"], D=p["D"], dt_bias=p["dt_bias"], dt_softplus=True,
            dt_limit=(0.001, 5.0), initial_state=s0, output_final_state=fs, cu_seqlens=cu, chunk_size=CHUNK)
    if op == "selective_scan":
        return lambda i, p, s0, cu, fs: adapters.ms_selective_scan(
            i["u"], i["delta"], p["A"], i["B"], i["C"], p["D"], i["z"], p["delta_bias"], True, initial_state=s0,
            output_final_state=fs, cu_seqlens=cu)
    fn = adapters.fla_chunk_kda if op == "chunk_kda" else adapters.fla_chunk_gated_delta_rule
    return lambda i, p, s0, cu, fs: fn(i["q"], i["k"], i["v"], i["g"], i["beta"], initial_state=s0,
                                       output_final_state=fs, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


def _check(op, *, with_states: bool, final_grad: bool = True):
    cu = cu_of(LENS)
    case = make_case(op, sum(LENS)).cast(torch.float32, requires_grad=True)
    s0 = random_state(case, len(LENS), torch.float32).requires_grad_(True) if with_states else None
    leaves = list(case.leaves().values()) + ([s0] if with_states else [])
    results = []
    for run in (_adapter_run(op), lambda i, p, s, c, fs: case.ref(i, p, s, c)):
        out, final = run(case.inputs, case.params, s0, cu, with_states)
        gen = torch.Generator().manual_seed(5)
        loss = (out.double() * torch.randn(out.shape, generator=gen, dtype=torch.float64)).sum()
        if with_states and final_grad:
            loss = loss + (final.double() * torch.randn(final.shape, generator=gen, dtype=torch.float64)).sum()
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
        results.append((out, final, grads))
    (out, final, grads), (r_out, r_final, r_grads) = results
    torch.testing.assert_close(out.double(), r_out, rtol=2e-5, atol=2e-5 * max(1.0, r_out.abs().max().item()))
    if with_states:
        torch.testing.assert_close(final.double(), r_final, rtol=2e-5, atol=2e-5 * r_final.abs().max().item())
    for g, r in zip(grads, r_grads):
        if r is not None:
            torch.testing.assert_close(g.double(), r.double(), rtol=1e-4, atol=1e-4 * max(1.0, r.abs().max().item()))


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "causal_conv1d", "ssd_chunk_scan"])
@pytest.mark.parametrize("with_states", [False, True])
def test_adapter_matches_reference_through_standin(calls, op, with_states):
    _check(op, with_states=with_states)
    assert calls, "the adapter did not reach the library"
    if op == "ssd_chunk_scan":  # packed row with seq_idx without states; one padded row per sequence with them
        assert calls[0] == ("mamba_chunk_scan_combined", not with_states, with_states)
    if op in ("chunk_gated_delta_rule", "chunk_kda"):
        assert calls[0][1] is True  # cu_seqlens reached fla


def test_selective_scan_adapter_without_states(calls):
    """Mamba1 through selective_scan_fn: padded batch rows, outputs and their gradients exact."""
    _check("selective_scan", with_states=False)
    assert calls == [("selective_scan_fn",)]


def test_selective_scan_adapter_final_state_has_no_gradient_and_refuses_initial_state(calls):
    cu = cu_of(LENS)
    case = make_case("selective_scan", sum(LENS)).cast(torch.float32)
    run = _adapter_run("selective_scan")
    _, final = run(case.inputs, case.params, None, cu, True)
    _, ref_final = case.ref(case.inputs, case.params, None, cu)
    torch.testing.assert_close(final.double(), ref_final, rtol=2e-5, atol=2e-5)
    with pytest.raises(NotImplementedError, match="initial state"):
        run(case.inputs, case.params, random_state(case, len(LENS), torch.float32), cu, True)


def test_unavailable_reasons_on_cpu():
    x = torch.randn(1, 4, 2, 3)
    assert "CUDA" in adapters.fla_unavailable_reason(x)
    assert "CUDA" in adapters.fla_unavailable_reason(x, kda=True)
    assert "CUDA" in adapters.ssd_unavailable_reason(x)
    assert "widths 2 to 4" in adapters.causal_conv1d_unavailable_reason(x, torch.randn(3, 5), None)
    assert "activations" in adapters.causal_conv1d_unavailable_reason(x, torch.randn(3, 4), "gelu")
    assert "CUDA" in adapters.causal_conv1d_unavailable_reason(x, torch.randn(3, 4), "silu")
    u = torch.randn(1, 4, 3)
    assert "initial state" in adapters.selective_scan_unavailable_reason(u, initial_state=torch.zeros(1, 3, 2))
    assert "gradient" in adapters.selective_scan_unavailable_reason(u, final_state_needs_grad=True)
    assert "CUDA" in adapters.selective_scan_unavailable_reason(u)
    assert "not installed" in adapters._missing("no_such_module_for_hf_blockdiag_cp", "no-such")


def test_importing_the_ops_imports_no_gpu_library():
    code = ("import sys, hf_blockdiag_cp.recurrent.ops, hf_blockdiag_cp.recurrent.ops.adapters; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('fla', 'mamba_ssm', 'causal_conv1d')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_one_table_names_every_op_on_both_paths():
    from hf_blockdiag_cp.recurrent.ops import TORCH_OPS
    assert set(adapters.LIBRARY_OPS) == set(TORCH_OPS)
    x = torch.randn(1, 4, 3)
    for op in TORCH_OPS:
        reason = adapters.library_unavailable_reason(op, x, weight=torch.randn(3, 4), activation="silu")
        assert reason and "CUDA" in reason, (op, reason)
    with pytest.raises(NotImplementedError, match="no recurrent op"):
        adapters.library_unavailable_reason("lightning", x)
