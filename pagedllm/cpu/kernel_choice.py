"""Which kernel multiplies each weight matrix on the CPU: by capability, then measurement.

Candidates, in order of preference: ``packed`` (the weight packed into panels for
``packed_linear``, where the AVX-512 kernels take it), ``onednn`` (torch's oneDNN on the
weight reordered into its blocked layout, :mod:`pagedllm.cpu.onednn`, where oneDNN takes
the dtype and the weight's rows are not also read as an embedding; bfloat16 on AMX tiles
where the CPU has them) and ``dense`` (``F.linear`` on the plain ``[out, in]`` matrix:
torch's GEMM as it is, which repacks the matrix at each call, yet on a 2-core Zen 5
beat the blocked layout in one of two runs at 14,336 inputs in bfloat16). A weight is
kept in one form only, so one kernel serves every batch size, and is timed in that
form. With
``linear_kernel="auto"``, each (dtype, out_features, in_features) has its candidates
timed once, on that weight, and the winner is the one of least score (see
:func:`winner` for the margin the preferred ``packed`` gets)

    score = sum over buckets b of BUCKETS[b] * (seconds of one b-row product),

``BUCKETS = {1: 16, 16: 4, 128: 2, 512: 1}``: per 512-row prefill chunk, two 128-row
mixed steps, four 16-row steps of a decoding crowd and sixteen single-row steps of a
request decoding alone. Decode steps weigh more than their rows (a reply's tokens come
one step each) but not one weight per row, which would let microsecond-long single rows
decide alone. Each timing is the least of ``REPEATS`` calls or more after one warm-up,
the candidates interleaved: not their median, since on a CPU shared with other machines
a burst of theirs can stall a whole bucket's calls (8 ms for a 20 µs call, measured on
the 2 shared cores of a Zen 4 VM), while it only ever adds time. A call above
``MAX_MULTIPLY_ADDS`` times a slice of the weight's rows (whole panels) and scales it by
``out_features / rows timed``: the product is then bound by arithmetic, linear in the
output features. The default model (5 shapes) times in 1-2 s on 2 cores.

Timings taken while other processes kept busy the cores torch's threads need
(:func:`other_cores` above ``os.cpu_count() - torch threads + CONTENDED_CORES``) are not
trusted: such a shape keeps the preferred kernel, its timings are not cached (the next
start times it again; this one does not), and one warning says so. On 2 cores shared
with a busy process, every parallel call waits for a scheduler tick (4-8 ms), which no
repetition averages away and which says nothing about the kernels.

Timings are cached as JSON in ``$XDG_CACHE_HOME/pagedllm`` (else ``~/.cache/pagedllm``),
one file per :func:`machine_key` (CPU model, its matrix-relevant flags, torch's version
and thread count, the C++ kernels' digest), so a shape is timed once per CPU model and
library version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedllm import user_cache
from pagedllm.choice import Choice, parse_choice
from pagedllm.cpu.cpuinfo import busy_cpu_seconds, cpu_flags, cpu_model
from pagedllm.cpu.extension import PANEL_WIDTH, pack_weight, packed_linear, sources_digest
from pagedllm.cpu.onednn import onednn_linear, reorder
from pagedllm.kv.capacity import cdiv


class LinearKernel(Choice):
    """``linear_kernel`` values: measure, or force one form for every float weight.
    The forced ones also name the kernels in timing tables."""

    AUTO = "auto"
    PACKED = "packed"
    ONEDNN = "onednn"
    DENSE = "dense"


BUCKETS = {1: 16, 16: 4, 128: 2, 512: 1}
"""Rows of a timed product -> its weight in a shape's score."""

REPEATS = 3
"""Timed calls of each kernel per bucket, at least (after one warm-up call)."""

BUCKET_SECONDS = 0.02
MAX_ROUNDS = 64
"""Shorter calls repeat until a bucket has taken ``BUCKET_SECONDS``, up to ``MAX_ROUNDS``
calls of each kernel, to outlast the milliseconds another process may take the cores
for."""

MAX_MULTIPLY_ADDS = 1 << 28
"""Multiply-adds of one timed call (about 5-10 ms in float32 on 2 cores) before the
timing moves to a slice of the weight's rows."""

