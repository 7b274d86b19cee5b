"""Shared checks of the recurrent tests (a harness, not a test file): a packed row at CP = 1 in every batch form, and
one CP training step of a tiny model on gloo ranks, both against each document alone.

The CP step: the packed batch through ``model(**batch)`` (under bf16 autocast if asked), ``loss.backward()``, every
parameter gradient all-reduced over the ranks (the sum of the ranks' parts is the whole row's gradient). The check:
the logits of this rank's real tokens (mapped back through ``local_index``) and every gradient against
:func:`tests.reference.documents_alone`'s, with the tolerances the recurrent tests state (bf16: loose).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_blockdiag_cp.conformance.runs import VARIANTS, grad_error, packed_inputs, packed_run, reference_run


def assert_packed_rows_match(stock: torch.nn.Module, ours: torch.nn.Module, docs: list[torch.Tensor], pad_id: int,
                             variants: tuple[str, ...] = VARIANTS, label: str = ""
                             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The packed row of ``docs`` through ``ours`` (``attn_implementation="blockdiag_cp"``) in each batch form of
    ``variants`` equals each document alone through ``stock``: logits within 1e-5 of their largest, gradients within
    1e-4 (relative). Returns the reference ``(logits [T, V], gradients)``."""
    ref_logits, ref_grads = reference_run(stock, docs)
    for variant in variants:
        logits, grads = packed_run(ours, docs, packed_inputs(docs, variant, pad_id))
        err = (logits - ref_logits).abs().max().item() / ref_logits.abs().max().item()
        assert err < 1e-5, f"{label} {variant}: logits differ by {err:.2e}"
        assert grad_error(grads, ref_grads) < 1e-4, f"{label} {variant}: gradients differ"
    return ref_logits, ref_grads


@dataclass
class Step:
    """What one step left: the model's output, the batch's context, which local rows are real tokens, the bytes this
    rank sent in the forward's collectives."""

    out: Any
    ctx: Any
    real: torch.Tensor
    sent_forward: int


def cp_step(model: torch.nn.Module, batch: dict[str, Any], bf16: bool = False) -> Step:
    """Forward, backward and the gradient all-reduce of ``batch`` (a CP collator's) on this rank."""
    import torch.distributed as dist

    from hf_blockdiag_cp import comm_stats

    ctx = batch["cp_context"]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        out = model(**batch)
    sent_forward = sum(s for phase, s, _ in comm_stats(ctx).per_call if phase == "forward")
    out.loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    return Step(out, ctx, ctx.doc_ids[0, ctx.local_index] != 0, sent_forward)


def assert_matches_documents_alone(key: str, step: Step, model: torch.nn.Module, ref_logits: torch.Tensor,
                                   ref_grads: dict[str, torch.Tensor], bf16: bool = False) -> None:
    """This rank's logits and the all-reduced gradients equal each document alone (``ref_*``); ``key`` names it."""
    tol = dict(rtol=3e-2, atol=3e-2) if bf16 else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(step.out.logits[0][step.real].float(), ref_logits[step.ctx.local_index[step.real]],
                               **tol, msg=lambda m: f"{key} logits vs documents alone: {m}")
    gtol = dict(rtol=5e-2, atol=5e-3) if bf16 else dict(rtol=1e-4, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], **gtol,
                                   msg=lambda m, n=name: f"{key} grad {n} vs documents alone: {m}")


def packed_batch(docs: list[torch.Tensor], seq_len: int, placement: str) -> dict[str, Any]:
    """The CP collator's batch of ``docs`` on the default group (one row of ``seq_len``, padding id 0)."""
    import torch.distributed as dist

    import hf_blockdiag_cp as bd

    collator = bd.PackingCollator(seq_len, group=dist.group.WORLD, pad_token_id=0, placement=placement,
                                  config=bd.BlockDiagCPConfig(collective_timeout_s=60))
    return collator([{"input_ids": d.tolist()} for d in docs])


def family_step_reports(kind: str, runs: list[tuple[Any, str, bool, bool]], layouts: dict[str, list[int]],
                        seq_len: int, rank: int, world: int, alone: Any,
                        expected_bytes: Any) -> dict[str, dict[str, Any]]:
    """One CP training step per layout x ``runs`` entry ``(config, placement, checkpointing, bf16)``, each checked
    against each document alone; per step a report row: fragments continuing on this rank, whether it holds padding
    only, whether it sends out of document order, the forward bytes sent, whether ``config is alone`` (every byte is
    the recurrent gathers') and the bytes ``expected_bytes(model, slots, world)`` predicts."""
    from hf_blockdiag_cp.conformance.runs import build_model
    from hf_blockdiag_cp.recurrent.runs import _cached_plan
    from tests.reference import documents_alone

    report = {}
    gen = torch.Generator().manual_seed(7)
    for layout, lengths in layouts.items():
        docs = [torch.randint(3, runs[0][0].vocab_size, (n,), generator=gen) for n in lengths]
        for cfg, placement, checkpointing, bf16 in runs:
            types = getattr(cfg, "layer_types", None) or getattr(cfg, "block_types", None)
            key = f"{layout}/{types}/{placement}/ckpt={checkpointing}/bf16={bf16}"
            ref = documents_alone(kind, docs, build_model(cfg, None).train(),
                                  autocast=torch.bfloat16 if bf16 else None)
            model = build_model(cfg, "blockdiag_cp").train()
            if checkpointing:
                model.activation_checkpointing_enable()
            step = cp_step(model, packed_batch(docs, seq_len, placement), bf16)
            assert_matches_documents_alone(key, step, model, ref.logits, ref.grads, bf16)
            plan = _cached_plan(step.ctx)
            report[key] = dict(continuing=len(plan.sources[rank]), padding_only=not bool(step.real.any()),
                               out_of_order=list(plan.send[rank]) != sorted(plan.send[rank]),
                               sent_forward=step.sent_forward, alone=cfg is alone,
                               expected=expected_bytes(model, plan.slots, world))
    return report


def assert_family_reports(reports: list[dict[str, dict[str, Any]]], world: int, out_of_order: bool = False) -> None:
    """What :func:`family_step_reports` found over the ranks: some fragment continued a document; the recurrent-only
    model sent the bytes of its formula; at CP = 4 some rank held padding only (and, if asked, sent out of order)."""
    assert sum(r[k]["continuing"] for r in reports for k in r) > 0, "no fragment continued a document"
    for r in reports:
        for key, row in r.items():
            if row["alone"]:
                assert row["sent_forward"] == row["expected"] > 0, (key, row)
    if world == 4:
        assert any(r[k]["padding_only"] for r in reports for k in r)
        if out_of_order:
            assert any(r[k]["out_of_order"] for r in reports for k in r)
