"""The most output tokens/s any engine could reach on a workload on this machine, counting
only the matrix products of a Llama-shaped decoder at the best GEMM rate measured on the machine
(attention, norms, sampling and the host cost nothing): a bound on what a throughput
target can ask of a compute-bound CPU. A second, tighter figure adds attention's two
products (scores and probabilities times values) at the same rate; attention runs below
the GEMM rate on every CPU measured, so that one too is a bound in practice.

With prefix caching, a prompt's tokens that an earlier request's prompt already began
with cost nothing but the last (whose logits give the first output token); engines that
cache whole blocks of tokens compute at least that much, so the bounds hold for them.

The roofline (:func:`roofline_record`) counts memory too: it schedules the workload step
by step as a continuous-batching engine does and bounds each step by the larger of its
products' time and the time to move the bytes it must move (the weights once, the K/V
its attention reads and writes, its elementwise passes) at the measured copy bandwidth.
Where products are cheap (bfloat16 on AMX tiles) it is the tighter bound."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.bench.workload import BenchRequest
from pagedllm.models.config import ModelConfig


def config_fields(config: ModelConfig) -> dict:
    """A loaded model's config under the Hugging Face ``config.json`` names these bounds
    read."""
    return {
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "sliding_window": next((w for w in config.sliding_windows if w), None),
    }


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


def shared_prompt_tokens(requests: Sequence[BenchRequest]) -> list[int]:
    """Per request, the leading prompt tokens it shares with any other request's prompt
    (earlier or later): the part of its K/V one copy could serve for both. Compared with
    its two neighbours in sorted order, as :func:`cached_prompt_tokens` does."""
    order = sorted(range(len(requests)), key=lambda i: requests[i].prompt_token_ids)
    shared = [0] * len(requests)
    for at, index in enumerate(order):
        prompt = requests[index].prompt_token_ids
        for neighbour in order[max(0, at - 1) : at] + order[at + 1 : at + 2]:
            other = requests[neighbour].prompt_token_ids
            shared[index] = max(shared[index], common_prefix_length(prompt, other))
    return shared


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


# The memory-aware roofline: products at the best GEMM rate, and the bytes a step must
# move at the measured copy bandwidth, step by step.

COPY_BYTES = 256 << 20
"""Size of the timed copy (well past any last-level cache)."""


def copy_bandwidth() -> float:
    """Bytes/s moved (read plus written) by torch's copy of :data:`COPY_BYTES` into
    another buffer, the least time of a few calls in turns (:func:`least_seconds`)."""
    from pagedllm.cpu.kernel_choice import least_seconds

    source = torch.ones(COPY_BYTES // 4)
    target = torch.empty_like(source)
    seconds = least_seconds({"copy": lambda: target.copy_(source)})["copy"]
    return 2 * COPY_BYTES / seconds


@dataclass(frozen=True)
class StepLoad:
    """What one scheduled step computes: ``tokens`` through the layers, ``sampled`` LM-head
    rows, ``attention_pairs`` (query position, position seen) pairs and
    ``positions_read``, the K/V positions its attention must read (a prefix that
    sequences of the step share read once)."""

    tokens: int
    sampled: int
    attention_pairs: int
    positions_read: int


@dataclass
class _Sequence:
    prompt: int
    output: int
    cached: int  # prompt tokens not computed
    shared: int  # prompt tokens whose K/V another request's prompt holds too
    position: int  # next position to compute
    decodes_left: int = 0

    def read(self, end: int) -> tuple[int, int]:
        """K/V positions attention over [0, end) reads: (its own, the shared prefix's)."""
        shared = min(self.shared, end) if self.shared else 0
        return end - shared, shared


def scheduled_steps(
    requests: Sequence[BenchRequest],
    prefix_caching: bool,
    max_num_batched_tokens: int,
    max_num_seqs: int,
) -> list[StepLoad]:
    """The steps of a continuous-batching scheduler running ``requests`` (all arrived at
    once) to the end: each step first gives every running sequence past its prompt one
    decode token, then fills the rest of ``max_num_batched_tokens`` with prompt chunks in
    arrival order, admitting up to ``max_num_seqs`` sequences. With ``prefix_caching``,
    prompt tokens a cached prefix holds (:func:`cached_prompt_tokens`) are not computed,
    and the K/V of the prompt prefixes the step's sequences share with other requests
    (:func:`shared_prompt_tokens`) is read once per step, all such prefixes taken to be
    one (fewer bytes: a bound)."""
    none = [0] * len(requests)
    cached = cached_prompt_tokens(requests) if prefix_caching else none
    shared = shared_prompt_tokens(requests) if prefix_caching else none
    waiting = [
        _Sequence(len(r.prompt_token_ids), r.output_len, c, h, c)
        for r, c, h in zip(requests, cached, shared, strict=True)
    ]
    running: list[_Sequence] = []
    steps = []
    while waiting or running:
        tokens = sampled = pairs = own = prefix = 0
        for seq in [s for s in running if s.position >= s.prompt]:
            tokens += 1
            sampled += 1
            pairs += seq.position + 1
            alone, common = seq.read(seq.position + 1)
            own, prefix = own + alone, max(prefix, common)
            seq.position += 1
            seq.decodes_left -= 1
        while waiting and len(running) < max_num_seqs:
            running.append(waiting.pop(0))
        for seq in [s for s in running if s.position < s.prompt]:
            chunk = min(max_num_batched_tokens - tokens, seq.prompt - seq.position)
            if chunk <= 0:
                break
            end = seq.position + chunk
            tokens += chunk
            pairs += (end * (end + 1) - seq.position * (seq.position + 1)) // 2
            alone, common = seq.read(end)
            own, prefix = own + alone, max(prefix, common)
            seq.position = end
            if end == seq.prompt:
                sampled += 1
                seq.decodes_left = seq.output - 1
        running = [s for s in running if s.position < s.prompt or s.decodes_left > 0]
        steps.append(StepLoad(tokens, sampled, pairs, own + prefix))
    return steps


def model_bytes(config: dict, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of one model's traffic besides its weights: ``kv_per_position`` (K and V of
    one position in every layer, the cache in ``dtype``); ``elementwise_per_token`` (one
    token's passes through a layer's norms, residual adds, rotary and activation, each
    reading and writing its rows once, every layer); ``logits_per_row`` (one sampled
    row's float32 logits)."""
    size = torch.tensor([], dtype=dtype).element_size()
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", heads)
    qk = head_dim(config) * (heads + kv_heads)
    per_layer = 2 * 2 * hidden + 2 * 3 * hidden + 2 * qk + 3 * config["intermediate_size"]
    return {
        "kv_per_position": layers * 2 * kv_heads * head_dim(config) * size,
        "elementwise_per_token": layers * per_layer * size,
        "logits_per_row": 4 * config["vocab_size"],
    }


def roofline_record(
    config: dict,
    requests: Sequence[BenchRequest],
    dtype: str,
    weight_bytes: int,
    prefix_caching: bool = False,
    max_num_batched_tokens: int = 1024,
    max_num_seqs: int = 128,
    rates: tuple[float, float] | None = None,
) -> dict:
    """The memory-aware bound in output tokens/s: step by step (:func:`scheduled_steps`)
    the larger of the products' time at the best GEMM rate (projections, LM head and
    attention's two products) and the time to move the step's bytes at the copy
    bandwidth: ``weight_bytes`` (the weights as stored, streamed once per step), the K/V
    its attention reads and its new K/V written, its elementwise passes and logits.
    ``rates``: (GEMM FLOP/s, copy bytes/s), measured when not given."""
    torch_dtype = getattr(torch, dtype)
    gemm, bandwidth = rates or (max(gemm_rates(torch_dtype).values()), copy_bandwidth())
    per_token, head_row = matmul_flops_per_token(config)
    per_pair = config["num_hidden_layers"] * config["num_attention_heads"] * 4 * head_dim(config)
    traffic = model_bytes(config, torch_dtype)
    steps = scheduled_steps(requests, prefix_caching, max_num_batched_tokens, max_num_seqs)
    totals = dict.fromkeys(("compute_s", "memory_s", "bound_s", "weights", "kv", "other"), 0.0)
    for step in steps:
        flops = step.tokens * per_token + step.sampled * head_row + step.attention_pairs * per_pair
        kv = (step.positions_read + step.tokens) * traffic["kv_per_position"]
        other = (
            step.tokens * traffic["elementwise_per_token"]
            + step.sampled * traffic["logits_per_row"]
        )
        moved = weight_bytes + kv + other
        totals["compute_s"] += flops / gemm
        totals["memory_s"] += moved / bandwidth
        totals["bound_s"] += max(flops / gemm, moved / bandwidth)
        totals["weights"] += weight_bytes
        totals["kv"] += kv
        totals["other"] += other
    outputs = sum(r.output_len for r in requests)
    return {
        "measure": "roofline",
        "dtype": dtype,
        "prefix_caching": prefix_caching,
        "steps": len(steps),
        "gemm_gflop_per_s": gemm / 1e9,
        "copy_gb_per_s": bandwidth / 1e9,
        "weight_bytes": weight_bytes,
        "gb_moved": {name: totals[name] / 1e9 for name in ("weights", "kv", "other")},
        "compute_seconds": totals["compute_s"],
        "memory_seconds": totals["memory_s"],
        "max_output_tokens_per_s": outputs / totals["bound_s"],
    }
