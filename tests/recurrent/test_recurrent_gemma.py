"""Issue 24, RecurrentGemma (Griffin): its RG-LRU scan and its depthwise ``conv_1d`` per document fragment.

The RG-LRU (``RecurrentGemmaRglru``) resets where ``position_ids`` are 0 and runs its diagonal recurrence
``h_t = a_t h_{t-1} + x_t`` in the instance method ``_rnn_scan``, served per fragment (``METHODS``, kind ``"diag"``);
the block's plain ``nn.Conv1d`` mixes documents and is served as a channels-first windowed module (``WINDOWED``).

References: each document alone through the unmodified model (CP = 1: the three batch forms; CP = 2 and 4 on gloo:
documents in several fragments, every placement, a rank holding only padding, activation checkpointing, bf16
autocast), and a float64 sequential recurrence for the diagonal summary and its composition.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.recurrent_gemma import modeling_recurrent_gemma as rg

from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import (
    VARIANTS,
    build_model,
    make_documents,
    packed_inputs,
)
from hf_blockdiag_cp.errors import UnsupportedModel
from hf_blockdiag_cp.mixer_hooks import INSTALLED_ATTR, uninstall_recurrent
from hf_blockdiag_cp.mixer_table import METHODS, WINDOWED, conv_window
from hf_blockdiag_cp.model.detect import packing_refusal
from hf_blockdiag_cp.recurrent.scan_runner import ScanRunner
from tests.launch import run_ranks
from tests.recurrent.harness import (
    assert_family_reports,
    assert_packed_rows_match,
    family_step_reports,
)

KIND = "recurrent_gemma"


def _check(variants: tuple[str, ...], control: bool) -> None:
    config = tiny_config(KIND)
    assert set(config.layers_block_type) == {"linear_attention", "sliding_attention"}  # both temporal blocks
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    docs = make_documents(config)
    ref_logits, _ = assert_packed_rows_match(stock, ours, docs, config.pad_token_id or 0, variants)
    if control:  # the same row with the served forwards removed: the whole-row convolution mixes the documents
        uninstall_recurrent(ours)
        inputs = {k: v for k, v in packed_inputs(docs, "position_ids").items() if not k.startswith("_")}
        with torch.no_grad():
            leaked = ours(**inputs, use_cache=False).logits[0]
        assert (leaked - ref_logits).abs().max() > 1e-3


def test_packed_rows_equal_each_document_alone() -> None:
    """CP = 1, packed ``position_ids``: logits and gradients; and the control without the served forwards."""
    _check(("position_ids",), control=True)


# Like the other per-family packed-row checks (tests/recurrent/test_packed_cp1.py), the other batch forms run in the
# full suite only (the quick loop's budget).
@pytest.mark.slow
def test_packed_rows_equal_each_document_alone_every_batch_form() -> None:
    """CP = 1, ``cu_seq_lens_*`` keywords and ``PackingCollator`` batches (and packed ``position_ids``)."""
    assert set(VARIANTS) >= {"position_ids", "cu_seq_lens", "collator"}
    _check(VARIANTS, control=False)


def test_a_packed_batch_without_position_ids_or_with_a_cache_is_refused() -> None:
    """The RG-LRU reads its resets (and skips its input normalisation) from ``position_ids``; a cache would start
    the scans from a state: both refused with the cause."""
    config = tiny_config(KIND)
    model = build_model(config, "blockdiag_cp")
    docs = make_documents(config)
    inputs = packed_inputs(docs, "cu_seq_lens")
    without = {k: v for k, v in inputs.items() if k != "position_ids"}
    with pytest.raises(UnsupportedModel, match="where position_ids are 0 but this packed batch has no position_ids"):
        model(**without, use_cache=False)
    with pytest.raises(UnsupportedModel, match="use_cache=False"):
        model(**inputs, use_cache=True)


def test_rglru_scan_and_conv_are_served_and_transformers_names_still_match() -> None:
    """The served method and convolution still exist under their names with the parameters the package binds, the
    block still reads the convolution's first ``T`` outputs only, the instance attributes are installed, and
    uninstalling removes them (a transformers rename fails here)."""
    spec = METHODS["RecurrentGemmaRglru"]
    params = tuple(inspect.signature(getattr(rg.RecurrentGemmaRglru, spec.name)).parameters)[1:]
    assert params[:len(spec.params)] == spec.params, params
    assert f"self.{spec.name}(" in inspect.getsource(rg.RecurrentGemmaRglru.forward)
    window = WINDOWED["RecurrentGemmaRecurrentBlock"]
    owner_source = inspect.getsource(rg.RecurrentGemmaRecurrentBlock.forward)
    assert window.owner_reads in owner_source and owner_source.count(f"self.{window.child}(") == 2  # prefill, no cache
    assert tuple(inspect.signature(torch.nn.Conv1d.forward).parameters)[1:] == window.params

    model = build_model(tiny_config(KIND), "blockdiag_cp")
    assert packing_refusal(model) is None
    blocks = [m for m in model.modules() if isinstance(m, rg.RecurrentGemmaRecurrentBlock)]
    assert blocks
    for block in blocks:
        conv = getattr(block, window.child)
        assert conv_window(conv) == block.conv1d_width - 1
        assert INSTALLED_ATTR in conv.__dict__ and "forward" in conv.__dict__
        assert INSTALLED_ATTR in block.rg_lru.__dict__ and spec.name in block.rg_lru.__dict__
    uninstall_recurrent(model)
    for block in blocks:
        assert not {INSTALLED_ATTR, "forward"} & set(getattr(block, window.child).__dict__)
        assert not {INSTALLED_ATTR, spec.name} & set(block.rg_lru.__dict__)


def _sequential(x: torch.Tensor, a: torch.Tensor, reset: torch.Tensor) -> torch.Tensor:
    """float64 reference: ``h_t = a_t (1 - reset_t) h_{t-1} + x_t`` from ``h = 0``; ``[1, T, W]``."""
    h = torch.zeros_like(x[:, 0])
    out = []
    for t in range(x.shape[1]):
        h = a[:, t] * (~reset[:, t]).to(x.dtype) * h + x[:, t]
        out.append(h)
    return torch.stack(out, 1)


def test_diag_summaries_compose_to_the_sequential_recurrence() -> None:
    """A document cut into fragments (lengths 1, 3, 1, 7, 11): each fragment's summary (end state from zero, and the
    product of its decays read off the model's own ``_rnn_scan``), composed in order in fp32, is the state the
    float64 sequential recurrence has there; the fragments rerun from it give its outputs and gradients."""
    gen = torch.Generator().manual_seed(0)
    length, width = 23, 5
    x = torch.randn(1, length, width, dtype=torch.float64, generator=gen, requires_grad=True)
    a = (0.5 + 0.5 * torch.rand(1, length, width, dtype=torch.float64, generator=gen)).requires_grad_()
    reset = torch.zeros(1, length, 1, dtype=torch.bool)
    reset[0, 0] = True
    spec = METHODS["RecurrentGemmaRglru"]
    original = rg.RecurrentGemmaRglru(tiny_config(KIND))._rnn_scan
    named = {"hidden_states": x, "recurrent_gate": a, "reset": reset, "recurrent_states": None,
             "acc_dtype": torch.float64}
    runner = ScanRunner(spec, original, named, "model", False, ())
    assert runner.algebra.width == 2 * width

    def frag(start: int, n: int):
        return type("Fragment", (), {"row": 0, "start": start, "length": n})

    def call_fragment(spec, original, named, row, start, n, state=None):
        out, end = runner._run_model(frag(start, n), None if state is None else (state,), True)
        return out, end[0]

    def compose(spec, named, summaries):
        return runner.algebra.fold(summaries, [1] * len(summaries))[0]

    def _transition(spec, original, named, row, start, n):
        return runner.transitions([frag(start, n)])[0][0]
    ref = _sequential(x, a, reset)
    cuts = [0, 1, 4, 5, 12, length]
    pieces, summaries = [], []
    for k, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        n = stop - start
        _, end = call_fragment(spec, original, named, 0, start, n)  # from zero
        if k == 0:
            out = _sequential(x[:, :n], a[:, :n], reset[:, :n])
            summaries.append(torch.cat([end.float().flatten(), end.new_zeros(width).float()]))
        else:
            state = compose(spec, named, summaries)
            torch.testing.assert_close(state.double(), ref[:, start - 1], rtol=1e-6, atol=1e-6)
            out, _ = call_fragment(spec, original, named, 0, start, n, state)
            decay = _transition(spec, original, named, 0, start, n)
            torch.testing.assert_close(decay.double(), a[:, start:stop].prod(1), rtol=1e-6, atol=0)
            summaries.append(torch.cat([end.float().flatten(), decay.flatten()]))
        pieces.append(out)
    got = torch.cat(pieces, 1)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    weight = torch.randn(1, length, width, dtype=torch.float64, generator=gen)
    got_grads = torch.autograd.grad((got * weight).sum(), (x, a))
    ref_grads = torch.autograd.grad((ref * weight).sum(), (x, a))
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


SEQ_LEN = 48  # divisible by 2P for zigzag at P = 2, 4
LAYOUTS = {
    "mixed": [5, 21, 1, 9, 12],
    "one_doc": [48],  # one document in P (contiguous) or 2P (zigzag) fragments, several per rank
    "mostly_padding": [10, 4],  # at P = 4 the last ranks hold only padding
    "many_pieces": [7, 1, 12, 4, 9, 15],  # at P = 4 a rank sends its fragments' summaries out of fragment order
}
# (placement, activation checkpointing, bf16 autocast)
CASES = [("balanced", False, False), ("contiguous", True, False), ("zigzag", False, False), ("balanced", False, True)]


def expected_bytes(model: torch.nn.Module, slots: int, cp_size: int) -> int:
    """Bytes one rank sends in one forward's recurrent all-gathers (docs/hybrid.md): per served call
    ``(P - 1) * slots * W * 4`` with ``W = (K - 1) C`` for the convolution and ``2 C`` for the RG-LRU scan."""
    total = 0
    for block in model.modules():
        if isinstance(block, rg.RecurrentGemmaRecurrentBlock):
            channels, width = block.lru_width, block.conv1d_width - 1
            total += (cp_size - 1) * slots * 4 * (width * channels + 2 * channels)
    return total


def _worker(rank: int, world: int) -> dict:
    config = tiny_config(KIND)
    recurrent_only = tiny_config(KIND)
    recurrent_only.block_types = ["recurrent"]  # no attention layer: every byte sent is the recurrent all-gathers'
    runs = [(config, *case) for case in CASES] + [(recurrent_only, "balanced", False, False)]
    return family_step_reports(KIND, runs, LAYOUTS, SEQ_LEN, rank, world, recurrent_only, expected_bytes)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_training_step_matches_documents_alone(world: int) -> None:
    """A training step on ``world`` gloo ranks equals each document alone (logits mapped back through
    ``local_index``, gradients all-reduced), and the recurrent all-gathers move the bytes of the formula."""
    assert_family_reports(run_ranks(_worker, world, timeout=900), world, out_of_order=True)
