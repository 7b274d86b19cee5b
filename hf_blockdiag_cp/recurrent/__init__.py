"""Recurrent token mixers (Mamba1/2, gated delta rule, KDA, short convolutions) on packed rows and CP shards.

:mod:`.functions` lists transformers' replaceable functions served, :mod:`.runs` the fragments of a forward's
local rows, :mod:`.install` what :func:`~hf_blockdiag_cp.model.prepare_model` puts on a model's mixers, and
:mod:`.state_passing` the exchange of fragment summaries between CP ranks (``recurrent_layout="state"``),
:mod:`.head_parallel` the head-parallel fallback (``"heads"``), :mod:`.agreement` the step's rank agreement before
the first recurrent collective. The kernels live in :mod:`.ops`.
"""
