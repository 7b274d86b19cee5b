"""Issue 34 item 3: the step runtime owns its verbs. One agreement per step (a hybrid model's first recurrent and
first attention layer share it), a named state all-gather that refuses a broken group and names itself when a peer
fails, and a guard that marks the group broken when a kernel or runner raises."""

from __future__ import annotations

import types

import pytest
import torch

from hf_blockdiag_cp.distributed import CollectiveError, check_usable
from hf_blockdiag_cp.errors import CPKernelError
from hf_blockdiag_cp.runtime import StepRuntime
from tests.distributed.fault_harness import FAULTY, _run, _survivors_raise
from tests.launch import run_ranks


class _Group:
    """A stand-in process group (weakly referenceable, like torch's)."""


def _ctx(group: object) -> types.SimpleNamespace:
    config = types.SimpleNamespace(collective_timeout_s=5.0)
    return types.SimpleNamespace(group=group, cp_rank=1, cp_size=2, config=config, origin=None)


def test_guard_marks_the_group_broken_and_the_state_gather_refuses_it():
    group = _Group()
    ctx, runtime = _ctx(group), StepRuntime()
    with pytest.raises(CPKernelError, match="the recurrent delta rule runner failed .*injected runner fault"):
        with runtime.guard(ctx, "recurrent delta rule runner"):
            raise ValueError("injected runner fault")
    with pytest.raises(CollectiveError, match="refusing to start the recurrent state all-gather: this CP group failed "
                                              r"earlier \(the recurrent delta rule runner on CP rank 1 failed"):
        runtime.all_gather(ctx, torch.zeros(2, 3), what="recurrent state all-gather")
    check_usable(_Group(), "K/V exchange", 1)  # another group is not affected


def test_guard_passes_collective_errors_through_and_builds_the_timeout_once():
    group = _Group()
    ctx, runtime = _ctx(group), StepRuntime()
    with pytest.raises(CollectiveError, match="^already named$"):
        with runtime.guard(ctx, "recurrent runner"):
            raise CollectiveError("already named")
    check_usable(group, "K/V exchange", 1)  # not marked by the guard (the collective marked it, if anything)
    first = runtime.collective_timeout(ctx)
    assert first.total_seconds() == 5.0 and runtime.collective_timeout(ctx) is first


@pytest.fixture
def one_process_group(tmp_path):
    """A one-process gloo group and a context on it (collective timeout 5 s)."""
    import datetime

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        group = dist.new_group([0])
        yield types.SimpleNamespace(group=group, cp_rank=0, cp_size=1, origin=None,
                                    config=types.SimpleNamespace(collective_timeout_s=5.0))
    finally:
        dist.destroy_process_group()


def test_the_state_gathers_backward_names_itself_on_a_group_that_broke_after_the_forward(one_process_group):
    """A one-process gloo group: the forward all-gather runs; the group is then marked broken (as a peer's failure
    would), and the backward refuses before starting, naming the recurrent state gradient exchange (not K/V)."""
    from hf_blockdiag_cp.distributed.exchange import mark_broken

    ctx = one_process_group
    buffer = torch.ones(2, 3, requires_grad=True)
    out = StepRuntime().all_gather(ctx, buffer, what="recurrent state all-gather")
    torch.testing.assert_close(out, buffer.detach())
    mark_broken(ctx.group, "the test's injected failure")
    with pytest.raises(CollectiveError, match="refusing to start the recurrent state gradient"):
        out.sum().backward()


def _one_step_agreements(rank: int, world: int) -> dict:
    """One forward + backward of a tiny hybrid (gated delta rule and full attention layers) at CP = 2; counts the
    step agreement's collectives."""
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.distributed import agreement

    calls = []
    original = agreement.wait

    def counted(work, what, *args, **kwargs):  # every agreement collective of the module waits here, named
        calls.append(what)
        return original(work, what, *args, **kwargs)

    agreement.wait = counted
    config = tiny_config("qwen3_next")
    kinds = list(config.layer_types)
    model = build_model(config, "blockdiag_cp").train()
    gen = torch.Generator().manual_seed(7)
    docs = [{"input_ids": torch.randint(3, config.vocab_size, (n,), generator=gen).tolist()} for n in (5, 20, 3, 12)]
    batch = bd.PackingCollator(40, group=dist.group.WORLD, pad_token_id=0)(docs)
    out = model(**{k: v for k, v in batch.items() if k not in ("labels", "use_cache")}, use_cache=False)
    out.logits.float().square().mean().backward()
    mixed = model.__dict__["_blockdiag_cp_probe"].attention_calls  # attention and served recurrent calls
    return {"agreements": calls.count("blockdiag_cp rank agreement"), "layer_types": kinds, "mixed": mixed}


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_a_hybrid_step_agrees_once():
    for report in run_ranks(_one_step_agreements, 2, timeout=240):
        kinds = report["layer_types"]
        assert "linear_attention" in kinds and "full_attention" in kinds, kinds  # a hybrid: both mixers ran
        assert report["mixed"] >= 2, report
        assert report["agreements"] == 1, report  # before: 2 (the first recurrent and the first attention layer)


@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_the_state_gather_names_itself_when_a_peer_fails():
    rows = _run(["state_gather_peer_fails"])["state_gather_peer_fails"]
    _survivors_raise(rows, {FAULTY: ("CPKernelError", "the recurrent test runner failed"),
                            0: ("CollectiveError", "refusing to start the recurrent state all-gather")})
    message = rows[0][2]
    assert "recurrent state all-gather on CP rank 0" in message and "K/V" not in message, message


def test_a_deferred_gather_finishes_at_its_wait_and_counts_the_wait(one_process_group):
    """``all_gather(..., deferred)`` returns once started; ``deferred.wait()`` finishes it (idempotent) and the
    seconds waited are counted under the gather's name; its backward is the same reduce-scatter."""
    from hf_blockdiag_cp.distributed.exchange import Deferred

    runtime, deferred = StepRuntime(), Deferred()
    buffer = torch.arange(6.0).view(2, 3).requires_grad_()
    out = runtime.all_gather(one_process_group, buffer, what="recurrent state all-gather", deferred=deferred)
    deferred.wait()
    deferred.wait()
    torch.testing.assert_close(out, buffer.detach())
    assert list(runtime.comm.waited_s) == ["recurrent state all-gather"]
    (out * 2).sum().backward()
    torch.testing.assert_close(buffer.grad, torch.full((2, 3), 2.0))
