"""Speculative decoding in the engine: after each step, offer each decoding sequence
guessed tokens for the next one; after the next one's pass, settle what the model kept.

Which sequences guess: those decoding (one known token left to compute) with room for
at least two more output tokens (a guess is useless without a token after it), and no
owed prompt logprobs. Under ``structured_outputs`` a guess is cut where the grammar
refuses a token (verification then masks each row as a one-token step would). A
sequence guesses at most
``max_tokens - outputs - 1`` tokens, so a fully accepted guess never passes its
``max_tokens`` and never needs more blocks than its admitted worst case.

How many: :class:`~pagedllm.spec_decode.draft_length.DraftLengthPolicy` picks one
length for the step from the proposals and its measurements (down to none), unless
``adaptive_draft_length`` is off: then every proposal runs in full. A draft model is
asked for full-length guesses whenever guessing pays, and stops each sequence between
its passes by ``DraftLengthPolicy.keep_guessing``, which weighs the draft's confidence
in the guesses so far against the cost of another.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from pagedllm.engine.draft_proposer import DraftGuesses, KeepGuessing
from pagedllm.engine.sampler import SamplerOutput, TokenLogprobs
from pagedllm.engine.scheduler import Scheduler, SchedulerOutput
from pagedllm.engine.sequence import TokenSequence
from pagedllm.engine.spec_verify import Verified
from pagedllm.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedllm.spec_decode.draft_length import DraftLengthPolicy, amortized_catch_up
from pagedllm.spec_decode.guess import Guess
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.stats import SpecDecodeStats
from pagedllm.spec_decode.suffix import SuffixConfig, SuffixProposer


class Proposer(Protocol):
    """Where guesses come from, seen by the engine."""

    def propose_all(
        self, requests: Sequence[tuple[TokenSequence, int]], wanted: int | None
    ) -> list[tuple[TokenSequence, Guess]]:
        """Non-empty guesses of up to ``limit`` (>= 1) tokens to follow each request's
        ``seq.all_token_ids``, for at most ``wanted`` sequences (None: all), in order."""

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        """``seq`` ended, having completed its output or not (aborted, failed)."""

    def verified(self, seq: TokenSequence, num_drafted: int, num_accepted: int) -> None:
        """``seq``'s first ``num_drafted`` guesses offered last were run, and the first
        ``num_accepted`` of them kept."""

    @property
    def pays_per_guess(self) -> bool:
        """Whether each guessed token costs a pass of a model (a draft model): the
        step's guess length is then chosen before proposing, not after."""

    def catch_up_rows(self, seq: TokenSequence) -> int:
        """Tokens of ``seq`` a proposal must run before it guesses (a draft model's
        catch-up; 0 for proposers that read host data)."""


class PerSequence:
    """A proposer that guesses for one sequence at a time (``propose``), from host
    data: a proposal is cheap, and the step's length is chosen among them."""

    pays_per_guess = False

    def catch_up_rows(self, seq: TokenSequence) -> int:
        return 0

    def verified(self, seq: TokenSequence, num_drafted: int, num_accepted: int) -> None:
        pass  # host proposers learn nothing from the outcome

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        raise NotImplementedError

    def propose_all(
        self, requests: Sequence[tuple[TokenSequence, int]], wanted: int | None
    ) -> list[tuple[TokenSequence, Guess]]:
        proposals = []
        for seq, limit in requests:
            if len(proposals) == wanted:
                break
            tokens = self.propose(seq, limit)
            if tokens:
                proposals.append((seq, Guess(tokens)))
        return proposals


class NgramGuesses(PerSequence):
    """:class:`~pagedllm.spec_decode.ngram.NgramProposer` over each sequence's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        return self.ngram.propose(seq.all_token_ids, limit)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        pass  # stateless


class SuffixGuesses(PerSequence):
    """:class:`~pagedllm.spec_decode.suffix.SuffixProposer`, one tree per sequence
    (samples of one request diverge); completed outputs join its global tree."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.suffix = SuffixProposer(
            SuffixConfig(
                max_tree_depth=config.suffix_decoding_max_tree_depth,
                max_cached_requests=config.suffix_decoding_max_cached_requests,
                max_spec_factor=config.suffix_decoding_max_spec_factor,
                min_token_prob=config.suffix_decoding_min_token_prob,
            )
        )

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        key = str(seq.seq_id)
        return self.suffix.propose(key, seq.all_token_ids, seq.num_prompt_tokens, limit)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        self.suffix.abort(str(seq.seq_id))  # its own tree goes; its output joins the global
        if completed:
            self.suffix.add_output(seq.output_token_ids)


