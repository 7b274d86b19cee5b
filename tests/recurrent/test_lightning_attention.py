"""Issue 24, MiniMax's lightning attention: a linear-attention recurrence inside the module's own ``forward``.

``MiniMaxLightningAttention`` (``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t`` per head) has no replaceable
function: it is served whole once per fragment (``STATEFUL``); under CP a continuing fragment runs through the
module's own cached path with a stand-in cache holding the composed state.

References: each document alone through the unmodified model (CP = 1 packed rows; CP = 2 and 4 on gloo with documents
in several fragments, every placement, activation checkpointing, bf16 autocast, a rank holding only padding, the
bytes moved), and
for the summary and its composition the unmodified module on the whole document in float64.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.models.minimax import modeling_minimax as mm

from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import (
    VARIANTS,
    build_model,
    make_documents,
    packed_inputs,
)
from hf_blockdiag_cp.mixer_hooks import INSTALLED_ATTR, uninstall_recurrent
from hf_blockdiag_cp.mixer_table import STATEFUL
from hf_blockdiag_cp.model.detect import packing_refusal
from hf_blockdiag_cp.recurrent.algebra import DecayAlgebra
from hf_blockdiag_cp.recurrent.module_runners import HandedState as _HandedState
from hf_blockdiag_cp.recurrent.module_runners import stateful_decay
from tests.launch import run_ranks
from tests.recurrent.harness import (
    assert_family_reports,
    assert_packed_rows_match,
    family_step_reports,
)


def compose_stateful(summaries: list, heads: int, dim: int) -> torch.Tensor:
    """The state entering the next fragment, folded from the packed summaries by the lightning row's algebra."""
    algebra = DecayAlgebra((1, heads, dim, dim), (1, heads))
    return algebra.fold(summaries, [1] * len(summaries))[0]


KIND = "minimax"
SPEC = STATEFUL["MiniMaxLightningAttention"]


def _check(variants: tuple[str, ...], control: bool) -> None:
    config = tiny_config(KIND)
    assert set(config.layer_types) == {"full_attention", "linear_attention"}
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    docs = make_documents(config)
    ref_logits, _ = assert_packed_rows_match(stock, ours, docs, config.pad_token_id or 0, variants)
    if control:  # the same row with the served forward removed: the recurrence runs over the whole row
        uninstall_recurrent(ours)
        inputs = {k: v for k, v in packed_inputs(docs, "position_ids").items() if not k.startswith("_")}
        with torch.no_grad():
            leaked = ours(**inputs, use_cache=False).logits[0]
        assert (leaked - ref_logits).abs().max() > 1e-3


def test_packed_rows_equal_each_document_alone() -> None:
    """CP = 1, packed ``position_ids``: logits and gradients; and the control without the served forward."""
    _check(("position_ids",), control=True)


@pytest.mark.slow
def test_packed_rows_equal_each_document_alone_every_batch_form() -> None:
    """CP = 1, ``cu_seq_lens_*`` keywords and ``PackingCollator`` batches (and packed ``position_ids``)."""
    _check(VARIANTS, control=False)


def test_lightning_attention_is_served_and_transformers_names_still_match() -> None:
    """The module still takes the parameters the package binds, reads and writes its state through the cache methods
    the stand-in implements, holds the attributes the summary reads; the instance forward is installed and removed
    (a transformers rename fails here)."""
    params = tuple(inspect.signature(mm.MiniMaxLightningAttention.forward).parameters)[1:]
    assert params[:len(SPEC.params)] == SPEC.params, params
    source = inspect.getsource(mm.MiniMaxLightningAttention.forward)
    assert f"{SPEC.cache}.{SPEC.cache_get}(self.{SPEC.layer_attr})" in source
    assert f"{SPEC.cache}.{SPEC.cache_set}(self.{SPEC.layer_attr}" in source
    assert callable(getattr(_HandedState, SPEC.cache_get)) and callable(getattr(_HandedState, SPEC.cache_set))
    model = build_model(tiny_config(KIND), "blockdiag_cp")
    assert packing_refusal(model) is None
    mixers = [m for m in model.modules() if isinstance(m, mm.MiniMaxLightningAttention)]
    assert mixers
    for m in mixers:
        heads, dim = getattr(m, SPEC.heads_attr), getattr(m, SPEC.dim_attr)
        assert getattr(m, SPEC.rate_attr).numel() == heads and dim * heads == m.out_proj.in_features
        assert INSTALLED_ATTR in m.__dict__ and "forward" in m.__dict__
    uninstall_recurrent(model)
    assert not any({INSTALLED_ATTR, "forward"} & set(m.__dict__) for m in mixers)


