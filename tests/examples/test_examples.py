"""Issue 5 acceptance 2 and the configs: every accelerate config parses; the CPU one launches the
main example, whose loss goes down and whose --check-parity line shows |dloss| <= 1e-5 (fp32)."""

from __future__ import annotations

import glob
import json
import math
import re
from pathlib import Path

import pytest
import yaml

from tests.launch import launch_example, run_example

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(glob.glob(str(ROOT / "configs" / "accelerate" / "*.yaml")))


@pytest.mark.parametrize("path", CONFIGS, ids=[Path(p).stem for p in CONFIGS])
def test_accelerate_configs_parse_and_fit_their_cp_size(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(path)
    raw = yaml.safe_load(Path(path).read_text())
    assert config.num_processes == raw["num_processes"] >= 2
    assert raw["distributed_type"] in ("MULTI_GPU", "FSDP")
    assert raw.get("rdzv_backend") == "static"
    usage = re.search(r"--cp-size (\d+)", Path(path).read_text())
    assert usage, f"{path} must say which --cp-size it is for"
    cp_size = int(usage.group(1))
    assert raw["num_processes"] % cp_size == 0
    if raw["distributed_type"] == "FSDP":
        assert raw["fsdp_config"]["fsdp_version"] == 2
    if raw.get("num_machines", 1) > 1:
        assert raw["num_processes"] % raw["num_machines"] == 0
        assert (raw["num_processes"] // raw["num_machines"]) % cp_size == 0, "a CP group must fit in one node"


def _launch(tmp_path, *args: str, timeout: int = 300, launcher: bool = True) -> dict:
    """examples/train_packed_cp.py on 2 ranks: under ``accelerate launch`` or (``launcher=False``, for the flag
    variants: the launch itself is tested once) forked from the preloaded ranks as the launcher starts them."""
    summary = tmp_path / "summary.json"
    proc = (launch_example if launcher else run_example)("train_packed_cp.py", "--summary-json", str(summary),
                                                         "--no-progress", *args, timeout=timeout)
    assert proc.returncode == 0, proc.output[-8000:]
    result = json.loads(summary.read_text())
    result["stdout"] = proc.output
    return result


@pytest.mark.distributed
@pytest.mark.slow
def test_cpu_config_launches_the_example_loss_falls_and_parity_holds(tmp_path):
    result = _launch(tmp_path, "--cp-size", "2", "--seq-len", "512", "--steps", "20", "--max-docs", "24",
                     "--check-parity", "--output-dir", str(tmp_path / "model"))
    assert result["world"] == 2 and result["cp_size"] == 2
    assert all(math.isfinite(x) for x in result["losses"])
    assert result["last_loss"] < result["losses"][0]
    parity = result["parity"]
    assert parity["abs_loss_diff"] <= 1e-5 and parity["max_grad_diff"] <= 1e-4
    assert re.search(r"parity: loss with CP \(dp 1 x cp 2\) [\d.]+ without CP \(1 process\) [\d.]+ \|dloss\| ",
                     result["stdout"])
    assert "mesh: world 2 = dp 1 x cp 2" in result["stdout"]
    assert "tokens/s" in result["stdout"] and "K/V exchanged per step" in result["stdout"]
    # --output-dir: a normal checkpoint that loads back with the plugin.
    import torch
    from transformers import AutoModelForCausalLM

    import hf_blockdiag_cp  # noqa: F401  (registers the attention, as a user's script would)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", attn_implementation="blockdiag_cp")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]), use_cache=False).logits).all()


@pytest.mark.distributed
@pytest.mark.slow
def test_example_with_fsdp2_and_activation_checkpointing_keeps_parity(tmp_path):
    result = _launch(tmp_path, "--cp-size", "2", "--seq-len", "512", "--steps", "2", "--max-docs", "24",
                     "--check-parity", "--fsdp2", "--grad-checkpointing", "--kv-exchange", "a2a", launcher=False)
    assert result["fsdp2"] and result["kv_exchange_strategy"] == "a2a"
    assert result["parity"]["abs_loss_diff"] <= 1e-5 and result["parity"]["max_grad_diff"] <= 1e-4


@pytest.mark.distributed
def test_example_rejects_a_cp_size_that_does_not_divide_the_world():
    """One line with the fix, printed once (by rank 0, the other rank prints nothing), no traceback, a failing
    exit status on every rank."""
    proc = run_example("train_packed_cp.py", "--cp-size", "3", "--steps", "1", "--max-docs", "4", "--no-progress",
                       timeout=180)
    assert proc.returncode != 0
    errors = [line for line in proc.output.splitlines() if "--cp-size 3" in line]
    assert errors == ["error: --cp-size 3 does not divide the 2 launched processes: use a --cp-size that does "
                      "(1, 2), or launch a multiple of 3 processes"], proc.output
    assert "Traceback" not in proc.output and proc.output.count("error:") == 1, proc.output


#: Run in a fresh interpreter, as a newcomer's script: it loads a model with attn_implementation="blockdiag_cp"
#: before importing hf_blockdiag_cp; with the argument "all" it then checks what the other ranks print.
_NEWCOMER_SCRIPT = """
import json, sys, warnings
sys.path.insert(0, "examples")
import transformers
import setup_errors
from common import example_parser, one_line_errors, quiet_other_ranks, trainer_arguments

setup_errors.OTHER_RANKS_EXIT_AFTER_S = 0.0  # what it prints is checked here; the wait: test_other_ranks_wait_...

config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  num_key_value_heads=1, vocab_size=64)
try:
    with one_line_errors():
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="blockdiag_cp")
except SystemExit as exit:
    status = exit.code
if sys.argv[1:] == ["all"]:
    quiet_other_ranks()
    import datasets
    from trl import SFTConfig
    from hf_blockdiag_cp import BlockDiagCPConfig

    args = example_parser("x", trainer=True).parse_args(["--grad-checkpointing", "--steps", "3"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sft = SFTConfig(**trainer_arguments(args, BlockDiagCPConfig(), "out"), max_length=64)
    print(json.dumps({"progress_bars": datasets.is_progress_bar_enabled(),
                      "transformers_verbosity": transformers.utils.logging.get_verbosity(),
                      "checkpointing": sft.activation_checkpointing,
                      "deprecations": [str(w.message) for w in caught if "checkpointing" in str(w.message)]}))
sys.exit(status)
"""


@pytest.fixture(scope="module")
def newcomers():
    """The script as rank 0 (the forgotten import) and as rank 1 with "all", both fresh interpreters started at
    once (each spends ~10 s of one core importing): ``{rank: CompletedProcess}``."""
    import os
    import subprocess
    import sys

    runs = {rank: (subprocess.Popen([sys.executable, "-c", _NEWCOMER_SCRIPT, *args], cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env={**os.environ, "RANK": str(rank), "TRANSFORMERS_VERBOSITY": "info"}), args)
            for rank, args in ((0, ()), (1, ("all",)))}
    done = {}
    for rank, (proc, args) in runs.items():
        try:
            stdout, stderr = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for other, _ in runs.values():
                other.kill()
            raise
        done[rank] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return done


@pytest.mark.slow
def test_forgotten_import_gives_a_one_line_hint(newcomers):
    proc = newcomers[0]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    assert [line for line in proc.stderr.splitlines() if line.startswith("error:")] == [
        'error: ValueError: attn_implementation="blockdiag_cp" is not registered with transformers: '
        "`import hf_blockdiag_cp` before loading the model (the import registers it)"], proc.stderr


@pytest.mark.slow
def test_other_ranks_stay_quiet_and_trl_arguments_use_current_names(newcomers):
    """A process other than the main one prints no set-up error line, no dataset-preparation progress bar and no
    library INFO/WARNING logs; the TRL example's arguments use ``activation_checkpointing`` (not the deprecated
    ``gradient_checkpointing``)."""
    pytest.importorskip("trl")
    proc = newcomers[1]
    assert proc.returncode == 2 and "error:" not in proc.stderr, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["progress_bars"] is False and report["transformers_verbosity"] == 40, report  # logging.ERROR
    assert report["checkpointing"] is True and report["deprecations"] == [], report


@pytest.mark.distributed
@pytest.mark.slow
def test_example_with_ulysses_size_keeps_parity(tmp_path):
    # Issue 18: --ulysses-size 2 at cp 2 is pure head parallelism (the head all-to-all in every layer).
    result = _launch(tmp_path, "--cp-size", "2", "--seq-len", "512", "--steps", "2", "--max-docs", "24",
                     "--check-parity", "--ulysses-size", "2", launcher=False)
    assert result["parity"]["abs_loss_diff"] <= 1e-5 and result["parity"]["max_grad_diff"] <= 1e-4
    assert "ulysses_size 2" in result["stdout"]


def test_other_ranks_wait_before_exiting_on_a_set_up_error(monkeypatch, capsys):
    """torchrun ends every process when one exits: a process other than the main one must not exit first on a
    set-up error (the main one would be ended before it printed the error line)."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import common
    import setup_errors

    waits = []
    monkeypatch.setattr(setup_errors.time, "sleep", waits.append)
    for rank, expected_waits in (("1", [setup_errors.OTHER_RANKS_EXIT_AFTER_S]), ("0", [])):
        waits.clear()
        monkeypatch.setenv("RANK", rank)
        with pytest.raises(SystemExit) as exit_:
            with common.one_line_errors():
                raise SystemExit("--cp-size 3 does not divide the 2 launched processes")
        assert exit_.value.code == 2 and waits == expected_waits
        err = capsys.readouterr().err
        assert err == ("" if rank == "1" else "error: --cp-size 3 does not divide the 2 launched processes\n"), err
    assert setup_errors.OTHER_RANKS_EXIT_AFTER_S >= 5


@pytest.mark.parametrize(("argv", "world", "message"), [
    (["--max-docs", "0"], "2", "--max-docs 0: give at least 1 document (or leave it out to use them all)"),
    (["--seq-len", "1001"], "2", "--seq-len 1001 is not divisible by the CP size 2 (each rank holds seq_len / "
                                 "cp_size tokens): use a multiple of 2, e.g. --seq-len 1002"),
])
def test_argument_mistakes_end_before_the_ranks_start_work_with_the_line_last_in_torchruns_report(
        argv, world, message, monkeypatch, capsys, tmp_path):
    """Checked before anything distributed starts; torchrun's failure report (printed after the ranks exit, by
    ``accelerate launch`` too) then ends with the same line, read from the rank's error file."""
    import json
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import common

    args = common.example_parser("x").parse_args(argv)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    with pytest.raises(SystemExit) as exit_:
        with common.one_line_errors():
            common.check_common_args(args)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert json.loads(error_file.read_text())["message"] == f"error: {message}"
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == f"error: {message}"  # what torchrun prints as the root cause's last line


@pytest.mark.distributed
@pytest.mark.slow
def test_example_with_a_tiny_hybrid_model_keeps_parity(tmp_path):
    # Issue 24: Qwen3-Next (gated delta rule + convolution layers, state passed between the CP ranks).
    result = _launch(tmp_path, "--cp-size", "2", "--seq-len", "512", "--steps", "2", "--max-docs", "24",
                     "--model", "configs/model/tiny-qwen3-next.json", "--check-parity", launcher=False)
    assert result["parity"]["abs_loss_diff"] <= 1e-5 and result["parity"]["max_grad_diff"] <= 1e-4


# ---- set-up mistakes under the real launcher: the user's last line is the example's ----------------------

#: What libstdc++ prints when torch's launcher process aborts on its way out (exit status -6).
TORCH_AGENT_ABORT = "terminate called without an active exception"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize(("script", "argv", "line"), [
    ("train_packed_cp.py", ("--model", "/nonexistent/model"),
     "error: --model /nonexistent/model: no such file or directory (give a config *.json, a local model directory "
     "or a hub id such as namespace/name)"),
    ("sft_trl_cp.py", ("--data", "missing/docs.jsonl"), "error: --data missing/docs.jsonl: no such file or directory"),
    ("trainer_packed_cp.py", ("--cp-size", "3"),
     "error: --cp-size 3 does not divide the 2 launched processes: use a --cp-size that does (1, 2), or launch a "
     "multiple of 3 processes"),
])
def test_set_up_mistake_under_accelerate_launch_ends_with_the_examples_line(script, argv, line):
    """Issue 35 item 9: no hub error for a missing path, no launcher traceback after the line (the example stops
    the launcher, which then exits 143 without a report); only torch's agent logs its shutdown before it."""
    proc = launch_example(script, *argv, "--steps", "1", "--no-progress", timeout=180)
    lines = [text for text in proc.output.splitlines() if text.strip()]
    if proc.returncode == -6 and lines[-1] == TORCH_AGENT_ABORT:
        # torch's agent itself now and then aborts (std::terminate) on its way out after the SIGTERM, seen once in
        # ~10 CI runs: not the example's doing, and the example's line is still the last one before it
        lines = lines[:-1]
    else:
        assert proc.returncode == 143, proc.output[-4000:]
    assert lines[-1] == line, proc.output[-4000:]
    assert len(lines) <= 6 and "Traceback" not in proc.output and proc.output.count("error:") == 1, proc.output


def test_paths_that_do_not_exist_are_named_and_hub_ids_are_left_to_the_library(tmp_path):
    import argparse
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import setup_errors

    def line(model: str, data: str | None = None) -> str | None:
        try:
            setup_errors.check_paths(argparse.Namespace(model=model, data=data))
        except SystemExit as exit_:
            return exit_.code
        return None

    for missing in ("/nonexistent/model", "./model", "../model", "~/model", "configs/missing.json", "a/b/c"):
        assert line(missing) == (f"--model {missing}: no such file or directory (give a config *.json, a local "
                                 "model directory or a hub id such as namespace/name)"), missing
    for fine in ("Qwen/Qwen2.5-0.5B", "gpt2", str(tmp_path), str(ROOT / "configs" / "model" / "tiny-llama.json")):
        assert line(fine) is None, fine
    assert line("gpt2", str(tmp_path / "docs.jsonl")) == f"--data {tmp_path / 'docs.jsonl'}: no such file or directory"
    for fine in (None, "stdlib", "wikitext:wikitext-2-raw-v1", str(tmp_path / "*.txt")):
        assert line("gpt2", fine) is None, fine


def test_only_an_accelerate_launch_parent_is_ever_signalled(monkeypatch):
    """Outside ``accelerate launch`` (a shell, pytest, a test's fork server, torchrun) the example never signals its
    parent: it prints the line itself."""
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import setup_errors

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert setup_errors.accelerate_agent_pid() is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert setup_errors.accelerate_agent_pid() is None  # the parent here is pytest's (or xdist's) process
