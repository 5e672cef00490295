"""A request's output does not depend on the batch around it, to the bit.

With the AVX-512 kernels every row of every matrix product, norm and activation is
computed in one fixed order whatever the other rows are, and attention runs per sequence
over positions in a fixed order, so a request's logprobs are identical alone with its
whole prompt in one step and in a crowd with its prompt cut into chunks (float32 and
bfloat16). torch's GEMM, the fallback without AVX-512, blocks by batch size and gives no
such guarantee.
"""

from __future__ import annotations

import random

import pytest
import torch
from tiny_checkpoints import tiny_engine

from pagedllm import LLM, SamplingParams
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.models.loader import load_model

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="batch invariance comes from the AVX-512 kernels"
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_alone_equal_logprobs_in_a_chunked_crowd(tiny_model, dtype):
    loaded = load_model(tiny_model.source, dtype)
    crowd = LLM.from_engine(
        tiny_engine(loaded, 512, max_num_seqs=8, max_num_batched_tokens=16, dtype=dtype)
    )
    solo = LLM.from_engine(tiny_engine(loaded, 512, max_num_batched_tokens=256, dtype=dtype))
    rng = random.Random(0)
    prompts = [
        {"prompt_token_ids": [rng.randrange(2, 512) for _ in range(rng.randint(5, 60))]}
        for _ in range(6)
    ]
    params = [
        SamplingParams(temperature=0.9, seed=i, max_tokens=16, logprobs=3, ignore_eos=True)
        for i in range(len(prompts))
    ]
    together = crowd.generate(prompts, params, use_tqdm=False)
    assert crowd.llm_engine.get_stats().max_concurrent_seqs > 1
    for prompt, sp, in_crowd in zip(prompts, params, together, strict=True):
        alone = solo.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == in_crowd.outputs[0].token_ids
        assert alone.logprobs == in_crowd.outputs[0].logprobs
        assert alone.cumulative_logprob == in_crowd.outputs[0].cumulative_logprob
