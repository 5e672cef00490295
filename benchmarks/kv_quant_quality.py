"""What a quantized KV cache costs in quality, per KV dtype, side by side (JSON lines).

Text: the long descriptions (READMEs) that installed packages ship in their metadata,
read at run time and concatenated: English prose with some markup and code.

1. ``perplexity``: the default model reads the first ``--max-len`` tokens chunk by chunk
   (``--chunk`` tokens per forward) through the paged backend, so every chunk attends
   to the cache, in the dtype under test, written by the chunks before it. Perplexity
   over the first 512, 2,048 and ``--max-len`` tokens, and the mean NLL difference to
   the full-precision cache per position band: whether the error grows with length.
2. ``scale_error``: K/V of the real model (the full-precision run's cache) quantized
   with one scale per token and head (what the cache does) against one per block and
   head (computed from the whole block, the best a block-wide scale could do): relative
   RMS error.
3. ``agreement``: greedy generations of ``--gen-tokens`` tokens after prompts of
   ``--prompt-len`` tokens through the engine, token by token against the
   full-precision cache: share of equal positions, and where they first differ.

    python benchmarks/kv_quant_quality.py [--max-len 8192] [--dtypes int8,fp8_e4m3]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from importlib.metadata import metadata

import torch

from pagedllm import LLM, EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.agreement import agreement
from pagedllm.bench.chunked_nll import chunked_nll, text_cache
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.kv_quant import decode_rows, encode_rows, resolve_kv_format
from pagedllm.models.loader import LoadedModel, load_model

DISTRIBUTIONS = ["transformers", "torch", "fastapi", "tqdm"]
ALL_DTYPES = ["auto", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8"]
BLOCK_SIZE = 16


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def corpus_text() -> str:
    """The packages' long descriptions, in a fixed order."""
    parts = []
    for name in DISTRIBUTIONS:
        meta = metadata(name)
        parts.append(meta.get_payload() or meta.get("Description") or "")
    return "\n\n".join(parts)


def read_in_chunks(
    loaded: LoadedModel, token_ids: list[int], kv_cache_dtype: str, chunk: int
) -> tuple[torch.Tensor, KVCache]:
    """NLL (nats) of tokens ``1 ..`` given the ones before, prefilled ``chunk`` at a time
    over scattered blocks of a cache in ``kv_cache_dtype``; also the cache it filled."""
    cache = text_cache(loaded, len(token_ids) - 1, BLOCK_SIZE, kv_cache_dtype)
    table = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(0))
    return chunked_nll(loaded, token_ids, cache, table, chunk), cache


def cache_rows(cache: KVCache, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the first ``n`` logical positions, float32 ``[layers, blocks, heads,
    block_size, head_dim]`` (block order is irrelevant to the error statistics)."""
    used = -(-n // cache.block_size)
    k = torch.stack([decode_rows(cache.key(i), cache.format) for i in range(cache.num_layers)])
    v = torch.stack([decode_rows(cache.value(i), cache.format) for i in range(cache.num_layers)])
    return k[:, :used], v[:, :used]


def relative_error(x: torch.Tensor, name: str, per_block: bool) -> float:
    """Relative RMS error of ``x`` ``[..., block_size, head_dim]`` after a round trip
    through format ``name``, with one scale per token row or per block tile."""
    fmt = resolve_kv_format(name, torch.float32)
    rows = x.flatten(-2) if per_block else x
    back = decode_rows(encode_rows(rows, fmt), fmt).reshape(x.shape)
    return float((back - x).norm() / x.norm())


def perplexity_records(args, loaded: LoadedModel, token_ids: list[int]) -> None:
    lengths = sorted({min(512, args.max_len), min(2048, args.max_len), args.max_len})
    bands = [(a, b) for a, b in zip([0, *lengths[:-1]], lengths, strict=True) if a < b]
    baseline = None
    for name in args.dtypes:
        begin = time.perf_counter()
        nll, cache = read_in_chunks(loaded, token_ids, name, args.chunk)
        seconds = time.perf_counter() - begin
        if name == "auto":
            baseline = nll
            k, v = cache_rows(cache, len(token_ids))
            for quant in ("int8", "fp8_e4m3", "fp8_e5m2"):
                for kind, x in (("K", k), ("V", v)):
                    emit(
                        record="scale_error",
                        kv_cache_dtype=quant,
                        tensor=kind,
                        per_token=round(relative_error(x, quant, False), 5),
                        per_block=round(relative_error(x, quant, True), 5),
                    )
        ppl = {str(n): round(math.exp(float(nll[:n].mean())), 4) for n in lengths}
        record = dict(record="perplexity", kv_cache_dtype=name, perplexity=ppl)
        if baseline is not None:
            delta = nll - baseline
            record["nll_delta_by_band"] = {
                f"{a}-{b}": round(float(delta[a:b].mean()), 5) for a, b in bands
            }
            record["ppl_ratio"] = {
                str(n): round(math.exp(float(delta[:n].mean())), 5) for n in lengths
            }
        record["seconds"] = round(seconds, 1)
        emit(**record)


def agreement_records(args, loaded: LoadedModel, token_ids: list[int]) -> None:
    step = (len(token_ids) - args.prompt_len) // max(1, args.prompts - 1)
    prompts = [
        {"prompt_token_ids": token_ids[i * step : i * step + args.prompt_len]}
        for i in range(args.prompts)
    ]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.gen_tokens, ignore_eos=True)
    runs = {}
    for name in args.dtypes:
        config = EngineConfig(
            dtype="float32",
            kv_cache_dtype=name,
            kv_cache_memory="1GiB",
            max_model_len=args.prompt_len + args.gen_tokens,
            log_stats_interval=0,
        )
        begin = time.perf_counter()
        outputs = LLM.from_engine(LLMEngine(config, loaded)).generate(
            prompts, greedy, use_tqdm=False
        )
        runs[name] = [out.outputs[0].token_ids for out in outputs]
        reference = runs.get("auto")
        if reference is None:
            continue
        agreed = agreement(reference, runs[name])
        emit(
            record="agreement",
            kv_cache_dtype=name,
            prompts=args.prompts,
            prompt_len=args.prompt_len,
            gen_tokens=args.gen_tokens,
            equal_share=round(agreed.equal_share, 4),
            first_difference=agreed.first_differences,
            seconds=round(time.perf_counter() - begin, 1),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--dtypes", default=",".join(ALL_DTYPES))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-tokens", type=int, default=256)
    parser.add_argument("--skip", default="", help="perplexity and/or agreement")
    args = parser.parse_args()
    args.dtypes = ["auto"] + [d for d in args.dtypes.split(",") if d != "auto"]
    loaded = load_model(None, torch.float32)
    token_ids = loaded.tokenizer.encode(corpus_text())
    emit(
        record="setup",
        model=loaded.source.name,
        corpus=DISTRIBUTIONS,
        corpus_tokens=len(token_ids),
        threads=torch.get_num_threads(),
        scales="one bfloat16 per token and KV head",
    )
    if len(token_ids) < args.max_len + 1:
        raise SystemExit(f"the corpus has only {len(token_ids)} tokens")
    if "perplexity" not in args.skip:
        perplexity_records(args, loaded, token_ids[: args.max_len + 1])
    if "agreement" not in args.skip:
        agreement_records(args, loaded, token_ids)


if __name__ == "__main__":
    main()
