"""Where a step's time goes: matrix products, attention, elementwise kernels, sampling and
Python, on ``pagedllm bench``'s workload (JSON lines), on both paths a step can take.

The engine's own clocks split each step into scheduling, batch preparation, the forward
pass, sampling and output processing. Inside the forward pass:

- ``stack`` (the default for Llama-shaped models on AVX-512 CPUs): the one-call layer
  stack's own phase clocks (``pagedllm/cpu/layer_stack.cpp``) add up each layer's
  products, attention, K/V writes, norms, rotary, activation, residual adds and copies
  (fused passes count once: the K/V write of a cache in the model's dtype under rotary,
  each residual add but the last layer's under norms); the rest of the forward pass
  (embedding, final norm, LM head, Python) is reported as outside the stack, and
  scheduling, preparation, sampling and output processing as the host.
  ``non_product_ms_per_step`` is everything but the products.
- ``layers`` (``enforce_eager``): torch's profiler attributes each operator's own CPU
  time to a kind (the C++ kernels are torch operators: ``packed_linear``,
  ``quant_linear``, ``paged_attention``, ...); what the operators do not account for is
  Python and the framework around them, the share the layer stack does not pay. The
  profiler adds some overhead of its own, so the shares, not the absolute times, are the
  result.

``--workload shared-prefix`` profiles instead the requests of ``benchmarks/vllm_cpu.py
--workload shared-prefix`` (32 unless ``--num-requests``; one 1,024-token prefix, prefix
caching on) from their first step to their last; the lengths and step counts of the
mixed workload do not apply to it.

Records: ``machine``; per path ``phases`` (ms per step in each part of the step, from
the engine's clocks); ``stack_phases`` (ms per step and share by phase); ``operators``
(ms per step and share by kind, the top operators of each); run it once per dtype and
kernel setting to compare.

    python benchmarks/step_profile.py [--dtype bfloat16] [--num-requests 64]
        [--steps 40] [--model M] [--quantization none] [--workload shared-prefix]
        [--paths stack,layers]
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from contextlib import nullcontext

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
    parser.add_argument("--paths", default="stack,layers",
                        help="stack: the default one-call layer stack, timed by its own "
                        "phase clocks; layers: layer by layer under torch's profiler")
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
    if shared:
        requests = shared_prefix_workload(args.num_requests or 32)
    else:
        requests = synthetic_workload(
            args.num_requests or 64, 0, args.prompt_len, args.output_len
        )
    for path in args.paths.split(","):
        if path not in ("stack", "layers"):
            parser.error(f"--paths takes stack and layers, not {path!r}")
        config = EngineConfig(model=args.model, dtype=args.dtype, quantization=args.quantization,
                              log_stats_interval=0, enable_prefix_caching=shared,
                              enforce_eager=path == "layers")  # fmt: skip
        engine = LLMEngine(config)
        stack = engine.runner.layer_stack
        if path == "stack" and stack is None:
            emit({"measure": "stack_phases", "dtype": args.dtype, "skipped": "no layer stack"})
            continue
        for index, request in enumerate(requests):
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=request.output_len,
                                    output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
            engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids}, params)
        for _ in range(0 if shared else args.warmup_steps):
            engine.step()
        before = dict(vars(engine.step_times))
        run = profile(activities=[ProfilerActivity.CPU]) if path == "layers" else nullcontext()
        if stack is not None:
            stack.set_profiling(path == "stack")
        with run as prof:
            if shared:
                while engine.has_unfinished_requests():
                    engine.step()
            else:
                for _ in range(args.steps):
                    engine.step()
        after = vars(engine.step_times)
        steps = after["steps"] - before["steps"]
        phases = {k: 1e3 * (after[k] - before[k]) / steps for k in after if k != "steps"}
        total = sum(phases.values())
        emit({"measure": "phases", "path": path, "dtype": args.dtype, "steps": steps,
              "ms_per_step": phases, "total_ms_per_step": total})  # fmt: skip
        if path == "stack":
            emit(stack_record(stack.phase_seconds(), phases, args.dtype))
        else:
            emit(operators_record(prof, steps, total, args.dtype))


def stack_record(seconds: dict[str, float], phases: dict[str, float], dtype: str) -> dict:
    """The layer stack's own phase clocks per step; what the forward pass spends outside
    the stack (embedding, final norm, LM head, Python) and the step outside the forward
    pass (host: scheduling, batch preparation, sampling, output processing)."""
    steps = seconds.pop("steps")
    inside = {name: 1e3 * s / steps for name, s in seconds.items()}
    ms = {**inside, "forward outside the stack": phases["forward"] - sum(inside.values()),
          "host": sum(v for k, v in phases.items() if k != "forward")}  # fmt: skip
    total = sum(ms.values())
    non_product = total - ms["products"]
    return {"measure": "stack_phases", "dtype": dtype, "ms_per_step": ms,
            "share": {k: v / total for k, v in ms.items()},
            "non_product_ms_per_step": non_product}  # fmt: skip


def operators_record(prof, steps: int, total: float, dtype: str) -> dict:
    """The profiler's operator time per step by kind, the rest being Python and the
    framework."""
    by_kind: dict[str, float] = defaultdict(float)
    top: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for event in prof.key_averages():
        if not event.key.startswith(("aten::", "pagedllm_cpu::", "pagedllm_shm::")):
            continue
        ms = event.self_cpu_time_total / 1e3 / steps
        kind = kind_of(event.key)
        by_kind[kind] += ms
        top[kind].append((event.key, round(ms, 3)))
    by_kind["python and framework"] = total - sum(by_kind.values())
    return {
        "measure": "operators",
        "dtype": dtype,
        "ms_per_step": dict(by_kind),
        "share": {k: v / total for k, v in by_kind.items()},
        "top": {k: sorted(v, key=lambda kv: -kv[1])[:4] for k, v in top.items()},
    }

if __name__ == "__main__":
    main()
