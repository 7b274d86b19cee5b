"""Issue 27, findings 1 and 8: a forward that raises leaves no stale state in the probe.

A PEFT model wrapping a prepared model carries two hook pairs; the outer one agrees with the CP group and the
inner one skips because the outer's forward is in progress. Before the fix the post-hook was not called when the
forward raised, so the next forward of the pair saw a stale entry and skipped the agreement on every module, and a
plain call without a context was refused as if its layers dropped the context.
"""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bd
import hf_blockdiag_cp.model.prepare as prepare
from tests.reference import tiny_model


class _AgreementReached(Exception):
    """Raised by the spy in place of the collective: the forward got as far as agreeing."""


def _context_and_shard(cp_size: int = 2):
    lengths = [5, 20, 3, 12, 8]
    doc_ids = torch.repeat_interleave(torch.arange(1, 6), torch.tensor(lengths))
    ids = torch.randint(0, 97, (1, doc_ids.numel()), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    ctx = bd.BlockDiagCPContext.build(doc_ids, placement="contiguous", cp_rank=0, cp_size=cp_size, group=None,
                                      input_ids=ids, position_ids=pos)
    sl = slice(ctx.row_offset, ctx.row_offset + ctx.local_len)
    return ctx, ids[:, sl], pos[:, sl]


def _wrapped(kind: str) -> torch.nn.Module:
    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    if kind == "peft":
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    return bd.guard_model(model)


@pytest.mark.parametrize("kind", ["plain", "peft"])
@pytest.mark.parametrize("where", ["forward", "agreement"])
def test_the_forward_after_an_exception_agrees_again(monkeypatch, kind, where):
    model = _wrapped(kind)
    ctx, ids, pos = _context_and_shard()
    calls: list[int] = []
    fail = {"armed": True}

    def spy(module, named):
        calls.append(id(module))
        if where == "agreement" and fail["armed"]:
            fail["armed"] = False
            raise RuntimeError("injected agreement fault")
        raise _AgreementReached

    monkeypatch.setattr(prepare, "agree_forward", spy)
    if where == "forward":  # e.g. an OOM caught by the loop: the agreement passed, then a module raised
        monkeypatch.setattr(prepare, "agree_forward", lambda module, named: calls.append(id(module)))
        embed = model.get_input_embeddings()
        handle = embed.register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("injected OOM")))
        with pytest.raises(RuntimeError, match="injected OOM"):
            model(ids, position_ids=pos, cp_context=ctx, use_cache=False)
        handle.remove()
        monkeypatch.setattr(prepare, "agree_forward", spy)
    else:
        with pytest.raises(RuntimeError, match="injected agreement fault"):
            model(ids, position_ids=pos, cp_context=ctx, use_cache=False)
    probe = model.__dict__[prepare.PROBE_ATTR]
    assert probe.starts == {} and probe.cp_context is None
    before = len(calls)
    with pytest.raises(_AgreementReached):  # the retry agrees (exactly once: the outermost module)
        model(ids, position_ids=pos, cp_context=ctx, use_cache=False)
    assert calls[before:] == [id(model)]
    # Finding 8: a plain call of the bare model without a context after the failed CP forward is not refused.
    base = model.get_base_model() if kind == "peft" else model
    base.model(ids)


def test_a_stale_entry_from_an_interrupted_forward_is_dropped():
    """A forward interrupted by a BaseException (not seen by always_call hooks) leaves its entry: the same module's
    next forward drops it and agrees again instead of taking itself for a nested call."""
    model = _wrapped("plain")
    probe = model.__dict__[prepare.PROBE_ATTR]
    probe.starts[id(model)] = 0
    probe.starts[12345] = 0
    ctx, ids, pos = _context_and_shard()
    calls = []
    original = prepare.agree_forward
    try:
        prepare.agree_forward = lambda module, named: (calls.append(module), (_ for _ in ()).throw(_AgreementReached()))
        with pytest.raises(_AgreementReached):
            model(ids, position_ids=pos, cp_context=ctx, use_cache=False)
    finally:
        prepare.agree_forward = original
    assert calls == [model] and probe.starts == {}
