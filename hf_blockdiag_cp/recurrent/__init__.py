"""Recurrent token mixers (Mamba1/2, gated delta rule, KDA, short convolutions) on packed rows and CP shards.

:mod:`.functions` lists transformers' replaceable functions served, :mod:`.runs` the fragments of a forward's
local rows, :mod:`.install` what :func:`~hf_blockdiag_cp.model.prepare_model` puts on a model's mixers, and
:mod:`.state_passing` the exchange of fragment summaries between CP ranks. The kernels live in :mod:`.ops`.
"""
