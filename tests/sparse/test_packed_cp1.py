"""DSA models (deepseek_v32, glm_moe_dsa with a "shared" layer) on packed rows at CP = 1, in the three batch forms
the package accepts, against each document alone through the stock model with the stable tie rule in its indexer.

The documents (9-41 tokens, ``index_topk = 8``) make the selection sparse, and the tiny random weights give exact
ties at the cut-off (keys whose ReLU is 0 in every head), so the tie rule is exercised: the stock model with plain
``torch.topk`` differs on the same row.
"""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.conformance.runs import (
    VARIANTS,
    document_loss,
    forward_logits,
    grad_error,
    packed_inputs,
    packed_run,
)
from tests.sparse.harness import documents, models, reference

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")


_reference = reference


def _packed(model, docs, variant):
    logits, grads = packed_run(model, docs, packed_inputs(docs, variant, 0))
    bounds = torch.tensor([0, *[len(d) for d in docs]]).cumsum(0).tolist()
    loss = sum(document_loss(logits[a:b], d) for a, b, d in zip(bounds, bounds[1:], docs))
    return logits, loss, grads


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_packed_rows_match_documents_alone_with_the_stable_rule(model_type):
    stock, ours, config = models(model_type)
    if model_type == "glm_moe_dsa":  # the second layer reuses the first layer's selection
        assert [layer.self_attn.indexer is None for layer in ours.model.layers] == [False, True]
    docs = documents(config)
    ref_logits, ref_loss, ref_grads = _reference(stock, docs)
    for variant in VARIANTS:
        logits, loss, grads = _packed(ours, docs, variant)
        assert _rel(logits, ref_logits) <= 1e-4, f"{variant}: logits differ by {_rel(logits, ref_logits):.2e}"
        assert abs(float(loss - ref_loss)) / float(ref_loss) <= 1e-4, f"{variant}: loss {loss} vs {ref_loss}"
        assert grad_error(grads, ref_grads) <= 1e-4, f"{variant}: gradients differ"
    # the plain torch.topk of the stock model on the same packed row breaks ties by row position: it differs
    plain_logits, _, _ = _packed(stock, docs, "position_ids")
    assert _rel(plain_logits, ref_logits) > 1e-2, "no tie at the cut-off was exercised"


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_documents_shorter_than_index_topk_take_the_plain_path(model_type, monkeypatch):
    """index_topk (64) longer than every document and than the row: identical to the plain stock model, through the
    plain block-diagonal kernel (no sparse gather), and the indexer scores nothing (its projections only)."""
    import hf_blockdiag_cp.integration as integration
    import hf_blockdiag_cp.sparse.topk as topk

    stock, ours, config = models(model_type, topk=64)
    docs = documents(config, lengths=(9, 23, 5, 12))
    ref_logits, ref_loss, ref_grads = _reference(stock, docs)
    plain = [forward_logits(stock, d[None])[0] for d in docs]
    assert torch.equal(torch.cat(plain).detach(), ref_logits)

    def forbidden(*args, **kwargs):
        raise AssertionError("the sparse path ran for documents no longer than index_topk")
    monkeypatch.setattr(integration, "sparse_attention", forbidden)
    monkeypatch.setattr(topk, "index_scores", forbidden)
    for variant in VARIANTS:
        logits, loss, grads = _packed(ours, docs, variant)
        assert _rel(logits, ref_logits) <= 1e-4 and grad_error(grads, ref_grads) <= 1e-4, variant


def test_one_long_document_takes_the_sparse_path(monkeypatch):
    """The same short documents and one longer than index_topk: the sparse path serves the step."""
    import hf_blockdiag_cp.integration as integration

    stock, ours, config = models("deepseek_v32", topk=16)
    docs = documents(config, lengths=(9, 5, 30))
    ref_logits, _, ref_grads = _reference(stock, docs)
    calls = []
    original = integration.sparse_attention
    monkeypatch.setattr(integration, "sparse_attention", lambda *a, **k: calls.append(1) or original(*a, **k))
    logits, _, grads = _packed(ours, docs, "collator")
    assert calls and _rel(logits, ref_logits) <= 1e-4 and grad_error(grads, ref_grads) <= 1e-4


def test_activation_checkpointing_replays_the_selection():
    stock, ours, config = models("glm_moe_dsa")
    docs = documents(config)
    ref_logits, _, ref_grads = _reference(stock, docs)
    ours.train()
    ours.activation_checkpointing_enable()
    logits, _, grads = _packed(ours, docs, "collator")
    assert _rel(logits, ref_logits) <= 1e-4 and grad_error(grads, ref_grads) <= 1e-4
