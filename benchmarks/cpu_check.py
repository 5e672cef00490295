"""The CPU speed checks in one command, on whatever CPU it runs (JSON lines).

1. The defaults against the fastest configuration: ``pagedllm bench`` on the default
   model, each run a fresh process, runs alternating, for the mixed workload (64
   requests, prompts 32-512 tokens, outputs 16-256) and the shared-prefix one (32
   requests over one 1,024-token prefix), in bfloat16 where the CPU multiplies it
   natively and in float32. Configurations: ``default`` (no options: GGUF blocks, with
   expanded copies for calls of many rows where measured faster), ``expanded``
   (``--quantization none``) and ``blocks alone`` (``--weight-expansion-memory 0``).
2. Each run's share of the memory-aware roofline (``pagedllm.bench.ceiling``) that
   ``pagedllm bench`` reports beside it.
3. Both step profiles of the default configuration (``benchmarks/step_profile.py``):
   the one-call layer stack by its own phase clocks, and the layers one by one under
   torch's profiler.
4. With ``--vllm-python``, ``benchmarks/vllm_cpu.py`` on both workloads.

Records: ``machine`` (CPU model and matrix flags; ``amx`` says whether the CPU has AMX
tiles); ``run`` (workload, dtype, configuration, run, output tokens/s, share of the
roofline); ``summary`` per workload and dtype (medians, the fastest configuration,
default / fastest, and whether that is within 5%); then the profiles' and vLLM's own
records, tagged with their workload.

    python benchmarks/cpu_check.py [--runs 3] [--workloads mixed,shared-prefix]
        [--dtypes bfloat16,float32] [--vllm-python ../vllm-venv/bin/python] [--no-profiles]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from pagedllm.bench.machine import machine_record
from pagedllm.cpu.cpuinfo import cpu_flags, multiplies_bfloat16

CONFIGURATIONS = {
    "default": [],
    "expanded": ["--quantization", "none"],
    "blocks alone": ["--weight-expansion-memory", "0"],
}
"""Configuration name -> ``pagedllm bench`` options."""

WITHIN = 0.95
"""The defaults' goal: at least this share of the fastest configuration's throughput."""

HERE = Path(__file__).resolve().parent


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def records(command: list[str]) -> list[dict[str, object]]:
    """The JSON lines ``command`` prints (its other output dropped); raises with its
    error output when it fails."""
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def bench(workload: str, dtype: str, options: list[str]) -> dict[str, float]:
    """One ``pagedllm bench`` run: output tokens/s and share of the roofline."""
    command = [sys.executable, "-m", "pagedllm.cli", "bench", "--workload", workload,
               "--dtypes", dtype, *options]  # fmt: skip
    (throughput,) = [r for r in records(command) if r["measure"] == "throughput"]
    return {
        "output_tokens_per_s": throughput["output_tokens_per_s"],
        "share_of_roofline": throughput["share_of_roofline"],
    }


def summary(workload: str, dtype: str, rates: dict[str, list[float]]) -> dict[str, object]:
    medians = {name: statistics.median(values) for name, values in rates.items()}
    fastest = max(medians, key=medians.__getitem__)
    ratio = medians["default"] / medians[fastest]
    return {
        "measure": "summary",
        "workload": workload,
        "dtype": dtype,
        "median_output_tokens_per_s": medians,
        "fastest": fastest,
        "default_over_fastest": ratio,
        "default_within_5_percent": ratio >= WITHIN,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workloads", default="mixed,shared-prefix")
    default_dtypes = "bfloat16,float32" if multiplies_bfloat16() else "float32"
    parser.add_argument("--dtypes", default=default_dtypes)
    parser.add_argument("--vllm-python", help="also compare with vLLM-CPU (see vllm_cpu.py)")
    parser.add_argument("--no-profiles", action="store_true")
    args = parser.parse_args()
    workloads, dtypes = args.workloads.split(","), args.dtypes.split(",")
    emit({**machine_record(), "amx": bool(cpu_flags() & {"amx_bf16", "amx_int8"})})
    rates: dict[tuple[str, str], dict[str, list[float]]] = {}
    for run in range(args.runs):
        for workload in workloads:
            for dtype in dtypes:
                for name, options in CONFIGURATIONS.items():
                    result = bench(workload, dtype, options)
                    emit({"measure": "run", "workload": workload, "dtype": dtype,
                          "configuration": name, "run": run, **result})  # fmt: skip
                    per = rates.setdefault((workload, dtype), {})
                    per.setdefault(name, []).append(result["output_tokens_per_s"])
    for (workload, dtype), per in rates.items():
        emit(summary(workload, dtype, per))
    for workload in [] if args.no_profiles else workloads:
        for dtype in dtypes:
            command = [sys.executable, str(HERE / "step_profile.py"), "--dtype", dtype,
                       "--workload", workload]  # fmt: skip
            for record in records(command):
                if record["measure"] != "machine":
                    emit({"workload": workload, **record})
    if args.vllm_python:
        for workload in workloads:
            command = [sys.executable, str(HERE / "vllm_cpu.py"), "--vllm-python",
                       args.vllm_python, "--runs", str(args.runs), "--dtypes", args.dtypes,
                       "--workload", workload]  # fmt: skip
            for record in records(command):
                if record["measure"] != "machine":
                    emit({"workload": workload, **record})


if __name__ == "__main__":
    main()
