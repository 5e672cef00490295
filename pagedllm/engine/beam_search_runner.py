"""Beam searches driven over the engine's scheduler and paged KV cache.

Every beam is a :class:`~pagedllm.engine.sequence.TokenSequence` in the scheduler. A search
starts as one sequence, the prompt, prefilled once (in chunks if long, reusing cached
prefix blocks). Each step every live beam computes one token; :class:`BeamSelector`
picks the next beams from their log-probabilities; then, per parent beam:

- the first surviving continuation extends the parent's own sequence;
- every other continuation is a fork of the parent sharing all its blocks (the partly
  filled last block is copied on its next write: the plan's ``block_copies``);
- a parent without a continuation leaves the scheduler at once, returning its blocks.

Beam search runs alone on an engine (no other requests at the same time). Searches are
admitted only while the worst case of all admitted searches fits the pool (a search
counts as a request of ``beam_width`` samples:
:meth:`~pagedllm.engine.llm_engine.LLMEngine.worst_case_blocks`, with contiguous
allocation's up-front slots and sliding windows) and their beams fit one step's token
budget, so the scheduler never preempts a beam and every live beam of a search runs in
the same step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from pagedllm.engine.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    BeamSelector,
    Continuation,
)
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import SequenceStatus, TokenSequence

_RELEASED = SequenceStatus.FINISHED_PRUNED
"""How a beam leaves the scheduler, pruned or at the end of its search."""


@dataclass(eq=False)
class _Search:
    """One prompt's search: its selector and the sequences of its beams, in beam order."""

    key: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: BeamSearchParams
    selector: BeamSelector
    worst_case_blocks: int
    beams: list[TokenSequence] = field(default_factory=list)


