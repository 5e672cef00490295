"""The most output tokens/s any engine could reach on a workload on this machine, counting
only the matrix products of a Llama-shaped decoder at the best GEMM rate measured on the machine
(attention, norms, sampling and the host cost nothing): a bound on what a throughput
target can ask of a compute-bound CPU. A second, tighter figure adds attention's two
products (scores and probabilities times values) at the same rate; attention runs below
the GEMM rate on every CPU measured, so that one too is a bound in practice.

With prefix caching, a prompt's tokens that an earlier request's prompt already began
with cost nothing but the last (whose logits give the first output token); engines that
cache whole blocks of tokens compute at least that much, so the bounds hold for them."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch

from pagedllm.bench.workload import BenchRequest


def head_dim(config: dict) -> int:
    """A Hugging Face ``config.json``'s size of one attention head."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def matmul_flops_per_token(config: dict) -> tuple[int, int]:
    """FLOPs (2 per multiply-add) of one token through every decoder layer's projections,
    and of one row of the LM head, from a Hugging Face ``config.json``'s fields."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    attention = 2 * hidden * head_dim(config) * (2 * heads + 2 * kv_heads)  # q and o, k and v
    mlp = 2 * 3 * hidden * config["intermediate_size"]
    return layers * (attention + mlp), 2 * hidden * config["vocab_size"]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def cached_prompt_tokens(requests: Sequence[BenchRequest]) -> list[int]:
    """Per request, the leading prompt tokens an earlier request's prompt already began
    with, all but the prompt's last token. The longest start a prompt shares with any of
    a set of prompts is the one it shares with a neighbour in their sorted order, so each
    prompt is compared with two."""
    earlier: list[tuple[int, ...]] = []  # sorted
    cached = []
    for request in requests:
        prompt = tuple(request.prompt_token_ids)
        at = bisect.bisect_left(earlier, prompt)
        shared = max(
            (common_prefix_length(prompt, q) for q in earlier[max(0, at - 1) : at + 1]), default=0
        )
        cached.append(min(shared, len(prompt) - 1))
        earlier.insert(at, prompt)
    return cached


def computed_positions(
    requests: Sequence[BenchRequest], prefix_caching: bool
) -> list[tuple[int, int]]:
    """Per request, the positions [first, end) whose tokens go through the layers: the
    prompt's (less what the cache holds) and every output token's but the last."""
    cached = cached_prompt_tokens(requests) if prefix_caching else [0] * len(requests)
    return [
        (first, len(r.prompt_token_ids) + r.output_len - 1)
        for first, r in zip(cached, requests, strict=True)
    ]


def workload_matmul_flops(
    config: dict, requests: Sequence[BenchRequest], prefix_caching: bool = False
) -> float:
    """FLOPs of the matrix products of a workload run to the end: every computed position
    (:func:`computed_positions`) goes through the layers; each output token costs one
    LM-head row."""
    per_token, head_row = matmul_flops_per_token(config)
    outputs = sum(r.output_len for r in requests)
    positions = computed_positions(requests, prefix_caching)
    through_layers = sum(end - first for first, end in positions)
    return float(through_layers * per_token + outputs * head_row)


def workload_attention_flops(
    config: dict, requests: Sequence[BenchRequest], prefix_caching: bool = False
) -> float:
    """FLOPs of attention's two products over a workload: each computed position p sees
    positions 0..p, and each (query head, position seen) costs 2 x head_dim for the score
    and 2 x head_dim for the value. Refuses a sliding window, whose count this is not."""
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        raise ValueError("the attention count assumes no sliding window")
    per_pair = config["num_hidden_layers"] * config["num_attention_heads"] * 4 * head_dim(config)
    seen = sum(  # sum of p + 1 over p in [first, end)
        (end * (end + 1) - first * (first + 1)) // 2
        for first, end in computed_positions(requests, prefix_caching)
    )
    return float(seen * per_pair)


def gemm_rates(dtype: torch.dtype) -> dict[str, float]:
    """The best rate (FLOP/s, the current thread count) of one product of 512 x 2,048 by
    2,048 x 2,048 by each candidate of :mod:`pagedllm.cpu.kernel_choice` here, timed in
    turns (:func:`least_seconds`): torch's GEMM on the plain matrix (``dense``), oneDNN on
    the matrix in its blocked layout where it takes the dtype (``onednn``) and, where
    the C++ kernels are built, ``packed_linear`` on packed panels (``packed``). On some
    CPUs torch's float32 GEMM on the plain matrix runs at under half the peak the others
    reach, so the bound takes the fastest."""
    from pagedllm.cpu.extension import fits_avx512_kernels, pack_weight, packed_linear
    from pagedllm.cpu.kernel_choice import least_seconds
    from pagedllm.cpu.onednn import onednn_linear, reorder, reorderable

    x, weight = torch.randn(512, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
    products = {"dense": lambda: x @ weight.T}
    if reorderable(weight):
        reordered = reorder(weight)
        products["onednn"] = lambda: onednn_linear(x, reordered)
    if fits_avx512_kernels(x, weight):
        panels = pack_weight(weight)
        products["packed"] = lambda: packed_linear(x, panels, 2048)
    seconds = least_seconds(products)
    return {name: 2 * 512 * 2048 * 2048 / s for name, s in seconds.items()}


def ceiling_record(
    config: dict, requests: Sequence[BenchRequest], dtype: str, prefix_caching: bool = False
) -> dict:
    """The bounds in output tokens/s for ``dtype``, with what they rest on."""
    flops = workload_matmul_flops(config, requests, prefix_caching)
    attention = workload_attention_flops(config, requests, prefix_caching)
    rates = gemm_rates(getattr(torch, dtype))
    rate = max(rates.values())
    outputs = sum(r.output_len for r in requests)
    return {
        "measure": "ceiling",
        "dtype": dtype,
        "prefix_caching": prefix_caching,
        "matmul_tflop": flops / 1e12,
        "attention_tflop": attention / 1e12,
        "gemm_gflop_per_s": rate / 1e9,
        "gflop_per_s_by_gemm": {name: r / 1e9 for name, r in rates.items()},
        "max_output_tokens_per_s": outputs / (flops / rate),
        "max_output_tokens_per_s_with_attention": outputs / ((flops + attention) / rate),
    }
