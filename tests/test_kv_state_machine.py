"""A hypothesis state machine over the block manager, checked against a shadow memory.

The shadow memory maps each flat cache slot to the K/V "content" written there; the
content of a sequence's token at position p is the tuple of its token ids up to p, which
is exactly what real K/V depend on. After every step each sequence must read back, through
its block table, the content it wrote, whatever the others wrote or freed meanwhile.
"""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import OutOfBlocksError
from pagedllm.kv.fragmentation import fragmentation_stats

TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=12)


class KVManagerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4, 8]),
        num_blocks=st.integers(1, 24),
        reserved_fraction=st.sampled_from([0.0, 0.1, 0.25]),
    )
    def setup(self, block_size, num_blocks, reserved_fraction):
        self.manager = BlockManager(num_blocks, block_size, reserved_fraction)
        self.pool = self.manager.pool
        self.block_size = block_size
        self.memory: dict[int, tuple[int, ...]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_seq_id = 0

    # -- helpers -------------------------------------------------------------------------

    def snapshot(self):
        refs = [self.pool.ref_count(b) for b in range(self.pool.num_blocks)]
        tables = {s: self.manager.block_table(s) for s in self.tokens}
        return refs, tables, self.pool.free_block_ids(), self.pool.stats()

    def write(self, seq_id, new_tokens, high_priority):
        """Reserve slots for ``new_tokens``, perform the copies, write their K/V."""
        manager, block_size = self.manager, self.block_size
        expected_ok = manager.can_append(seq_id, len(new_tokens), high_priority)
        before = self.snapshot()
        try:
            result = manager.append_slots(seq_id, len(new_tokens), high_priority)
        except OutOfBlocksError:
            assert not expected_ok
            assert self.snapshot() == before
            return False
        assert expected_ok
        for src, dst in result.copies:
            assert self.pool.ref_count(dst) == 1
            for offset in range(block_size):
                src_slot, dst_slot = src * block_size + offset, dst * block_size + offset
                if src_slot in self.memory:
                    self.memory[dst_slot] = self.memory[src_slot]
        history = self.tokens.setdefault(seq_id, [])
        for slot, token in zip(result.slots, new_tokens, strict=True):
            assert self.pool.ref_count(slot // block_size) == 1, "wrote a shared block"
            history.append(token)
            self.memory[slot] = tuple(history)
        return True

    def pick(self, index):
        return sorted(self.tokens)[index % len(self.tokens)]

    # -- rules ---------------------------------------------------------------------------

    @rule(new_tokens=TOKENS, high_priority=st.booleans())
    def new_sequence(self, new_tokens, high_priority):
        seq_id = self.next_seq_id
        self.next_seq_id += 1
        if not self.write(seq_id, new_tokens, high_priority):
            assert seq_id not in self.manager

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 99), new_tokens=TOKENS, high_priority=st.booleans())
    def append(self, index, new_tokens, high_priority):
        self.write(self.pick(index), new_tokens, high_priority)

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 99))
    def fork(self, index):
        parent = self.pick(index)
        child = self.next_seq_id
        self.next_seq_id += 1
        free_before = self.pool.num_free
        self.manager.fork(parent, child)
        assert self.pool.num_free == free_before
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(index=st.integers(0, 99))
    def free_sequence(self, index):
        """A sequence finishing, or being preempted: all its blocks go back at once."""
        seq_id = self.pick(index)
        self.manager.free(seq_id)
        del self.tokens[seq_id]

    # -- invariants ----------------------------------------------------------------------

    @invariant()
    def blocks_are_free_xor_referenced_and_counted_by_holders(self):
        holders = [0] * self.pool.num_blocks
        for seq_id in self.tokens:
            for block_id in self.manager.block_table(seq_id):
                holders[block_id] += 1
        free = self.pool.free_block_ids()
        assert len(free) == len(set(free))
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == holders[block_id]
            assert (block_id in free) == (holders[block_id] == 0)

    @invariant()
    def each_sequence_holds_ceil_tokens_over_block_size_blocks(self):
        for seq_id, history in self.tokens.items():
            assert self.manager.num_tokens(seq_id) == len(history)
            expected = -(-len(history) // self.block_size)
            assert len(self.manager.block_table(seq_id)) == expected

    @invariant()
    def every_sequence_reads_what_it_wrote(self):
        for seq_id, history in self.tokens.items():
            table = self.manager.block_table(seq_id)
            for position in range(len(history)):
                block_id = table[position // self.block_size]
                slot = block_id * self.block_size + position % self.block_size
                assert self.memory.get(slot) == tuple(history[: position + 1])

    @invariant()
    def manager_fragmentation_equals_the_pure_count(self):
        seq_ids = sorted(self.tokens)
        tables = [self.manager.block_table(s) for s in seq_ids]
        lengths = [len(self.tokens[s]) for s in seq_ids]
        expected = fragmentation_stats(tables, lengths, self.block_size)
        assert self.manager.fragmentation() == expected

    def teardown(self):
        if not hasattr(self, "manager"):
            return
        for seq_id in list(self.tokens):
            self.manager.free(seq_id)
        assert sorted(self.pool.free_block_ids()) == list(range(self.pool.num_blocks))
        assert self.pool.num_used == 0


KVManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=50, deadline=None
)
test_kv_manager_state_machine = KVManagerMachine.TestCase
