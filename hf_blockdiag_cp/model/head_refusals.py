"""What a model's head does with the row, beyond attention: row-pooling heads and ``logits_to_keep``.

- **Row-pooling heads** (``*ForSequenceClassification`` — reward models —, ``*ForQuestionAnswering``,
  ``*ForMultipleChoice``) reduce each *row* to one answer: the score of the row's last non-pad token, a softmax over
  the row's positions. A packed row holds several documents (one score per row, not per document, even at CP = 1),
  and under CP each rank holds a shard (the rank without the row's last token pools another token). Refused for
  packed or sharded batches; one document per row (padded), without CP, is the model's own computation.
  ``*ForTokenClassification`` is per token and exact.
- **``logits_to_keep=k``** keeps the last ``k`` positions of what the head sees: under CP the last ``k`` of each
  rank's *shard*, not of the row. Refused under CP (``k != 0``); an empty index tensor (no logits at all, what
  :func:`~hf_blockdiag_cp.chunked_causal_lm_loss` asks for) is fine. At CP = 1 a packed row's last ``k`` positions
  are what one process computes on that row, as without the package.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Refusal

__all__ = ["ROW_POOLING_SUFFIXES", "check_logits_to_keep", "row_pooling_refusal"]

#: Task suffixes of transformers model classes whose head pools a whole row into one output.
ROW_POOLING_SUFFIXES = ("ForSequenceClassification", "ForQuestionAnswering", "ForMultipleChoice")


def row_pooling_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s head cannot serve packed or CP-sharded rows (``None``: it pools nothing across the row).

    Found from the model's class (and the classes it derives from), so a ``LlamaForSequenceClassification`` wrapped
    by PEFT is found through the wrapped model it is prepared as.
    """
    for cls in type(model).__mro__:
        name = cls.__name__
        suffix = next((s for s in ROW_POOLING_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            return (f"{type(model).__name__} pools each row into one output ({suffix[3:]}: e.g. the score of the "
                    "row's last non-pad token): with several documents in a row it gives one answer per row, not per "
                    "document, and under CP each rank pools its own shard. Give it one document per row (padded, "
                    "without cu_seq_lens_*/packed position_ids) and no cp_context, or use a token-level head "
                    "(ForTokenClassification / a causal LM) and pool per document yourself")
    return None


def check_logits_to_keep(model_type: str, named: dict[str, Any]) -> None:
    """Refuse ``logits_to_keep`` that would keep the last positions of each CP shard instead of the row's."""
    ctx = named.get("cp_context")
    keep = named.get("logits_to_keep")
    if getattr(ctx, "cp_size", 1) <= 1 or keep is None:
        return
    if isinstance(keep, torch.Tensor) and keep.numel() == 0 or isinstance(keep, int) and keep == 0:
        return
    raise Refusal(
        f"{model_type} was given logits_to_keep={keep if isinstance(keep, int) else 'an index tensor'} with a "
        f"cp_context (CP size {ctx.cp_size}): each rank would keep the last positions (or these indices) of its own "
        "shard, not of the row. Run the forward with logits_to_keep=0 and pick the positions from the row's logits "
        "(e.g. CPTrainer.predict gathers them in row order), or run these forwards without CP")
