"""Each chunked op equals transformers' own torch fallback (the function the model calls) on unpacked sequences,
so a semantic mismatch (scale, l2norm, where dt_bias/softplus/clamp happen, D, the z gate, GQA) fails here."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.recurrent import ops

transformers = pytest.importorskip("transformers")
from transformers.models.bamba import modeling_bamba  # noqa: E402
from transformers.models.kimi_linear import modeling_kimi_linear  # noqa: E402
from transformers.models.lfm2 import modeling_lfm2  # noqa: E402
from transformers.models.mamba import modeling_mamba  # noqa: E402
from transformers.models.mamba2 import modeling_mamba2  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next  # noqa: E402

BATCH, LENGTH = 2, 45  # not a multiple of the chunk sizes


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _close(got, want, tol=2e-5):
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("module", [modeling_qwen3_next, modeling_bamba, modeling_mamba, modeling_lfm2])
@pytest.mark.parametrize("activation", ["silu", None])
def test_causal_conv1d_matches_transformers(module, activation):
    gen = _gen()
    channels, width = 7, 4
    x = torch.randn(BATCH, channels, LENGTH, generator=gen)  # transformers' layout: channels first
    w, b = torch.randn(channels, width, generator=gen), torch.randn(channels, generator=gen)
    want = module.causal_conv1d_fn(x, w, b, activation=activation)
    got, _ = ops.causal_conv1d(x.transpose(1, 2), w, b, activation)
    _close(got.transpose(1, 2), want)


@pytest.mark.parametrize("module", [modeling_bamba, modeling_mamba2])
@pytest.mark.parametrize("with_state", [False, True])
def test_ssd_matches_transformers_mamba2_chunk_scan(module, with_state):
    gen = _gen(1)
    heads, head_dim, groups, state = 4, 3, 2, 5
    x = torch.randn(BATCH, LENGTH, heads, head_dim, generator=gen)
    dt = torch.randn(BATCH, LENGTH, heads, generator=gen)
    A = -torch.exp(torch.randn(heads, generator=gen))
    B = torch.randn(BATCH, LENGTH, groups, state, generator=gen)
    C = torch.randn(BATCH, LENGTH, groups, state, generator=gen)
    D, dt_bias = torch.randn(heads, generator=gen), torch.randn(heads, generator=gen)
    s0 = torch.randn(BATCH, heads, head_dim, state, generator=gen) if with_state else None
    limit = (0.01, 3.0)
    want, want_final = module.mamba2_chunk_scan(x, dt, A, B, C, chunk_size=16, D=D, dt_bias=dt_bias,
                                                initial_states=s0, dt_softplus=True, dt_limit=limit,
                                                return_final_states=True)
    got, final = ops.ssd_chunk_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=limit,
                                    initial_state=s0, output_final_state=True, chunk_size=16)
    _close(got, want)
    _close(final, want_final)


@pytest.mark.parametrize("with_state", [False, True])
def test_gated_delta_rule_matches_qwen3_next(with_state):
    gen = _gen(2)
    k_heads, heads, dk, dv = 2, 4, 8, 6  # GQA as in Qwen3-Next (more value heads than key heads)
    q = torch.randn(BATCH, LENGTH, k_heads, dk, generator=gen)
    k = torch.randn(BATCH, LENGTH, k_heads, dk, generator=gen)
    v = torch.randn(BATCH, LENGTH, heads, dv, generator=gen)
    beta = torch.rand(BATCH, LENGTH, heads, generator=gen)
    g = -torch.rand(BATCH, LENGTH, heads, generator=gen) * 2
    s0 = torch.randn(BATCH, heads, dk, dv, generator=gen) if with_state else None
    want, want_final = modeling_qwen3_next.torch_chunk_gated_delta_rule(
        q, k, v, g=g, beta=beta, chunk_size=16, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    got, final = ops.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True, chunk_size=16)
    _close(got, want)
    _close(final, want_final)
    rec, rec_final = modeling_qwen3_next.torch_recurrent_gated_delta_rule(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    _close(got, rec)
    _close(final, rec_final)


@pytest.mark.parametrize("with_state", [False, True])
def test_kda_matches_kimi_linear(with_state):
    gen = _gen(3)
    heads, dk, dv = 3, 8, 8
    q = torch.randn(BATCH, LENGTH, heads, dk, generator=gen)
    k = torch.randn(BATCH, LENGTH, heads, dk, generator=gen)
    v = torch.randn(BATCH, LENGTH, heads, dv, generator=gen)
    beta = torch.rand(BATCH, LENGTH, heads, generator=gen)
    g = -torch.rand(BATCH, LENGTH, heads, dk, generator=gen) * 2
    s0 = torch.randn(BATCH, heads, dk, dv, generator=gen) if with_state else None
    want, want_final = modeling_kimi_linear.chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, chunk_size=16, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    got, final = ops.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, chunk_size=16)
    _close(got, want)
    _close(final, want_final)


def test_selective_scan_matches_mamba():
    gen = _gen(4)
    channels, state = 6, 4
    u = torch.randn(BATCH, channels, LENGTH, generator=gen)  # transformers' layout: channels first
    delta = torch.randn(BATCH, channels, LENGTH, generator=gen)
    z = torch.randn(BATCH, channels, LENGTH, generator=gen)
    A = -torch.exp(torch.randn(channels, state, generator=gen))
    B = torch.randn(BATCH, state, LENGTH, generator=gen)
    C = torch.randn(BATCH, state, LENGTH, generator=gen)
    D, bias = torch.randn(channels, generator=gen), torch.randn(channels, generator=gen)
    want, want_final = modeling_mamba.mamba_selective_scan(u, delta, A, B, C, D=D, z=z, delta_bias=bias,
                                                           delta_softplus=True, return_last_state=True)
    t = lambda x: x.transpose(1, 2)  # noqa: E731
    got, final = ops.selective_scan(t(u), t(delta), A, t(B), t(C), D, t(z), bias, True, output_final_state=True,
                                    chunk_size=16)
    _close(t(got), want)
    _close(final, want_final)


def test_transformers_fallbacks_still_refuse_packed_rows():
    """The premise of these ops: transformers' torch paths raise on cu_seqlens / seq_idx instead of resetting.
    If this starts passing through, the integration may be able to use transformers' own path."""
    x = torch.randn(1, 4, 2, 2)
    with pytest.raises(ValueError, match="packed sequences"):
        modeling_bamba.mamba2_chunk_scan(x, torch.randn(1, 4, 2), -torch.ones(2), torch.randn(1, 4, 1, 3),
                                         torch.randn(1, 4, 1, 3), chunk_size=4,
                                         seq_idx=torch.zeros(1, 4, dtype=torch.int32))
