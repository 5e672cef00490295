"""Beam search KV memory with shared blocks against private copies, and its speed.

All prompts' searches run together on one engine. After every step the benchmark reads
two figures, in KV blocks:

- ``shared``: blocks the pool has handed out (the beams' forks share every block and
  copy only a partly filled last block when they write to it);
- ``unshared``: what the same beams would hold if each kept a private copy of its whole
  sequence, prompt included: the sum over live beams of ``ceil(slots / block_size)``.

Prints JSON lines: the machine, then one record with the peak of each figure, their
ratio, wall time and tokens per second (``beam_tokens_per_s`` counts the decode tokens,
one per live beam per step after the prompt; ``output_tokens_per_s`` counts the tokens
of each prompt's best sequence).

    python benchmarks/beam_search.py [--model PATH] [--beam-width 4] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from pagedllm import EngineConfig, LLMEngine
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.beam_search_runner import BeamSearchRunner

QUESTIONS = [
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "What is the capital of France, and what is it known for?",
    "Give three tips for learning a new language.",
]


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def unshared_blocks(engine: LLMEngine, runner: BeamSearchRunner) -> int:
    """Blocks the live beams would hold with a private copy of every sequence."""
    block_size = engine.config.block_size
    manager = engine.block_manager
    return sum(
        -(-manager.num_tokens(seq.seq_id) // block_size)
        for seq in runner.live_beams
        if seq.seq_id in manager
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF folder (default model)")
    parser.add_argument("--beam-width", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many prompts")
    parser.add_argument("--ignore-eos", action="store_true", help="every beam runs max-tokens")
    args = parser.parse_args()
    emit(
        metric="machine",
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_average=os.getloadavg()[0],
    )
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            block_size=args.block_size,
            kv_cache_memory="256MiB",
            max_model_len=1024,
            log_stats_interval=0,
        )
    )
    params = BeamSearchParams(args.beam_width, args.max_tokens, ignore_eos=args.ignore_eos)
    runner = BeamSearchRunner(engine)
    prompt_tokens = 0
    for index in range(args.prompts):
        question = QUESTIONS[index % len(QUESTIONS)]
        ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}])
        prompt_tokens += len(ids)
        runner.add(ids, params, question)

    pool = engine.block_manager.pool
    peak_shared = peak_unshared = steps = beam_tokens = 0
    outputs = []
    start = time.perf_counter()
    while runner.has_unfinished:
        beam_tokens += sum(seq.num_output_tokens > 0 for seq in runner.live_beams)
        outputs += runner.step()
        steps += 1
        peak_shared = max(peak_shared, pool.num_used)
        peak_unshared = max(peak_unshared, unshared_blocks(engine, runner))
    seconds = time.perf_counter() - start
    output_tokens = sum(len(out.sequences[0].token_ids) for _, out in outputs)
    emit(
        metric="beam_search",
        beam_width=args.beam_width,
        prompts=args.prompts,
        prompt_tokens=prompt_tokens,
        max_tokens=args.max_tokens,
        block_size=args.block_size,
        steps=steps,
        peak_blocks_shared=peak_shared,
        peak_blocks_unshared=peak_unshared,
        shared_over_unshared=round(peak_shared / peak_unshared, 3),
        seconds=round(seconds, 2),
        beam_tokens_per_s=round(beam_tokens / seconds, 1),
        output_tokens_per_s=round(output_tokens / seconds, 1),
        load_average=os.getloadavg()[0],
    )


if __name__ == "__main__":
    main()
