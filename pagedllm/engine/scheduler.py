"""Iteration-level scheduling: which sequences run this step, and how many tokens each.

Each step first gives every running sequence its next tokens (one for a decode, a chunk
for a prefill still in progress), in queue order, then fills what is left of the token
budget with prefill chunks of waiting sequences, first come first served within a
priority, up to ``max_num_seqs`` running. Blocks are taken from the pool as sequences
grow. When the pool cannot supply a running sequence, the lowest-priority, most recently
arrived running sequence is preempted by recompute: its blocks go back to the pool and
it waits again ahead of every later arrival of its priority. No new sequence is admitted
in a step that preempted, so a preempted sequence is never overtaken by a newcomer.

Preemption by swap (``preemption_mode`` "swap", or "auto" while the second tier has
room) parks the victim's blocks in the :class:`~pagedllm.kv_storage.swap_space.SwapSpace`
instead; swapped sequences come back, in queue order, before any new admission. With
compact blocks (``kv_cache_dtype="int4"``) each block parks in its own kind, and comes
back in it: the parked compact ones compact, and the full ones full unless they fell
behind the window of the restored tokens (then re-encoded on the way in, as the next
reservation would have).

Read-ahead (``read_ahead``, with prefix caching, one table of full-size blocks): while
swapped sequences wait, those next in the queue whose blocks the pool could hold, after
room for the running sequences' next step, get their evicted parked blocks back ahead of
their turn. Each step's plan takes free blocks for them, caches each under its content
key and leaves it free (:meth:`BlockManager.restore_cached`), and the executor copies
the parked K/V in beside that step's forward pass. The swap-in then finds them as its
prefix hit and copies nothing for them. An allocation in need may evict them like any
cached block, so a read-ahead never causes a preemption.

With prefix caching, a sequence that starts (or restarts after preemption) first takes
the longest chain of cached full blocks of its tokens and computes only the rest. With
lower tiers (:mod:`pagedllm.kv_tiers`), the chain goes on through the blocks the host
tier holds, copied back into fresh pool blocks before the forward pass; a sequence
whose blocks are loading from disk is passed over (others are admitted past it) until
they are in or its wait ends.

With a sliding window on every layer, committing a step's tokens releases the blocks no
later query of the sequence reads (:mod:`pagedllm.kv.block_manager`); their entries
reach the model runner as null entries in the next block-table delta, a swap-out parks
only the blocks still held, and a swap-in copies back only those inside the window.

With KV layer groups (a model whose layers attend differently,
:mod:`pagedllm.kv.layer_groups`), every plan entry carries a slot list and a table
delta per group, a swap-out parks each group's held blocks, and a swap-in restores
each group's blocks inside its window.

Speculative decoding: a decoding sequence may carry guessed tokens
(``TokenSequence.draft_token_ids``). The step runs them after its next token, in the
same allocation call, as far as the token budget and the pool allow (else without
them). Only the sequence's known tokens are committed when the pass is done; the engine
verifies the guesses and then calls :meth:`Scheduler.settle_drafts`, which commits the
kept ones (they are now the sequence's tokens) and rolls the rest back: their slots are
dropped and blocks wholly past the kept tokens return to the pool. Unverified guesses
never reach the prefix cache.

Liveness: a request is only accepted if it fits the pool alone, and the sequence at the
head of the queue can always evict everything behind it, so some sequence always runs.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pagedllm.choice import parse_choice
from pagedllm.config import PreemptionMode
from pagedllm.engine.sequence import SequenceStatus, TokenSequence
from pagedllm.kv.block_manager import BlockManager, CachedPrefix
from pagedllm.kv.block_table import AppendResult
from pagedllm.kv.capacity import cdiv
from pagedllm.kv.prefix_hash import BlockKey, group_key, iter_block_keys
from pagedllm.kv_storage.swap_space import SwapSpace
from pagedllm.kv_tiers.tier_moves import TierMove
from pagedllm.kv_tiers.tiered_cache import TieredCache


@dataclass
class GroupDelta:
    """The slots and block-table delta of one more KV layer group
    (:mod:`pagedllm.kv.layer_groups`), as :class:`ScheduledSequence` has group 0's."""

    slots: list[int]
    table_start: int
    new_block_ids: list[int]


