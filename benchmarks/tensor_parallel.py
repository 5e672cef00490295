"""Tensor parallelism on one machine: two ranks of one thread each (all-reduces through
shared memory, and through gloo alone) against one rank of two threads, side by side
(JSON lines).

All split the same cores; the two ranks add what tensor parallelism costs on a CPU:
an all-reduce after every output projection and MLP (two per layer), a gather of the
sampled rows' logits and the step's broadcast to the other rank, and, when heads do not
split evenly (the default model's 3 KV heads go 2 + 1), the wait for the busier rank.

Records (one JSON line each):
- ``machine``: CPU model and flags that matter here, cores, load average.
- ``run``: per run and variant (``tp1``, ``tp2``, ``tp2_gloo``), ``pagedllm bench``'s
  workload (greedy, ``ignore_eos``) then one sequence decoding alone: output tokens/s,
  steps, and per step the milliseconds rank 0 spent in each kind of collective (waiting
  included).
- ``summary``: medians over the runs (the variants alternate, so background load hits
  all alike) and each variant's ratio to one rank.

    python benchmarks/tensor_parallel.py [--runs 3] [--num-requests 64] [--model M]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from pagedllm.bench.machine import machine_record
from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workload import BenchRequest, length_range, synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def measure(
    config: EngineConfig, requests: list[BenchRequest], threads: int
) -> dict[str, object]:
    """One engine of ``config`` over ``requests``: throughput and collectives per step."""
    torch.set_num_threads(threads)  # a tensor-parallel engine sets its own share
    engine = LLMEngine(config)
    try:
        result = run_engine(requests, config, engine)
        steps = engine.step_times.steps
        record = {
            "output_tokens_per_s": result["output_tokens_per_s"],
            "steps": steps,
            "seconds": result["elapsed_s"],
        }
        if engine.executor is not None:
            group = engine.executor.group
            record["collective_ms_per_step"] = {
                kind: 1e3 * seconds / steps for kind, seconds in group.seconds.items()
            }
            record["collectives_per_step"] = {
                kind: calls / steps for kind, calls in group.calls.items()
            }
        return record
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=length_range, default=(32, 512))
    parser.add_argument("--output-len", type=length_range, default=(16, 256))
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--model", default=None, help="default: the embedded default model")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    emit(machine_record())
    threads = len(os.sched_getaffinity(0))
    workloads = {
        "bench": synthetic_workload(args.num_requests, 0, args.prompt_len, args.output_len),
        "decode_1": synthetic_workload(1, 1, (32, 32), (args.decode_tokens, args.decode_tokens)),
    }
    variants = {"tp1": (1, False), "tp2": (2, False), "tp2_gloo": (2, True)}
    rates: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for variant, (tp, gloo) in variants.items():
            config = EngineConfig(
                model=args.model,
                dtype=args.dtype,
                tensor_parallel_size=tp,
                disable_custom_all_reduce=gloo,
                log_stats_interval=0,
                enable_prefix_caching=False,
            )
            for name, requests in workloads.items():
                record = measure(config, requests, threads)
                emit({"measure": "run", "workload": name, "run": run, "variant": variant,
                      **record})
                rates.setdefault((name, variant), []).append(record["output_tokens_per_s"])
    for name in workloads:
        medians = {variant: statistics.median(rates[name, variant]) for variant in variants}
        emit({
            "measure": "summary",
            "workload": name,
            "tp1_threads": threads,
            "tp2_threads_per_rank": max(1, threads // 2),
            "output_tokens_per_s": medians,
            "ratio_to_tp1": {v: rate / medians["tp1"] for v, rate in medians.items()},
        })


if __name__ == "__main__":
    main()
