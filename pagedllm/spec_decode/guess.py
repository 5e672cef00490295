"""What a proposer offers one sequence for the next step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Guess:
    """Tokens guessed to follow a sequence, in order. ``probs`` ``[len(token_ids),
    vocab]`` (float32, each row normalised): the distribution each token was drawn
    from, for rejection sampling; None when they were proposed with certainty (n-grams,
    suffix trees, a draft's argmax)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None

    def truncated(self, length: int) -> Guess:
        """The first ``length`` tokens (and their distributions)."""
        probs = None if self.probs is None else self.probs[:length]
        return Guess(self.token_ids[:length], probs)
