"""Issue 17: after a :class:`CPKernelError` the CP group is recorded as broken, so a rank that catches the
error and keeps training gets a clear :class:`CollectiveError` at the group's next use (no collective
entered, no SIGABRT)."""

from __future__ import annotations

import types

import pytest
import torch

from hf_blockdiag_cp.attention import cp as cp_module
from hf_blockdiag_cp.attention.layer import CPKernelError, kernel_failed
from hf_blockdiag_cp.distributed import CollectiveError, check_usable
from hf_blockdiag_cp.runtime import StepRuntime


class _Group:
    """A stand-in process group (weakly referenceable, like torch's)."""


def test_kernel_failure_marks_the_group_broken():
    group = _Group()
    ctx = types.SimpleNamespace(group=group, cp_rank=1, cp_size=2)
    check_usable(group, "K/V exchange", 1)  # usable before
    err = kernel_failed(ctx, "sdpa_doc", RuntimeError("injected kernel fault"))
    assert isinstance(err, CPKernelError) and "injected kernel fault" in str(err)
    assert "cannot be used again" in str(err)
    with pytest.raises(CollectiveError, match=r"failed earlier \(the 'sdpa_doc' attention kernel on CP rank 1 failed"):
        check_usable(group, "K/V exchange", 1)
    check_usable(_Group(), "K/V exchange", 0)  # another group is not affected


def test_cp_attention_routes_kernel_failures_through_kernel_failed(monkeypatch):
    """The kernel call of sequence_attention marks the group (the step runtime's guard): driven with a stubbed plan,
    backend, exchange and kernel."""
    group = _Group()
    ctx = types.SimpleNamespace(group=group, cp_rank=0, cp_size=2, config=None, origin=None)
    runtime = StepRuntime()
    runtime.backend = lambda *a, **k: "sdpa_doc"
    runtime.exchange_kv = lambda ctx, k, v, window: (k, v)
    monkeypatch.setattr(cp_module, "step_runtime", lambda ctx: runtime)
    monkeypatch.setattr(cp_module, "device_plan", lambda *a, **k: types.SimpleNamespace(plan=None, schedules=None))

    def broken_kernel(*args, **kwargs):
        raise RuntimeError("injected kernel fault")

    monkeypatch.setattr(cp_module, "attend_flat", broken_kernel)
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(CPKernelError, match="injected kernel fault"):
        cp_module.sequence_attention(ctx, q, q[:, :1], q[:, :1], dropout_p=0.0, scale=1.0, window=None, softcap=None)
    with pytest.raises(CollectiveError, match="this CP group failed earlier"):
        check_usable(group, "K/V exchange", 0)
