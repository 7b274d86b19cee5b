"""The ``flash`` and ``te`` adapters driven end to end through pure-PyTorch stand-ins of flash-attn and
TransformerEngine (see :mod:`tests.standins`), the ``flex`` adapter on CPU, and backend selection on
a CPU-only machine.

Every numeric check compares against the float64 brute-force :func:`tests.reference.dense_reference`;
every launch check reads what reached the stand-in (which rejects what the real kernel would trust:
non-int32 or inconsistent ``cu_seqlens``, inexact maxima, strided last dims, ...).
"""

from __future__ import annotations

import sys
import warnings

import pytest
import torch

from hf_blockdiag_cp import BlockDiagCPConfig, blockdiag_attention
from hf_blockdiag_cp.attention.core import attend_flat, flat_rows
from hf_blockdiag_cp.config import BACKENDS
from hf_blockdiag_cp.kernels import (
    BackendUnavailable,
    KernelSpec,
    available_backends,
    choose_backend,
    unavailable_reason,
)
from hf_blockdiag_cp.planning import build_varlen_plan
from tests.layouts import runs as _runs
from tests.reference import dense_reference
from tests.standins import FlashContractError, Standins, clear_caches, standins  # noqa: F401 (fixture)
from tests.standins import flash_attn as flash_standin

FLEX_EAGER_WARNING = "ignore:flex_attention called without torch.compile"


# name -> (doc_ids [S] or [B][S], row_offset, L). Every query row block is [row_offset, row_offset + L).
LAYOUTS: dict[str, tuple[list, int, int]] = {
    "one_token_docs": (list(range(1, 25)), 0, 24),
    "one_doc_everything": ([3] * 24, 0, 24),
    "one_doc_straddles_only": ([3] * 24, 10, 14),  # a single prefix segment, nothing else
    "first_doc_straddles": (_runs((1, 9), (2, 11), (3, 4)), 12, 12),
    "middle_shard": (_runs((1, 5), (2, 13), (3, 6)), 8, 8),  # keys after the local rows exist too
    "padding_tail": (_runs((1, 7), (2, 9), (0, 8)), 0, 24),
    "all_padding_rows": (_runs((1, 14), (0, 10)), 16, 8),
    "b2_both_rows_straddle": ([_runs((1, 9), (2, 11), (3, 4)), _runs((4, 3), (5, 15), (0, 6))], 12, 12),
    "b2_one_row_all_padding": ([_runs((1, 10), (2, 14)), [0] * 24], 0, 24),
}


def _inputs(layout: str, *, heads: tuple[int, int] = (8, 2), head_dim: int = 64, dtype=torch.float32, seed=0):
    """``q [B,Hq,L,D]``, ``k/v [B,Hkv,S,D]`` (transposed views, as transformers passes them), ids, offset."""
    doc, offset, local_len = LAYOUTS[layout]
    ids = torch.tensor(doc)
    batch = ids.shape[0] if ids.dim() == 2 else 1
    full_len = ids.shape[-1]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, local_len, heads[0], head_dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, full_len, heads[1], head_dim, generator=gen).to(dtype).transpose(1, 2)
    v = torch.randn(batch, full_len, heads[1], head_dim, generator=gen).to(dtype).transpose(1, 2)
    return [t.requires_grad_() for t in (q, k, v)], ids, offset


def _check_against_reference(backend: str, layout: str, *, window=None, config=None, atol=1e-5, **kw):
    """Forward and q/k/v gradients of ``backend`` vs the float64 reference; returns the output."""
    (q, k, v), ids, offset = _inputs(layout, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a silent fallback to another backend would fail here
        out = blockdiag_attention(q, k, v, ids, offset, sliding_window=window, backend=backend, config=config)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = dense_reference(q64, k64, v64, ids, offset, window=window)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), ref.detach(), atol=atol, rtol=0)
    grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
    want = torch.autograd.grad(ref, (q64, k64, v64), grad)
    for name, g, r in zip("qkv", got, want):
        torch.testing.assert_close(g.double(), r, atol=atol, rtol=0, msg=lambda m, n=name: f"d{n}: {m}")
    return out


