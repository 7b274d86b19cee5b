"""``CPTrainer(offload_activations=True)`` with activation checkpointing at cp = 2 (issue 19): the step is exact.

On CPU ``save_on_cpu`` copies to host memory that is already the host, but the path runs: the saved tensors go
through its pack hook (counted here), the recomputed layers redo their K/V exchange in the backward, and the
parameters after one SGD step equal one process running every document alone through stock ``sdpa``.
"""

from __future__ import annotations

import pytest

from tests.launch import run_ranks
from tests.training.trainer_setup import documents as _documents
from tests.training.trainer_setup import rank_env as _rank_env
from tests.training.trainer_setup import reference_step as _reference_step
from tests.training.trainer_setup import training_args as _training_args

pytestmark = pytest.mark.distributed


def _offload_worker(rank: int, world: int, tmp: str) -> dict:
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    packed = []
    stock = torch.autograd.graph.save_on_cpu

    class CountingSaveOnCpu(stock):
        """save_on_cpu that counts what it packs (to show the offload path ran)."""

        def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counting(tensor):
                packed.append(tuple(tensor.shape))
                return pack(tensor)

            self.pack_hook = counting

    torch.autograd.graph.save_on_cpu = CountingSaveOnCpu
    mesh = bd.init_device_mesh(world)
    _, ref_after, ref_loss = _reference_step()
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    out = {}
    for kind in ("reentrant", "non-reentrant"):
        packed.clear()
        model = tiny_model("llama", attn_implementation="blockdiag_cp")
        args = _training_args(tmp, activation_checkpointing=True,
                              activation_checkpointing_kwargs={"use_reentrant": kind == "reentrant"})
        trainer = bd.CPTrainer(model=model, args=args, train_dataset=examples, mesh=mesh, offload_activations=True,
                               data_collator=bd.PackingCollator(48, group=mesh["cp"], pad_token_id=0),
                               optimizers=(torch.optim.SGD(model.parameters(), lr=1.0), None))
        trainer.train()
        for name, value in model.named_parameters():
            torch.testing.assert_close(value.detach(), ref_after[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{kind} {n}: {m}")
        out[kind] = {"loss": [h["loss"] for h in trainer.state.log_history if "loss" in h][0], "ref": ref_loss,
                     "packed": len(packed), "hidden": sum(s[-1:] == (model.config.hidden_size,) for s in packed)}
    return out


@pytest.mark.slow
def test_offloaded_checkpointed_step_matches_documents_alone(tmp_path):
    for out in run_ranks(_offload_worker, 2, str(tmp_path), timeout=240, env=_rank_env(2)):
        for kind, got in out.items():
            assert got["loss"] == pytest.approx(got["ref"], rel=1e-5), (kind, got)
            assert got["packed"] > 0 and got["hidden"] > 0, (kind, got)
