"""Issue 17: the parameters of a CP group are compared (first step, every N steps); ranks that diverged
(a skipped optimizer.step, DDP over mesh["dp"] only, different seeds) raise a clear error on every rank."""

from __future__ import annotations

import types

import pytest
import torch

from tests.launch import run_ranks


def _consistency_worker(rank: int, world: int) -> dict[str, str]:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(world)  # ("dp", "cp") = (1, world)
    outcome = {}

    def check(name: str, model: torch.nn.Module, step: int, where=None) -> None:
        try:
            bd.check_parameters_consistent(model, mesh if where is None else where, step=step)
            outcome[name] = "ok"
        except bd.ParameterMismatchError as err:
            outcome[name] = str(err)

    model = tiny_model("llama", seed=0)
    check("same", model, 0)
    check("same_group", model, 0, where=dist.group.WORLD)
    # One training step, with optimizer.step skipped on rank 1.
    model.train()
    ids = torch.arange(3, 19)[None]
    model(ids, labels=ids, use_cache=False).loss.backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if rank == 0:
        optimizer.step()
    check("skipped_step", model, 1)
    check("different_seed", tiny_model("llama", seed=rank), 0)
    perturbed = tiny_model("llama", seed=0)
    if rank == 1:
        with torch.no_grad():
            perturbed.model.norm.weight[3] += 1e-6  # the smallest change shows
    check("perturbed", perturbed, 5)
    extra = tiny_model("llama", seed=0)
    if rank == 1:
        extra.register_parameter("extra", torch.nn.Parameter(torch.zeros(2)))
    check("extra_parameter", extra, 0)
    return outcome


@pytest.mark.slow
def test_diverged_parameters_raise_on_every_rank():
    outcomes = run_ranks(_consistency_worker, 2, timeout=240)
    for rank, outcome in enumerate(outcomes):
        assert outcome["same"] == "ok" and outcome["same_group"] == "ok", (rank, outcome)
        for case, step in (("skipped_step", 1), ("different_seed", 0), ("perturbed", 5)):
            message = outcome[case]
            assert f"step {step}: the ranks of the CP group hold different parameters" in message, (rank, case, message)
            assert "mesh['dp'] only" in message and "optimizer.step" in message and "seeds" in message
        assert "model.norm.weight" in outcome["perturbed"] and "1 of" in outcome["perturbed"]
        assert "different parameter sets" in outcome["extra_parameter"], (rank, outcome["extra_parameter"])


def test_callback_checks_at_the_first_step_and_every_n(monkeypatch):
    from hf_blockdiag_cp.training import trainer

    steps = []
    monkeypatch.setattr(trainer, "check_parameters_consistent", lambda model, mesh, *, step: steps.append(step))
    callback = trainer.ParameterConsistencyCallback(mesh="MESH", every=3)
    model = torch.nn.Linear(2, 2)
    for step in range(8):
        callback.on_step_begin(None, types.SimpleNamespace(global_step=step), None, model=model)
    assert steps == [0, 3, 6]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_parameter_check_every_is_validated(bad):
    from hf_blockdiag_cp.training.trainer import CPTrainer

    with pytest.raises(ValueError, match="parameter_check_every"):
        CPTrainer(model=torch.nn.Linear(2, 2), parameter_check_every=bad)


def _trainer_worker(rank: int, world: int, tmp: str) -> str:
    from transformers import TrainerCallback

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model
    from tests.training.trainer_setup import SEQ_LEN
    from tests.training.trainer_setup import documents as _documents
    from tests.training.trainer_setup import training_args as _training_args

    class PerturbOnRank1(TrainerCallback):
        """Runs before the package's check (callbacks run in the order added): the weights of rank 1 drift
        after DDP's initial broadcast, as after a skipped optimizer.step (different seeds alone are
        overwritten by DDP over the whole mesh)."""

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if rank == 1 and state.global_step == 0:
                with torch.no_grad():
                    model.lm_head.weight[0, 0] += 1e-3

    mesh = bd.init_device_mesh(world)
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    collator = bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    trainer = bd.CPTrainer(model=model, args=_training_args(tmp), train_dataset=examples, data_collator=collator,
                           mesh=mesh, callbacks=[PerturbOnRank1()])
    try:
        trainer.train()
    except bd.ParameterMismatchError as err:
        return str(err)
    return "trained"


@pytest.mark.slow
def test_cp_trainer_refuses_ranks_with_different_weights_at_the_first_step(tmp_path):
    from tests.training.trainer_setup import rank_env as _rank_env

    messages = run_ranks(_trainer_worker, 2, str(tmp_path), timeout=300, env=_rank_env(2))
    for message in messages:
        assert "step 0: the ranks of the CP group hold different parameters" in message, message
        assert "lm_head.weight" in message, message
