"""The indexer's key selection for one document: a running top-k over key blocks, with a stable tie rule.

Notation: ``n`` queries of one document (or one row), ``m`` keys, ``H`` indexer heads, ``D`` indexer head dim.
Query ``i`` sits at key position ``q_offset + i`` and may select keys ``0 .. q_offset + i`` (causal), those of
``key_valid`` only when it is given. The score of key ``j`` for query ``i`` is DSA's
``I[i, j] = sum_h w[i, h] * ReLU(scale * q[i, h] . k[j])``, computed in float32 with the same operations as
transformers' indexers (a matmul over ``D``, ReLU, a matmul over ``H``), so equal inputs give equal scores.

Tie rule: keys are ranked by score, descending; keys of equal score by position, ascending (the lower position in
the document first). A position here is relative to the document's first key, so the selection of a document does
not depend on where it sits in a packed row, on its neighbours, or on how the row is split.

Never an ``[n, m]`` score matrix: queries go in blocks of ``q_block``, keys in blocks of ``k_block`` (only those at
or before the query block's last query); a block's candidates are merged into the running best ``topk`` with one
stable sort, whose invariant (the running best holds equal scores in ascending position, every earlier position is
below the block's) makes the merge order the tie rule.
"""

from __future__ import annotations

import torch

__all__ = ["document_topk", "index_scores"]

_NEG_INF = float("-inf")


def index_scores(q_nHD: torch.Tensor, k_mD: torch.Tensor, w_nH: torch.Tensor, scale: float) -> torch.Tensor:
    """``[n, m]`` float32 DSA scores of queries ``q [n, H, D]`` (weights ``w [n, H]``) against keys ``k [m, D]``."""
    relu_nHm = torch.relu(torch.matmul(q_nHD.float(), k_mD.float().transpose(0, 1)) * scale)
    return torch.matmul(w_nH.float().unsqueeze(-2), relu_nHm).squeeze(-2)


def document_topk(q_nHD: torch.Tensor, k_mD: torch.Tensor, w_nH: torch.Tensor, scale: float, topk: int, *,
                  q_offset: int = 0, key_valid: torch.Tensor | None = None, q_block: int = 256,
                  k_block: int = 1024) -> torch.Tensor:
    """The selected keys of each query of one document.

    Args:
        q_nHD: ``[n, H, D]`` indexer queries; w_nH: ``[n, H]`` head weights (scaled as the model scales them).
        k_mD: ``[m, D]`` indexer keys, position 0 = the document's first key.
        scale: the indexer's softmax scale.
        topk: keys kept per query (``index_topk``).
        q_offset: key position of the first query (host int; ``m - n`` with a cache, 0 for a whole document).
        key_valid: ``[m]`` bool, keys that may be selected (a padding mask), or ``None`` = all.

    Returns:
        ``[n, min(topk, m)]`` int64 key positions in ``[0, m)``, best first, ``-1`` where a query has fewer
        selectable keys than slots. When every query can see at most ``topk`` keys (a document no longer than
        ``topk``), every earlier key is selected without scoring.
    """
    n, m = q_nHD.shape[0], k_mD.shape[0]
    width = min(topk, m)
    device = q_nHD.device
    if key_valid is None and q_offset + n <= topk:  # every query sees at most `topk` keys: all of them
        pos_K = torch.arange(width, device=device)
        reach_n = torch.arange(q_offset, q_offset + n, device=device)
        return torch.where(pos_K[None, :] <= reach_n[:, None], pos_K[None, :], -1)
    out_nK = torch.full((n, width), -1, dtype=torch.int64, device=device)
    for i0 in range(0, n, q_block):
        i1 = min(n, i0 + q_block)
        last = q_offset + i1  # keys [0, last) can be seen by some query of this block
        reach_b = torch.arange(q_offset + i0, q_offset + i1, device=device)
        best_v = torch.empty(i1 - i0, 0, dtype=torch.float32, device=device)
        best_p = torch.empty(i1 - i0, 0, dtype=torch.int64, device=device)
        for j0 in range(0, min(m, last), k_block):
            j1 = min(m, last, j0 + k_block)
            scores_bk = index_scores(q_nHD[i0:i1], k_mD[j0:j1], w_nH[i0:i1], scale)
            pos_k = torch.arange(j0, j1, device=device)
            hidden_bk = pos_k[None, :] > reach_b[:, None]
            if key_valid is not None:
                hidden_bk = hidden_bk | ~key_valid[j0:j1].to(torch.bool)[None, :]
            scores_bk = scores_bk.masked_fill(hidden_bk, _NEG_INF)
            cand_v = torch.cat([best_v, scores_bk], dim=1)
            cand_p = torch.cat([best_p, pos_k.expand(i1 - i0, -1)], dim=1)
            order = torch.sort(cand_v, dim=1, descending=True, stable=True).indices[:, :width]
            best_v, best_p = cand_v.gather(1, order), cand_p.gather(1, order)
        best_p = best_p.masked_fill(best_v == _NEG_INF, -1)
        out_nK[i0:i1, :best_p.shape[1]] = best_p
    return out_nK
