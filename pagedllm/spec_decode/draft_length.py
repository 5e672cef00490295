"""How many tokens to guess this step: the count that the measurements say gives the
most output tokens per second, down to none.

Two measurements, both kept as exponentially decaying sums so they follow the load:

- acceptance ``a``: the chance that a guess is kept given that the guesses before it
  were. Each verified guess is a run of trials: its kept tokens are successes and the
  first rejected one (if any) a failure; ``a`` is successes / trials (the maximum
  likelihood estimate of a geometric run). A sequence guessing ``k`` tokens then emits
  on average ``1 + a + a^2 + ... + a^k`` tokens per step instead of 1.
- step cost: the seconds of a whole step as a straight line in its batched tokens,
  ``t(T) = fixed + per_token * T``, its slope fitted to the changes between consecutive
  steps (:class:`CostLine`: the cost of longer contexts cancels). On a CPU
  decoding a few sequences, ``fixed`` (reading the weights once) dominates and guesses
  are nearly free; with many sequences a step costs about its tokens and guesses only
  pay when nearly all are accepted.

For each ``k`` the rule compares (tokens emitted by the batch) / t(batched tokens with
the guesses) and takes the best, requiring ``MIN_GAIN`` over guessing nothing, among the
``k`` that add at most ``EXTRAPOLATION`` times the largest step-size change measured. A draft
model pays a forward pass per guessed token: its passes are fitted on a line of their
own, seconds against rows (``d(R)``), their time is left out of the step's, and ``k``
guesses for ``n`` sequences add ``d(C) + (k - 1) * d(n)`` to the step, ``C`` the rows of
the first pass: the tokens the draft must catch up (a new sequence's whole prompt),
each sequence's spread over the steps it may still guess in, at most
``CATCH_UP_STEPS`` (:func:`amortized_catch_up`): a sequence catches up once and then
guesses for the rest of its output. A draft model measures with one sequence
(the one with the least to catch up), not one in ``MEASURING_SHARE``. Before
any proposal is made it asks whether even full proposals could pay, and proposes
nothing when not. Until the fit has seen consecutive steps of different sizes, and once
every ``EXPLORE_EVERY`` steps without guesses (a draft model: at most ``EXPLORE_SHARE`` of the
time in its measuring passes), it measures, every other step without prefill while the
fit has no slope (a step with prefill is not timed, so it cannot give the fit its slope),
so the acceptance keeps being measured and the slope follows the load, at little cost: a
host proposer guesses one token for one sequence in ``MEASURING_SHARE``; a draft model
guesses in full for one sequence (:attr:`DraftLengthPolicy.measuring_length`).

Where a draft model guesses, it is asked for full-length guesses and stops each
sequence between its passes by :meth:`DraftLengthPolicy.keep_guessing`: another guess
must be worth, at the step's rate so far, the row and the share of a pass it adds, given
the chance (from the draft's confidence) that the guesses before it are all kept.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

MIN_GAIN = 1.05
"""A guess length must promise at least this much more throughput than none."""

EXPLORE_EVERY = 64
"""After this many steps without guesses, one step guesses to re-measure."""

EXPLORE_SHARE = 0.01
"""A draft model re-measures less often than ``EXPLORE_EVERY`` where its measuring passes
(the measuring sequence's catch-up, at high load its whole history, and its guesses)
would cost more than this share of the steps in between. The rows the draft falls behind
while it waits are left out: catching up on them costs the same share of those steps
whenever it happens, so no wait makes it cheaper (counted, they would put the next
measurement forever out of reach wherever a draft row costs more than this share of a
step, as with one sequence on a CPU)."""

DECAY = 0.98
"""Weight kept by past observations at each new one (about 50 observations' memory)."""

MEASURING_SHARE = 4
"""A measuring step guesses one token for one decoding sequence in this many (at
least one): enough to measure acceptance and give the cost fit two step sizes apart,
cheap beside a full batch."""

EXTRAPOLATION = 4
"""A step's guesses add at most this many times the largest change between consecutive
step sizes that the cost line has seen (its slope rests on those changes; a noisy slope
read far beyond them can make one step cost several), so a first guessing step stays
near what was measured and each one that guesses more lets the next go further."""

CATCH_UP_STEPS = 16
"""Steps over which a sequence's catch-up (a draft running its history) is counted."""

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 8.0
"""The acceptance estimate starts as ``PRIOR_ACCEPTANCE`` worth this many trials."""


def amortized_catch_up(num_rows: int, num_guesses_left: int) -> int:
    """The share of a sequence's ``num_rows``-token catch-up counted against one step:
    spread over the steps it may still guess in (at most one per guess left, at most
    ``CATCH_UP_STEPS``), never less than its one row of the pass."""
    steps = min(CATCH_UP_STEPS, max(1, num_guesses_left))
    return max(1, -(-num_rows // steps))


class CostLine:
    """Seconds against a size (tokens, rows) as a line ``fixed + per_unit * size``, both
    kept >= 0, over exponentially decayed observations.

    The slope comes from the differences of consecutive observations (least squares
    through the origin of the seconds' change against the size's change), so a cost
    that drifts slowly with something else (the contexts a batch attends to grow as it
    decodes, while its size shrinks as sequences finish) cancels in it; a plain fit of
    seconds against size reads that drift as a negative slope. ``fixed`` is the recent
    observations' mean of ``seconds - per_unit * size``. :meth:`interrupt` marks an
    observation missing in between (a step of another kind): no difference spans it."""

    def __init__(self) -> None:
        self._w = self._x = self._y = 0.0  # decayed count, sizes, seconds
        self._dxx = self._dxy = 0.0  # decayed sums over consecutive differences
        self._last: tuple[int, float] | None = None
        self.span = 0
        """The largest change of size between consecutive observations seen."""

    def observe(self, size: int, seconds: float) -> None:
        d = DECAY
        if self._last is not None and size != self._last[0]:
            dx, dy = size - self._last[0], seconds - self._last[1]
            self._dxx = self._dxx * d + dx * dx
            self._dxy = self._dxy * d + dx * dy
            self.span = max(self.span, abs(dx))
        self._last = (size, seconds)
        self._w = self._w * d + 1.0
        self._x = self._x * d + size
        self._y = self._y * d + seconds

    def interrupt(self) -> None:
        """The next observation does not follow the last one."""
        self._last = None

    def cost(self, size: int) -> float | None:
        """The fitted seconds at ``size``; None until consecutive sizes that differ
        were seen."""
        if self._dxx == 0:
            return None
        per_unit = max(0.0, self._dxy / self._dxx)
        fixed = max(0.0, (self._y - per_unit * self._x) / self._w)
        return fixed + per_unit * size


class DraftLengthPolicy:
    """Chooses the step's guess length from the proposals' lengths and the measurements.
    ``pays_per_guess``: each guessed token costs a pass of a draft model, observed with
    :meth:`observe_draft_pass`.

    Units: tokens and seconds. Not thread-safe (the engine's step loop owns it)."""

    def __init__(self, max_tokens: int, pays_per_guess: bool = False) -> None:
        self.max_tokens = max_tokens
        self.pays_per_guess = pays_per_guess
        self._trials = PRIOR_WEIGHT
        self._accepted = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
        self._steps = CostLine()  # a step's seconds against its batched tokens
        self._draft_passes = CostLine()  # a draft pass's seconds against its rows
        self._steps_without = 0
        self._unfitted_steps = 0

    @property
    def acceptance(self) -> float:
        """The measured chance (0..1) that a guess is kept after kept ones."""
        return self._accepted / self._trials

    def observe_acceptance(self, num_drafted: int, num_accepted: int) -> None:
        """A sequence's ``num_drafted`` guessed tokens were verified; the first
        ``num_accepted`` were kept."""
        if num_drafted:
            trials = num_accepted + (num_accepted < num_drafted)
            scale = DECAY**trials
            self._trials = self._trials * scale + trials
            self._accepted = self._accepted * scale + num_accepted

    def observe_step(self, num_batched_tokens: int, seconds: float) -> None:
        """A whole step of ``num_batched_tokens`` tokens took ``seconds`` (a draft
        model's passes left out)."""
        self._steps.observe(num_batched_tokens, seconds)

    def skip_step(self) -> None:
        """A step that :meth:`observe_step` does not see (it ran prefill) came between
        the steps it saw."""
        self._steps.interrupt()

    def observe_draft_pass(self, num_rows: int, seconds: float) -> None:
        """A pass of the draft model over ``num_rows`` rows took ``seconds``."""
        self._draft_passes.observe(num_rows, seconds)

    def step_cost(self, num_batched_tokens: int) -> float | None:
        """The fitted seconds of a step of ``num_batched_tokens`` tokens; None until
        consecutive steps of different sizes were seen."""
        return self._steps.cost(num_batched_tokens)

    def guessing_cost(
        self, num_guesses: int, num_sequences: int, catch_up_rows: int | None = None
    ) -> float | None:
        """Seconds of proposing ``num_guesses`` tokens to each of ``num_sequences``: 0
        for host proposers; for a draft model ``num_guesses`` passes of that many rows,
        the first one of ``catch_up_rows`` when given (None until consecutive passes of
        different sizes were seen)."""
        if not self.pays_per_guess or num_guesses == 0:
            return 0.0
        per_pass = self._draft_passes.cost(num_sequences)
        first = self._draft_passes.cost(max(catch_up_rows or 0, num_sequences))
        if per_pass is None or first is None:
            return None
        return first + (num_guesses - 1) * per_pass

    def most_worth_guessing(
        self,
        num_emitting: int,
        num_batched_tokens: int,
        catch_up_rows: int | None = None,
        measuring_rows: int = 1,
        timed: bool = True,
    ) -> tuple[int, bool]:
        """Asked before any proposal is made (proposing costs host time too): the most
        tokens a sequence may usefully guess next step, and whether that is a measuring
        step (run whatever was proposed). 0 when even a full proposal for every one of
        the ``num_emitting`` decoding sequences would not pay (fewer proposals cannot
        pay when all of them would not: the rate moves monotonically between none and
        all); (:attr:`measuring_length`, True) every other step until the cost fit has
        seen two step sizes, and once every :meth:`explore_interval` steps without
        guesses: a guess of that many tokens for :meth:`measuring_sequences` sequences
        measures acceptance and widens the fit at little cost. ``catch_up_rows``: a draft
        model's first pass for all of them; ``measuring_rows``: its first pass for the
        sequence that would measure; ``timed``: whether the next step feeds the cost line
        (it runs no prefill). While the costs are unfitted only such steps measure: a
        measuring step whose time the line never sees cannot fit it, and a draft model's
        measuring passes are spent for the acceptance alone."""
        if num_emitting == 0:
            return 0, False
        if self.step_cost(num_batched_tokens) is None or self.guessing_cost(1, 1) is None:
            if not timed:
                return 0, False
            self._unfitted_steps += 1
            return (self.measuring_length, True) if self._unfitted_steps % 2 else (0, False)
        full = [self.max_tokens] * num_emitting
        best = self._best(full, num_batched_tokens, num_emitting, catch_up_rows)
        if best > 0:
            self._steps_without = 0
            return self.max_tokens, False
        self._steps_without += 1
        if self._steps_without >= self.explore_interval(num_batched_tokens, measuring_rows):
            self._steps_without = 0
            return self.measuring_length, True
        return 0, False

    def keep_guessing(
        self,
        chances: Sequence[float],
        num_batched_tokens: int,
        expected_tokens: float,
        num_passes: int,
        num_drafting: int,
        catch_up_rows: int | None = None,
    ) -> list[bool]:
        """Asked between a draft model's passes: which of the sequences still guessing
        should guess once more. ``chances[i]``: the chance that every guess sequence ``i``
        made so far is kept; ``num_batched_tokens``: the step's tokens with every guess
        made so far; ``expected_tokens``: the tokens the step is expected to emit so
        far (one per emitting sequence, plus each guess's chance of being kept);
        ``num_passes``: the draft passes run so far for ``num_drafting`` sequences,
        the first one of ``catch_up_rows``.

        A sequence goes on when the tokens another guess may add (its chance times the
        acceptance ``a``) are worth, at the step's rate so far, the seconds they add:
        one more row of the step and its share of one more pass, shared among those
        that go on. Everyone goes on until the costs are fitted."""
        step = self.step_cost(num_batched_tokens)
        drafted = self.guessing_cost(num_passes, num_drafting, catch_up_rows)
        if step is None or drafted is None or not self.pays_per_guess:
            return [True] * len(chances)
        row = self.step_cost(num_batched_tokens + 1) - step
        rate = expected_tokens / (step + drafted)
        going = [i for i in range(len(chances)) if chances[i] > 0]
        while going:
            share = self._draft_passes.cost(len(going)) / len(going)
            worth = [i for i in going if chances[i] * self.acceptance > rate * (row + share)]
            if len(worth) == len(going):
                break
            going = worth
        kept = set(going)
        return [i in kept for i in range(len(chances))]

    def explore_interval(self, num_batched_tokens: int, measuring_rows: int = 1) -> int:
        """Steps without guesses before a measuring step: ``EXPLORE_EVERY``, or for a draft
        model whose measuring sequence must first catch up ``measuring_rows`` rows,
        enough steps of ``num_batched_tokens`` tokens that its measuring passes cost
        ``EXPLORE_SHARE`` of them, the rows it fell behind while waiting left out."""
        rows_before_wait = max(1, measuring_rows - self._steps_without)
        pass_seconds = self.guessing_cost(self.measuring_length, 1, rows_before_wait)
        step_seconds = self.step_cost(num_batched_tokens)
        if not pass_seconds or not step_seconds:
            return EXPLORE_EVERY
        return max(EXPLORE_EVERY, math.ceil(pass_seconds / (EXPLORE_SHARE * step_seconds)))

    @property
    def measuring_length(self) -> int:
        """Tokens each measuring sequence guesses. One for a host proposer: a cheap trial
        for a share of the batch. All ``max_tokens`` for a draft model, whose one
        measuring sequence must be caught up first: a one-token guess measures a single
        trial, and one unlucky first trial could leave the acceptance near its prior,
        and guessing off, until the next measurement hundreds of steps later."""
        return self.max_tokens if self.pays_per_guess else 1

    def measuring_sequences(self, num_emitting: int) -> int:
        """How many sequences guess in a measuring step: one in ``MEASURING_SHARE``, one
        for a draft model (each may first need its whole history run by the draft)."""
        if self.pays_per_guess:
            return 1
        return max(1, num_emitting // MEASURING_SHARE)

    def choose(
        self,
        proposal_lengths: Sequence[int],
        num_batched_tokens: int,
        num_emitting: int,
    ) -> int:
        """The guess length for this step, for proposals made within
        :meth:`most_worth_guessing`: at most ``max_tokens``; a sequence whose proposal
        is shorter guesses its whole proposal. ``proposal_lengths``: per decoding
        sequence with a proposal; ``num_batched_tokens``: the step's tokens without
        guesses (one per decoding sequence, plus prefill chunks); ``num_emitting``: the
        sequences that get a token from it without guesses. (A draft model's guesses are
        cut between its passes instead: :meth:`keep_guessing`.)"""
        unfitted = self.step_cost(num_batched_tokens) is None or self.guessing_cost(1, 1) is None
        if not proposal_lengths or unfitted:
            return min(1, max(proposal_lengths, default=0))
        return self._best(proposal_lengths, num_batched_tokens, num_emitting)

    def _best(
        self,
        proposal_lengths: Sequence[int],
        num_batched_tokens: int,
        num_emitting: int,
        catch_up_rows: int | None = None,
    ) -> int:
        """The length with the highest fitted rate of emitted tokens, 0 unless it beats
        no guesses by ``MIN_GAIN``."""
        a = min(self.acceptance, 0.999)
        best, best_rate = 0, num_emitting / self.step_cost(num_batched_tokens)
        floor = best_rate * MIN_GAIN
        longest = min(self.max_tokens, max(proposal_lengths, default=0))
        counts = Counter(proposal_lengths).items()  # few distinct lengths, many sequences
        for k in range(1, longest + 1):
            extra = sum(n * min(k, length) for length, n in counts)
            if extra > EXTRAPOLATION * self._steps.span:
                break
            gained = sum(n * a * (1 - a ** min(k, length)) / (1 - a) for length, n in counts)
            seconds = self.step_cost(num_batched_tokens + extra)
            seconds += self.guessing_cost(k, len(proposal_lengths), catch_up_rows)
            rate = (num_emitting + gained) / seconds
            if rate >= floor and rate > best_rate:
                best, best_rate = k, rate
        return best
