"""Decode attention over compact 4-bit blocks against the full-block formats.

One layer-like call per step: ``num_seqs`` sequences of ``context`` tokens decode one
token each, SmolLM2-135M's heads (9 query heads, 3 KV heads, head_dim 64). Formats:
bfloat16 blocks (the paged kernel with a bfloat16 query, as a bfloat16 model runs it),
int8 and float32 blocks (the paged kernel, float32 query) and all-compact block tables
(``paged_attention_compact``, float32 query and its rotation); block sizes 64 and 16
(the engine's default for int4). Two cache states: ``warm`` repeats one layer's call, so its K/V
stay in the CPU's caches where they fit; ``cold`` calls enough layers in turn (at least
``--cold-mb`` of K/V per format) that each finds its K/V in memory, as an engine step
does. Candidates are timed in turns; prints one JSON line per (state, sequences,
context, format, block size) with the median milliseconds per layer, the K/V bytes a
call reads and the speed-up over bfloat16 blocks of the same size
(``over_bfloat16`` > 1: faster).

    python benchmarks/attention_compact.py [--reps 15] [--contexts 2048 4096 8192]
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable

import torch

from pagedllm.bench.race import race
from pagedllm.cpu import paged_attention, paged_attention_compact
from pagedllm.cpu.allocator import huge_page_region
from pagedllm.cpu.extension import ops
from pagedllm.kv_storage.compact_blocks import TileLayout, encode_tiles
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.kv_storage.kv_quant import encode_rows, resolve_kv_format

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
FULL_FORMATS = ("bfloat16", "int8", "float32")


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def pinned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor in huge pages, as the engine's pools: scattered blocks in
    small pages would time TLB misses the engine never pays."""
    nbytes = math.prod(shape) * dtype.itemsize
    return huge_page_region(nbytes)[:nbytes].view(dtype).view(shape)


class Layer:
    """One layer's decode call: its own pool of scattered blocks (``fmt`` ``"compact"``
    or a full format) and the tensors the kernel takes."""

    def __init__(self, fmt: str, num_seqs: int, context: int, block_size: int, source: dict):
        blocks_per_seq = context // block_size
        num_blocks = num_seqs * blocks_per_seq
        self.block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, -1)
        self.seq_lens = torch.full((num_seqs,), context, dtype=torch.int32)
        self.query_start_loc = torch.arange(num_seqs + 1, dtype=torch.int32)
        q = source["q"][:num_seqs]
        self.out = torch.empty_like(q)
        if fmt == "compact":
            tiles = source[f"tiles{block_size}"]
            self.tiles = pinned((num_blocks, *tiles.shape[1:]), torch.uint8)
            self.tiles.copy_(tiles.repeat(-(-num_blocks // len(tiles)), 1, 1)[:num_blocks])
            self.q, self.q_rotated = q, (q @ hadamard(HEAD_DIM)).contiguous()
            self.k_cache = self.v_cache = torch.empty(0, NUM_KV_HEADS, block_size, HEAD_DIM)
            self.kv_bytes = self.tiles.nbytes
            self.call: Callable[[], None] = self.compact
            return
        rows = source[fmt][:, : num_blocks * block_size]
        shape = (2, num_blocks, NUM_KV_HEADS, block_size, rows.shape[-1])
        storage = pinned(shape, rows.dtype)
        storage.copy_(rows.view(2, num_blocks, block_size, NUM_KV_HEADS, -1).transpose(2, 3))
        self.k_cache, self.v_cache = storage.unbind(0)
        self.q = q.to(torch.bfloat16) if fmt == "bfloat16" else q
        self.out = torch.empty_like(self.q)
        self.kv_bytes = storage.nbytes
        self.call = self.full

    def full(self) -> None:
        paged_attention(
            self.out, self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
            self.query_start_loc, HEAD_DIM**-0.5,
        )  # fmt: skip

    def compact(self) -> None:
        paged_attention_compact(
            self.out, self.q, self.q_rotated, self.k_cache, self.v_cache, self.tiles, 0,
            self.block_tables, self.seq_lens, self.query_start_loc, HEAD_DIM**-0.5,
        )  # fmt: skip


def sources(max_tokens: int, max_seqs: int) -> dict[str, torch.Tensor]:
    """Random K/V once, in every format: rows ``[2, max_tokens, kv heads, row]`` per full
    format, up to 4096 tokens' tiles per compact block size (cycled: their values do not change
    the time), and the queries."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, max_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    out = {"q": torch.randn(max_seqs, NUM_Q_HEADS, HEAD_DIM, generator=gen)}
    for fmt in FULL_FORMATS:
        spec = resolve_kv_format("auto" if fmt == "float32" else fmt, torch.float32)
        out[fmt] = encode_rows(kv, spec).view(spec.dtype)
    tokens = min(4096, max_tokens) // 64 * 64
    for size in (64, 16):
        blocks = kv[:, :tokens].reshape(2, tokens // size, size, NUM_KV_HEADS, HEAD_DIM)
        keys, values = blocks.transpose(2, 3)
        out[f"tiles{size}"] = encode_tiles(keys, values)
        assert out[f"tiles{size}"].shape[-1] == TileLayout(size, HEAD_DIM).tile_bytes
    return out


def bench(num_seqs: int, context: int, reps: int, cold_mb: float, source: dict) -> None:
    variants = [(fmt, size) for size in (64, 16) for fmt in (*FULL_FORMATS, "compact")]
    stacks: dict[tuple[str, int], list[Layer]] = {}
    for fmt, block_size in variants:
        first = Layer(fmt, num_seqs, context, block_size, source)
        count = max(2, math.ceil(cold_mb * 2**20 / first.kv_bytes))
        rest = [Layer(fmt, num_seqs, context, block_size, source) for _ in range(count - 1)]
        stacks[fmt, block_size] = [first, *rest]

    def in_turn(layers: list[Layer]) -> Callable[[], None]:
        def step() -> None:
            for layer in layers:
                layer.call()

        return step

    for state in ("warm", "cold"):
        candidates = {
            key: (layers[0].call if state == "warm" else in_turn(layers))
            for key, layers in stacks.items()
        }
        seconds = race(candidates, reps)
        per_layer = {
            key: t / (1 if state == "warm" else len(stacks[key])) for key, t in seconds.items()
        }
        for (fmt, block_size), t in per_layer.items():
            kv_bytes = stacks[fmt, block_size][0].kv_bytes
            emit(
                bench="decode",
                cache=state,
                num_seqs=num_seqs,
                context=context,
                format=fmt,
                block_size=block_size,
                ms=round(t * 1e3, 4),
                kv_mb=round(kv_bytes / 2**20, 2),
                kv_gb_s=round(kv_bytes / t / 1e9, 1),
                over_bfloat16=round(per_layer["bfloat16", block_size] / t, 2),
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15, help="timed calls per candidate")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--num-seqs", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--cold-mb", type=float, default=96.0, help="K/V per format called in turn when cold"
    )
    args = parser.parse_args()
    ops()
    emit(bench="machine", cpus=os.cpu_count(), torch_threads=torch.get_num_threads())
    source = sources(max(args.num_seqs) * max(args.contexts), max(args.num_seqs))
    for num_seqs in args.num_seqs:
        for context in args.contexts:
            bench(num_seqs, context, args.reps, args.cold_mb, source)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
