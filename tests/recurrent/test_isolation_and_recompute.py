"""The recurrent path keeps the attention path's guarantees (issue 35, items 1 and 2).

- A non-finite document stays in its document under state passing: NaN in one document's embeddings (a document split
  over the ranks) leaves every other document's logits those of the document alone, at CP = 2 under every placement
  and at CP = 4 (a gated delta rule, an SSD and a convolution model).
- Two packed forwards and one backward with activation checkpointing (DPO's chosen / rejected, summed micro-batches),
  reentrant and non-reentrant, at CP = 1 and CP = 2: through transformers' checkpointing each recompute reads its
  own forward's fragments (:mod:`hf_blockdiag_cp.model.forward_runs`) and the gradients equal each document alone;
  through torch's checkpoint wrapper (which carries nothing) refused naming the cause, and a backward per forward
  is exact. The same for stablelm at CP = 2 (attention only; its layers drop the model's kwargs, so the recompute
  reads the forward's held ``cp_context``).

Gated delta rule layers get ``A_log = -4`` (decay ~0.97 per token): tiny random configs forget their state after one
token, which would let a wrong hand-off pass unseen.
"""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.conformance.multimodal import make_stateful

KINDS = ("qwen3_next", "bamba", "lfm2")  # gated delta rule + conv, SSD + conv, conv
SEQ_LEN = 48
FIRST = [5, 21, 1, 9, 12]  # the 21-token document is split at CP = 2 and 4 by every placement
SECOND = [30, 7, 11]


def _docs(lengths: list[int], vocab: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=gen) for n in lengths]


def _vocab(kind: str) -> int:
    from hf_blockdiag_cp.conformance.configs import tiny_config

    return tiny_config(kind).vocab_size


def _models(kind: str):
    from hf_blockdiag_cp.conformance.configs import tiny_config
    from hf_blockdiag_cp.conformance.runs import build_model

    config = tiny_config(kind)
    stock = build_model(config, None).train()
    make_stateful(stock)
    ours = build_model(config, "blockdiag_cp").train()
    ours.load_state_dict(stock.state_dict())
    return config, stock, ours


def _poison(model: torch.nn.Module, rows: torch.Tensor):
    """A hook setting the embeddings of local rows ``rows`` (bool ``[L]``) to NaN."""
    def hook(module, args, out):
        out = out.clone()
        out[:, rows] = float("nan")
        return out
    return model.get_input_embeddings().register_forward_hook(hook)


def _nan_isolation(kind: str, placements: tuple[str, ...]) -> None:
    from tests.recurrent.harness import packed_batch
    from tests.reference import documents_alone

    config, stock, ours = _models(kind)
    docs = _docs(FIRST, config.vocab_size, 1)
    ref = documents_alone(kind, docs, stock, backward=False).logits
    bad = 2  # the document of 21 tokens (ids count from 1)
    for placement in placements:
        batch = packed_batch(docs, SEQ_LEN, placement)
        ctx = batch["cp_context"]
        local_ids = ctx.doc_ids[0, ctx.local_index]
        handle = _poison(ours, local_ids == bad)
        try:
            with torch.no_grad():
                logits = ours(**batch).logits[0]
        finally:
            handle.remove()
        keep = (local_ids != 0) & (local_ids != bad)
        assert torch.isfinite(logits[keep]).all(), f"{kind} {placement}: NaN reached another document"
        torch.testing.assert_close(logits[keep], ref[ctx.local_index[keep]], rtol=1e-4, atol=1e-5,
                                   msg=lambda m, p=placement: f"{kind} {p}: neighbours of a NaN document: {m}")


