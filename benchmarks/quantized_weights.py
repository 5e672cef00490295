"""Weights run on their GGUF blocks against weights expanded at load, side by side (JSON).

Variants of the default model (SmolLM2-135M-Instruct): ``F32`` and ``BF16`` expand the
shipped Q4_1 file (``quantization="none"``); ``Q4_1`` runs its blocks (Q4_1 matrices, a
Q8_0 tied embedding); ``Q8_0`` runs a GGUF this script writes from the dequantized
weights (every matrix Q8_0). ``Q4_1`` and ``Q8_0`` take float32 activations,
``Q4_1 bf16`` and ``Q8_0 bf16`` bfloat16 ones (multiplied in bfloat16 pairs where the CPU
has them); ``Q4_1 int8`` and ``Q8_0 int8`` bfloat16 ones rounded to int8 where they meet
the blocks (``activation_quantization="int8"``, llama.cpp's arithmetic). ``--variants``
picks some (F32 is always run: the ratios are to it).

Records (one JSON line each):
- ``machine``: CPU model, its AVX-512 flags, threads, load average.
- ``memory``: per variant, in a fresh process, the file's bytes, the weight bytes the
  model holds and the process's resident bytes before and after loading.
- ``decode_1``: one sequence (a 32-token prompt) decoding ``--decode-tokens`` tokens,
  output tokens/s after the first token, per second of wall time and of process CPU
  time; median of ``--runs`` runs alternating between variants, so background load hits
  all alike. On a shared machine run ``--threads 1``: the CPU-time rate is then close
  to the rate on an idle core (with more threads it counts their spin-waits).
- ``throughput_64``: ``pagedllm bench``'s synthetic workload (64 requests, greedy,
  ``ignore_eos``, prefix caching off), output tokens/s; median of alternating runs.
- ``same_tokens``: requests of that workload whose greedy ``Q4_1`` tokens equal the
  ``F32`` run's (the same weights), and for the others the first position that differs.
- With ``llama-cpp-python`` installed, ``decode_1`` of llama.cpp with the same threads
  (its weight repacking off on CPUs with AMX, where it crashes; ``machine`` records it)
  on the shipped Q4_1 file and on F32, BF16 and Q8_0 files this script writes from the
  dequantized weights; otherwise one ``skipped`` record.

    python benchmarks/quantized_weights.py [--runs 3] [--decode-tokens 64]
        [--num-requests 64] [--prompt-len 32,512] [--output-len 16,256] [--threads 2]
        [--variants F32,BF16,Q4_1,Q8_0,"Q4_1 bf16","Q8_0 bf16","Q4_1 int8","Q8_0 int8"]
        [--no-throughput]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import psutil
import torch

from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import BenchRequest, length_range, synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.cpu.cpuinfo import cpu_flags
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.models.default import default_model_path
from pagedllm.models.loader import load_model

UNQUANTIZED = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def write_requantized(source: Path, dest: Path, target: gguf.GGMLQuantizationType) -> Path:
    """``source``'s metadata and tensors, every quantized matrix stored as ``target``
    (Q8_0, BF16 or F32) from its dequantized values."""
    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(dest, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), kind, sub)
    for tensor in reader.tensors:
        if tensor.tensor_type in UNQUANTIZED:
            writer.add_tensor(tensor.name, np.array(tensor.data))
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        values = values.astype(np.float32)
        if target == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, values)
            continue
        blocks = gguf.quants.quantize(values, target)
        writer.add_tensor(tensor.name, blocks, raw_shape=blocks.shape, raw_dtype=target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dest


def memory_after_load(
    path: str, dtype: str, quantization: str, activations: str, threads: int
) -> dict:
    """Resident bytes before and after loading, in this (fresh) process."""
    torch.set_num_threads(threads)
    process = psutil.Process()
    before = process.memory_info().rss
    model = load_model(
        path, getattr(torch, dtype), quantization=quantization, activation_quantization=activations
    ).model
    after = process.memory_info().rss
    weights = sum(t.numel() * t.element_size() for t in model.weights())
    return {"rss_before_bytes": before, "rss_after_bytes": after, "weight_bytes": weights}


def rates(tokens: int, wall_s: float, cpu_s: float) -> dict[str, float]:
    """Tokens per second of wall time and of this process's CPU time (all threads): on a
    shared machine with one thread, the CPU rate is close to the rate on an idle core."""
    return {"wall": tokens / wall_s, "cpu": tokens / cpu_s}


def decode_rate(engine: LLMEngine, tokens: int) -> dict[str, float]:
    """Output tokens/s of one sequence after its first token."""
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
    prompt = {"prompt_token_ids": list(range(100, 132))}
    engine.add_request("decode", prompt, params)
    engine.step()  # prefill and the first token
    wall, cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return rates(tokens - 1, time.perf_counter() - wall, time.process_time() - cpu)


def run_workload(engine: LLMEngine, requests: list[BenchRequest]) -> tuple[dict, list]:
    """Output tokens/s of all requests submitted at once, and each request's tokens."""
    wall, cpu = time.perf_counter(), time.process_time()
    for index, request in enumerate(requests):
        params = SamplingParams(
            temperature=0.0,
            ignore_eos=True,
            max_tokens=request.output_len,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        engine.add_request(str(index), {"prompt_token_ids": request.prompt_token_ids}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[int(out.request_id)] = list(out.outputs[0].token_ids)
    tokens = [outputs[i] for i in range(len(requests))]
    count = sum(map(len, tokens))
    return rates(count, time.perf_counter() - wall, time.process_time() - cpu), tokens


@contextlib.contextmanager
def llama_cpp_repacking(enabled: bool) -> Iterator[None]:
    """llama.cpp models opened meanwhile repack their weights for the CPU (its default) or
    not: on a CPU with AMX tiles llama-cpp-python 0.3.36 crashes in decode on Q4_1 and
    Q8_0 files unless ``use_extra_bufts`` is off, which its ``Llama`` does not expose."""
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def params() -> bindings.llama_model_params:
        chosen = defaults()
        chosen.use_extra_bufts = enabled
        return chosen

    bindings.llama_model_default_params = params
    try:
        yield
    finally:
        bindings.llama_model_default_params = defaults


def llama_cpp_repacks() -> bool:
    """Whether llama.cpp keeps its default weight repacking here: not on CPUs with AMX."""
    return not any(flag.startswith("amx") for flag in cpu_flags())


def llama_cpp_decode_rate(path: str, tokens: int, threads: int) -> dict[str, float]:
    """llama.cpp's output tokens/s for one sequence after its first token (greedy)."""
    from llama_cpp import Llama

    with llama_cpp_repacking(llama_cpp_repacks()):
        llm = Llama(
            model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False
        )
    try:
        llm.eval(list(range(100, 132)))
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        wall, cpu = time.perf_counter(), time.process_time()
        for _ in range(tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return rates(tokens - 1, time.perf_counter() - wall, time.process_time() - cpu)
    finally:  # an open model keeps its threads, which slow whatever runs next
        llm.close()


def report(measure: str, runs: dict[str, list[dict[str, float]]]) -> None:
    """One record per variant: median wall and CPU tokens/s, and their ratios to F32's."""
    medians = {
        name: {kind: statistics.median(r[kind] for r in values) for kind in ("wall", "cpu")}
        for name, values in runs.items()
    }
    for name, median in medians.items():
        emit(
            measure=measure,
            variant=name,
            tokens_per_s=median["wall"],
            cpu_tokens_per_s=median["cpu"],
            wall_vs_F32=median["wall"] / medians["F32"]["wall"],
            cpu_vs_F32=median["cpu"] / medians["F32"]["cpu"],
            runs=runs[name],
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=length_range, default=(32, 512))
    parser.add_argument("--output-len", type=length_range, default=(16, 256))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--variants", default="F32,BF16,Q4_1,Q8_0,Q4_1 bf16,Q8_0 bf16")
    parser.add_argument("--no-throughput", action="store_true", help="decode_1 only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    emit(**machine_record(), threads=args.threads, llama_cpp_repacks=llama_cpp_repacks())

    shipped = default_model_path()
    folder = Path(tempfile.mkdtemp())
    written = {
        name: write_requantized(
            shipped, folder / f"SmolLM2-135M-Instruct.{name}.gguf", gguf.GGMLQuantizationType[name]
        )
        for name in ("Q8_0", "BF16", "F32")
    }
    q8_0 = written["Q8_0"]
    variants = {  # file, dtype, quantization, activation_quantization
        "F32": (shipped, "float32", "none", "none"),
        "BF16": (shipped, "bfloat16", "none", "none"),
        "Q4_1": (shipped, "float32", "auto", "none"),
        "Q8_0": (q8_0, "float32", "auto", "none"),
        "Q4_1 bf16": (shipped, "bfloat16", "auto", "none"),
        "Q8_0 bf16": (q8_0, "bfloat16", "auto", "none"),
        "Q4_1 int8": (shipped, "bfloat16", "auto", "int8"),
        "Q8_0 int8": (q8_0, "bfloat16", "auto", "int8"),
    }
    chosen = {"F32", *args.variants.split(",")}
    variants = {name: variant for name, variant in variants.items() if name in chosen}
    spawn = multiprocessing.get_context("spawn")
    for name, (path, dtype, quantization, activations) in variants.items():
        with spawn.Pool(1) as pool:
            memory = pool.apply(
                memory_after_load, (str(path), dtype, quantization, activations, args.threads)
            )
        emit(measure="memory", variant=name, file_bytes=path.stat().st_size, **memory)

    engines = {
        name: LLMEngine(
            EngineConfig(
                model=str(path),
                dtype=dtype,
                quantization=quantization,
                activation_quantization=activations,
                kv_cache_memory="512MiB",
                enable_prefix_caching=False,
                log_stats_interval=0,
            )
        )
        for name, (path, dtype, quantization, activations) in variants.items()
    }
    baselines = {}
    try:
        import llama_cpp  # noqa: F401

        files = {"F32": written["F32"], "BF16": written["BF16"], "Q4_1": shipped, "Q8_0": q8_0}
        baselines = {f"llama.cpp {name}": str(path) for name, path in files.items()}
    except ImportError:
        emit(measure="decode_1", variant="llama.cpp", skipped="llama-cpp-python not installed")

    decode: dict[str, list[dict[str, float]]] = {name: [] for name in [*engines, *baselines]}
    for _ in range(args.runs):
        for name, engine in engines.items():
            decode[name].append(decode_rate(engine, args.decode_tokens))
        for name, path in baselines.items():
            decode[name].append(llama_cpp_decode_rate(path, args.decode_tokens, args.threads))
    report("decode_1", decode)
    if args.no_throughput:
        return

    requests = synthetic_workload(args.num_requests, 0, args.prompt_len, args.output_len)
    throughput: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    tokens = {}
    for _ in range(args.runs):
        for name, engine in engines.items():
            rate, tokens[name] = run_workload(engine, requests)
            throughput[name].append(rate)
    report(f"throughput_{args.num_requests}", throughput)
    # Q4_1 runs the very weights F32 expands: greedy tokens differ only where float32
    # rounding flips a near-tie
    if "Q4_1" not in tokens:
        return
    pairs = list(zip(tokens["Q4_1"], tokens["F32"], strict=True))
    diverged = {  # request -> (first differing output position, output length)
        i: (next(p for p, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        for i, (a, b) in enumerate(pairs)
        if a != b
    }
    emit(
        measure="same_tokens",
        variant="Q4_1",
        as_variant="F32",
        requests=len(pairs) - len(diverged),
        of=len(pairs),
        diverged=diverged,
    )


if __name__ == "__main__":
    main()
