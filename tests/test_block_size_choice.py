"""``block_size="auto"`` (pagedllm/engine/block_size_choice.py): the waste a block size
costs a workload, the choice against fake timing tables, the lengths a server records,
and an engine that starts with the size chosen from them."""

from __future__ import annotations

import json
import logging
import sys

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st
from tiny_chat_model import write_tiny_chat_llama

from pagedllm import user_cache
from pagedllm.config import EngineConfig
from pagedllm.engine import block_size_choice
from pagedllm.engine.block_size_choice import (
    RequestLengthLog,
    RequestLengths,
    choose,
    choose_block_size,
    expected_waste,
    slack_sum,
)
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.server.launcher import ServerProcess

SHORT_CHAT = [RequestLengths(p, o) for p, o in [(16, 8), (40, 20), (64, 32), (23, 9)]]


@given(st.integers(0, 300), st.integers(0, 300), st.sampled_from([1, 2, 8, 16, 32]))
def test_slack_sum_counts_each_lengths_empty_slots(first, count, block_size):
    last = first + count - 1
    brute = sum(-length % block_size for length in range(first, last + 1))
    assert slack_sum(first, last, block_size) == brute


def test_expected_waste_is_the_mean_over_every_step_of_every_request():
    # one request: prompt 5, 3 outputs -> lengths 5, 6, 7 held at its 3 steps
    lengths = [RequestLengths(5, 3)]
    assert expected_waste(lengths, 4) == (3 + 2 + 1) / 3
    assert expected_waste(lengths, 8) == (3 + 2 + 1) / 3
    assert expected_waste(lengths, 16) == (11 + 10 + 9) / 3
    assert expected_waste(SHORT_CHAT, 8) < 0.6 * expected_waste(SHORT_CHAT, 16)


@pytest.mark.parametrize(
    ("timings", "chosen"),
    [
        ({8: 1.0, 16: 1.0, 32: 1.0}, 8),  # all as fast: the least waste
        ({8: 1.02, 16: 1.01, 32: 1.0}, 8),  # within the margin
        ({8: 1.5, 16: 1.01, 32: 1.0}, 16),  # 8 too slow; 16 within 3% of 32
        ({8: 2.0, 16: 1.2, 32: 1.0}, 32),  # only 32 fast enough
        ({8: 1.0, 16: 2.0, 32: 2.0}, 8),
    ],
)
def test_choice_against_fake_timing_tables(timings, chosen):
    assert choose(timings, SHORT_CHAT) == chosen


def test_equal_waste_takes_the_larger_size():
    equal = [RequestLengths(32, 1)]  # 32 tokens held: no size wastes a slot
    assert choose({8: 1.0, 16: 1.0, 32: 1.0}, equal) == 32


def test_fallbacks_say_why():
    layout = ("bfloat16", 9, 3, 64)
    assert choose_block_size(layout, [])[0] == 16
    assert "no request lengths" in choose_block_size(layout, [])[1]
    assert choose_block_size(layout, SHORT_CHAT, on_cpu=False) == (
        16,
        "the attention kernel is timed on the CPU only",
    )


def test_real_timing_of_each_size(monkeypatch, tmp_path):
    import torch

    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path)
    chosen, reason = choose_block_size((torch.float32, 4, 2, 64), SHORT_CHAT)
    assert chosen in block_size_choice.CANDIDATES
    assert "4 recorded requests, decode timed at 128 tokens" in reason
    (table,) = tmp_path.glob("block-size-*.json")
    timings = next(iter(json.loads(table.read_text())["timings"].values()))["decode"]
    assert sorted(int(b) for b in timings) == [8, 16, 32] and min(timings.values()) > 0


def test_length_log_appends_reads_and_trims(monkeypatch, tmp_path):
    monkeypatch.setattr(block_size_choice, "MAX_RECORDED", 3)
    log = RequestLengthLog("some model", tmp_path)
    for i in range(7):
        log.add(10 + i, i)
    log.close()
    assert log.read() == [RequestLengths(14, 4), RequestLengths(15, 5), RequestLengths(16, 6)]
    RequestLengthLog("some model", tmp_path).add(1, 1)  # reopened: trimmed to the newest 3
    assert len(log.path.read_text().splitlines()) == 4
    assert RequestLengthLog("another model", tmp_path).read() == []


def fake_timings(layout, context, candidates):
    return {"decode": {8: 1.0, 16: 1.0, 32: 1.0}}


def test_a_server_records_lengths_and_the_next_engine_chooses_from_them(
    monkeypatch, tmp_path, caplog
):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache" / "pagedllm"))
    model = write_tiny_chat_llama(tmp_path / "model")
    args = ["--model", str(model), "--dtype", "float32"]
    with ServerProcess(args, entry=[sys.executable, "-m", "pagedllm.cli"]) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        name = client.models.list().data[0].id
        for prompt in ("the river rises", "in the northern hills and flows south"):
            client.completions.create(model=name, prompt=prompt, max_tokens=5, temperature=0.0)
    (log,) = (tmp_path / "cache" / "pagedllm").glob("request-lengths-*.jsonl")
    recorded = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["output"] for r in recorded] == [5, 5] and all(r["prompt"] > 0 for r in recorded)

    monkeypatch.setattr(block_size_choice, "time_block_sizes", fake_timings)
    monkeypatch.setattr(user_cache, "cache_dir", lambda: log.parent)  # the server's cache
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size="auto"))
    assert engine.config.block_size == 8  # short requests, every size as fast
    assert engine.block_manager.block_size == 8
    assert "block_size auto: 8 (2 recorded requests" in caplog.text


def test_a_workload_trace_instead_and_what_auto_refuses(monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(user_cache, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(block_size_choice, "time_block_sizes", fake_timings)
    model = write_tiny_chat_llama(tmp_path / "model")
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"prompt": 4000, "output": 64}) + "\n" for _ in range(3)))
    config = EngineConfig(
        model=str(model), dtype="float32", block_size="auto", block_size_workload=str(trace)
    )
    assert config.block_size == 0  # resolved when the engine starts
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        engine = LLMEngine(config)
    assert engine.config.block_size in (8, 16, 32)
    assert "3 recorded requests, decode timed at 4096 tokens" in caplog.text
    (tmp_path / "empty.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="holds no request lengths"):
        LLMEngine(EngineConfig(model=str(model), dtype="float32", block_size="auto",
                               block_size_workload=str(tmp_path / "empty.jsonl")))  # fmt: skip
    with pytest.raises(ValueError, match="power of two or 'auto'"):
        EngineConfig(block_size="big")
    with pytest.raises(ValueError, match="one rank"):
        EngineConfig(block_size="auto", tensor_parallel_size=2)
