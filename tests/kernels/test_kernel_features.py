"""Kernel features beyond plain causal attention: a value head dim != the query/key head dim (MLA),
logit softcapping (gemma2) and attention sinks (gpt-oss ``s_aux``), alone and combined with GQA,
sliding windows, straddling prefix segments and padding rows.

Every numeric check compares outputs and q/k/v (and sinks) gradients against the float64 brute-force
:func:`tests.reference.dense_reference`; one check per feature runs each document alone through
transformers' own eager attention instead. The availability checks read what each backend reports.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from hf_blockdiag_cp import blockdiag_attention
from hf_blockdiag_cp.kernels import (
    BackendUnavailable,
    KernelCall,
    KernelSpec,
    _chunked,
    available_backends,
    choose_backend,
    get_backend,
    torch_varlen,
    unavailable_reason,
)
from hf_blockdiag_cp.planning import build_varlen_plan
from tests.layouts import runs as _runs
from tests.reference import dense_reference
from tests.standins import standins  # noqa: F401 (fixture)

# name -> (doc_ids [S] or [B][S], row_offset, L). Query rows are global positions [row_offset, row_offset + L).
LAYOUTS: dict[str, tuple[list, int, int]] = {
    # doc 1 starts 20 keys before the local rows: a prefix segment, then two square ones
    "straddle_then_docs": (_runs((1, 30), (2, 9), (3, 1), (4, 8)), 20, 28),
    # the only local document started long before: one prefix segment, nothing else
    "straddle_only": ([5] * 48, 36, 12),
    "docs_and_padding": (_runs((1, 3), (2, 14), (3, 1), (4, 12), (0, 10)), 0, 40),
    "b2_straddle_and_padding_rows": ([_runs((1, 18), (2, 7), (0, 7)), _runs((3, 5), (4, 21), (5, 6))], 12, 20),
    "b2_one_row_all_padding": ([_runs((1, 10), (2, 14)), [0] * 24], 0, 24),
}
STRADDLING = ["straddle_then_docs", "straddle_only", "b2_straddle_and_padding_rows"]


def _inputs(layout: str, *, heads: tuple[int, int] = (8, 2), dim: int = 32, dim_v: int | None = None,
            dtype: torch.dtype = torch.float32, sinks: bool = False, seed: int = 0):
    """``q [B,Hq,L,D]``, ``k [B,Hkv,S,D]``, ``v [B,Hkv,S,Dv]`` (transposed views, as transformers passes
    them), ``sinks [Hq]`` or None (all requiring grad), ids, offset."""
    doc, offset, local_len = LAYOUTS[layout]
    ids = torch.tensor(doc)
    batch = ids.shape[0] if ids.dim() == 2 else 1
    full_len = ids.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, local_len, heads[0], dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, full_len, heads[1], dim, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(batch, full_len, heads[1], dim_v or dim, generator=gen).to(dtype).transpose(1, 2)
    # Sinks of the size of typical scores, so that they move the result (checked in _check).
    # A float32 parameter, as in a bf16 model under autocast (float64 with float64 activations).
    sink_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    s = (1.5 * torch.randn(heads[0], generator=gen)).to(sink_dtype).requires_grad_() if sinks else None
    return [t.requires_grad_() for t in (q, k, v)], s, ids, offset


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, seq, D]`` -> ``[B*seq, H, D]``."""
    return x.transpose(1, 2).reshape(x.shape[0] * x.shape[2], x.shape[1], x.shape[3])


def _attend(backend: str, q, k, v, ids, offset, *, window=None, softcap=None, sinks=None, dropout_p=0.0):
    """The kernel alone: plan, pack the real rows, one ``attention`` call, scatter back to ``[B,Hq,L,Dv]``."""
    batch, num_q_heads, local_len, dim = q.shape
    dim_v = v.shape[-1]
    plan = build_varlen_plan(ids, local_len=local_len, row_offset=offset)
    qf, kf, vf = _flat(q), _flat(k), _flat(v)
    q_rows = torch.arange(plan.total_q) if plan.q_index is None else plan.q_index
    k_rows = torch.arange(plan.k_offset, plan.k_offset + plan.total_k) if plan.k_index is None else plan.k_index
    call = KernelCall(plan=plan, scale=dim ** -0.5, dropout_p=dropout_p, window=window, softcap=softcap, sinks=sinks)
    out = get_backend(backend).attention(qf.index_select(0, q_rows), kf.index_select(0, k_rows),
                                         vf.index_select(0, k_rows), call)
    assert out.shape == (plan.total_q, num_q_heads, dim_v) and out.dtype == q.dtype
    full = out.new_zeros(batch * local_len, num_q_heads, dim_v).index_copy(0, q_rows, out)
    return full.view(batch, local_len, num_q_heads, dim_v).transpose(1, 2)