PREFERENCE_MARGIN = 0.9
"""A kernel beats the preferred one (``packed``, whose products are batch invariant:
a row's result does not depend on the other rows) only with a score 10% lower, which
also keeps timing noise from flipping a close call."""

MATRIX_FLAGS = frozenset(
    {"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
     "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16"}
)  # fmt: skip
"""``/proc/cpuinfo`` flags that change which matrix kernel is fastest."""

CONTENDED_CORES = 0.5
"""Cores other processes may keep busy, beyond those torch's threads leave free, before
timings are not trusted (a busy process takes a whole core; ``/proc/stat`` counts in
10 ms ticks, an eighth of a core over one shape's 80 ms of timing at least)."""

Timings = dict[str, dict[int, float]]
"""Kernel -> rows -> seconds of one product."""

logger = logging.getLogger("pagedllm")


def machine_key(buckets: Sequence[int] = tuple(BUCKETS)) -> dict[str, object]:
    """What a timing table holds for: CPU, library versions, threads and ``buckets``
    (``onednn`` names the form its candidate is timed in: tables timed on the plain
    matrix are not read back)."""
    return {
        "cpu": cpu_model(),
        "flags": sorted(cpu_flags() & MATRIX_FLAGS),
        "torch": torch.__version__,
        "kernels": sources_digest(),
        "onednn": "reordered",
        "threads": torch.get_num_threads(),
        "buckets": list(buckets),
    }


def cache_path(key: dict[str, object], kind: str = "linear-kernels") -> Path:
    """The JSON file caching the ``kind`` timings of ``key``."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return user_cache.cache_dir() / f"{kind}-{digest}.json"


def timed_rows(rows: int, out_features: int, in_features: int) -> int:
    """Output features one timed ``rows``-row call multiplies: all, or whole panels that
    keep it within :data:`MAX_MULTIPLY_ADDS`."""
    if rows * out_features * in_features <= MAX_MULTIPLY_ADDS:
        return out_features
    panels = max(1, MAX_MULTIPLY_ADDS // (rows * in_features * PANEL_WIDTH))
    return min(out_features, panels * PANEL_WIDTH)


def cpu_clock() -> tuple[float, float, float] | None:
    """Now: (wall seconds, CPU seconds of every process, CPU seconds of this one); ``None``
    where the system's busy time cannot be read."""
    busy = busy_cpu_seconds()
    return None if busy is None else (time.perf_counter(), busy, time.process_time())


def other_cores(start: tuple[float, float, float], end: tuple[float, float, float]) -> float:
    """Cores that other processes kept busy, on average, between two :func:`cpu_clock`
    readings (to the 10 ms of ``/proc/stat``)."""
    wall, busy, own = (b - a for a, b in zip(start, end, strict=True))
    return (busy - own) / max(wall, 1e-3)


def contended(cores: float) -> bool:
    """Whether other processes busy on ``cores`` took cores from torch's threads."""
    spare = (os.cpu_count() or 1) - torch.get_num_threads()
    return cores > spare + CONTENDED_CORES


