"""Each chunked recurrent op vs its float64 token-by-token reference on packed varlen rows: outputs, final
states and gradients w.r.t. every input (initial_state included), fp32/fp64/bf16, fragments and transitions."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.recurrent import ops

from ._cases import LENS, OPS, cu_of, make_case, random_state


def _loss_weights(out: torch.Tensor, final: torch.Tensor, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out.shape, generator=gen, dtype=torch.float64),
            torch.randn(final.shape, generator=gen, dtype=torch.float64))


def _grads(run, case, s0, cu):
    out, final = run(case.inputs, case.params, s0, cu)
    w_out, w_final = _loss_weights(out, final)
    loss = (out.double() * w_out).sum() + (final.double() * w_final).sum()
    leaves = list(case.leaves().values()) + [s0]
    return out, final, torch.autograd.grad(loss, leaves)


def _run(case):
    return lambda i, p, s0, cu: case.run(i, p, s0, cu, True)


def _assert_close(name, got, want, rtol, atol_scale):
    atol = atol_scale * max(want.abs().max().item(), 1.0)
    err = (got.double() - want).abs().max().item() if got.numel() else 0.0
    assert torch.allclose(got.double(), want, rtol=rtol, atol=atol), f"{name}: max abs error {err:.3g} > {atol:.3g}"


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_outputs_states_and_gradients_match_reference(op, dtype, tol):
    total = sum(LENS)
    cu = cu_of(LENS)
    case64 = make_case(op, total).cast(torch.float64, requires_grad=True)
    s0_64 = random_state(case64, len(LENS), torch.float64).requires_grad_(True)
    ref_out, ref_final, ref_grads = _grads(case64.ref, case64, s0_64, cu)

    case = case64.cast(dtype, requires_grad=True)
    s0 = s0_64.detach().to(dtype).requires_grad_(True)
    out, final, grads = _grads(_run(case), case, s0, cu)
    assert out.dtype == dtype and out.shape == ref_out.shape
    assert final.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    _assert_close("out", out, ref_out, tol, tol)
    _assert_close("final_state", final, ref_final, tol, tol)
    for name, got, want in zip(list(case.leaves()) + ["initial_state"], grads, ref_grads):
        _assert_close(f"grad {name}", got, want, 10 * tol, 10 * tol)


@pytest.mark.parametrize("op", OPS)
def test_bf16_inputs_within_stated_tolerance(op):
    """bf16 in, fp32 state math, bf16 out: within 2e-2 of max|ref| of the fp64 reference on the same rounded inputs
    (the error is the bf16 rounding of the output, not an accumulated state error)."""
    total = sum(LENS)
    cu = cu_of(LENS)
    case = make_case(op, total).cast(torch.bfloat16)
    s0 = random_state(case, len(LENS), torch.float32)
    out, final = case.run(case.inputs, case.params, s0, cu, True)
    ref_out, ref_final = case.ref(case.inputs, case.params, s0, cu)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.float32
    _assert_close("out", out, ref_out, 2e-2, 2e-2)
    _assert_close("final_state", final, ref_final, 1e-4, 1e-4)  # the state never passes through bf16


@pytest.mark.parametrize("op", OPS)
def test_zero_initial_state_equals_none_and_sequences_reset(op):
    """No initial state means zeros; and a packed row equals each sequence run alone (the reset)."""
    total = sum(LENS)
    cu = cu_of(LENS)
    case = make_case(op, total).cast(torch.float64)
    out, final = case.run(case.inputs, case.params, None, cu, True)
    out0, final0 = case.run(case.inputs, case.params, torch.zeros(len(LENS), *case.state_shape,
                                                                  dtype=torch.float64), cu, True)
    torch.testing.assert_close(out, out0, rtol=0, atol=0)
    torch.testing.assert_close(final, final0, rtol=0, atol=0)
    start = 0
    for s, n in enumerate(LENS):
        alone, fin = case.run(case.slice_time(start, start + n), case.params, None, None, True)
        torch.testing.assert_close(out[:, start:start + n], alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final[s], fin[0], rtol=1e-10, atol=1e-10)
        start += n


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("cut", [1, 13, *(pytest.param(c, marks=pytest.mark.slow) for c in (2, 8, 23))])
def test_two_fragments_equal_the_whole_sequence(op, cut):
    """A sequence run as two fragments (the first one's final state as the second one's initial state) equals the
    sequence run whole, outputs and gradients (fragments shorter than the conv window included)."""
    total = 24
    base = make_case(op, total, seed=3).cast(torch.float64)

    def whole(case):
        out, final = case.run(case.inputs, case.params, None, None, True)
        return out, final

    def split(case):
        o1, f1 = case.run(case.slice_time(0, cut), case.params, None, None, True)
        o2, f2 = case.run(case.slice_time(cut, total), case.params, f1, None, True)
        return torch.cat([o1, o2], dim=1), f2

    results = []
    for fn in (whole, split):
        case = base.cast(torch.float64, requires_grad=True)
        out, final = fn(case)
        w_out, w_final = _loss_weights(out, final)
        grads = torch.autograd.grad((out * w_out).sum() + (final * w_final).sum(), list(case.leaves().values()))
        results.append((out, final, grads))
    (o_a, f_a, g_a), (o_b, f_b, g_b) = results
    torch.testing.assert_close(o_b, o_a, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(f_b, f_a, rtol=1e-10, atol=1e-10)
    for name, a, b in zip(base.leaves(), g_a, g_b):
        torch.testing.assert_close(b, a, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {name}: {m}")


def _transition_apply(op, case, cu, s_in):
    i, p = case.inputs, case.params
    if op == "ssd_chunk_scan":
        decay = ops.ssd_transition(i["dt"], p["A"], dt_bias=p["dt_bias"], dt_softplus=True, dt_limit=(0.001, 5.0),
                                   cu_seqlens=cu)
        return decay.exp()[..., None, None] * s_in
    if op == "selective_scan":
        decay = ops.selective_scan_transition(i["delta"], p["A"], delta_bias=p["delta_bias"], delta_softplus=True,
                                              cu_seqlens=cu)
        return decay.exp() * s_in
    fn = ops.kda_transition if op == "chunk_kda" else ops.gated_delta_rule_transition
    m = fn(i["k"], i["g"], i["beta"], cu_seqlens=cu, use_qk_l2norm_in_kernel=True, chunk_size=8)
    return m @ s_in


@pytest.mark.parametrize("op", ["ssd_chunk_scan", "chunk_gated_delta_rule", "chunk_kda", "selective_scan"])
def test_transition_composes_exactly(op):
    """S_end(S_in) == S_end(0) + Transition(S_in) per sequence, and the gradient reaches the transition's inputs."""
    cu = cu_of(LENS)
    case = make_case(op, sum(LENS)).cast(torch.float64, requires_grad=True)
    s_in = random_state(case, len(LENS), torch.float64)
    _, with_state = case.run(case.inputs, case.params, s_in, cu, True)
    _, from_zero = case.run(case.inputs, case.params, None, cu, True)
    composed = from_zero + _transition_apply(op, case, cu, s_in)
    torch.testing.assert_close(composed, with_state, rtol=1e-10, atol=1e-10)
    w = torch.randn(composed.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    leaves = [t for t in case.leaves().values()]
    g_a = torch.autograd.grad((composed * w).sum(), leaves, allow_unused=True)
    g_b = torch.autograd.grad((with_state * w).sum(), leaves, allow_unused=True)
    for name, a, b in zip(case.leaves(), g_a, g_b):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m: f"grad {name}: {m}")


