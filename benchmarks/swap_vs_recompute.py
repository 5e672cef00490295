"""Preemption under memory pressure: recompute against swap, side by side (JSON lines).

Also measures the two per-token costs the "auto" rule weighs: copying one token's K/V
to the second tier and back, and recomputing it (a prefill forward per token).

    python benchmarks/swap_vs_recompute.py --num-requests 32 --kv-blocks 96
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workload import synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import load_model


def copy_seconds_per_token(engine: LLMEngine, num_blocks: int = 64) -> float:
    """Round trip of ``num_blocks`` blocks to the swap tier, per token."""
    swap = engine.swap_space
    blocks = list(range(num_blocks))
    begin = time.perf_counter()
    swap_ids = swap.swap_out(blocks)
    swap.swap_in(swap_ids, blocks)
    return (time.perf_counter() - begin) / (num_blocks * engine.config.block_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--kv-blocks", type=int, default=96, help="pool size in 16-token blocks")
    parser.add_argument("--max-output", type=int, default=128)
    args = parser.parse_args()
    loaded = load_model(None, torch.float32)
    mc = loaded.config
    block_bytes = bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32)
    requests = synthetic_workload(
        args.num_requests, seed=0, prompt_len=(32, 512), output_len=(16, args.max_output)
    )
    results = {}
    for mode in ("recompute", "swap"):
        config = EngineConfig(
            dtype="float32",
            kv_cache_memory=args.kv_blocks * block_bytes,
            max_model_len=640,
            reserved_fraction=0.0,
            preemption_mode=mode,
            swap_space=0 if mode == "recompute" else 4 * args.kv_blocks * block_bytes,
            log_stats_interval=0,
        )
        engine = LLMEngine(config, loaded)
        result = run_engine(requests, config, engine)
        stats = engine.get_stats()
        if stats.swap is not None:
            result["swap_outs"] = stats.swap.swap_outs
            result["bytes_swapped_out"] = stats.swap.bytes_swapped_out
            result["copy_us_per_token"] = 1e6 * copy_seconds_per_token(engine)
        result["preemption_mode"] = mode
        results[mode] = result
        print(json.dumps({"measure": "throughput_under_pressure", **result}), flush=True)
    times = results["recompute"]
    prefill_s_per_token = times["step_ms"]["forward"] / 1000 / max(
        1.0, times["total_tokens_per_s"] * times["elapsed_s"] / times["steps"]
    )
    print(
        json.dumps(
            {
                "measure": "swap_vs_recompute",
                "output_tokens_per_s_ratio": results["swap"]["output_tokens_per_s"]
                / results["recompute"]["output_tokens_per_s"],
                "copy_us_per_token": results["swap"]["copy_us_per_token"],
                "forward_us_per_batched_token": 1e6 * prefill_s_per_token,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
