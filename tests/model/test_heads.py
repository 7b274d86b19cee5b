"""Reading a transformers model config (hf_blockdiag_cp/model/heads.py): attribute values, per-layer ones
included, and the attention head geometry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hf_blockdiag_cp.model.heads import config_int, config_values, head_shape
from hf_blockdiag_cp.planning.layout import HeadShape
from tests.reference import tiny_model


def test_per_layer_config_attributes_are_read_per_layer():
    """transformers' heterogeneous configs (gemma4: head_dim per layer) refuse a global read; the sweep at CP = 2
    found the per-forward agreement crashing on it. Both readers take the per-layer values."""
    from hf_blockdiag_cp.conformance.configs import tiny_config

    config = tiny_config("gemma4_text")
    with pytest.raises(RuntimeError, match="per-layer attribute"):
        config.head_dim  # noqa: B018  (what the agreement used to read)
    dims = config_values(config, "head_dim")
    assert len(dims) == config.num_hidden_layers and len(set(dims)) == 2, dims
    assert config_values(config, "num_attention_heads") == (config.num_attention_heads,)
    assert config_int(config, "head_dim") == sum((i + 1) * d for i, d in enumerate(dims))
    with pytest.raises(NotImplementedError, match="sets head_dim per layer"):
        head_shape(config)


def test_head_shape_from_model_configs():
    assert head_shape(tiny_model("llama").config) == HeadShape(4, 2, 16)
    mla = SimpleNamespace(num_attention_heads=8, num_key_value_heads=8, qk_nope_head_dim=16, qk_rope_head_dim=8,
                          v_head_dim=12, hidden_size=64)
    assert head_shape(mla) == HeadShape(8, 8, 24, 12)
    with pytest.raises(NotImplementedError, match="num_attention_heads"):  # no heads: refused, the cause named
        head_shape(SimpleNamespace(hidden_size=8))
    with pytest.raises(ValueError, match="num_attention_heads"):
        head_shape(SimpleNamespace(num_attention_heads="8", hidden_size=8))


def test_a_model_without_attention_heads_refuses_the_head_parallel_layout():
    """Pure state-space models (mamba, mamba2, falcon_mamba) have no heads to split: a head-parallel collator is
    refused with the cause (the sweep's CP = 2, u = 2 pass found a ValueError there)."""
    import transformers

    from hf_blockdiag_cp import PackingCollator, UnsupportedModel

    config = transformers.MambaConfig(vocab_size=97, hidden_size=16, num_hidden_layers=1)
    with pytest.raises(UnsupportedModel, match="names no attention heads.*ulysses_size=1"):
        head_shape(config)
    with pytest.raises(NotImplementedError, match="names no attention heads"):
        PackingCollator(64, cp_size=2, cp_rank=0, pad_token_id=0, ulysses_size=2, model_config=config)