def _expected_segments(layout: str) -> list[tuple[int, int]]:
    """``(q_len, k_len)`` per segment, derived here from the ids by hand-rolled scanning (B = 1)."""
    doc, offset, local_len = LAYOUTS[layout]
    segs = []
    for pos in range(offset, offset + local_len):
        if doc[pos] == 0:
            continue
        start = pos
        while start > 0 and doc[start - 1] == doc[pos]:
            start -= 1
        if segs and pos > offset and doc[pos - 1] == doc[pos]:
            segs[-1] = (segs[-1][0] + 1, pos - start + 1)
        else:
            segs.append((1, pos - start + 1))
    return segs


def _cu(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# flash / te through the stand-ins: numerics
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["flash", "te"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 5])
def test_standin_backends_match_reference(standins, backend, layout, window):
    _check_against_reference(backend, layout, window=window)


@pytest.mark.parametrize("backend", ["flash", "te"])
@pytest.mark.parametrize("heads,head_dim", [((8, 2), 128), ((4, 4), 64), ((6, 1), 128)])
@pytest.mark.parametrize("layout", ["first_doc_straddles", "b2_both_rows_straddle"])
def test_standin_backends_head_shapes(standins, backend, heads, head_dim, layout):
    _check_against_reference(backend, layout, heads=heads, head_dim=head_dim, window=3)


def test_no_kernel_launch_when_every_query_row_is_padding(standins):
    (q, k, v), _, _ = _inputs("all_padding_rows")
    ids = torch.tensor(_runs((1, 16), (0, 8)))  # local rows [16, 24) are all padding
    for backend in ("flash", "te"):
        out = blockdiag_attention(q, k, v, ids, 16, backend=backend)
        assert torch.count_nonzero(out) == 0
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert all(torch.isfinite(g).all() and torch.count_nonzero(g) == 0 for g in grads)
    assert standins.flash.calls == [] and standins.te.calls == []


# ---------------------------------------------------------------------------------------------
# flash: long-prefix guard and the arguments reaching the kernel
# ---------------------------------------------------------------------------------------------

def _flash_calls(standins: Standins) -> list[str]:
    return [c.fn for c in standins.flash.calls]


def test_flash_guard_peels_the_straddling_first_document(standins):
    _check_against_reference("flash", "first_doc_straddles", window=None)
    assert _flash_calls(standins) == ["flash_attn_func", "flash_attn_varlen_func"]
    segs = _expected_segments("first_doc_straddles")  # [(8, 11), (4, 4)]: doc 2 has 3 keys before row 12
    assert segs[0][1] > segs[0][0] and all(ql == kl for ql, kl in segs[1:])
    fixed, varlen = standins.flash.calls
    assert fixed.q_shape == (1, segs[0][0], 8, 64) and fixed.k_shape == (1, segs[0][1], 2, 64)
    assert fixed.causal is True and fixed.window_size == (-1, 0)
    rest = segs[1:]
    assert varlen.cu_seqlens_q == _cu([q for q, _ in rest]) and varlen.cu_seqlens_k == _cu([k for _, k in rest])
    assert varlen.max_seqlen_q == max(q for q, _ in rest) and varlen.max_seqlen_k == max(k for _, k in rest)
    assert varlen.cu_seqlens_dtype == torch.int32


def test_flash_guard_only_prefix_segment_is_one_fixed_launch(standins):
    _check_against_reference("flash", "one_doc_straddles_only")
    assert _flash_calls(standins) == ["flash_attn_func"]


def test_flash_guard_one_fixed_launch_per_straddling_row(standins):
    _check_against_reference("flash", "b2_both_rows_straddle", window=4)
    # Both rows' first documents straddle row 12; the rest (not contiguous in packed order) is one call.
    assert _flash_calls(standins) == ["flash_attn_func", "flash_attn_func", "flash_attn_varlen_func"]


@pytest.mark.parametrize("layout", ["one_token_docs", "padding_tail", "b2_one_row_all_padding", "one_doc_everything"])
def test_flash_single_varlen_call_when_nothing_straddles(standins, layout):
    _check_against_reference("flash", layout)
    assert _flash_calls(standins) == ["flash_attn_varlen_func"]


def test_flash_guard_disabled_sends_the_asymmetric_segment_to_varlen(standins):
    _check_against_reference("flash", "first_doc_straddles", config=BlockDiagCPConfig(flash_prefix_guard=False))
    assert _flash_calls(standins) == ["flash_attn_varlen_func"]
    (call,) = standins.flash.calls
    segs = _expected_segments("first_doc_straddles")
    assert call.cu_seqlens_q == _cu([q for q, _ in segs]) and call.cu_seqlens_k == _cu([k for _, k in segs])
    assert (call.max_seqlen_q, call.max_seqlen_k) == (max(q for q, _ in segs), max(k for _, k in segs))


