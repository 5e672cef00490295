"""Which 4-bit K/V scheme to build: perplexity at long context when K/V older than a
recent window are stored in 4 bits, per scheme, side by side (JSON lines).

The default model in float32 reads the first ``--max-len`` tokens of a novel (Pride and
Prejudice, see :func:`novel_text`) ``--chunk`` at a time through the paged backend. The
reference schemes (float32, bfloat16, int8) run in a cache of their own format. The
4-bit ones run in a float32 cache: after each chunk, every group of K/V rows lying
wholly behind the newest ``window`` tokens is replaced, once, by its round trip through
the scheme (``pagedllm/kv_storage/int4_codec.py``), as a cache that re-encodes blocks
by age would hold them. Every chunk attends to the cache the chunks before it left.
Perplexity over the first 2k, 4k and 8k tokens, over the second half of each, and the
mean NLL difference to the first scheme over that half. ``--measure passkey``: a
five-digit key hidden at each depth of 1k-8k tokens of filler, asked for at the end
(``--keys-per-case`` keys each); the keys each scheme's greedy answer names (the same
keys for every scheme) and the keys' NLL after the prompt. ``--measure key_error``: the
keys' coding error alone, per scheme, over the first ``--max-len`` tokens of the text.

Schemes: ``bfloat16``; ``int8`` (the cache's per-token format); ``int4-kG`` (keys per
channel in groups of G tokens, values per token); ``int4-kG-rot`` (the same after a
Hadamard rotation of keys and queries); ``int4-tok-rot`` (keys per token too, rotated);
a ``-vrot`` suffix rotates the values too before their per-token codes (the attention
output rotated back); ``-kfull`` / ``-vfull`` leave keys / values unquantized (which of
the two a loss comes from); ``-p8`` stores each key group's scale and zero as 8-bit
codes on one linear grid per 64 tokens and KV head (:func:`round_trip_p8`), ``-vp8``
each token's value scale and zero alike; ``-q8`` puts each key group on a grid of whole
steps instead, an 8-bit step and an int8 zero (:func:`round_trip_q8`); ``-kNvM`` codes
keys in N bits and values in M (``-k5v3``: the same code bytes as 4 and 4).

    python benchmarks/kv_int4_study.py [--max-len 8192] [--windows 0,128,512]
    python benchmarks/kv_int4_study.py --measure passkey [--passkey-lengths 1024,8192]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch

from pagedllm import EngineConfig
from pagedllm.bench.chunked_nll import chunked_nll, greedy_continuation, text_cache
from pagedllm.bench.long_context import ANSWER_TOKENS, novel_text, passkey_prompt
from pagedllm.bench.machine import machine_record
from pagedllm.kv_storage.int4_codec import hadamard, round_trip_keys, round_trip_values
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.models.loader import load_model_for

BLOCK_SIZE = 16
P8_TILE = 64


class Scheme:
    """How rows are stored: the reference formats in a cache of that ``kv_dtype``; the
    4-bit schemes in a float32 cache whose groups of ``group`` tokens are re-encoded
    once they are old enough (``compact_keys``, values per token)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.by_age = name.startswith("int4")
        self.kv_dtype = "auto" if self.by_age or name == "float32" else name
        parts = name.split("-")
        self.rotate = "rot" in parts
        self.rotate_values = "vrot" in parts
        self.full_keys = "kfull" in parts
        self.full_values = "vfull" in parts
        self.group = int(parts[1][1:]) if name.startswith("int4-k") else BLOCK_SIZE
        self.params_8bit = "p8" in parts
        self.values_8bit = "vp8" in parts
        self.steps_8bit = "q8" in parts
        widths = [re.fullmatch(r"k(\d)v(\d)", part) for part in parts]
        key_bits, value_bits = next(((int(m[1]), int(m[2])) for m in widths if m), (4, 4))
        self.key_levels, self.value_levels = 2**key_bits - 1, 2**value_bits - 1
        tiled = self.params_8bit or self.values_8bit or self.steps_8bit
        if tiled and (key_bits, value_bits) != (4, 4):
            raise ValueError(f"{name}: the 8-bit group parameters (-p8, -vp8, -q8) code 4 bits")
        self.unit = P8_TILE if tiled else self.group
        """Tokens re-encoded at once."""

    def compact_keys(self, k: torch.Tensor) -> torch.Tensor:
        """``k`` ``[heads, unit, head_dim]``."""
        if self.rotate:
            h = hadamard(k.shape[-1])
            k = k @ h
        if self.name.startswith("int4-tok"):
            k = round_trip_values(k, self.key_levels)
        elif self.params_8bit or self.steps_8bit:
            codec = round_trip_q8 if self.steps_8bit else round_trip_p8
            k = round_trip_key_groups(k, self.group, codec)
        else:
            k = round_trip_keys(k, self.group, self.key_levels)
        return k @ h.T if self.rotate else k


