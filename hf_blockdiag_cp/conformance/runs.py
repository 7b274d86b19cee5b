"""Tiny models and the two runs the check compares: each document alone through the stock model
(the reference) and the packed row through the model under ``"blockdiag_cp"``, in one of three input
variants (packed ``position_ids``, ``cu_seq_lens_*`` keywords, a :class:`PackingCollator` batch)."""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Sequence
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM

from ..compat import model_from_config
from ..data import Document, PackedRow, PackingCollator
from .configs import VOCAB, causal_lm_names, text_config

__all__ = [
    "LENGTHS",
    "VARIANTS",
    "accepts_keyword",
    "build_model",
    "collated_batch",
    "document_loss",
    "forward_logits",
    "grad_error",
    "make_documents",
    "packed_inputs",
    "packed_run",
    "reference_run",
]

#: Document lengths of the packed row: windows (6) and chunks (8) are exceeded, one document has one token.
LENGTHS = (7, 1, 12, 4, 9)
#: The packed input variants, in the order the check runs them.
VARIANTS = ("position_ids", "cu_seq_lens", "collator")


def build_model(config: Any, attn_implementation: str | None, seed: int = 0) -> torch.nn.Module:
    """The causal LM of ``config`` with random weights (seeded), fp32, eval mode."""
    torch.manual_seed(seed)
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # A copy: from_config records the attention implementation on the config object it is given.
        config = copy.deepcopy(config)
        if getattr(config, "model_type", None) in causal_lm_names():
            model = AutoModelForCausalLM.from_config(config, **kwargs)
        else:  # the text config of a composite type, with its causal LM class named in `architectures`
            model = model_from_config(getattr(transformers, config.architectures[0]), config, **kwargs)
    if hasattr(model, "set_default_language"):  # X-MOD needs a language adapter chosen
        model.set_default_language(list(getattr(config, "languages", ["en_XX"]))[0])
    return model.float().eval()


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    for cfg in {id(config): config, id(text_config(config)): text_config(config)}.values():
        for name, value in vars(cfg).items():
            if ("token_id" in name or "token_index" in name) and isinstance(value, int):
                ids.add(value)
            elif ("token_id" in name) and isinstance(value, (list, tuple)):
                ids.update(v for v in value if isinstance(v, int))
    return ids


def make_documents(config: Any, seed: int = 0, lengths: Sequence[int] = LENGTHS) -> list[torch.Tensor]:
    """Random documents (``[n]`` int64 each) of ``lengths`` tokens avoiding the config's special token ids."""
    vocab = int(getattr(text_config(config), "vocab_size", VOCAB) or VOCAB)
    allowed = torch.tensor([t for t in range(3, min(vocab, VOCAB)) if t not in _special_ids(config)])
    gen = torch.Generator().manual_seed(seed)
    return [allowed[torch.randint(0, allowed.numel(), (n,), generator=gen)] for n in lengths]


def accepts_keyword(model: torch.nn.Module, name: str) -> bool:
    """Whether ``model.forward`` takes keyword ``name`` (by name or through ``**kwargs``)."""
    params = inspect.signature(model.forward).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def forward_logits(model: torch.nn.Module, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """``model(input_ids, **kwargs)``'s logits ``[B, L, V]`` (no cache)."""
    if accepts_keyword(model, "use_cache"):
        kwargs.setdefault("use_cache", False)
    out = model(input_ids=input_ids, **kwargs)
    return out.logits if hasattr(out, "logits") else out[0]


def document_loss(logits: torch.Tensor, doc: torch.Tensor) -> torch.Tensor:
    """Summed next-token loss of one document (``logits [n, V]``): a packed run must not predict across documents."""
    return torch.nn.functional.cross_entropy(logits[:-1].float(), doc[1:], reduction="sum")


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """``||g - g_ref|| / ||g_ref||`` over all parameters together (a missing gradient counts in full)."""
    num, den = 0.0, 0.0
    for name, g_ref in ref.items():
        g = grads.get(name, torch.zeros_like(g_ref))
        num += float((g.double() - g_ref.double()).pow(2).sum())
        den += float(g_ref.double().pow(2).sum())
    for name, g in grads.items():
        if name not in ref:
            num += float(g.double().pow(2).sum())
    return (num ** 0.5) / max(den ** 0.5, 1e-30)


def reference_run(model: torch.nn.Module, docs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Each document alone through ``model`` (stock attention): ``(logits [T, V], gradients)``."""
    model.zero_grad(set_to_none=True)
    logits = [forward_logits(model, d[None])[0] for d in docs]
    sum(document_loss(lg, d) for lg, d in zip(logits, docs)).backward()
    return torch.cat(logits).detach().float(), _grads(model)


def packed_inputs(docs: Sequence[torch.Tensor], variant: str, pad_token_id: int = 0) -> dict[str, Any]:
    """``model(**inputs)`` for the packed row of ``docs`` in one of :data:`VARIANTS` (keys starting with
    ``_`` are for the check, not the model)."""
    lengths = [len(d) for d in docs]
    ids = torch.cat(list(docs))[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    if variant == "position_ids":
        return {"input_ids": ids, "position_ids": position_ids}
    if variant == "cu_seq_lens":
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        return {"input_ids": ids, "position_ids": position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
                "max_length_q": max(lengths), "max_length_k": max(lengths)}
    if variant == "collator":
        return collated_batch(docs, cp_size=1, cp_rank=0, group=None, pad_token_id=pad_token_id)
    raise ValueError(f"variant={variant!r}: expected one of {VARIANTS}")


def collated_batch(docs: Sequence[torch.Tensor], *, cp_size: int, cp_rank: int, group: Any, pad_token_id: int
                   ) -> dict[str, Any]:
    """A :class:`PackingCollator` batch of ``docs`` laid out in order in one row: the model inputs
    (``input_ids``, ``position_ids``, ``cp_context``) and ``_shift_labels`` ``[1, local_len]``."""
    total = sum(len(d) for d in docs)
    seq_len = -(-total // cp_size) * cp_size
    collator = PackingCollator(seq_len, cp_size=cp_size, cp_rank=cp_rank, group=group, pad_token_id=pad_token_id)
    row = PackedRow(tuple(Document(d, d.clone(), 0, i) for i, d in enumerate(docs)))
    batch = collator([row])
    return {k: batch[k] for k in ("input_ids", "position_ids", "cp_context")} | {"_shift_labels": batch["shift_labels"]}


def packed_run(model: torch.nn.Module, docs: Sequence[torch.Tensor], inputs: dict[str, Any]
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The packed row through ``model``: ``(logits of the real tokens [T, V], gradients)``."""
    model.zero_grad(set_to_none=True)
    inputs = {k: v for k, v in inputs.items() if not k.startswith("_")}
    logits = forward_logits(model, **inputs)[0]
    bounds = [0]
    for d in docs:
        bounds.append(bounds[-1] + len(d))
    sum(document_loss(logits[a:b], d) for a, b, d in zip(bounds, bounds[1:], docs)).backward()
    return logits[: bounds[-1]].detach().float(), _grads(model)
