"""Serving DSA indexers per document: what :func:`~hf_blockdiag_cp.model.prepare_model` installs on them.

transformers' indexers (``DeepseekV32Indexer``, ``GlmMoeDsaIndexer``) score every query against every key of the
row, read the 4-D mask, and keep ``torch.topk``'s choice: on a packed row that needs the dense mask, and ties (keys
whose ReLU is 0 in every head score exactly 0) are broken by absolute position in the row. Each indexer gets an
instance ``forward`` (the module keeps its class and parameters) that

- passes the call through unchanged when the mask is a tensor (the model switched to eager / sdpa);
- otherwise computes the indexer's queries, keys and head weights as the model does and selects, for each
  document of the forward (the fragments its preparation derived from ``cp_context`` / ``cu_seq_lens_*`` /
  ``position_ids``, as the recurrent mixers get them), the top ``index_topk`` keys of that document at or before the
  query, with :func:`~.topk.document_topk`'s stable tie rule; with one document per row (generation), the row's
  non-padding keys;
- returns ``[B, L, min(index_topk, S)]`` int32 key positions of the query's row (``-1``: no key), one coordinate
  system for the whole step, so GLM's ``"shared"`` layers reuse them as they are.

The attention layer then passes them as ``indices=`` to the ``"blockdiag_cp"`` attention function, which attends over
them within the plan's bounds (:mod:`.attention`). Under CP (a ``cp_context`` with ``cp_size > 1``) the attention
layers' ``expand_kv`` is served too: the MLA latent crosses ranks instead of the expanded K/V, and the indices are
global positions of the row (:mod:`.cp`).
"""

from __future__ import annotations

import inspect
from types import MethodType
from typing import Any

import torch

from ..attention.mask import BlockDiagMask, IndexerMask
from ..compat import SPARSE_ATTENTIONS, SPARSE_INDEXER_ATTRS, SPARSE_INDEXER_PARAMS, SPARSE_INDEXERS, indexer_rope
from ..errors import MaskConsumedError, UnsupportedModel
from .cp import expand_kv, select_cp
from .topk import document_topk

__all__ = ["INDEXERS", "REFUSED_INDEXERS", "install_indexers", "is_served_indexer", "served_indices_refusal",
           "uninstall_indexers"]

#: Indexer classes served per document (their RoPE layout: :data:`~hf_blockdiag_cp.compat.SPARSE_INDEXERS`).
INDEXERS = frozenset(SPARSE_INDEXERS)
#: On a served indexer: the original bound ``forward``, and the model's probe.
_ORIGINAL = "_blockdiag_cp_indexer_original"
_PROBE = "_blockdiag_cp_indexer_probe"
#: On a served DSA attention layer: its original bound ``expand_kv``.
_ORIGINAL_EXPAND = "_blockdiag_cp_expand_kv_original"


#: Indexers of other shapes, refused at their forward on blockdiag_cp's mask (why, and what serving them would need).
REFUSED_INDEXERS: dict[str, str] = {
    "Qwen4ExpTextQSAIndexer": (
        "its QSA indexer (Qwen4ExpTextQSAIndexer) is not served by blockdiag_cp: it mean-pools the keys in blocks of "
        "indexer_compress_ratio visible tokens, selects blocks with torch.topk (ties broken by absolute position), and "
        "returns the selection as a dense boolean [B, 1, L, S] mask that Qwen4ExpTextAttention.forward ANDs with the "
        "4-D attention mask before calling attention: there is no indices= channel to the attention function, so "
        "serving it needs a replacement of the attention layer's forward and a block-sparse attention (not "
        "implemented). Use attn_implementation='sdpa' or 'eager' for this model"),
}


def is_served_indexer(module: torch.nn.Module) -> bool:
    return _ORIGINAL in module.__dict__


def _check_indexer(module: torch.nn.Module) -> None:
    """Raise ``UnsupportedModel`` if an indexer class no longer looks as this package assumes (an upgrade)."""
    name = type(module).__name__
    params = tuple(inspect.signature(type(module).forward).parameters)
    missing = [a for a in SPARSE_INDEXER_ATTRS if not hasattr(module, a)]
    if params[:len(SPARSE_INDEXER_PARAMS)] != SPARSE_INDEXER_PARAMS or missing:
        raise UnsupportedModel(f"transformers' {name} changed (forward takes {params}, missing attributes {missing}); "
                               "blockdiag_cp cannot serve its indexer per document")


