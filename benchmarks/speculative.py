"""Speculative decoding against plain decoding, per method and workload (JSON lines).

Workloads, all greedy on the default model (or ``--model``):

- ``grounded``: chat requests that ask the model to repeat, correct or summarize a
  passage given in the prompt (prompt lookup's home ground);
- ``agentic``: requests that each answer with a tool call in one JSON shape, for a
  different city each (repetitive structure across requests: suffix trees' home);
- ``bench``: ``pagedllm bench``'s synthetic workload (random prompts, exact output
  lengths), where guesses rarely match.

Each workload runs at two loads: ``one`` (``--single`` requests sent one after another:
one sequence decoding at a time) and ``all`` (every request at once, 64 by default).
For every (workload, load) the methods (``off``, then each of ``--methods``) run in
fresh engines over one loaded model, in an order rotated each of ``--runs`` rounds. At
load ``one`` each round builds every method's engine first and then alternates them
request by request (each request runs under every method before the next one starts);
at load ``all`` every method's engine holds all requests and the engines take one step
in turn. Either way a machine whose speed drifts within a run slows every method alike.
The model is loaded once, as a speculative engine loads it: GGUF blocks without the
expanded copies that plain decoding keeps by default for calls of many rows
(``weight_expansion_memory``; they are not batch invariant), so ``off`` runs the same
products as the methods.

Per (workload, load, method) one line: median ``output_tokens_per_s``, ``ratio`` (median
of the per-round ratios to ``off`` of the same round), ``acceptance_rate``,
``mean_acceptance_length`` (tokens a drafting sequence emitted per step),
``draft_tokens``, ``identical`` (greedy tokens equal to ``off``'s in every round), and
``blocks_held_after`` (pool blocks in use after the run: 0). The first line names the
machine (CPU model and flags: every figure belongs to it).

    python benchmarks/speculative.py [--runs 3] [--methods ngram,suffix,draft_model]
        [--workloads grounded,agentic,bench] [--single 16] [--requests 64]
        [--dtype float32 --quantization none]  # the target
        [--draft-model default --draft-quantization auto|q4_0 --draft-dtype auto
         --draft-activation-quantization int8 --draft-vocab-size N]  # draft_model's draft

The quantized self-draft: ``--dtype float32 --quantization none --methods draft_model``
(the target is the default model expanded to float32; the draft its own blocks with
int8 activations, or ``--draft-quantization q4_0`` to round them to Q4_0 first).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import synthetic_workload
from pagedllm.models.loader import load_model_for

PASSAGES = [
    "PagedAttention stores the key and value cache of every sequence in fixed-size "
    "blocks drawn from one preallocated pool. A block table maps each sequence's logical "
    "blocks to physical blocks, so memory is taken on demand as the sequence grows and "
    "returned the moment it finishes.",
    "Prefix caching lets requests that begin with the same system prompt share the "
    "blocks that hold it. Each full block is identified by a hash of its tokens and of "
    "every token before it, and a new request takes the longest chain of cached blocks "
    "before it computes anything.",
    "When two sequences share a block and one of them must write into it, the engine "
    "first copies the block and points the writer at the copy. This copy-on-write rule "
    "lets parallel samples of one prompt share all of its blocks until they diverge.",
    "Continuous batching schedules work one iteration at a time. Finished sequences "
    "leave the batch at once and waiting ones join it in the same step, so the model is "
    "never idle while short requests wait behind long ones.",
    "The river rises in the northern hills and flows south through three small towns "
    "before it reaches the sea. In spring the water is high and fast, and the old stone "
    "bridges are closed to carts until the floods have passed.",
    "Our library opens at nine in the morning and closes at six in the evening, except "
    "on Sundays, when it opens at noon. Books may be borrowed for three weeks and "
    "renewed twice, online or at the front desk.",
    "To bake the bread, mix the flour, water, salt and yeast, knead the dough for ten "
    "minutes, and let it rise for an hour. Shape the loaf, let it rise again, and bake "
    "it for forty minutes until the crust is brown.",
    "The committee met on Tuesday to review the budget. It agreed to raise the funds "
    "for repairs to the school roof, to postpone the new playground until next year, "
    "and to publish the accounts on the town's website.",
]
TASKS = [
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Correct the spelling mistakes in the following text and return the whole corrected "
    "text:\n\n{passage}",
    "Summarize the following text in two sentences, reusing its words:\n\n{passage}",
]
CITIES = [
    "Paris", "Berlin", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Dublin",
    "Oslo", "Stockholm", "Helsinki", "Warsaw", "Athens", "Budapest", "Brussels", "Zurich",
]  # fmt: skip
TOOL_PROMPT = (
    "You can call one tool, get_weather(city: string, unit: 'celsius' or 'fahrenheit', "
    "days: integer). Answer only with the tool call as JSON of the form "
    '{{"name": "get_weather", "arguments": {{"city": ..., "unit": ..., "days": ...}}}}.\n\n'
    "What will the weather be in {city} over the next {days} days, in celsius?"
)


def with_typos(text: str) -> str:
    """Swap two letters in every seventh word (a passage to correct)."""
    words = text.split(" ")
    for i in range(3, len(words), 7):
        word = words[i]
        if len(word) > 3:
            words[i] = word[0] + word[2] + word[1] + word[3:]
    return " ".join(words)


def chat_prompts(tokenizer, contents: list[str]) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True)
        for c in contents
    ]


def workloads(
    tokenizer, vocab_size: int, count: int
) -> dict[str, tuple[list[list[int]], list[SamplingParams]]]:
    """Prompt token ids and sampling params of each workload, ``count`` requests."""
    grounded = []
    for i in range(count):
        passage = PASSAGES[i % len(PASSAGES)]
        task = TASKS[(i // len(PASSAGES)) % len(TASKS)]
        grounded.append(task.format(passage=with_typos(passage) if "Correct" in task else passage))
    agentic = [
        TOOL_PROMPT.format(city=CITIES[i % len(CITIES)], days=1 + i % 7) for i in range(count)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=160)
    bench = synthetic_workload(count, vocab_size=vocab_size)
    return {
        "grounded": (chat_prompts(tokenizer, grounded), [greedy] * count),
        "agentic": (chat_prompts(tokenizer, agentic), [greedy] * count),
        "bench": (
            [r.prompt_token_ids for r in bench],
            [
                SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
                for r in bench
            ],
        ),
    }


def spec_config(method: str, args: argparse.Namespace) -> dict | None:
    if method == "off":
        return None
    config = {"method": method, "num_speculative_tokens": args.tokens}
    if method == "draft_model":
        config.update(
            model=args.draft_model,
            quantization=args.draft_quantization,
            dtype=args.draft_dtype,
            activation_quantization=args.draft_activation_quantization,
        )
        if args.draft_vocab_size:
            config["draft_vocab_size"] = args.draft_vocab_size
    return config


def measure(loaded, args, methods, prompts, params, one_at_a_time) -> dict[str, list[dict]]:
    """Every method ``args.runs`` times, in an order rotated each round; each run in a
    fresh engine over ``loaded`` (one at a time: the methods' engines alternate request
    by request)."""
    rows: dict[str, list[dict]] = {m: [] for m in methods}
    for round_index in range(args.runs):
        shift = round_index % len(methods)
        order = methods[shift:] + methods[:shift]
        if one_at_a_time:  # every method's engine, alternating request by request
            engines = {m: engine_for(m, args, loaded) for m in order}
            results = {m: {"seconds": 0.0, "tokens": {}} for m in order}
            for i in range(len(prompts)):
                for method in order:
                    result = run_alternating({method: engines[method]}, prompts, params, [i])
                    results[method]["seconds"] += result[method]["seconds"]
                    results[method]["tokens"].update(result[method]["tokens"])
            for method in order:
                rows[method].append(finished_run(results[method], engines[method]))
        else:  # every request at once in every method's engine, alternating step by step
            engines = {m: engine_for(m, args, loaded) for m in order}
            results = run_alternating(engines, prompts, params, range(len(prompts)))
            for method in order:
                rows[method].append(finished_run(results[method], engines[method]))
    return rows


def run_alternating(engines: dict[str, LLMEngine], prompts, params, indexes) -> dict[str, dict]:
    """Requests ``indexes`` at once in each engine, the engines taking one step in turn
    until all are done; per engine the seconds its own calls took and its outputs by
    request."""
    results = {m: {"seconds": 0.0, "tokens": {}} for m in engines}
    for method, engine in engines.items():
        start = time.perf_counter()
        for i in indexes:
            engine.add_request(str(i), {"prompt_token_ids": prompts[i]}, params[i])
        results[method]["seconds"] += time.perf_counter() - start
    while any(e.has_unfinished_requests() for e in engines.values()):
        for method, engine in engines.items():
            if not engine.has_unfinished_requests():
                continue
            start = time.perf_counter()
            outputs = engine.step()
            results[method]["seconds"] += time.perf_counter() - start
            for out in outputs:
                if out.finished:
                    results[method]["tokens"][out.request_id] = out.outputs[0].token_ids
    return results


def finished_run(result: dict, engine: LLMEngine) -> dict:
    """``result`` (seconds, tokens by request) with the rate and ``engine``'s counters."""
    stats = engine.get_stats()
    result["output_tokens"] = sum(len(t) for t in result["tokens"].values())
    result["rate"] = result["output_tokens"] / result["seconds"]
    result["spec"] = stats.spec_decode
    result["blocks_held_after"] = stats.num_blocks_used
    return result


