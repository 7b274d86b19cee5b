"""The loss of collated batches against documents run one by one through the stock model (acceptance 2).

Reference: every document (or split piece, with its continuing positions) is run alone through an
unmodified ``"sdpa"`` tiny Llama; the reference is the mean next-token cross-entropy over all targets.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DataCollatorWithFlattening

from hf_blockdiag_cp import PackingCollator, from_flattened
from tests.reference import documents_alone, tiny_model

SEQ_LEN = 48  # divisible by 2, 3 and 4


@pytest.fixture(scope="module")
def models():
    reference = tiny_model("llama", attn_implementation="sdpa", seed=0)
    packed = tiny_model("llama", attn_implementation="blockdiag_cp", seed=0)
    packed.load_state_dict(reference.state_dict())
    return reference, packed


def make_docs(lengths: list[int], seed: int = 0, masked: tuple[int, ...] = ()) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(1, 97, (n,), generator=g)
        labels = ids.clone()
        if i in masked:  # a "prompt" whose tokens are not trained on
            labels[: n // 2] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def pieces(doc: dict, seq_len: int) -> list[tuple[list[int], list[int], int]]:
    """``(input_ids, labels, first position)`` of each ``overflow="split"`` piece."""
    ids, labels = doc["input_ids"], doc["labels"]
    return [(ids[s:s + seq_len], labels[s:s + seq_len], s) for s in range(0, len(ids), seq_len)]


def piece_logits(model, ids: list[int], start: int) -> torch.Tensor:
    """``[len(ids), V]`` float64 logits of one piece run alone at positions from ``start``."""
    return documents_alone("llama", [torch.tensor(ids)], model, first_positions=[start], backward=False).logits.double()


def reference_mean(model, docs: list[dict], seq_len: int) -> float:
    """Mean next-token loss of every piece run alone (targets inside the piece only)."""
    parts = [p for doc in docs for p in pieces(doc, seq_len)]
    return documents_alone("llama", [torch.tensor(ids) for ids, _, _ in parts], model,
                           labels=[torch.tensor(labels) for _, labels, _ in parts],
                           first_positions=[start for _, _, start in parts], backward=False).loss


DOCS = make_docs([17, 3, 40, 1, 25, 9, 60, 12, 30], masked=(2, 5))


def test_cp1_loss_equals_documents_one_by_one(models):
    reference, packed = models
    batch = PackingCollator(SEQ_LEN, pad_token_id=0)(DOCS)
    assert batch["input_ids"].shape[0] > 1, "several rows: the backend must handle B > 1"
    with torch.no_grad():
        loss = packed(**batch).loss
    assert float(loss) == pytest.approx(reference_mean(reference, DOCS, SEQ_LEN), rel=1e-5)


def test_micro_batches_sum_to_the_step_mean(models):
    reference, packed = models
    mbs = PackingCollator(SEQ_LEN, pad_token_id=0).micro_batches(DOCS)
    with torch.no_grad():
        total = sum(float(packed(**mb).loss) for mb in mbs)
    assert total == pytest.approx(reference_mean(reference, DOCS, SEQ_LEN), rel=1e-5)


def test_model_forward_uses_shift_labels_and_num_items(models):
    """Installed transformers: LlamaForCausalLM passes shift_labels / num_items_in_batch to ForCausalLMLoss,
    which then ignores ``labels`` (no second shift) and divides the sum by num_items_in_batch."""
    _, packed = models
    batch = PackingCollator(SEQ_LEN, pad_token_id=0)(DOCS[:4])
    with torch.no_grad():
        base = float(packed(**batch).loss)
        garbage = torch.randint(0, 97, batch["labels"].shape)
        assert float(packed(**{**batch, "labels": garbage}).loss) == pytest.approx(base, rel=1e-6)
        doubled = float(packed(**{**batch, "num_items_in_batch": 2 * batch["num_items_in_batch"]}).loss)
        assert doubled == pytest.approx(base / 2, rel=1e-6)
        # Without shift_labels HF shifts `labels` itself: on a full row that is the same targets,
        # because labels are ignored at every document start.
        no_shift = {k: v for k, v in batch.items() if k != "shift_labels"}
        assert float(packed(**no_shift).loss) == pytest.approx(base, rel=1e-6)
        # `labels` is still required: without it transformers computes no loss.
        assert packed(**{k: v for k, v in batch.items() if k != "labels"}).loss is None


def row_reference_logits(reference, row_batch: dict, docs: list[dict], seq_len: int) -> torch.Tensor:
    """``[1, S, V]`` logits of a full row assembled from its pieces run alone; padding rows are 0."""
    doc_ids = row_batch["cp_context"].doc_ids[0]
    ids = row_batch["input_ids"][0].tolist()
    catalogue = [p for d in docs for p in pieces(d, seq_len)]
    out = torch.zeros(1, doc_ids.numel(), 97, dtype=torch.float64)
    t = 0
    while t < doc_ids.numel() and doc_ids[t] != 0:
        end = t
        while end < doc_ids.numel() and doc_ids[end] == doc_ids[t]:
            end += 1
        match = [p for p in catalogue if p[0] == ids[t:end]]
        assert match, "every document span of the row is one of the input pieces"
        out[0, t:end] = piece_logits(reference, match[0][0], match[0][2])
        t = end
    return out


@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_rank_losses_from_sliced_logits_sum_to_the_mean(models, cp_size):
    reference, packed = models
    expected = reference_mean(reference, DOCS, SEQ_LEN)
    ranks = [PackingCollator(SEQ_LEN, cp_size=cp_size, cp_rank=r, pad_token_id=0).micro_batches(DOCS)
             for r in range(cp_size)]
    full_rows = PackingCollator(SEQ_LEN, pad_token_id=0).micro_batches(DOCS)
    total, reshifted = 0.0, 0.0
    for row, full in enumerate(full_rows):
        logits = row_reference_logits(reference, full, DOCS, SEQ_LEN)
        for r in range(cp_size):
            b = ranks[r][row]
            local = logits[:, b["cp_context"].local_index]
            assert local.shape[1] == b["input_ids"].shape[1] == SEQ_LEN // cp_size
            total += float(packed.loss_function(logits=local, labels=b["labels"], vocab_size=97,
                                                shift_labels=b["shift_labels"],
                                                num_items_in_batch=b["num_items_in_batch"]))
            # What a rank-local re-shift of `labels` would give: it loses the targets across rank boundaries.
            reshifted += float(packed.loss_function(logits=local, labels=b["labels"], vocab_size=97,
                                                    num_items_in_batch=b["num_items_in_batch"]))
    assert total == pytest.approx(expected, rel=1e-5)
    assert reshifted != pytest.approx(expected, rel=1e-3)


def test_from_flattened_loss_equals_hf_flattening(models):
    reference, packed = models
    docs = DOCS[:5]
    hf = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    with torch.no_grad():
        hf_loss = float(reference(**hf, use_cache=False).loss)  # stock sdpa detects packing from position_ids
        ours = float(packed(**from_flattened(hf, cp_size=1, pad_to_multiple_of=8)).loss)
    assert ours == pytest.approx(hf_loss, rel=1e-5)
    assert ours == pytest.approx(reference_mean(reference, docs, 10_000), rel=1e-5)
    # Under CP: rank losses from sliced full-row logits sum to the same value.
    full = from_flattened(hf, cp_size=1, pad_to_multiple_of=3)
    logits = row_reference_logits(reference, full, docs, 10_000)
    total = 0.0
    for r in range(3):
        b = from_flattened(hf, cp_size=3, cp_rank=r)
        total += float(packed.loss_function(logits=logits[:, b["cp_context"].local_index], labels=b["labels"],
                                            vocab_size=97, shift_labels=b["shift_labels"],
                                            num_items_in_batch=b["num_items_in_batch"]))
    assert total == pytest.approx(hf_loss, rel=1e-5)