def install_indexers(model: torch.nn.Module, probe: Any) -> int:
    """Install the per-document ``forward`` on every DSA indexer of ``model`` and the CP ``expand_kv`` on every DSA
    attention layer; returns how many indexers (idempotent; the probe's ``runs`` are the fragments of the forward in
    progress)."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in SPARSE_ATTENTIONS and callable(getattr(module, "expand_kv", None)):
            module.__dict__[_PROBE] = probe
            if _ORIGINAL_EXPAND not in module.__dict__:
                module.__dict__[_ORIGINAL_EXPAND] = module.expand_kv
                module.__dict__["expand_kv"] = MethodType(_expand_kv, module)
        if type(module).__name__ in REFUSED_INDEXERS and _ORIGINAL not in module.__dict__:
            module.__dict__[_ORIGINAL] = module.forward
            module.__dict__["forward"] = MethodType(_refused_forward, module)
        if type(module).__name__ not in INDEXERS:
            continue
        _check_indexer(module)
        count += 1
        module.__dict__[_PROBE] = probe
        if _ORIGINAL not in module.__dict__:
            module.__dict__[_ORIGINAL] = module.forward
            module.__dict__["forward"] = MethodType(_indexer_forward, module)
    return count


def uninstall_indexers(model: torch.nn.Module) -> None:
    """Give every served indexer of ``model`` its class ``forward`` back."""
    for module in model.modules():
        if module.__dict__.pop(_ORIGINAL, None) is not None:
            module.__dict__.pop("forward", None)
        if module.__dict__.pop(_ORIGINAL_EXPAND, None) is not None:
            module.__dict__.pop("expand_kv", None)
        module.__dict__.pop(_PROBE, None)


def served_indices_refusal(module: torch.nn.Module) -> str | None:
    """Why an attention call's ``indices=`` cannot be served (``None``: they come from a served indexer, or, on a
    ``"shared"`` GLM layer, from the previous layer's). Host attribute reads only."""
    name = type(module).__name__
    if name not in SPARSE_ATTENTIONS:
        return (f"{name} passes indices= (sparse attention indices) from an indexer blockdiag_cp does not serve per "
                "document (only DeepSeek-V3.2 / GLM-MoE-DSA indexers are)")
    indexer = getattr(module, "indexer", None)
    if indexer is not None and not is_served_indexer(indexer):
        return (f"{name} passes indices= from its {type(indexer).__name__}, which is not served per document (the "
                "model was not prepared)")
    return None


def _indexer_forward(self: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
                     position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any,
                     position_ids: torch.Tensor | None = None, cache: Any = None, **kwargs: Any) -> torch.Tensor:
    if cache is None:
        cache = kwargs.pop("past_key_values", None)
    original = self.__dict__[_ORIGINAL]
    if not isinstance(attention_mask, IndexerMask):  # a tensor mask: the model runs eager / sdpa
        return original(hidden_states, q_resid, position_embeddings, attention_mask, position_ids, cache=cache,
                        **kwargs)
    with torch.no_grad():
        return _select(self, hidden_states, q_resid, position_embeddings, attention_mask, cache)


def _refused_forward(self: torch.nn.Module, hidden_states: torch.Tensor, position_embeddings: Any,
                     attention_mask: Any, *args: Any, **kwargs: Any) -> Any:
    """An indexer of :data:`REFUSED_INDEXERS`: unchanged on a tensor mask, refused on blockdiag_cp's."""
    if isinstance(attention_mask, BlockDiagMask):
        raise MaskConsumedError(f"{attention_mask.model_type}: {REFUSED_INDEXERS[type(self).__name__]}")
    return self.__dict__[_ORIGINAL](hidden_states, position_embeddings, attention_mask, *args, **kwargs)


def _held_runs(probe: Any) -> Any:
    if probe is None or not probe.holds_step():
        return None
    return probe.held("a sparse indexer").runs  # the forward being recomputed, else the latest (or refused)