class BeamSearchRunner:
    """Runs beam searches on ``engine``; call :meth:`add`, then :meth:`step` until
    :attr:`has_unfinished` is False."""

    def __init__(self, engine: LLMEngine) -> None:
        if engine.has_unfinished_requests():
            raise ValueError("beam search runs alone: the engine still has requests")
        if engine.speculator is not None:
            raise ValueError(
                "beam search does not run with speculative decoding: start the engine "
                "without speculative_config"
            )
        self.engine = engine
        self._pending: deque[_Search] = deque()
        self._active: list[_Search] = []
        self._next_key = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self._pending or self._active)

    @property
    def live_beams(self) -> list[TokenSequence]:
        """The sequences of every admitted search's beams, for inspection."""
        return [seq for search in self._active for seq in search.beams]

    @property
    def _max_live_beams(self) -> int:
        scheduler = self.engine.scheduler
        return min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)

    def add(
        self, prompt_token_ids: list[int], params: BeamSearchParams, prompt: str | None = None
    ) -> int:
        """Queue a search; returns its key (the order of results). Raises ValueError when
        it could never run on this engine."""
        engine = self.engine
        total = len(prompt_token_ids) + params.max_tokens
        if total > engine.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) "
                f"is {total} tokens, beyond max_model_len={engine.max_model_len}"
            )
        if params.beam_width > self._max_live_beams:
            raise ValueError(
                f"beam_width {params.beam_width} exceeds the {self._max_live_beams} sequences "
                "one step may run (max_num_seqs, max_num_batched_tokens)"
            )
        blocks = engine.worst_case_blocks(
            len(prompt_token_ids), params.max_tokens, params.beam_width
        )
        capacity = engine.capacity_blocks()
        if blocks > capacity:
            raise ValueError(f"this search may need {blocks} KV blocks; the pool has {capacity}")
        search = _Search(
            self._next_key,
            prompt,
            list(prompt_token_ids),
            params,
            BeamSelector(params, engine.stop_token_ids),
            blocks,
        )
        self._next_key += 1
        self._pending.append(search)
        return search.key

    def _admit(self) -> None:
        """Start pending searches, first come first served, while the worst cases fit."""
        blocks = sum(search.worst_case_blocks for search in self._active)
        beams = sum(search.params.beam_width for search in self._active)
        while self._pending:
            search = self._pending[0]
            if blocks + search.worst_case_blocks > self.engine.capacity_blocks():
                return
            if beams + search.params.beam_width > self._max_live_beams:
                return
            self._pending.popleft()
            blocks += search.worst_case_blocks
            beams += search.params.beam_width
            root = TokenSequence(
                request_id=f"beam-{search.key}",
                prompt_token_ids=search.prompt_token_ids,
                params=SamplingParams(temperature=0.0, max_tokens=search.params.max_tokens),
                arrival_time=time.monotonic(),
            )
            search.beams = [root]
            self._active.append(search)
            self.engine.scheduler.add(root)

    def step(self) -> list[tuple[int, BeamSearchOutput]]:
        """Run one forward pass over every live beam; returns ``(key, output)`` of the
        searches that finished in it."""
        self._admit()
        logprobs = self._forward()
        finished = []
        for search in list(self._active):
            rows = [logprobs.get(seq.seq_id) for seq in search.beams]
            if all(row is None for row in rows):
                continue  # the prompt is still being prefilled
            if any(row is None for row in rows):
                raise RuntimeError("the beams of one search did not run in the same step")
            continuations = search.selector.step(torch.stack(rows))
            self._advance(search, continuations)
            if search.selector.is_done:
                self._active.remove(search)
                finished.append((search.key, self._output(search)))
        return finished

    def _forward(self) -> dict[int, torch.Tensor]:
        """Schedule, copy blocks on write, run the model, commit the K/V written; returns
        the log-softmax of the next-token logits of each sequence that reached its end."""
        engine = self.engine
        plan = engine.scheduler.schedule()
        if plan.preempted:
            raise RuntimeError("a beam was preempted although the worst case fits the pool")
        if plan.is_empty:
            return {}
        ending, logits = engine.execute_plan(plan)
        logprobs = torch.log_softmax(logits, dim=-1)
        return dict(zip((seq.seq_id for seq in ending), logprobs, strict=True))

    def _advance(self, search: _Search, continuations: list[Continuation]) -> None:
        """Turn ``search.beams`` into the beams of ``continuations``: free the parents
        left without one first, then fork, then extend."""
        scheduler = self.engine.scheduler
        parents = search.beams
        continued = {c.parent for c in continuations}
        for index, seq in enumerate(parents):
            if index not in continued:
                scheduler.finish(seq, _RELEASED)
        beams: list[TokenSequence] = []
        extended: set[int] = set()
        for c in continuations:
            parent = parents[c.parent]
            if c.parent in extended:
                beams.append(self._fork(parent, c.token_id))
            else:
                extended.add(c.parent)
                beams.append(parent)
        for c, seq in zip(continuations, beams, strict=True):
            if seq is parents[c.parent]:
                seq.append_token(c.token_id)
        search.beams = beams

    def _fork(self, parent: TokenSequence, token_id: int) -> TokenSequence:
        """A new running beam sharing every block of ``parent``, extended by ``token_id``.

        Called before ``parent`` itself is extended, so the child copies its tokens so far.
        """
        child = parent.branch()
        self.engine.scheduler.fork(parent, child)
        child.append_token(token_id)
        return child

    def _output(self, search: _Search) -> BeamSearchOutput:
        tokenizer = self.engine.tokenizer
        sequences = [
            BeamSearchSequence(
                prompt_token_ids=search.prompt_token_ids,
                token_ids=list(h.token_ids),
                text=tokenizer.decode(h.token_ids) if tokenizer else None,
                cum_logprob=h.cum_logprob,
                score=h.score,
                finish_reason=h.finish_reason,
            )
            for h in search.selector.hypotheses
        ]
        return BeamSearchOutput(search.prompt, search.prompt_token_ids, sequences)
