"""Issue 36: the placement the collator chooses for a hybrid model (``model_config=``, no ``placement=``) is exact.

One tiny training step on P = 2 and 4 gloo ranks (one spawn per P) of a gated-delta-rule model (qwen3_next, its
layers given a slow decay so that a wrong hand-off shows), an SSD model (bamba) and a short-convolution model (lfm2),
on rows whose chosen placement cuts documents over ranks: logits mapped back through ``local_index`` and the
all-reduced gradients equal each document run alone through the unmodified model. One more row per family asks for
``placement="mirror"`` (documents reordered, two stretches per rank, cut documents on both ends at P = 4), so that
placement runs exactly at both sizes whatever the choice. A collator given ``model_config`` on one rank only (its
placement differs from its peers') ends in an AgreementError on every rank.
"""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_ranks
from tests.recurrent.harness import assert_matches_documents_alone, cp_step
from tests.reference import documents_alone

SEQ_LEN = 48
LAYOUTS = {"mixed": [5, 21, 1, 9, 12], "long_first": [30, 6, 4, 8]}
#: Scenarios: ``(layout, placement asked for)``; ``None`` = the one the collator chooses.
SCENARIOS = [("mixed", None), ("long_first", None), ("mixed", "mirror")]
KINDS = ("qwen3_next", "bamba", "lfm2")


def _worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.multimodal import make_stateful
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.recurrent.runs import _cached_plan

    report = {}
    for kind in KINDS:
        config = tiny_config(kind)
        for layout, placement in SCENARIOS:
            gen = torch.Generator().manual_seed(11)
            docs = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in LAYOUTS[layout]]
            stock = build_model(config, None).train()
            model = build_model(config, "blockdiag_cp").train()
            if kind == "qwen3_next":
                assert make_stateful(stock) and make_stateful(model)
            ref_logits, ref_grads = documents_alone(kind, docs, stock)
            collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0, model_config=config,
                                          placement=placement, config=bd.BlockDiagCPConfig(collective_timeout_s=60))
            step = cp_step(model, collator([{"input_ids": d.tolist()} for d in docs]))
            assert placement is None or step.ctx.placement.kind == placement
            key = f"{layout}/{kind}/P={world}/{step.ctx.placement.kind}"
            assert_matches_documents_alone(key, step, model, ref_logits, ref_grads)
            report[key] = len(_cached_plan(step.ctx).sources[rank])
    # model_config given on rank 0 only: its placement is the hybrid one, the others' balanced; every rank must
    # refuse at the agreement (a clear error), none may finish a step on a placement its peers do not hold.
    config = tiny_config("qwen3_next")
    model = build_model(config, "blockdiag_cp").train()
    collator = bd.PackingCollator(SEQ_LEN, group=dist.group.WORLD, pad_token_id=0,
                                  model_config=config if rank == 0 else None,
                                  config=bd.BlockDiagCPConfig(collective_timeout_s=60))
    gen = torch.Generator().manual_seed(11)
    docs = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in LAYOUTS["long_first"]]
    try:
        model(**collator([{"input_ids": d.tolist()} for d in docs])).loss.backward()
        report["_one_rank_model_config"] = "finished"
    except bd.AgreementError as err:
        report["_one_rank_model_config"] = str(err)
    return report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_chosen_placement_matches_documents_alone(world: int) -> None:
    reports = run_ranks(_worker, world, timeout=900)
    assert any(k.endswith("/hybrid") for k in reports[0]), reports[0]  # the hybrid placement was chosen and run
    for r in reports:
        assert "differ in placement" in r.pop("_one_rank_model_config"), r
    for kind in KINDS:  # every family continued a document across ranks, under the mirror placement too
        assert sum(r[k] for r in reports for k in r if f"/{kind}/" in k) > 0, (kind, reports)
        assert sum(r[k] for r in reports for k in r if f"/{kind}/" in k and k.endswith("/mirror")) > 0, (kind, reports)
