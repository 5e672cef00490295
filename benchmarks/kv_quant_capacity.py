"""Capacity per KV dtype, side by side (JSON lines).

1. ``blocks``: blocks of 16 tokens that ``--budget`` bytes hold for the default model
   (30 layers, 3 KV heads, head_dim 64) in each format, scales counted, and the ratios
   to bfloat16 and float32.
2. ``throughput``: the engine on one small synthetic workload with a KV budget that
   holds only ``--pressure-blocks`` float32 blocks, the same bytes for every dtype:
   output tokens/s, peak concurrency and preemptions. A smaller element holds more
   blocks, so fewer preemptions; the kernel's decoding costs some time per token.

On a machine busy with other work, run it with ``OMP_NUM_THREADS=1``: there two threads
per process waited on each other and steps took 10-20x longer.

    python benchmarks/kv_quant_capacity.py [--num-requests 8] [--pressure-blocks 12]
"""

from __future__ import annotations

import argparse
import json

import torch

from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workload import synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv.capacity import pool_blocks
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import load_model

DTYPES = ["auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"]
SHAPE = (30, 16, 3, 64)  # the default model: layers, block size, KV heads, head_dim


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--budget", default=2**30, type=int, help="bytes for the block counts")
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--pressure-blocks", type=int, default=12)
    parser.add_argument("--dtypes", default=",".join(DTYPES), help="for the throughput runs")
    args = parser.parse_args()

    def blocks(name: str, model_dtype: torch.dtype = torch.float32) -> int:
        return pool_blocks(args.budget, bytes_per_block(*SHAPE, model_dtype, name))

    for name in DTYPES:
        emit(
            record="blocks",
            kv_cache_dtype="float32" if name == "auto" else name,
            budget_bytes=args.budget,
            bytes_per_block=bytes_per_block(*SHAPE, torch.float32, name),
            num_blocks=blocks(name),
            vs_bfloat16=round(blocks(name) / blocks("auto", torch.bfloat16), 4),
            vs_float32=round(blocks(name) / blocks("auto"), 4),
        )

    loaded = load_model(None, torch.float32)
    mc = loaded.config
    budget = args.pressure_blocks * bytes_per_block(
        mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.float32
    )
    requests = synthetic_workload(
        args.num_requests, seed=0, prompt_len=(16, 64), output_len=(16, 32)
    )
    for name in args.dtypes.split(","):
        config = EngineConfig(
            dtype="float32",
            kv_cache_dtype=name,
            kv_cache_memory=budget,
            max_model_len=128,
            log_stats_interval=0,
        )
        result = run_engine(requests, config, LLMEngine(config, loaded))
        emit(
            record="throughput",
            kv_cache_dtype="float32" if name == "auto" else name,
            kv_budget_bytes=budget,
            **{
                key: round(value, 3) if isinstance(value, float) else value
                for key, value in result.items()
                if key
                in (
                    "num_requests",
                    "elapsed_s",
                    "output_tokens_per_s",
                    "num_blocks",
                    "peak_kv_blocks",
                    "max_concurrent_seqs",
                    "preemptions",
                    "steps",
                )
            },
        )


if __name__ == "__main__":
    main()