def test_conv_state_of_a_short_sequence_keeps_the_incoming_window():
    """A sequence shorter than K-1: its end window is the tail of (initial_state ++ inputs), zeros when none."""
    x = torch.arange(1.0, 3.0, dtype=torch.float64).view(1, 2, 1)
    w = torch.ones(1, 4, dtype=torch.float64)
    _, final = ops.causal_conv1d(x, w, output_final_state=True)
    assert final.flatten().tolist() == [0.0, 1.0, 2.0]
    s0 = torch.tensor([[[7.0, 8.0, 9.0]]], dtype=torch.float64)
    y, final = ops.causal_conv1d(x, w, initial_state=s0, output_final_state=True)
    assert final.flatten().tolist() == [9.0, 1.0, 2.0]
    assert y.flatten().tolist() == [7 + 8 + 9 + 1.0, 8 + 9 + 1 + 2.0]


@pytest.mark.parametrize("op", OPS)
def test_host_lengths_and_batched_rows_agree_with_cu_seqlens(op):
    """seq_lens_host (no device read) gives the same result; B rows without cu_seqlens are B sequences."""
    lens = [7, 7, 7]
    case = make_case(op, sum(lens)).cast(torch.float64)
    cu = cu_of(lens)
    out, final = case.run(case.inputs, case.params, None, cu, True)
    batched = {k: v.reshape(3, 7, *v.shape[2:]) for k, v in case.inputs.items()}
    out_b, final_b = case.run(batched, case.params, None, None, True)
    torch.testing.assert_close(out_b.reshape(out.shape), out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(final_b, final, rtol=1e-12, atol=1e-12)


def test_bad_arguments_raise():
    x = torch.randn(1, 5, 3)
    w = torch.randn(3, 4)
    with pytest.raises(ValueError, match="covers 4 tokens"):
        ops.causal_conv1d(x, w, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="B == 1"):
        ops.causal_conv1d(torch.randn(2, 5, 3), w, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="activation"):
        ops.causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match="initial_state"):
        ops.causal_conv1d(x, w, initial_state=torch.zeros(1, 3, 2))
    with pytest.raises(ValueError, match="seq_lens_host"):
        ops.ssd_chunk_scan(torch.randn(1, 5, 2, 2), torch.randn(1, 5, 2), -torch.ones(2), torch.randn(1, 5, 1, 3),
                           torch.randn(1, 5, 1, 3), cu_seqlens=torch.tensor([0, 5]), seq_lens_host=[2, 3])


