"""The real kernels on CUDA (flash-attn, TransformerEngine, torch varlen, flex, sdpa_doc, sdpa_mask)
against the float64 brute-force :func:`tests.reference.dense_reference`, forward and q/k/v gradients.

Marked ``gpu`` (``tests/conftest.py`` skips them without CUDA); a case whose library is absent, or
whose dtype the backend does not support, skips with the backend's own ``unavailable_reason``.
Without pytest (a bare GPU box), ``python tests/kernels/test_gpu_kernels.py`` runs the same cases.

Tolerances. The reference runs on the very bf16/fp32 inputs the kernel gets, upcast to float64, so
the only error left is the kernel's arithmetic. Errors are measured relative to the size of the
exact result (``rms`` for the mean error, ``max |ref|`` for the worst element), which keeps one bound
meaningful for outputs and for gradients of any magnitude. Calibrated by running these cases with
sdpa_doc / sdpa_mask on CPU: bf16 gives <= 0.15% mean / 1% worst on outputs, <= 0.3% / 1.3% on
gradients; a window one key too wide (257 instead of 256) gives 1.2% mean / 12% worst, which the
bf16 bounds below (0.6% / 5%) reject with room for a GPU kernel's extra rounding. fp32 kernels
(2e-7 / 1e-6 measured) are held to 1.5e-4 / 8e-4.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass

import torch

try:
    import pytest
except ModuleNotFoundError:  # ``python tests/kernels/test_gpu_kernels.py`` on a machine without pytest
    pytest = None

if __package__ in (None, ""):  # run as a script from the repository root
    sys.path.insert(0, ".")

from hf_blockdiag_cp import BlockDiagCPConfig, blockdiag_attention  # noqa: E402
from hf_blockdiag_cp.attention.core import kernel_spec  # noqa: E402
from hf_blockdiag_cp.kernels import unavailable_reason  # noqa: E402
from tests.layouts import runs as _runs
from tests.reference import dense_reference  # noqa: E402

DEVICE = "cuda"  # a module constant so the tolerance logic can be dry-run elsewhere
BACKENDS = ("flash", "te", "torch_varlen", "flex", "sdpa_doc", "sdpa_mask")
# (mean error / rms(ref), max error / max|ref|) per dtype, for outputs and for gradients.
BOUNDS = {
    torch.bfloat16: {"out": (6e-3, 5e-2), "grad": (8e-3, 6e-2)},
    torch.float32: {"out": (1.5e-4, 8e-4), "grad": (3e-4, 1.2e-3)},
}


class SkipCase(Exception):
    """A case that cannot run here (library absent, dtype unsupported)."""


def _short_docs_with_padding(total: int, real: int) -> list[int]:
    """Documents of cycling lengths 1..250 up to ``real`` tokens, then padding up to ``total``."""
    lengths, ids, doc = (1, 3, 17, 64, 129, 5, 250, 33), [], 0
    while len(ids) < real:
        doc += 1
        ids += [doc] * min(lengths[doc % len(lengths)], real - len(ids))
    return ids + [0] * (total - real)


@dataclass(frozen=True)
class Case:
    """Query rows ``[row_offset, row_offset + local_len)`` of rows with ``doc_ids`` ([S] or [B][S])."""

    doc_ids: tuple
    row_offset: int
    local_len: int
    window: int | None = None
    heads: tuple[int, int] = (8, 2)
    head_dim: int = 64


# doc 2 spans [700, 1600): it straddles row 1024 with 324 keys before the local rows (prefix segment).
_STRADDLE = tuple(_runs((1, 700), (2, 900), (3, 300), (4, 148)))
CASES = {
    "straddle": Case(_STRADDLE, 1024, 1024),
    "straddle_window256": Case(_STRADDLE, 1024, 1024, window=256),
    "short_docs_padding_d128": Case(tuple(_short_docs_with_padding(2048, 1800)), 0, 2048, head_dim=128),
    "b2_middle_shard_window": Case((tuple(_runs((1, 300), (2, 900), (3, 336))),
                                    tuple(_runs((4, 1000), (5, 200), (0, 336)))), 512, 512, window=100),
}
# flex compiles per shape and mask (tens of seconds each): one representative case keeps the file fast.
FLEX_CASES = ("straddle_window256",)


def _inputs(case: Case, dtype: torch.dtype, seed: int = 0):
    ids = torch.tensor(case.doc_ids)
    batch = ids.shape[0] if ids.dim() == 2 else 1
    full_len = ids.shape[-1]
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape):  # [B, seq, H, D] -> transposed [B, H, seq, D] views, as transformers passes them
        return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype).transpose(1, 2).requires_grad_()

    q = randn(batch, case.local_len, case.heads[0], case.head_dim)
    k = randn(batch, full_len, case.heads[1], case.head_dim)
    v = randn(batch, full_len, case.heads[1], case.head_dim)
    return q, k, v, ids


def _relative_errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    err = (got.double() - ref).abs()
    rms = ref.pow(2).mean().sqrt().item() + 1e-30
    return err.mean().item() / rms, err.max().item() / (ref.abs().max().item() + 1e-30)


def run_case(backend: str, dtype: torch.dtype, case: Case, config: BlockDiagCPConfig | None = None,
             seed: int = 0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """Run ``backend`` on ``case`` and assert it matches the reference; returns ``(out, grads)``."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SkipCase("needs a CUDA device")
    q, k, v, ids = _inputs(case, dtype, seed)
    reason = unavailable_reason(backend, kernel_spec(q, k, v, dropout_p=0.0, window=case.window, softcap=None))
    if reason is not None:
        raise SkipCase(f"{backend} unavailable for {dtype}: {reason}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = blockdiag_attention(q, k, v, ids, case.row_offset, sliding_window=case.window, backend=backend,
                                  config=config)
    fallbacks = [str(w.message) for w in caught if "falling back" in str(w.message)]
    assert not fallbacks, f"{backend} did not run: {fallbacks}"  # a fallback must not pass silently
    grad = torch.randn(out.shape, generator=torch.Generator(device=DEVICE).manual_seed(seed + 1), device=DEVICE,
                       dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    grad = grad.double()  # the reference gets the very same (rounded) output gradient
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    with torch.device(DEVICE):  # the reference's index tensors are made on the GPU too
        ref = dense_reference(q64, k64, v64, ids.to(DEVICE), case.row_offset, window=case.window)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad)
    assert out.shape == ref.shape and out.dtype == dtype
    bounds = BOUNDS[dtype]
    mean_err, max_err = _relative_errors(out, ref.detach())
    assert mean_err <= bounds["out"][0] and max_err <= bounds["out"][1], \
        f"{backend} {dtype} output: mean {mean_err:.2e} / max {max_err:.2e} (bounds {bounds['out']})"
    for name, g, r in zip("qkv", grads, ref_grads):
        mean_err, max_err = _relative_errors(g, r)
        assert mean_err <= bounds["grad"][0] and max_err <= bounds["grad"][1], \
            f"{backend} {dtype} d{name}: mean {mean_err:.2e} / max {max_err:.2e} (bounds {bounds['grad']})"
    return out, grads


