"""The engine's own work per decode step (scheduling, batch building, sampling, output
processing) at many sequences, apart from the model: JSON lines.

On a GPU the host's share of a step does not shrink with the model: at 512 sequences
it was about half of a Llama-3-8B decode step on an H200. This measures it on any
machine with a model so small that its forward pass costs next to nothing: a random
one-layer Llama (hidden size 64, vocabulary 512) written by transformers into a
temporary folder. Every sequence decodes (prompts prefilled first, then ``--steps``
steps timed); the engine's clocks split each step into its phases.

Records: ``machine``; one ``host_overhead`` per sequence count and output kind: wall
milliseconds per step, the engine's phases, ``host_ms`` (everything but the forward
pass) and microseconds of it per sequence.

    python benchmarks/host_overhead.py [--num-seqs 64,256,512] [--steps 50]
        [--output-kinds cumulative,final_only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path

import torch

from pagedllm.bench.machine import machine_record
from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.config import EngineConfig
from pagedllm.engine.frozen_gc import frozen_startup_objects
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.engine.stats import StepTimes


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


TINY_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=4096,
)
"""Overrides of ``write_tiny_llama``'s settings: a random one-layer Llama whose forward
pass costs next to nothing."""


def decoding_engine(model: str, num_seqs: int, kind: RequestOutputKind) -> LLMEngine:
    """An engine with ``num_seqs`` requests (prompts of 64-255 tokens) all past their
    prompt and decoding."""
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            kv_cache_memory="1GiB",
            block_size=16,
            max_num_seqs=num_seqs,
            max_num_batched_tokens=8192,
            log_stats_interval=0,
        )
    )
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=2000, output_kind=kind)
    for index in range(num_seqs):
        length = int(torch.randint(64, 256, (1,), generator=generator))
        ids = torch.randint(2, 512, (length,), generator=generator).tolist()
        engine.add_request(str(index), {"prompt_token_ids": ids}, params)
    while engine.scheduler.waiting or any(
        seq.num_output_tokens == 0 for seq in engine.scheduler.running
    ):
        engine.step()
    return engine


def measure(engine: LLMEngine, steps: int) -> dict[str, object]:
    before = replace(engine.step_times)
    walls = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
    after = engine.step_times
    phases = {
        f.name: 1000 * (getattr(after, f.name) - getattr(before, f.name)) / steps
        for f in fields(StepTimes)
        if f.name != "steps"
    }
    wall_ms = 1000 * statistics.median(walls)
    host_ms = wall_ms - phases["forward"]
    return {"ms_per_step": wall_ms, "phases_ms": phases, "host_ms": host_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", default="64,256,512")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--output-kinds", default="cumulative,final_only")
    args = parser.parse_args()
    emit(machine_record())
    kinds = [RequestOutputKind[name.upper()] for name in args.output_kinds.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        model = str(write_tiny_llama(Path(folder), seed=0, **TINY_MODEL))
        for num_seqs in (int(n) for n in args.num_seqs.split(",")):
            for kind in kinds:
                engine = decoding_engine(model, num_seqs, kind)
                with frozen_startup_objects():  # as the server and the benchmarks run
                    result = measure(engine, args.steps)
                engine.shutdown()
                emit(
                    {
                        "measure": "host_overhead",
                        "num_seqs": num_seqs,
                        "output_kind": kind.name.lower(),
                        **result,
                        "host_us_per_seq": 1000 * result["host_ms"] / num_seqs,
                    }
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
