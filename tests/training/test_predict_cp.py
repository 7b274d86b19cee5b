"""``CPTrainer.predict()`` / ``evaluate()`` with ``compute_metrics`` under CP (issue 19).

On a (dp=1, cp=2) mesh with the balanced placement (each rank's positions are not contiguous) and rows whose
documents are split over the ranks: the predictions (logits, and argmax ids through
``preprocess_logits_for_metrics``, which runs on each rank's shard) and the label ids equal what one process
returns for the same rows element for element, the logits equal every document run alone through stock
``sdpa``, ``compute_metrics`` receives exactly those arrays, and ``eval_loss`` stays the exact token mean.
"""

from __future__ import annotations

import pytest

from tests.launch import run_ranks
from tests.training.trainer_setup import SEQ_LEN
from tests.training.trainer_setup import documents as _documents
from tests.training.trainer_setup import rank_env as _rank_env
from tests.training.trainer_setup import reference_eval_loss as _reference_eval_loss
from tests.training.trainer_setup import training_args as _training_args

pytestmark = pytest.mark.distributed

ROWS = 4  # documents per row: per_device_eval_batch_size of _training_args, so two rows of _documents()


def _one_process_rows(model, examples):
    """What one process's ``Trainer.predict`` returns for the rows: ``model(row).logits`` and the row's unshifted
    labels (cp_size = 1, the same collator), plus each row's document ids."""
    import torch

    import hf_blockdiag_cp as bd

    collator = bd.PackingCollator(SEQ_LEN, pad_token_id=0)
    logits, labels, doc_ids = [], [], []
    with torch.no_grad():
        for start in range(0, len(examples), ROWS):
            batch = collator(examples[start:start + ROWS])
            out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                        cp_context=batch["cp_context"], use_cache=False)
            logits.append(out.logits)
            labels.append(batch["labels"])
            doc_ids.append(batch["cp_context"].doc_ids)
    return torch.cat(logits).numpy(), torch.cat(labels).numpy(), torch.cat(doc_ids).numpy()


def _sft_predict(mesh, tmp: str, preprocess) -> dict:
    """``CPSFTTrainer.predict`` at cp=2 with ``preprocess_logits_for_metrics`` and, for the same packed rows, one
    process's argmax ids and labels."""
    import datasets
    import numpy as np
    import torch

    import hf_blockdiag_cp as bd
    from hf_blockdiag_cp.training.trl import CPSFTTrainer
    from tests.training import test_trl_cp

    model, tokenizer, examples = test_trl_cp._setup("text")
    seen: list = []
    trainer = CPSFTTrainer(model=model, args=test_trl_cp._sft_args(tmp), processing_class=tokenizer, mesh=mesh,
                           train_dataset=datasets.Dataset.from_list(examples[:2]),
                           eval_dataset=datasets.Dataset.from_list(examples), preprocess_logits_for_metrics=preprocess,
                           compute_metrics=lambda p: seen.append((np.array(p.predictions), np.array(p.label_ids)))
                           or {})
    result = trainer.predict(trainer.eval_dataset)
    collator = bd.PackingCollator(test_trl_cp.SEQ_LEN, pad_token_id=tokenizer.pad_token_id)
    ids, labels = [], []
    with torch.no_grad():
        for row in trainer.eval_dataset.rows:
            batch = collator([row])
            ids.append(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                             cp_context=batch["cp_context"], use_cache=False).logits.argmax(-1))
            labels.append(batch["labels"])
    return {"ids": result.predictions, "labels": result.label_ids, "metrics": seen.pop(),
            "ref_ids": torch.cat(ids).numpy(), "ref_labels": torch.cat(labels).numpy()}