@pytest.mark.parametrize("window", [None, 1, 5])
@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_arguments(standins, window, deterministic):
    layout = "middle_shard"
    _check_against_reference("flash", layout, window=window,
                             config=BlockDiagCPConfig(deterministic=deterministic, flash_prefix_guard=False))
    (call,) = standins.flash.calls
    segs = _expected_segments(layout)
    assert call.fn == "flash_attn_varlen_func"
    assert call.cu_seqlens_dtype == torch.int32
    assert call.cu_seqlens_q == _cu([q for q, _ in segs]) and call.cu_seqlens_k == _cu([k for _, k in segs])
    assert (call.max_seqlen_q, call.max_seqlen_k) == (max(q for q, _ in segs), max(k for _, k in segs))
    assert call.causal is True
    assert call.window_size == ((-1, 0) if window is None else (window - 1, 0))
    assert call.deterministic is deterministic
    assert call.softmax_scale == pytest.approx(64 ** -0.5) and call.softcap == 0.0 and call.dropout_p == 0.0


def _softcap_reference(q, k, v, doc, offset, cap):
    """Float64 block-diagonal causal attention with ``cap * tanh(s / cap)`` scores (B = 1, 1-D ids)."""
    doc = torch.as_tensor(doc)
    run = torch.cat([torch.zeros(1, dtype=torch.long), (doc[1:] != doc[:-1]).long()]).cumsum(0)
    q_pos = torch.arange(offset, offset + q.shape[2])
    k_pos = torch.arange(k.shape[2])
    allowed = (run[q_pos][:, None] == run[None, :]) & (doc[q_pos][:, None] != 0) & (k_pos[None] <= q_pos[:, None])
    groups = q.shape[1] // k.shape[1]
    k64, v64 = (t.double().repeat_interleave(groups, dim=1) for t in (k, v))
    scores = q.double() @ k64.transpose(-1, -2) * q.shape[-1] ** -0.5
    scores = (cap * torch.tanh(scores / cap)).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v64


def _attend_with_softcap(backend: str, layout: str, cap: float, requires_grad: bool = True):
    (q, k, v), ids, offset = _inputs(layout, heads=(4, 2), head_dim=32)
    if not requires_grad:
        q, k, v = (t.detach() for t in (q, k, v))
    plan = build_varlen_plan(ids, local_len=q.shape[2], row_offset=offset)
    out = attend_flat(flat_rows(q), flat_rows(k), flat_rows(v), plan, backend, scale=q.shape[-1] ** -0.5,
                      softcap=cap)
    out = out.view(1, q.shape[2], q.shape[1], -1).transpose(1, 2)
    q, k, v = (t.detach() for t in (q, k, v))
    ref = _softcap_reference(q, k, v, ids, offset, cap)
    # A cap this small changes the result, so comparing against ``ref`` can fail.
    assert (dense_reference(q, k, v, ids, offset) - ref).abs().max() > 1e-2
    return out, ref


def test_flash_softcap_passthrough(standins):
    out, ref = _attend_with_softcap("flash", "first_doc_straddles", cap=0.5)
    assert {c.softcap for c in standins.flash.calls} == {0.5}
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# the stand-ins themselves reject what the real kernels would trust
# ---------------------------------------------------------------------------------------------

def _varlen_args():
    q = torch.randn(7, 4, 16)
    k = torch.randn(9, 2, 16)
    cu_q = torch.tensor([0, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 9], dtype=torch.int32)
    return q, k, k.clone(), cu_q, cu_k, 4, 5


