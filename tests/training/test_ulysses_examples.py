"""Issue 18: the Trainer-driven examples take ``--ulysses-size`` (head-parallel CP) and stay exact.

At CP = 2 with ``--ulysses-size 2`` every layer runs the head all-to-all (pure Ulysses, ``u = 2 x c = 1``):
examples/trainer_packed_cp.py builds its own collator (model heads, ``bd.ulysses_groups``), examples/sft_trl_cp.py
lets ``CPSFTTrainer`` build one from ``cp_config``. The first step's loss and gradients must equal one process
without CP (trainer: the same rows; TRL: every document alone through ``sdpa``), and the summary must show that
the steps really used ``u = 2``.
"""

from __future__ import annotations

import json
import math

import pytest

from tests.launch import run_example

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _run(tmp_path, script: str, *args: str) -> tuple[dict, str]:
    summary_path = tmp_path / "summary.json"
    proc = run_example(script, "--cp-size", "2", "--ulysses-size", "2", "--check-parity", "--no-progress",
                       "--summary-json", str(summary_path), *args, timeout=240)
    assert proc.returncode == 0, proc.output[-6000:]
    return json.loads(summary_path.read_text()), proc.output


def _check_ulysses_parity(summary: dict, output: str) -> None:
    assert summary["world"] == 2 and summary["cp_size"] == 2 and summary["dp_size"] == 1
    assert summary["ulysses_size"] == 2 and summary["ulysses_size_last_step"] == 2, summary
    assert summary["kv_exchange_strategy"] == "none", summary  # c = 1: the head all-to-all moves everything
    assert "ulysses_size 2" in output and "layout: ulysses_size 2 (last step: u=2 x c=1)" in output
    assert all(math.isfinite(x) for x in summary["losses"]), summary["losses"]
    parity = summary["parity"]
    assert len(parity["grads_compared"]) > 10 and parity["min_max_abs_grad"] > 0, parity
    assert parity["abs_loss_diff"] <= 1e-5, parity
    assert parity["max_grad_diff"] <= 1e-4, parity
    assert "parity: loss with CP (dp 1 x cp 2)" in output


@pytest.mark.timeout(300)
def test_trainer_example_ulysses_size_2_keeps_parity(tmp_path):
    summary, output = _run(tmp_path, "trainer_packed_cp.py", "--max-docs", "24", "--seq-len", "512", "--steps", "2")
    _check_ulysses_parity(summary, output)


@pytest.mark.timeout(300)
def test_sft_example_ulysses_size_2_keeps_parity(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    summary, output = _run(tmp_path, "sft_trl_cp.py", "--max-docs", "16", "--eval-docs", "3", "--seq-len", "512",
                           "--steps", "2")
    _check_ulysses_parity(summary, output)
    parity = summary["parity"]
    assert parity["abs_eval_loss_diff"] <= 1e-5, parity  # evaluation through the same head-parallel collator