def product(kernel: str, x: torch.Tensor, operand: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` times the first ``n`` rows of a weight, transposed, by ``kernel``: ``operand``
    is their panels (``packed``), those rows in oneDNN's layout (``onednn``) or plain
    (``dense``)."""
    if kernel == LinearKernel.PACKED:
        return packed_linear(x, operand, n)
    return onednn_linear(x, operand) if kernel == LinearKernel.ONEDNN else F.linear(x, operand)


def least_seconds(calls: dict[str, Callable[[], object]]) -> dict[str, float]:
    """The least seconds of one call of each of ``calls``, taken in turns after one
    warm-up round: :data:`REPEATS` rounds, more until :data:`BUCKET_SECONDS` have passed
    (up to :data:`MAX_ROUNDS`)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    rounds = 0  # the first warms up
    while rounds <= REPEATS or (
        time.perf_counter() - start < BUCKET_SECONDS and rounds < MAX_ROUNDS
    ):
        for name, call in calls.items():
            begin = time.perf_counter()
            call()
            samples[name].append(time.perf_counter() - begin)
        rounds += 1
    return {name: min(seconds[1:]) for name, seconds in samples.items()}


def time_kernels(weight: torch.Tensor, kernels: Sequence[str]) -> Timings:
    """Seconds of one product by each of ``kernels`` with contiguous ``weight``
    ``[out, in]``, per :data:`BUCKETS` row count (see the module's docstring)."""
    out_features, in_features = weight.shape
    panels = pack_weight(weight) if LinearKernel.PACKED in kernels else None
    timings: Timings = {kernel: {} for kernel in kernels}
    with torch.inference_mode():
        for rows in BUCKETS:
            n = timed_rows(rows, out_features, in_features)
            x = torch.randn(rows, in_features, dtype=weight.dtype)
            operands = {LinearKernel.DENSE: weight[:n]}
            if LinearKernel.ONEDNN in kernels:
                operands[LinearKernel.ONEDNN] = reorder(weight[:n])
            if panels is not None:
                operands[LinearKernel.PACKED] = panels[: cdiv(n, PANEL_WIDTH)]
            least = least_seconds({k: partial(product, k, x, operands[k], n) for k in kernels})
            for kernel in kernels:
                timings[kernel][rows] = least[kernel] * out_features / n
    return timings


def score(per_rows: dict[int, float]) -> float:
    """A kernel's weighted seconds over :data:`BUCKETS` (lower is faster)."""
    return sum(weight * per_rows[rows] for rows, weight in BUCKETS.items())


def winner(timings: Timings) -> str:
    """The first kernel of ``timings`` (the preferred), unless another's :func:`score` is
    below ``PREFERENCE_MARGIN`` times the best so far."""
    best = next(iter(timings))
    for kernel in timings:
        if score(timings[kernel]) < PREFERENCE_MARGIN * score(timings[best]):
            best = kernel
    return best


class TimingTable:
    """The cached timings of one machine key, entry by entry (a weight shape, a head
    layout); an entry is timed on first use and the file rewritten (atomically:
    concurrent engines never read half a file). ``kind`` names the file, ``subject``
    what is timed, in the warnings."""

    def __init__(
        self,
        key: dict[str, object] | None = None,
        kind: str = "linear-kernels",
        subject: str = "matrix kernel",
    ) -> None:
        self.key = key or machine_key()
        self.path = cache_path(self.key, kind)
        self.subject = subject
        self.entries: dict[str, Timings] = {}
        self.seconds_timing = 0.0
        self.entries_timed = 0
        self.contended_entries: set[str] = set()  # not trusted, not timed again
        with contextlib.suppress(OSError, ValueError):
            stored = json.loads(self.path.read_text())
            if stored.get("key") == self.key:
                self.entries = {
                    shape: {k: {int(r): s for r, s in t.items()} for k, t in kernels.items()}
                    for shape, kernels in stored["timings"].items()
                }

    def timings(
        self, entry: str, kernels: Sequence[str], measure: Callable[[], Timings]
    ) -> Timings | None:
        """Timings of ``kernels`` for ``entry``, cached or taken by ``measure``; ``None``
        when measured under contention (see the module's docstring)."""
        known = self.entries.get(entry, {})
        if entry in self.contended_entries:
            return None
        buckets = set(self.key["buckets"])
        if all(set(known.get(kernel, ())) == buckets for kernel in kernels):
            return {kernel: known[kernel] for kernel in kernels}
        begin, start = time.perf_counter(), cpu_clock()
        measured = measure()
        end = cpu_clock()
        self.seconds_timing += time.perf_counter() - begin
        self.entries_timed += 1
        others = other_cores(start, end) if start and end else 0.0
        if contended(others):
            if not self.contended_entries:
                logger.warning(
                    "Other processes kept %.1f cores busy while the %ss were timed; "
                    "what was timed so keeps the preferred kernel and is not cached "
                    "(timed again at the next start)",
                    others,
                    self.subject,
                )
            self.contended_entries.add(entry)
            return None
        self.entries[entry] = {**known, **measured}
        self.save()
        return {kernel: self.entries[entry][kernel] for kernel in kernels}

    def save(self) -> None:
        """Writes the table; a cache that cannot be written only costs timing again."""
        text = json.dumps({"key": self.key, "timings": self.entries}, indent=1)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            pending = self.path.with_suffix(f".{os.getpid()}.tmp")
            pending.write_text(text)
            pending.replace(self.path)
        except OSError as error:
            logger.warning("Cannot cache %s timings at %s: %s", self.subject, self.path, error)


def shape_entry(weight: torch.Tensor) -> str:
    """A weight's entry in the timing table: its dtype and shape."""
    return f"{str(weight.dtype).removeprefix('torch.')} {weight.shape[0]}x{weight.shape[1]}"


class KernelChoice:
    """The kernel for each float weight of one model on the CPU, for a ``linear_kernel``
    of :class:`LinearKernel`; it counts its choices for one summary line.
    ``activations``: the model's dtype, when known (quantized weights are interleaved for
    bfloat16 ones). ``expansion_budget``: bytes left for expanded copies of GGUF block
    weights (:mod:`pagedllm.models.block_expansion`), which records in
    ``expansions`` each such weight's entry and ``min_rows`` (``None``: blocks alone)."""

    def __init__(
        self,
        requested: str = "auto",
        activations: torch.dtype | None = None,
        expansion_budget: int = 0,
    ) -> None:
        self.requested = parse_choice(LinearKernel, requested, "linear_kernel")
        self.activations = activations
        self.table: TimingTable | None = None
        self.shapes: dict[tuple[torch.dtype, int, int], str] = {}
        self.expansion_budget = expansion_budget
        self.expansion_table: TimingTable | None = None
        self.expansions: list[tuple[str, int | None]] = []

    def note_expansion(self, entry: str, min_rows: int | None) -> None:
        """Records whether the block weight ``entry`` got an expanded copy, for calls of
        ``min_rows`` rows or more."""
        self.expansions.append((entry, min_rows))

    def choose(self, weight: torch.Tensor, kernels: Sequence[str]) -> str:
        """The kernel of ``kernels`` (those able to run ``weight``, in order of preference)
        that runs ``weight``: the forced one, the only one, or the measured winner. A
        forced ``onednn`` runs a weight oneDNN cannot take in its layout ``dense``."""
        if self.requested is not LinearKernel.AUTO:
            kernel = self.requested.value
            if kernel == LinearKernel.ONEDNN and kernel not in kernels:
                kernel = LinearKernel.DENSE.value
            if kernel not in kernels:
                raise ValueError(
                    f"linear_kernel={self.requested!r} cannot run a {weight.dtype} weight on "
                    f"{weight.device.type} (it can: {', '.join(kernels)})"
                )
        elif len(kernels) == 1:
            kernel = kernels[0]
        else:
            self.table = self.table or TimingTable()
            timings = self.table.timings(
                shape_entry(weight), kernels, lambda: time_kernels(weight, kernels)
            )
            kernel = kernels[0] if timings is None else winner(timings)
        if weight.device.type == "cpu":
            self.shapes[(weight.dtype, *weight.shape)] = kernel
        return kernel

    def summary(self) -> str | None:
        """One line: which kernel runs how many shapes, and where timings came from;
        ``None`` when no CPU weight was chosen for."""
        if not self.shapes:
            return None
        counts = Counter(self.shapes.values())
        kernels = ", ".join(
            f"{kernel} for {n} shape{'s' * (n != 1)}" for kernel, n in counts.most_common()
        )
        if self.table is None:
            return f"Matrix kernels (linear_kernel={self.requested}): {kernels}"
        table, timed = self.table, ""
        if table.entries_timed:
            timed = f"; timed {table.entries_timed} shapes in {table.seconds_timing:.2f} s"
        if table.contended_entries:
            timed += f", {len(table.contended_entries)} under contention (preferred kernel)"
        return (
            f"Matrix kernels (timed on {table.key['cpu']}, cached at {table.path}"
            f"{timed}): {kernels}"
        )

    def expansion_summary(self) -> str | None:
        """One line: which GGUF block weights got expanded copies and from how many rows
        those multiply; ``None`` when no block weight was considered."""
        if not self.expansions:
            return None
        counts = Counter(self.expansions)
        parts = [
            f"{n} x {entry} " + ("in blocks alone" if rows is None else f"from {rows} rows")
            for (entry, rows), n in counts.items()
        ]
        table, where = self.expansion_table, ""
        if table is not None:
            where = f" (timed on {table.key['cpu']}, cached at {table.path}"
            if table.entries_timed:
                where += f"; timed {table.entries_timed} in {table.seconds_timing:.2f} s"
            where += ")"
        return (
            f"GGUF block weights with an expanded copy for calls of many rows{where}: "
            + "; ".join(parts)
            + f"; {self.expansion_budget / 1e6:.0f} MB of the budget left"
        )