def _wrap_layers_with_torch_checkpoint(model: torch.nn.Module, reentrant: bool) -> None:
    """Checkpoint every decoder layer the way FSDP / accelerate do (torch's ``checkpoint_wrapper``), not through
    transformers' ``gradient_checkpointing_enable``."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from transformers.modeling_layers import GradientCheckpointingLayer

    impl = CheckpointImpl.REENTRANT if reentrant else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=lambda m: checkpoint_wrapper(m, checkpoint_impl=impl),
                                   check_fn=lambda m: isinstance(m, GradientCheckpointingLayer))


def _two_forwards(kind: str, reentrant: bool, batches: list[dict], docs: list[list[torch.Tensor]],
                  distributed: bool) -> None:
    """Two packed forwards (different document boundaries), one backward, transformers' checkpointing on: each
    layer's recompute reads its own forward's fragments (carried by the checkpoint), so the summed gradients equal
    each document alone. The same with torch's checkpoint wrapper, which carries nothing: refused naming the cause;
    there a backward per forward is exact."""
    from hf_blockdiag_cp.errors import UnsupportedModel
    from tests.reference import documents_alone

    config, stock, ours = _models(kind)
    ref = {}
    for part in docs:
        for name, grad in documents_alone(kind, part, stock).grads.items():
            ref[name] = ref.get(name, 0) + grad
            stock.zero_grad()

    def check(model: torch.nn.Module, what: str) -> None:
        for name, p in model.named_parameters():
            grad = p.grad
            if distributed:
                import torch.distributed as dist

                dist.all_reduce(grad)
            name = name.replace("_checkpoint_wrapped_module.", "")
            torch.testing.assert_close(grad, ref[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=name: f"{kind} reentrant={reentrant} {what} grad {n}: {m}")

    ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    sum(ours(**batch).loss for batch in batches).backward()
    check(ours, "two forwards, one backward")

    _, _, ours = _models(kind)
    _wrap_layers_with_torch_checkpoint(ours, reentrant)

    def refusal() -> str:
        losses = [ours(**batch).loss for batch in batches]
        try:
            sum(losses).backward()
        except UnsupportedModel as err:  # the traceback (and the graphs it holds) goes with this frame
            return str(err)
        return "no error"

    assert "packed forwards wait for this backward" in refusal()
    _, _, ours = _models(kind)  # a fresh model: a backward that raised may leave its graphs alive
    _wrap_layers_with_torch_checkpoint(ours, reentrant)
    for batch in batches:  # a backward per forward: each recompute reads its own (the latest) forward's fragments
        ours(**batch).loss.backward()
    check(ours, "torch checkpoint_wrapper, a backward per forward")


def _worker(rank: int, world: int) -> dict:
    from tests.recurrent.harness import packed_batch

    for kind in KINDS:
        _nan_isolation(kind, ("balanced", "contiguous", "zigzag"))
        if world == 2:
            docs = [_docs(FIRST, _vocab(kind), 2), _docs(SECOND, _vocab(kind), 3)]
            for reentrant in (True, False):
                batches = [packed_batch(d, SEQ_LEN, "balanced") for d in docs]
                _two_forwards(kind, reentrant, batches, docs, distributed=True)
    if world == 2:  # attention only, whose layers drop the model's kwargs: the recompute reads the held cp_context
        docs = [_docs(FIRST, _vocab("stablelm"), 2), _docs(SECOND, _vocab("stablelm"), 3)]
        for reentrant in (True, False):
            batches = [packed_batch(d, SEQ_LEN, "balanced") for d in docs]
            _two_forwards("stablelm", reentrant, batches, docs, distributed=True)
    return {}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_nan_isolation_and_two_forwards_one_backward_under_cp(world: int) -> None:
    from tests.launch import run_ranks

    run_ranks(_worker, world, timeout=900)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_two_forwards_one_backward_with_checkpointing_at_cp1(kind: str, reentrant: bool) -> None:
    import hf_blockdiag_cp as bd

    collator = bd.PackingCollator(SEQ_LEN, pad_token_id=0)
    docs = [_docs(FIRST, _vocab(kind), 2), _docs(SECOND, _vocab(kind), 3)]
    batches = [collator([{"input_ids": d.tolist()} for d in part]) for part in docs]
    _two_forwards(kind, reentrant, batches, docs, distributed=False)
