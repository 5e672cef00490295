"""Which kernel attends a long prefill chunk on the CPU: by measurement.

Candidates for a sequence's chunk of query rows: ``paged`` (the C++ kernel reading K/V
through the block table, batch invariant: a row's result does not depend on the other
rows) and ``sdpa`` (the chunk's K/V gathered, then torch's fused SDPA, whose products
run through oneDNN: bfloat16 on AMX tiles where the CPU has them; see
:mod:`pagedllm.attention.sdpa_prefill`). Decode rows and short chunks always run paged.

With ``attention_kernel="auto"``, each (dtype, query heads, KV heads, head dim, block
size) has both candidates timed once per machine (the timing table of
:mod:`pagedllm.cpu.kernel_choice`, cached next to the matrix kernels' and trusted or
not under contention the same way) on chunks of :data:`ROW_BUCKETS` rows after
:data:`CONTEXT` cached tokens, ``TOTAL_ROWS // rows`` sequences per call. SDPA takes the
chunks of at least ``min_rows`` rows: the least bucket from which it beats the paged
kernel by :data:`~pagedllm.cpu.kernel_choice.PREFERENCE_MARGIN` at every larger bucket
(none: everything paged). ``paged`` forces the C++ kernel for every row;
``sdpa`` sends every chunk of at least :data:`FORCED_MIN_ROWS` rows to SDPA.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.paged_backend import sdpa_refusal
from pagedllm.attention.sdpa_prefill import PrefillChunk, attend_chunk
from pagedllm.choice import Choice, parse_choice
from pagedllm.cpu.extension import paged_attention
from pagedllm.cpu.kernel_choice import (
    PREFERENCE_MARGIN,
    Timings,
    TimingTable,
    least_seconds,
    machine_key,
)
from pagedllm.kv.capacity import cdiv
from pagedllm.kv_storage.kv_cache import KVCache


class AttentionKernel(Choice):
    """``attention_kernel`` values: measure, or force one kernel for long prefill
    chunks."""

    AUTO = "auto"
    PAGED = "paged"
    SDPA = "sdpa"

ROW_BUCKETS = (16, 64, 256)
"""Query rows of one sequence's timed chunk."""

TOTAL_ROWS = 256
CONTEXT = 1024
"""A timed call runs ``TOTAL_ROWS // rows`` chunks, each after ``CONTEXT`` cached tokens."""

FORCED_MIN_ROWS = ROW_BUCKETS[0]
"""Rows from which a chunk goes to SDPA under ``attention_kernel="sdpa"``."""

logger = logging.getLogger("pagedllm")


class TimedPrefill:
    """``TOTAL_ROWS // rows`` chunks of ``rows`` query rows after :data:`CONTEXT` cached
    tokens each, in scattered blocks of a random cache, run by either kernel."""

    def __init__(self, rows: int, layout: tuple[torch.dtype, int, int, int, int]) -> None:
        dtype, num_q_heads, num_kv_heads, head_dim, block_size = layout
        num_seqs, seq_len = TOTAL_ROWS // rows, CONTEXT + rows
        blocks_per_seq = cdiv(seq_len, block_size)
        num_blocks = num_seqs * blocks_per_seq
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.keys, self.values = torch.randn(2, *shape).to(dtype).unbind(0)
        self.block_tables = torch.randperm(num_blocks, dtype=torch.int32).view(num_seqs, -1)
        self.seq_lens = torch.full((num_seqs,), seq_len, dtype=torch.int32)
        self.starts = torch.arange(0, num_seqs * rows + 1, rows, dtype=torch.int32)
        self.q = torch.randn(num_seqs * rows, num_q_heads, head_dim).to(dtype)
        self.out = torch.empty_like(self.q)
        self.options = AttentionOptions(scale=head_dim**-0.5)
        self.chunks = [
            PrefillChunk(i * rows, (i + 1) * rows, seq_len, table.long())
            for i, table in enumerate(self.block_tables)
        ]

    def paged(self) -> None:
        paged_attention(
            self.out, self.q, self.keys, self.values, self.block_tables, self.seq_lens,
            self.starts, self.options.scale,
        )  # fmt: skip

    def sdpa(self) -> None:
        for chunk in self.chunks:
            self.out[chunk.start : chunk.end] = attend_chunk(
                self.q, self.keys, self.values, chunk, self.options
            )


def time_prefill(layout: tuple[torch.dtype, int, int, int, int]) -> Timings:
    """Seconds of one call of each kernel per :data:`ROW_BUCKETS` row count, for
    ``layout`` = (dtype, query heads, KV heads, head dim, block size)."""
    timings: Timings = {"paged": {}, "sdpa": {}}
    with torch.inference_mode():
        for rows in ROW_BUCKETS:
            batch = TimedPrefill(rows, layout)
            for kernel, seconds in least_seconds(
                {"paged": batch.paged, "sdpa": batch.sdpa}
            ).items():
                timings[kernel][rows] = seconds
    return timings


def crossover(timings: Timings) -> int | None:
    """The least bucket from which ``sdpa`` beats ``paged`` by the preference margin
    at every larger bucket; ``None`` when it does not at the largest."""
    min_rows = None
    for rows in sorted(timings["paged"], reverse=True):
        if timings["sdpa"][rows] >= PREFERENCE_MARGIN * timings["paged"][rows]:
            break
        min_rows = rows
    return min_rows


def sdpa_min_rows(
    requested: str, kv_cache: KVCache, model_dtype: torch.dtype, num_q_heads: int
) -> int | None:
    """Rows from which a chunk attends through SDPA over ``kv_cache`` (``None``: never),
    for an ``attention_kernel`` (:class:`AttentionKernel`); logs the choice once."""
    requested = parse_choice(AttentionKernel, requested, "attention_kernel")
    if requested is AttentionKernel.PAGED:
        return None
    reason = sdpa_refusal(kv_cache)
    if reason is None and kv_cache.format.dtype != model_dtype:
        reason = f"the KV cache holds {kv_cache.format.name}, the model runs in {model_dtype}"
    if reason is not None:
        if requested is AttentionKernel.SDPA:
            raise ValueError(f"attention_kernel='sdpa' cannot run here: {reason}")
        return None
    if requested is AttentionKernel.SDPA:
        logger.info("Prefill attention (attention_kernel=sdpa): SDPA from %d rows", FORCED_MIN_ROWS)
        return FORCED_MIN_ROWS
    layout = (model_dtype, num_q_heads, kv_cache.num_kv_heads, kv_cache.head_dim,
              kv_cache.block_size)  # fmt: skip
    table = TimingTable(machine_key(ROW_BUCKETS), "attention-kernels", "attention kernel")
    entry = "{} q{} kv{} d{} b{}".format(str(model_dtype).removeprefix("torch."), *layout[1:])
    timings = table.timings(entry, ("paged", "sdpa"), lambda: time_prefill(layout))
    min_rows = None if timings is None else crossover(timings)
    chosen = "paged for every row" if min_rows is None else f"SDPA from {min_rows} rows"
    if timings is None:
        chosen += " (timed under contention, not cached)"
    elif table.entries_timed:
        chosen += f" (timed in {table.seconds_timing:.2f} s)"
    logger.info(
        "Prefill attention (timed on %s, cached at %s): %s", table.key["cpu"], table.path, chosen
    )
    return min_rows
