"""How many tokens to guess this step: the count that the measurements say gives the
most output tokens per second, down to none.

Two measurements, both kept as exponentially decaying sums so they follow the load:

- acceptance ``a``: the share of guessed tokens the model accepted (each accepted only if
  those before it were). A sequence guessing ``k`` tokens then emits on average
  ``1 + a + a^2 + ... + a^k`` tokens per step instead of 1.
- step cost: the seconds of a whole step as a straight line in its batched tokens,
  ``t(T) = fixed + per_token * T``, fitted by least squares over recent steps. On a CPU
  decoding a few sequences, ``fixed`` (reading the weights once) dominates and guesses
  are nearly free; with many sequences a step costs about its tokens and guesses only
  pay when nearly all are accepted.

For each ``k`` the rule compares (tokens emitted by the batch) / t(batched tokens with
the guesses) and takes the best, requiring ``MIN_GAIN`` over guessing nothing. Until
the fit has seen steps of different sizes (and once every ``EXPLORE_EVERY`` steps that
chose none), it guesses fully, so the measurements cover the sizes it chooses among
and the acceptance keeps being measured.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_GAIN = 1.03
"""A guess length must promise at least this much more throughput than none."""

EXPLORE_EVERY = 64
"""After this many steps without guesses, one step guesses fully to re-measure."""

DECAY = 0.98
"""Weight kept by past observations at each new one (about 50 observations' memory)."""

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 8.0
"""The acceptance estimate starts as ``PRIOR_ACCEPTANCE`` worth this many tokens."""


class DraftLengthPolicy:
    """Chooses the step's guess length from the proposals' lengths and the measurements.

    Units: tokens and seconds. Not thread-safe (the engine's step loop owns it)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._drafted = PRIOR_WEIGHT
        self._accepted = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
        # decayed sums for the least-squares line t = fixed + per_token * T
        self._w = self._t = self._tt = self._y = self._ty = 0.0
        self._steps_without = 0

    @property
    def acceptance(self) -> float:
        """The measured share of guessed tokens accepted (0..1)."""
        return self._accepted / self._drafted

    def observe_acceptance(self, num_drafted: int, num_accepted: int) -> None:
        """A step verified ``num_drafted`` guessed tokens; ``num_accepted`` were kept."""
        if num_drafted:
            scale = DECAY**num_drafted
            self._drafted = self._drafted * scale + num_drafted
            self._accepted = self._accepted * scale + num_accepted

    def observe_step(self, num_batched_tokens: int, seconds: float) -> None:
        """A whole step of ``num_batched_tokens`` tokens took ``seconds``."""
        d, tokens = DECAY, float(num_batched_tokens)
        self._w = self._w * d + 1.0
        self._t = self._t * d + tokens
        self._tt = self._tt * d + tokens * tokens
        self._y = self._y * d + seconds
        self._ty = self._ty * d + tokens * seconds

    def step_cost(self, num_batched_tokens: int) -> float | None:
        """The fitted seconds of a step of ``num_batched_tokens`` tokens; None until
        steps of different sizes were seen."""
        spread = self._w * self._tt - self._t * self._t
        if self._w == 0 or spread <= 1e-9 * max(1.0, self._w * self._tt):
            return None
        per_token = max(0.0, (self._w * self._ty - self._t * self._y) / spread)
        fixed = max(0.0, (self._y - per_token * self._t) / self._w)
        return fixed + per_token * num_batched_tokens

    def choose(
        self, proposal_lengths: Sequence[int], num_batched_tokens: int, num_emitting: int
    ) -> int:
        """The guess length for this step: at most ``max_tokens``; a sequence whose
        proposal is shorter guesses its whole proposal. ``proposal_lengths``: per
        decoding sequence with a proposal; ``num_batched_tokens``: the step's tokens
        without guesses (one per decoding sequence, plus prefill chunks);
        ``num_emitting``: the sequences that get a token from it without guesses."""
        longest = min(self.max_tokens, max(proposal_lengths, default=0))
        if longest == 0:
            return 0
        base_cost = self.step_cost(num_batched_tokens)
        if base_cost is None:
            return longest
        a = min(self.acceptance, 0.999)
        best, best_rate = 0, num_emitting / base_cost
        floor = best_rate * MIN_GAIN
        for k in range(1, longest + 1):
            extra = sum(min(k, length) for length in proposal_lengths)
            gained = sum(a * (1 - a ** min(k, length)) / (1 - a) for length in proposal_lengths)
            rate = (num_emitting + gained) / self.step_cost(num_batched_tokens + extra)
            if rate >= floor and rate > best_rate:
                best, best_rate = k, rate
        if best == 0:
            self._steps_without += 1
            if self._steps_without >= EXPLORE_EVERY:
                self._steps_without = 0
                return longest
        else:
            self._steps_without = 0
        return best
