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
    with pytest.raises(ValueError, match="num_attention_heads"):
        head_shape(SimpleNamespace(hidden_size=8))
