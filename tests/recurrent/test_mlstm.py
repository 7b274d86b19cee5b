"""Issue 24: xLSTM's mLSTM backend served whole per fragment (``SCAN_MODULES``).

References: each document alone through the unmodified model (CP = 1 for the three packed batch forms; CP = 2 and
4 on gloo with documents in several fragments, several placements, activation checkpointing, a rank holding only
padding; under bf16 autocast no further from the fp32 reference than twice the stock model's own bf16 run), and the
module itself in float64 over a whole document against two fragments composed. A chunk size of 16 makes the
mLSTM's chunkwise kernel run inside fragments.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import (
    build_model,
    grad_error,
    make_documents,
)
from hf_blockdiag_cp.mixer_hooks import INSTALLED_ATTR
from hf_blockdiag_cp.mixer_table import SCAN_MODULES
from hf_blockdiag_cp.model.detect import packing_refusal
from tests.launch import run_ranks
from tests.recurrent.harness import assert_matches_documents_alone, assert_packed_rows_match, cp_step, packed_batch
from tests.reference import documents_alone


def _config():
    config = tiny_config("xlstm")
    config.chunk_size = 16
    return config


def test_mlstm_backend_is_served_and_transformers_names_still_match() -> None:
    spec = SCAN_MODULES["xLSTMBackend"]
    model = build_model(_config(), "blockdiag_cp")
    assert packing_refusal(model) is None
    modules = [m for m in model.modules() if type(m).__name__ == spec.name]
    assert modules, "xlstm: no xLSTMBackend (transformers renamed it?)"
    params = tuple(inspect.signature(type(modules[0]).forward).parameters)[1:]
    assert params[:len(spec.params)] == spec.params, params
    assert all(INSTALLED_ATTR in m.__dict__ for m in modules)


def test_packed_rows_equal_each_document_alone() -> None:
    config = _config()
    stock, ours = build_model(config, None), build_model(config, "blockdiag_cp")
    docs = make_documents(config, lengths=(7, 23, 1, 18, 12))  # longer than a chunk (16)
    assert_packed_rows_match(stock, ours, docs, config.pad_token_id or 0)


def test_mlstm_composition_matches_the_whole_document_in_float64() -> None:
    """Two fragments of one document: the second run from the state the first leaves equals the whole document's
    outputs, and the state composed of both fragments' ``(C_0, n_0, m_0, F)`` stands for the whole run's last state
    (the module in float64)."""
    from hf_blockdiag_cp.recurrent.algebra import Summary
    from hf_blockdiag_cp.recurrent.module_runners import ScanModuleRunner

    def _call(spec, original, named, row, start, length, state):
        frag = type("Fragment", (), {"row": row, "start": start, "length": length})
        outs, ends = ScanModuleRunner(spec, original, named, True, [frag]).run([frag], state and [state], True)
        return outs[0], ends[0]

    def _summary(spec, named, f, last, continues):
        return spec.algebra(named).pack(Summary(last, spec.transition(named, f) if continues else None))

    def _compose(rows, heads, dqk, dv):
        return spec.algebra(named).fold(rows, [1] * len(rows))

    spec = SCAN_MODULES["xLSTMBackend"]
    config = _config()
    # eps = 0: the module's output then depends on the state it stands for alone, not on the stabilizer m, which
    # differs with the chunking (with eps the module's own result moves by ~eps * exp(m) between chunkings).
    config.eps = 0.0
    backend = next(m for m in build_model(config, None).double().modules() if type(m).__name__ == spec.name)
    torch.manual_seed(5)
    # Whole chunks of 16 only: the module's step kernels (for a remainder under 16) keep their state in float32.
    heads, length, dqk, dv, cut = 4, 48, 8, 16, 32
    named = {"query": torch.randn(1, heads, length, dqk, dtype=torch.float64),
             "key": torch.randn(1, heads, length, dqk, dtype=torch.float64),
             "value": torch.randn(1, heads, length, dv, dtype=torch.float64),
             "igate": torch.randn(1, heads, length, dtype=torch.float64),
             "fgate": torch.randn(1, heads, length, dtype=torch.float64) + 2}
    whole, whole_last = _call(spec, backend.forward, named, 0, 0, length, None)

    class Piece:
        row, start = 0, 0
        length = cut

    first_h, first_last = _call(spec, backend.forward, named, 0, 0, cut, None)
    second = type("Second", (), {"row": 0, "start": cut, "length": length - cut})
    _, second_zero = _call(spec, backend.forward, named, 0, cut, length - cut, None)
    rows = [_summary(spec, named, Piece, first_last, False), _summary(spec, named, second, second_zero, True)]
    state = _compose(rows[:1], heads, dqk, dv)
    second_h, _ = _call(spec, backend.forward, named, 0, cut, length - cut, tuple(t.double() for t in state))
    # The summaries travel in fp32 (as between ranks): agreement to fp32 rounding of the state.
    torch.testing.assert_close(torch.cat([first_h, second_h], 2), whole, rtol=1e-5, atol=1e-6)
    # The composed end state stands for the same (C, n) * exp(m) as the whole run's (m is only a stabilizer).
    c, n, m = _compose(rows, heads, dqk, dv)
    wc, wn, wm = whole_last
    torch.testing.assert_close(c.double() * torch.exp(m.double())[..., None], wc * torch.exp(wm)[..., None],
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(n.double() * torch.exp(m.double()), wn * torch.exp(wm), rtol=1e-5, atol=1e-6)


SEQ_LEN = 48
LAYOUTS = {"mixed": [5, 21, 1, 9, 12], "one_doc": [48], "mostly_padding": [10, 4]}
# (model type, placement, activation checkpointing, bf16 autocast)
CASES = [("xlstm", "zigzag", False, False), ("xlstm", "balanced", True, False), ("xlstm", "contiguous", False, True)]


def _worker(rank: int, world: int) -> dict:

    from hf_blockdiag_cp.recurrent.runs import _cached_plan

    report = {}
    for layout, lengths in LAYOUTS.items():
        for kind, placement, checkpointing, bf16 in CASES:
            config = _config()
            gen = torch.Generator().manual_seed(7)
            docs = [torch.randint(3, config.vocab_size, (n,), generator=gen) for n in lengths]
            ref_logits, ref_grads = documents_alone(kind, docs, build_model(config, None).train())
            if bf16:  # the stock model's own bf16 error sets the bound (the mLSTM's exp gates are noisy in bf16)
                stock_logits, stock_grads = documents_alone(kind, docs, build_model(config, None).train(),
                                                            autocast=torch.bfloat16)
            model = build_model(config, "blockdiag_cp").train()
            if checkpointing:
                model.activation_checkpointing_enable()
            step = cp_step(model, packed_batch(docs, SEQ_LEN, placement), bf16)
            key = f"{layout}/{kind}/{placement}/ckpt={checkpointing}/bf16={bf16}"
            if bf16:
                ours, want = step.out.logits[0][step.real].float(), ref_logits[step.ctx.local_index[step.real]]
                bound = (stock_logits - ref_logits).abs().max().item()
                if ours.numel():
                    assert (ours - want).abs().max().item() <= 2 * bound + 1e-3, (key, bound)
                grads = {n: p.grad for n, p in model.named_parameters()}
                assert grad_error(grads, ref_grads) <= 2 * grad_error(stock_grads, ref_grads) + 1e-3, key
            else:
                assert_matches_documents_alone(key, step, model, ref_logits, ref_grads)
            plan = _cached_plan(step.ctx)
            report[key] = dict(continuing=len(plan.sources[rank]), padding_only=not bool(step.real.any()))
    return report


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_training_step_matches_documents_alone_under_cp(world: int) -> None:
    reports = run_ranks(_worker, world, timeout=900)
    assert sum(r[k]["continuing"] for r in reports for k in r) > 0, "no fragment continued a document"
    if world == 4:
        assert any(r[k]["padding_only"] for r in reports for k in r if k.startswith("mostly_padding"))
