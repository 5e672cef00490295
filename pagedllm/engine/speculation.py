"""Speculative decoding in the engine: after each step, offer each decoding sequence
guessed tokens for the next one; after the next one's pass, settle what the model kept.

Which sequences guess: those decoding (one known token left to compute) with room for
at least two more output tokens (a guess is useless without a token after it), and
without ``structured_outputs`` (their guesses are not checked against the grammar;
they decode as before) or owed prompt logprobs. A sequence guesses at most
``max_tokens - outputs - 1`` tokens, so a fully accepted guess never passes its
``max_tokens`` and never needs more blocks than its admitted worst case.

How many: :class:`~pagedllm.spec_decode.draft_length.DraftLengthPolicy` picks one
length for the step from the proposals and its measurements (down to none), unless
``adaptive_draft_length`` is off: then every proposal runs in full.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedllm.engine.sequence import TokenSequence
from pagedllm.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedllm.spec_decode.draft_length import DraftLengthPolicy
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.stats import SpecDecodeStats
from pagedllm.spec_decode.suffix import SuffixConfig, SuffixProposer


class Proposer(Protocol):
    """Where guesses come from, seen by the engine."""

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        """Up to ``limit`` (>= 1) tokens to follow ``seq.all_token_ids``."""

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        """``seq`` ended, having completed its output or not (aborted, failed)."""


class NgramGuesses:
    """:class:`~pagedllm.spec_decode.ngram.NgramProposer` over each sequence's tokens."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)

    def propose(self, seq: TokenSequence, limit: int) -> list[int]:
        return self.ngram.propose(seq.all_token_ids, limit)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        pass  # stateless


class SuffixGuesses:
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
        key = str(seq.seq_id)
        if completed:  # the tree takes the last tokens first: it stores them on finish
            self.suffix.propose(key, seq.all_token_ids, seq.num_prompt_tokens, 0)
            self.suffix.finish(key)
        else:
            self.suffix.abort(key)


def make_proposer(config: SpeculativeConfig) -> Proposer:
    """The proposer ``config.method`` names; ValueError for one not built yet."""
    if config.method is SpeculativeMethod.NGRAM:
        return NgramGuesses(config)
    if config.method is SpeculativeMethod.SUFFIX:
        return SuffixGuesses(config)
    raise ValueError(
        f"speculative_config: method {config.method.value!r} is not implemented yet; use "
        "'ngram' or 'suffix'"
    )


class Speculator:
    """Owns the proposer, the length policy and the counters of one engine."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.proposer = make_proposer(config)
        self.policy = DraftLengthPolicy(config.num_speculative_tokens)
        self.stats = SpecDecodeStats(config.num_speculative_tokens)
        self.num_blocks_rolled_back = 0

    def propose(
        self,
        candidates: Sequence[tuple[TokenSequence, int]],
        num_batched_tokens: int,
    ) -> None:
        """Offer guesses to ``candidates``: (decoding sequence, most guesses its limits
        allow). ``num_batched_tokens``: the next step's tokens without guesses, as far
        as known."""
        most, measuring = self.config.num_speculative_tokens, True
        if self.config.adaptive_draft_length:
            most, measuring = self.policy.most_worth_guessing(len(candidates), num_batched_tokens)
        proposals = []
        wanted = None
        if measuring and self.config.adaptive_draft_length:
            wanted = self.policy.measuring_sequences(len(candidates))
        for seq, limit in candidates if most else ():
            if len(proposals) == wanted:
                break
            if limit <= 0 or not self._may_guess(seq):
                continue
            guess = self.proposer.propose(seq, min(limit, most))
            if guess:
                proposals.append((seq, guess))
        lengths = [len(guess) for _, guess in proposals]
        k = max(lengths, default=0)
        if not measuring:
            k = self.policy.choose(lengths, num_batched_tokens, len(candidates))
        for seq, guess in proposals:
            seq.draft_token_ids = guess[:k]

    @staticmethod
    def _may_guess(seq: TokenSequence) -> bool:
        return (
            seq.num_uncomputed_tokens == 1
            and seq.params.structured_outputs is None
            and not seq.owes_prompt_logprobs
        )

    def record(self, num_drafted: int, num_accepted: int) -> None:
        """One sequence's guesses were verified."""
        self.stats.record(num_drafted, num_accepted)
        self.policy.observe_acceptance(num_drafted, num_accepted)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        """``seq`` ended (``completed``: its output is whole, not aborted or failed)."""
        self.proposer.finished(seq, completed)