@pytest.mark.parametrize("corrupt,match", [
    (lambda a: {**a, "cu_seqlens_q": a["cu_seqlens_q"].long()}, "int32"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([0, 5, 8], dtype=torch.int32)}, "packed rows"),
    (lambda a: {**a, "cu_seqlens_k": torch.tensor([1, 5, 9], dtype=torch.int32)}, "must be 0"),
    (lambda a: {**a, "cu_seqlens_q": torch.tensor([0, 4, 3, 7], dtype=torch.int32)}, "non-decreasing"),
    (lambda a: {**a, "max_seqlen_q": 5}, "exact maximum"),
    (lambda a: {**a, "max_seqlen_k": torch.tensor(5)}, "Python int"),
    (lambda a: {**a, "q": a["q"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous last"),
    (lambda a: {**a, "k": a["k"][:, :1].expand(9, 3, 16).contiguous(), "v": a["v"][:, :1].expand(9, 3, 16)
                .contiguous()}, "divisible"),
    (lambda a: {**a, "v": a["v"].double()}, "dtypes differ"),
    (lambda a: {**a, "window_size": (2,)}, "window_size"),
])
def test_flash_standin_is_strict(corrupt, match):
    fa = flash_standin.make_module()
    q, k, v, cu_q, cu_k, mq, mk = _varlen_args()
    good = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=mq, max_seqlen_k=mk)
    fa.flash_attn_varlen_func(**good, causal=True)  # the unmodified call is accepted
    args = corrupt(good)
    window = args.pop("window_size", (-1, 0))
    with pytest.raises(FlashContractError, match=match):
        fa.flash_attn_varlen_func(**args, causal=True, window_size=window)
    assert len(fa.calls) == 1  # rejected calls are not recorded


# ---------------------------------------------------------------------------------------------
# te: module cache, dropout
# ---------------------------------------------------------------------------------------------

def test_te_reuses_one_module_per_key(standins):
    for seed in (0, 1):
        (q, k, v), ids, offset = _inputs("first_doc_straddles", seed=seed)
        blockdiag_attention(q, k, v, ids, offset, backend="te")
    assert len(standins.te.constructions) == 1
    assert len(standins.te.calls) == 2 and standins.te.calls[0].module_id == standins.te.calls[1].module_id
    built = standins.te.constructions[0]
    assert (built.num_attention_heads, built.num_gqa_groups, built.kv_channels) == (8, 2, 64)
    assert built.qkv_format == "thd" and built.attn_mask_type == "padding_causal_bottom_right"
    assert built.window_size == (-1, 0) and built.softmax_scale == pytest.approx(64 ** -0.5)
    call = standins.te.calls[0]
    segs = _expected_segments("first_doc_straddles")
    assert call.cu_seqlens_dtype == torch.int32
    assert call.cu_seqlens_q == _cu([q for q, _ in segs]) and call.cu_seqlens_kv == _cu([k for _, k in segs])
    assert (call.max_seqlen_q, call.max_seqlen_kv) == (max(q for q, _ in segs), max(k for _, k in segs))

    (q, k, v), ids, offset = _inputs("first_doc_straddles")
    blockdiag_attention(q, k, v, ids, offset, backend="te", scale=0.1)  # new scale -> new module
    assert len(standins.te.constructions) == 2 and standins.te.constructions[-1].softmax_scale == pytest.approx(0.1)
    blockdiag_attention(q, k, v, ids, offset, backend="te", sliding_window=4)  # new window -> new module
    assert len(standins.te.constructions) == 3 and standins.te.constructions[-1].window_size == (3, 0)
    blockdiag_attention(q, k, v, ids, offset, backend="te", sliding_window=4)  # cached again
    assert len(standins.te.constructions) == 3 and len(standins.te.calls) == 5


def test_te_unavailable_with_dropout_and_selection_falls_back(standins):
    spec = KernelSpec("cuda", torch.bfloat16, 64, 64, 8, 2, dropout_p=0.1)
    assert "dropout" in unavailable_reason("te", spec)
    assert unavailable_reason("te", KernelSpec("cuda", torch.bfloat16, 64, 64, 8, 2)) is None
    name, note = choose_backend("te", spec)
    assert name == "flash" and "te" in note and "dropout" in note
    (q, k, v), ids, offset = _inputs("padding_tail")
    with pytest.warns(UserWarning, match="dropout"):
        blockdiag_attention(q, k, v, ids, offset, backend="te", dropout_p=0.1)
    assert standins.te.constructions == [] and standins.te.calls == []


def test_te_has_no_softcap(standins):
    assert "softcap" in unavailable_reason("te", KernelSpec("cuda", torch.bfloat16, 64, 64, 8, 2, softcap=30.0))


def test_standins_installed_and_available(standins):
    assert sys.modules["flash_attn"] is standins.flash
    assert available_backends(KernelSpec("cpu", torch.float32, 64, 64, 8, 2)) >= {"flash", "te"}


# ---------------------------------------------------------------------------------------------
# backend selection on this CPU-only machine (no stand-ins)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def real_imports():
    """The real optional-import state (a previous test's stand-ins must not leak in)."""
    clear_caches()
    assert not hasattr(sys.modules.get("flash_attn"), "calls"), "a flash_attn stand-in leaked"
    yield
    clear_caches()


CPU_SPEC = KernelSpec("cpu", torch.float32, 64, 64, 8, 2)


@pytest.mark.parametrize("name", ["flash", "te", "torch_varlen"])
def test_gpu_backends_unavailable_on_cpu_with_reason(real_imports, name):
    reason = unavailable_reason(name, CPU_SPEC)
    assert reason is not None
    assert "CUDA" in reason or "not installed" in reason, reason
    assert name not in available_backends(CPU_SPEC)


def test_cpu_available_backends(real_imports):
    assert {"sdpa_doc", "sdpa_mask", "flex"} <= available_backends(CPU_SPEC)
    assert choose_backend("auto", CPU_SPEC) == ("sdpa_doc", None)


def test_flex_unavailable_for_cpu_training(real_imports):
    spec = KernelSpec("cpu", torch.float32, 64, 64, 8, 2, requires_grad=True)
    assert "backward" in unavailable_reason("flex", spec)
    name, note = choose_backend("flex", spec)
    assert name == "sdpa_doc" and "'flex'" in note and "falling back" in note
    assert choose_backend("flex", CPU_SPEC) == ("flex", None)  # inference: fine


@pytest.mark.parametrize("name", ["flash", "te", "torch_varlen"])
def test_explicit_unavailable_backend_falls_back_to_sdpa_doc(real_imports, name):
    chosen, note = choose_backend(name, CPU_SPEC)
    assert chosen == "sdpa_doc"
    assert f"'{name}'" in note and "'sdpa_doc'" in note and unavailable_reason(name, CPU_SPEC) in note
    (q, k, v), ids, offset = _inputs("first_doc_straddles", heads=(4, 2), head_dim=16)
    with pytest.warns(UserWarning, match=f"'{name}'.*falling back to 'sdpa_doc'"):
        out = blockdiag_attention(q, k, v, ids, offset, backend=name)
    torch.testing.assert_close(out.double(), dense_reference(q.detach(), k.detach(), v.detach(), ids, offset),
                               atol=1e-5, rtol=0)


def test_unknown_backend_lists_names(real_imports):
    with pytest.raises(ValueError) as err:
        choose_backend("flash3", CPU_SPEC)
    assert all(name in str(err.value) for name in BACKENDS)
    with pytest.raises(ValueError, match="sdpa_doc"):
        unavailable_reason("nope", CPU_SPEC)


def test_softcap_on_cpu_with_dropout_is_unavailable(real_imports):
    # sdpa_doc softcaps exactly (training and inference), but applies no dropout with it.
    assert choose_backend("auto", KernelSpec("cpu", torch.float32, 64, 64, 8, 2, softcap=30.0,
                                             requires_grad=True)) == ("sdpa_doc", None)
    spec = KernelSpec("cpu", torch.float32, 64, 64, 8, 2, softcap=30.0, dropout_p=0.1, requires_grad=True)
    with pytest.raises(BackendUnavailable) as err:
        choose_backend("auto", spec)
    assert isinstance(err.value, NotImplementedError)
    assert "sdpa_doc" in str(err.value) and "softcap" in str(err.value)


# ---------------------------------------------------------------------------------------------
# flex on CPU (eager, forward only)
# ---------------------------------------------------------------------------------------------

@pytest.mark.filterwarnings(FLEX_EAGER_WARNING)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("window", [None, 5])
def test_flex_cpu_forward_matches_reference(real_imports, layout, window):
    (q, k, v), ids, offset = _inputs(layout)
    with torch.no_grad():
        out = blockdiag_attention(q, k, v, ids, offset, sliding_window=window, backend="flex")
    ref = dense_reference(q.detach(), k.detach(), v.detach(), ids, offset, window=window)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings(FLEX_EAGER_WARNING)
def test_flex_cpu_softcap_matches_reference(real_imports):
    with torch.no_grad():
        out, ref = _attend_with_softcap("flex", "first_doc_straddles", cap=0.5, requires_grad=False)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings(FLEX_EAGER_WARNING)
def test_flex_cpu_training_falls_back(real_imports):
    (q, k, v), ids, offset = _inputs("first_doc_straddles", heads=(4, 2), head_dim=16)
    with pytest.warns(UserWarning, match="'flex'.*backward.*falling back to 'sdpa_doc'"):
        out = blockdiag_attention(q, k, v, ids, offset, backend="flex")
    assert out.requires_grad