@pytest.mark.parametrize("op", ["chunk_gated_delta_rule", "chunk_kda", "ssd_chunk_scan", "selective_scan"])
@pytest.mark.parametrize("decay", ["none", "total"])
def test_extreme_decays_stay_exact_in_fp32(op, decay):
    """No decay at all, and decays strong enough that exp(-cumulative) would overflow fp32 within a chunk: the
    chunked forms only ever exponentiate decays between two positions of a chunk, so both stay exact."""
    cu = cu_of(LENS)
    case = make_case(op, sum(LENS)).cast(torch.float64)
    i, p = case.inputs, case.params
    if op in ("chunk_gated_delta_rule", "chunk_kda"):
        i["g"] = torch.zeros_like(i["g"]) if decay == "none" else torch.full_like(i["g"], -40.0)
    elif op == "ssd_chunk_scan":
        p["A"] = torch.full_like(p["A"], -1e-9 if decay == "none" else -60.0)
        i["dt"] = torch.full_like(i["dt"], 3.0)  # softplus(3 + bias) ~ 3, clamped to <= 5
    else:
        p["A"] = torch.full_like(p["A"], -1e-9 if decay == "none" else -60.0)
    case = case.cast(torch.float32)
    s0 = random_state(case, len(LENS), torch.float32)
    out, final = case.run(case.inputs, case.params, s0, cu, True)
    ref_out, ref_final = case.ref(case.inputs, case.params, s0, cu)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    _assert_close("out", out, ref_out, 1e-4, 1e-4)
    _assert_close("final_state", final, ref_final, 1e-4, 1e-4)
