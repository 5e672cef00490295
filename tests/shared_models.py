"""Models loaded once per test session and shared by the test modules that need them."""

from __future__ import annotations

import functools

import torch

from pagedllm.models.loader import LoadedModel, load_model


@functools.cache
def default_model(dtype: torch.dtype = torch.float32, quantization: str = "auto") -> LoadedModel:
    """SmolLM2-135M-Instruct from its GGUF, loaded once (its Q4_1 / Q8_0 matrices kept
    quantized with ``"auto"``, expanded to ``dtype`` with ``"none"``)."""
    return load_model(None, dtype, quantization=quantization)


@functools.cache
def transformers_default_model():
    """transformers' own float32 model from the same GGUF: the reference."""
    from transformers import AutoModelForCausalLM

    path = default_model().source
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def transformers_greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' ``generate(do_sample=False)`` continuation, eos ignored."""
    model = transformers_default_model()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