def engine_for(method: str, args: argparse.Namespace, loaded) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        log_stats_interval=0,
        speculative_config=spec_config(method, args),
    )
    return LLMEngine(config, loaded)


def summary(runs: list[dict], off: list[dict]) -> dict[str, object]:
    """One method's figures over its runs, against plain decoding's runs of the same
    rounds."""
    spec = runs[-1]["spec"]
    ratios = [r["rate"] / o["rate"] for r, o in zip(runs, off, strict=True)]
    return {
        "output_tokens_per_s": statistics.median(r["rate"] for r in runs),
        "ratio": statistics.median(ratios),
        "single_ratios": [round(x, 3) for x in ratios],
        "acceptance_rate": None if spec is None else spec.acceptance_rate,
        "mean_acceptance_length": None if spec is None else spec.mean_acceptance_length,
        "draft_tokens": None if spec is None else spec.num_draft_tokens,
        "identical": all(r["tokens"] == o["tokens"] for r, o in zip(runs, off, strict=True)),
        "blocks_held_after": max(r["blocks_held_after"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", default="auto", help="the target's")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--workloads", default="grounded,agentic,bench")
    parser.add_argument("--single", type=int, default=16, help="requests run one by one")
    parser.add_argument("--requests", type=int, default=64, help="requests run at once")
    parser.add_argument("--tokens", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--loads", default="one,all", help="one (one by one), all (at once)")
    parser.add_argument("--draft-model", default="default", help="draft_model's checkpoint")
    parser.add_argument("--draft-quantization", default="auto")
    parser.add_argument("--draft-dtype", default="auto")
    parser.add_argument("--draft-activation-quantization", default="int8")
    parser.add_argument("--draft-vocab-size", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(machine_record()), flush=True)
    # loaded as a speculative engine loads it (GGUF blocks without expanded copies, which
    # are not batch invariant), for plain decoding too: both run the same products
    loaded = load_model_for(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            speculative_config={"method": "ngram", "num_speculative_tokens": 1},
        )
    )
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    methods = ["off", *args.methods.split(",")]
    all_workloads = workloads(loaded.tokenizer, loaded.config.vocab_size, args.requests)
    for name in args.workloads.split(","):
        prompts, params = all_workloads[name]
        counts = {"one": args.single, "all": args.requests}
        for load in args.loads.split(","):
            count = counts[load]
            rows = measure(loaded, args, methods, prompts[:count], params[:count], load == "one")
            for method in methods:
                record = {
                    "measure": "speculative",
                    "workload": name,
                    "load": load,
                    "requests": count,
                    "method": method,
                    "num_speculative_tokens": 0 if method == "off" else args.tokens,
                    "dtype": dtype,
                    "quantization": args.quantization,
                    "speculative_config": spec_config(method, args),
                    **summary(rows[method], rows["off"]),
                }
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
