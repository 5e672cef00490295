"""How far greedy outputs agree with a reference's, token by token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Agreement:
    """``equal``: positions with the reference's token, of ``total``; ``first_differences``:
    per output, the position of its first other token (its length when none)."""

    equal: int
    total: int
    first_differences: list[int]

    @property
    def equal_share(self) -> float:
        return self.equal / self.total if self.total else 1.0


def agreement(reference: Sequence[Sequence[int]], outputs: Sequence[Sequence[int]]) -> Agreement:
    """Outputs against the reference's, pairwise; outputs of equal lengths."""
    first_differences, equal, total = [], 0, 0
    for want, have in zip(reference, outputs, strict=True):
        same = [a == b for a, b in zip(want, have, strict=True)]
        equal += sum(same)
        total += len(same)
        first_differences.append(same.index(False) if False in same else len(same))
    return Agreement(equal, total, first_differences)
