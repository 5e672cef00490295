"""The most output tokens/s any engine could reach on a workload on this machine, counting
only the matrix products of a Llama-shaped decoder at the best GEMM rate measured on the machine
(attention, norms, sampling and the host cost nothing): a bound on what a throughput
target can ask of a compute-bound CPU."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedllm.bench.workload import BenchRequest


def matmul_flops_per_token(config: dict) -> tuple[int, int]:
    """FLOPs (2 per multiply-add) of one token through every decoder layer's projections,
    and of one row of the LM head, from a Hugging Face ``config.json``'s fields."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim") or hidden // heads
    attention = 2 * hidden * head_dim * (2 * heads + 2 * kv_heads)  # q and o, k and v
    mlp = 2 * 3 * hidden * config["intermediate_size"]
    return layers * (attention + mlp), 2 * hidden * config["vocab_size"]


def workload_matmul_flops(config: dict, requests: Sequence[BenchRequest]) -> float:
    """FLOPs of the matrix products of a workload run to the end: every prompt token and
    every output token but the last goes through the layers; each output token costs one
    LM-head row."""
    per_token, head_row = matmul_flops_per_token(config)
    outputs = sum(r.output_len for r in requests)
    through_layers = sum(len(r.prompt_token_ids) for r in requests) + outputs - len(requests)
    return float(through_layers * per_token + outputs * head_row)


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


def ceiling_record(config: dict, requests: Sequence[BenchRequest], dtype: str) -> dict:
    """The bound in output tokens/s for ``dtype``, with what it rests on."""
    flops = workload_matmul_flops(config, requests)
    rates = gemm_rates(getattr(torch, dtype))
    rate = max(rates.values())
    outputs = sum(r.output_len for r in requests)
    return {
        "measure": "ceiling",
        "dtype": dtype,
        "matmul_tflop": flops / 1e12,
        "gemm_gflop_per_s": rate / 1e9,
        "gflop_per_s_by_gemm": {name: r / 1e9 for name, r in rates.items()},
        "max_output_tokens_per_s": outputs / (flops / rate),
    }
