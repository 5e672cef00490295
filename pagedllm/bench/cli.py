"""``pagedllm bench`` / ``benchmarks/throughput.py``: the throughput comparison as JSON lines.

Each line is one measurement; comparisons (ratios) are printed last, from the same run.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from pagedllm.bench.ceiling import config_fields, roofline_record
from pagedllm.bench.pool_trace import PoolTracer, draw_trace, trace_path
from pagedllm.bench.throughput import (
    flops_per_output_token,
    matmul_peak_gflops,
    run_engine,
    run_transformers,
)
from pagedllm.bench.workload import (
    BenchRequest,
    length_range,
    shared_prefix_workload,
    synthetic_workload,
)
from pagedllm.choice import parse_choice
from pagedllm.config import KVAllocation, PreemptionMode
from pagedllm.config_flags import add_config_flags, config_from_flags
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import load_model, load_model_for
from pagedllm.models.weight_bytes import weight_bytes_by_format


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        choices=("mixed", "shared-prefix"),
        default="mixed",
        help="mixed: random prompts and outputs of --prompt-len / --output-len tokens; "
        "shared-prefix: requests sharing one 1,024-token prefix, then 32-128 tokens of their "
        "own, 32 output tokens each",
    )
    parser.add_argument("--num-requests", type=int, help="64 mixed, 32 shared-prefix")
    parser.add_argument("--workload-seed", type=int, default=0, help="seed of the workload")
    parser.add_argument(
        "--prompt-len", type=length_range, help="MIN,MAX prompt tokens (mixed; 32,512)"
    )
    parser.add_argument(
        "--output-len", type=length_range, help="MIN,MAX output tokens (mixed; 16,256)"
    )
    parser.add_argument("--dtypes", default="float32", help="comma list: float32,bfloat16")
    parser.add_argument(
        "--baseline", action="store_true", help="also run transformers' static batching of 16"
    )
    parser.add_argument(
        "--contiguous",
        action="store_true",
        help="also compare paged and contiguous reservation under a budget of 4 x 2,048 tokens",
    )
    parser.add_argument(
        "--trace", default=None, metavar="PNG", help="draw each paged run's pool (PNG-<dtype>)"
    )
    parser.add_argument(
        "--preemption-modes",
        default="recompute",
        help="comma list for the paged run under the --contiguous budget: recompute,swap,auto "
        "(swap and auto get a second tier as large as the KV budget)",
    )
    add_config_flags(parser, exclude=("dtype",))


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def bench_workload(args: argparse.Namespace) -> list[BenchRequest]:
    """The requests ``--workload`` names."""
    if args.workload == "shared-prefix":
        if args.prompt_len or args.output_len:
            raise SystemExit("--prompt-len and --output-len shape the mixed workload only")
        return shared_prefix_workload(args.num_requests or 32, args.workload_seed)
    return synthetic_workload(
        args.num_requests or 64,
        args.workload_seed,
        args.prompt_len or (32, 512),
        args.output_len or (16, 256),
    )


def run_bench(args: argparse.Namespace) -> int:
    requests = bench_workload(args)
    results: dict[str, dict[str, object]] = {}
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        config = config_from_flags(args, dtype=dtype, log_stats_interval=0)
        loaded = load_model_for(config)
        peak = matmul_peak_gflops(dtype)
        emit({"measure": "matmul_peak", "dtype": dtype_name, "gflops": peak})
        from pagedllm.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, loaded)
        tracer = PoolTracer(engine).attach() if args.trace else None
        result = run_engine(requests, config, engine)
        if tracer:
            draw_trace(tracer.trace, trace_path(args.trace, dtype_name), f"paged, {dtype_name}")
        flops = flops_per_output_token(loaded.config)
        result["gflop_per_output_token"] = flops / 1e9
        result["mfu_decode_equivalent"] = result["output_tokens_per_s"] * flops / (peak * 1e9)
        roofline = workload_roofline(loaded, config, requests, dtype_name)
        result["share_of_roofline"] = (
            result["output_tokens_per_s"] / roofline["max_output_tokens_per_s"]
        )
        emit(roofline)
        emit({"measure": "throughput", **result})
        results[f"paged_{dtype_name}"] = result
        if args.contiguous:
            results.update(_paged_vs_contiguous(args, requests, loaded, dtype_name, result))
    if args.baseline:
        baseline = run_transformers(requests, str(load_model(args.model).source))
        emit({"measure": "throughput", **baseline})
        for key, result in results.items():
            if key.startswith("paged_") and "budget" not in key:
                ratio = result["output_tokens_per_s"] / baseline["output_tokens_per_s"]
                emit({"measure": "ratio_vs_transformers", "run": key, "output_tokens_per_s": ratio})
    return 0


def workload_roofline(loaded, config, requests, dtype_name: str) -> dict[str, object]:
    """The memory-aware bound of ``requests`` under the engine's step budget
    (:func:`~pagedllm.bench.ceiling.roofline_record`), the weights counted as stored
    without expanded copies (the fewest bytes a step could stream)."""
    stored = sum(
        size
        for name, size in weight_bytes_by_format(loaded.model).items()
        if not name.endswith("expanded copies")
    )
    return roofline_record(
        config_fields(loaded.config),
        requests,
        dtype_name,
        stored,
        prefix_caching=config.enable_prefix_caching,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
    )


def _paged_vs_contiguous(
    args, requests, loaded, dtype_name: str, unlimited: dict[str, object]
) -> dict[str, dict[str, object]]:
    """Both modes under one KV budget that holds exactly 4 sequences of 2,048 tokens;
    ``unlimited`` is the paged run with the full pool, the ceiling of any allocation."""
    from pagedllm.engine.llm_engine import LLMEngine

    mc = loaded.config
    block_bytes = bytes_per_block(
        mc.num_layers, args.block_size, mc.num_kv_heads, mc.head_dim, getattr(torch, dtype_name)
    )
    budget = 4 * (2048 // args.block_size) * block_bytes
    modes = [
        parse_choice(PreemptionMode, mode, "--preemption-modes")
        for mode in args.preemption_modes.split(",")
    ]
    runs = [(KVAllocation.PAGED, mode) for mode in modes]
    out = {}
    for allocation, preemption in [*runs, (KVAllocation.CONTIGUOUS, PreemptionMode.RECOMPUTE)]:
        config = config_from_flags(
            args,
            dtype=dtype_name,
            kv_cache_memory=budget,
            max_model_len=2048,
            reserved_fraction=0.0,
            kv_allocation=allocation,
            preemption_mode=preemption,
            swap_space=0 if preemption is PreemptionMode.RECOMPUTE else budget,
            log_stats_interval=0,
        )
        engine = LLMEngine(config, loaded)
        result = run_engine(requests, config, engine)
        result["preemption_mode"] = preemption
        swap = engine.get_stats().swap
        if swap is not None:
            result.update(swap_outs=swap.swap_outs, bytes_swapped_out=swap.bytes_swapped_out)
        emit({"measure": "throughput_fixed_budget", "kv_budget_bytes": budget, **result})
        out[f"budget_{allocation}_{preemption}_{dtype_name}"] = result
    contiguous = out[f"budget_contiguous_recompute_{dtype_name}"]
    compared = [(p, out[f"budget_paged_{p}_{dtype_name}"]) for _, p in runs]
    for preemption, paged in [*compared, ("none (unlimited pool)", unlimited)]:
        emit(
            {
                "measure": "ratio_paged_vs_contiguous",
                "dtype": dtype_name,
                "paged_preemption_mode": preemption,
                "max_concurrent_seqs": paged["max_concurrent_seqs"]
                / contiguous["max_concurrent_seqs"],
                "output_tokens_per_s": paged["output_tokens_per_s"]
                / contiguous["output_tokens_per_s"],
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_bench_args(parser)
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
