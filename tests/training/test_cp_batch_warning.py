"""A batch without a ``cp_context`` (a plain ``DataCollatorForLanguageModeling``-style batch in a manual loop)
on a process with a CP mesh is not sharded: every CP rank runs all of it. A guarded model says so, once."""

from __future__ import annotations

import warnings

import pytest

from tests.launch import run_ranks

pytestmark = pytest.mark.distributed


def _forward_warnings(model, batches) -> list[str]:
    """The UserWarnings of ``model(**b)`` for each of ``batches``, under Python's default filter (once per place)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for batch in batches:
            model(**batch)
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "cp_context" in str(w.message)]


def _warning_worker(rank: int, world: int) -> dict:
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    model = bd.guard_model(tiny_model("llama", attn_implementation="blockdiag_cp"))
    ids = torch.arange(1, 17)[None]
    plain = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}  # what DataCollatorForLanguageModeling gives
    out = {"no mesh": _forward_warnings(model, [plain])}
    bd.init_device_mesh(1)  # data parallelism only: a plain batch is fine
    out["dp mesh"] = _forward_warnings(model, [plain])
    mesh = bd.init_device_mesh(world)
    collator = bd.PackingCollator(16, group=mesh["cp"], pad_token_id=0)
    packed = collator([{"input_ids": list(range(1, 11))}, {"input_ids": list(range(20, 24))}])
    out["cp mesh, packed batch"] = _forward_warnings(model, [packed])
    out["cp mesh, plain batches"] = _forward_warnings(model, [plain, plain, plain])
    return out


def test_plain_batch_on_a_cp_mesh_warns_once():
    for out in run_ranks(_warning_worker, 2, timeout=120):
        assert out["no mesh"] == [] and out["dp mesh"] == [] and out["cp mesh, packed batch"] == [], out
        assert len(out["cp mesh, plain batches"]) == 1, out
        message = out["cp mesh, plain batches"][0]
        assert "cp_size=2" in message and "every CP rank runs all of it" in message, message
        assert "PackingCollator(seq_len, group=mesh['cp']" in message, message
