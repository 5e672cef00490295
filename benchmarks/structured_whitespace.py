"""Free against compact whitespace in structured JSON: what it does to a small model's
outputs (JSON lines).

The default model (SmolLM2-135M-Instruct) is asked, through its chat template, for JSON
under each of a set of schemas' grammars, with any whitespace between tokens
(xgrammar's ``any_whitespace``, vLLM's default) and with compact JSON
(``disable_any_whitespace``: one space after ``,`` and ``:``, none elsewhere). Two
prompts: ``described`` puts the schema in the message; ``bare`` asks for JSON without
it, as clients do that give the schema only as ``response_format``. At temperature 1.0
every schema is sampled ``--seeds`` times per prompt; at temperature 0 once.

Per temperature, prompt and whitespace mode, one line: ``valid`` (share of outputs that
finished on a stop token and parse as JSON; an output cut by ``--max-tokens`` is
incomplete), ``mean_tokens`` / ``max_tokens`` (output tokens), ``whitespace_share``
(share of output tokens that are whitespace alone), ``seconds`` (wall time of the
batch, grammar compilation included) and ``tokens_per_s``. A first line names the CPU
and torch's thread count.

    python benchmarks/structured_whitespace.py [--seeds 2] [--max-tokens 512]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.cpu.cpuinfo import cpu_model
from pagedllm.engine.outputs import CompletionOutput
from pagedllm.structured_output import StructuredOutputsParams

TEXT = {"type": "string", "maxLength": 24}
SCHEMAS = [
    {"type": "object", "properties": {"name": TEXT, "age": {"type": "integer"}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"city": TEXT, "country": TEXT,
     "population": {"type": "integer", "minimum": 0}},
     "required": ["city", "country", "population"]},
    {"type": "object", "properties": {"title": TEXT, "year": {"type": "integer"},
     "genres": {"type": "array", "items": TEXT, "maxItems": 3}}, "required": ["title", "year"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]}},
     "required": ["point"]},
    {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "reason": TEXT},
     "required": ["answer", "reason"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "label": TEXT},
        "required": ["id", "label"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": TEXT, "email": TEXT, "address": {"type": "object", "properties": {
            "street": TEXT, "zip": TEXT}, "required": ["street", "zip"]}},
        "required": ["name", "email", "address"]}}, "required": ["user"]},
    {"type": "object", "properties": {"temperature": {"type": "number"},
     "unit": {"enum": ["C", "F"]}, "ok": {"type": "boolean"}},
     "required": ["temperature", "unit", "ok"]},
    {"type": "array", "items": {"type": "object", "properties": {"word": TEXT,
     "count": {"type": "integer"}}, "required": ["word", "count"]}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {"tags": {"type": "array", "items": TEXT,
     "maxItems": 5}, "score": {"type": "number"}}, "required": ["tags", "score"]},
    {"type": "object", "properties": {"recipe": TEXT, "ingredients": {"type": "array",
     "items": {"type": "object", "properties": {"name": TEXT, "grams": {"type": "integer"}},
     "required": ["name", "grams"]}, "maxItems": 4}}, "required": ["recipe", "ingredients"]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"},
     "sum": {"type": "integer"}, "note": {"type": "null"}},
     "required": ["a", "b", "sum", "note"]},
]  # fmt: skip


PROMPTS = {
    "described": "Reply with JSON matching this schema: {schema}",
    "bare": "Tell me about something you like, as JSON.",
}


def requests(prompt: str, temperature: float, seeds: int, compact: bool, max_tokens: int):
    """``(messages, params)`` per request: each schema once per seed (once when greedy)."""
    for schema in SCHEMAS:
        ask = PROMPTS[prompt].format(schema=json.dumps(schema))
        for seed in range(seeds if temperature > 0 else 1):
            structured = StructuredOutputsParams(json=schema, compact_json=compact)
            params = SamplingParams(
                temperature=temperature, seed=seed, max_tokens=max_tokens,
                structured_outputs=structured,
            )  # fmt: skip
            yield [{"role": "user", "content": ask}], params


def is_valid(output: CompletionOutput) -> bool:
    """Finished on a stop token and parses as JSON."""
    if output.finish_reason != "stop":
        return False
    try:
        json.loads(output.text)
    except ValueError:
        return False
    return True


def measure(llm: LLM, prompt: str, temperature: float, compact: bool, args) -> dict[str, object]:
    """One batch of every request under one prompt, temperature and whitespace mode."""
    batch = list(requests(prompt, temperature, args.seeds, compact, args.max_tokens))
    start = time.perf_counter()
    outputs = llm.chat([m for m, _ in batch], [p for _, p in batch], use_tqdm=False)
    seconds = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    completions = [output.outputs[0] for output in outputs]
    lengths = [len(c.token_ids) for c in completions]
    blank = sum(tokenizer.decode([t]).isspace() for c in completions for t in c.token_ids)
    return {
        "prompt": prompt,
        "temperature": temperature,
        "whitespace": "compact" if compact else "any",
        "requests": len(batch),
        "valid": round(sum(map(is_valid, completions)) / len(batch), 3),
        "mean_tokens": round(sum(lengths) / len(lengths), 1),
        "max_tokens": max(lengths),
        "whitespace_share": round(blank / max(sum(lengths), 1), 3),
        "seconds": round(seconds, 1),
        "tokens_per_s": round(sum(lengths) / seconds, 1),
    }


def warm_up(llm: LLM) -> None:
    """Prefill every prompt once under another constraint, so the first measured batch
    does not pay for the engine's first steps (kernel timing on the CPU) nor for the
    grammar compiler's construction (the vocabulary's analysis)."""
    batch = [m for prompt in PROMPTS for m, _ in requests(prompt, 0.0, 1, False, 1)]
    any_object = StructuredOutputsParams(json_object=True)
    llm.chat(batch, SamplingParams(max_tokens=2, structured_outputs=any_object), use_tqdm=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=2, help="samples per schema at T=1")
    parser.add_argument("--max-tokens", type=int, default=512)
    args = parser.parse_args()
    llm = LLM(kv_cache_memory="1GiB", log_stats_interval=0)
    warm_up(llm)
    print(json.dumps({"cpu": cpu_model(), "threads": torch.get_num_threads()}), flush=True)
    for temperature in (1.0, 0.0):
        for prompt in PROMPTS:
            for compact in (False, True):
                line = measure(llm, prompt, temperature, compact, args)
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
