"""The kinds of recurrent token mixer the package serves: one enum, the key of every per-kind table.

A kind names a state algebra (:mod:`.algebra`) and, where the package has one, an op (:mod:`.ops`). Adding a mixer
family is one algebra and one row in :data:`~.algebra.ALGEBRAS` (plus the op, if any).
"""

from __future__ import annotations

from enum import Enum

__all__ = ["MixerKind"]


class MixerKind(str, Enum):
    """What recurrence a served call runs (a ``str`` so that configuration tables and messages read it as text)."""

    #: causal depthwise convolution over the last ``K - 1`` inputs (state: those inputs)
    CONV = "conv"
    #: Mamba2 / SSD: ``S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T`` per head (state ``[H, P, N]``)
    SSD = "ssd"
    #: Mamba1 selective scan: ``S_t = exp(delta_t A) * S_{t-1} + delta_t x_t B_t`` (state ``[D, N]``)
    SELECTIVE = "selective"
    #: a diagonal linear recurrence ``h_t = a_t * h_{t-1} + x_t`` (RecurrentGemma's RG-LRU, state ``[W]``)
    DIAG = "diag"
    #: gated delta rule (state ``[H, Dk, Dv]``, transition a matrix per token)
    DELTA = "delta"
    #: Kimi delta attention (the delta rule with a per-channel gate)
    KDA = "kda"
    #: xLSTM's mLSTM: a log-stabilised matrix memory ``(C, n, m)``
    MLSTM = "mlstm"
    #: MiniMax's lightning attention: ``S_t = exp(-rate) S_{t-1} + k_t^T v_t`` inside a module's forward
    LIGHTNING = "lightning"
    #: a module whose outputs read a fixed window of earlier inputs (plain ``nn.Conv1d`` mixers)
    WINDOW = "window"

    def __str__(self) -> str:
        return self.value
