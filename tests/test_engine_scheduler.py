"""The scheduler alone, over a real block manager and no model: budgets, chunked
prefill, preemption order, priorities and the contiguous reservation."""

from __future__ import annotations

import pytest

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.scheduler import Scheduler
from pagedllm.engine.sequence import SequenceStatus, TokenSequence
from pagedllm.kv.block_manager import BlockManager


def make_seq(prompt_len: int, arrival: float, priority: int = 0) -> TokenSequence:
    return TokenSequence(
        request_id=f"r{arrival}",
        prompt_token_ids=list(range(prompt_len)),
        params=SamplingParams(max_tokens=8),
        arrival_time=arrival,
        priority=priority,
    )


def run_step(scheduler: Scheduler, next_token: int = 7) -> list[tuple[TokenSequence, int]]:
    """One step as the engine does it: compute, then sample where a sequence ends."""
    plan = scheduler.schedule()
    ran = []
    for item in plan.scheduled:
        samples = item.will_sample
        item.seq.num_computed_tokens += item.num_tokens
        if samples:
            item.seq.append_token(next_token)
        ran.append((item.seq, item.num_tokens))
    return ran


def test_decodes_run_before_prefill_chunks_within_the_budget():
    manager = BlockManager(num_blocks=64, block_size=4, reserved_fraction=0.0)
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
    manager = BlockManager(num_blocks=4, block_size=2, reserved_fraction=0.0)
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
    manager = BlockManager(num_blocks=4, block_size=4, reserved_fraction=0.0)
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
