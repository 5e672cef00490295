"""The scheduler alone, over a real block manager and no model: budgets, chunked
prefill, preemption order, priorities, the contiguous reservation, and one count of
each sequence's progress through every path (swap, recompute, fork, prefix hits,
sliding window, compact blocks parked and restored in their own kind)."""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from pagedllm.config import PreemptionMode
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import SequenceStatus, TokenSequence
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.block_pool import BlockPool


def make_seq(prompt_len: int, arrival: float, priority: int = 0) -> TokenSequence:
    return TokenSequence(
        request_id=f"r{arrival}",
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=8),
        arrival_time=arrival,
        priority=priority,
    )


def run_step(scheduler: Scheduler, next_token: int = 7) -> list[tuple[TokenSequence, int]]:
    """One step as the engine does it: plan, compute (the scheduler commits), then sample
    where a sequence ends; every sequence's progress is checked in the step and after."""
    plan = scheduler.schedule()
    scheduler.check_progress(plan)
    for seq in scheduler.update_from_output(plan):
        seq.append_token(next_token)
    scheduler.check_progress()
    return [(item.seq, item.num_tokens) for item in plan.scheduled]


# The prompts of make_seq share their first tokens; the tests counting chunks and blocks
# turn prefix caching off, so that every token is computed.


def test_decodes_run_before_prefill_chunks_within_the_budget():
    manager = BlockManager(
        num_blocks=64, block_size=4, reserved_fraction=0.0, enable_prefix_caching=False
    )
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=10)
    first = make_seq(6, arrival=0.0)
    scheduler.add(first)
    assert run_step(scheduler) == [(first, 6)]
    second = make_seq(30, arrival=1.0)
    scheduler.add(second)
    # the running decode takes 1 token, the new prompt gets the other 9
    assert run_step(scheduler) == [(first, 1), (second, 9)]
    assert second.num_output_tokens == 0
    assert run_step(scheduler) == [(first, 1), (second, 9)]
    assert run_step(scheduler) == [(first, 1), (second, 9)]
    assert run_step(scheduler) == [(first, 1), (second, 3)]
    assert second.num_output_tokens == 1
    assert manager.num_tokens(second.seq_id) == 30


