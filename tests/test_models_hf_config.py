"""``config.json`` written from a ModelConfig (:mod:`pagedllm.models.hf_config`): read
back it gives the same ModelConfig, and transformers' AutoConfig loads it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import AutoConfig

from pagedllm.models.config import ModelConfig
from pagedllm.models.hf_config import hf_config_dict, write_hf_config
from pagedllm.models.presets import PRESETS

SMALL = dict(
    num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, intermediate_size=128, vocab_size=300, max_position_embeddings=512,
)  # fmt: skip
CONFIGS = {
    **{name: preset.hf_config for name, preset in PRESETS.items()},
    "qwen3 sliding": dict(SMALL, model_type="qwen3", use_sliding_window=True,
                          sliding_window=32, max_window_layers=2),
    "gemma2 soft-caps": dict(SMALL, model_type="gemma2", sliding_window=32,
                             query_pre_attn_scalar=16, attn_logit_softcapping=50.0,
                             final_logit_softcapping=30.0),
    "gemma3 local rope": dict(SMALL, model_type="gemma3_text", num_hidden_layers=7,
                              sliding_window=32, rope_local_base_freq=10000.0,
                              rope_scaling={"rope_type": "linear", "factor": 8.0}),
    "granite scales": dict(SMALL, model_type="granite", embedding_multiplier=12.0,
                           residual_multiplier=0.22, attention_multiplier=0.015625,
                           logits_scaling=8.0),
    "mixtral": dict(SMALL, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=None, eos_token_id=[2, 7], bos_token_id=1),
    "qwen2_moe": dict(SMALL, model_type="qwen2_moe", moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, mlp_only_layers=[1]),
    "phi3 window": dict(SMALL, model_type="phi3", sliding_window=64),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CONFIGS))
def test_written_config_reads_back_the_same(tmp_path, name):
    config = ModelConfig.from_hf_dict(CONFIGS[name])
    assert ModelConfig.from_hf_dict(hf_config_dict(config)) == config
    loaded = AutoConfig.from_pretrained(write_hf_config(tmp_path, config).parent)
    assert loaded.model_type == config.architecture
    assert loaded.vocab_size == config.vocab_size
    assert loaded.num_hidden_layers == config.num_layers


def test_gguf_frequency_factors_are_left_out():
    raw = dict(SMALL, model_type="llama")
    config = ModelConfig.from_hf_dict(raw)
    factors = {"rope_type": "freq_factors", "factors": [1.0] * 8}
    written = hf_config_dict(replace(config, rope_scaling=factors))
    assert "rope_scaling" not in written and written["rope_theta"] == config.rope_theta
