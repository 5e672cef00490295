"""KV layer groups: layers grouped by attention kind, each group with its own block table
per sequence over one pool (:mod:`pagedllm.kv.layer_groups`,
:class:`~pagedllm.kv.block_manager.BlockManager` with ``group_windows``).

The grouping is checked on the layer patterns of real models and as a property; a
hypothesis state machine drives a grouped block manager through starts on cached
prefixes, appends, guesses rolled back, forks and frees, against a shadow memory in
which each group writes its own content: every group's table must read back what that
group wrote, inside its window, and hold nothing before it."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.capacity import (
    grouped_worst_case_blocks,
    longest_sequence,
    max_window_blocks,
    request_worst_case_blocks,
)
from pagedllm.kv.layer_groups import MAX_PADDING_FRACTION, group_layers


def gemma3_windows(num_layers: int, window: int = 512, every: int = 6) -> list[int | None]:
    """Gemma 3's pattern: five sliding layers, then a global one."""
    return [None if (i + 1) % every == 0 else window for i in range(num_layers)]


def test_gemma3_1b_groups_four_global_layers_and_twenty_two_sliding_ones():
    groups = group_layers(gemma3_windows(26), 26)
    assert groups.num_slots == 4
    assert groups.windows == (None,) + (512,) * 6
    assert groups.padding_layers == 2  # 22 sliding layers in 6 groups of 4 slots
    assert [groups.layer_group[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [groups.layer_slot[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    assert "7 KV layer groups of 4 layers (1 global, 6 sliding over 512 tokens" in (
        groups.describe()
    )


def test_gemma2_alternating_layers_make_two_groups_without_padding():
    windows = [4096 if i % 2 == 0 else None for i in range(26)]
    groups = group_layers(windows, 26)
    assert (groups.windows, groups.num_slots, groups.padding_layers) == ((None, 4096), 13, 0)


@pytest.mark.parametrize(
    ("windows", "expected"), [((), (None,)), ((None, None), (None,)), ((8, 8, 8), (8,))]
)
def test_layers_of_one_kind_keep_one_table(windows, expected):
    groups = group_layers(windows, 3 if windows else 4)
    assert groups.windows == expected
    assert groups.layer_slot == tuple(range(groups.num_layers))


@given(
    st.lists(st.sampled_from([None, 4, 16]), min_size=2, max_size=40).filter(
        lambda w: len(set(w)) > 1
    )
)
def test_every_layer_has_one_slot_of_a_group_of_its_kind(windows):
    groups = group_layers(windows, len(windows))
    seen = set()
    for layer, window in enumerate(windows):
        group, slot = groups.layer_group[layer], groups.layer_slot[layer]
        assert groups.windows[group] == window
        assert 0 <= slot < groups.num_slots
        assert (group, slot) not in seen
        seen.add((group, slot))
    assert groups.num_groups * groups.num_slots == len(windows) + groups.padding_layers
    if groups.num_slots > 1:
        assert groups.padding_layers <= MAX_PADDING_FRACTION * len(windows)
    if None in windows:
        assert groups.windows[0] is None


def test_grouped_worst_case_and_longest_sequence_count_each_groups_table():
    windows = (None, 32, 32)
    worst = grouped_worst_case_blocks(100, 400, 2, 16, windows, step_tokens=64)
    one = request_worst_case_blocks(100, 400, 2, 16, step_tokens=64)
    slid = request_worst_case_blocks(100, 400, 2, 16, window=32, step_tokens=64)
    assert worst == one + 2 * slid
    assert slid == 2 * max_window_blocks(32, 64, 16)
    # 100 blocks: the two sliding groups hold at most their windows, the rest is global
    bound = max_window_blocks(32, 64, 16)
    assert longest_sequence(100, 16, windows, 64) == (100 - 2 * bound) * 16
    assert longest_sequence(100, 16, (None,), 64) == 1600
    assert longest_sequence(100, 16, (8, 32), 64) is None
    # a small pool: each table holds a third of it while the windows are not full yet
    assert longest_sequence(6, 16, windows, 1024) == 2 * 16
    assert longest_sequence(2, 16, (8, 32), 1024) == 16


# -- the grouped block manager as a state machine ------------------------------------------

PROMPTS = st.builds(
    lambda shared, tail: [0, 1, 2, 0, 1, 2, 0, 1, 2, 0][:shared] + tail,
    st.integers(0, 10),
    st.lists(st.integers(0, 2), max_size=10),
)


class GroupedKVMachine(RuleBasedStateMachine):
    """A grouped block manager and a shadow memory ``slot -> (group, salt, tokens up to
    the position)``: what group ``g``'s layers would have written there."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 40),
        windows=st.sampled_from([(None, 3), (None, 5, 5), (None, 1, 9), (2, 6)]),
        enable_prefix_caching=st.booleans(),
    )
    def setup(self, block_size, num_blocks, windows, enable_prefix_caching):
        self.manager = BlockManager(
            num_blocks,
            block_size,
            reserved_fraction=0.1,
            enable_prefix_caching=enable_prefix_caching,
            group_windows=windows,
        )
        self.pool = self.manager.pool
        self.block_size = block_size
        self.windows = windows
        self.memory: dict[int, tuple] = {}
        self.tokens: dict[int, list[int]] = {}  # committed tokens per sequence
        self.salts: dict[int, str] = {}
        self.next_id = 0

    def content(self, group: int, seq_id: int, position: int) -> tuple:
        return (group, self.salts[seq_id], tuple(self.tokens[seq_id][: position + 1]))

    def write(self, seq_id, result, tokens, start):
        """Apply ``result``'s copies, then write ``tokens`` (positions ``start ..``) in
        every group's slots."""
        for src, dst in result.copies:
            for offset in range(self.block_size):
                src_slot = src * self.block_size + offset
                if src_slot in self.memory:
                    self.memory[dst * self.block_size + offset] = self.memory[src_slot]
        self.tokens[seq_id][start:] = tokens
        for group, appended in enumerate([result, *result.more_groups]):
            assert len(appended.slots) == len(tokens)
            for position, slot in enumerate(appended.slots, start=start):
                if slot < 0:  # out of the group's window from the first query on
                    assert self.windows[group] is not None
                    continue
                assert self.pool.ref_count(slot // self.block_size) == 1, "wrote a shared block"
                self.memory[slot] = self.content(group, seq_id, position)

    @rule(prompt=PROMPTS, salt=st.sampled_from(["a", "b"]), high_priority=st.booleans())
    def start(self, prompt, salt, high_priority):
        seq_id, self.next_id = self.next_id, self.next_id + 1
        extra = (salt,)
        prefix = self.manager.find_cached_prefix(prompt, extra) if prompt else None
        hit = 0 if prefix is None else prefix.num_tokens
        if hit:
            event("a prefix hit")
            if any(prefix.num_nulls):
                event("a hit with null entries")
        result = self.manager.allocate_slots(seq_id, len(prompt) - hit, high_priority, prefix)
        if result is None:
            assert seq_id not in self.manager
            return
        self.salts[seq_id] = salt
        self.tokens[seq_id] = list(prompt[:hit])
        self.write(seq_id, result, prompt[hit:], hit)
        self.manager.commit_tokens(seq_id, prompt[hit:])

    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new):
        if not self.tokens:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        start = len(self.tokens[seq_id])
        result = self.manager.allocate_slots(seq_id, len(new))
        if result is None:
            event("out of blocks")
            return
        self.write(seq_id, result, new, start)
        keep = data.draw(st.integers(0, len(new)))  # guesses: the rest rolls back
        released = self.manager.commit_tokens(seq_id, new[:keep])
        assert len(released) == len(self.windows)
        if keep < len(new):
            self.tokens[seq_id][start + keep :] = []
            self.manager.rollback(seq_id)
            event("guesses rolled back")

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.manager.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.salts[child] = self.salts[parent]

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.manager.free(seq_id)
        del self.tokens[seq_id], self.salts[seq_id]

    @invariant()
    def each_group_reads_back_what_it_wrote_inside_its_window(self):
        for seq_id, tokens in self.tokens.items():
            self.manager.check_progress(seq_id, len(tokens))
            for group in range(len(self.windows)):
                table = self.manager.block_table(seq_id, group)
                live = self.manager.live_from(len(tokens), group)
                assert table[:live] == [self.pool.null_block] * live
                for position in range(live * self.block_size, len(tokens)):
                    block_id = table[position // self.block_size]
                    slot = block_id * self.block_size + position % self.block_size
                    assert self.memory.get(slot) == self.content(group, seq_id, position)

    @invariant()
    def every_held_block_is_counted_once_per_holder(self):
        holders: dict[int, int] = {}
        for seq_id in self.tokens:
            for block_id in self.manager.held_block_ids(seq_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        for block_id in range(self.pool.num_blocks):
            assert self.pool.ref_count(block_id) == holders.get(block_id, 0)
        assert self.pool.num_used == len(holders)

    @invariant()
    def cached_blocks_hold_their_groups_content(self):
        for block_id in range(self.pool.num_blocks):
            key = self.pool.block_key(block_id)
            if key is None:
                continue
            first = self.memory.get(block_id * self.block_size)
            last = self.memory.get((block_id + 1) * self.block_size - 1)
            assert first is not None and last is not None
            assert first[0] == last[0], "one group's block"

    def teardown(self):
        if hasattr(self, "manager"):
            for seq_id in list(self.tokens):
                self.manager.free(seq_id)
            assert self.pool.num_used == 0


TestGroupedKVMachine = GroupedKVMachine.TestCase
TestGroupedKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_a_hit_is_what_every_group_can_serve():
    """The global group needs the whole chain, a sliding group only its blocks inside
    the window of the first computed token (the others are null entries)."""
    manager = BlockManager(64, 4, reserved_fraction=0.0, group_windows=(None, 4))
    prompt = list(range(17))
    result = manager.allocate_slots("a", 17, prefix=manager.find_cached_prefix(prompt))
    assert len(result.more_groups) == 1
    assert len(result.slots) == len(result.more_groups[0].slots) == 17
    manager.commit_tokens("a", prompt)
    assert manager.num_null_blocks("a", 0) == 0
    assert manager.num_null_blocks("a", 1) == 3  # the next query (17) sees 14..17
    assert manager.num_held_blocks("a") == 5 + 2
    hit = manager.find_cached_prefix(prompt + [99])
    assert hit.num_tokens == 16 and hit.num_nulls == (0, 3)
    shorter = manager.find_cached_prefix(prompt[:9] + [77] * 8)
    assert shorter.num_tokens == 8 and shorter.num_nulls == (0, 1)
    assert shorter.held(0) == tuple(manager.block_table("a", 0)[:2])
    assert manager.pool.ref_count(shorter.held(1)[0]) == 0  # released by the window, cached
    result = manager.allocate_slots("b", 9, prefix=shorter)
    manager.commit_tokens("b", (prompt[:9] + [77] * 8)[8:17])
    manager.check_progress("b", 17)
    manager.free("a")
    manager.free("b")
    assert manager.pool.num_used == 0
