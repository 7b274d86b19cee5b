"""Sparse-indexer attention (DeepSeek-V3.2 DSA, GLM-MoE-DSA) served per document.

- :mod:`.topk`: the indexer's key selection for one document: a running top-k over key blocks with the stable tie
  rule (equal scores: the lower position in the document first); knows nothing of transformers.
- :mod:`.attention`: attention of each query over its selected keys (gather + softmax, exact), limited to the keys
  its document lets it see.
- :mod:`.cp`: the same under context parallelism: the MLA latent and the indexer keys move by the step's exchange plan
  (the expanded K/V never cross ranks), the selection is over the whole document.
- :mod:`.indexer`: what :func:`~hf_blockdiag_cp.model.prepare_model` installs on a model's indexers (a per-instance
  ``forward`` that selects per document) and the check that an attention call's ``indices`` came from one.
"""

from .attention import query_bounds, selects_everything, sparse_attention
from .indexer import INDEXERS, install_indexers, served_indices_refusal, uninstall_indexers
from .topk import document_topk

__all__ = ["INDEXERS", "document_topk", "install_indexers", "query_bounds", "selects_everything",
           "served_indices_refusal", "sparse_attention", "uninstall_indexers"]
