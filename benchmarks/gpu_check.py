"""The GPU check: one command, JSON lines, sized to finish in under 8 minutes on an H200.

    PYTHONPATH=. python benchmarks/gpu_check.py [--sections a,b,c,d] [--quick]

Sections (each prints its own JSON lines; a section that fails prints its error and the
others still run):

a. Tiny random checkpoints (written here by transformers): greedy tokens of the CUDA
   engine in float32 against the CPU engine's (CUDA graphs on, prefix caching on,
   prompts prefilled in chunks over shared prefixes), and bfloat16 on CUDA against
   float32 on CUDA over 64 requests x 32 steps: the largest logprob difference at the
   first step, the share of requests whose tokens are identical, and for every request
   that diverges, the float32 margin between its two best tokens where it diverged.
b. Paged decode attention over 64 sequences x 4,096 tokens, Llama-3-8B shape, bfloat16:
   bytes read per second against the device's read bandwidth measured in the same run,
   and time against torch's SDPA on the same K/V stored contiguously
   (``benchmarks/gpu_attention.py``).
c. Dummy Llama-3-8B in bfloat16, 1,000 requests (prompts 64-1,024 tokens, outputs
   64-512, greedy, ignore_eos): tokens/s, TTFT and TPOT percentiles, and the share of
   the bfloat16 matrix-product roofline (measured here) that the run reached counting
   every token.
d. Paged against contiguous reservation under the same KV budget, dummy Llama-2-13B
   in bfloat16: sequences at once and tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from pagedllm.bench.throughput import flops_per_output_token, run_engine
from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.bench.workload import synthetic_workload
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.loader import load_model

BF16_LOGPROB_TOLERANCE = 0.1
"""Largest |bfloat16 - float32| logprob of the greedy token at the first step (nats):
bfloat16 keeps 8 significant bits, so logits of magnitude ~10 carry errors of a few
hundredths after two layers; 0.1 leaves a margin. Random models with large weights have
larger logits and errors, reported as measured."""


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def train_tiny_llama(folder: Path, device: str, steps: int = 300) -> Path:
    """A tiny Llama trained for a few hundred steps on a synthetic language whose next
    token is a fixed function of the current one: its greedy choices are confident, as a
    trained model's are, so float rounding rarely decides them (a random model's top two
    logits are often closer than bfloat16 can tell apart)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab = 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=vocab,
            hidden_size=256,
            intermediate_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            eos_token_id=1,
            bos_token_id=0,
        )
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        tokens = [torch.randint(2, vocab, (64,), device=device)]
        for _ in range(95):
            tokens.append((tokens[-1] * 5 + 3) % vocab)
        batch = torch.stack(tokens, dim=1)
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.to("cpu").save_pretrained(folder, safe_serialization=True)
    emit({"check": "a_trained_tiny_llama", "steps": steps, "final_loss": loss.item()})
    return folder


