"""Acceptance 5 (core): bad input raises ValueError/TypeError naming the field; config and env vars."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp import BACKENDS, BlockDiagCPConfig, BlockDiagCPContext, blockdiag_attention


def _qkv(batch=1, num_q_heads=4, num_kv_heads=2, local_len=8, full_len=8, head_dim=16, kv_head_dim=None):
    q = torch.randn(batch, num_q_heads, local_len, head_dim)
    k = torch.randn(batch, num_kv_heads, full_len, kv_head_dim or head_dim)
    v = torch.randn(batch, num_kv_heads, full_len, kv_head_dim or head_dim)
    return q, k, v


@pytest.mark.parametrize("kwargs,doc_ids,error,match", [
    ({}, torch.ones(7, dtype=torch.long), ValueError, "doc_ids has length 7"),
    ({}, torch.ones(8), TypeError, "doc_ids must have an integer dtype"),
    ({}, torch.ones(8, dtype=torch.bool), TypeError, "doc_ids must have an integer dtype"),
    ({}, torch.tensor([1, 1, -1, 2, 2, 2, 2, 2]), ValueError, "doc_ids must be >= 0"),
    ({}, torch.ones(2, 8, dtype=torch.long), ValueError, "doc_ids has batch size 2"),
    ({}, torch.ones(1, 1, 8, dtype=torch.long), ValueError, r"doc_ids must be \[S\] or \[B, S\]"),
    ({"row_offset": 1}, torch.ones(8, dtype=torch.long), ValueError, "row_offset=1 \\+ L=8 exceeds"),
    ({"backend": "magic"}, torch.ones(8, dtype=torch.long), ValueError, "backend='magic' is not one of auto, flash"),
    ({"sliding_window": 0}, torch.ones(8, dtype=torch.long), ValueError, "sliding_window"),
    ({"dropout_p": 1.5}, torch.ones(8, dtype=torch.long), ValueError, "dropout_p"),
])
def test_bad_arguments_name_the_field(kwargs, doc_ids, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        blockdiag_attention(q, k, v, doc_ids, **kwargs)


@pytest.mark.parametrize("shapes,error,match", [
    (dict(num_q_heads=3, num_kv_heads=2), ValueError, "Hq=3 must be a multiple of key/value heads Hkv=2"),
    (dict(kv_head_dim=8), ValueError, "head dims differ: query D=16, key D=8"),
    (dict(batch=1), None, None),
])
def test_head_mismatches(shapes, error, match):
    q, k, v = _qkv(**shapes)
    if error is None:
        blockdiag_attention(q, k, v, torch.ones(8, dtype=torch.long))
        return
    with pytest.raises(error, match=match):
        blockdiag_attention(q, k, v, torch.ones(8, dtype=torch.long))


def test_dtype_and_rank_mismatches():
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="dtypes differ"):
        blockdiag_attention(q, k.double(), v, torch.ones(8, dtype=torch.long))
    with pytest.raises(ValueError, match="query must be 4-D"):
        blockdiag_attention(q[0], k, v, torch.ones(8, dtype=torch.long))
    with pytest.raises(TypeError, match="floating point"):
        blockdiag_attention(q.long(), k.long(), v.long(), torch.ones(8, dtype=torch.long))


def test_config_validates_and_lists_valid_names():
    with pytest.raises(ValueError, match="auto, flash, te, torch_varlen, flex, sdpa_doc, sdpa_mask"):
        BlockDiagCPConfig(backend="fast")
    with pytest.raises(ValueError, match="kv_exchange='ring'"):
        BlockDiagCPConfig(kv_exchange="ring")
    assert BlockDiagCPConfig(backend="SDPA_DOC").backend == "sdpa_doc"
    assert BACKENDS[0] == "auto"


def test_environment_overrides_defaults_not_explicit_values(monkeypatch):
    monkeypatch.setenv("HF_BLOCKDIAG_CP_BACKEND", "sdpa_mask")
    monkeypatch.setenv("HF_BLOCKDIAG_CP_DETERMINISTIC", "1")
    monkeypatch.setenv("HF_BLOCKDIAG_CP_KV_EXCHANGE", "a2a")
    config = BlockDiagCPConfig()
    assert (config.backend, config.deterministic, config.kv_exchange) == ("sdpa_mask", True, "a2a")
    assert BlockDiagCPConfig(backend="sdpa_doc").backend == "sdpa_doc"
    monkeypatch.setenv("HF_BLOCKDIAG_CP_BACKEND", "nope")
    with pytest.raises(ValueError, match="backend='nope'"):
        BlockDiagCPConfig()
    monkeypatch.setenv("HF_BLOCKDIAG_CP_BACKEND", "auto")
    monkeypatch.setenv("HF_BLOCKDIAG_CP_VALIDATE", "maybe")
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_VALIDATE='maybe' is not a boolean"):
        BlockDiagCPConfig()


@pytest.mark.parametrize("entry", ["public", "hf"])
def test_env_backend_is_used_by_the_attention_path(monkeypatch, entry):
    """The env default reaches the kernel choice when the caller names no backend."""
    import hf_blockdiag_cp.kernels.sdpa_doc as sdpa_doc
    import hf_blockdiag_cp.kernels.sdpa_mask as sdpa_mask
    from hf_blockdiag_cp.integration import blockdiag_cp_attention

    calls = []
    for module in (sdpa_mask, sdpa_doc):
        original = module.attention
        monkeypatch.setattr(module, "attention",
                            lambda *a, _name=module.NAME, _f=original, **k: calls.append(_name) or _f(*a, **k))
    q, k, v = _qkv()

    def run() -> None:
        if entry == "public":
            blockdiag_attention(q, k, v, torch.ones(8, dtype=torch.long))
        else:
            blockdiag_cp_attention(torch.nn.Module(), q, k, v, None)

    run()
    assert calls == ["sdpa_doc"]  # the CPU "auto" choice
    monkeypatch.setenv("HF_BLOCKDIAG_CP_BACKEND", "sdpa_mask")
    run()
    assert calls == ["sdpa_doc", "sdpa_mask"]
    if entry == "public":  # an explicit argument still wins over the environment
        blockdiag_attention(q, k, v, torch.ones(8, dtype=torch.long), backend="sdpa_doc")
        assert calls[-1] == "sdpa_doc"


def test_collective_timeout_must_be_finite():
    with pytest.raises(ValueError, match="collective_timeout_s=inf"):
        BlockDiagCPConfig(collective_timeout_s=float("inf"))


def test_collective_timeout_env_names_the_variable(monkeypatch):
    monkeypatch.setenv("HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S", "inf")
    with pytest.raises(ValueError, match="HF_BLOCKDIAG_CP_COLLECTIVE_TIMEOUT_S"):
        BlockDiagCPConfig()


def test_context_rejects_bad_sharding():
    with pytest.raises(ValueError, match="cp_rank=2 must be an int in"):
        BlockDiagCPContext.build(torch.ones(8, dtype=torch.long), cp_rank=2, cp_size=2)
    with pytest.raises(ValueError, match="not divisible by cp_size=3"):
        BlockDiagCPContext.build(torch.ones(8, dtype=torch.long), cp_rank=0, cp_size=3)


def test_unsupported_features_raise_instead_of_computing_something_else():
    from hf_blockdiag_cp.integration import blockdiag_cp_attention
    from hf_blockdiag_cp.kernels import BackendUnavailable

    q, k, v = _qkv()
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match="causal"):
        blockdiag_cp_attention(module, q, k, v, None, is_causal=False)
    with pytest.raises(NotImplementedError, match="position bias"):
        blockdiag_cp_attention(module, q, k, v, None, position_bias=torch.zeros(1, 4, 8, 8))
    q.requires_grad_()
    with pytest.raises(BackendUnavailable, match="softcap"):  # CPU softcap exists, but not with dropout
        blockdiag_cp_attention(module, q, k, v, None, softcap=30.0, dropout=0.1)
