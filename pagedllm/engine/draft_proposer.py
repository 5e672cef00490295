"""Guesses from a draft model (``draft_model`` speculation), run over the paged cache.

After a step, a decoding sequence has ``C`` computed tokens and one known token ``t``
at position ``C``. The draft first catches up: one pass over the tokens whose draft K/V
are not yet in the sequence's blocks, ending with ``t`` (for a sequence that just
finished its prompt, the whole prompt: the draft's prefill). That pass gives the first
guess; each further pass feeds the last guess and gives the next. Sequences run
batched, each pass one forward of the draft.

Where the draft writes (:mod:`~pagedllm.engine.draft_worker`): committed positions
(``< C``) into the sequence's own pool blocks, in the draft's cache; every sharer of a
block computes the same draft K/V from the same tokens there. Positions ``>= C`` are
guesses: they go into the sequence's last pool block when it holds it alone (a block
shared with a sibling sample makes the sequence skip guessing for the step), and past
it into scratch blocks. Nothing the draft writes touches the target's K/V.

What the proposer remembers per sequence (:class:`_DraftKV`): how many leading positions
hold right draft K/V, and the tokens it fed into the last pool block; those that the
sequence kept are right too, so the next catch-up starts after them (usually one or two
tokens). A recompute (the sequence's blocks were freed) or a new sequence starts over
at 0; a cached prefix is recomputed once by the draft, not trusted.

Guesses are the draft's argmax for greedy sequences; sampled sequences draw them from
the draft's tempered, truncated distribution, which verification needs
(:class:`~pagedllm.engine.speculation.Guess.probs`).

How far each sequence guesses: up to its limit, but between passes
:attr:`DraftGuesses.keep_guessing` (when set) may stop a sequence whose guesses so far
are unlikely to all be kept. Each guess's chance comes from the draft's confidence in it
through :class:`~pagedllm.spec_decode.guess_calibration.GuessCalibration`, which learns
from the verifications (:meth:`DraftGuesses.verified`). The guesses made are verified
whatever the stop, so it changes speed, never the output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from pagedllm.engine.draft_worker import DraftPass, DraftWorker, scratch_blocks_per_sequence
from pagedllm.engine.sampler import draw_from, draw_uniforms, random_rows, sampling_probabilities
from pagedllm.engine.sequence import TokenSequence
from pagedllm.kv.block_manager import BlockManager
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.guess import Guess
from pagedllm.spec_decode.guess_calibration import GuessCalibration

KeepGuessing = Callable[[list[float], int, float, int, int], list[bool]]
"""``(chances, guesses made, expected kept guesses, passes run, sequences drafting)`` ->
which of the sequences still guessing (their ``chances`` that every guess so far is
kept) guess once more; the counts are the whole group's, for the step being drafted."""


@dataclass
class _DraftKV:
    """Draft K/V of one sequence in its pool blocks: positions ``0 .. num_valid - 1`` are
    right; ``fed`` are the tokens written at ``fed_from ..`` (its guesses' positions in
    its own last block), right as far as the sequence kept them. ``num_preemptions``:
    the sequence's count when recorded (a recompute frees the blocks)."""

    num_valid: int
    num_preemptions: int
    fed_from: int
    fed: list[int]

    def valid_for(self, seq: TokenSequence) -> int:
        """Leading positions of ``seq`` whose draft K/V are right now."""
        if seq.num_preemptions != self.num_preemptions:
            return 0
        valid = min(self.num_valid, seq.num_computed_tokens)
        if valid != self.fed_from:
            return valid
        tokens = seq.all_token_ids
        for token in self.fed:
            if valid >= seq.num_computed_tokens or tokens[valid] != token:
                break
            valid += 1
        return valid