def round_trip_key_groups(k: torch.Tensor, group: int, codec) -> torch.Tensor:
    """``k`` ``[heads, P8_TILE, head_dim]`` coded per channel in groups of ``group``
    tokens by ``codec`` (:func:`round_trip_p8` or :func:`round_trip_q8`), decoded."""
    heads, tokens, dim = k.shape
    grouped = k.float().reshape(heads, tokens // group, group, dim)
    return codec(grouped, dim=2).reshape(k.shape)


def by_head(rows: torch.Tensor, coding) -> torch.Tensor:
    """``rows`` ``[blocks, heads, BLOCK_SIZE, head_dim]`` laid in token order, through
    ``coding`` of ``[heads, tokens, head_dim]``, in the same layout."""
    blocks, heads, _, dim = rows.shape
    coded = coding(rows.transpose(0, 1).reshape(heads, blocks * BLOCK_SIZE, dim))
    return coded.reshape(heads, blocks, BLOCK_SIZE, dim).transpose(0, 1)


def round_trip_q8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` ``[heads, ...]`` coded in groups along ``dim`` on a grid ``(z + c) * step``:
    the step an 8-bit power ``2^(-e/16)`` (rounded up) of the head's largest one, the
    zero ``z`` an int8 count of steps, so that the group's values lie on its grid (a
    step of at least its range / 14 and its largest magnitude / 127)."""
    x = x.float()
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    needed = torch.maximum((high - low) / 14, torch.maximum(-low, high) / 127).clamp_min(1e-30)
    rest = tuple(range(1, x.dim()))
    largest = needed.amax(dim=rest, keepdim=True)
    exponent = (torch.log2(largest / needed) * 16).floor().clamp(0, 255)
    step = largest * torch.exp2(-exponent / 16)
    zero = (low / step).floor().clamp(-128, 127)
    return (zero + ((x / step) - zero).round().clamp(0, 15)) * step


def round_trip_p8(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` ``[heads, ...]`` coded in groups along ``dim``, each group's low and high
    end as 8-bit codes (rounded outward) on a grid of 255 steps from the head's lowest
    to its highest value (float32), decoded."""
    x = x.float()
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    rest = tuple(range(1, x.dim()))
    tile_low = low.amin(dim=rest, keepdim=True)
    step = ((high.amax(dim=rest, keepdim=True) - tile_low) / 255).clamp_min(1e-30)
    low_code = ((low - tile_low) / step).floor().clamp(0, 255)
    high_code = ((high - tile_low) / step).ceil().clamp(0, 255)
    zero = tile_low + low_code * step
    scale = ((high_code - low_code) * step / 15).clamp_min(1e-30)
    return zero + ((x - zero) / scale).round().clamp(0, 15) * scale


def by_age(cache: KVCache, mc, scheme: Scheme, window: int):
    """The hook that re-encodes each group of ``scheme`` once it lies wholly behind the
    newest ``window`` tokens (None for the reference formats)."""
    if not scheme.by_age:
        return None
    compacted = 0  # tokens already re-encoded

    def compact_old(end: int) -> None:
        nonlocal compacted
        old = (end - window) // scheme.unit * scheme.unit
        for first in range(compacted, old, scheme.unit):
            compact(cache, mc, scheme, first, first + scheme.unit)
        compacted = max(compacted, old)

    return compact_old


def nll_with(loaded, token_ids: list[int], scheme: Scheme, window: int, chunk: int) -> torch.Tensor:
    """NLL (nats) of tokens 1.. given those before, read ``chunk`` tokens a time."""
    cache = text_cache(loaded, len(token_ids) - 1, BLOCK_SIZE, scheme.kv_dtype)
    hook = by_age(cache, loaded.config, scheme, window)
    return chunked_nll(loaded, token_ids, cache, torch.arange(cache.num_blocks), chunk, hook)


def passkey_found(loaded, scheme: Scheme, window: int, chunk: int, num_tokens: int, depth: float,
                  key: int) -> tuple[bool, float]:  # fmt: skip
    """Whether the greedy answer after a pass-key prompt names the key, and the key's
    NLL (nats, summed over its tokens) after the prompt: how near a miss is."""
    prompt = passkey_prompt(loaded.tokenizer, num_tokens, depth, key)
    cache = text_cache(loaded, len(prompt) + ANSWER_TOKENS, BLOCK_SIZE, scheme.kv_dtype)
    hook = by_age(cache, loaded.config, scheme, window)
    table = torch.arange(cache.num_blocks)
    answer = greedy_continuation(loaded, prompt, cache, table, chunk, ANSWER_TOKENS, hook)
    answered = loaded.tokenizer.encode(f" {key}")
    cache = text_cache(loaded, len(prompt) + len(answered), BLOCK_SIZE, scheme.kv_dtype)
    hook = by_age(cache, loaded.config, scheme, window)
    table = torch.arange(cache.num_blocks)
    nll = chunked_nll(loaded, [*prompt, *answered], cache, table, chunk, hook)
    return str(key) in loaded.tokenizer.decode(answer), nll[-len(answered) :].sum().item()


def compact(cache: KVCache, mc, scheme: Scheme, first: int, last: int) -> None:
    """Re-encode positions ``first .. last - 1`` of every layer (blocks laid in order)."""
    heads = mc.num_kv_heads
    for layer in range(mc.num_layers):
        k = cache.key(layer).view(-1, heads, BLOCK_SIZE, mc.head_dim)
        v = cache.value(layer).view(-1, heads, BLOCK_SIZE, mc.head_dim)
        blocks = slice(first // BLOCK_SIZE, last // BLOCK_SIZE)
        if not scheme.full_keys:
            k[blocks] = by_head(k[blocks], scheme.compact_keys)
        if scheme.rotate_values:
            h = hadamard(mc.head_dim)
            v[blocks] = round_trip_values(v[blocks] @ h, scheme.value_levels) @ h.T
        elif scheme.values_8bit:
            v[blocks] = by_head(v[blocks], lambda rows: round_trip_p8(rows, dim=2))
        elif not scheme.full_values:
            v[blocks] = round_trip_values(v[blocks], scheme.value_levels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument(
        "--schemes",
        default="float32,bfloat16,int8,int4-k16,int4-k32,int4-k64,int4-k16-rot,int4-k64-rot,int4-tok-rot",
    )
    parser.add_argument("--windows", default="0,128")
    parser.add_argument("--text-file", default=None, help="a text instead of the novel")
    parser.add_argument(
        "--measure", default="perplexity", help="perplexity, passkey and/or key_error"
    )
    parser.add_argument("--passkey-lengths", default="1024,2048,4096,8192")
    parser.add_argument("--passkey-depths", default="0.1,0.3,0.5,0.7,0.9")
    parser.add_argument("--keys-per-case", type=int, default=1, help="keys per length and depth")
    args = parser.parse_args()
    print(json.dumps(machine_record()), flush=True)
    loaded = load_model_for(EngineConfig(dtype="float32", quantization="none"))
    runs = [
        (Scheme(name), window)
        for name in args.schemes.split(",")
        for window in (
            [int(w) for w in args.windows.split(",")] if name.startswith("int4") else [0]
        )
    ]
    if "perplexity" in args.measure:
        text = Path(args.text_file).read_text() if args.text_file else novel_text()
        perplexity_records(args, loaded, loaded.tokenizer.encode(text)[: args.max_len + 1], runs)
    if "passkey" in args.measure:
        passkey_records(args, loaded, runs)
    if "key_error" in args.measure:
        text = Path(args.text_file).read_text() if args.text_file else novel_text()
        key_error_records(args, loaded, loaded.tokenizer.encode(text)[: args.max_len + 1], runs)


def key_error_records(args, loaded, token_ids: list[int], runs) -> None:
    """Per 4-bit scheme: the keys' coding error over the text's keys (float32 cache),
    root mean square relative to the keys, per layer; its mean and largest."""
    mc = loaded.config
    cache = text_cache(loaded, len(token_ids) - 1, BLOCK_SIZE)
    chunked_nll(loaded, token_ids, cache, torch.arange(cache.num_blocks), args.chunk, None)
    for scheme in {scheme.name: scheme for scheme, _ in runs if scheme.by_age}.values():
        errors = []
        num_blocks = (len(token_ids) - 1) // scheme.unit * scheme.unit // BLOCK_SIZE
        for layer in range(mc.num_layers):
            k = cache.key(layer).view(-1, mc.num_kv_heads, BLOCK_SIZE, mc.head_dim)[:num_blocks]
            coded = torch.cat(
                [by_head(unit, scheme.compact_keys) for unit in k.split(scheme.unit // BLOCK_SIZE)]
            )
            errors.append(((coded - k).pow(2).mean() / k.pow(2).mean()).sqrt().item())
        record = {
            "measure": "key_error",
            "scheme": scheme.name,
            "tokens": num_blocks * BLOCK_SIZE,
            "mean": round(sum(errors) / len(errors), 5),
            "max": round(max(errors), 5),
        }
        print(json.dumps(record), flush=True)


def perplexity_records(args, loaded, token_ids: list[int], runs) -> None:
    lengths = [n for n in (2048, 4096, 8192) if n <= len(token_ids) - 1]
    base = None
    for scheme, window in runs:
        start = time.perf_counter()
        nll = nll_with(loaded, token_ids, scheme, window, args.chunk)
        if base is None:
            base = nll
        record = {
            "measure": "perplexity",
            "scheme": scheme.name,
            "window": window if scheme.by_age else None,
            "tokens": len(nll),
            "seconds": round(time.perf_counter() - start, 1),
        }
        for n in lengths:
            record[f"ppl_{n}"] = round(math.exp(nll[:n].mean().item()), 4)
            last = nll[n // 2 : n]
            record[f"ppl_{n // 2}_{n}"] = round(math.exp(last.mean().item()), 4)
            diff = (nll[n // 2 : n] - base[n // 2 : n]).mean().item()
            record[f"nll_vs_first_{n // 2}_{n}"] = round(diff, 5)
        print(json.dumps(record), flush=True)


def passkey_records(args, loaded, runs) -> None:
    """Per scheme: keys found at each length and depth (the same keys for every scheme),
    and the keys' NLL after the prompt, each and averaged (smoother than found/missed
    where keys lie near the edge)."""
    lengths = [int(n) for n in args.passkey_lengths.split(",")]
    depths = [float(d) for d in args.passkey_depths.split(",")]
    rng = random.Random(0)
    keys = {
        (n, d, i): rng.randrange(10_000, 100_000)
        for n in lengths
        for d in depths
        for i in range(args.keys_per_case)
    }

    def label(n: int, d: float, i: int) -> str:
        return f"{n}@{d}" if args.keys_per_case == 1 else f"{n}@{d}#{i}"

    for scheme, window in runs:
        start = time.perf_counter()
        found = {
            (n, d, i): passkey_found(loaded, scheme, window, args.chunk, n, d, key)
            for (n, d, i), key in keys.items()
        }
        record = {
            "measure": "passkey",
            "scheme": scheme.name,
            "window": window if scheme.by_age else None,
            "found": sum(ok for ok, _ in found.values()),
            "trials": len(found),
            "mean_key_nll": round(sum(nll for _, nll in found.values()) / len(found), 4),
            "seconds": round(time.perf_counter() - start, 1),
        }
        for n in lengths:
            record[f"found_{n}"] = sum(ok for (m, _, _), (ok, _) in found.items() if m == n)
        record["missed"] = [label(*case) for case, (ok, _) in found.items() if not ok]
        record["key_nll"] = {label(*case): round(nll, 3) for case, (_, nll) in found.items()}
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
