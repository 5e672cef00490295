"""A hypothesis state machine over the block manager, checked against a shadow memory.

The shadow memory maps each flat cache slot to the K/V "content" written there. The
content of a sequence's token at position p is its cache salt and its token ids up to p,
which is what real K/V depend on (the salt stands in for everything that must keep two
requests apart). After every step each sequence must read back, through its block table,
the content it wrote, and every cached block must still hold the content its key names,
whatever other sequences wrote, forked, evicted or freed meanwhile (or guessed and
rolled back: a speculative step writes guesses it may not keep). With a sliding
window, each sequence reads back only the positions its next query can see, holds no
block before them, and prefix hits need only the cached blocks inside the window.
With compact blocks (precision by age), full blocks wholly behind a recent window are
re-encoded into compact ones (the shadow copies their content, as the cache encodes
it) and a prefix hit takes compact blocks only behind its own window; a swap-in brings
a parked table's compact entries back compact (and the restored blocks behind the
window, while compact blocks are free), the shadow copying their content in.
Listeners on the pool (the events the dashboard and kv-events stream are built from)
must see every change: a mirror kept from the events alone equals the pool.

A third machine runs the prefix cache's lower tiers (:mod:`pagedllm.kv_tiers`) over a real
cache tensor, as the scheduler and executor drive them: see :class:`TieredKVMachine`.

A stress run, by hand: ``PAGEDLLM_STATE_MACHINE_SCALE=20`` runs every machine here with
20 times its examples (``--hypothesis-seed=N`` repeats one run).
"""

import functools
import hashlib
import os
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.kv.block_manager import BlockManager, CachedPrefix
from pagedllm.kv.fragmentation import FragmentationStats, fragmentation_stats
from pagedllm.kv.prefix_hash import BlockKey, iter_block_keys
from pagedllm.kv_tiers.disk_tier import DiskTier, slot_bytes_for
from pagedllm.kv_tiers.host_tier import HostTier
from pagedllm.kv_tiers.tier_moves import MoveKind, TierMove
from pagedllm.kv_tiers.tiered_cache import TieredCache
from pagedllm.server.dashboard.recorder import PoolRecorder

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=12)
SYSTEM_PROMPTS = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1] * 12)
# Prompts sharing a system prompt's first tokens, so that prefix-cache hits are common.
PROMPTS = st.builds(
    lambda system, length, tail: system[:length] + tail,
    st.sampled_from(SYSTEM_PROMPTS),
    st.integers(0, 12),
    TOKENS,
)
SALTS = st.sampled_from(["tenant-a", "tenant-b"])
EXAMPLES_SCALE = int(os.environ.get("PAGEDLLM_STATE_MACHINE_SCALE", "1"))


class MirrorListener:
    """Reference counts and content keys kept from pool events alone."""

    def __init__(self, num_blocks):
        self.ref_counts = [0] * num_blocks
        self.keys = {}

    def blocks_taken(self, block_ids):
        for block_id in block_ids:
            assert self.ref_counts[block_id] == 0
            self.ref_counts[block_id] = 1

    def blocks_referenced(self, block_ids):
        for block_id in block_ids:
            self.ref_counts[block_id] += 1

    def blocks_released(self, block_ids, by_window):
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1

    def block_stored(self, block_id, key):
        self.keys[block_id] = key

    def block_removed(self, block_id, key):
        assert self.keys.pop(block_id) == key

    def cache_cleared(self, block_ids):
        for block_id in block_ids:
            del self.keys[block_id]


