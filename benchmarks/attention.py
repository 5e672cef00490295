"""Paged attention on CPU against torch's SDPA, side by side in one run.

Prints JSON lines: the machine (cores, measured memory bandwidth), the extension's load
time, then per shape the median time of the paged kernel, of SDPA on the same K/V
already contiguous, and of gathering K/V through the block table followed by SDPA,
with the ratios and the K/V read bandwidth each achieves; decode over 30 layers' caches
in turn, as an engine step reads them (``decode_cold``); prefill chunks of many
sequences over one prefix in shared blocks (``prefill_shared``); then what
``attention_kernel="auto"`` times for prefill chunks (paged against gather-then-SDPA)
and the crossover it would pick; decode per block size; and decode over blocks scattered
against the same blocks in one contiguous run per sequence (``decode_contiguous_runs``).
Candidates are timed round-robin so that background load hits them alike.

    python benchmarks/attention.py [--reps 9] [--quick] [--fresh-build] [--contiguous-runs]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time

import torch
import torch.nn.functional as F

from pagedllm.attention.attention_choice import (
    CONTEXT,
    ROW_BUCKETS,
    TOTAL_ROWS,
    crossover,
    time_prefill,
)
from pagedllm.bench.race import race
from pagedllm.cpu import paged_attention
from pagedllm.cpu.allocator import huge_page_region
from pagedllm.cpu.extension import ops

NUM_SEQS, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 64, 9, 3, 64  # SmolLM2-135M's attention


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def memory_bandwidth(reps: int) -> dict[str, float]:
    """GB/s of a 512 MiB sum (reads only) and of a 256 MiB copy (read + write)."""
    x = torch.ones(128 * 2**20)
    src, dst = torch.ones(64 * 2**20), torch.empty(64 * 2**20)
    t = race({"sum": x.sum, "copy": lambda: dst.copy_(src)}, reps)
    return {"sum_gb_s": x.nbytes / t["sum"] / 1e9, "copy_gb_s": 2 * src.nbytes / t["copy"] / 1e9}


class PagedBatch:
    """``num_seqs`` sequences of ``seq_len`` tokens in scattered blocks; the last
    ``q_len`` tokens of each are the queries. The first ``shared_blocks`` blocks of every
    table are the first sequence's (a cached prefix all of them start with). With
    ``contiguous``, each sequence's blocks lie in one run, in order."""

    def __init__(
        self,
        num_seqs: int,
        seq_len: int,
        q_len: int,
        block_size: int,
        dtype: torch.dtype,
        token_major: bool = False,
        shared_blocks: int = 0,
        contiguous: bool = False,
    ):
        blocks_per_seq = -(-seq_len // block_size)
        num_blocks = num_seqs * blocks_per_seq
        # In huge pages, as the engine's pool: else scattered small blocks would time
        # TLB misses the engine never pays.
        shape = (2, num_blocks, NUM_KV_HEADS, block_size, HEAD_DIM)
        if token_major:  # [blocks, block_size, heads, dim], seen through a permuted view
            shape = (2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        numel = math.prod(shape)
        region = huge_page_region(numel * dtype.itemsize)[: numel * dtype.itemsize]
        storage = region.view(dtype).view(shape)
        storage.copy_(torch.randn(shape))
        if token_major:
            self.k_cache, self.v_cache = storage.permute(0, 1, 3, 2, 4).unbind(0)
        else:
            self.k_cache, self.v_cache = storage.unbind(0)
        self.kv_bytes = storage.numel() * storage.element_size()
        perm = torch.randperm(num_blocks, dtype=torch.int32)
        if contiguous:  # each sequence's blocks one run, in order
            perm = torch.arange(num_blocks, dtype=torch.int32)
        self.block_tables = perm.view(num_seqs, blocks_per_seq)
        self.block_tables[:, :shared_blocks] = self.block_tables[0, :shared_blocks].clone()
        self.seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
        self.query_start_loc = torch.arange(0, num_seqs * q_len + 1, q_len, dtype=torch.int32)
        self.q = torch.randn(num_seqs * q_len, NUM_Q_HEADS, HEAD_DIM).to(dtype)
        self.out = torch.empty_like(self.q)
        self.shape = (num_seqs, seq_len, q_len)
        self.q_sdpa = self.q.view(num_seqs, q_len, NUM_Q_HEADS, HEAD_DIM).transpose(1, 2)
        context = seq_len - q_len
        self.visible = torch.arange(seq_len) <= torch.arange(context, seq_len)[:, None]
        self.keys, self.values = self.gather()

    def paged(self) -> None:
        paged_attention(
            self.out, self.q, self.k_cache, self.v_cache, self.block_tables,
            self.seq_lens, self.query_start_loc, HEAD_DIM**-0.5,
        )  # fmt: skip

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as contiguous ``[num_seqs, kv_heads, seq_len, head_dim]``."""
        num_seqs, seq_len, _ = self.shape
        index = self.block_tables.long()

        def one(cache: torch.Tensor) -> torch.Tensor:
            blocks = cache[index].transpose(1, 2)  # [seqs, heads, blocks, block_size, dim]
            return blocks.reshape(num_seqs, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :seq_len]

        return one(self.k_cache), one(self.v_cache)

    def sdpa(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        mask = self.visible if self.shape[2] > 1 else None
        return F.scaled_dot_product_attention(
            self.q_sdpa, keys, values, attn_mask=mask, enable_gqa=True
        )

    def sdpa_contiguous(self) -> torch.Tensor:
        return self.sdpa(self.keys, self.values)

    def gather_then_sdpa(self) -> torch.Tensor:
        return self.sdpa(*self.gather())


def bench_decode(reps: int, contexts: list[int], dtypes: list[torch.dtype]) -> None:
    for dtype in dtypes:
        for context in contexts:
            batch = PagedBatch(NUM_SEQS, context, 1, 16, dtype)
            t = race(
                {
                    "paged": batch.paged,
                    "sdpa_contiguous": batch.sdpa_contiguous,
                    "gather_then_sdpa": batch.gather_then_sdpa,
                },
                reps,
            )
            emit(
                bench="decode",
                dtype=str(dtype).removeprefix("torch."),
                num_seqs=NUM_SEQS,
                context=context,
                block_size=16,
                ms={k: round(v * 1e3, 3) for k, v in t.items()},
                paged_over_sdpa=round(t["paged"] / t["sdpa_contiguous"], 3),
                gather_sdpa_over_paged=round(t["gather_then_sdpa"] / t["paged"], 2),
                paged_kv_gb_s=round(batch.kv_bytes / t["paged"] / 1e9, 2),
                sdpa_kv_gb_s=round(batch.kv_bytes / t["sdpa_contiguous"] / 1e9, 2),
            )


def bench_decode_cold(reps: int, contexts: list[int], layers: int = 30) -> None:
    """Decode as an engine step meets it: one batch per layer, each read once per step,
    so no layer finds its K/V in a cache the step before left warm."""
    for dtype in (torch.float32, torch.bfloat16):
        for context in contexts:
            stack = [PagedBatch(NUM_SEQS, context, 1, 16, dtype) for _ in range(layers)]

            def step(stack: list[PagedBatch] = stack) -> None:
                for batch in stack:
                    batch.paged()

            seconds = race({"step": step}, reps)["step"]
            emit(
                bench="decode_cold",
                dtype=str(dtype).removeprefix("torch."),
                num_seqs=NUM_SEQS,
                context=context,
                layers=layers,
                ms_per_layer=round(seconds / layers * 1e3, 3),
                kv_gb_s=round(layers * stack[0].kv_bytes / seconds / 1e9, 2),
            )


def bench_contiguous_runs(reps: int, block_sizes: list[int], contexts: list[int]) -> None:
    """Cold decode (30 layers in turn, as :func:`bench_decode_cold`) with each sequence's
    blocks scattered over the pool against the same blocks as one contiguous run: what
    allocating contiguous runs would buy the kernel."""
    for dtype in (torch.float32, torch.bfloat16):
        for block_size in block_sizes:
            for context in contexts:
                steps = {}
                for layout in ("scattered", "contiguous"):
                    stack = [
                        PagedBatch(NUM_SEQS, context, 1, block_size, dtype,
                                   contiguous=layout == "contiguous")  # fmt: skip
                        for _ in range(30)
                    ]
                    steps[layout] = lambda stack=stack: [batch.paged() for batch in stack]
                t = race(steps, reps)
                emit(
                    bench="decode_contiguous_runs",
                    dtype=str(dtype).removeprefix("torch."),
                    block_size=block_size,
                    context=context,
                    scattered_ms_per_layer=round(t["scattered"] / 30 * 1e3, 3),
                    contiguous_ms_per_layer=round(t["contiguous"] / 30 * 1e3, 3),
                    scattered_over_contiguous=round(t["scattered"] / t["contiguous"], 3),
                )


def bench_block_sizes(reps: int, block_sizes: list[int], context: int) -> None:
    """Decode time per block size, and the token-major layout at the same block sizes."""
    for dtype in (torch.float32, torch.bfloat16):
        candidates, sizes = {}, {}
        for block_size in block_sizes:
            for token_major in (False, True):
                batch = PagedBatch(NUM_SEQS, context, 1, block_size, dtype, token_major)
                name = f"{'token' if token_major else 'head'}_major_{block_size}"
                candidates[name] = batch.paged
                sizes[name] = batch.kv_bytes
        t = race(candidates, reps)
        for block_size in block_sizes:
            head, token = t[f"head_major_{block_size}"], t[f"token_major_{block_size}"]
            emit(
                bench="decode_block_size",
                dtype=str(dtype).removeprefix("torch."),
                context=context,
                block_size=block_size,
                head_major_ms=round(head * 1e3, 3),
                token_major_ms=round(token * 1e3, 3),
                head_major_kv_gb_s=round(sizes[f"head_major_{block_size}"] / head / 1e9, 2),
            )


def prefill_flops(chunk: int, context: int) -> float:
    """Floating-point operations of one sequence's ``chunk`` new tokens attending causally
    after ``context`` cached ones (QK^T and PV, every query head)."""
    return 4 * chunk * NUM_Q_HEADS * HEAD_DIM * (context + (chunk + 1) / 2)


def bench_prefill(reps: int, chunk: int, context: int) -> None:
    """One sequence: ``chunk`` new tokens after ``context`` cached ones."""
    for dtype in (torch.float32, torch.bfloat16):
        batch = PagedBatch(1, context + chunk, chunk, 16, dtype)
        t = race({"paged": batch.paged, "sdpa_contiguous": batch.sdpa_contiguous}, reps)
        flops = prefill_flops(chunk, context)
        emit(
            bench="prefill",
            dtype=str(dtype).removeprefix("torch."),
            chunk=chunk,
            context=context,
            block_size=16,
            ms={k: round(v * 1e3, 3) for k, v in t.items()},
            paged_over_sdpa=round(t["paged"] / t["sdpa_contiguous"], 3),
            paged_gflops=round(flops / t["paged"] / 1e9, 1),
        )


def bench_prefill_shared(
    reps: int, num_seqs: int = 12, chunk: int = 80, prefix: int = 1024
) -> None:
    """``num_seqs`` sequences of ``chunk`` new tokens each after one ``prefix``-token
    prefix in shared blocks, as a step of ``vllm_cpu.py --workload shared-prefix`` runs
    them: the paged kernel's time and arithmetic rate (the shared K/V stay in cache, so
    this is the kernel's compute, not memory, speed)."""
    for dtype in (torch.float32, torch.bfloat16):
        batch = PagedBatch(num_seqs, prefix + chunk, chunk, 16, dtype, shared_blocks=prefix // 16)
        t = race({"paged": batch.paged}, reps)["paged"]
        flops = num_seqs * prefill_flops(chunk, prefix)
        emit(
            bench="prefill_shared",
            dtype=str(dtype).removeprefix("torch."),
            num_seqs=num_seqs,
            chunk=chunk,
            prefix=prefix,
            ms=round(t * 1e3, 3),
            paged_gflops=round(flops / t / 1e9, 1),
        )


def bench_prefill_choice() -> None:
    """What ``attention_kernel="auto"`` measures for this head layout: the least time of
    the paged kernel and of gather-then-SDPA per chunk size, and the crossover it picks."""
    for dtype in (torch.float32, torch.bfloat16):
        timings = time_prefill((dtype, NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, 16))
        emit(
            bench="prefill_choice",
            dtype=str(dtype).removeprefix("torch."),
            context=CONTEXT,
            total_rows=TOTAL_ROWS,
            ms={k: {rows: round(s * 1e3, 3) for rows, s in t.items()} for k, t in timings.items()},
            sdpa_over_paged={
                rows: round(timings["sdpa"][rows] / timings["paged"][rows], 3)
                for rows in ROW_BUCKETS
            },
            sdpa_min_rows=crossover(timings),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9, help="timed calls per candidate")
    parser.add_argument("--quick", action="store_true", help="decode targets only")
    parser.add_argument(
        "--contiguous-runs", action="store_true", help="only scattered against contiguous blocks"
    )
    parser.add_argument(
        "--fresh-build", action="store_true", help="compile the extension in an empty cache"
    )
    args = parser.parse_args()
    if args.fresh_build:
        os.environ["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="pagedllm_ext_")
    start = time.perf_counter()
    ops()
    emit(
        bench="machine",
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        extension_load_s=round(time.perf_counter() - start, 2),
        fresh_build=args.fresh_build,
        **{k: round(v, 1) for k, v in memory_bandwidth(args.reps).items()},
    )
    if args.contiguous_runs:
        return bench_contiguous_runs(args.reps, [8, 16], [256, 1024])
    bench_decode(args.reps, [512, 2048], [torch.float32, torch.bfloat16])
    bench_decode_cold(args.reps, [128, 384, 1024])
    if args.quick:
        return
    bench_prefill(args.reps, chunk=256, context=2048)
    bench_prefill_shared(args.reps)
    bench_prefill_choice()
    bench_block_sizes(args.reps, [8, 16, 32, 64, 128, 256], context=2048)
    bench_contiguous_runs(args.reps, [8, 16], [256, 1024])


if __name__ == "__main__":
    with torch.inference_mode():
        main()