def make_proposer(config: SpeculativeConfig, drafter: DraftGuesses | None) -> Proposer:
    """The proposer ``config.method`` names (``drafter``: the draft model's, built with
    the engine for ``draft_model``)."""
    if config.method is SpeculativeMethod.NGRAM:
        return NgramGuesses(config)
    if config.method is SpeculativeMethod.SUFFIX:
        return SuffixGuesses(config)
    if drafter is None:
        raise ValueError("speculative_config: method 'draft_model' needs its draft model")
    return drafter


class Speculator:
    """Owns the proposer, the length policy and the counters of one engine, and the
    distributions of the guesses offered for the next step (sampled draft tokens)."""

    def __init__(self, config: SpeculativeConfig, drafter: DraftGuesses | None = None) -> None:
        self.config = config
        self.proposer = make_proposer(config, drafter)
        pays = self.proposer.pays_per_guess
        self.policy = DraftLengthPolicy(config.num_speculative_tokens, pays)
        if drafter is not None:
            drafter.pass_observer = self.policy.observe_draft_pass
        self._drafting_seconds = 0.0  # the last offer's draft passes (left out of steps)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.num_blocks_rolled_back = 0
        self.draft_probs: dict[int, torch.Tensor] = {}

    def offer(
        self,
        running: Sequence[TokenSequence],
        max_tokens_of: Callable[[TokenSequence], int],
        token_budget: int,
        prompts_waiting: bool = False,
    ) -> None:
        """Offer guesses for the next step to the decoding sequences among ``running``
        (each within ``max_tokens_of(seq)`` output tokens; ``token_budget``: the step's
        ``max_num_batched_tokens``; ``prompts_waiting``: requests wait to start, so the
        next step may run prefill)."""
        candidates, num_batched_tokens = [], 0
        for seq in running:
            num_batched_tokens += seq.num_uncomputed_tokens
            if seq.num_uncomputed_tokens == 1:
                candidates.append((seq, max_tokens_of(seq) - seq.num_output_tokens - 1))
        prefill = prompts_waiting or any(seq.num_uncomputed_tokens > 1 for seq in running)
        self.propose(candidates, min(num_batched_tokens, token_budget), timed=not prefill)

    def propose(
        self,
        candidates: Sequence[tuple[TokenSequence, int]],
        num_batched_tokens: int,
        timed: bool = True,
    ) -> None:
        """Offer guesses to ``candidates``: (decoding sequence, most guesses its limits
        allow). ``num_batched_tokens``: the next step's tokens without guesses, as far
        as known; ``timed``: whether that step's time feeds the cost line (no prefill
        in it, as far as known)."""
        most, measuring = self.config.num_speculative_tokens, True
        pays = self.proposer.pays_per_guess
        catch_up, least = None, 1
        if pays and candidates:  # what the draft must run before it guesses
            rows = [self.proposer.catch_up_rows(seq) for seq, _ in candidates]
            limits = [limit for _, limit in candidates]
            catch_up = sum(  # counted against the step
                amortized_catch_up(n, limit) for n, limit in zip(rows, limits, strict=True)
            )
            least = max(1, min(rows))  # a measuring step drafts for that sequence
        if self.config.adaptive_draft_length:
            most, measuring = self.policy.most_worth_guessing(
                len(candidates), num_batched_tokens, catch_up, least, timed
            )
        self.draft_probs.clear()  # guesses live one step
        wanted = None
        if measuring and self.config.adaptive_draft_length:
            wanted = self.policy.measuring_sequences(len(candidates))
        requests = [(seq, limit) for seq, limit in candidates if limit > 0 and self._may_guess(seq)]
        if pays:
            self.proposer.keep_guessing = None
        if requests and pays and measuring and self.config.adaptive_draft_length:
            requests.sort(key=lambda request: self.proposer.catch_up_rows(request[0]))
        elif requests and pays and self.config.adaptive_draft_length:
            # a draft model guesses in full and stops each sequence between its passes
            self.proposer.keep_guessing = self._keep_guessing(
                num_batched_tokens, len(candidates), catch_up
            )
        requests = [(seq, min(limit, most)) for seq, limit in requests] if most else []
        start = time.perf_counter()
        proposed = self.proposer.propose_all(requests, wanted) if requests else []
        elapsed = time.perf_counter() - start
        self._drafting_seconds = elapsed if pays else 0.0
        proposals = []
        for seq, guess in proposed:
            matchers = seq.params.grammar_matchers
            if matchers is not None:  # cut where the grammar refuses a guess
                guess = guess.truncated(
                    matchers.num_accepted(seq.output_token_ids, guess.token_ids)
                )
            if guess.token_ids:
                proposals.append((seq, guess))
        lengths = [len(guess.token_ids) for _, guess in proposals]
        k = max(lengths, default=0)
        if not measuring and not pays:  # a draft's length was chosen before it drafted
            k = self.policy.choose(lengths, num_batched_tokens, len(candidates))
        for seq, guess in proposals:
            guess = guess.truncated(k)
            seq.draft_token_ids = guess.token_ids
            if guess.probs is not None:
                self.draft_probs[seq.seq_id] = guess.probs

    def _keep_guessing(
        self, num_batched_tokens: int, num_emitting: int, catch_up_rows: int | None
    ) -> KeepGuessing:
        """The draft's stopping rule for a step of ``num_batched_tokens`` tokens without
        guesses and ``num_emitting`` sequences emitting tokens."""

        def keep(
            chances: list[float], guessed: int, expected: float, passes: int, drafting: int
        ) -> list[bool]:
            return self.policy.keep_guessing(
                chances,
                num_batched_tokens + guessed,
                num_emitting + expected,
                passes,
                drafting,
                catch_up_rows,
            )

        return keep

    @staticmethod
    def _may_guess(seq: TokenSequence) -> bool:
        return seq.num_uncomputed_tokens == 1 and not seq.owes_prompt_logprobs

    def observe_step(self, plan: SchedulerOutput, seconds: float) -> None:
        """A whole step of ``plan`` took ``seconds``: decoding steps feed the cost line
        (the rule chooses among them; prefill rows cost less per token), less the draft
        model's passes run in it (they have a line of their own)."""
        if all(item.num_known_tokens == 1 for item in plan.scheduled):
            self.policy.observe_step(plan.num_batched_tokens, seconds - self._drafting_seconds)
        else:
            self.policy.skip_step()
        self._drafting_seconds = 0.0

    def settle(
        self, scheduler: Scheduler, rows: StepRows, verified: Sequence[Verified | None]
    ) -> None:
        """Count each guessing sequence's kept guesses and let the scheduler commit them
        and roll the rest back (a sequence whose verification failed was aborted)."""
        for seq, guesses, result in zip(rows.guessing, rows.guesses, verified, strict=True):
            if result is None:
                continue
            self.stats.record(len(guesses), result.num_accepted)
            self.policy.observe_acceptance(len(guesses), result.num_accepted)
            self.proposer.verified(seq, len(guesses), result.num_accepted)
            self.num_blocks_rolled_back += scheduler.settle_drafts(seq, result.num_accepted)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        """``seq`` ended (``completed``: its output is whole, not aborted or failed)."""
        self.proposer.finished(seq, completed)


