"""Who changes what in one step: the scheduler plans (bookkeeping only), one executor
applies the plan's copies, and the model runner keeps block tables from the plans'
deltas alone."""

from __future__ import annotations

import numpy as np
from test_engine_swap import workload
from tiny_checkpoints import tiny_engine

from pagedllm.engine.block_table_rows import BlockTableRows
from pagedllm.engine.sampling_params import SamplingParams


def test_block_table_rows_follow_deltas_and_reuse_rows():
    rows = BlockTableRows(columns=2, rows=1)
    rows.update(7, 0, [3, 4])
    rows.update(8, 0, [9])
    rows.update(7, 2, [5, 6])  # grows the columns
    rows.update(8, 0, [10, 11])  # copy-on-write replaced block 0, then one more block
    assert rows.gather([8, 7], 4).tolist() == [[10, 11, -1, -1], [3, 4, 5, 6]]
    rows.release([7])
    assert 7 not in rows
    rows.update(12, 0, [1])  # takes the released row, which was cleared
    assert rows.gather([12], 4).tolist() == [[1, -1, -1, -1]]


def test_runner_tables_equal_the_block_managers_through_forks_and_preemption(tiny_model):
    """Through the whole engine (forks of n > 1, copy-on-write, swap and recompute), the
    runner's tables follow the plans' deltas and every sequence's computed count agrees
    with the block manager before and after each step."""
    engine = tiny_engine(
        tiny_model,
        32,
        max_model_len=100,
        max_num_batched_tokens=64,
        preemption_mode="auto",
        swap_blocks=64,
    )
    prompts, params = workload(count=24)
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, param)
    saw_swap_copies = saw_cow = saw_swap_in = False
    manager, block_size = engine.block_manager, engine.config.block_size
    while engine.has_unfinished_requests():
        swapped = set(engine.scheduler.swapped)
        plan = engine.scheduler.schedule()
        for item in plan.scheduled:
            if item.seq in swapped:  # swapped in by this plan: back in the prefix cache
                saw_swap_in = True
                computed = item.seq.num_computed_tokens
                keys = engine.scheduler._extra_keys(item.seq)
                found = manager.find_cached_prefix(item.seq.all_token_ids[: computed + 1], keys)
                assert found.num_tokens == computed // block_size * block_size
        engine.scheduler.check_progress(plan)  # slots for the plan, none of it computed
        if plan.is_empty:
            continue
        swapped_out_bytes = engine.swap_space.stats().bytes_swapped_out
        if plan.swap_out:
            # planning moved no data: the executor does, in execute_plan
            assert engine.swap_space.stats().bytes_swapped_out == swapped_out_bytes
            saw_swap_copies = True
        saw_cow |= bool(plan.block_copies)
        engine.run_plan(plan)
        engine.scheduler.check_progress()  # forks, finishes and sampled tokens included
        for item in plan.scheduled:
            if item.seq.seq_id not in engine.block_manager:
                continue  # finished in this step
            held = engine.block_manager.block_table(item.seq.seq_id)
            runner = engine.runner.group_tables[0].gather([item.seq.seq_id], len(held))
            assert np.array_equal(runner[0], held)
    assert saw_swap_copies and saw_cow and saw_swap_in
    assert engine.block_manager.pool.num_used == 0


def test_token_counters_follow_vllms_definitions(tiny_model):
    """prompt_tokens_total counts each request's prompt once (recomputation after
    preemption and cached prefixes do not change it); generation_tokens_total counts
    every sampled token of every sample."""
    engine = tiny_engine(tiny_model, 32, max_model_len=100, max_num_batched_tokens=64)
    prompts, params = workload(count=24)
    for i, (prompt, param) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, param)
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += sum(len(sample.token_ids) for sample in out.outputs)
    stats = engine.get_stats()
    assert stats.num_preemptions_total > 0 and stats.prefix_cache_hits > 0
    assert stats.prompt_tokens_total == sum(len(p["prompt_token_ids"]) for p in prompts)
    assert stats.generation_tokens_total == generated


def test_running_and_waiting_count_requests_not_sequences(tiny_model):
    engine = tiny_engine(tiny_model, 64, max_model_len=100)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("fan", {"prompt_token_ids": list(range(10, 30))}, params)
    engine.add_request("solo", {"prompt_token_ids": list(range(40, 50))}, SamplingParams())
    engine.step()  # both prefilled; "fan" forks into three sequences
    assert len(engine.scheduler.running) == 4
    assert engine.get_stats().num_running == 2