def _expand_kv(self: torch.nn.Module, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DSA attention layer's ``expand_kv``: unchanged at CP = 1; under CP the latent crosses ranks first."""
    original = self.__dict__[_ORIGINAL_EXPAND]
    runs = _held_runs(self.__dict__.get(_PROBE))
    if runs is None or runs.cp_size == 1:
        return original(kv_nope, k_rot)
    return expand_kv(self, original, runs.context, kv_nope, k_rot)


def _select(self: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
            position_embeddings: tuple[torch.Tensor, torch.Tensor], attention_mask: Any, cache: Any) -> torch.Tensor:
    """``[B, L, K]`` int32 selected key positions per query (``-1``: none); see the module docstring."""
    name = type(self).__name__
    model_type = attention_mask.mask.model_type
    runs = _held_runs(self.__dict__.get(_PROBE))
    if runs is not None and cache is not None:
        raise ValueError(f"{model_type}: {name} got a cache with packed rows (a cp_context, cu_seq_lens_* or packed "
                         "position_ids); blockdiag_cp trains packed rows without a cache: pass use_cache=False")
    batch, local_len, _ = hidden_states.shape
    q_BLHD, k_BSD, w_BLH = _project(self, hidden_states, q_resid, position_embeddings)
    if runs is not None and runs.cp_size > 1:
        if runs.local_len != local_len or batch != 1:
            raise ValueError(f"{model_type}: {name} got rows [B={batch}, L={local_len}] but this CP step has "
                             f"[B=1, L={runs.local_len}]")
        return select_cp(self, runs.context, runs.fragments, q_BLHD, k_BSD, w_BLH)
    if cache is not None:
        k_BSD = cache.update_indexer(k_BSD, self.layer_idx)
    keys = k_BSD.shape[1]
    width = min(int(self.index_topk), keys)
    out_BLK = torch.full((batch, local_len, width), -1, dtype=torch.int32, device=hidden_states.device)
    scale = float(self.softmax_scale)
    if runs is not None:
        if runs.batch_size != batch or runs.local_len != local_len or keys != local_len:
            raise ValueError(f"{model_type}: {name} got rows [B={batch}, L={local_len}, S={keys}] but this forward's "
                             f"packed batch has [B={runs.batch_size}, L={runs.local_len}]")
        for frag in runs.fragments:
            if frag.doc == 0:  # padding: selects nothing (its outputs are not used)
                continue
            rows = slice(frag.start, frag.start + frag.length)
            sel = document_topk(q_BLHD[frag.row, rows], k_BSD[frag.row, rows], w_BLH[frag.row, rows], scale,
                                int(self.index_topk))
            out_BLK[frag.row, rows, :sel.shape[1]] = torch.where(sel >= 0, sel + frag.start, -1)
        return out_BLK
    # One document per row: the row's keys (a cache's included), queries bottom-right, padding keys never selected.
    padding = attention_mask.mask.padding_mask
    if padding is not None and padding.shape[-1] != keys:
        raise ValueError(f"{model_type}: {name} has {keys} keys but the padding mask covers {padding.shape[-1]}")
    for b in range(batch):
        sel = document_topk(q_BLHD[b], k_BSD[b], w_BLH[b], scale, int(self.index_topk), q_offset=keys - local_len,
                            key_valid=None if padding is None else padding[b])
        out_BLK[b, :, :sel.shape[1]] = sel
    return out_BLK


def _project(self: torch.nn.Module, hidden_states: torch.Tensor, q_resid: torch.Tensor,
             position_embeddings: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's queries ``[B, L, H, D]``, keys ``[B, L, D]`` (RoPE on their first ``qk_rope_head_dim`` dims, in
    the model's own layout) and head weights ``[B, L, H]`` float32 (scaled by ``H ** -0.5``)."""
    batch, local_len, _ = hidden_states.shape
    heads, dim, rope_dim = int(self.n_heads), int(self.head_dim), int(self.qk_rope_head_dim)
    cos, sin = position_embeddings
    q = self.wq_b(q_resid).view(batch, local_len, heads, dim)
    k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)  # [B, L, 1, D]
    q_rope, k_rope = indexer_rope(self)(q[..., :rope_dim], k[..., :rope_dim], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rope, q[..., rope_dim:]], dim=-1)
    k = torch.cat([k_rope, k[..., rope_dim:]], dim=-1).squeeze(2)
    weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * (heads ** -0.5)
    return q, k, weights
