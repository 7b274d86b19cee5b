"""Launch settings that silently did something else (issue 11, part 4); each now raises naming the setting.

(a) the examples' CP size defaults to all processes (one place: ``resolve_cp_size``), the summary prints the mesh,
    and the parity line says what ran (never "with CP" without CP);
(b) accelerate's own context parallelism — a config file's ``parallelism_config``, the launcher flag
    ``--parallelism_config_cp_size`` (which accelerate drops on CPU), ``TrainingArguments.parallelism_config`` —
    is refused by the examples and ``CPTrainer`` with a message that names it and points at this package's cp_size;
(c) ``CPTrainer`` accepts any callable collator that exposes its CP topology (attributes, a ``group``, a
    ``functools.partial``), trains exactly with one built on ``from_flattened``, and names what is missing or wrong.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import yaml

from tests.launch import Launched, launch_example, run_ranks

ROOT = Path(__file__).resolve().parents[2]
CPU_CONFIG = ROOT / "configs" / "accelerate" / "cpu_cp2.yaml"


def _common():
    if str(ROOT / "examples") not in sys.path:
        sys.path.insert(0, str(ROOT / "examples"))
    import common

    return common


# ---- (a) the default CP size and what the summary says ------------------------------------------------


def test_default_cp_size_is_all_processes_and_the_summary_says_what_ran(capsys):
    common = _common()
    assert common.resolve_cp_size(None, 2) == 2 and common.resolve_cp_size(None, 8) == 8
    assert common.resolve_cp_size(1, 2) == 1 and common.resolve_cp_size(4, 8) == 4
    with pytest.raises(SystemExit, match="--cp-size 2 needs 2 processes"):
        common.resolve_cp_size(2, 1)

    base = {"losses": [2.0, 1.0], "tokens_per_s": 1.0, "seq_len": 64, "peak_memory_kind": "rss",
            "kv_exchange_strategy": "none", "parity": {"loss_cp": 1.5, "loss_no_cp": 1.5, "abs_loss_diff": 0.0,
                                                       "max_grad_diff": 0.0}}
    for world, dp, cp in [(2, 2, 1), (2, 1, 2), (1, 1, 1)]:
        common.report({**base, "world": world, "dp_size": dp, "cp_size": cp, "peak_memory_gib_per_rank": [0.1] * world,
                       "kv_exchange_bytes_per_step_per_rank": [0.0] * world}, None)
        out = capsys.readouterr().out
        assert f"mesh: world {world} = dp {dp} x cp {cp}" in out, out
        parity = next(line for line in out.splitlines() if line.startswith("parity:"))
        if cp == 1:
            assert "with CP" not in parity and "no CP" in parity and "(no CP)" in out, parity
        else:
            assert parity.startswith("parity: loss with CP (dp 1 x cp 2) "), parity


# ---- (b) accelerate's own CP -------------------------------------------------------------------------


def test_accelerate_launch_flag_is_found_on_the_launcher_command_line():
    from hf_blockdiag_cp.training.checks import _flag_in

    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "x.yaml"]
    assert _flag_in([*launcher, "--parallelism_config_cp_size", "2", "train.py"]) == (
        "--parallelism_config_cp_size 2 on the accelerate launch command line")
    assert _flag_in([*launcher, "--parallelism-config-sp-size=4", "train.py"]).startswith(
        "--parallelism-config-sp-size 4")
    assert _flag_in([*launcher, "--parallelism_config_cp_size", "1", "train.py"]) is None
    assert _flag_in([*launcher, "train.py", "--cp-size", "2"]) is None


def _launch(args: list[str], script: str, timeout: int = 180) -> Launched:
    return launch_example(script, "--steps", "1", "--max-docs", "4", "--no-progress", launcher_args=tuple(args),
                          timeout=timeout)


@pytest.mark.distributed
@pytest.mark.slow  # two processes start (imports) before the refusal
def test_example_refuses_accelerates_cp_flag_on_the_launcher_command_line():
    # accelerate drops the flag on CPU (no --use_parallelism_config): without the check the example would run.
    proc = _launch(["--config_file", str(CPU_CONFIG), "--parallelism_config_cp_size", "2"], "train_packed_cp.py")
    assert proc.returncode != 0, proc.output[-2000:]
    assert "--parallelism_config_cp_size 2 on the accelerate launch command line" in proc.output, proc.output[-3000:]
    assert "--cp-size" in proc.output


@pytest.mark.distributed
@pytest.mark.slow  # two processes start (imports) before the refusal
def test_example_refuses_accelerates_cp_from_a_config_file(tmp_path):
    # A config file's parallelism_config: accelerate launch exports it; the TRL example refuses it first.
    config = yaml.safe_load(CPU_CONFIG.read_text())
    config["parallelism_config"] = {"parallelism_config_cp_size": 2}
    path = tmp_path / "accelerate_cp.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = _launch(["--config_file", str(path)], "sft_trl_cp.py")
    assert proc.returncode != 0, proc.output[-2000:]
    assert "PARALLELISM_CONFIG_CP_SIZE=2" in proc.output, proc.output[-3000:]
    assert "parallelism_config.parallelism_config_cp_size" in proc.output and "--cp-size" in proc.output


def test_cptrainer_refuses_accelerates_cp(tmp_path, monkeypatch):
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    def message(args) -> str:
        with pytest.raises(ValueError) as err:
            bd.CPTrainer(model=tiny_model("llama", attn_implementation="blockdiag_cp"), args=args,
                         train_dataset=[{"input_ids": [1, 2, 3]}], data_collator=bd.PackingCollator(8, pad_token_id=0))
        return str(err.value)

    plain = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    text = message(TrainingArguments(**plain, parallelism_config=ParallelismConfig(cp_size=2)))
    assert text.startswith("TrainingArguments.parallelism_config.cp_size=2:") and "init_device_mesh(cp_size=" in text
    monkeypatch.setenv("PARALLELISM_CONFIG_CP_SIZE", "2")
    text = message(TrainingArguments(**plain))
    assert text.startswith("PARALLELISM_CONFIG_CP_SIZE=2 (set by accelerate launch from the config file's "
                           "parallelism_config.parallelism_config_cp_size)") and "cp_size" in text


# ---- (c) function collators ----------------------------------------------------------------------------


def _flattened(examples, **cp):
    """A function collator: HF's DataCollatorWithFlattening, then this rank's share via ``from_flattened``."""
    from transformers import DataCollatorWithFlattening

    import hf_blockdiag_cp as bd

    return bd.from_flattened(DataCollatorWithFlattening()(examples), pad_token_id=0, **cp)


def _collator_worker(rank: int, world: int, tmp: str) -> dict:
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model
    from tests.training.trainer_setup import documents as _documents
    from tests.training.trainer_setup import reference_step as _reference_step
    from tests.training.trainer_setup import training_args as _training_args

    mesh = bd.init_device_mesh(world)
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    messages = {}

    def trainer(collator, model=None):
        model = model or tiny_model("llama", attn_implementation="blockdiag_cp")
        return bd.CPTrainer(model=model, args=_training_args(tmp), train_dataset=examples, data_collator=collator,
                            mesh=mesh, optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))

    def refused(key: str, collator, *, train: bool = False) -> None:
        try:
            built = trainer(collator)
            if train:
                built.train()
        except ValueError as err:
            messages[key] = str(err)
        else:
            raise AssertionError(f"{key}: no ValueError")

    def closure(batch):  # passes the group itself, but nothing outside can see it
        return _flattened(batch, group=mesh["cp"])

    refused("no topology", closure)
    only_size = lambda batch: _flattened(batch, group=mesh["cp"])  # noqa: E731
    only_size.cp_size = world
    refused("only cp_size", only_size)
    refused("wrong rank", functools.partial(_flattened, cp_size=world, cp_rank=world - 1 - rank))
    lying = lambda batch: _flattened(batch, cp_size=world, cp_rank=world - 1 - rank)  # noqa: E731
    lying.cp_size, lying.cp_rank = world, rank
    refused("lying attributes", lying, train=True)

    closure.cp_size, closure.cp_rank = mesh["cp"].size(), mesh["cp"].get_local_rank()
    trainer(closure)  # accepted: it exposes its topology now
    # Accepted through a functools.partial's group= keyword, and exact: one step of two flattened micro-batches
    # equals one process running every document alone through stock sdpa.
    ref_before, ref_after, ref_loss = _reference_step()
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    built = trainer(functools.partial(_flattened, group=mesh["cp"]), model=model)
    built.train()
    for name, value in model.named_parameters():
        torch.testing.assert_close(ref_before[name] - value.detach(), ref_before[name] - ref_after[name],
                                   rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"update {n}: {m}")
    loss = [h["loss"] for h in built.state.log_history if "loss" in h][0]
    assert loss == pytest.approx(ref_loss, rel=1e-5), (loss, ref_loss)
    return messages


@pytest.mark.distributed
@pytest.mark.slow
def test_function_collators_are_accepted_when_they_expose_their_topology(tmp_path):
    from tests.training.trainer_setup import rank_env as _rank_env

    for rank, messages in enumerate(run_ranks(_collator_worker, 2, str(tmp_path), timeout=240, env=_rank_env(2))):
        text = messages["no topology"]
        assert "does not expose its CP topology" in text and "cp_size" in text and "cp_rank" in text, text
        assert "closure" in text and "build it with group" not in text, text
        text = messages["only cp_size"]
        assert "has a cp_size attribute but no cp_rank" in text, text
        text = messages["wrong rank"]
        assert f"cp_rank={1 - rank} (from its functools.partial keywords)" in text and f"cp_rank={rank}" in text, text
        text = messages["lying attributes"]
        assert f"the batch's cp_context is for cp_size=2, cp_rank={1 - rank}" in text, text
