"""Shared pieces of the sparse-indexer tests (a harness, not a test file): tiny DSA models with a small
``index_topk``, and the reference: each document alone through the stock model with the stable tie rule in its
indexer's top-k.

The stock indexers call ``Tensor.topk`` on their scores; :func:`stable_indexer_topk` swaps in, only while an
indexer's ``forward`` runs, a top-k that ranks equal scores by position, ascending (the package's rule,
docs/models.md). Nothing here imports the package's sparse code.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import torch

import hf_blockdiag_cp  # noqa: F401  (registers the attention name)
from hf_blockdiag_cp.conformance.configs import tiny_config
from hf_blockdiag_cp.conformance.runs import build_model, document_loss, forward_logits, make_documents

#: Documents of 9-41 tokens (longer than index_topk = 8: sparse), one of 5 (shorter: every earlier key).
LENGTHS = (9, 23, 5, 41, 12)
TOPK = 8
INDEXER_CLASSES = ("DeepseekV32Indexer", "GlmMoeDsaIndexer")


def dsa_config(model_type: str, topk: int = TOPK, layers: int = 2) -> Any:
    """A tiny fp32 config of ``model_type`` with ``index_topk = topk``; GLM's layers after the first are
    ``"shared"`` (they reuse the first layer's selection)."""
    config = copy.deepcopy(tiny_config(model_type))
    config.index_topk = topk
    config.num_hidden_layers = layers
    if model_type == "glm_moe_dsa":
        config.indexer_types = ["full"] + ["shared"] * (layers - 1)
        config.mlp_layer_types = ["dense"] * layers
    return config


def models(model_type: str, topk: int = TOPK, layers: int = 2) -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """``(stock eager, blockdiag_cp, config)`` with the same seeded weights."""
    config = dsa_config(model_type, topk, layers)
    return build_model(config, "eager"), build_model(config, "blockdiag_cp"), config


def documents(config: Any, lengths: tuple[int, ...] = LENGTHS, seed: int = 0) -> list[torch.Tensor]:
    return make_documents(config, seed=seed, lengths=lengths)


def _stable_topk(original: Any) -> Any:
    def topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        assert largest and dim in (-1, self.dim() - 1)
        order = torch.sort(self, dim=dim, descending=True, stable=True).indices[..., :k]
        return torch.return_types.topk((self.gather(dim, order), order))
    return topk


@contextlib.contextmanager
def stable_indexer_topk(model: torch.nn.Module) -> Iterator[None]:
    """While active, ``Tensor.topk`` inside ``model``'s indexers ranks equal scores by position, lower first."""
    original = torch.Tensor.topk
    stable = _stable_topk(original)
    inside = [0]

    def dispatch(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return (stable if inside[0] else original)(self, *args, **kwargs)

    def wrap(module: torch.nn.Module) -> Any:
        forward = module.forward

        def indexer_forward(*args: Any, **kwargs: Any) -> Any:
            inside[0] += 1
            try:
                return forward(*args, **kwargs)
            finally:
                inside[0] -= 1
        return indexer_forward

    indexers = [m for m in model.modules() if type(m).__name__ in INDEXER_CLASSES]
    for m in indexers:
        m.forward = wrap(m)
    torch.Tensor.topk = dispatch
    try:
        yield
    finally:
        torch.Tensor.topk = original
        for m in indexers:
            del m.forward


def reference(stock: torch.nn.Module, docs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Each document alone through ``stock`` with the stable tie rule: ``(logits [T, V], summed loss, gradients)``."""
    stock.zero_grad(set_to_none=True)
    with stable_indexer_topk(stock):
        logits = [forward_logits(stock, d[None])[0] for d in docs]
    loss = sum(document_loss(lg, d) for lg, d in zip(logits, docs))
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in stock.named_parameters() if p.grad is not None}
    return torch.cat(logits).detach(), loss.detach(), grads
