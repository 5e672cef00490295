"""Tiny random Llama checkpoints written on the spot (nothing downloaded), for tests and
checks that need a real Hugging Face folder but not a trained model."""

from __future__ import annotations

from pathlib import Path

import torch


def write_tiny_llama(folder: Path, seed: int = 0, **overrides: object) -> Path:
    """A 2-layer random Llama (GQA 4/2 heads, head_dim 64, 512 positions) saved by
    transformers as safetensors in ``folder``; ``overrides`` replace config fields.

    ``initializer_range`` is large so that greedy choices are far from ties and do not
    flip under float rounding when the batch around a sequence changes.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        eos_token_id=1,
        bos_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**settings)).save_pretrained(folder, safe_serialization=True)
    return folder
