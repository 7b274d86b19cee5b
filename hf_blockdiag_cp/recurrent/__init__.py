"""Recurrent token mixers (Mamba1/2, gated delta rule, KDA, RG-LRU, mLSTM, lightning, convolutions) on packed rows
and CP shards: math and context parallelism only (README.md in this folder has the notation and the data flow).

:mod:`.kinds` the mixer kinds, :mod:`.algebra` the state algebras, :mod:`.driver` the one algorithm,
:mod:`.scan_runner` / :mod:`.module_runners` the runners, :mod:`.serve` the entry of a served call, :mod:`.runs` the
fragments of a forward, :mod:`.head_parallel` the head-parallel fallback (``recurrent_layout="heads"``),
:mod:`.backend` which kernel runs a call; the kernels live in :mod:`.ops`. Which transformers mixers are served and
how they reach this package: :mod:`hf_blockdiag_cp.mixer_table`, :mod:`hf_blockdiag_cp.mixer_hooks`.
"""
