"""Sharing benchmarks (JSON lines), each comparison in one run on the default model.

(a) shared prefix: 32 requests with one 1,024-token system prefix plus 32..128 unique
    tokens and 32 output tokens: time to first token of one request on a cache hit
    against cold, and the total time of all 32 with prefix caching on against off.
(b) parallel sampling: n=4 on 256-token prompts with 128-token outputs: peak KV blocks
    and throughput with the samples forked from one prefill against 4 separate
    requests per prompt (prefix caching off in both, so only forking shares).

    python benchmarks/prefix_sharing.py [--part a|b] [--num-prompts 4]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from pagedllm.bench.workload import shared_prefix_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.loader import load_model


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def run_all(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """Submit everything at once; return wall time, TTFTs and peak blocks."""
    start = time.monotonic()
    for index, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{index}", {"prompt_token_ids": prompt}, p, arrival_time=start)
    finished = []
    while engine.has_unfinished_requests():
        finished.extend(out for out in engine.step() if out.finished)
    elapsed = time.monotonic() - start
    stats = engine.get_stats()
    tokens = sum(len(o.token_ids) for out in finished for o in out.outputs)
    return {
        "elapsed_s": elapsed,
        "output_tokens_per_s": tokens / elapsed,
        "mean_ttft_s": sum(o.metrics.time_to_first_token for o in finished) / len(finished),
        "peak_kv_blocks": stats.peak_blocks_used,
        "prefix_cache_hits_tokens": stats.prefix_cache_hits,
        "prefix_cache_queries_tokens": stats.prefix_cache_queries,
    }


def part_a(loaded, rng: random.Random) -> None:
    workload = shared_prefix_workload(seed=rng.randrange(1 << 31))
    prompts = [request.prompt_token_ids for request in workload]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)] * len(prompts)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    results = {}
    for caching in (False, True):
        config = EngineConfig(
            dtype="float32",
            enable_prefix_caching=caching,
            max_num_batched_tokens=2048,
            log_stats_interval=0,
        )
        engine = LLMEngine(config, loaded)
        cold = run_all(engine, [prompts[0]], [first])["mean_ttft_s"]
        single = run_all(engine, [prompts[1]], [first])["mean_ttft_s"]
        result = run_all(LLMEngine(config, loaded), prompts, params)
        result.update(prefix_caching=caching, ttft_first_request_s=cold, ttft_next_request_s=single)
        emit({"measure": "shared_prefix", **result})
        results[caching] = result
    emit(
        {
            "measure": "shared_prefix_ratios",
            "ttft_cold_over_hit": results[True]["ttft_first_request_s"]
            / results[True]["ttft_next_request_s"],
            "total_time_off_over_on": results[False]["elapsed_s"] / results[True]["elapsed_s"],
        }
    )


def part_b(loaded, rng: random.Random, num_prompts: int) -> None:
    prompts = [[rng.randrange(16, 49152) for _ in range(256)] for _ in range(num_prompts)]
    results = {}
    for forked in (True, False):
        config = EngineConfig(dtype="float32", enable_prefix_caching=False, log_stats_interval=0)
        engine = LLMEngine(config, loaded)
        if forked:
            params = [
                SamplingParams(n=4, temperature=1.0, seed=i, max_tokens=128, ignore_eos=True)
                for i in range(num_prompts)
            ]
            result = run_all(engine, prompts, params)
        else:
            params = [
                SamplingParams(temperature=1.0, seed=i + k, max_tokens=128, ignore_eos=True)
                for i in range(num_prompts)
                for k in range(4)
            ]
            result = run_all(engine, [p for p in prompts for _ in range(4)], params)
        result["shared_by_fork"] = forked
        emit({"measure": "parallel_sampling_n4", **result})
        results[forked] = result
    emit(
        {
            "measure": "parallel_sampling_ratios",
            "peak_blocks_shared_over_unshared": results[True]["peak_kv_blocks"]
            / results[False]["peak_kv_blocks"],
            "throughput_shared_over_unshared": results[True]["output_tokens_per_s"]
            / results[False]["output_tokens_per_s"],
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part", choices=["a", "b", "all"], default="all")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts in part (b)")
    args = parser.parse_args()
    loaded = load_model(None, torch.float32)
    rng = random.Random(0)
    if args.part in ("a", "all"):
        part_a(loaded, rng)
    if args.part in ("b", "all"):
        part_b(loaded, rng, args.num_prompts)


if __name__ == "__main__":
    main()
