"""``block_size="auto"``: the block size chosen at start-up from how fast the attention
kernel reads each candidate size on this machine and how long the recent requests were.

The block size trades a sequence's internal waste (its last block's empty slots: about
half a block while it grows), the prefix cache's granularity (only full blocks are
shared), the kernel's contiguous reads and the tables' length. Two measurements decide:

- **Speed.** The paged kernel's decode over :data:`TIMED_SEQUENCES` sequences of the
  workload's typical context (its mean final length rounded up to a power of two, 128 to
  8,192 tokens), their blocks scattered, in the model's head layout and dtype, at each of
  :data:`CANDIDATES`; timed once per machine and cached like the matrix kernels' choice
  (:mod:`pagedllm.cpu.kernel_choice`).
- **Waste.** The recorded requests' (prompt, output) lengths: each request holds, at every
  step from its prompt to its last token, ``-length mod block_size`` empty slots;
  :func:`expected_waste` is their mean. The server records the lengths of the requests it
  finishes in the user's cache directory, per model (:class:`RequestLengthLog`); a trace
  in the same format can be given instead (``block_size_workload``).

The choice: among the candidates whose timed decode is within :data:`SPEED_MARGIN` of the
fastest, the one of least expected waste (the larger on a tie). With no recorded lengths
it keeps :data:`FALLBACK` and says why; so it does off the CPU, where the kernel timed
here is not the one that runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedllm import user_cache
from pagedllm.cpu.extension import paged_attention
from pagedllm.cpu.kernel_choice import Timings, TimingTable, least_seconds, machine_key
from pagedllm.kv.capacity import cdiv

CANDIDATES = (8, 16, 32)
"""Block sizes ``auto`` chooses among (tokens)."""

FALLBACK = 16
"""The block size without lengths to weigh (vLLM's default too)."""

SPEED_MARGIN = 1.03
"""A candidate is as fast as the fastest when its timed decode takes at most this much
longer."""

TIMED_SEQUENCES = 16
"""Sequences of one timed decode call."""

MAX_RECORDED = 4096
"""Requests a length log keeps (the newest)."""

logger = logging.getLogger("pagedllm")


@dataclass(frozen=True)
class RequestLengths:
    """One finished request's prompt and output lengths (tokens)."""

    prompt: int
    output: int


def slack_sum(first: int, last: int, block_size: int) -> int:
    """Sum over lengths ``first..last`` (inclusive) of ``-length mod block_size``: the
    empty slots of a sequence's last block, step after step."""
    count = last - first + 1
    if count <= 0:
        return 0
    cycles, rest = divmod(count, block_size)
    total = cycles * block_size * (block_size - 1) // 2
    return total + sum(-length % block_size for length in range(first, first + rest))


def expected_waste(lengths: Sequence[RequestLengths], block_size: int) -> float:
    """Mean empty slots a running sequence's table holds, over every step of every
    request: after its prompt, and after each output token but the last."""
    steps = sum(max(1, r.output) for r in lengths)
    slack = sum(slack_sum(r.prompt, r.prompt + max(1, r.output) - 1, block_size) for r in lengths)
    return slack / steps


def timed_context(lengths: Sequence[RequestLengths]) -> int:
    """The context a timed decode call runs at: the mean final length, rounded up to a
    power of two from 128 to 8,192 tokens."""
    mean = sum(r.prompt + r.output for r in lengths) / len(lengths)
    context = 128
    while context < mean and context < 8192:
        context *= 2
    return context


def time_block_sizes(
    layout: tuple[torch.dtype, int, int, int], context: int, candidates: Iterable[int]
) -> Timings:
    """Seconds of one decode call of the paged kernel over :data:`TIMED_SEQUENCES`
    sequences of ``context`` tokens in scattered blocks, per block size, for ``layout``
    = (dtype, query heads, KV heads, head dim): ``{"decode": {block size: seconds}}``."""
    dtype, num_q_heads, num_kv_heads, head_dim = layout
    calls = {}
    with torch.inference_mode():
        for block_size in candidates:
            blocks_per_seq = cdiv(context, block_size)
            num_blocks = TIMED_SEQUENCES * blocks_per_seq
            shape = (num_blocks, num_kv_heads, block_size, head_dim)
            keys, values = torch.randn(2, *shape).to(dtype).unbind(0)
            tables = torch.randperm(num_blocks, dtype=torch.int32).view(TIMED_SEQUENCES, -1)
            seq_lens = torch.full((TIMED_SEQUENCES,), context, dtype=torch.int32)
            starts = torch.arange(TIMED_SEQUENCES + 1, dtype=torch.int32)
            q = torch.randn(TIMED_SEQUENCES, num_q_heads, head_dim).to(dtype)
            out = torch.empty_like(q)
            arguments = (out, q, keys, values, tables, seq_lens, starts, head_dim**-0.5)
            calls[block_size] = lambda arguments=arguments: paged_attention(*arguments)
        seconds = least_seconds({str(b): call for b, call in calls.items()})
    return {"decode": {int(b): s for b, s in seconds.items()}}


def choose(timings: dict[int, float], lengths: Sequence[RequestLengths]) -> int:
    """The least-waste block size of those timed within :data:`SPEED_MARGIN` of the
    fastest (the larger on a tie)."""
    fastest = min(timings.values())
    fast = [b for b, s in timings.items() if s <= SPEED_MARGIN * fastest]
    return min(fast, key=lambda b: (expected_waste(lengths, b), -b))


def choose_block_size(
    layout: tuple[torch.dtype, int, int, int],
    lengths: Sequence[RequestLengths],
    candidates: Sequence[int] = CANDIDATES,
    on_cpu: bool = True,
) -> tuple[int, str]:
    """The block size for ``block_size="auto"`` and why, in words."""
    if not on_cpu:
        return FALLBACK, "the attention kernel is timed on the CPU only"
    if not lengths:
        return FALLBACK, "no request lengths recorded yet for this model"
    context = timed_context(lengths)
    entry = "{} q{} kv{} d{} ctx{}".format(
        str(layout[0]).removeprefix("torch."), *layout[1:], context
    )
    table = TimingTable(machine_key(CANDIDATES), "block-size", "block size")
    timed = table.timings(entry, ("decode",), lambda: time_block_sizes(layout, context, CANDIDATES))
    if timed is None:
        return FALLBACK, "the kernels were timed under contention"
    timings = {b: s for b, s in timed["decode"].items() if b in candidates}
    chosen = choose(timings, lengths)
    fastest = min(timings.values())
    reasons = ", ".join(
        f"{b}: waste {expected_waste(lengths, b):.1f} slots/sequence, decode "
        f"{timings[b] / fastest:.2f}x the fastest"
        for b in sorted(timings)
    )
    return chosen, (
        f"{len(lengths)} recorded requests, decode timed at {context} tokens of context ({reasons})"
    )


class RequestLengthLog:
    """The lengths of the requests a server finished for one model, appended to a JSON
    lines file in the user's cache directory (the newest :data:`MAX_RECORDED` kept)."""

    def __init__(self, model: str, folder: Path | None = None) -> None:
        digest = hashlib.sha1(model.encode()).hexdigest()[:12]
        self.path = (folder or user_cache.cache_dir()) / f"request-lengths-{digest}.jsonl"
        self._file = None

    def read(self) -> list[RequestLengths]:
        """The recorded lengths, oldest first (none when there is no readable log)."""
        return read_lengths(self.path)[-MAX_RECORDED:]

    def add(self, prompt: int, output: int) -> None:
        """Append one request's lengths; a log that cannot be written is left alone."""
        try:
            if self._file is None:
                self._trim()
                self._file = self.path.open("a")
            self._file.write(json.dumps({"prompt": prompt, "output": output}) + "\n")
            self._file.flush()
        except OSError as error:
            logger.warning("Cannot record request lengths at %s: %s", self.path, error)
            self._file = None

    def _trim(self) -> None:
        """Keep the newest :data:`MAX_RECORDED` entries once the log holds twice that."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = read_lengths(self.path)
        if len(kept) > 2 * MAX_RECORDED:
            pending = self.path.with_suffix(f".{os.getpid()}.tmp")
            lines = [json.dumps({"prompt": r.prompt, "output": r.output}) for r in kept]
            pending.write_text("\n".join(lines[-MAX_RECORDED:]) + "\n")
            pending.replace(self.path)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_lengths(path: Path) -> list[RequestLengths]:
    """The ``{"prompt": n, "output": m}`` lines of ``path`` (unreadable lines skipped; a
    missing file is empty)."""
    lengths = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            entry = json.loads(line)
            lengths.append(RequestLengths(int(entry["prompt"]), int(entry["output"])))
        except (ValueError, KeyError, TypeError):
            continue
    return [r for r in lengths if r.prompt > 0 and r.output >= 0]
