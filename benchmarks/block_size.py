"""Fixed block sizes against ``block_size="auto"`` on two workloads (JSON lines).

Workloads: ``short-chat`` (256 requests, prompts 16-64 tokens, outputs 8-32) and
``bench`` (``pagedllm bench``'s: 64 requests, prompts 32-512, outputs 16-256), all
submitted at once, greedy, exact output lengths, on the default model under one KV pool
(``--kv-cache-memory``, 96 MiB: about 4,000 bfloat16 tokens, so that what blocks waste
costs sequences). Block sizes 8, 16, 32 and ``auto``, which weighs the workload's own
lengths (written as a ``block_size_workload`` trace) and the kernel's timed speed at
each size. Runs alternate between the sizes, in one process, the model loaded once.

Per run: output tokens/s; waste, the pool's slots held but empty (internal
fragmentation), averaged over the steps and per running sequence; the most sequences
running at once; prefix-cache hit tokens; preemptions. Per workload, ``summary``:
medians, the best fixed size by throughput, auto's throughput and waste against it, and
auto's waste against the fixed 16.

    python benchmarks/block_size.py [--runs 3] [--dtype bfloat16]
        [--workloads short-chat,bench] [--kv-cache-memory 96MiB]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import BenchRequest, synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.models.loader import load_model_for

WORKLOADS = {
    "short-chat": lambda: synthetic_workload(256, 1, (16, 64), (8, 32)),
    "bench": lambda: synthetic_workload(64, 0, (32, 512), (16, 256)),
}
SIZES = ("8", "16", "32", "auto")


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def run(engine: LLMEngine, requests: list[BenchRequest]) -> dict[str, float]:
    """The workload to the end, sampling the pool's waste after every step."""
    start = time.monotonic()
    for index, request in enumerate(requests):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=request.output_len,
                                output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
        engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids}, params)
    outputs = 0
    waste, running = [], []
    while engine.has_unfinished_requests():
        outputs += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        manager = engine.block_manager
        waste.append(manager.fragmentation().internal_fragmentation_slots)
        running.append(manager.num_seqs)
    elapsed = time.monotonic() - start
    stats = engine.get_stats()
    busy = [w / n for w, n in zip(waste, running, strict=True) if n]
    return {
        "output_tokens_per_s": outputs / elapsed,
        "waste_slots_per_step": statistics.fmean(waste),
        "waste_slots_per_sequence": statistics.fmean(busy),
        "max_concurrent_seqs": stats.max_concurrent_seqs,
        "prefix_cache_hit_tokens": stats.prefix_cache_hits,
        "preemptions": stats.num_preemptions_total,
    }


def summary(workload: str, runs: dict[str, list[dict]]) -> dict[str, object]:
    medians = {
        size: {key: statistics.median(r[key] for r in results) for key in results[0]}
        for size, results in runs.items()
    }
    fixed = [size for size in medians if size != "auto"]
    best = max(fixed, key=lambda s: medians[s]["output_tokens_per_s"])
    auto, waste = medians["auto"], "waste_slots_per_step"
    return {
        "measure": "summary",
        "workload": workload,
        "medians": medians,
        "best_fixed": best,
        "auto_over_best_throughput": auto["output_tokens_per_s"]
        / medians[best]["output_tokens_per_s"],
        "auto_waste_over_best": auto[waste] / medians[best][waste],
        "auto_waste_below_16": 1 - auto[waste] / medians["16"][waste],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--workloads", default="short-chat,bench")
    parser.add_argument("--kv-cache-memory", default="96MiB")
    args = parser.parse_args()
    emit(machine_record())
    base = EngineConfig(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                        log_stats_interval=0, max_num_seqs=256)  # fmt: skip
    loaded = load_model_for(base)
    folder = Path(tempfile.mkdtemp(prefix="block-size-"))
    results: dict[str, dict[str, list[dict]]] = {}
    for run_index in range(args.runs):
        for workload in args.workloads.split(","):
            requests = WORKLOADS[workload]()
            trace = folder / f"{workload}.jsonl"
            trace.write_text("".join(
                json.dumps({"prompt": len(r.prompt_token_ids), "output": r.output_len}) + "\n"
                for r in requests
            ))  # fmt: skip
            for size in SIZES:
                config = EngineConfig(
                    dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                    log_stats_interval=0, max_num_seqs=256, block_size=size,
                    block_size_workload=str(trace) if size == "auto" else None,
                )  # fmt: skip
                engine = LLMEngine(config, loaded)
                result = run(engine, requests)
                chosen = engine.config.block_size
                emit({"measure": "run", "workload": workload, "block_size": size,
                      "chosen": chosen, "run": run_index, **result})  # fmt: skip
                results.setdefault(workload, {}).setdefault(size, []).append(result)
                del engine
    for workload, runs in results.items():
        emit(summary(workload, runs))


if __name__ == "__main__":
    main()