@dataclass
class ScheduledSequence:
    """``num_tokens`` tokens of ``seq``, from ``seq.num_computed_tokens`` on, written at
    ``slots``; ``will_sample`` is True when they reach the end of the sequence, so the step
    yields its next token. The last ``len(draft_token_ids)`` of them are guesses that
    follow the sequence's known tokens (each of their rows is scored too).

    Block-table delta for the model runner: logical blocks ``table_start ..`` of the
    sequence now live in physical blocks ``new_block_ids`` (new blocks, a block replaced
    by copy-on-write, null entries of blocks a sliding window released, or the whole
    table when the sequence starts on a new one). With KV layer groups these are group
    0's, and ``more_groups`` holds the others' (groups 1, 2, ...).
    """

    seq: TokenSequence
    num_tokens: int
    slots: list[int]
    table_start: int = 0
    new_block_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)
    more_groups: list[GroupDelta] = field(default_factory=list)

    @property
    def num_known_tokens(self) -> int:
        """The scheduled tokens that are the sequence's own (not guesses)."""
        return self.num_tokens - len(self.draft_token_ids)

    @property
    def will_sample(self) -> bool:
        return self.seq.num_computed_tokens + self.num_known_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: what runs, the block copies to apply before it, who was
    preempted, and which sequences the model runner can forget.

    Copies are ``(src, dst)`` block pairs, applied in this order: ``swap_out`` (pool ->
    swap space), ``block_encodes`` (full -> compact blocks re-encoded by age),
    ``swap_in`` (swap space -> pool), ``block_copies`` (copy-on-write within the pool).
    A block a swap-out frees is parked before an encode may reuse it; a full block an
    encode frees may take a swap-in or a copy. ``tier_moves`` (spills of evicted cached
    blocks to the lower tiers, fills back from them) run in planned order right after
    the swap-outs (:mod:`pagedllm.kv_tiers.tier_moves`). ``read_ahead``: ``(swap block,
    pool block)`` pairs copied back beside the forward pass, into free cached blocks
    no sequence of the plan touches; the next plan's moves wait for them. ``released``:
    sequence ids that finished or were preempted since the previous plan.
    """

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    block_encodes: list[tuple[int, int]] = field(default_factory=list)
    tier_moves: list[TierMove] = field(default_factory=list)
    read_ahead: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[TokenSequence] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ReadAheadStats:
    """Read-ahead of swapped sequences since start-up: ``blocks`` restored ahead of
    their swap-in (planned copies), ``used_blocks`` of them a swap-in then found in its
    prefix hit (the others were evicted first), ``resumes`` of sequences that had blocks
    read ahead, and ``lead_seconds`` summed over those resumes: from the plan that first
    read ahead for the sequence to its swap-in."""

    blocks: int = 0
    used_blocks: int = 0
    resumes: int = 0
    lead_seconds: float = 0.0


class Scheduler:
    """Owns the waiting and running queues and asks the block manager for slots.

    ``cache_key``: identity of the model (and adapter) whose K/V the cache holds; it is
    part of every cached block's hash, with the sequence's ``cache_salt``. How blocks
    are taken (on demand, or up front in contiguous mode) is the block manager's policy.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cache_key: str = "",
        swap_space: SwapSpace | None = None,
        preemption_mode: PreemptionMode | str = PreemptionMode.RECOMPUTE,
        tiers: TieredCache | None = None,
        prefetch_on_arrival: bool = True,
        read_ahead: bool = False,
    ) -> None:
        self.block_manager = block_manager
        self.read_ahead = read_ahead and swap_space is not None and block_manager.restores_cached
        # swapped sequence id -> (when its read-ahead began, the blocks restored for it)
        self._read_ahead: dict[int, tuple[float, set[int]]] = {}
        self.read_ahead_stats = ReadAheadStats()
        self.cache_key = cache_key
        self.swap_space = swap_space
        self.tiers = tiers
        self.prefetch_on_arrival = prefetch_on_arrival
        self._prefetched: set[int] = set()  # sequence ids whose disk loads were asked
        self.preemption_mode = parse_choice(PreemptionMode, preemption_mode, "preemption_mode")
        self.swapped: list[TokenSequence] = []
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[TokenSequence] = []
        self.running: list[TokenSequence] = []
        self.num_preemptions = 0
        self._released: list[int] = []

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    @property
    def num_preempted_waiting(self) -> int:
        """Waiting sequences that were preempted and wait to be recomputed."""
        return sum(seq.status is SequenceStatus.PREEMPTED for seq in self.waiting)

    def add(self, seq: TokenSequence) -> None:
        bisect.insort(self.waiting, seq, key=TokenSequence.sort_key)
        if self.tiers is not None and self.prefetch_on_arrival:
            self._prefetch(seq)

    def finish(self, seq: TokenSequence, status: SequenceStatus) -> None:
        """End ``seq`` with a finished ``status`` and return its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_space.free(seq.swap_block_ids)
            seq.swap_block_ids = []
            self._read_ahead.pop(seq.seq_id, None)
        elif not seq.is_finished:
            self.waiting.remove(seq)
            if self.tiers is not None:
                self.tiers.forget(seq.seq_id)
                self._prefetched.discard(seq.seq_id)
        seq.status = status

    def finish_unscheduled(self, seq: TokenSequence, status: SequenceStatus) -> None:
        """End ``seq``, which was never handed to the scheduler (a sample still waiting
        to be forked from its request's first), with a finished ``status``: it holds no
        queue place and no block."""
        if seq.status is not SequenceStatus.WAITING or seq in self.waiting:
            raise ValueError(
                f"sequence {seq.seq_id} is {seq.status.name}, not a sample waiting unscheduled"
            )
        seq.status = status

    def fork(self, parent: TokenSequence, child: TokenSequence) -> None:
        """Start ``child`` running as a copy of ``parent``'s computed state, sharing all
        its blocks (the partly filled last block is copied on its first write). The one
        way parallel samples (n > 1) and beam search branch a sequence."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.table_blocks_sent = []
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def update_from_output(self, plan: SchedulerOutput) -> list[TokenSequence]:
        """Record that the plan's forward pass wrote K/V of its tokens: commit them to the
        prefix cache and advance each sequence. Returns the sequences whose known tokens
        are now all computed, in plan order (they sample this step)."""
        ending = []
        for item in plan.scheduled:
            seq = item.seq
            if item.will_sample:
                ending.append(seq)
            owed = seq.prompt_logprob_positions(item.num_tokens)
            if owed:
                seq.num_prompt_logprob_positions = owed.stop
            self._advance(seq, item.num_known_tokens)
        return ending

    def settle_drafts(self, seq: TokenSequence, num_accepted: int) -> int:
        """After verification: ``seq``'s first ``num_accepted`` guesses were kept and
        appended to it (their K/V are written); commit them and roll the rejected
        guesses' slots back. Returns the blocks the rollback released. A sequence that
        finished meanwhile holds nothing and is left alone (returns 0)."""
        if seq.status is not SequenceStatus.RUNNING:
            return 0
        self._advance(seq, num_accepted)
        released = self.block_manager.rollback(seq.seq_id)
        if released and seq.table_blocks_sent:  # the runner's entries past a table are stale
            manager = self.block_manager
            seq.table_blocks_sent = [
                min(sent, len(manager.block_table(seq.seq_id, group)))
                for group, sent in enumerate(seq.table_blocks_sent)
            ]
        return released

    def _advance(self, seq: TokenSequence, num_tokens: int) -> None:
        """The one way a running sequence's progress moves on: K/V of its next
        ``num_tokens`` tokens are written (by this plan's forward pass, or copied back
        from the swap space before it). Commits them to the block manager (its committed
        count, hash chain and sliding window follow) and advances
        ``seq.num_computed_tokens`` by as many, so the two stay equal."""
        start = seq.num_computed_tokens
        released = self.block_manager.commit_tokens(
            seq.seq_id, seq.all_token_ids[start : start + num_tokens]
        )
        if seq.table_blocks_sent and any(released):  # the runner's entries there are stale
            seq.table_blocks_sent = [
                min(sent, gone.start) if gone else sent
                for sent, gone in zip(seq.table_blocks_sent, released, strict=True)
            ]
        seq.num_computed_tokens = start + num_tokens

    def check_progress(self, plan: SchedulerOutput | None = None) -> None:
        """Check every sequence's computed count against the block manager; raise
        AssertionError on the first disagreement. For tests and debugging: O(sequences),
        never called per step.

        ``TokenSequence.num_computed_tokens`` is the engine's count of tokens whose K/V
        exist. Running, it equals the block manager's committed count and the rest follow
        (:meth:`BlockManager.check_progress`): pass the ``plan`` between :meth:`schedule`
        and :meth:`update_from_output`, when the plan's tokens have slots and are not yet
        computed. Swapped, the sequence holds no table and its computed tokens' blocks
        (those a sliding window had not released) are parked. Waiting (new or preempted
        for recompute), it holds nothing and has computed nothing.
        """
        manager = self.block_manager
        scheduled = {} if plan is None else {i.seq.seq_id: i.num_tokens for i in plan.scheduled}
        for seq in self.running:
            manager.check_progress(
                seq.seq_id, seq.num_computed_tokens, scheduled.get(seq.seq_id, 0)
            )
        if manager.num_seqs != len(self.running):
            raise AssertionError(
                f"the block manager holds {manager.num_seqs} sequences, "
                f"{len(self.running)} are running"
            )
        for seq in self.swapped:
            end = cdiv(seq.num_computed_tokens, manager.block_size)
            parked = sum(max(0, end - first) for first in self._swap_firsts(seq))
            if seq.seq_id in manager or len(seq.swap_block_ids) != parked:
                raise AssertionError(
                    f"swapped sequence {seq.seq_id}: {len(seq.swap_block_ids)} parked blocks "
                    f"for {seq.num_computed_tokens} computed tokens from logical block "
                    f"{seq.swap_first_block}, or it still holds a table"
                )
        for seq in self.waiting:
            if seq.seq_id in manager or seq.num_computed_tokens != 0:
                raise AssertionError(
                    f"waiting sequence {seq.seq_id}: {seq.num_computed_tokens} computed "
                    f"tokens, or it still holds a table"
                )

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(released=self._released)
        self._released = []
        budget = self.max_num_batched_tokens
        queue = sorted(self.running, key=TokenSequence.sort_key)
        while queue and budget > 0:
            seq = queue.pop(0)
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            drafts = self._take_drafts(seq, budget - num_tokens)
            if drafts and self._append(seq, num_tokens, out, drafts=drafts):
                budget -= num_tokens + len(drafts)
                continue
            while not self._append(seq, num_tokens, out):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                budget -= num_tokens
        if not out.preempted:
            budget = self._swap_in(budget, out)
            if not self.swapped:
                self._admit_waiting(budget, out)
            elif self.read_ahead:
                self._read_ahead_swapped(out)
        if self.tiers is not None:
            out.tier_moves = self.tiers.take_moves()
        return out

    @staticmethod
    def _take_drafts(seq: TokenSequence, budget: int) -> list[int]:
        """The guesses ``seq`` offers to run after its next token, within ``budget``
        tokens; only a decoding sequence (one known token to compute) runs guesses.
        Clears the offer: guesses live one step."""
        drafts, seq.draft_token_ids = seq.draft_token_ids, []
        if seq.num_uncomputed_tokens != 1:
            return []
        return drafts[: max(0, budget)]

    def _free(self, seq: TokenSequence) -> None:
        """Return ``seq``'s blocks to the pool; the runner drops its table next plan."""
        self.block_manager.free(seq.seq_id)
        seq.table_blocks_sent = []
        self._released.append(seq.seq_id)

    def _swap_in(self, budget: int, out: SchedulerOutput) -> int:
        """Bring swapped sequences back while their blocks (and their next tokens) fit."""
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            parked = seq.num_computed_tokens
            # The parked blocks still cached in the pool are taken as a prefix hit (no
            # copy), while each is of the kind the sequence comes back with there; one
            # allocation covers the other parked tokens and the new ones (only the new
            # ones run; with a sliding window, only the parked blocks inside the window
            # come back; with compact blocks, those parked compact and those behind the
            # window come back compact); the copied-in blocks join the prefix cache again.
            manager = self.block_manager
            tokens = seq.all_token_ids
            extra_keys = self._extra_keys(seq)
            prefix = manager.find_cached_prefix(tokens[: parked + 1], extra_keys, for_swap_in=True)
            copied = parked - prefix.num_tokens
            compact_end = self._parked_compact_end(seq)
            if not self._append(seq, num_tokens, out, prefix, copied, compact_end=compact_end):
                break
            self._note_resume(seq, prefix)
            end = cdiv(parked, manager.block_size)
            swap_ids = iter(seq.swap_block_ids)  # group by group
            for group, parked_from in enumerate(self._swap_firsts(seq)):
                table = manager.block_table(seq.seq_id, group)
                group_ids = [next(swap_ids) for _ in range(parked_from, end)]
                first = max(len(prefix.block_ids), manager.num_null_blocks(seq.seq_id, group))
                out.swap_in.extend(
                    (group_ids[i - parked_from], table[i]) for i in range(first, end)
                )
            # their K/V are back before this plan's forward pass reads any of them
            self._advance(seq, copied)
            self.swap_space.unpark(seq.swap_block_ids)
            seq.swap_block_ids = []
            self.swapped.pop(0)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            budget -= num_tokens
        return budget

    def _read_ahead_swapped(self, out: SchedulerOutput) -> None:
        """Restore the evicted parked blocks of the swapped sequences that resume next
        (queue order), into the free blocks the pool has past the running sequences'
        next step: the head sequence partly if that is all there is room for, a later one
        only after every earlier one's blocks fit. Adds the copies to the plan."""
        manager = self.block_manager
        size = manager.block_size
        pending = sum(seq.num_uncomputed_tokens for seq in self.running)
        pending = max(0, pending - out.num_batched_tokens)  # this plan's have their blocks
        headroom = len(self.running) + cdiv(min(pending, self.max_num_batched_tokens), size)
        room = manager.pool.num_available() - headroom
        now = time.perf_counter()
        for seq in self.swapped:
            if room <= 0:
                return
            parked = seq.num_computed_tokens
            tokens = seq.all_token_ids[: parked + 1]
            prefix = manager.find_cached_prefix(tokens, self._extra_keys(seq), for_swap_in=True)
            restored = manager.restore_cached(prefix, tokens[:parked], room)
            room -= cdiv(parked + 1, size)
            if not restored:
                continue
            out.read_ahead.extend((seq.swap_block_ids[i], block) for i, block in restored)
            _, blocks = self._read_ahead.setdefault(seq.seq_id, (now, set()))
            blocks.update(block for _, block in restored)
            self.read_ahead_stats.blocks += len(restored)

    def _note_resume(self, seq: TokenSequence, prefix: CachedPrefix) -> None:
        """Count the blocks read ahead for ``seq`` that its swap-in finds in ``prefix``."""
        entry = self._read_ahead.pop(seq.seq_id, None)
        if entry is None:
            return
        since, blocks = entry
        stats = self.read_ahead_stats
        stats.used_blocks += len(blocks.intersection(prefix.block_ids))
        stats.resumes += 1
        stats.lead_seconds += time.perf_counter() - since

    @staticmethod
    def _swap_firsts(seq: TokenSequence) -> list[int]:
        """The first logical block each KV layer group of swapped ``seq`` parked."""
        return [seq.swap_first_block, *seq.swap_more_firsts]

    def _parked_compact_end(self, seq: TokenSequence) -> int:
        """The compact end of ``seq``'s table when it was parked: its parked compact
        blocks come first, from logical block ``swap_first_block`` on (0 when none)."""
        num_compact = sum(map(self.swap_space.is_compact, seq.swap_block_ids))
        return seq.swap_first_block + num_compact if num_compact else 0

    def _admit_waiting(self, budget: int, out: SchedulerOutput) -> None:
        """Start waiting sequences in queue order while they fit; with lower tiers, one
        whose blocks are still loading from disk is passed over until they are in (or
        its wait ends), and a hit the pool's prefix leaves off continues from the host
        tier, copied into the pool before the forward pass."""
        manager = self.block_manager
        index = 0
        while index < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[index]
            if not self._loads_done(seq):
                index += 1
                continue
            prefix = manager.find_cached_prefix(self._cacheable(seq), self._extra_keys(seq))
            run = self._host_run(seq, prefix)
            restored = len(run) // manager.num_groups * manager.block_size
            num_tokens = min(seq.num_tokens - prefix.num_tokens - restored, budget)
            admitted = self._append(seq, num_tokens, out, prefix=prefix, parked=restored)
            if run:
                self._fill(seq, prefix, run, admitted)
            if not admitted:
                return
            self.waiting.pop(index)
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            budget -= num_tokens

    # -- lower tiers of the prefix cache -------------------------------------------------

    def _block_keys(self, seq: TokenSequence, prefix: CachedPrefix | None = None):
        """The keys of ``seq``'s cacheable full blocks past ``prefix`` (lazily)."""
        cacheable = self._cacheable(seq)
        start = 0 if prefix is None else prefix.num_tokens
        parent = prefix.keys[-1].digest if prefix is not None and prefix.keys else None
        tokens = cacheable[start : len(cacheable) - 1]
        return iter_block_keys(tokens, self.block_manager.block_size, self._extra_keys(seq), parent)

    def _group_keys(self, keys: Iterable[BlockKey]) -> Iterator[BlockKey]:
        """Each content key as the keys of its blocks in every KV layer group, block by
        block (the key itself with one group)."""
        groups = range(self.block_manager.num_groups)
        return (group_key(key, group) for key in keys for group in groups)

    def _prefetch(self, seq: TokenSequence) -> None:
        """Ask the tiers to load ``seq``'s cached blocks from disk (every group's)."""
        self._prefetched.add(seq.seq_id)
        pool = self.block_manager.pool
        keys = self._group_keys(self._block_keys(seq))
        self.tiers.prefetch(seq.seq_id, keys, lambda k: pool.lookup(k) is not None)

    def _loads_done(self, seq: TokenSequence) -> bool:
        """Whether ``seq`` may start: no tiers, or none of its disk loads in flight (its
        loads start here if they did not when it arrived)."""
        if self.tiers is None:
            return True
        if seq.seq_id not in self._prefetched:
            self._prefetch(seq)
        if not self.tiers.admissible(seq.seq_id):
            return False
        self._prefetched.discard(seq.seq_id)
        return True

    def _host_run(self, seq: TokenSequence, prefix: CachedPrefix) -> list:
        """The host tier's blocks continuing ``prefix`` (none without tiers): each
        content block's block of every KV layer group in turn, whole content blocks
        only (the host tier holds a sliding group's blocks past its window too, as the
        pool evicted them)."""
        if self.tiers is None:
            return []
        run = self.tiers.host_run(self._group_keys(self._block_keys(seq, prefix)))
        whole = len(run) - len(run) % self.block_manager.num_groups
        self.tiers.unpin(run[whole:])
        return run[:whole]

    def _fill(self, seq: TokenSequence, prefix: CachedPrefix, run: list, admitted: bool) -> None:
        """Copy the host blocks of ``run`` into the blocks ``seq`` was just given after
        ``prefix`` in each group (not into null entries: a sliding group's blocks out
        of its window), and count their tokens computed (unpin them if it was not
        admitted)."""
        if not admitted:
            self.tiers.unpin(run)
            return
        manager = self.block_manager
        num_groups, null = manager.num_groups, manager.pool.null_block
        first = len(prefix.block_ids)
        num_blocks = len(run) // num_groups
        fills, targets = [], []
        for group in range(num_groups):
            table = manager.block_table(seq.seq_id, group)[first : first + num_blocks]
            entries = run[group::num_groups]
            self.tiers.unpin([entry for entry, b in zip(entries, table, strict=True) if b == null])
            fills += [entry for entry, b in zip(entries, table, strict=True) if b != null]
            targets += [b for b in table if b != null]
        self.tiers.fill(fills, targets)
        self._advance(seq, num_blocks * manager.block_size)

    @staticmethod
    def _cacheable(seq: TokenSequence) -> list[int]:
        """The tokens a prefix-cache hit may cover, plus one: a sequence that still owes
        prompt logprobs computes those positions, so its hit stops before them."""
        if seq.owes_prompt_logprobs:
            return seq.all_token_ids[: seq.num_prompt_logprob_positions + 1]
        return seq.all_token_ids

    def _extra_keys(self, seq: TokenSequence) -> tuple[str, ...]:
        if seq.cache_salt is None:
            return (self.cache_key,)
        return (self.cache_key, seq.cache_salt)

    def _append(
        self,
        seq: TokenSequence,
        num_tokens: int,
        out: SchedulerOutput,
        prefix: CachedPrefix | None = None,
        parked: int = 0,
        drafts: list[int] | None = None,
        compact_end: int = 0,
    ) -> bool:
        """Allocate slots for ``num_tokens`` tokens of ``seq`` (after ``parked`` tokens
        whose K/V come back from the swap space, the logical blocks before
        ``compact_end`` compact; followed by the guessed ``drafts``) and add them to the
        plan with their block-table delta; False, changing nothing, when the blocks are
        not there.

        With a ``prefix`` the sequence starts a new table on that hit: its computed count
        starts where the block manager's committed count does, at the hit's tokens (the
        parked ones follow through :meth:`_advance`)."""
        manager = self.block_manager
        drafts = drafts or []
        num_tokens += len(drafts)
        result = manager.allocate_slots(
            seq.seq_id, parked + num_tokens, seq.is_high_priority, prefix, parked, compact_end
        )
        if result is None:
            return False
        if prefix is not None:
            seq.num_computed_tokens = prefix.num_tokens
        out.block_copies.extend(result.copies)
        out.block_encodes.extend(result.encodes)
        if not seq.table_blocks_sent:
            seq.table_blocks_sent = [0] * manager.num_groups
        more = [  # the other KV layer groups' deltas (none without groups)
            GroupDelta(*self._delta(seq, group, appended, parked))
            for group, appended in enumerate(result.more_groups, start=1)
        ]
        slots, start, new_block_ids = self._delta(seq, 0, result, parked)
        out.scheduled.append(
            ScheduledSequence(seq, num_tokens, slots, start, new_block_ids, drafts, more)
        )
        return True

    def _delta(
        self, seq: TokenSequence, group: int, appended: AppendResult, parked: int
    ) -> tuple[list[int], int, list[int]]:
        """``(slots, table_start, new_block_ids)`` for ``group`` of ``seq`` after
        ``appended``: the slots of the tokens computed (past the ``parked`` ones copied
        in), and the table entries the runner lacks or that changed; records what it
        was sent."""
        sent = seq.table_blocks_sent
        start = min(sent[group], appended.first_changed)
        new_block_ids = self.block_manager.block_ids_from(seq.seq_id, start, group)
        sent[group] = start + len(new_block_ids)
        return appended.slots[parked:] if parked else appended.slots, start, new_block_ids

    def _preempt(self, seq: TokenSequence, out: SchedulerOutput) -> None:
        """Take ``seq``'s blocks back: park them in the swap space, or drop them and
        queue ``seq`` again for recompute."""
        self.running.remove(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)
        # the held blocks of computed tokens (not null entries a sliding window released,
        # nor blocks held up front for later tokens)
        manager = self.block_manager
        num_computed_blocks = cdiv(seq.num_computed_tokens, manager.block_size)
        firsts = [manager.num_null_blocks(seq.seq_id, g) for g in range(manager.num_groups)]
        block_ids = [  # group by group (KV layer groups)
            block_id
            for group, first in enumerate(firsts)
            for block_id in manager.block_table(seq.seq_id, group)[first:num_computed_blocks]
        ]
        # compact entries come first and hold committed tokens only
        num_compact = max(0, manager.compact_end(seq.seq_id) - firsts[0])
        num_full = len(block_ids) - num_compact
        if self._swaps(seq, num_full, num_compact):
            seq.swap_block_ids = self.swap_space.park(num_full, num_compact)
            seq.swap_first_block, *seq.swap_more_firsts = firsts
            out.swap_out.extend(zip(block_ids, seq.swap_block_ids, strict=True))
            self._free(seq)
            seq.status = SequenceStatus.SWAPPED
            seq.num_preemptions += 1
            bisect.insort(self.swapped, seq, key=TokenSequence.sort_key)
            return
        self._free(seq)
        seq.reset_for_recompute()
        self.add(seq)

    def _swaps(self, seq: TokenSequence, num_full: int, num_compact: int) -> bool:
        """The preemption rule. "recompute" never swaps. "swap" swaps whenever the second
        tier has room for ``num_full`` full-size and ``num_compact`` compact blocks.
        "auto" also needs at least one full block of computed tokens: copying a token's
        K/V costs microseconds where recomputing it costs milliseconds (docs/engine.md
        has the measurements), but a sequence with less than a block computed is cheaper
        to recompute than to park."""
        if self.swap_space is None or self.preemption_mode is PreemptionMode.RECOMPUTE:
            return False
        if (
            self.preemption_mode is PreemptionMode.AUTO
            and seq.num_computed_tokens < self.block_manager.block_size
        ):
            return False
        return self.swap_space.can_hold(num_full, num_compact)
