"""Issue 18 (primitive, faults): a peer that stalls before the head all-to-all, or dies, makes the
waiting rank raise ``CollectiveError`` within the collective timeout (+ 10 s), not hang."""

from __future__ import annotations

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed

TIMEOUT_S = 4.0


def _worker(rank: int, world: int) -> dict:
    import os
    import time

    import torch

    from hf_blockdiag_cp.distributed.exchange import CollectiveError
    from hf_blockdiag_cp.distributed.ulysses import HeadA2A, heads_to_tokens, new_subgroups
    from hf_blockdiag_cp.planning.layout import HeadSplit

    # Both groups exist before anything fails (group creation is collective over every process).
    # Their own timeout (connecting included) is longer, as BlockDiagCPConfig.process_group_timeout is.
    stalled_group, _ = new_subgroups([list(range(world))], world, timeout_s=60)
    dead_group, _ = new_subgroups([list(range(world))], world, timeout_s=60)
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)
    elapsed = {}
    for name, group in (("stalled", stalled_group), ("died", dead_group)):
        if rank == 1:
            if name == "stalled":
                time.sleep(TIMEOUT_S + 4)  # never enters this all-to-all
                continue
            os._exit(3)  # dies without a word before the all-to-all
        ex = HeadA2A.build(HeadSplit(world, 4, 2), rank, group, timeout_s=TIMEOUT_S)
        start = time.monotonic()
        try:
            heads_to_tokens(q, kv, kv, ex)
        except CollectiveError as err:
            elapsed[name] = (time.monotonic() - start, str(err))
        else:
            elapsed[name] = (None, "no error")
    return elapsed


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_stalled_or_dead_peer_fails_the_head_all_to_all_in_bounded_time():
    outcome = run_ranks(_worker, 2, timeout=180, expect_failure=True)
    status, result = outcome[0]
    assert status == "ok", result
    for name in ("stalled", "died"):
        seconds, message = result[name]
        assert seconds is not None, f"{name}: the all-to-all returned although the peer never entered it"
        assert seconds < TIMEOUT_S + 10, f"{name}: {seconds:.1f} s"
        assert "Ulysses q/k/v all-to-all" in message and "CP rank 0" in message, message
    assert outcome[1][0] == "error"  # rank 1 exited on purpose


# ---- layer level: a real tiny-model step through model(**batch) at CP = 2, u = 2 ------------------------

LAYER_SCENARIOS = ("kernel_raises", "sigkill_in_a2a")  # the kill last: the faulty rank dies there
FAULTY = 1


def _layer_worker(rank: int, world: int, log_dir: str) -> dict:
    """Both layer-level faults in one spawn. Every group is created before anything fails (creation is
    collective over every process); each scenario has its own CP group and head subgroups, since a failure
    leaves its groups unusable. A control group lines the ranks up between the scenarios. Each outcome is
    appended to ``log_dir/rank{rank}.jsonl`` at once (the faulty rank is killed by the second scenario)."""
    import json
    import os
    import signal
    import time
    from unittest import mock

    import torch
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    import hf_blockdiag_cp.distributed.ulysses as ulysses
    import hf_blockdiag_cp.kernels.sdpa_doc as sdpa_doc
    from tests.reference import tiny_model

    config = bd.BlockDiagCPConfig(collective_timeout_s=TIMEOUT_S)
    control = dist.new_group(list(range(world)), backend="gloo")
    made = {name: (dist.new_group(list(range(world)), backend="gloo", timeout=config.process_group_timeout),
                   bd.ulysses_groups(None, 2, config=config)) for name in LAYER_SCENARIOS}
    gen = torch.Generator().manual_seed(3)
    examples = [{"input_ids": torch.randint(1, 97, (n,), generator=gen).tolist()} for n in (9, 30, 5, 20)]

    def broken_kernel(*args, **kwargs):
        raise RuntimeError("injected kernel fault")

    calls = []
    real_a2a = ulysses._all_to_all

    def dying_a2a(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the first layer's output all-to-all: the peer is inside it by now
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        return real_a2a(*args, **kwargs)

    faults = {"kernel_raises": mock.patch.object(sdpa_doc, "attention", broken_kernel),
              "sigkill_in_a2a": mock.patch.object(ulysses, "_all_to_all", dying_a2a)}
    outcome = {}
    for name in LAYER_SCENARIOS:
        dist.barrier(group=control)
        group, heads = made[name]
        model = tiny_model("llama", attn_implementation="blockdiag_cp", num_hidden_layers=3,
                           num_key_value_heads=1).train()
        collator = bd.PackingCollator(64, group=group, pad_token_id=0, config=config, ulysses_size=2,
                                      model_config=model.config, ulysses_groups=heads)
        batch = collator(examples)
        assert batch["cp_context"].ulysses_size == 2
        start = time.monotonic()
        try:
            if rank == FAULTY:
                with faults[name]:
                    model(**batch).loss.backward()
            else:
                model(**batch).loss.backward()
            error, message = None, "finished"
        except Exception as err:  # the outcome under test
            error, message = type(err).__name__, str(err)
        outcome[name] = (error, message[:600], time.monotonic() - start)
        with open(os.path.join(log_dir, f"rank{rank}.jsonl"), "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"scenario": name, "outcome": outcome[name]}) + "\n")
    return outcome


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_layer_faults_inside_the_head_all_to_all_fail_every_peer_in_bounded_time(tmp_path):
    """A rank whose kernel raises in the forward, then a rank SIGKILLed inside the head all-to-all: its peer
    raises ``CollectiveError`` naming the Ulysses all-to-all within ``collective_timeout_s`` + 10 s."""
    import json

    outcome = run_ranks(_layer_worker, 2, str(tmp_path), timeout=180, expect_failure=True)
    logs = [{r["scenario"]: r["outcome"] for r in map(json.loads, (tmp_path / f"rank{rank}.jsonl").read_text()
                                                        .splitlines())} for rank in (0, 1)]
    for name in LAYER_SCENARIOS:
        print(f"fault {name}: " + "; ".join(f"rank {rank}: {log[name][0] or 'no error'} after {log[name][2]:.1f} s"
                                            if name in log else f"rank {rank}: died" for rank, log in enumerate(logs)))
    error, message, seconds = logs[0]["kernel_raises"]
    assert error == "CollectiveError" and "Ulysses output all-to-all" in message and "CP rank 0" in message, message
    assert seconds < TIMEOUT_S + 10, f"kernel_raises: {seconds:.1f} s"
    error, message, _ = logs[FAULTY]["kernel_raises"]
    assert error == "CPKernelError" and "injected kernel fault" in message, message

    error, message, seconds = logs[0]["sigkill_in_a2a"]
    assert error == "CollectiveError" and "Ulysses output all-to-all" in message and "CP rank 0" in message, message
    assert seconds < TIMEOUT_S + 10, f"sigkill_in_a2a: {seconds:.1f} s"
    assert "sigkill_in_a2a" not in logs[FAULTY] and outcome[FAULTY][0] != "ok", outcome[FAULTY]  # it really died
    assert outcome[0][0] == "ok", outcome[0]
