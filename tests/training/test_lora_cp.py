"""PEFT LoRA under CP (issue 11, part 3): examples/trainer_packed_cp.py --lora on 2 CPU processes (CP = 2, the
``CPTrainer``, activation checkpointing) gives the first step's loss and adapter gradients of one process holding
the same rows without CP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import run_example

pytest.importorskip("peft")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.distributed
@pytest.mark.slow
def test_lora_example_cp2_parity(tmp_path):
    summary_path = tmp_path / "summary.json"
    # --lora-init random: B is not zero, so every adapter matrix (A too) has a gradient in the compared step.
    proc = run_example("trainer_packed_cp.py", "--cp-size", "2", "--max-docs", "24", "--seq-len", "512",
                       "--steps", "2", "--lora", "--lora-r", "4", "--lora-alpha", "8", "--lora-target-modules",
                       "q_proj,v_proj", "--lora-init", "random", "--grad-checkpointing", "--check-parity",
                       "--no-progress", "--summary-json", str(summary_path), timeout=240)
    output = proc.output
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads(summary_path.read_text())
    assert summary["lora"] and summary["cp_size"] == 2 and summary["world"] == 2
    parity = summary["parity"]
    # Only the adapters train: 2 layers x {q_proj, v_proj} x {lora_A, lora_B}, each with a non-zero gradient.
    compared = parity["grads_compared"]
    assert len(compared) == 8 and all(".lora_A." in n or ".lora_B." in n for n in compared), compared
    assert sum(".lora_A." in n for n in compared) == 4 and parity["min_max_abs_grad"] > 0, parity
    assert parity["abs_loss_diff"] <= 1e-5, parity
    assert parity["max_grad_diff"] <= 1e-5, parity
    assert "parity: loss with CP (dp 1 x cp 2)" in output
