"""Rounds of side-by-side configurations, as the benchmark scripts run them: each round
rotates the order (so drift over time falls on every configuration alike), and the
summary takes medians over rounds."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def rotation(configs: Sequence[str], round_index: int) -> list[str]:
    """``configs`` in the order round ``round_index`` runs them."""
    start = round_index % len(configs)
    return [*configs[start:], *configs[:start]]


def median_record(rows: Sequence[dict]) -> dict:
    """Each numeric field's median over ``rows`` (one per round, same fields)."""
    return {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def median_ratio(rows: Sequence[dict], base: Sequence[dict], key: str) -> float:
    """The median over rounds of ``rows[i][key] / base[i][key]`` (same round's runs)."""
    return statistics.median(row[key] / b[key] for row, b in zip(rows, base, strict=True))
