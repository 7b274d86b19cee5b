"""examples/train_vlm_packed_cp.py under ``accelerate launch`` (configs/accelerate/cpu_cp2.yaml): a tiny
Qwen2.5-VL-style model trains at CP = 2 on packed image-text documents, its loss falls, and step 1's loss and
gradients (vision tower, projector, language model) equal every document run alone through the stock model."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.launch import launch_example

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


@pytest.mark.slow  # ~10 s: two launched ranks
def test_vlm_example_at_cp2_loss_falls_and_matches_each_document_alone(tmp_path):
    summary = tmp_path / "summary.json"
    proc = launch_example("train_vlm_packed_cp.py", "--check-parity", "--no-progress", "--summary-json",
                          str(summary), timeout=240)
    assert proc.returncode == 0, proc.output[-8000:]
    result = json.loads(summary.read_text())
    assert result["world"] == 2 and result["cp_size"] == 2
    assert 0.2 <= result["image_token_share"] <= 0.4, result["image_token_share"]
    losses = result["losses"]
    assert all(math.isfinite(x) for x in losses) and result["last_loss"] < losses[0] - 0.5, losses
    parity = result["parity"]
    assert parity["abs_loss_diff"] <= 1e-5 and parity["max_grad_diff"] <= 1e-4, parity
    assert set(parity["relative_grad_diff"]) == {"language", "projector", "vision"}, parity
    assert max(parity["relative_grad_diff"].values()) <= 1e-5, parity
    # Images were encoded on both ranks and feature rows crossed between them.
    assert min(result["images_encoded_last_step_per_rank"]) >= 1, result
    assert min(result["media_bytes_per_step_per_rank"]) > 0, result
    assert proc.output.count("parity:") == 1, proc.output[-4000:]
    assert re.search(r"parity: loss with CP \(dp 1 x cp 2\) [\d.]+ each document alone \(stock sdpa, 1 process\) "
                     r"[\d.]+ \|dloss\| ", proc.output), proc.output[-4000:]


def test_vlm_example_on_one_process_matches_each_document_alone(tmp_path):
    """CP = 1: the packed rows (all images encoded by the model itself) against every document alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    summary = tmp_path / "summary.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run([sys.executable, str(root / "examples" / "train_vlm_packed_cp.py"), "--check-parity",
                           "--no-progress", "--steps", "3", "--summary-json", str(summary)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-8000:]
    result = json.loads(summary.read_text())
    assert result["world"] == 1 and result["cp_size"] == 1
    parity = result["parity"]
    assert parity["abs_loss_diff"] <= 1e-5 and max(parity["relative_grad_diff"].values()) <= 1e-5, parity
