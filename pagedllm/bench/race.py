"""Side-by-side timing of candidates in turns, for the kernel benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def race(candidates: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each candidate, timed in turns after one warm-up."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()
    for _ in range(reps):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}
