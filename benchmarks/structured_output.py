"""What structured outputs add to a decode step: the sampler's time for a batch of
constrained sequences against the same batch unconstrained.

Each step the benchmark builds the batch (the constrained rows' matchers advance by
the last token and fill one bitmask) and samples from ``[batch, vocab]`` random logits
of the default model's vocabulary; the sampled tokens follow the grammar, so every
sequence walks its JSON schema as a real one would. The model's forward pass is the
same with or without the constraint and is left out.

Prints one JSON line: batch size, steps, milliseconds per step without and with the
constraint, the overhead per step, and the grammar's compile time (once per schema).

    python benchmarks/structured_output.py [--batch 64] [--steps 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm.engine.sampler import Sampler, SamplingBatch
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.models.default import default_model_path
from pagedllm.models.loader_gguf import gguf_config, open_gguf
from pagedllm.structured_output import StructuredOutputsParams
from pagedllm.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city"],
        },
    },
    "required": ["name", "age", "address"],
}


def ms_per_step(params: list[SamplingParams], steps: int, vocab: int, stop: set[int]) -> float:
    sampler = Sampler()
    outputs: list[list[int]] = [[] for _ in params]
    generator = torch.Generator().manual_seed(0)
    elapsed = 0.0
    for _ in range(steps):
        logits = torch.randn(len(params), vocab, generator=generator)
        start = time.perf_counter()
        batch = SamplingBatch.from_requests(
            params, [[1]] * len(params), outputs, [None] * len(params), stop
        )
        tokens = sampler(logits, batch).token_ids
        elapsed += time.perf_counter() - start
        for output, token in zip(outputs, tokens, strict=True):
            if token in stop:  # the sequence is done: a new one takes its row
                output.clear()
            else:
                output.append(token)
    return 1000 * elapsed / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    args = parser.parse_args()
    path = default_model_path()
    tokenizer = Tokenizer.from_gguf(path)
    vocab = gguf_config(open_gguf(path), path).vocab_size
    torch.manual_seed(0)
    plain = [SamplingParams(temperature=1.0, max_tokens=None)] * args.batch
    start = time.perf_counter()
    constrained = SamplingParams(
        temperature=1.0, max_tokens=None, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    constrained.check_for_model(vocab, tokenizer)
    compile_ms = 1000 * (time.perf_counter() - start)
    base = ms_per_step(plain, args.steps, vocab, tokenizer.stop_token_ids)
    with_grammar = ms_per_step(
        [constrained] * args.batch, args.steps, vocab, tokenizer.stop_token_ids
    )
    record = {
        "batch": args.batch,
        "steps": args.steps,
        "vocab": vocab,
        "sampler_ms_per_step": round(base, 2),
        "constrained_ms_per_step": round(with_grammar, 2),
        "overhead_ms_per_step": round(with_grammar - base, 2),
        "compile_ms": round(compile_ms, 1),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
