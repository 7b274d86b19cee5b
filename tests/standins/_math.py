"""The attention math the stand-ins compute: one segment, eager PyTorch, differentiable.

Written from the documented kernel contracts (flash-attn 2 / TransformerEngine), not from their
code. Half-precision inputs are computed in float32 (as the real kernels accumulate); float32 and
float64 inputs in their own precision, so CPU tests can compare at tight tolerances.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, causal: bool,
                      window: tuple[int, int], softcap: float = 0.0, dropout_p: float = 0.0,
                      bottom_right: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one segment.

    Args:
        q: ``[Sq, Hq, D]``; k: ``[Sk, Hk, D]``; v: ``[Sk, Hk, Dv]`` with ``Hk`` dividing ``Hq``
            (query head ``h`` reads K/V head ``h // (Hq // Hk)``).
        scale: multiplies ``q @ k^T`` before softcapping and softmax.
        causal: mask keys after the query's diagonal (then ``window[1]`` is treated as 0).
        window: ``(left, right)`` keys kept around the diagonal, ``-1`` = unbounded. The diagonal of
            query ``i`` is key ``i + Sk - Sq`` (bottom-right) or key ``i`` (top-left).
        softcap: ``> 0`` applies ``softcap * tanh(s / softcap)`` to the scaled scores.
        dropout_p: dropout on the probabilities (training semantics).

    Returns:
        ``(out [Sq, Hq, Dv] in q.dtype, lse [Hq, Sq] float32)``; a query that sees no key outputs
        zeros and has ``lse = -inf`` (the documented flash behaviour).
    """
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    groups = hq // hk
    cd = compute_dtype(q.dtype)
    qf = q.to(cd).transpose(0, 1)  # [Hq, Sq, D]
    kf = k.to(cd).repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, Sk, D]
    vf = v.to(cd).repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, Sk, Dv]
    scores = (qf @ kf.transpose(1, 2)) * scale  # [Hq, Sq, Sk]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    diag = torch.arange(sq, device=q.device)[:, None] + (sk - sq if bottom_right else 0)  # [Sq, 1]
    key = torch.arange(sk, device=q.device)[None, :]  # [1, Sk]
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left >= 0:
        allowed &= key >= diag - left
    if right >= 0:
        allowed &= key <= diag + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [Hq, Sq]; -inf for a query that sees nothing
    # Subtract a finite value so an empty row gives exp(-inf) = 0, never NaN (also in backward).
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    if dropout_p > 0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p, training=True)
    out = (probs @ vf).transpose(0, 1).to(q.dtype)  # [Sq, Hq, Dv]
    return out, lse.float()
