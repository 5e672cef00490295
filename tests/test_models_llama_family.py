"""The Llama family completed, exact against transformers: attention biases (o_proj
too), MLP biases, sliding windows shorter than the sequence (every layer, or the layers
Qwen2 marks), and rope types linear, dynamic, yarn and longrope. Sequences run past
every window (prompts up to 17 tokens plus 32 generated, windows of 8 and 16)."""

from __future__ import annotations

import pytest
from transformers_oracle import assert_exact, write_random_checkpoint

VARIANTS = {
    "llama-all-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
    "qwen2-window-upper-layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 4.0,
                                                   "rope_theta": 1e4})),
    "rope-dynamic": ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                    "rope_theta": 1e4})),
    "rope-yarn": ("llama", dict(rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
        "original_max_position_embeddings": 64, "beta_fast": 8.0, "beta_slow": 1.0})),
    "rope-longrope": ("llama", dict(max_position_embeddings=256, rope_parameters={
        "rope_type": "longrope", "rope_theta": 1e4, "factor": 8.0,
        "original_max_position_embeddings": 256,
        "short_factor": [1.0 + i / 4 for i in range(8)],
        "long_factor": [2.0 + i for i in range(8)]})),
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_is_exact(tmp_path, name):
    model_type, overrides = VARIANTS[name]
    reference = write_random_checkpoint(tmp_path, model_type, **overrides)
    assert_exact(tmp_path, reference)