def _predict_worker(rank: int, world: int, tmp: str) -> dict:
    import numpy as np
    import torch

    import hf_blockdiag_cp as bd
    from tests.reference import tiny_model

    mesh = bd.init_device_mesh(world)
    examples = [{"input_ids": d.tolist()} for d in _documents()]
    collator = bd.PackingCollator(SEQ_LEN, group=mesh["cp"], pad_token_id=0)
    out: dict = {"local_index": collator(examples[:ROWS])["cp_context"].local_index.tolist()}
    seen: list = []

    def compute_metrics(prediction):
        seen.append((np.array(prediction.predictions), np.array(prediction.label_ids)))
        return {"rows": float(prediction.label_ids.shape[0])}

    received: list = []

    def argmax(logits, labels):
        received.append((tuple(logits.shape), tuple(labels.shape)))
        return logits.argmax(-1)

    model = tiny_model("llama", attn_implementation="blockdiag_cp")
    trainer = bd.CPTrainer(model=model, args=_training_args(tmp), data_collator=collator, mesh=mesh,
                           compute_metrics=compute_metrics)
    result = trainer.predict(examples)
    out.update(logits=result.predictions, labels=result.label_ids, predict_loss=result.metrics["test_loss"],
               predict_metrics=seen.pop())
    metrics = trainer.evaluate(eval_dataset=examples)
    out.update(eval_loss=metrics["eval_loss"], eval_rows=metrics["eval_rows"], eval_metrics=seen.pop())

    trainer = bd.CPTrainer(model=model, args=_training_args(tmp), data_collator=collator, mesh=mesh,
                           compute_metrics=compute_metrics, preprocess_logits_for_metrics=argmax)
    result = trainer.predict(examples)
    out.update(ids=result.predictions, ids_labels=result.label_ids, ids_metrics=seen.pop(), received=received)

    # A preprocessing that does not keep one output per position cannot be put back in row order: refused.
    trainer.preprocess_logits_for_metrics = lambda logits, labels: logits[:, :-1]
    try:
        trainer.predict(examples)
    except NotImplementedError as err:
        out["refusal"] = str(err)

    out["sft"] = _sft_predict(mesh, tmp, lambda logits, labels: logits.argmax(-1))
    out["reference"] = _one_process_rows(model, examples)
    alone = tiny_model("llama", attn_implementation="sdpa")
    with torch.no_grad():
        out["alone"] = [alone(d[None], use_cache=False).logits[0].numpy() for d in _documents()]
    return out


@pytest.mark.slow
def test_predict_in_row_order_matches_one_process(tmp_path):
    import numpy as np

    results = run_ranks(_predict_worker, 2, str(tmp_path), timeout=300, env=_rank_env(2))
    for out in results:
        # The balanced placement: rank 0's positions of the first row are not one contiguous block.
        index = out["local_index"]
        assert len(index) == SEQ_LEN // 2 and index != list(range(index[0], index[0] + len(index))), index
        ref_logits, ref_labels, doc_ids = out["reference"]
        # Every row once (not once per CP rank), each position where one process has it.
        assert out["logits"].shape == ref_logits.shape == (2, SEQ_LEN, ref_logits.shape[-1])
        np.testing.assert_allclose(out["logits"], ref_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out["labels"], ref_labels)
        # Independent reference: each document alone through stock sdpa, at its positions in its row.
        docs = iter(out["alone"])
        for row in range(doc_ids.shape[0]):
            for doc in [d for d in dict.fromkeys(doc_ids[row].tolist()) if d != 0]:
                np.testing.assert_allclose(out["logits"][row, doc_ids[row] == doc], next(docs), rtol=1e-5, atol=1e-5)
        # compute_metrics sees exactly the returned arrays (predict and evaluate).
        for preds, labels in (out["predict_metrics"], out["eval_metrics"]):
            np.testing.assert_array_equal(preds, out["logits"])
            np.testing.assert_array_equal(labels, ref_labels)
        assert out["eval_rows"] == 2
        # preprocess_logits_for_metrics ran on each rank's shard (no [S, V] logits gathered); its argmax ids, in
        # row order, are the one process's element for element.
        assert set(out["received"]) == {((1, SEQ_LEN // 2, ref_logits.shape[-1]), (1, SEQ_LEN // 2))}
        np.testing.assert_array_equal(out["ids"], ref_logits.argmax(-1))
        np.testing.assert_array_equal(out["ids_labels"], ref_labels)
        np.testing.assert_array_equal(out["ids_metrics"][0], out["ids"])
        np.testing.assert_array_equal(out["ids_metrics"][1], ref_labels)
        # The exact token mean, also for the loss of predict().
        assert out["eval_loss"] == pytest.approx(_reference_eval_loss(), rel=1e-5)
        assert out["predict_loss"] == pytest.approx(out["eval_loss"], rel=1e-6)
        # CPSFTTrainer (TRL's data preparation and loss, the same evaluation step).
        sft = out["sft"]
        assert sft["ids"].shape == sft["ref_ids"].shape and sft["ids"].shape[0] >= 2
        np.testing.assert_array_equal(sft["ids"], sft["ref_ids"])
        np.testing.assert_array_equal(sft["labels"], sft["ref_labels"])
        np.testing.assert_array_equal(sft["metrics"][0], sft["ids"])
        np.testing.assert_array_equal(sft["metrics"][1], sft["ref_labels"])
        assert "preprocess_logits_for_metrics" in out["refusal"] and "per-position" in out["refusal"]
    np.testing.assert_array_equal(results[0]["logits"], results[1]["logits"])
