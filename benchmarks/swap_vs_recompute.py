"""Preemption under memory pressure: recompute, swap, and swap with read-ahead, side by
side (JSON lines).

One synthetic workload (all requests at once, greedy, exact output lengths) over a pool
too small for it, in fresh engines over one loaded model, the configurations rotated
each of ``--runs`` rounds:

- ``recompute``: a preempted sequence's K/V are dropped and computed again;
- ``swap``: they park in the second tier (``--swap-path``: a memory-mapped file) and
  are copied back when the sequence resumes (``swap_read_ahead=False``);
- ``swap+read-ahead``: the same, and the evicted parked blocks of the swapped sequences
  next in line are copied back beside the running steps, into free pool blocks.

Per configuration (medians): output tokens/s, seconds the steps spent in swap-ins and
swap-outs before their forward passes, blocks read ahead and used, and how long steps
waited for a read-ahead copy. Also the two per-token costs the "auto" rule weighs:
copying one token's K/V to the tier and back, and a forward pass per batched token.

    python benchmarks/swap_vs_recompute.py [--runs 3] [--swap-path /tmp/kv-swap.bin]
"""

from __future__ import annotations

import argparse
import json
import time

from pagedllm.bench.machine import machine_record
from pagedllm.bench.rounds import median_ratio, median_record, rotation
from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workload import synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import LoadedModel, load_model_for

CONFIGS = ("recompute", "swap", "swap+read-ahead")


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def copy_seconds_per_token(engine: LLMEngine, num_blocks: int = 64) -> float:
    """Round trip of ``num_blocks`` pool blocks through the swap tier, per token."""
    swap = engine.swap_space
    blocks = list(range(num_blocks))
    begin = time.perf_counter()
    parked = swap.park(num_blocks)
    swap.copy_out(list(zip(blocks, parked, strict=True)))
    swap.copy_in(list(zip(parked, blocks, strict=True)))
    seconds = time.perf_counter() - begin
    swap.unpark(parked)
    return seconds / (num_blocks * engine.config.block_size)


def engine_config(args: argparse.Namespace, config: str, block_bytes: int) -> EngineConfig:
    swapping = config != "recompute"
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=args.kv_blocks * block_bytes,
        max_model_len=640,
        max_num_batched_tokens=args.max_num_batched_tokens,
        reserved_fraction=0.0,
        preemption_mode="swap" if swapping else "recompute",
        swap_space=4 * args.kv_blocks * block_bytes if swapping else 0,
        swap_path=args.swap_path if swapping else None,
        swap_read_ahead=config == "swap+read-ahead",
        log_stats_interval=0,
    )


def one_run(loaded: LoadedModel, config: EngineConfig, requests: list) -> dict[str, object]:
    engine = LLMEngine(config, loaded=loaded)
    result = run_engine(requests, config, engine)
    stats = engine.get_stats()
    record = {
        "output_tokens_per_s": result["output_tokens_per_s"],
        "preemptions": stats.num_preemptions_total,
        "forward_us_per_batched_token": 1e6
        * result["step_ms"]["forward"]
        / 1000
        * result["steps"]
        / max(1, result["total_tokens_per_s"] * result["elapsed_s"]),
    }
    swap = stats.swap
    if swap is not None:
        record.update(
            swap_in_s=swap.copy_in_seconds,
            swap_out_s=swap.copy_out_seconds,
            bytes_swapped_in=swap.bytes_swapped_in,
            read_ahead_wait_s=swap.read_ahead_wait_seconds,
            copy_us_per_token=1e6 * copy_seconds_per_token(engine),
        )
    if stats.read_ahead is not None:
        ahead = stats.read_ahead
        record.update(
            read_ahead_blocks=ahead.blocks,
            read_ahead_used_blocks=ahead.used_blocks,
            read_ahead_resumes=ahead.resumes,
            read_ahead_mean_lead_s=ahead.lead_seconds / max(1, ahead.resumes),
        )
    engine.shutdown()
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--kv-blocks", type=int, default=96, help="pool size in 16-token blocks")
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=256)
    parser.add_argument("--swap-path", default=None, help="the second tier in this file")
    args = parser.parse_args()
    loaded = load_model_for(EngineConfig(model=args.model, dtype=args.dtype))
    mc = loaded.config
    block_bytes = bytes_per_block(
        mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, loaded.model.dtype
    )
    requests = synthetic_workload(
        args.num_requests, seed=0, prompt_len=(32, 512), output_len=(16, args.max_output)
    )
    emit(**machine_record(), kv_blocks=args.kv_blocks, swap_path=args.swap_path)
    configs = args.configs.split(",")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.runs):
        for config in rotation(configs, r):
            record = one_run(loaded, engine_config(args, config, block_bytes), requests)
            results[config].append(record)
            emit(measure="round", round=r, config=config, **record)
    for config in configs:
        summary = median_record(results[config])
        if "recompute" in results and config != "recompute":
            summary["throughput_ratio_to_recompute"] = median_ratio(
                results[config], results["recompute"], "output_tokens_per_s"
            )
        emit(measure="summary", config=config, runs=args.runs, **summary)


if __name__ == "__main__":
    main()
