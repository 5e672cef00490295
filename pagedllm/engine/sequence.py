"""A sequence: one stream of tokens the scheduler runs, and its life cycle.

States, and the scheduler's transitions between them::

    WAITING   --schedule----------> RUNNING
    RUNNING   --preempt, recompute-> PREEMPTED  (blocks freed; waits in the waiting queue)
    PREEMPTED --schedule----------> RUNNING    (its K/V computed again)
    RUNNING   --preempt, swap-----> SWAPPED    (blocks parked in the second tier)
    SWAPPED   --resume------------> RUNNING    (blocks copied back)
    RUNNING   --finish------------> FINISHED_STOPPED or FINISHED_LENGTH
    unfinished --abort------------> FINISHED_ABORTED
    unfinished --prune------------> FINISHED_PRUNED (a beam that fell out of its search)

A preempted sequence waits again at the front of its priority class: its arrival time
is unchanged, and the waiting queue is ordered by (priority, arrival, sequence id).
Only the scheduler changes a sequence's state; a sample not yet forked from its
request's first sequence (still WAITING, in no queue) is ended by
``Scheduler.finish_unscheduled``.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from pagedllm.engine.sampling_params import SamplingParams

_sequence_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_PRUNED = "pruned"  # a beam that fell out of the search: no output of its own

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """OpenAI/vLLM finish reason: ``"stop"``, ``"length"``, ``"abort"`` or None (also
        for a pruned beam, which is never reported)."""
        if self is SequenceStatus.FINISHED_PRUNED or not self.is_finished:
            return None
        return self.value


_FINISHED = {
    SequenceStatus.FINISHED_STOPPED,
    SequenceStatus.FINISHED_LENGTH,
    SequenceStatus.FINISHED_ABORTED,
    SequenceStatus.FINISHED_PRUNED,
}


@dataclass(eq=False)
class TokenSequence:
    """Token ids of one sequence and how far the KV cache has computed them.

    Invariant: ``0 <= num_computed_tokens <= num_tokens``; the tokens
    ``all_token_ids[num_computed_tokens:]`` still need a forward pass.
    ``num_computed_tokens`` counts the tokens whose K/V exist: in the running sequence's
    blocks, where it equals the block manager's committed count (the kv side's copy of
    the same quantity); parked in the swap space while SWAPPED; none while WAITING or
    PREEMPTED. Only the scheduler changes it, in step with the block manager
    (``Scheduler._advance``; ``Scheduler.check_progress`` checks they agree).
    ``priority``: lower runs earlier (vLLM's convention); priority < 0 may use the
    reserved blocks. ``cache_salt``: sequences with different salts never share cached
    blocks.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    priority: int = 0
    index: int = 0
    cache_salt: str | None = None
    seq_id: int = field(default_factory=lambda: next(_sequence_ids))
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    finished_time: float | None = None
    stop_reason: int | str | None = None
    # Swap blocks parked for logical blocks swap_first_block .. of the preempted table
    # (its compact blocks first, in swap blocks of their kind); with KV layer groups,
    # then those of groups 1, 2, ..., each from logical block swap_more_firsts[g - 1] on
    # (every group's run ends with the computed tokens' last block).
    swap_block_ids: list[int] = field(default_factory=list)
    swap_first_block: int = 0
    swap_more_firsts: list[int] = field(default_factory=list)
    # Leading block-table entries the model runner holds for this sequence, one count
    # per KV layer group; empty (none) whenever the sequence (re)starts on new tables,
    # so its next plan sends them whole.
    table_blocks_sent: list[int] = field(default_factory=list)
    # Prompt positions 0.. whose next-token logprobs were computed (prompt_logprobs);
    # a recompute never computes them twice.
    num_prompt_logprob_positions: int = 0
    # Tokens guessed to follow all_token_ids (speculative decoding), offered to the
    # next step: the scheduler takes what fits and clears them; never part of the
    # sequence until the model verified them.
    draft_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_high_priority(self) -> bool:
        return self.priority < 0

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def prompt_logprob_positions(self, num_tokens: int) -> range:
        """Positions, among the next ``num_tokens`` to compute, whose row gives the
        logprob of the prompt token after it and is still owed (``prompt_logprobs``)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        start = max(self.num_computed_tokens, self.num_prompt_logprob_positions)
        return range(start, min(self.num_computed_tokens + num_tokens, self.num_prompt_tokens - 1))

    @property
    def owes_prompt_logprobs(self) -> bool:
        """Whether prompt positions remain whose logprobs were asked for and not computed:
        such a sequence must compute them, so it takes no prefix-cache hit beyond them."""
        return (
            self.params.prompt_logprobs is not None
            and self.num_prompt_logprob_positions < self.num_prompt_tokens - 1
        )

    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: priority first, then first come first served."""
        return (self.priority, self.arrival_time, self.seq_id)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def branch(self) -> TokenSequence:
        """A new sequence of the same request holding this one's tokens so far (and no
        computed state): the child :meth:`Scheduler.fork` starts from it."""
        child = TokenSequence(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            params=self.params,
            arrival_time=self.arrival_time,
        )
        child.output_token_ids = list(self.output_token_ids)
        child.all_token_ids = list(self.all_token_ids)
        return child

    def reset_for_recompute(self) -> None:
        """Forget the cache: every token (prompt and output so far) is prefilled again."""
        self.num_computed_tokens = 0
        self.draft_token_ids = []
        self.num_preemptions += 1
        self.status = SequenceStatus.PREEMPTED