@dataclass
class ShadowSequence:
    salt: str
    tokens: list[int]
    num_committed: int = 0
    reserved_tokens: int = 0

    def content(self, position: int):
        return self.salt, tuple(self.tokens[: position + 1])


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 32),
        reserved_fraction=st.sampled_from([0.0, 0.1, 0.25]),
        enable_prefix_caching=st.booleans(),
        upfront_tokens=st.sampled_from([None, None, None, 0, 5, 40]),
        sliding_window=st.sampled_from([None, None, 1, 3, 6, 13]),
        recent_tokens=st.sampled_from([None, None, 0, 3, 7]),
        num_compact_blocks=st.integers(1, 24),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        reserved_fraction,
        enable_prefix_caching,
        upfront_tokens,
        sliding_window,
        recent_tokens,
        num_compact_blocks,
    ):
        """``upfront_tokens``: None allocates on demand; a number is the contiguous
        baseline, every sequence holding that many slots from its start. A
        ``sliding_window`` (tokens) releases blocks, on demand only. ``recent_tokens``
        (on demand, no window): blocks behind that many recent tokens become compact."""
        if upfront_tokens is not None:
            sliding_window = None
        if recent_tokens is None or upfront_tokens is not None or sliding_window is not None:
            recent_tokens, num_compact_blocks = None, 0
        self.manager = BlockManager(
            num_blocks,
            block_size,
            reserved_fraction,
            enable_prefix_caching,
            upfront_tokens,
            sliding_window,
            num_compact_blocks,
            recent_tokens,
        )
        self.pool = self.manager.pool
        # full blocks, the null block, then the compact ones
        self.block_ids = range(self.pool.compact_offset + num_compact_blocks)
        self.mirror = MirrorListener(len(self.block_ids))
        self.pool.add_listener(self.mirror)
        self.recorder = PoolRecorder(self.pool, "CPU")
        self.recorder.kv_events = True
        self.pool.add_listener(self.recorder)
        self.page_view: dict[int, tuple] = {}  # what a page knows from the recorder
        self.stored_hashes: set[str] = set()  # what a kv-events reader knows
        self.block_size = block_size
        self.memory: dict[int, tuple] = {}
        self.cached_content: dict[bytes, tuple] = {}
        self.seqs: dict[int, ShadowSequence] = {}
        self.next_seq_id = 0

    # -- helpers -------------------------------------------------------------------------

    def snapshot(self):
        refs = [self.pool.ref_count(b) for b in self.block_ids]
        tables = {s: self.manager.block_table(s) for s in self.seqs}
        keys = [self.pool.block_key(b) for b in self.block_ids]
        stats = self.manager.stats()
        return refs, tables, keys, self.pool.free_block_ids(), stats

    def block_content(self, block_id):
        first = block_id * self.block_size
        return tuple(self.memory.get(first + offset) for offset in range(self.block_size))

    def write(
        self,
        seq_id,
        shadow,
        new_tokens,
        high_priority,
        commit,
        prefix=None,
        restored=0,
        compact_end=0,
    ):
        """Reserve slots for ``new_tokens``, copy, write their K/V, and ``commit`` them
        (else they wait, as when the engine schedules before the model step has run).
        The first ``restored`` of them are copied in (a swap-in): those out of the window
        of the first computed one get no slot, those of logical blocks before
        ``compact_end`` (parked compact) land in compact blocks.

        Returns False (after checking nothing changed) when the blocks are not available.
        """
        manager, block_size = self.manager, self.block_size
        args = (seq_id, len(new_tokens), high_priority, prefix, restored, compact_end)
        expected_ok = manager.can_append(*args)
        starts = seq_id not in manager
        before = self.snapshot()
        table_before = [] if starts else manager.block_table(seq_id)
        result = manager.allocate_slots(*args)
        if result is None:
            assert not expected_ok
            assert self.snapshot() == before
            return False
        assert expected_ok
        # the delta a model runner applies: entries before first_changed are unchanged
        table = manager.block_table(seq_id)
        assert result.first_changed <= min(len(table), len(table_before))
        assert table[: result.first_changed] == table_before[: result.first_changed]
        changed = [i for i, (a, b) in enumerate(zip(table, table_before, strict=False)) if a != b]
        if changed or len(table) != len(table_before) or starts:
            first = min([len(table_before), *changed]) if not starts else 0
            assert result.first_changed == first, "first_changed is the first entry that changed"
        if starts:
            shadow.reserved_tokens = manager.upfront_tokens or 0
        for full, compact in result.encodes:  # before anything else, as the cache does
            event("a block re-encoded")
            assert self.pool.is_compact(compact) and not self.pool.is_compact(full)
            for offset in range(block_size):
                self.memory[compact * block_size + offset] = self.memory[full * block_size + offset]
        for src, dst in result.copies:
            assert self.pool.ref_count(dst) == 1
            for offset in range(block_size):
                src_slot, dst_slot = src * block_size + offset, dst * block_size + offset
                if src_slot in self.memory:
                    self.memory[dst_slot] = self.memory[src_slot]
        first_query = len(shadow.tokens) + restored
        for slot, token in zip(result.slots, new_tokens, strict=True):
            shadow.tokens.append(token)
            position = len(shadow.tokens) - 1
            if slot < 0:
                assert position < first_query, "a computed token has no slot"
                assert position <= first_query - manager.sliding_window, "in the window"
                continue
            assert self.pool.ref_count(slot // block_size) == 1, "wrote a shared block"
            compact = self.pool.is_compact(slot // block_size)
            if position >= first_query:
                assert not compact, "wrote a compact block"
            elif position // block_size < compact_end:
                assert compact, "a parked compact block came back full"
            elif compact:  # copied in, or re-encoded from its parked bytes
                event("a restored block came back compact")
            self.memory[slot] = shadow.content(position)
        self.seqs[seq_id] = shadow
        if commit:
            self.commit(seq_id)
        return True

    def commit(self, seq_id, count=None):
        """Commit the sequence's pending tokens (the first ``count`` of them if given); a
        sliding window releases blocks then."""
        shadow = self.seqs[seq_id]
        held = self.manager.held_block_ids(seq_id)
        num_null = self.manager.num_null_blocks(seq_id)
        end = len(shadow.tokens) if count is None else shadow.num_committed + count
        released = self.manager.commit_tokens(seq_id, shadow.tokens[shadow.num_committed : end])
        shadow.num_committed = end
        assert released == [range(num_null, self.manager.live_from(shadow.num_committed))]
        event("window released blocks" if released[0] else "nothing released")
        self.record_cached_blocks(held)

    def record_cached_blocks(self, block_ids):
        """Remember the content each newly cached block holds; equal keys, equal content."""
        for block_id in block_ids:
            key = self.pool.block_key(block_id)
            if key is None:
                continue
            content = self.block_content(block_id)
            assert self.cached_content.setdefault(key.digest, content) == content

    def admit(
        self, new_tokens, high_priority, shadow, prefix, restored=0, commit=True, compact_end=0
    ):
        """Start a sequence; commit its tokens, or only the ``restored`` ones (as the
        scheduler does at a swap-in: the others wait for the step)."""
        seq_id = self.new_id()
        args = (prefix, restored, compact_end)
        if not self.write(seq_id, shadow, new_tokens, high_priority, commit, *args):
            assert seq_id not in self.manager
        elif not commit:
            self.commit(seq_id, restored)

    def new_id(self):
        self.next_seq_id += 1
        return self.next_seq_id - 1

    def pick(self, index):
        return sorted(self.seqs)[index % len(self.seqs)]

    # -- rules ---------------------------------------------------------------------------

    @rule(prompt=PROMPTS, high_priority=st.booleans(), salt=SALTS)
    def new_sequence(self, prompt, high_priority, salt):
        """Admit a prompt without looking up the prefix cache (it is never cached)."""
        self.admit(prompt, high_priority, ShadowSequence(salt, []), prefix=None)

    @rule(prompt=PROMPTS, high_priority=st.booleans(), salt=SALTS)
    def new_sequence_on_cached_prefix(self, prompt, high_priority, salt):
        """Admit a prompt on its longest cached prefix; only the rest is computed."""
        prefix = self.manager.find_cached_prefix(prompt, (salt,))
        skipped = prefix.num_tokens
        assert skipped <= max(0, len(prompt) - 1)
        event(f"prefix hit of {skipped // self.block_size} blocks" if skipped else "miss")
        shadow = ShadowSequence(salt, prompt[:skipped], num_committed=skipped)
        self.admit(prompt[skipped:], high_priority, shadow, prefix)

    @rule(prompt=PROMPTS, high_priority=st.booleans(), salt=SALTS, data=st.data())
    def swap_in(self, prompt, high_priority, salt, data):
        """A preempted sequence coming back, as the scheduler brings it: of its
        ``parked`` computed tokens, the cached prefix found for a swap-in, then tokens
        whose K/V are copied in (restored), then tokens computed now. Its parked table
        had ``compact_end`` compact entries (at most those behind the window)."""
        parked = data.draw(st.integers(0, max(0, len(prompt) - 1)), label="parked tokens")
        prefix = self.manager.find_cached_prefix(prompt[: parked + 1], (salt,), for_swap_in=True)
        skipped = prefix.num_tokens
        compact_end = data.draw(st.integers(0, self.manager.compact_before(parked)))
        shadow = ShadowSequence(salt, prompt[:skipped], num_committed=skipped)
        commit = data.draw(st.booleans(), label="commit the computed tokens too")
        args = (prefix, parked - skipped, commit, compact_end)
        self.admit(prompt[skipped:], high_priority, shadow, *args)

    @precondition(lambda self: self.manager.restores_cached)
    @rule(prompt=PROMPTS, salt=SALTS, data=st.data())
    def read_ahead(self, prompt, salt, data):
        """A swapped sequence's parked blocks restored ahead of its swap-in, as the
        scheduler plans it and the executor copies: they come back free and cached
        under their keys, holding the parked K/V, later chain blocks nearer the head of
        the free queue (evicted first); no table or held block changes, and the
        sequence's next swap-in finds the chain through the last restored block."""
        parked = data.draw(st.integers(0, max(0, len(prompt) - 1)), label="parked tokens")
        max_blocks = data.draw(st.integers(0, 8), label="room")
        query = prompt[: parked + 1]
        prefix = self.manager.find_cached_prefix(query, (salt,), for_swap_in=True)
        _, tables, _, _, _ = self.snapshot()
        held = {b: self.pool.ref_count(b) for table in tables.values() for b in table}
        restored = self.manager.restore_cached(prefix, prompt[:parked], max_blocks)
        assert len(restored) <= max_blocks
        event(f"{len(restored)} blocks read ahead" if restored else "nothing to read ahead")
        shadow = ShadowSequence(salt, list(prompt[:parked]))
        block_size = self.block_size
        for index, block_id in restored:
            assert self.pool.ref_count(block_id) == 0 and self.pool.block_key(block_id)
            for offset in range(block_size):
                self.memory[block_id * block_size + offset] = shadow.content(
                    index * block_size + offset
                )
        self.record_cached_blocks([block_id for _, block_id in restored])
        assert {s: self.manager.block_table(s) for s in self.seqs} == tables
        assert {b: self.pool.ref_count(b) for b in held} == held
        if restored:
            queue = self.pool.free_block_ids()
            order = [queue.index(block_id) for _, block_id in restored]
            assert order == sorted(order, reverse=True), "later blocks are evicted first"
            again = self.manager.find_cached_prefix(query, (salt,), for_swap_in=True)
            assert again.num_tokens >= (restored[-1][0] + 1) * block_size

    @precondition(lambda self: self.seqs)
    @rule(
        index=st.integers(0, 99),
        new_tokens=TOKENS,
        high_priority=st.booleans(),
        commit=st.booleans(),
    )
    def append(self, index, new_tokens, high_priority, commit):
        seq_id = self.pick(index)
        self.write(seq_id, self.seqs[seq_id], new_tokens, high_priority, commit)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99), data=st.data())
    def commit_pending(self, index, data):
        """The model step has run: the waiting tokens' K/V (or the first of them) are
        now committed."""
        seq_id = self.pick(index)
        shadow = self.seqs[seq_id]
        pending = len(shadow.tokens) - shadow.num_committed
        count = data.draw(st.one_of(st.none(), st.integers(0, pending)), label="count")
        self.commit(seq_id, count)

    @precondition(lambda self: self.seqs)
    @rule(
        index=st.integers(0, 99),
        known=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        guesses=st.lists(st.integers(0, 2), min_size=1, max_size=9),
        high_priority=st.booleans(),
        data=st.data(),
    )
    def speculate(self, index, known, guesses, high_priority, data):
        """A speculative step: slots for the known tokens and the guesses after them in
        one allocation, all written; then the known tokens and the kept guesses are
        committed and the rejected guesses rolled back (their blocks wholly past the
        kept tokens return to the pool; a contiguous reservation keeps its own)."""
        seq_id = self.pick(index)
        shadow = self.seqs[seq_id]
        self.commit(seq_id)  # the previous step's tokens are done
        if not self.write(seq_id, shadow, known + guesses, high_priority, commit=False):
            return
        accepted = data.draw(st.integers(0, len(guesses)), label="guesses kept")
        self.commit(seq_id, len(known) + accepted)
        table_before = len(self.manager.block_table(seq_id))
        free_before = self.pool.num_free
        released = self.manager.rollback(seq_id)
        del shadow.tokens[shadow.num_committed :]
        kept = max(
            -(-shadow.num_committed // self.block_size),
            -(-shadow.reserved_tokens // self.block_size),
            self.manager.num_null_blocks(seq_id),
        )
        assert released == table_before - kept
        assert len(self.manager.block_table(seq_id)) == kept
        assert self.pool.num_free == free_before + released
        event(f"rollback released {released} blocks")

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def fork(self, index):
        parent = self.pick(index)
        child = self.new_id()
        free_before = self.pool.num_free
        self.manager.fork(parent, child)
        assert self.pool.num_free == free_before
        shadow = self.seqs[parent]
        self.seqs[child] = ShadowSequence(
            shadow.salt, list(shadow.tokens), shadow.num_committed, shadow.reserved_tokens
        )

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def free_sequence(self, index):
        """A sequence finishing, or being preempted: all its blocks go back at once."""
        seq_id = self.pick(index)
        self.manager.free(seq_id)
        del self.seqs[seq_id]

    @rule()
    def reset_prefix_cache(self):
        """Done only when no cached block is held; otherwise nothing changes."""
        held = any(
            self.pool.ref_count(b) and self.pool.block_key(b) is not None for b in self.block_ids
        )
        assert self.pool.reset_prefix_cache() is not held
        if not held:
            assert self.pool.stats().cached == 0

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def listeners_see_every_change(self):
        """The events alone rebuild the pool's reference counts and keys; the blocks
        the recorder names as changed bring a page's view up to date; the kv events
        bring a reader's set of stored hashes up to date."""
        pool = self.pool
        blocks = self.block_ids
        assert self.mirror.ref_counts == [pool.ref_count(b) for b in blocks]
        cached = {b: pool.block_key(b) for b in blocks if pool.block_key(b) is not None}
        assert self.mirror.keys == cached
        for block_id in self.recorder.take_changed():
            self.page_view[block_id] = (pool.ref_count(block_id), pool.block_key(block_id))
        for block_id in blocks:
            state = (pool.ref_count(block_id), pool.block_key(block_id))
            assert self.page_view.get(block_id, (0, None)) == state
        for kv_event in self.recorder.take_kv_events():
            if kv_event["type"] == "BlockStored":
                self.stored_hashes.update(kv_event["block_hashes"])
            elif kv_event["type"] == "BlockRemoved":
                self.stored_hashes.difference_update(kv_event["block_hashes"])
            else:
                self.stored_hashes.clear()
        assert self.stored_hashes == {key.digest.hex() for key in cached.values()}
        for block_id in blocks:
            if self.recorder.flags(block_id):
                event("a block released by the window")
                assert self.manager.sliding_window is not None
                assert pool.ref_count(block_id) == 0

    @invariant()
    def blocks_are_free_xor_referenced_and_counted_by_holders(self):
        """A block's references are its holders, plus, for the twin of a full block,
        the full block's (its readers that have not switched yet)."""
        pool = self.pool
        holders = [0] * len(self.block_ids)
        for seq_id in self.seqs:
            for block_id in self.manager.held_block_ids(seq_id):
                holders[block_id] += 1
        references = list(holders)
        for block_id in range(pool.num_blocks):
            twin = pool.twin(block_id)
            if twin is not None:
                event("a twin outlives a reader")
                assert holders[block_id] > 0 and pool.block_key(block_id) is None
                references[twin] += holders[block_id]
        free = [*pool.free_block_ids(), *pool.compact_free_block_ids()]
        assert len(free) == len(set(free))
        assert pool.null_block not in free and pool.ref_count(pool.null_block) == 0
        for block_id in self.block_ids:
            if block_id != pool.null_block:
                assert pool.ref_count(block_id) == references[block_id]
                assert (block_id in free) == (references[block_id] == 0)
        stats = pool.stats()
        keyed = [b for b in self.block_ids if pool.block_key(b) is not None]
        assert stats.shared == sum(count > 1 for count in references)
        assert stats.cached == len(keyed)
        assert stats.evictable == sum(references[b] == 0 for b in keyed)
        assert stats.compact_used == sum(
            references[b] > 0 for b in self.block_ids if pool.is_compact(b)
        )

    @invariant()
    def each_sequence_holds_ceil_tokens_over_block_size_blocks(self):
        for seq_id, shadow in self.seqs.items():
            assert self.manager.num_tokens(seq_id) == len(shadow.tokens)
            capacity = max(len(shadow.tokens), shadow.reserved_tokens)
            expected = -(-capacity // self.block_size)
            assert len(self.manager.block_table(seq_id)) == expected

    @invariant()
    def progress_counts_agree(self):
        """One count of progress: the block manager's committed tokens equal the shadow's
        (which stands for the engine's computed count), the table's reserved slots run
        ahead of them by the tokens written and not yet committed (a step's plan), and
        the hash chain, null entries and table length follow from them."""
        for seq_id, shadow in self.seqs.items():
            scheduled = len(shadow.tokens) - shadow.num_committed
            self.manager.check_progress(seq_id, shadow.num_committed, scheduled)

    @invariant()
    def blocks_out_of_the_next_querys_window_are_null(self):
        null = self.pool.null_block
        for seq_id, shadow in self.seqs.items():
            num_null = self.manager.live_from(shadow.num_committed)
            table = self.manager.block_table(seq_id)
            assert table[:num_null] == [null] * num_null
            assert null not in table[num_null:]
            assert self.manager.num_held_blocks(seq_id) == len(table) - num_null

    @invariant()
    def every_sequence_reads_what_it_wrote(self):
        for seq_id, shadow in self.seqs.items():
            table = self.manager.block_table(seq_id)
            first = self.manager.live_from(shadow.num_committed) * self.block_size
            for position in range(first, len(shadow.tokens)):
                block_id = table[position // self.block_size]
                slot = block_id * self.block_size + position % self.block_size
                assert self.memory.get(slot) == shadow.content(position)

    @invariant()
    def cached_blocks_hold_what_their_keys_name(self):
        for block_id in self.block_ids:
            key = self.pool.block_key(block_id)
            if key is not None:
                assert self.block_content(block_id) == self.cached_content[key.digest]

    @invariant()
    def manager_fragmentation_equals_the_pure_count(self):
        seq_ids = sorted(self.seqs)
        tables = [self.manager.block_table(s) for s in seq_ids]
        lengths = [len(self.seqs[s].tokens) for s in seq_ids]
        expected = fragmentation_stats(tables, lengths, self.block_size, self.pool.null_block)
        # a twin no table holds yet is memory in use, full of its full block's tokens
        in_tables = {block_id for table in tables for block_id in table}
        twins = {self.pool.twin(b) for b in range(self.pool.num_blocks)} - {None}
        extra = len(twins - in_tables) * self.block_size
        expected = FragmentationStats(
            unique_blocks=expected.unique_blocks + len(twins - in_tables),
            allocated_slots=expected.allocated_slots + extra,
            live_tokens=expected.live_tokens + extra,
            internal_fragmentation_slots=expected.internal_fragmentation_slots,
            slots_saved_by_sharing=expected.slots_saved_by_sharing - extra,
        )
        assert self.manager.fragmentation() == expected

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.seqs):
            self.manager.free(seq_id)
        assert sorted(self.pool.free_block_ids()) == list(range(self.pool.num_blocks))
        stats = self.pool.stats()
        assert stats.used == 0 and stats.shared == 0 and stats.compact_used == 0
        assert stats.evictable == stats.cached


class CompactKVManagerMachine(KVManagerMachine):
    """The same machine over pools with compact blocks (on demand, no window) only, so
    that re-encoding, twins and swap-ins bringing compact blocks back are common."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 32),
        reserved_fraction=st.sampled_from([0.0, 0.1, 0.25]),
        enable_prefix_caching=st.booleans(),
        recent_tokens=st.sampled_from([0, 3, 7]),
        num_compact_blocks=st.integers(1, 24),
    )
    def setup(
        self,
        block_size,
        num_blocks,
        reserved_fraction,
        enable_prefix_caching,
        recent_tokens,
        num_compact_blocks,
    ):
        super().setup(
            block_size,
            num_blocks,
            reserved_fraction,
            enable_prefix_caching,
            upfront_tokens=None,
            sliding_window=None,
            recent_tokens=recent_tokens,
            num_compact_blocks=num_compact_blocks,
        )


KVManagerMachine.TestCase.settings = settings(
    max_examples=200 * EXAMPLES_SCALE, stateful_step_count=50, deadline=None
)
test_kv_manager_state_machine = KVManagerMachine.TestCase
CompactKVManagerMachine.TestCase.settings = settings(
    max_examples=100 * EXAMPLES_SCALE, stateful_step_count=50, deadline=None
)
test_kv_manager_state_machine_with_compact_blocks = CompactKVManagerMachine.TestCase


# -- the prefix cache's lower tiers -------------------------------------------------------

MODEL = "model"  # the scheduler's cache_key: every block key's first extra key
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 2
UNWRITTEN = -1.0  # what a fresh cache tensor holds: no token's K/V is negative
FINGERPRINT = bytes(range(32))  # one model and format across restarts
WAIT_FOREVER = 3600.0  # seconds: a request waits for its loads until they end
LOAD_TIMEOUT_S = 30.0  # a runnable disk load taking longer is a hang
MAX_CONVERSATION = 12  # tokens of a finished conversation a follow-up continues
# Prompts of 1 to 11 tokens, most continuing a system prompt: hits in every tier.
TIER_PROMPTS = st.builds(
    lambda system, length, tail: system[:length] + tail,
    st.sampled_from(SYSTEM_PROMPTS),
    st.integers(0, 8),
    st.lists(st.integers(0, 2), min_size=1, max_size=3),
)


def extra_keys(salt: str) -> tuple[str, ...]:
    return (MODEL, salt)


@functools.lru_cache(maxsize=1 << 16)
def token_kv(salt: str, tokens: tuple[int, ...]) -> torch.Tensor:
    """The K/V every layer writes for the last of ``tokens`` (a prompt's first tokens,
    under a cache ``salt``): ``[NUM_LAYERS, 2, NUM_KV_HEADS, HEAD_DIM]`` whole numbers
    below 2**16 (exact in float32), a hash of all of them. Shared: never write into it."""
    count = NUM_LAYERS * 2 * NUM_KV_HEADS * HEAD_DIM
    digest = hashlib.blake2b(repr((salt, tokens)).encode(), digest_size=2 * count).digest()
    values = [int.from_bytes(digest[2 * i : 2 * i + 2], "little") for i in range(count)]
    return torch.tensor(values, dtype=torch.float32).reshape(NUM_LAYERS, 2, NUM_KV_HEADS, -1)


def block_kv(salt: str, tokens: tuple[int, ...], block_size: int) -> torch.Tensor:
    """The bytes of the full block that ends with the last of ``tokens``, shaped like one
    pool block: ``[NUM_LAYERS, 2, NUM_KV_HEADS, block_size, HEAD_DIM]``."""
    end = len(tokens)
    rows = [token_kv(salt, tokens[: position + 1]) for position in range(end - block_size, end)]
    return torch.stack(rows, dim=3)


class CheckedDiskTier(DiskTier):
    """A disk tier that checks every payload it is given (a demotion, a load's victim,
    a persisted block: from any thread) against ``expected(digest)``, a block's bytes,
    and keeps the digests of those that differ in ``wrong_puts``."""

    def __init__(self, *args, expected: Callable[[bytes], torch.Tensor], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.expected = expected
        self.wrong_puts: list[bytes] = []

    def put(self, digest: bytes, payload: torch.Tensor) -> None:
        expected = self.expected(digest).reshape(-1).view(torch.uint8)
        if not torch.equal(payload.reshape(-1), expected):
            self.wrong_puts.append(digest)
        super().put(digest, payload)


@dataclass
class Request:
    """A prompt waiting to be admitted: new, or preempted and recomputed from scratch
    (``tokens`` then includes what it generated). ``prefetched``: its disk loads were
    asked for since it last passed the wait (the scheduler's ``_prefetched``)."""

    salt: str
    tokens: list[int]
    high_priority: bool
    prefetched: bool = False


@dataclass
class TieredSequence(ShadowSequence):
    """A running sequence of the tiered machine: its request's priority too."""

    high_priority: bool = False


@dataclass
class Plan:
    """What the scheduler hands the executor for one step, built up by the rules since
    the last :meth:`TieredKVMachine.step`: tier moves in planned order, copy-on-write
    ``(src, dst)`` pairs, and per scheduled sequence the ``(slot, position)`` of each token
    the forward pass computes. ``preempted``: a sequence was preempted in this plan, so
    none is admitted after it (the scheduler's rule; admissions are what fill)."""

    moves: list[TierMove] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)
    writes: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    preempted: bool = False

    @property
    def is_open(self) -> bool:
        """Whether bytes are still to move: until then, the tensor lags the bookkeeping."""
        return bool(self.moves or self.copies or self.writes)


class TieredKVMachine(RuleBasedStateMachine):
    """The block manager, a :class:`TieredCache` listening to its pool, and a real cache
    tensor, driven as the scheduler and executor drive them.

    Rules build one plan at a time (:class:`Plan`): sequences start as
    ``Scheduler._admit_waiting`` starts them (the pool's cached prefix, then the host
    tier's ready blocks after it, pinned; slots for both; a fill into the blocks given
    for them; those tokens committed at once), running ones append (evicting cached
    blocks, which spills them, and copying on write) or are preempted (their blocks
    freed, the prompt queued again). :meth:`step` runs the plan as the executor does:
    the tier moves in planned order, then the copies, then the forward pass writes each
    computed token's K/V (:func:`token_kv` of its position's tokens), then the tokens
    are committed. Finishing and forking happen between steps.

    So a block's correct bytes are a function of its content key, and after every step
    every cached pool block and every ready host slot holds its key's bytes and every
    sequence reads its own tokens' K/V back through its table: a fill restores exactly
    what was spilled, never another key's bytes.

    With a disk tier (in a temporary directory), full host slots demote their blocks to
    disk, requests prefetch theirs and wait for the loads (``admissible``), and a restart
    persists the pool's cached blocks, closes the tiers and opens new ones over the same
    directory with a fresh pool and tensor: every entry read back is its key's bytes.
    Loads run on the tiers' reader thread; each starts once the moves planned before it
    have run, and the machine waits for it as soon as it can run (after a prefetch with
    no move pending, or after a step), so what the tiers report never depends on timing.
    """

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        pool_tokens=st.integers(12, 24),
        reserved_fraction=st.sampled_from([0.0, 0.25]),
        host_slots=st.sampled_from([1, 1, 2, 4]),
        disk_entries=st.sampled_from([None, None, 2, 4, 64]),
        extent_entries=st.sampled_from([None, 1, 3]),
        wait_limit=st.sampled_from([0.0, WAIT_FOREVER]),
        prefetch_on_arrival=st.booleans(),
    )
    def setup(
        self,
        block_size: int,
        pool_tokens: int,
        reserved_fraction: float,
        host_slots: int,
        disk_entries: int | None,
        extent_entries: int | None,
        wait_limit: float,
        prefetch_on_arrival: bool,
    ) -> None:
        """A pool of ``pool_tokens`` tokens (rounded up to blocks of ``block_size``:
        a prompt or two fit, so admissions evict) and a host tier of ``host_slots``
        blocks; a disk tier of ``disk_entries`` entries (None: none) in extent files of
        ``extent_entries``; requests wait ``wait_limit`` seconds for their loads, which
        start when they arrive or (``prefetch_on_arrival`` false) when they are next."""
        self.block_size = block_size
        self.num_blocks = -(-pool_tokens // block_size)
        self.reserved_fraction = reserved_fraction
        self.host_slots = host_slots
        self.disk_entries = disk_entries
        self.extent_entries = extent_entries
        self.wait_limit = wait_limit
        self.prefetch_on_arrival = prefetch_on_arrival
        self.directory = None if disk_entries is None else tempfile.mkdtemp(prefix="kv-tiers-")
        self.chains: dict[bytes, tuple[str, tuple[int, ...]]] = {}
        self.expected: dict[bytes, torch.Tensor] = {}
        self.seqs: dict[int, TieredSequence] = {}
        self.waiting: dict[int, Request] = {}
        self.finished: list[Request] = []  # conversations a follow-up may continue
        self.next_id = 0
        self.start_engine()

    def start_engine(self) -> None:
        """A fresh pool, a cache tensor whose every element is ``UNWRITTEN``, and tiers
        (over the directory's entries, if any)."""
        self.manager = BlockManager(
            self.num_blocks, self.block_size, self.reserved_fraction, enable_prefix_caching=True
        )
        self.pool = self.manager.pool
        # KVCache's layout, the null block included; a plain tensor (KVCache commits a
        # huge page for each one)
        shape = (NUM_LAYERS, 2, self.num_blocks + 1, NUM_KV_HEADS, self.block_size, HEAD_DIM)
        self.cache = torch.full(shape, UNWRITTEN)
        block = self.cache[:, :, 0]
        host = HostTier(self.host_slots, tuple(block.shape), block.dtype)
        disk = None
        if self.directory is not None:
            capacity = self.disk_entries * slot_bytes_for(host.block_bytes)
            disk = CheckedDiskTier(
                self.directory,
                capacity,
                host.block_bytes,
                FINGERPRINT,
                self.extent_entries,
                expected=self.block_bytes,
            )
        self.tiers = TieredCache(self.cache, self.block_size, host, disk, self.wait_limit)
        self.pool.add_listener(self.tiers)
        self.plan = Plan()

    # -- helpers -------------------------------------------------------------------------

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def register(self, salt: str, tokens: list[int]) -> None:
        """Remember which tokens each full block of ``tokens`` holds, by its digest."""
        block_size = self.block_size
        for index, key in enumerate(iter_block_keys(tokens, block_size, extra_keys(salt))):
            end = (index + 1) * block_size
            self.chains.setdefault(key.digest, (salt, tuple(tokens[:end])))

    def block_bytes(self, digest: bytes) -> torch.Tensor:
        """What the block of ``digest`` must hold, in every tier."""
        if digest not in self.expected:
            salt, tokens = self.chains[digest]
            self.expected[digest] = block_kv(salt, tokens, self.block_size)
        return self.expected[digest]

    def pool_block(self, block_id: int) -> torch.Tensor:
        return self.cache[:, :, block_id]

    def take_moves(self) -> list[TierMove]:
        """The moves planned since the last call, added to the plan in order."""
        moves = self.tiers.take_moves()
        self.plan.moves.extend(moves)
        return moves

    def idle(self) -> list[int]:
        """Running sequences not scheduled in this plan yet."""
        return sorted(s for s in self.seqs if s not in self.plan.writes)

    def commit(self, seq_id: int, count: int) -> None:
        """Commit the sequence's next ``count`` tokens (their K/V are written, or will be
        by this plan's fills)."""
        shadow = self.seqs[seq_id]
        end = shadow.num_committed + count
        self.manager.commit_tokens(seq_id, shadow.tokens[shadow.num_committed : end])
        shadow.num_committed = end
        self.register(shadow.salt, shadow.tokens[:end])

    def schedule(
        self, seq_id: int, slots: list[int], first: int, copies: list[tuple[int, int]]
    ) -> None:
        """Add the sequence's tokens from position ``first`` on, written at ``slots``,
        and the allocation's copies, to the plan."""
        self.plan.copies.extend(copies)
        positions = range(first, first + len(slots))
        self.plan.writes[seq_id] = list(zip(slots, positions, strict=True))

    def prompt_keys(
        self, request: Request, prefix: CachedPrefix | None = None
    ) -> Iterator[BlockKey]:
        """The keys of the request's cacheable full blocks after ``prefix`` (lazily):
        every token but the last, as ``Scheduler._block_keys``."""
        start = 0 if prefix is None else prefix.num_tokens
        parent = prefix.keys[-1].digest if prefix is not None and prefix.keys else None
        tokens = request.tokens[start : len(request.tokens) - 1]
        return iter_block_keys(tokens, self.block_size, extra_keys(request.salt), parent)

    def prefetch(self, seq_id: int, request: Request) -> None:
        """``Scheduler._prefetch``: the tiers start loading the request's disk blocks
        past what the pool and host tier hold. With no move pending the loads can run
        now: wait for them. Else they wait for the plan's moves (:meth:`step`)."""
        request.prefetched = True
        self.take_moves()
        host = self.tiers.host
        loading = host.num_loading
        in_pool = lambda key: self.pool.lookup(key) is not None  # noqa: E731
        self.tiers.prefetch(seq_id, self.prompt_keys(request), in_pool)
        if host.num_loading > loading:
            event("prefetch started loads" + " behind pending moves" * bool(self.plan.moves))
        if not self.plan.moves:
            self.drain_loads()

    def drain_loads(self) -> None:
        """Wait (at most ``LOAD_TIMEOUT_S``) until no disk load is in flight; call only
        when none waits for a pending move."""
        host = self.tiers.host
        if not host.num_loading:
            return
        failed = self.tiers.stats().failed_loads
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while host.num_loading:
            assert time.monotonic() < deadline, "a runnable disk load never ended"
            time.sleep(0.0005)
            self.tiers.poll()
        if self.tiers.stats().failed_loads > failed:
            event("a load failed: its entry was evicted meanwhile")

    def loads_done(self, seq_id: int, request: Request) -> bool:
        """``Scheduler._loads_done``: the request's loads start now if they did not on
        arrival; it may start unless one of its blocks is still loading (they wait for
        this plan's moves) and its wait has no limit."""
        if not request.prefetched:
            self.prefetch(seq_id, request)
        admissible = self.tiers.admissible(seq_id)
        host = self.tiers.host
        loading = any(host.is_loading(key.digest) for key in self.prompt_keys(request))
        assert admissible or loading, "passed over while none of its blocks loads"
        assert admissible or self.wait_limit == WAIT_FOREVER, "waited past the wait limit"
        if not admissible:
            event("passed over while its blocks load")
            return False
        request.prefetched = False
        return True

    def admit(self, seq_id: int) -> bool | None:
        """``Scheduler._admit_waiting`` for one request: once its loads are done, the
        pool's cached prefix, the host tier's run after it (pinned: no spill of this
        allocation may take those slots), slots for the run's tokens and the rest, then
        :meth:`start`. Not admitted (no blocks): unpinned, nothing planned, the request
        waits. Returns whether it was admitted, None when it was passed over (its loads
        are not done)."""
        request = self.waiting[seq_id]
        if not self.loads_done(seq_id, request):
            return None
        prefix = self.manager.find_cached_prefix(request.tokens, extra_keys(request.salt))
        run = self.tiers.host_run(self.prompt_keys(request, prefix))
        pinned = {slot for slot, _ in run}
        restored = len(run) * self.block_size
        computed = len(request.tokens) - prefix.num_tokens - restored
        assert computed >= 1, "the last token is always computed"
        result = self.manager.allocate_slots(
            seq_id, restored + computed, request.high_priority, prefix, restored
        )
        spills = [m for m in self.take_moves() if m.kind is MoveKind.SPILL]
        assert not pinned & {m.slot for m in spills}, "a spill took a slot a fill reads"
        if pinned and spills:
            event("spills while a fill's slots are pinned")
        if result is None:
            assert not spills and seq_id not in self.manager
            self.tiers.unpin(run)
            event("not admitted")
            return False
        self.start(seq_id, prefix, run, result.slots, result.copies)
        return True

    def start(
        self,
        seq_id: int,
        prefix: CachedPrefix,
        run: list[tuple[int, BlockKey]],
        slots: list[int],
        copies: list[tuple[int, int]],
    ) -> None:
        """The admitted request runs: the host ``run`` fills the blocks given for it
        (those right after ``prefix``, where its first ``slots`` are), its tokens count
        as computed at once, the rest are scheduled."""
        request = self.waiting.pop(seq_id)
        event("admitted" + " after a host hit" * bool(run))
        first = len(prefix.block_ids)
        targets = self.manager.block_table(seq_id)[first : first + len(run)]
        block_size = self.block_size
        restored = len(run) * block_size
        assert slots[:restored] == [b * block_size + o for b in targets for o in range(block_size)]
        if run:
            disk_hits = self.tiers.stats().disk_hits
            self.tiers.fill(run, targets)
            self.take_moves()
            if self.tiers.stats().disk_hits > disk_hits:
                event("a fill of blocks loaded from disk")
        self.seqs[seq_id] = TieredSequence(
            request.salt, list(request.tokens), prefix.num_tokens, 0, request.high_priority
        )
        if restored:
            self.commit(seq_id, restored)
        self.schedule(seq_id, slots[restored:], prefix.num_tokens + restored, copies)

    # -- rules ---------------------------------------------------------------------------

    @rule(prompt=TIER_PROMPTS, salt=SALTS, admit_now=st.booleans(), high_priority=st.booleans())
    def arrive(self, prompt: list[int], salt: str, admit_now: bool, high_priority: bool) -> None:
        """A new request arrives (see :meth:`add`)."""
        self.add(Request(salt, list(prompt), high_priority), admit_now)

    @precondition(lambda self: self.finished)
    @rule(
        index=st.integers(0, 99),
        turn=st.lists(st.integers(0, 2), min_size=1, max_size=3),
        admit_now=st.booleans(),
        high_priority=st.booleans(),
    )
    def follow_up(self, index: int, turn: list[int], admit_now: bool, high_priority: bool) -> None:
        """The next turn of a finished conversation: its tokens and a new ``turn``, whose
        blocks the pool may have evicted meanwhile (the hits the tiers exist for)."""
        done = self.finished[index % len(self.finished)]
        self.add(Request(done.salt, done.tokens + turn, high_priority), admit_now)

    def add(self, request: Request, admit_now: bool) -> None:
        """``Scheduler.add`` (the loads start on arrival, if so set), then the request is
        admitted in this plan when ``admit_now`` and no sequence was preempted in it.
        Refused when it would not fit the pool alone, as the engine refuses it."""
        needed = -(-len(request.tokens) // self.block_size)
        reserved = 0 if request.high_priority else self.pool.num_reserved
        if needed > self.pool.num_blocks - reserved:
            event("refused: longer than the pool")
            return
        seq_id = self.new_id()
        self.waiting[seq_id] = request
        self.register(request.salt, request.tokens)
        if self.prefetch_on_arrival:
            self.prefetch(seq_id, request)
        if admit_now and not self.plan.preempted:
            self.admit(seq_id)

    @precondition(lambda self: self.waiting and not self.plan.preempted)
    @rule(max_seqs=st.integers(1, 4))
    def admit_waiting(self, max_seqs: int) -> None:
        """The admissions of one plan: waiting requests in queue order, those whose
        loads are not done passed over, until ``max_seqs`` started or one does not fit.
        A later one's allocation may spill into a slot an earlier one fills from."""
        started = 0
        for seq_id in sorted(self.waiting):
            admitted = self.admit(seq_id)
            if admitted is False:
                return
            started += bool(admitted)
            if started == max_seqs:
                return

    @precondition(lambda self: self.idle())
    @rule(
        index=st.integers(0, 99),
        new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6),
    )
    def append(self, index: int, new_tokens: list[int]) -> None:
        """A running sequence's next tokens (a decode, or several): new blocks may evict
        cached ones (spilled), a shared last block is copied on write."""
        idle = self.idle()
        seq_id = idle[index % len(idle)]
        shadow = self.seqs[seq_id]
        result = self.manager.allocate_slots(seq_id, len(new_tokens), shadow.high_priority)
        self.take_moves()
        if result is None:
            event("append did not fit")
            return
        first = len(shadow.tokens)
        shadow.tokens.extend(new_tokens)
        self.schedule(seq_id, result.slots, first, result.copies)

    @precondition(lambda self: self.idle())
    @rule(index=st.integers(0, 99))
    def preempt(self, index: int) -> None:
        """Preemption by recompute: the blocks go back (the cached ones stay findable
        until evicted, then spill), the sequence waits again with all its tokens; no
        admission follows in this plan."""
        idle = self.idle()
        seq_id = idle[index % len(idle)]
        shadow = self.seqs.pop(seq_id)
        self.manager.free(seq_id)
        self.plan.preempted = True
        request = Request(shadow.salt, shadow.tokens, shadow.high_priority)
        self.waiting[seq_id] = request
        if self.prefetch_on_arrival:
            self.prefetch(seq_id, request)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 99))
    def abort_waiting(self, index: int) -> None:
        waiting = sorted(self.waiting)
        seq_id = waiting[index % len(waiting)]
        del self.waiting[seq_id]
        self.tiers.forget(seq_id)

    @rule()
    def step(self) -> None:
        """The executor runs the plan: tier moves in planned order (each fill then holds
        its key's bytes), copies on write, the forward pass's K/V; then the scheduler
        commits the computed tokens. The loads that waited for the moves then run."""
        self.take_moves()
        self.apply_moves(self.plan.moves)
        self.copy_on_write(self.plan.copies)
        self.forward(self.plan.writes)
        for seq_id in self.plan.writes:
            shadow = self.seqs[seq_id]
            self.commit(seq_id, len(shadow.tokens) - shadow.num_committed)
        self.plan = Plan()
        self.drain_loads()

    def apply_moves(self, moves: list[TierMove]) -> None:
        """The plan's tier moves, in order; each filled block then holds its key's bytes."""
        self.note_moves(moves)
        self.tiers.apply(moves)
        for move in moves:
            if move.kind is MoveKind.FILL:
                restored = self.pool_block(move.block_id)
                assert torch.equal(restored, self.block_bytes(move.digest)), "a fill's bytes"

    def copy_on_write(self, copies: list[tuple[int, int]]) -> None:
        """The plan's ``(src, dst)`` block copies: each destination is new to the plan."""
        assert not {dst for _, dst in copies} & {src for src, _ in copies}
        assert len({dst for _, dst in copies}) == len(copies)
        for src, dst in copies:
            self.cache[:, :, dst] = self.cache[:, :, src]

    def forward(self, writes: dict[int, list[tuple[int, int]]]) -> None:
        """The forward pass writes each scheduled token's K/V at its slot."""
        block_size = self.block_size
        for seq_id, slots in writes.items():
            shadow = self.seqs[seq_id]
            for slot, position in slots:
                block_id, offset = divmod(slot, block_size)
                kv = token_kv(shadow.salt, tuple(shadow.tokens[: position + 1]))
                self.cache[:, :, block_id, :, offset] = kv

    def note_moves(self, moves: list[TierMove]) -> None:
        """Label the plan's move patterns (for the statistics)."""
        filled_from = set()
        for move in moves:
            event(f"a {move.kind.value}")
            if move.kind is MoveKind.FILL:
                filled_from.add(move.slot)
            elif move.kind is MoveKind.SPILL and move.slot in filled_from:
                event("a spill into the slot a fill of the same plan reads")

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def finish(self, index: int) -> None:
        """A sequence finishes after a step: its blocks go back (cached ones evictable)."""
        self.step()
        seq_id = sorted(self.seqs)[index % len(self.seqs)]
        self.manager.free(seq_id)
        self.end(self.seqs.pop(seq_id))

    def end(self, shadow: TieredSequence) -> None:
        """Keep the last few finished conversations short enough for follow-ups."""
        if len(shadow.tokens) <= MAX_CONVERSATION:
            request = Request(shadow.salt, shadow.tokens, shadow.high_priority)
            self.finished = [*self.finished[-3:], request]

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 99))
    def fork(self, index: int) -> None:
        """A parallel sample branches after a step: every block shared."""
        self.step()
        parent = sorted(self.seqs)[index % len(self.seqs)]
        child = self.new_id()
        self.manager.fork(parent, child)
        shadow = self.seqs[parent]
        self.seqs[child] = TieredSequence(
            shadow.salt, list(shadow.tokens), shadow.num_committed, 0, shadow.high_priority
        )

    @rule()
    def finish_everything(self) -> None:
        """Every sequence finishes after a step: no block is held, every cached one is
        evictable."""
        self.step()
        for seq_id in list(self.seqs):
            self.manager.free(seq_id)
            self.end(self.seqs.pop(seq_id))
        stats = self.pool.stats()
        assert stats.used == 0 and stats.evictable == stats.cached

    @precondition(lambda self: self.directory is not None)
    @rule()
    def restart(self) -> None:
        """Shutdown after a last step (the pool's cached blocks and the host tier's go to
        disk, the tiers close) and a new engine over the same directory, with a fresh
        pool and tensor and nothing running or waiting."""
        self.step()
        cached = self.pool.cached_blocks()
        persisted = {digest for digest, _ in [*cached, *self.tiers.host.ready_items()]}
        self.tiers.persist(cached)
        assert not self.tiers.disk.wrong_puts, "a disk entry was written with other bytes"
        self.tiers.close()
        self.seqs.clear()
        self.waiting.clear()
        self.start_engine()
        self.check_disk(persisted)

    def check_disk(self, persisted: set[bytes]) -> None:
        """Every entry of the reopened disk tier reads back as its key's bytes; when the
        tier has room for every block ever named (nothing was evicted), every block
        ``persisted`` is there."""
        disk = self.tiers.disk
        scratch = torch.empty_like(self.tiers.host.block(0))
        found = {digest for digest in self.chains if digest in disk}
        assert len(found) == len(disk)
        for digest in found:
            assert disk.read_into(digest, scratch), "an entry fails its checksums"
            assert torch.equal(scratch, self.block_bytes(digest)), "an entry's bytes"
        if len(self.chains) <= disk.capacity_entries:
            assert persisted <= found, "a persisted block is missing"
        event("restarted with " + ("blocks" if found else "nothing") + " on disk")

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def host_tier_bookkeeping_is_consistent(self) -> None:
        """Every slot is ready (one digest), loading (one digest) or free, exactly one of
        them; a digest is in one slot at most; nothing is pinned between rules (a fill or
        an unpin always follows ``host_run``)."""
        host = self.tiers.host
        ready = dict(host.ready_items())
        loading = host._loading
        assert len(ready) == len(host) and len(loading) == host.num_loading
        slots = [*ready.values(), *loading.values(), *host._free]
        assert sorted(slots) == list(range(host.num_slots))
        assert not ready.keys() & loading.keys()
        assert not host._pinned, "a slot stays pinned after its fill or unpin"

    @invariant()
    def disk_gets_only_its_keys_bytes(self) -> None:
        """Every entry written to disk (demoted, a load's victim, persisted) was its
        key's bytes."""
        disk = self.tiers.disk
        assert disk is None or not disk.wrong_puts, "a disk entry was written with other bytes"

    @invariant()
    def pool_references_are_the_tables(self) -> None:
        """A block's reference count is the tables holding it; free xor referenced;
        every sequence's counts agree (its plan's tokens reserved, not committed)."""
        holders = Counter(b for s in self.seqs for b in self.manager.held_block_ids(s))
        free = self.pool.free_block_ids()
        assert len(free) == len(set(free))
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == holders[block_id]
            assert (block_id in free) == (holders[block_id] == 0)
        for seq_id, shadow in self.seqs.items():
            scheduled = len(shadow.tokens) - shadow.num_committed
            self.manager.check_progress(seq_id, shadow.num_committed, scheduled)

    @invariant()
    def bytes_are_their_keys(self) -> None:
        """Between plans (every move applied): each cached pool block and each ready host
        slot holds exactly its key's bytes, and each sequence reads its committed
        tokens' K/V back through its table."""
        if self.plan.is_open:
            return
        for digest, block_id in self.pool.cached_blocks():
            block = self.pool_block(block_id)
            assert torch.equal(block, self.block_bytes(digest)), "a cached block's bytes"
        host = self.tiers.host
        for digest, slot in host.ready_items():
            assert torch.equal(host.block(slot), self.block_bytes(digest)), "a host slot's bytes"
        block_size = self.block_size
        for seq_id, shadow in self.seqs.items():
            table = self.manager.block_table(seq_id)
            for position in range(shadow.num_committed):
                block_id = table[position // block_size]
                kv = self.cache[:, :, block_id, :, position % block_size]
                expected = token_kv(shadow.salt, tuple(shadow.tokens[: position + 1]))
                assert torch.equal(kv, expected), "a sequence reads other K/V"

    def teardown(self) -> None:
        """Stop the tiers and remove the directory (after a failed example too: the
        checks are rules and invariants)."""
        try:
            if hasattr(self, "tiers"):
                self.tiers.close()
        finally:
            if getattr(self, "directory", None) is not None:
                shutil.rmtree(self.directory, ignore_errors=True)


TieredKVMachine.TestCase.settings = settings(
    max_examples=150 * EXAMPLES_SCALE, stateful_step_count=120, deadline=None
)
test_kv_tiers_state_machine = TieredKVMachine.TestCase
