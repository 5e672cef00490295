"""Where a step's time goes: matrix products, attention, elementwise kernels, sampling and
Python, on ``pagedllm bench``'s workload (JSON lines).

The engine's own clocks split each step into scheduling, batch preparation, the forward
pass, sampling and output processing. Inside the forward pass and the sampler, torch's
profiler attributes each operator's own CPU time to a kind (the C++ kernels are torch
operators: ``packed_linear``, ``quant_linear``, ``paged_attention``, ...); what the
operators do not account for is Python and the framework around them. The layers run one
by one (``enforce_eager``): the layer stack calls the same kernels without the
dispatcher, where the profiler cannot see them, so the Python share here is that of the
layer-by-layer path. The profiler adds some overhead of its own, so the shares, not the
absolute times, are the result.

``--workload shared-prefix`` profiles instead the requests of ``benchmarks/vllm_cpu.py
--workload shared-prefix`` (32 unless ``--num-requests``; one 1,024-token prefix, prefix
caching on) from their first step to their last; the lengths and step counts of the
mixed workload do not apply to it.

Records: ``machine``; ``phases`` (ms per step in each part of the step, from the
engine's clocks); ``operators`` (ms per step and share by kind, the top operators of
each); run it once per dtype and kernel setting to compare.

    python benchmarks/step_profile.py [--dtype bfloat16] [--num-requests 64]
        [--steps 40] [--model M] [--quantization none] [--workload shared-prefix]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

from torch.profiler import ProfilerActivity, profile

from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import length_range, shared_prefix_workload, synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams

KINDS = {
    "matrix products": ("packed_linear", "quant_linear", "linear", "addmm", "mm", "matmul",
                        "bmm", "mkldnn"),
    "attention": ("paged_attention", "write_kv", "scaled_dot_product", "copy_blocks"),
    "elementwise": ("rms_norm", "rotary", "silu_and_mul", "gelu", "add", "mul", "layer_norm",
                    "embedding", "index", "cat", "copy_", "to", "clamp", "div", "tanh"),
    "sampling": ("softmax", "log_softmax", "topk", "sort", "multinomial", "argmax",
                 "exponential", "cumsum", "gather", "scatter", "max", "where", "masked_fill"),
}


def kind_of(name: str) -> str:
    short = name.split("::")[-1]
    for kind, words in KINDS.items():
        if any(short == w or short.startswith(w) for w in words):
            return kind
    return "other operators"


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--num-requests", type=int, help="64 mixed, 32 shared-prefix")
    parser.add_argument("--workload", choices=("mixed", "shared-prefix"), default="mixed")
    mixed_only = {"--prompt-len": (length_range, (32, 512)),
                  "--output-len": (length_range, (16, 256)),
                  "--warmup-steps": (int, 10), "--steps": (int, 40)}  # fmt: skip
    for flag, (kind, default) in mixed_only.items():
        parser.add_argument(flag, type=kind, help=f"mixed workload only (default {default})")
    args = parser.parse_args()
    shared = args.workload == "shared-prefix"
    for flag, (_, default) in mixed_only.items():
        name = flag[2:].replace("-", "_")
        if getattr(args, name) is None:
            setattr(args, name, default)
        elif shared:
            parser.error(f"{flag} applies to the mixed workload only")
    emit(machine_record())
    config = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                          log_stats_interval=0, enable_prefix_caching=shared,
                          enforce_eager=True)
    engine = LLMEngine(config)
    if shared:
        requests = shared_prefix_workload(args.num_requests or 32)
    else:
        requests = synthetic_workload(
            args.num_requests or 64, 0, args.prompt_len, args.output_len
        )
    for index, request in enumerate(requests):
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=request.output_len,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids}, params)
    for _ in range(0 if shared else args.warmup_steps):
        engine.step()
    before = dict(vars(engine.step_times))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        if shared:
            while engine.has_unfinished_requests():
                engine.step()
        else:
            for _ in range(args.steps):
                engine.step()
    after = vars(engine.step_times)
    steps = after["steps"] - before["steps"]
    phases = {k: 1e3 * (after[k] - before[k]) / steps for k in after if k != "steps"}
    emit({"measure": "phases", "dtype": args.dtype, "steps": steps,
          "ms_per_step": phases, "total_ms_per_step": sum(phases.values())})
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "pagedllm_cpu::", "pagedllm_shm::")):
            continue
        ms = event.self_cpu_time_total / 1e3 / steps
        kind = kind_of(event.key)
        by_kind[kind] += ms
        top[kind].append((event.key, round(ms, 3)))
    total = sum(phases.values())
    by_kind["python and framework"] = total - sum(by_kind.values())
    emit({
        "measure": "operators",
        "dtype": args.dtype,
        "ms_per_step": dict(by_kind),
        "share": {k: v / total for k, v in by_kind.items()},
        "top": {k: sorted(v, key=lambda kv: -kv[1])[:4] for k, v in top.items()},
    })


if __name__ == "__main__":
    main()