def _params() -> list[tuple[str, torch.dtype, str]]:
    out = []
    for backend in BACKENDS:
        for dtype in (torch.bfloat16, torch.float32):
            for name in (FLEX_CASES if backend == "flex" else CASES):
                if backend == "flex" and dtype == torch.float32:
                    continue  # another compile; bf16 is the case that matters
                out.append((backend, dtype, name))
    return out


def _check_flash_guard(guard: bool) -> None:
    run_case("flash", torch.bfloat16, CASES["straddle"], BlockDiagCPConfig(flash_prefix_guard=guard))


def _check_flash_deterministic() -> None:
    config = BlockDiagCPConfig(deterministic=True)
    _, first = run_case("flash", torch.bfloat16, CASES["b2_middle_shard_window"], config)
    _, second = run_case("flash", torch.bfloat16, CASES["b2_middle_shard_window"], config)
    for a, b in zip(first, second):
        assert torch.equal(a, b), "deterministic=True backward differs between two identical runs"


if pytest is not None:
    pytestmark = pytest.mark.gpu

    def _run_or_skip(fn, *args) -> None:
        try:
            fn(*args)
        except SkipCase as skip:
            pytest.skip(str(skip))

    @pytest.mark.parametrize("backend,dtype,case", _params(), ids=lambda p: str(p).replace("torch.", ""))
    def test_kernel_matches_reference(backend, dtype, case):
        _run_or_skip(run_case, backend, dtype, CASES[case])

    @pytest.mark.parametrize("guard", [True, False])
    def test_flash_prefix_guard_on_and_off(guard):
        _run_or_skip(_check_flash_guard, guard)

    def test_flash_deterministic_backward_is_bitwise_repeatable():
        _run_or_skip(_check_flash_deterministic)


def main() -> int:
    """Run every case without pytest; print one line per case; exit status 1 on any failure."""
    checks = [(f"{b}-{str(d).replace('torch.', '')}-{c}", run_case, (b, d, CASES[c])) for b, d, c in _params()]
    checks += [(f"flash-guard-{g}", _check_flash_guard, (g,)) for g in (True, False)]
    checks += [("flash-deterministic", _check_flash_deterministic, ())]
    failed = 0
    for name, fn, args in checks:
        start = time.perf_counter()
        try:
            fn(*args)
            status = "PASS"
        except SkipCase as skip:
            status = f"SKIP ({skip})"
        except Exception as err:  # report and continue: one broken library must not hide the others
            status = f"FAIL {type(err).__name__}: {err}"
            failed += 1
        print(f"{name:48s} {time.perf_counter() - start:6.1f}s {status}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
