"""Offline throughput: the engine against transformers' static batching, and paged
against contiguous KV reservation, on one synthetic workload.

Every ``run_*`` function returns a flat dict that the caller prints as one JSON line.
Rates are per second of wall time; latencies are in seconds.
"""

from __future__ import annotations

import statistics
import time

import torch

from pagedllm.bench.workload import BenchRequest
from pagedllm.config import EngineConfig
from pagedllm.engine.frozen_gc import frozen_startup_objects
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.models.config import ModelConfig


def _percentiles(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        f"mean_{prefix}_s": statistics.fmean(ordered),
        f"p50_{prefix}_s": statistics.median(ordered),
        f"p99_{prefix}_s": p99,
    }


def run_engine(
    requests: list[BenchRequest],
    config: EngineConfig,
    engine: LLMEngine | None = None,
    time_limit_s: float | None = None,
) -> dict[str, object]:
    """All requests submitted at once, greedy, ``ignore_eos``, exact output lengths.

    With ``time_limit_s``, requests still unfinished after that many seconds are
    aborted; the result then says ``"truncated": true`` and counts finished requests
    only."""
    engine = engine or LLMEngine(config)
    with frozen_startup_objects():
        return _timed_run(engine, requests, time_limit_s)


def _timed_run(
    engine: LLMEngine, requests: list[BenchRequest], time_limit_s: float | None
) -> dict[str, object]:
    start = time.monotonic()
    for index, request in enumerate(requests):
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=request.output_len,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(
            f"bench-{index}",
            {"prompt_token_ids": request.prompt_token_ids},
            params,
            arrival_time=start,
        )
    finished = []
    truncated = False
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
        if time_limit_s is not None and time.monotonic() - start > time_limit_s:
            truncated = engine.has_unfinished_requests()
            break
    elapsed = time.monotonic() - start
    if truncated:
        for index in range(len(requests)):
            engine.abort_request(f"bench-{index}")
    finished_ids = {out.request_id for out in finished}
    stats = engine.get_stats()
    output_tokens = sum(len(out.outputs[0].token_ids) for out in finished)
    prompt_tokens = sum(
        len(r.prompt_token_ids) for i, r in enumerate(requests) if f"bench-{i}" in finished_ids
    )
    times = stats.step_times
    result: dict[str, object] = {
        "engine": "pagedllm",
        "kv_allocation": engine.config.kv_allocation,
        "dtype": str(engine.config.dtype).removeprefix("torch."),
        "num_requests": len(finished),
        "truncated": truncated,
        "elapsed_s": elapsed,
        "requests_per_s": len(finished) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (output_tokens + prompt_tokens) / elapsed,
        "output_tokens": output_tokens,
        "num_blocks": stats.num_blocks_total,
        "peak_kv_blocks": stats.peak_blocks_used,
        "max_concurrent_seqs": stats.max_concurrent_seqs,
        "preemptions": stats.num_preemptions_total,
        "steps": times.steps,
        "overhead_fraction": times.overhead_fraction,
        "step_ms": {
            part: 1000 * getattr(times, part) / max(times.steps, 1)
            for part in ("schedule", "prepare", "forward", "sample", "postprocess")
        },
    }
    result.update(_percentiles([o.metrics.time_to_first_token for o in finished], "ttft"))
    tpots = [o.metrics.time_per_output_token for o in finished]
    result.update(_percentiles([t for t in tpots if t is not None], "tpot"))
    return result


def run_transformers(
    requests: list[BenchRequest], model_path: str, batch_size: int = 16, dtype=torch.float32
) -> dict[str, object]:
    """transformers ``generate`` in static batches: left padding, each batch runs until
    its longest request is done; padding and tokens past a request's own length are
    waste and do not count as output."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    if path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    pad_id = model.config.pad_token_id or 0
    start = time.monotonic()
    useful = 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.int64)
        mask = torch.zeros((len(batch), width), dtype=torch.int64)
        for row, request in enumerate(batch):
            length = len(request.prompt_token_ids)
            ids[row, width - length :] = torch.tensor(request.prompt_token_ids)
            mask[row, width - length :] = 1
        new_tokens = max(r.output_len for r in batch)
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        useful += sum(r.output_len for r in batch)
    elapsed = time.monotonic() - start
    return {
        "engine": "transformers",
        "batch_size": batch_size,
        "dtype": str(dtype).removeprefix("torch."),
        "num_requests": len(requests),
        "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "output_tokens_per_s": useful / elapsed,
        "output_tokens": useful,
    }


def matmul_peak_gflops(dtype=torch.float32, size: int = 2048, repeats: int = 8) -> float:
    """Achieved GFLOP/s of a large square matmul on all threads (the machine's ceiling)."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    samples = []
    for _ in range(repeats):
        begin = time.perf_counter()
        a @ b
        samples.append(time.perf_counter() - begin)
    return 2 * size**3 / statistics.median(samples) / 1e9


def flops_per_output_token(config: ModelConfig) -> float:
    """Matmul FLOPs of one decoded token (2 per weight; attention scores excluded)."""
    hidden, heads = config.hidden_size, config.num_heads
    q_and_o = 2 * hidden * heads * config.head_dim
    kv = 2 * hidden * config.num_kv_heads * config.head_dim
    mlp = 3 * hidden * config.intermediate_size
    per_layer = q_and_o + kv + mlp
    return 2.0 * (config.num_layers * per_layer + hidden * config.vocab_size)
