"""Issue 24, CP = 1: recurrent mixers restart at every document start for every packed batch form.

Reference: each document alone through the unmodified model (stock attention, no packing, transformers' own
torch scans). Compared: the packed row through ``blockdiag_cp`` (packed ``position_ids``, ``cu_seq_lens_*`` from
``DataCollatorWithFlattening``, ``PackingCollator`` batches) — logits and every parameter's gradient. One family
per kind of mixer: gated delta rule, KDA, Mamba2/SSD, Mamba1 (a layer that drops the model's kwargs), short conv;
the fast set also covers the other architectures whose mixers route through the same served functions (lara_mini: gated
delta rule; bailing_hybrid: KDA; zamba: Mamba1; lfm3: short convolutions) and zaya, whose plain ``nn.Conv1d``
projection is served as a whole module per fragment (``WINDOWED``).
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch

from hf_blockdiag_cp.compat import kernel_functions as mixer_functions
from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import (
    build_model,
    make_documents,
    packed_inputs,
    packed_run,
    reference_run,
)
from hf_blockdiag_cp.mixer_hooks import INSTALLED_ATTR, check_signature, uninstall_recurrent
from hf_blockdiag_cp.mixer_table import COMPOSITES, FUSED, SCANS, WINDOWED
from hf_blockdiag_cp.model.detect import packing_refusal
from tests.recurrent.harness import assert_packed_rows_match

# The quick loop keeps one gated-delta-rule + convolution model and one short-convolution model (a few seconds
# each); the other families (5-11 s each) run in the full suite.
FAST = ("qwen3_next", "lfm2")
SLOW = ("bamba", "mamba", "zamba", "lara_mini", "bailing_hybrid", "lfm3", "zaya", "kimi_linear", "jamba", "nemotron_h",
        "olmo_hybrid")


def _check(model_type: str) -> None:
    config = tiny_config(model_type)
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    assert_packed_rows_match(stock, ours, make_documents(config), config.pad_token_id or 0, label=model_type)


@pytest.mark.parametrize("model_type", FAST)
def test_packed_rows_equal_each_document_alone(model_type: str) -> None:
    _check(model_type)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", SLOW)
def test_packed_rows_equal_each_document_alone_more_families(model_type: str) -> None:
    _check(model_type)


def test_without_the_per_document_scans_packing_leaks() -> None:
    """The control: the same packed row with the served forwards removed differs from the reference."""
    config = tiny_config("qwen3_next")
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    docs = make_documents(config)
    ref_logits, _ = reference_run(stock, docs)
    uninstall_recurrent(ours)
    assert packing_refusal(ours) is None  # refusal decided at load; the scans are what keeps documents apart
    inputs = {k: v for k, v in packed_inputs(docs, "position_ids").items() if not k.startswith("_")}
    with torch.no_grad():
        logits = ours(**inputs, use_cache=False).logits[0]
    assert (logits - ref_logits).abs().max() > 1e-3


# qwen4_exp_text and inkling_text: their mixers are served; the models are refused for other reasons (a mask read
# by the model itself, an additive position bias), see docs/hybrid.md.
@pytest.mark.parametrize("model_type", [*(m for m in (*FAST, *SLOW) if m != "zaya"), "qwen3_5_text", "zamba2", "mamba2",
                                        "falcon_mamba", "granitemoehybrid", "falcon_h1", "lfm2_moe", "qwen4_exp_text",
                                        "inkling_text"])
def test_mixers_are_served_and_transformers_names_still_match(model_type: str) -> None:
    """Every recurrent mixer's replaceable functions are known, the served ones have the parameters the package
    binds, and they were replaced on the instance (a transformers rename fails here)."""
    model = build_model(tiny_config(model_type), "blockdiag_cp")
    assert packing_refusal(model) is None
    mixers = [m for m in model.modules() if mixer_functions(m) and any(n in SCANS for n in mixer_functions(m))]
    assert mixers, f"{model_type}: no mixer with a served scan (transformers renamed the functions?)"
    module = importlib.import_module(type(mixers[0]).__module__)
    for mixer in mixers:
        for name, wrapper in mixer_functions(mixer).items():
            assert name in SCANS or name in COMPOSITES or name in FUSED, f"{model_type}: unknown function {name}"
            if name in SCANS:
                assert INSTALLED_ATTR in wrapper.__dict__
    for fn in vars(module).values():
        name = getattr(fn, "kernel_layer_name", None)
        if name in SCANS and not isinstance(fn, type):
            original = inspect.getclosurevars(type(fn).forward).nonlocals["func"]
            check_signature(SCANS[name], original)


def test_a_later_direct_call_of_the_inner_model_does_not_reuse_the_held_fragments() -> None:
    """The fragments of a packed forward are held after it (for a checkpoint recompute in backward), but a later
    direct call of the inner model (its pre-hook does not run) must run as stock does, not on the old fragments."""
    config = tiny_config("qwen3_next")
    stock = build_model(config, None)
    ours = build_model(config, "blockdiag_cp")
    docs = make_documents(config)
    packed_run(ours, docs, packed_inputs(docs, "position_ids", config.pad_token_id or 0))
    row = torch.cat(list(docs))[None]  # the same tokens as ONE sequence, same shape as the packed row
    with torch.no_grad():
        want = stock.model(row, use_cache=False).last_hidden_state
        got = ours.model(row, use_cache=False).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type,cls_name", [("zaya", "ZayaCCAProjection")])
def test_windowed_modules_are_served_and_transformers_names_still_match(model_type: str, cls_name: str) -> None:
    """The modules served whole per fragment still exist under their name, take the parameters the package binds
    and hold the window attribute (a transformers rename fails here), and got the instance forward."""
    spec = WINDOWED[cls_name]
    model = build_model(tiny_config(model_type), "blockdiag_cp")
    assert packing_refusal(model) is None
    modules = [m for m in model.modules() if type(m).__name__ == cls_name]
    assert modules, f"{model_type}: no {cls_name} (transformers renamed it?)"
    params = tuple(inspect.signature(type(modules[0]).forward).parameters)[1:]
    assert params[:len(spec.params)] == spec.params, params
    for module in modules:
        assert INSTALLED_ATTR in module.__dict__
        assert int(getattr(module, spec.window_attr)) >= 1