def _check(backend: str, layout: str, *, heads=(8, 2), dim=32, dim_v=None, window=None, softcap=None,
           sinks=False, dtype=torch.float32, atol=1e-5):
    """Output and every gradient of ``backend`` vs the float64 reference (fp32: ``atol``; bf16: within
    a small multiple of the error of rounding the exact result to bf16)."""
    (q, k, v), s, ids, offset = _inputs(layout, heads=heads, dim=dim, dim_v=dim_v, dtype=dtype, sinks=sinks)
    out = _attend(backend, q, k, v, ids, offset, window=window, softcap=softcap, sinks=s)
    leaves = [q, k, v] + ([s] if s is not None else [])
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    ref = dense_reference(*leaves64[:3], ids, offset, window=window, softcap=softcap,
                          sinks=leaves64[3] if s is not None else None)
    # The feature must matter here, or a kernel ignoring it would pass (a softcap cannot matter when a
    # query sees only itself: window 1).
    if sinks or (softcap is not None and window != 1):
        plain = dense_reference(*(t.detach() for t in leaves64[:3]), ids, offset, window=window)
        assert (plain - ref.detach()).abs().max() > 1e-2
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, leaves, grad.to(dtype))
    want = torch.autograd.grad(ref, leaves64, grad)
    assert [g.dtype for g in got] == [t.dtype for t in leaves]
    _close(out, ref.detach(), dtype, atol, "output")
    for name, g, r in zip(("q", "k", "v", "sinks"), got, want):
        _close(g, r, dtype, atol, f"grad {name}")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, atol: float, what: str) -> None:
    if dtype in (torch.float32, torch.float64):
        torch.testing.assert_close(got.double(), want, atol=atol, rtol=0, msg=lambda m: f"{what}: {m}")
        return
    # bf16: no kernel beats rounding the exact result once; gradients also pass rounded P and dS.
    scale = want.abs().max().item() + 1e-12
    floor = (want.to(dtype).double() - want).abs()
    err = (got.double() - want).abs()
    assert err.mean().item() <= 4 * floor.mean().item() + 2e-3 * scale, what
    assert err.max().item() <= 2 * floor.max().item() + 2e-2 * scale, what


# ---------------------------------------------------------------------------------------------
# value head dim != query/key head dim (MLA)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["sdpa_doc", "sdpa_mask"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("dim,dim_v", [(48, 32), (16, 40)])
@pytest.mark.parametrize("window", [None, 6])
def test_value_dim_differs(backend, layout, dim, dim_v, window):
    _check(backend, layout, dim=dim, dim_v=dim_v, window=window)


@pytest.mark.parametrize("layout", STRADDLING)
def test_mla_dims_bf16(layout):
    _check("sdpa_doc", layout, heads=(4, 4), dim=192, dim_v=128, dtype=torch.bfloat16)