@dataclass
class StepRows:
    """A step's sequences that reached their end, split by whether they ran guesses,
    with their rows of the step's logits: one row each for ``plain``, ``len(guesses)
    + 1`` rows each for ``guessing`` (its guesses in ``guesses``), in plan order."""

    plain: list[TokenSequence]
    plain_rows: list[int]
    guessing: list[TokenSequence]
    guesses: list[list[int]]
    guessing_rows: list[int]

    @classmethod
    def split(cls, ending: Sequence[TokenSequence], drafts: dict[int, list[int]]) -> StepRows:
        """``ending``'s rows (plan order; ``drafts``: the guesses run, by sequence id)."""
        rows = cls([], [], [], [], [])
        row = 0
        for seq in ending:
            guesses = drafts.get(seq.seq_id, [])
            if guesses:
                rows.guessing.append(seq)
                rows.guesses.append(guesses)
                rows.guessing_rows.extend(range(row, row + len(guesses) + 1))
            else:
                rows.plain.append(seq)
                rows.plain_rows.append(row)
            row += len(guesses) + 1
        return rows


def merged_rows(
    plain: Sequence[TokenSequence],
    sampled: SamplerOutput | None,
    guessing: Sequence[TokenSequence],
    verified: Sequence[Verified | None],
) -> tuple[list[TokenSequence], SamplerOutput]:
    """One row per token to record: each plain sequence's sampled token, then each
    guessing sequence's kept guesses and the model's token, in order (a sequence whose
    verification failed has none)."""
    rows = list(plain)
    token_ids: list[int | None] = list(sampled.token_ids) if sampled else []
    logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
    if sampled is not None and sampled.logprobs is not None:
        logprobs = list(sampled.logprobs)
    for seq, result in zip(guessing, verified, strict=True):
        if result is not None:
            rows.extend([seq] * len(result.token_ids))
            token_ids.extend(result.token_ids)
            logprobs.extend(result.logprobs or [None] * len(result.token_ids))
    return rows, SamplerOutput(token_ids, logprobs)