def test_max_num_seqs_limits_admission():
    manager = BlockManager(num_blocks=64, block_size=4, reserved_fraction=0.0)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [make_seq(3, arrival=float(i)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert [seq for seq, _ in run_step(scheduler)] == seqs[:2]
    assert scheduler.waiting == [seqs[2]]


def test_pool_exhaustion_preempts_latest_arrival_and_requeues_it_first():
    # 4 blocks of 2 tokens; two sequences of 3 tokens hold 2 blocks each
    manager = BlockManager(num_blocks=4, block_size=2, reserved_fraction=0.0)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new, later = make_seq(3, 0.0), make_seq(3, 1.0), make_seq(2, 2.0)
    for seq in (old, new, later):
        scheduler.add(seq)
    assert [s for s, _ in run_step(scheduler)] == [old, new]
    assert [s for s, _ in run_step(scheduler)] == [old, new]
    # both now hold 4 tokens in 2 blocks each; their next tokens need a third block each
    ran = run_step(scheduler)
    assert ran == [(old, 1)]
    assert new.status is SequenceStatus.PREEMPTED
    assert new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert scheduler.num_preemptions == 1
    assert scheduler.waiting == [new, later]  # ahead of the later arrival
    assert new.seq_id not in manager


def test_preempted_sequence_recomputes_prompt_and_outputs():
    manager = BlockManager(
        num_blocks=4, block_size=2, reserved_fraction=0.0, enable_prefix_caching=False
    )
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    old, new = make_seq(3, 0.0), make_seq(3, 1.0)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)
    run_step(scheduler)
    run_step(scheduler)  # preempts `new` holding prompt + 2 output tokens
    assert new.status is SequenceStatus.PREEMPTED
    scheduler.finish(old, SequenceStatus.FINISHED_LENGTH)
    assert manager.pool.num_free == 4
    assert run_step(scheduler) == [(new, 5)]  # 3 prompt tokens + 2 output tokens again
    assert new.num_output_tokens == 3


def test_head_of_line_waits_instead_of_being_skipped():
    manager = BlockManager(
        num_blocks=4, block_size=4, reserved_fraction=0.0, enable_prefix_caching=False
    )
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    running = make_seq(8, 0.0)
    scheduler.add(running)
    run_step(scheduler)
    big, small = make_seq(12, 1.0), make_seq(2, 2.0)
    scheduler.add(big)
    scheduler.add(small)
    # big needs 3 blocks, 2 are free after `running` takes its third: FCFS means small waits
    assert [s for s, _ in run_step(scheduler)] == [running]
    assert scheduler.waiting == [big, small]


def test_priority_orders_queue_and_only_high_priority_uses_reserve():
    manager = BlockManager(num_blocks=20, block_size=1, reserved_fraction=0.5)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    normal = make_seq(11, 0.0)
    urgent = make_seq(11, 1.0, priority=-1)
    scheduler.add(normal)
    scheduler.add(urgent)
    assert scheduler.waiting == [urgent, normal]
    assert [s for s, _ in run_step(scheduler)] == [urgent]
    # 9 blocks left, all of them below the reserve of 10: the normal request must wait
    assert scheduler.waiting == [normal]


def test_contiguous_mode_reserves_max_model_len_up_front():
    manager = BlockManager(num_blocks=16, block_size=4, reserved_fraction=0.0, upfront_tokens=32)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seqs = [make_seq(3, float(i)) for i in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    ran = run_step(scheduler)
    assert [s for s, _ in ran] == seqs[:2]  # 8 blocks each: only two fit in 16
    assert manager.pool.num_free == 0
    for _ in range(20):  # growth inside the reservation never allocates or preempts
        run_step(scheduler)
    assert scheduler.num_preemptions == 0


@pytest.mark.parametrize(
    "status", [SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_ABORTED]
)
def test_finish_returns_blocks_at_once(status):
    manager = BlockManager(num_blocks=8, block_size=4, reserved_fraction=0.0)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq(10, 0.0)
    scheduler.add(seq)
    run_step(scheduler)
    assert manager.pool.num_free == 5
    scheduler.finish(seq, status)
    assert manager.pool.num_free == 8
    assert not scheduler.has_unfinished
    assert seq.status is status


class FakeSwapSpace:
    """The swap space's bookkeeping (parked blocks of both kinds) without its tensors."""

    def __init__(self, num_blocks: int, block_size: int, num_compact_blocks: int = 0) -> None:
        self.pool = BlockPool(num_blocks, block_size, 0.0, num_compact_blocks)

    def is_compact(self, swap_id: int) -> bool:
        return self.pool.is_compact(swap_id)

    def can_hold(self, num_blocks: int, num_compact: int = 0) -> bool:
        return self.pool.can_allocate(num_blocks) and num_compact <= self.pool.num_compact_free

    def park(self, num_blocks: int, num_compact: int = 0) -> list[int]:
        return self.pool.allocate_compact(num_compact) + self.pool.allocate(num_blocks)

    def unpark(self, swap_ids: list[int]) -> None:
        self.pool.free(swap_ids)

    def free(self, swap_ids: list[int]) -> None:
        self.pool.free(swap_ids)


def test_progress_check_names_a_computed_count_out_of_step():
    manager = BlockManager(num_blocks=8, block_size=4, reserved_fraction=0.0)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    seq = make_seq(6, 0.0)
    scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.check_progress(plan)
    with pytest.raises(AssertionError, match="reserved 6 != committed 0 \\+ scheduled 0"):
        scheduler.check_progress()  # inside the step, the plan's tokens are reserved only
    scheduler.update_from_output(plan)
    scheduler.check_progress()
    seq.num_computed_tokens += 1  # counted by hand, not through the scheduler
    with pytest.raises(AssertionError, match="committed 6 != computed 7"):
        scheduler.check_progress()


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 14), st.integers(-1, 1), st.booleans()),
        st.tuples(st.just("step"), st.integers(1, 4)),
        st.tuples(st.just("fork"), st.integers(0, 99)),
        st.tuples(st.just("abort"), st.integers(0, 99)),
    ),
    min_size=4,
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4]),
    num_blocks=st.integers(3, 16),
    sliding_window=st.sampled_from([None, None, 3, 6]),
    recent_tokens=st.sampled_from([None, None, 0, 2, 5]),
    enable_prefix_caching=st.booleans(),
    preemption_mode=st.sampled_from(list(PreemptionMode)),
    swap_blocks=st.integers(1, 16),
    compact_blocks=st.tuples(st.integers(1, 24), st.integers(0, 16)),
    max_num_batched_tokens=st.integers(1, 24),
    max_num_seqs=st.integers(1, 6),
    actions=ACTIONS,
)
def test_computed_counts_follow_the_block_manager_through_every_path(
    block_size,
    num_blocks,
    sliding_window,
    recent_tokens,
    enable_prefix_caching,
    preemption_mode,
    swap_blocks,
    compact_blocks,
    max_num_batched_tokens,
    max_num_seqs,
    actions,
):
    """Random workloads of admissions, steps, forks and aborts, with chunked prefills,
    prefix hits, both preemptions, and a sliding window or compact blocks behind a
    window of ``recent_tokens`` (``compact_blocks`` in the pool and the swap space):
    after every plan and every step each running sequence's computed count is its
    committed count (the table's slots run ahead by the plan's tokens; compact entries
    only behind the window), each swapped one's parked blocks cover its computed
    tokens, each block parks in a swap block of its kind, and a parked compact block
    comes back compact."""
    if sliding_window is not None:
        recent_tokens = None
    num_compact, swap_compact = compact_blocks if recent_tokens is not None else (0, 0)
    manager = BlockManager(
        num_blocks,
        block_size,
        reserved_fraction=0.0,
        enable_prefix_caching=enable_prefix_caching,
        sliding_window=sliding_window,
        num_compact_blocks=num_compact,
        recent_tokens=recent_tokens,
    )
    swap_space = FakeSwapSpace(swap_blocks, block_size, swap_compact)
    scheduler = Scheduler(
        manager,
        max_num_seqs,
        max_num_batched_tokens,
        cache_key="model",
        swap_space=swap_space,
        preemption_mode=preemption_mode,
    )
    capacity = num_blocks * block_size
    live: list[TokenSequence] = []
    arrival = 0.0
    seen: set[str] = set()
    forks: list[int] = []  # asked for, made after the next step that ends a sequence

    def fork(parent: TokenSequence) -> TokenSequence:
        child = parent.branch()
        scheduler.fork(parent, child)
        live.append(child)
        seen.add("fork")
        return child

    def step() -> None:
        plan = scheduler.schedule()
        scheduler.check_progress(plan)
        seen.update(["swap out"] * bool(plan.swap_out) + ["swap in"] * bool(plan.swap_in))
        pool = manager.pool
        for block_id, swap_id in plan.swap_out:
            assert pool.is_compact(block_id) == swap_space.is_compact(swap_id)
        for swap_id, block_id in plan.swap_in:
            assert pool.is_compact(block_id) or not swap_space.is_compact(swap_id)
            if pool.is_compact(block_id):
                seen.add("swapped in compact")
        if any(seq.status is SequenceStatus.PREEMPTED for seq in plan.preempted):
            seen.add("recompute")
        if any(manager.num_null_blocks(seq.seq_id) for seq in scheduler.running):
            seen.add("window released blocks")
        ending = scheduler.update_from_output(plan)
        scheduler.check_progress()
        if forks and ending:  # as the engine forks samples, and beam search beams
            ending.append(fork(ending[forks.pop() % len(ending)]))
            scheduler.check_progress()
        for seq in ending:
            seq.append_token((seq.seq_id + seq.num_tokens) % 3)
            if seq.num_tokens >= seq.num_prompt_tokens + seq.params.max_tokens:
                scheduler.finish(seq, SequenceStatus.FINISHED_LENGTH)
        scheduler.check_progress()

    for action in actions:
        if action[0] == "add":
            _, prompt_len, priority, logprobs = action
            max_tokens = max(1, min(10, capacity - prompt_len))  # fits the pool alone
            prompt_len = min(prompt_len, capacity - max_tokens)
            arrival += 1.0
            seq = TokenSequence(
                request_id=f"r{arrival}",
                prompt_token_ids=[0, 1, 2, 0, 1, 2, 0, 1][:prompt_len] + [1] * (prompt_len - 8),
                params=SamplingParams(
                    max_tokens=max_tokens, prompt_logprobs=1 if logprobs else None
                ),
                arrival_time=arrival,
                priority=priority,
            )
            scheduler.add(seq)
            live.append(seq)
        elif action[0] == "step":
            for _ in range(action[1]):
                step()
        elif action[0] == "fork":
            forks.append(action[1])
        else:
            candidates = [seq for seq in live if not seq.is_finished]
            if candidates:
                seq = candidates[action[1] % len(candidates)]
                seen.add(f"abort {seq.status.name}")
                scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
                scheduler.check_progress()
    for _ in range(40):  # drain (aborting the rest afterwards, whatever is left)
        if not scheduler.has_unfinished:
            break
        step()
    if manager.stats().prefix_cache_hits:
        seen.add("prefix hit")
    for name in sorted(seen):
        event(name)
    for seq in live:
        if not seq.is_finished:
            scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
    scheduler.check_progress()
    assert not scheduler.has_unfinished
    assert manager.pool.num_used == 0 and swap_space.pool.num_used == 0
