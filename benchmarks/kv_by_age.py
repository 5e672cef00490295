"""The KV cache formats at long context, through the engine (JSON lines): perplexity,
pass keys, greedy agreement, capacity and decode attention time, per format and, for
``int4``, per recent window.

Every measure runs ``LLMEngine`` as a user would (chunked prefill of
``--chunk`` tokens, prefix caching off so that no run borrows another's K/V):

1. ``perplexity``: the first ``--max-len`` tokens (at most the model's positions less
   one) of a novel (Pride and Prejudice, see
   :func:`~pagedllm.bench.long_context.novel_text`) as one prompt, scored by its prompt
   logprobs; perplexity over the first 2k, 4k and 8k tokens, and the mean NLL
   difference to the first scheme over the second half of each.
2. ``passkey``: a five-digit key hidden at each depth of 1k-8k tokens of filler, asked
   for at the end; the keys each scheme's greedy answer names (same keys everywhere).
3. ``agreement``: greedy outputs on ``pagedllm bench``'s prompts, token by token
   against ``--agreement-reference`` (bfloat16): share of equal positions, and where
   each output first differs.
4. ``capacity``: tokens per GiB of one sequence of ``--max-len`` tokens, counting
   compact blocks, their scales and the full-size blocks of its recent window.
5. ``decode``: one sequence's decode speed (tokens/s after its first token, the whole
   engine step) after a prompt of each ``--decode-contexts`` length, schemes in
   alternating rounds, medians of ``--rounds``.

Schemes: a ``kv_cache_dtype`` (``float32`` is the model's own, ``auto``), the model
itself in another dtype with its own cache (``bfloat16-model``, agreement only), and
``int4@R`` for ``int4`` with ``kv_recent_tokens=R`` (``int4@R:B`` in blocks of ``B``
tokens instead of the engine's default 16; ``int4@R:B:F`` with the recent window in
format ``F``, ``kv_recent_dtype``, such as ``int8``).

    python benchmarks/kv_by_age.py [--schemes float32,bfloat16,int8,int4@0,int4@128]
    python benchmarks/kv_by_age.py --measure passkey --passkey-lengths 1024,8192
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

import torch

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.agreement import agreement
from pagedllm.bench.long_context import ANSWER_TOKENS, novel_text, passkey_prompt
from pagedllm.bench.machine import machine_record
from pagedllm.bench.workload import synthetic_workload
from pagedllm.kv.capacity import cdiv, recent_blocks
from pagedllm.kv_storage.compact_blocks import TileLayout
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import LoadedModel, load_model_for

GIB = 1 << 30


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def parse_scheme(scheme: str) -> tuple[str, int | None, int | None, str]:
    """``(kv_cache_dtype, kv_recent_tokens, block_size, kv_recent_dtype)`` of
    ``"int4@128:16:int8"``, ``"int4@128:16"``, ``"int4@128"`` or ``"bfloat16"`` (None and
    ``"auto"``: the engine's defaults)."""
    name, _, window = scheme.partition("@")
    window, _, rest = window.partition(":")
    block_size, _, recent = rest.partition(":")
    if name == "float32":
        name = "auto"
    window_tokens = int(window) if window else None
    return name, window_tokens, int(block_size) if block_size else None, recent or "auto"


MODEL_SUFFIX = "-model"
"""A scheme ``"bfloat16-model"``: the model itself in that dtype, with its own cache."""


def engine_for(args, loaded: LoadedModel, scheme: str, max_len: int) -> LLM:
    dtype = args.dtype
    if scheme.endswith(MODEL_SUFFIX):
        dtype, scheme = scheme.removesuffix(MODEL_SUFFIX), "float32"
        loaded = load_model_for(EngineConfig(dtype=dtype))
    kv_cache_dtype, window, block_size, recent = parse_scheme(scheme)
    extra = {} if window is None else {"kv_recent_tokens": window, "kv_recent_dtype": recent}
    if block_size is not None:
        extra["block_size"] = block_size
    config = EngineConfig(
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=max_len,
        max_num_batched_tokens=args.chunk,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=False,
        log_stats_interval=0,
        **extra,
    )
    return LLM.from_engine(LLMEngine(config, loaded))


def perplexity_records(args, loaded: LoadedModel, token_ids: list[int]) -> None:
    lengths = sorted({min(n, len(token_ids) - 1) for n in (2048, 4096, 8192)})
    scored = SamplingParams(max_tokens=1, prompt_logprobs=0)
    base = None
    for scheme in args.schemes:
        start = time.perf_counter()
        llm = engine_for(args, loaded, scheme, len(token_ids) + 1)  # one token generated
        (output,) = llm.generate([{"prompt_token_ids": token_ids}], scored, use_tqdm=False)
        scored_tokens = output.prompt_logprobs[1:]
        assert [entry.token_id for entry in scored_tokens] == token_ids[1:]
        nll = [-entry.logprob for entry in scored_tokens]
        base = base or nll
        record = {"measure": "perplexity", "scheme": scheme, "tokens": len(nll)}
        for n in lengths:
            record[f"ppl_{n}"] = round(math.exp(sum(nll[:n]) / n), 4)
            half = range(n // 2, n)
            diff = sum(nll[i] - base[i] for i in half) / len(half)
            record[f"nll_vs_{args.schemes[0]}_{n // 2}_{n}"] = round(diff, 5)
        record["seconds"] = round(time.perf_counter() - start, 1)
        emit(**record)


def passkey_records(args, loaded: LoadedModel) -> None:
    lengths = [int(n) for n in args.passkey_lengths.split(",")]
    depths = [float(d) for d in args.passkey_depths.split(",")]
    rng = random.Random(0)
    trials = [(n, d, rng.randrange(10_000, 100_000)) for n in lengths for d in depths]
    prompts = [
        {"prompt_token_ids": passkey_prompt(loaded.tokenizer, n, d, key)} for n, d, key in trials
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    for scheme in args.schemes:
        start = time.perf_counter()
        llm = engine_for(args, loaded, scheme, max(lengths))
        outputs = llm.generate(prompts, greedy, use_tqdm=False)
        found = [
            str(key) in out.outputs[0].text
            for (_, _, key), out in zip(trials, outputs, strict=True)
        ]
        record = {"measure": "passkey", "scheme": scheme, "found": sum(found)}
        record["trials"] = len(trials)
        for n in lengths:
            record[f"found_{n}"] = sum(
                ok for (m, _, _), ok in zip(trials, found, strict=True) if m == n
            )
        record["missed"] = [
            f"{n}@{d}" for (n, d, _), ok in zip(trials, found, strict=True) if not ok
        ]
        record["seconds"] = round(time.perf_counter() - start, 1)
        emit(**record)


def agreement_records(args, loaded: LoadedModel) -> None:
    requests = synthetic_workload(args.prompts, seed=0, vocab_size=loaded.config.vocab_size)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    longest = max(len(r.prompt_token_ids) for r in requests) + args.gen_tokens
    runs = {}
    for scheme in [args.agreement_reference, *args.schemes]:
        if scheme in runs:
            continue
        start = time.perf_counter()
        outputs = engine_for(args, loaded, scheme, longest).generate(
            prompts, greedy, use_tqdm=False
        )
        runs[scheme] = [out.outputs[0].token_ids for out in outputs]
        agreed = agreement(runs[args.agreement_reference], runs[scheme])
        first_diffs = agreed.first_differences
        emit(
            measure="agreement",
            scheme=scheme,
            reference=args.agreement_reference,
            prompts=len(prompts),
            gen_tokens=args.gen_tokens,
            equal_share=round(agreed.equal_share, 4),
            mean_first_difference=round(sum(first_diffs) / len(first_diffs), 1),
            seconds=round(time.perf_counter() - start, 1),
        )


def decode_seconds(llm: LLM, prompt_ids: list[int], num_tokens: int) -> float:
    """Seconds per generated token after the first, stepping ``llm``'s engine."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    engine.add_request("decode", {"prompt_token_ids": prompt_ids}, params)
    start = None
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if start is None and outputs and outputs[0].outputs[0].token_ids:
            start = time.perf_counter()
    return (time.perf_counter() - start) / (num_tokens - 1)


def decode_records(args, loaded: LoadedModel) -> None:
    contexts = [int(n) for n in args.decode_contexts.split(",")]
    text = loaded.tokenizer.encode(novel_text())
    for context in contexts:
        engines = {s: engine_for(args, loaded, s, context + args.gen_tokens) for s in args.schemes}
        times: dict[str, list[float]] = {s: [] for s in args.schemes}
        for _ in range(args.rounds):
            for scheme, llm in engines.items():
                times[scheme].append(decode_seconds(llm, text[:context], args.gen_tokens))
        base = statistics.median(times[args.schemes[0]])
        for scheme, seconds in times.items():
            median = statistics.median(seconds)
            emit(
                measure="decode",
                scheme=scheme,
                context=context,
                tokens_per_s=round(1 / median, 2),
                vs_first=round(base / median, 3),
                runs=[round(1 / s, 2) for s in seconds],
            )
        del engines


def capacity_records(args, loaded: LoadedModel) -> None:
    """Bytes one ``--max-len``-token sequence holds per format (the engine's own block
    arithmetic), and tokens per GiB against bfloat16."""
    mc = loaded.config
    model_dtype = loaded.model.dtype
    bf16_block = bytes_per_block(
        mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, torch.bfloat16, "bfloat16"
    )
    bf16_bytes = cdiv(args.max_len, 16) * bf16_block
    for scheme in args.schemes:
        kv_cache_dtype, window, block_size, recent = parse_scheme(scheme)
        block_size = block_size or EngineConfig.block_size
        full_format = kv_cache_dtype if window is None else recent
        full = bytes_per_block(
            mc.num_layers, block_size, mc.num_kv_heads, mc.head_dim, model_dtype, full_format
        )
        num_blocks = cdiv(args.max_len, block_size)
        if window is None:
            held = num_blocks * full
        else:
            compact = (
                mc.num_layers * mc.num_kv_heads * TileLayout(block_size, mc.head_dim).tile_bytes
            )
            recent = min(num_blocks, recent_blocks(window, 1, block_size))
            held = recent * full + (num_blocks - recent) * compact
        emit(
            measure="capacity",
            scheme=scheme,
            tokens=args.max_len,
            bytes=held,
            tokens_per_gib=round(args.max_len * GIB / held),
            vs_bfloat16=round(bf16_bytes / held, 3),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schemes", default="float32,bfloat16,int8,fp8_e4m3,int4@0,int4@128")
    parser.add_argument("--measure", default="capacity,perplexity,passkey,agreement")
    parser.add_argument("--dtype", default="float32", help="the model's dtype")
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--kv-cache-memory", default="2GiB")
    parser.add_argument("--passkey-lengths", default="1024,2048,4096,8192")
    parser.add_argument("--passkey-depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--prompts", type=int, default=16, help="agreement prompts")
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--agreement-reference", default="bfloat16")
    parser.add_argument("--decode-contexts", default="2048,8000")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    args.schemes = args.schemes.split(",")
    measures = args.measure.split(",")
    loaded = load_model_for(EngineConfig(dtype=args.dtype, log_stats_interval=0))
    emit(**machine_record(), dtype=args.dtype, chunk=args.chunk)
    if "capacity" in measures:
        capacity_records(args, loaded)
    if "perplexity" in measures:
        # the prompt and one generated token within the model's positions
        limit = loaded.config.max_position_embeddings - 1
        token_ids = loaded.tokenizer.encode(novel_text())[: min(args.max_len, limit)]
        perplexity_records(args, loaded, token_ids)
    if "passkey" in measures:
        passkey_records(args, loaded)
    if "agreement" in measures:
        agreement_records(args, loaded)
    if "decode" in measures:
        decode_records(args, loaded)


if __name__ == "__main__":
    main()
