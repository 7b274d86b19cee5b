"""Issue 17: a non-finite value (NaN/inf in q, k or v) of one document stays in that document with
``sdpa_mask``, as with ``sdpa_doc`` and each document alone. One dense ``[Tq, Tk]`` SDPA call spread it
to every document of the row (a masked NaN score is ``NaN + (-inf)``, a masked NaN value ``0 * NaN``)."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp import blockdiag_attention
from tests.layouts import runs
from tests.reference import attention_documents_alone

# (doc_ids over S, row_offset, L): documents 2 and 3 straddle the offset in the second layout.
LAYOUTS = {
    "whole_row": (runs((1, 5), (2, 20), (3, 3), (4, 12), (5, 8)), 0, 48),
    "shard_with_prefix": (runs((1, 5), (2, 20), (3, 3), (4, 12), (5, 8)), 16, 32),
}
POISONED = 2  # the document holding the non-finite value


def _inputs(layout: str, seed: int = 0):
    doc, offset, local_len = LAYOUTS[layout]
    doc = torch.tensor(doc)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, local_len, 4, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(1, len(doc), 2, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    v = torch.randn(1, len(doc), 2, 16, generator=gen, dtype=torch.float64).transpose(1, 2)
    return q, k, v, doc, offset


def _poison(k: torch.Tensor, v: torch.Tensor, doc: torch.Tensor, where: str, value: float):
    """Copies of ``k``/``v`` with ``value`` at one position of document ``POISONED`` (its last key)."""
    k, v = k.clone(), v.clone()
    pos = int(torch.nonzero(doc == POISONED)[-1])
    (k if where == "k" else v)[0, 1, pos, 3] = value
    return k, v


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("where,value", [("k", float("nan")), ("v", float("nan")), ("k", float("inf")),
                                         ("v", float("-inf"))])
def test_non_finite_value_stays_in_its_document(layout, where, value):
    q, k, v, doc, offset = _inputs(layout)
    k, v = _poison(k, v, doc, where, value)
    local_doc = doc[offset: offset + q.shape[2]]
    clean = local_doc != POISONED
    outs = {}
    for backend in ("sdpa_mask", "sdpa_doc"):
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out = blockdiag_attention(qg, kg, vg, doc, offset, backend=backend)
        # A loss over the other documents only: their gradients must be finite and agree.
        out[:, :, clean].square().sum().backward()
        outs[backend] = (out.detach(), qg.grad, kg.grad, vg.grad)
    reference = attention_documents_alone(q, k, v, doc, offset)
    mask_out, doc_out = outs["sdpa_mask"][0], outs["sdpa_doc"][0]
    assert torch.isfinite(mask_out[:, :, clean]).all()
    torch.testing.assert_close(mask_out[:, :, clean], reference[:, :, clean], atol=1e-12, rtol=0)
    torch.testing.assert_close(mask_out[:, :, clean], doc_out[:, :, clean], atol=1e-12, rtol=0)
    # The poison was seen (inside its own document, where each backend places NaN its own way).
    for out in (mask_out, doc_out, reference):
        assert not torch.isfinite(out[:, :, ~clean]).all()
    key_clean = doc != POISONED
    for got, want, rows in zip(outs["sdpa_mask"][1:], outs["sdpa_doc"][1:], (clean, key_clean, key_clean)):
        assert torch.isfinite(got[:, :, rows]).all()
        torch.testing.assert_close(got[:, :, rows], want[:, :, rows], atol=1e-12, rtol=0)


def test_finite_inputs_still_match_sdpa_doc_with_window_and_dropout_off():
    q, k, v, doc, offset = _inputs("shard_with_prefix", seed=3)
    for window in (None, 4):
        a = blockdiag_attention(q, k, v, doc, offset, backend="sdpa_mask", sliding_window=window)
        b = blockdiag_attention(q, k, v, doc, offset, backend="sdpa_doc", sliding_window=window)
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
