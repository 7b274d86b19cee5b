"""Issue 34: followed as data (scripts/follow_data.py, its docstring defines the counts), ``key`` through one CP = 2
attention call makes at most 10 function visits and 7 re-entries into a module it had left."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import ROOT


@pytest.mark.distributed
@pytest.mark.slow  # ~15 s alone, ~40 s on a loaded machine (two spawned ranks, a traced forward)
@pytest.mark.timeout(240)
def test_key_through_one_cp_attention_call_stays_within_the_bounds():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "follow_data.py"), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["visits"] <= 10 and counts["reentries"] <= 7, proc.stdout