@dataclass
class _Drafting:
    """One sequence while the draft runs: its pool table extended by scratch blocks (the
    first ``num_pool_blocks`` entries are its own pool blocks, the rest scratch), its
    computed count ``start`` (its known token's position), the first position the
    catch-up feeds, and the guesses (with their distributions) so far."""

    seq: TokenSequence
    limit: int
    table: list[int]
    start: int
    catch_up_from: int
    num_pool_blocks: int
    copy: tuple[int, int] | None = None  # (shared last block, its scratch copy)
    token_ids: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    confidences: list[float] = field(default_factory=list)
    chance: float = 1.0  # that every guess so far is kept
    expected: float = 0.0  # kept guesses expected: the sum of the chances so far
    done: bool = False

    def slot(self, position: int, block_size: int) -> int:
        return self.table[position // block_size] * block_size + position % block_size


class DraftGuesses:
    """Guesses from ``worker``'s draft model for sequences of ``block_manager``'s pool.
    ``stop_token_ids``: the engine's stop set (a guess that ends the sequence ends the
    guessing); ``max_tokens_per_pass``: the most tokens one draft pass runs (a longer
    catch-up is split)."""

    pays_per_guess = True  # each guessed token is a pass of the draft

    def __init__(
        self,
        config: SpeculativeConfig,
        worker: DraftWorker,
        block_manager: BlockManager,
        stop_token_ids: Collection[int],
        max_tokens_per_pass: int,
    ) -> None:
        self.worker = worker
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.stop_token_ids = frozenset(stop_token_ids)
        self.max_tokens_per_pass = max_tokens_per_pass
        self.scratch_per_sequence = scratch_blocks_per_sequence(config, self.block_size)
        self.group_size = max(1, worker.num_scratch_blocks // self.scratch_per_sequence)
        self._kv: dict[int, _DraftKV] = {}
        self._confidences: dict[int, list[float]] = {}  # the guesses offered, by sequence
        self.calibration = GuessCalibration()
        self.pass_observer: Callable[[int, float], None] | None = None  # (rows, seconds)
        self.keep_guessing: KeepGuessing | None = None  # set for each step by its owner
        self.num_passes = 0  # forward passes of the draft so far
        self.num_tokens_run = 0  # tokens those passes ran (catch-up and guesses)

    def propose_all(
        self, requests: Sequence[tuple[TokenSequence, int]], wanted: int | None
    ) -> list[tuple[TokenSequence, Guess]]:
        """Up to ``limit`` guesses for each decoding ``(sequence, limit)`` in order, for
        at most ``wanted`` of them (None: all); a sequence whose guesses would write a
        shared block past its last one gets none."""
        proposals = []
        for first in range(0, len(requests), self.group_size):
            if len(proposals) == wanted:
                break
            group: list[_Drafting] = []
            for seq, limit in requests[first : first + self.group_size]:
                if len(proposals) + len(group) == wanted:
                    break
                drafting = self._start(seq, limit, len(group))
                if drafting is not None:
                    group.append(drafting)
            copies = [drafting.copy for drafting in group if drafting.copy is not None]
            if copies:  # shared last blocks into their sequences' scratch copies
                self.worker.kv_cache.copy_blocks(copies)
            self._run(group)
            for drafting in group:
                self._remember(drafting)
                probs = torch.stack(drafting.probs) if drafting.probs else None
                self._confidences[drafting.seq.seq_id] = drafting.confidences
                proposals.append((drafting.seq, Guess(drafting.token_ids, probs)))
        return proposals

    def verified(self, seq: TokenSequence, num_drafted: int, num_accepted: int) -> None:
        """``seq``'s first ``num_drafted`` guesses of the last offer were run and the
        first ``num_accepted`` kept: the calibration learns from their confidences."""
        confidences = self._confidences.pop(seq.seq_id, [])
        self.calibration.observe(confidences[:num_drafted], num_accepted)

    def finished(self, seq: TokenSequence, completed: bool) -> None:
        self._kv.pop(seq.seq_id, None)
        self._confidences.pop(seq.seq_id, None)
        if self.worker.head is not None:
            self.worker.head.forget(seq.seq_id)

    def catch_up_rows(self, seq: TokenSequence) -> int:
        """Tokens of decoding ``seq`` the draft would run in its first pass: those whose
        draft K/V are not in its blocks, and its known token."""
        kv = self._kv.get(seq.seq_id)
        return seq.num_computed_tokens + 1 - (0 if kv is None else kv.valid_for(seq))

    def _start(self, seq: TokenSequence, limit: int, slot_in_group: int) -> _Drafting | None:
        """``seq`` ready to draft, with scratch blocks ``slot_in_group`` of a group. Its
        partly filled last block, when shared (siblings just forked), is drafted in a
        scratch copy; None when a block past it is shared (never, in practice)."""
        size, start = self.block_size, seq.num_computed_tokens
        table = self.block_manager.block_table(seq.seq_id)
        kv = self._kv.get(seq.seq_id)
        valid = 0 if kv is None else kv.valid_for(seq)
        last_needed = (start + limit - 1) // size
        pool = self.block_manager.pool
        first_written = start // size  # the first block a guess writes
        if any(pool.ref_count(b) != 1 for b in table[first_written + 1 : last_needed + 1]):
            return None
        scratch = iter(self.worker.scratch_block_ids[slot_in_group * self.scratch_per_sequence :])
        own_blocks, copy = len(table), None
        if first_written < len(table) and pool.ref_count(table[first_written]) != 1:
            copy = table[first_written], next(scratch)
            table[first_written] = copy[1]
            own_blocks = first_written
        table.extend(next(scratch) for _ in range(len(table), last_needed + 1))
        if self.worker.head is not None:
            self.worker.head.note(seq)
        return _Drafting(seq, limit, table, start, valid, own_blocks, copy)

    def _run(self, group: list[_Drafting]) -> None:
        """The catch-up passes, then one pass per further guess, until every sequence
        of ``group`` has its guesses or guessed a stop token."""
        pending = [(drafting, drafting.catch_up_from) for drafting in group]
        num_passes = 0
        while pending:  # catch-up, split over passes of at most max_tokens_per_pass
            step, sampled, later = self._new_pass(), [], []
            budget = self.max_tokens_per_pass
            for drafting, position in pending:
                end = drafting.start + 1
                take = min(end - position, budget)
                if take <= 0:
                    later.append((drafting, position))
                    continue
                tokens = drafting.seq.all_token_ids[position : position + take]
                self._add(step, drafting, tokens, position)
                budget -= take
                if position + take == end:
                    step.sample_rows.append(len(step.token_ids) - 1)
                    step.sample_seq_ids.append(drafting.seq.seq_id)
                    sampled.append(drafting)
                else:
                    later.append((drafting, position + take))
            self._draw(sampled, self._forward(step))
            pending = later
            num_passes += 1
        while True:
            going = self._going_on(group, num_passes)
            if not going:
                return
            num_passes += 1
            step = self._new_pass()
            for drafting in going:
                position = drafting.start + len(drafting.token_ids)
                self._add(step, drafting, drafting.token_ids[-1:], position)
                step.sample_rows.append(len(step.token_ids) - 1)
                step.sample_seq_ids.append(drafting.seq.seq_id)
            self._draw(going, self._forward(step))

    def _going_on(self, group: list[_Drafting], num_passes: int) -> list[_Drafting]:
        """The sequences of ``group`` that guess once more after ``num_passes`` passes:
        those not done that :attr:`keep_guessing` keeps (the others are done)."""
        going = [drafting for drafting in group if not drafting.done]
        if self.keep_guessing is None or not going:
            return going
        keep = self.keep_guessing(
            [drafting.chance for drafting in going],
            sum(len(drafting.token_ids) for drafting in group),
            sum(drafting.expected for drafting in group),
            num_passes,
            len(group),
        )
        for drafting, more in zip(going, keep, strict=True):
            drafting.done = not more
        return [drafting for drafting in going if not drafting.done]

    @staticmethod
    def _new_pass() -> DraftPass:
        return DraftPass([], [], [], [], [], [], [], [])

    def _forward(self, step: DraftPass) -> torch.Tensor:
        start = time.perf_counter()
        logits = self.worker.forward(step)
        self.num_passes += 1
        self.num_tokens_run += len(step.token_ids)
        if self.pass_observer is not None:
            self.pass_observer(len(step.token_ids), time.perf_counter() - start)
        return logits

    def _add(self, step: DraftPass, drafting: _Drafting, tokens: list[int], position: int) -> None:
        """``tokens`` of ``drafting`` at ``position ..`` into ``step``."""
        size = self.block_size
        step.token_ids.extend(tokens)
        step.positions.extend(range(position, position + len(tokens)))
        step.slots.extend(drafting.slot(p, size) for p in range(position, position + len(tokens)))
        end = position + len(tokens)
        step.tables.append(drafting.table[: -(-end // size)])
        step.seq_lens.append(end)
        step.query_lens.append(len(tokens))

    def _draw(self, group: list[_Drafting], logits: torch.Tensor) -> None:
        """Each sequence's next guess from its row of ``logits``: the argmax when greedy,
        a draw from its sampling distribution otherwise."""
        if not group:
            return
        top = logits.max(dim=-1)
        tokens = top.indices.tolist()
        confidences = torch.exp(top.values - torch.logsumexp(logits, dim=-1)).tolist()
        params = [drafting.seq.params for drafting in group]
        generators = [drafting.seq.generator for drafting in group]
        random = random_rows(params, generators, logits.device)
        if random is not None:
            probs = sampling_probabilities(logits[random.rows], random)
            probs = probs / probs.sum(dim=-1, keepdim=True)
            drawn = draw_from(probs, draw_uniforms(random.generators, probs.device)).tolist()
            top_probs = probs.max(dim=-1).values.tolist()
            for i, row in enumerate(random.rows.tolist()):
                tokens[row] = drawn[i]
                confidences[row] = top_probs[i]
                group[row].probs.append(probs[i])
        for drafting, token, confidence in zip(group, tokens, confidences, strict=True):
            drafting.token_ids.append(token)
            drafting.confidences.append(confidence)
            drafting.chance *= self.calibration.chance_kept(confidence)
            drafting.expected += drafting.chance
            stops = drafting.seq.params.stop_token_ids
            ends = token in self.stop_token_ids or (stops is not None and token in stops)
            drafting.done = ends or len(drafting.token_ids) >= drafting.limit

    def _remember(self, drafting: _Drafting) -> None:
        """What the passes left right in ``drafting``'s pool blocks: every position before
        its known token that lies in them, and the known token and guesses fed into them
        (a shared last block was drafted in a copy: nothing new in it is kept)."""
        seq, start = drafting.seq, drafting.start
        in_pool = drafting.num_pool_blocks * self.block_size
        num_valid = max(drafting.catch_up_from, min(start, in_pool))
        fed = [seq.all_token_ids[start], *drafting.token_ids[:-1]][: max(0, in_pool - start)]
        self._kv[seq.seq_id] = _DraftKV(num_valid, seq.num_preemptions, start, fed)