def tiny_prompts(count: int, vocab: int, seed: int) -> list[list[int]]:
    """Random prompts of 8-200 tokens; every other one starts with one shared 64-token
    prefix, so the prefix cache and chunked prefill over cached blocks are exercised."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(2, vocab, (64,), generator=gen).tolist()
    prompts = []
    for i in range(count):
        length = int(torch.randint(8, 200, (1,), generator=gen))
        ids = torch.randint(2, vocab, (length,), generator=gen).tolist()
        prompts.append(prefix + ids if i % 2 else ids)
    return prompts


def generate(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[str(i)] for i in range(len(prompts))]


def tiny_engine(folder: Path, device: str, dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(folder),
            device=device,
            dtype=dtype,
            kv_cache_memory="64MiB",
            block_size=16,
            max_num_seqs=64,
            max_num_batched_tokens=256,
            log_stats_interval=0,
        )
    )


def section_a(args: argparse.Namespace) -> None:
    cases = {
        "random_gqa4-2_hd64": dict(seed=1),
        "random_gqa8-2_hd128": dict(
            seed=1, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2
        ),
        "trained_gqa4-2_hd64": None,
    }
    for name, settings in cases.items():
        with tempfile.TemporaryDirectory() as tmp:
            if settings is None:
                folder = train_tiny_llama(Path(tmp), "cuda")
            else:
                folder = write_tiny_llama(Path(tmp), max_position_embeddings=1024, **settings)
            prompts = tiny_prompts(16 if args.quick else 32, 512, seed=2)
            greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
            cuda_fp32 = generate(tiny_engine(folder, "cuda", "float32"), prompts, greedy)
            cpu_fp32 = generate(tiny_engine(folder, "cpu", "float32"), prompts, greedy)
            pairs = zip(cuda_fp32, cpu_fp32, strict=True)
            same = sum(a.token_ids == b.token_ids for a, b in pairs)
            emit(
                {
                    "check": "a_float32_cuda_vs_cpu",
                    "model": name,
                    "requests": len(prompts),
                    "identical": same,
                    "all_identical": same == len(prompts),
                }
            )
            _compare_bf16(name, folder, tiny_prompts(64, 512, seed=3))
        gc.collect()
        torch.cuda.empty_cache()


def _compare_bf16(name: str, folder: Path, prompts: list[list[int]]) -> None:
    """bfloat16 against float32, both on CUDA. A divergence is explained when, at the
    first step where the tokens differ (the contexts are still identical there), the
    float32 margin between the two best tokens is within twice the largest logprob error
    measured at the first step: a near tie that bfloat16 cannot resolve."""
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
    reference = generate(tiny_engine(folder, "cuda", "float32"), prompts, params)
    bf16 = generate(tiny_engine(folder, "cuda", "bfloat16"), prompts, params)
    top_error = 0.0
    for ref, low in zip(reference, bf16, strict=True):
        ref_first, low_first = ref.logprobs[0], low.logprobs[0]
        if ref_first.token_id == low_first.token_id:
            top_error = max(top_error, abs(ref_first.logprob - low_first.logprob))
    divergences = []
    for index, (ref, low) in enumerate(zip(reference, bf16, strict=True)):
        if ref.token_ids == low.token_ids:
            continue
        pairs = zip(ref.token_ids, low.token_ids, strict=True)
        step = next(t for t, (a, b) in enumerate(pairs) if a != b)
        top = ref.logprobs[step].top
        margin = top[0][1] - top[1][1]
        divergences.append(
            {
                "request": index,
                "step": step,
                "float32_margin": margin,
                "explained_near_tie": margin <= 2 * top_error,
            }
        )
    identical = len(prompts) - len(divergences)
    emit(
        {
            "check": "a_bfloat16_vs_float32",
            "model": name,
            "requests": len(prompts),
            "steps": 32,
            "first_step_max_top_logprob_error": top_error,
            "tolerance": BF16_LOGPROB_TOLERANCE,
            "within_tolerance": top_error <= BF16_LOGPROB_TOLERANCE,
            "identical_share": identical / len(prompts),
            "goal_met": identical / len(prompts) >= 0.95,
            "unexplained_divergences": sum(not d["explained_near_tie"] for d in divergences),
            "divergences": divergences,
        }
    )


def section_b(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    import gpu_attention

    for record in gpu_attention.run_checks(torch.device("cuda"), quick=args.quick):
        emit({"check": "b_attention", **record})


def bf16_matmul_tflops(size: int = 8192, repeats: int = 10) -> float:
    a = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(size, size, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        a @ b
    end.record()
    torch.cuda.synchronize()
    return 2 * size**3 * repeats / (start.elapsed_time(end) / 1000) / 1e12


def section_c(args: argparse.Namespace) -> None:
    peak = bf16_matmul_tflops()
    emit({"check": "c_bf16_matmul_peak", "tflops": peak})
    config = EngineConfig(
        model="llama-3-8b",
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=512,
        max_num_batched_tokens=8192,
        log_stats_interval=0,
    )
    start = time.monotonic()
    engine = LLMEngine(config)
    emit(
        {
            "check": "c_startup",
            "seconds": time.monotonic() - start,
            "num_blocks": engine.num_blocks,
            "kv_pool_gib": engine.kv_cache.nbytes / 2**30,
            "max_model_len": engine.max_model_len,
        }
    )
    num_requests = 200 if args.quick else 1000
    requests = synthetic_workload(
        num_requests, seed=0, prompt_len=(64, 1024), output_len=(64, 512), vocab_size=128256
    )
    result = run_engine(requests, config, engine, time_limit_s=60 if args.quick else 200)
    tokens = result["output_tokens"] + sum(
        len(r.prompt_token_ids) for r in requests[: result["num_requests"]]
    )
    achieved = flops_per_output_token(engine.model_config) * tokens / result["elapsed_s"]
    result.update(
        check="c_llama3_8b_dummy_throughput",
        roofline_share=achieved / (peak * 1e12),
        goal_output_tokens_per_s=12500,
    )
    emit(result)
    emit({"check": "c_decode_step_gpu_ms", **decode_step_gpu_ms(engine, (64, 256, 512))})
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def decode_step_gpu_ms(engine: LLMEngine, sizes: tuple[int, ...]) -> dict[str, float]:
    """GPU time of one captured decode step (the decoder, every sequence at 1,024
    tokens of context) for each batch size, from CUDA events over 10 replays."""
    graphs = engine.runner.graphs
    if graphs is None:
        return {}
    times = {}
    blocks = 1024 // engine.config.block_size
    for size in sizes:
        if size not in graphs.sizes:
            continue
        table = torch.arange(size * blocks, dtype=torch.int32, device="cuda").view(size, -1)
        graphs.block_tables[:size, :blocks].copy_(table % engine.num_blocks)
        graphs.seq_lens[:size].fill_(1024)
        graphs.slot_mapping[:size].fill_(-1)  # measure reads only; write nothing
        graph, _ = graphs._graphs[size]
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times[f"batch_{size}"] = start.elapsed_time(end) / 10
    return times


def section_d(args: argparse.Namespace) -> None:
    loaded = load_model(
        "llama-2-13b", torch.bfloat16, device=torch.device("cuda"), load_format="dummy"
    )
    requests = synthetic_workload(
        48,
        seed=1,
        prompt_len=(64, 512),
        output_len=(32, 256),
        vocab_size=32000,
    )
    results = {}
    for allocation in ("paged", "contiguous"):
        config = EngineConfig(
            model="llama-2-13b",
            load_format="dummy",
            device="cuda",
            dtype="bfloat16",
            kv_cache_memory="6GiB",
            max_model_len=2048,
            reserved_fraction=0.0,
            kv_allocation=allocation,
            max_num_seqs=64,
            max_num_batched_tokens=4096,
            log_stats_interval=0,
        )
        engine = LLMEngine(config, loaded)
        result = run_engine(requests, config, engine, time_limit_s=45)
        result["check"] = "d_paged_vs_contiguous_13b"
        emit(result)
        results[allocation] = result
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    paged, contiguous = results["paged"], results["contiguous"]
    emit(
        {
            "check": "d_ratio",
            "concurrent_seqs_ratio": paged["max_concurrent_seqs"]
            / max(contiguous["max_concurrent_seqs"], 1),
            "output_tokens_per_s_ratio": paged["output_tokens_per_s"]
            / contiguous["output_tokens_per_s"],
        }
    )


SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sections", default="a,b,c,d")
    parser.add_argument("--quick", action="store_true", help="smaller workloads (a smoke run)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stderr)
    if not torch.cuda.is_available():
        emit({"check": "device", "error": "no CUDA device"})
        return 1
    props = torch.cuda.get_device_properties(0)
    import triton

    emit(
        {
            "check": "device",
            "name": props.name,
            "memory_gib": props.total_memory / 2**30,
            "multiprocessors": props.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton.__version__,
        }
    )
    failed = 0
    for name in args.sections.split(","):
        start = time.monotonic()
        try:
            SECTIONS[name](args)
        except Exception as err:  # one section's failure must not hide the others
            failed += 1
            emit(
                {
                    "check": f"section_{name}",
                    "error": repr(err),
                    "traceback": traceback.format_exc()[-3000:],
                }
            )
        emit({"check": f"section_{name}_seconds", "seconds": time.monotonic() - start})
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
