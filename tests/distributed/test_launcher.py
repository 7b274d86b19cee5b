"""The test launcher's rendezvous cannot race: the process that starts the ranks serves their store and
outlives them (tests/launch.py). Before, ``run_ranks`` picked a free port and let rank 0 bind it and serve
the store, which failed under load with ``DistNetworkError: Connection reset by peer``."""

from __future__ import annotations

import re
import sys
import time

import pytest

from tests.launch import launch_example, run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _sum_of_ranks(rank: int, world: int) -> tuple[int, int, int]:
    import torch
    import torch.distributed as dist

    value = torch.tensor([rank + 1])
    dist.all_reduce(value)
    return rank, world, int(value)


def test_ten_two_rank_runs_in_a_row_all_start():
    start = time.monotonic()
    for run in range(10):
        assert run_ranks(_sum_of_ranks, 2, timeout=120) == [(0, 2, 3), (1, 2, 3)], f"run {run}"
    print(f"10 runs of 2 ranks: {time.monotonic() - start:.1f} s")  # pytest -s, for the report


def _leave_first(rank: int, world: int) -> str:
    import os

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    if rank == 0:  # leaves at once: under the old launcher its process served the store
        store.set("rank0/pid", str(os.getpid()))
        return "left"
    pid = int(store.get("rank0/pid"))
    deadline = time.monotonic() + 60
    while _alive(pid):
        assert time.monotonic() < deadline, f"rank 0 (pid {pid}) did not exit"
        time.sleep(0.05)
    # Rank 0's process is gone; the store still answers (new groups, barriers, a late rank would use it).
    assert store.add("late/count", 1) == 1
    store.set("late/key", "value")
    assert store.get("late/key") == b"value"
    dist.new_group([1], use_local_synchronization=True)  # a group made after a peer left, through the store
    return "stayed"


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_store_outlives_a_rank_that_leaves_first():
    assert run_ranks(_leave_first, 2, timeout=120) == ["left", "stayed"]


# One write per line: the ranks share the launcher's stdout pipe, and print() writes its parts separately (seen
# under load: "probeprobe 0 ..."); a single write of under PIPE_BUF bytes is not interleaved.
PROBE = """import os, sys
fields = ("probe", os.environ["RANK"], os.environ["MASTER_PORT"], os.environ["TORCHELASTIC_USE_AGENT_STORE"],
          os.environ["TORCHELASTIC_RUN_ID"], str(os.getppid()))
sys.stdout.write(" ".join(fields) + "\\n")
sys.stdout.flush()
"""


@pytest.mark.slow
def test_launch_example_uses_a_store_its_launcher_binds_and_serves(tmp_path):
    # torchrun's standalone rendezvous (c10d on localhost:0): the launcher process, the ranks' parent, binds an
    # OS-chosen port itself and serves the ranks' store; with the config's static rendezvous on a port picked
    # beforehand the run id would be "none".
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    proc = launch_example(str(probe), timeout=180)  # an absolute path replaces examples/<script>
    assert proc.returncode == 0, proc.output[-3000:]
    lines = sorted(re.findall(r"^probe (\d) (\d+) (\S+) (\S+) (\d+)$", proc.output, flags=re.M))
    assert [line[0] for line in lines] == ["0", "1"], proc.output[-3000:]
    (_, port0, agent0, run0, parent0), (_, port1, agent1, run1, parent1) = lines
    assert agent0 == agent1 == "True"  # the ranks connect to the launcher's store as clients
    assert port0 == port1 and run0 == run1 != "none" and parent0 == parent1


def test_a_rank_set_that_fails_to_start_is_stopped_and_started_again(capfd):
    # Rank 1 fails to create the group on the first attempt (what gloo's connectFullMesh does on a busy machine):
    # rank 0, waiting for it inside init_process_group, is stopped at once instead of waiting out its timeout, and
    # the whole set starts again on a fresh store.
    start = time.monotonic()
    results = run_ranks(_sum_of_ranks, 2, timeout=120, pg_timeout_s=600, env={1: {"_FAIL_STARTUP_ON_ATTEMPT": "0"}})
    elapsed = time.monotonic() - start
    assert results == [(0, 2, 3), (1, 2, 3)]
    err = capfd.readouterr().err
    assert "attempt 1/3 of _sum_of_ranks on 2 ranks failed to start" in err and "connectFullMesh" in err, err
    assert elapsed < 100, f"{elapsed:.0f} s: the peer waited for its 600 s group timeout"


def test_a_rank_set_that_never_starts_fails_with_the_cause():
    import tests.launch as launch

    # One attempt allowed, and it fails: the error names the cause (not a timeout).
    attempts, launch.STARTUP_ATTEMPTS = launch.STARTUP_ATTEMPTS, 1
    try:
        with pytest.raises(AssertionError, match="failed to create their process group 1 times(.|\\n)*connectFullMesh"):
            run_ranks(_sum_of_ranks, 2, timeout=120, env={0: {"_FAIL_STARTUP_ON_ATTEMPT": "0"}})
    finally:
        launch.STARTUP_ATTEMPTS = attempts
