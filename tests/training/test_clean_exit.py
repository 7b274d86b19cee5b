"""A finished run exits 0 (issue 35, item 5): a world-4 (dp 2 x cp 2) CPTrainer script under the real launcher
ends with status 0, and the package has destroyed every process group by the time the interpreter exits (without
that, gloo's worker threads could still hold a finished collective's tensors then: a hang or SIGABRT at exit).
The soak over many runs beside a second job is scripts/soak_exit.sh."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.launch import CPU_CP2, launch_example

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_world4_cptrainer_script_exits_zero_with_its_groups_destroyed(tmp_path):
    proc = launch_example(str(Path(__file__).with_name("exit_run.py")), str(tmp_path), "2",
                          launcher_args=("--config_file", str(CPU_CP2), "--num_processes", "4"),
                          env={"PYTHONPATH": str(ROOT)}, timeout=400)
    assert proc.returncode == 0, proc.output[-4000:]
    assert "terminate called" not in proc.output
    for rank in range(4):
        assert f"rank {rank}: trained 3 steps" in proc.output, proc.output[-4000:]
        assert f"rank {rank}: process groups destroyed at exit: True" in proc.output, proc.output[-4000:]
