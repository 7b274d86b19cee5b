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
