"""Recurrent token-mixer kernels behind one contract (see the issue 24 contract).

Every op takes packed ``[B, T, ...]`` inputs (``B == 1`` with ``cu_seqlens`` for packed rows), restarts at each
sequence start, takes ``initial_state`` (zeros when None), returns ``(out, final_state or None)`` with fp32 states
``[N, ...]``, and is exactly differentiable through outputs, final states and initial states. ``seq_lens_host``
(the sequence lengths as Python ints, which the context has) avoids the one host read of ``cu_seqlens``.

The pure-PyTorch chunked ops here run anywhere (the CPU path); :mod:`.adapters` wraps the GPU libraries
(flash-linear-attention, mamba_ssm, causal-conv1d) behind the same signatures. ``*_reference`` are float64
token-by-token recurrences for the tests.
"""

from .conv import causal_conv1d, causal_conv1d_reference
from .delta_rule import (
                         chunk_gated_delta_rule,
                         chunk_kda,
                         delta_rule_reference,
                         gated_delta_rule_transition,
                         kda_transition,
                         l2norm,
)
from .selective_scan import selective_scan, selective_scan_reference, selective_scan_transition
from .ssd import discretised_dt, ssd_chunk_scan, ssd_chunk_scan_reference, ssd_transition

# the pure-PyTorch op per name; adapters.LIBRARY_OPS has the GPU-library op under the same names
TORCH_OPS = {
    "causal_conv1d": causal_conv1d,
    "ssd_chunk_scan": ssd_chunk_scan,
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "chunk_kda": chunk_kda,
    "selective_scan": selective_scan,
}

__all__ = [
    "TORCH_OPS",
    "causal_conv1d", "causal_conv1d_reference",
    "chunk_gated_delta_rule", "chunk_kda", "delta_rule_reference", "gated_delta_rule_transition", "kda_transition",
    "l2norm",
    "selective_scan", "selective_scan_reference", "selective_scan_transition",
    "discretised_dt", "ssd_chunk_scan", "ssd_chunk_scan_reference", "ssd_transition",
]