def test_mla_dims_through_the_public_entry_point():
    """DeepSeek-V3 head dims (D=192, Dv=128) through ``blockdiag_attention`` with GQA 8:2: the straddling
    segment used to crash in the CPU flash kernel ("Q/K/V should have the same head size")."""
    (q, k, v), _, ids, offset = _inputs("straddle_then_docs", dim=192, dim_v=128)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no silent fallback to another backend
        out = blockdiag_attention(q, k, v, ids, offset, backend="sdpa_doc")
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(q64, k64, v64, ids, offset)
    assert out.shape == ref.shape == (1, 8, 28, 128)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=0)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for g, r in zip(torch.autograd.grad(out, (q, k, v), grad.float()), torch.autograd.grad(ref, (q64, k64, v64), grad)):
        torch.testing.assert_close(g.double(), r, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# logit softcapping and attention sinks (sdpa_doc's exact chunked path)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 1, 7])
@pytest.mark.parametrize("softcap,sinks", [(0.5, False), (None, True), (0.8, True)], ids=["softcap", "sinks", "both"])
def test_softcap_and_sinks_fp32(layout, window, softcap, sinks):
    _check("sdpa_doc", layout, window=window, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("heads", [(8, 2), (8, 8), (4, 1)])
@pytest.mark.parametrize("dim,dim_v", [(32, 32), (48, 24)])
def test_softcap_and_sinks_head_shapes(heads, dim, dim_v):
    _check("sdpa_doc", "b2_straddle_and_padding_rows", heads=heads, dim=dim, dim_v=dim_v, window=9, softcap=0.6,
           sinks=True)


@pytest.mark.parametrize("layout", STRADDLING + ["docs_and_padding"])
@pytest.mark.parametrize("softcap,sinks", [(0.5, False), (None, True), (0.8, True)], ids=["softcap", "sinks", "both"])
def test_softcap_and_sinks_bf16(layout, softcap, sinks):
    _check("sdpa_doc", layout, dtype=torch.bfloat16, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("window", [None, 5])
def test_many_chunks_per_segment(monkeypatch, window):
    """Tiny chunks: every segment is computed (and recomputed in backward) over several query chunks
    whose key spans start and end mid-segment."""
    monkeypatch.setattr(_chunked, "_SCORE_BUDGET", 8 * 16 * 3)
    monkeypatch.setattr(_chunked, "_MIN_CHUNK", 3)
    spans = list(_chunked._chunks(12, 48, 8, window))
    assert len(spans) >= 2 and (window is None or spans[-1][2] > 0)
    _check("sdpa_doc", "straddle_only", window=window, softcap=0.7, sinks=True)
    _check("sdpa_doc", "straddle_then_docs", window=window, softcap=0.7, sinks=True)


def test_sinks_keep_their_dtype_and_match_transformers_gpt_oss_eager():
    """Each document alone through transformers' gpt-oss eager attention (the sinks' own semantics)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    (q, k, v), s, ids, offset = _inputs("straddle_then_docs", sinks=True)
    out = _attend("sdpa_doc", q, k, v, ids, offset, window=7, sinks=s)
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = s, 4, False
    for start, stop in ((0, 30), (30, 39), (39, 40), (40, 48)):  # documents (global positions)
        lo, hi = max(start, offset), stop  # their local query rows
        keys = torch.arange(start, stop)
        pos = torch.arange(lo, hi)
        visible = (keys[None] <= pos[:, None]) & (keys[None] > pos[:, None] - 7)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        want, _ = eager_attention_forward(module, q[:, :, lo - offset:hi - offset], k[:, :, start:stop],
                                          v[:, :, start:stop], mask, scaling=32 ** -0.5)
        torch.testing.assert_close(out[:, :, lo - offset:hi - offset].transpose(1, 2), want, atol=1e-5, rtol=0)
    # bf16 activations with a float32 sinks parameter: output bf16, sinks gradient float32.
    (q, k, v), s, ids, offset = _inputs("straddle_then_docs", dtype=torch.bfloat16, sinks=True)
    out = _attend("sdpa_doc", q, k, v, ids, offset, sinks=s)
    assert out.dtype == torch.bfloat16
    (gs,) = torch.autograd.grad(out.float().sum(), (s,))
    assert gs.dtype == torch.float32 and torch.count_nonzero(gs) == 8


def test_softcap_matches_transformers_gemma2_eager():
    """Each document alone through transformers' gemma2 eager attention (softcap before the mask)."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    (q, k, v), _, ids, offset = _inputs("straddle_then_docs")
    out = _attend("sdpa_doc", q, k, v, ids, offset, softcap=0.5)
    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 4, False
    for start, stop in ((0, 30), (30, 39), (39, 40), (40, 48)):
        lo, hi = max(start, offset), stop
        visible = torch.arange(start, stop)[None] <= torch.arange(lo, hi)[:, None]
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        want, _ = eager_attention_forward(module, q[:, :, lo - offset:hi - offset], k[:, :, start:stop],
                                          v[:, :, start:stop], mask, scaling=32 ** -0.5, softcap=0.5)
        torch.testing.assert_close(out[:, :, lo - offset:hi - offset].transpose(1, 2), want, atol=1e-5, rtol=0)


def test_bad_feature_arguments_raise_early():
    (q, k, v), s, ids, offset = _inputs("straddle_only", sinks=True)
    with pytest.raises(ValueError, match=r"sinks must be a float tensor \[Hq=8\]"):
        _attend("sdpa_doc", q, k, v, ids, offset, sinks=s[:4])
    with pytest.raises(ValueError, match="softcap=-1.0"):
        _attend("sdpa_doc", q, k, v, ids, offset, softcap=-1.0)
    with pytest.raises(BackendUnavailable, match="dropout"):
        _attend("sdpa_doc", q, k, v, ids, offset, sinks=s, dropout_p=0.1)


@pytest.mark.parametrize("dim_v,window,softcap,sinks", [(32, None, None, False), (24, None, None, False),
                                                        (24, 11, 0.7, True)],
                         ids=["plain", "value_dim", "window_softcap_sinks"])
def test_float64_stays_float64(dim_v, window, softcap, sinks):
    """float64 in, float64 throughout (the straddling segment's flash merge once computed in float32)."""
    _check("sdpa_doc", "straddle_then_docs", dim_v=dim_v, window=window, softcap=softcap, sinks=sinks,
           dtype=torch.float64, atol=1e-10)


# ---------------------------------------------------------------------------------------------
# which backends report each feature unavailable
# ---------------------------------------------------------------------------------------------

FEATURES = {
    "value_dim": dict(head_dim=192, value_dim=128),
    "softcap": dict(softcap=30.0),
    "sinks": dict(sinks=True),
}
# Backends that must report each feature unavailable (on CUDA in bf16, where the GPU ones could run).
UNAVAILABLE = {
    "value_dim": {"flash", "te", "torch_varlen"},
    "softcap": {"te", "torch_varlen", "sdpa_mask"},
    "sinks": {"flash", "te", "torch_varlen", "flex", "sdpa_mask"},
}


def _spec(device_type: str, dtype: torch.dtype, feature: str | None, **extra) -> KernelSpec:
    fields = dict(device_type=device_type, dtype=dtype, head_dim=64, value_dim=64, num_q_heads=8, num_kv_heads=2)
    fields.update(FEATURES.get(feature, {}))
    return KernelSpec(**{**fields, **extra})


@pytest.mark.parametrize("feature", sorted(FEATURES))
def test_backends_report_features_they_lack(standins, monkeypatch, feature):
    # flash/te: stand-ins, their availability checks run as if on CUDA; torch_varlen: only its
    # device gate is lifted. Every feature check is the adapter's own code.
    monkeypatch.setattr(torch_varlen, "CAPABILITIES", dataclasses.replace(torch_varlen.CAPABILITIES, devices=None,
                                                                         dtypes=None))
    plain = _spec("cuda", torch.bfloat16, None)
    spec = _spec("cuda", torch.bfloat16, feature)
    assert {"flash", "te", "torch_varlen", "sdpa_doc", "sdpa_mask"} <= available_backends(plain)
    unavailable = {name for name in ("flash", "te", "torch_varlen", "flex", "sdpa_doc", "sdpa_mask")
                   if unavailable_reason(name, spec) is not None and unavailable_reason(name, plain) is None}
    assert unavailable == UNAVAILABLE[feature]
    keyword = {"value_dim": "value_dim", "softcap": "softcap", "sinks": "sinks"}[feature]
    for name in unavailable:
        assert keyword in unavailable_reason(name, spec), (name, unavailable_reason(name, spec))
    assert "sdpa_doc" in available_backends(spec)


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_training_with_each_feature_picks_sdpa_doc(feature, dtype):
    spec = _spec("cpu", dtype, feature, requires_grad=True)
    assert choose_backend("auto", spec) == ("sdpa_doc", None)
    name, note = choose_backend("flash", spec)
    assert name == "sdpa_doc" and "falling back" in note


@pytest.mark.parametrize("feature", ["softcap", "sinks"])
def test_dropout_with_softcap_or_sinks_is_unavailable_everywhere_on_cpu(feature):
    spec = _spec("cpu", torch.float32, feature, dropout_p=0.1, requires_grad=True)
    with pytest.raises(BackendUnavailable, match="sdpa_doc applies no dropout"):
        choose_backend("auto", spec)


def test_backends_refuse_a_direct_call_with_a_feature_they_lack(standins):
    (q, k, v), s, ids, offset = _inputs("straddle_then_docs", sinks=True)
    for backend in ("flash", "te", "sdpa_mask"):
        with pytest.raises(BackendUnavailable, match="attention sinks"):
            _attend(backend, q, k, v, ids, offset, sinks=s)
    for backend in ("te", "sdpa_mask"):
        with pytest.raises(BackendUnavailable, match="softcapping"):
            _attend(backend, q, k, v, ids, offset, softcap=30.0)
    assert standins.flash.calls == [] and standins.te.calls == []