def test_summaries_compose_to_the_whole_document() -> None:
    """float64: a document cut into fragments (lengths 1, 3, 1, 7, 11); each fragment's end state from zero and its
    decay ``exp(-slope L)``, composed in order, are the state the unmodified module leaves after the same tokens, and
    the fragments rerun from it through the stand-in cache give its outputs and input gradients."""
    config = tiny_config(KIND)
    module = mm.MiniMaxLightningAttention(config, 1).double()
    # its decay tables were computed in float32 at init: recompute them in float64 from the same rates
    module.query_decay, module.key_decay, module.diagonal_decay = module.decay_factors(module.slope_rate)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64, generator=gen) * 0.2)
    length = 23
    x = torch.randn(1, length, config.hidden_size, dtype=torch.float64, generator=gen, requires_grad=True)
    no_rope = (torch.ones(1, length, 1, dtype=torch.float64), torch.zeros(1, length, 1, dtype=torch.float64))
    ref, ref_end = module(x, no_rope, None)
    heads, dim = getattr(module, SPEC.heads_attr), getattr(module, SPEC.dim_attr)
    cuts = [0, 1, 4, 5, 12, length]
    pieces, summaries = [], []
    for k, (start, stop) in enumerate(zip(cuts, cuts[1:])):
        part = x[:, start:stop]
        out, end = module(part, no_rope, None)  # from zero
        if k:
            state = compose_stateful(summaries, heads, dim)  # fp32, as sent between ranks
            _, want = module(x[:, :start], no_rope, None)
            torch.testing.assert_close(state.double(), want, rtol=1e-5, atol=1e-6)
            out = module(part, no_rope, None, cache=_HandedState(state.double()))[0]
        summaries.append(torch.cat([end.float().flatten(), stateful_decay(SPEC, module, stop - start)]))
        pieces.append(out)
    torch.testing.assert_close(compose_stateful(summaries, heads, dim).double(), ref_end, rtol=1e-5, atol=1e-6)
    got = torch.cat(pieces, 1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    weight = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    (g,) = torch.autograd.grad((got * weight).sum(), x)
    (r,) = torch.autograd.grad((ref * weight).sum(), x)
    torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


SEQ_LEN = 48  # divisible by 2P for zigzag at P = 2, 4
LAYOUTS = {
    "one_doc": [48],
    "mostly_padding": [10, 4],
    "many_pieces": [7, 1, 12, 4, 9, 15],
}
# (placement, activation checkpointing, bf16 autocast)
CASES = [("balanced", False, False), ("contiguous", True, False), ("zigzag", False, False), ("balanced", False, True)]


def expected_bytes(model: torch.nn.Module, slots: int, cp_size: int) -> int:
    """Bytes one rank sends in one forward's recurrent all-gathers (docs/hybrid.md): per lightning layer
    ``(P - 1) * slots * W * 4`` with ``W = H D D + H``."""
    return sum((cp_size - 1) * slots * 4 * (m.num_attention_heads * m.head_dim ** 2 + m.num_attention_heads)
               for m in model.modules() if isinstance(m, mm.MiniMaxLightningAttention))


def _worker(rank: int, world: int) -> dict:
    config = tiny_config(KIND)
    lightning_only = tiny_config(KIND)
    lightning_only.layer_types = ["linear_attention"] * lightning_only.num_hidden_layers  # every byte is ours
    runs = [(config, *case) for case in CASES] + [(lightning_only, "balanced", False, False)]
    return family_step_reports(KIND, runs, LAYOUTS, SEQ_LEN, rank, world, lightning_only, expected_bytes)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_training_step_matches_documents_alone(world: int) -> None:
    """A training step on ``world`` gloo ranks equals each document alone (logits mapped back through
    ``local_index``, gradients all-reduced), and the recurrent all-gathers move the bytes of the formula."""
    assert_family_reports(run_ranks(_worker, world, timeout=900), world)
