"""transformers (float32, eager attention) as the oracle for a model type: a tiny random
checkpoint written by transformers itself, its logits and its greedy tokens."""

from __future__ import annotations

import torch

# Logits tolerance, absolute, on float32 logits of size ~1-10: both sides run float32;
# the fused q/k/v and gate/up products and the paged kernel sum in other orders (~1e-6
# relative per product here). A wrong weight, rotation, mask or scale moves logits by
# 1e-2 or more.
LOGITS_TOLERANCE = 1e-4
TINY_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=2,
    eos_token_id=1,
    pad_token_id=0,
)
PROMPTS = [[5, 17, 200, 3, 64, 9], [42, 7, 99, 250, 1, 13, 77, 31, 8, 120, 64],
           list(range(30, 47))]  # fmt: skip
NEW_TOKENS = 32


def write_random_checkpoint(folder, model_type: str, **overrides):
    """Save a seeded random ``model_type`` checkpoint of :data:`TINY_SHAPE` (plus
    ``overrides``) to ``folder``; returns transformers' eager float32 model. Norm weights
    (``*norm*``, GPT-2's and Falcon's ``ln_*``) are moved away from 1 and biases away from
    0, so that a forgotten one shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **{**TINY_SHAPE, **overrides})
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            is_norm = "norm" in name or ".ln_" in name
            if is_norm or name.endswith("bias"):
                param.normal_(1.0 if is_norm and name.endswith("weight") else 0.0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    return model


def our_logits(model, tokens: list[int]) -> torch.Tensor:
    """Float32 logits of every token of one sequence, by the dense backend."""
    from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata

    hidden = model.forward(
        torch.tensor(tokens),
        torch.arange(len(tokens)),
        DenseAttentionBackend(),
        dense_metadata([len(tokens)]),
    )
    return model.compute_logits(hidden)


def reference_logits(reference, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return reference(torch.tensor([tokens])).logits[0]


def reference_greedy(reference, prompt: list[int], new_tokens: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens with no end-of-sequence token (the engine runs with ``ignore_eos``;
    ``min_new_tokens`` would instead ban the eos id)."""
    reference.generation_config.eos_token_id = None
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def engine_greedy(folder, prompts=PROMPTS, new_tokens: int = NEW_TOKENS, **options):
    """Greedy tokens of every prompt from the engine (paged KV cache, C++ kernels)."""
    from pagedllm import LLM, SamplingParams

    settings = dict(dtype="float32", kv_cache_memory="16MiB", log_stats_interval=0)
    llm = LLM(model=str(folder), **{**settings, **options})
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def assert_exact(folder, reference, **engine_options) -> None:
    """Logits within :data:`LOGITS_TOLERANCE` on a 60-token sequence, and greedy tokens
    equal for every prompt of :data:`PROMPTS`."""
    from pagedllm.models import load_model

    tokens = torch.randint(0, 256, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = our_logits(load_model(folder).model, tokens)
    torch.testing.assert_close(
        ours, reference_logits(reference, tokens), atol=LOGITS_TOLERANCE, rtol=0
    )
    expected = [reference_greedy(reference, p) for p in PROMPTS]
    assert engine_greedy(folder, **engine_options) == expected
