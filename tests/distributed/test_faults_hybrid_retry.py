"""Issue 35, item 3: a rank retrying after an error in the middle of a hybrid forward (real gloo ranks, T = 5 s).

Tiny qwen3_next (layer 0: gated delta rule, layer 1: full attention) at CP = 2 on the harness of
``tests/distributed/fault_harness.py``. The faulty rank raises an out-of-memory error (a) inside its first recurrent
scan, while its peer waits in that layer's state all-gather, or (b) in layer 0's MLP, after the state all-gather,
while its peer goes on to layer 1's K/V exchange; it catches the error and runs the step again, as a loop that
retries after an OOM does. Before the fix, (b) with the all-gather K/V exchange: the retry's forward agreement (an
all-gather) met the peer's K/V all-gather, and gloo aborted the process (SIGABRT, ``72 vs 68``). Like the Llama control
(``test_faults_oom_retry_and_subgroups.py``): every rank ends in a ``CollectiveError`` within the bound (measured
0.3-0.7 s), none dies; the retrying rank refuses before any collective, naming its first failure.
"""

from __future__ import annotations

import functools
from unittest import mock

import pytest

from tests.distributed import fault_harness as harness
from tests.distributed.fault_harness import FAULTY, TIMEOUT_S, _build, _with

pytestmark = pytest.mark.distributed

BOUND_S = TIMEOUT_S + 10.0


def _model():
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model

    config = tiny_config("qwen3_next")
    assert config.layer_types[:2] == ["linear_attention", "full_attention"], config.layer_types
    return build_model(config, "blockdiag_cp").train()


def _oom(*_args, **_kwargs):
    import torch

    raise torch.OutOfMemoryError("injected OOM")


def _retry(rank, world, mesh, config, *, where: str, exchange: str) -> None:
    """Rank ``FAULTY`` raises at ``where`` in its first forward, catches it and steps again; the peer steps once."""
    import torch

    from hf_blockdiag_cp.recurrent.scan_runner import ScanRunner

    ctx, ids, pos = _build(rank, world, mesh["cp"].get_group(), _with(config, exchange))
    model = _model()
    if rank == FAULTY:
        if where == "scan":
            patch = mock.patch.object(ScanRunner, "run", _oom)
        else:
            patch = mock.patch.object(type(model.model.layers[0].mlp), "forward", _oom)
        with patch:
            try:
                harness._step(model, ctx, ids, pos)
            except Exception as err:  # what a loop that retries after an OOM does (the runner's is re-raised named)
                if not isinstance(err.__cause__ or err, torch.OutOfMemoryError):
                    raise
    harness._step(model, ctx, ids, pos)


#: ``hybrid_retry_{where}_{K/V exchange}``: each fault with every K/V exchange (the peer waits in a different
#: collective in (b): an all-gather, a halo send, an all-to-all).
RETRIES = {f"hybrid_retry_{where}_{exchange}": functools.partial(_retry, where=where, exchange=exchange)
           for where in ("scan", "mlp") for exchange in ("allgather", "halo", "a2a")}


def _error_before_agreement(rank, world, mesh, config) -> None:
    """Every rank's forward raises before its agreement (targets without ``num_items_in_batch``): no collective was
    left, the group stays usable and the corrected step runs."""
    ctx, ids, pos = _build(rank, world, mesh["cp"].get_group(), config)
    model = _model()
    try:
        model(ids, position_ids=pos, cp_context=ctx, shift_labels=ids, use_cache=False)
    except ValueError as err:
        assert "num_items_in_batch" in str(err), err
    else:
        raise AssertionError("the forward without num_items_in_batch ran")
    harness._step(model, ctx, ids, pos)


def _worker(rank, world, names, ports, cp_size, log_dir, timeout_s):
    harness.SCENARIOS.update(RETRIES, error_before_agreement=_error_before_agreement)
    harness._scenario_worker(rank, world, names, ports, cp_size, log_dir, timeout_s)


def _run(names: list[str], world: int = 2) -> dict[str, list]:
    with mock.patch.object(harness, "_scenario_worker", _worker):
        return harness._run(names, world=world)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", list(RETRIES))
def test_a_rank_retrying_after_an_error_mid_hybrid_forward_ends_in_an_error_on_every_rank(name: str) -> None:
    rows = _run([name])[name]  # one spawn each: a rank whose collective failed keeps its group marked broken
    for rank, (status, error, message, elapsed) in enumerate(rows):
        assert status == "ran", (name, rank, rows[rank])  # not SIGABRT
        assert error == "CollectiveError", (name, rank, rows[rank])
        assert elapsed < BOUND_S, (name, rank, rows[rank])
    # The retry refuses before any collective, naming the first failure.
    assert "refusing to start the blockdiag_cp forward agreement" in rows[FAULTY][2], rows[FAULTY]
    assert "OutOfMemoryError" in rows[FAULTY][2], rows[FAULTY]


@pytest.mark.timeout(120)
def test_an_error_before_the_agreement_leaves_the_group_usable() -> None:
    """The boundary of the fix: only a raise after the agreement breaks the group."""
    rows = _run(["error_before_agreement"])["error_before_agreement"]
    assert all(row[:2] == ("ran", None) for row in rows), rows
