"""Acceptance counters of speculative decoding, under vLLM's meanings.

- a *draft* is one sequence's guesses verified in one step (at least one token);
- ``num_draft_tokens``: guessed tokens verified; ``num_accepted_tokens``: those kept;
- ``accepted_per_position[i]``: drafts whose guess at position ``i`` (0-based) was
  kept, so ``accepted_per_position[i] / num_drafts`` is the acceptance at that depth.

Counted since start-up; tokens a stop condition discarded after acceptance still count
as accepted (the model agreed with them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """Cumulative counters (tokens and drafts)."""

    max_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.accepted_per_position:
            self.accepted_per_position = [0] * self.max_tokens

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's draft of ``num_drafted`` tokens, ``num_accepted`` kept."""
        if num_drafted == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted share of the guessed tokens (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a drafting sequence emitted per step on average: its accepted guesses
        plus the model's own token (1 before any draft)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(
            self.max_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.accepted_per_position),
        )
