"""The block-pool trace: snapshots from block tables, shared blocks, and the PNG."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from pagedllm.bench.pool_trace import FREE, PoolTracer, draw_trace
from pagedllm.kv.block_manager import BlockManager

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_engine(num_blocks: int = 16, block_size: int = 4) -> SimpleNamespace:
    manager = BlockManager(num_blocks, block_size, reserved_fraction=0.0)
    return SimpleNamespace(
        block_manager=manager, scheduler=SimpleNamespace(running=[]), step=lambda: []
    )


def run(engine, seq_id: int, num_tokens: int) -> None:
    engine.block_manager.allocate_slots(seq_id, num_tokens)
    engine.scheduler.running.append(SimpleNamespace(seq_id=seq_id))


def test_snapshot_owners_shared_blocks_and_fragmentation(tmp_path):
    engine = fake_engine()
    tracer = PoolTracer(engine).attach()
    run(engine, 7, 10)  # 3 blocks, 2 empty slots
    engine.step()
    engine.block_manager.fork(7, 8)  # shares all three
    engine.scheduler.running.append(SimpleNamespace(seq_id=8))
    run(engine, 9, 5)
    engine.step()
    first, second = tracer.trace.snapshots
    assert tracer.trace.seq_ids == [7, 8, 9]
    table_7 = engine.block_manager.block_table(7)
    assert set(np.flatnonzero(first.owners != FREE)) == set(table_7)
    assert (first.used_blocks, first.allocated_slots, first.live_tokens) == (3, 12, 10)
    assert first.fragmentation_slots == 2 and first.shared.size == 0
    assert sorted(second.shared.tolist()) == sorted(table_7)
    assert second.used_blocks == 5 and second.num_running == 3
    assert second.fragmentation_slots == 2 + 3
    path = tmp_path / "trace.png"
    draw_trace(tracer.trace, path)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_finished_sequences_leave_the_trace_free():
    engine = fake_engine()
    tracer = PoolTracer(engine)
    run(engine, 1, 6)
    tracer.record()
    engine.block_manager.free(1)
    engine.scheduler.running.clear()
    snapshot = tracer.record()
    assert (snapshot.owners == FREE).all() and snapshot.used_blocks == 0


def test_empty_trace_cannot_be_drawn(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        draw_trace(PoolTracer(fake_engine()).trace, tmp_path / "x.png")


def test_engine_run_records_every_step(tmp_path):
    from pagedllm.bench.tiny_llama import write_tiny_llama
    from pagedllm.config import EngineConfig
    from pagedllm.engine.llm_engine import LLMEngine
    from pagedllm.engine.sampling_params import SamplingParams

    folder = write_tiny_llama(tmp_path / "tiny")
    config = EngineConfig(
        model=str(folder),
        dtype="float32",
        kv_cache_memory=64 * 2 * 2 * 2 * 64 * 4 * 16,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        log_stats_interval=0,
    )
    engine = LLMEngine(config)
    tracer = PoolTracer(engine).attach()
    prefix = list(range(2, 42))
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=12, n=2)
    for index in range(4):
        engine.add_request(None, {"prompt_token_ids": prefix + [50 + index] * (index + 3)}, params)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    trace = tracer.trace
    assert len(trace.snapshots) == steps and trace.num_blocks == engine.num_blocks
    # Every referenced block belongs to a running sequence's table, shared ones once.
    assert all((s.owners != FREE).sum() == s.used_blocks for s in trace.snapshots)
    assert max(s.num_running for s in trace.snapshots) > 1
    assert trace.snapshots[-1].used_blocks == 0
    draw_trace(trace, tmp_path / "engine_trace.png")
