"""How likely a draft model's guess is to be kept, given the draft's confidence in it.

The confidence of a guess is the draft's probability of its most likely token at that
position (for a sampled sequence, of its tempered, truncated distribution). A draft that
is sure is usually right: on the default model rounded to Q4_0, guesses made with
confidence >= 0.9 are kept 99% of the time and those under 0.3 about half the time.
:class:`GuessCalibration` learns that relation from the verifications, in
``NUM_BINS`` equal bins of confidence, each an exponentially decayed count of kept and
tried guesses that starts from a weak prior at the overall rate.

Units: probabilities in 0..1.
"""

from __future__ import annotations

from collections.abc import Sequence

NUM_BINS = 10
"""Equal-width bins of confidence over 0..1."""

DECAY = 0.995
"""Weight a bin's past observations keep at each new one in it (about 200 guesses'
memory: bins see a share of all guesses each)."""

PRIOR_WEIGHT = 2.0
"""Trials' worth of the overall acceptance a bin starts with."""


class GuessCalibration:
    """The chance that a guess is kept given that the guesses before it were, as a
    function of the draft's confidence in it. Not thread-safe (the step loop owns it)."""

    def __init__(self, prior_acceptance: float = 0.5) -> None:
        self._kept = [PRIOR_WEIGHT * prior_acceptance] * NUM_BINS
        self._tried = [PRIOR_WEIGHT] * NUM_BINS

    @staticmethod
    def _bin(confidence: float) -> int:
        return min(NUM_BINS - 1, max(0, int(confidence * NUM_BINS)))

    def chance_kept(self, confidence: float) -> float:
        """The estimated chance (0..1) that a guess of this confidence is kept."""
        b = self._bin(confidence)
        return self._kept[b] / self._tried[b]

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """A sequence's guesses, made with ``confidences``, were verified and the first
        ``num_accepted`` kept: each kept guess counts as kept in its bin, the first
        rejected one as rejected, and those after it are not counted (they were judged
        after a wrong token, not on their own)."""
        for position, confidence in enumerate(confidences[: num_accepted + 1]):
            b = self._bin(confidence)
            self._kept[b] = self._kept[b] * DECAY + (position < num_accepted)
            self._tried[b] = self._tried[b] * DECAY + 1.0
