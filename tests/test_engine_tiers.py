"""The prefix cache's lower tiers in the engine: blocks the pool evicts come back from
host memory or disk, after a restart too, and never change a token."""

from __future__ import annotations

import random

import pytest
import torch
from tiny_checkpoints import run_token_ids, tiny_engine

from pagedllm import EngineConfig, SamplingParams
from pagedllm.kv_storage.kv_cache import bytes_per_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
POOL_BLOCKS = 40  # 160 tokens: about three of the conversations below at once


def conversations(count: int = 12, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(30, 50))] for _ in range(count)]


def two_rounds(engine, chats: list[list[int]], params=GREEDY) -> list[list[list[int]]]:
    """Every chat, then every chat again with its answer and a new turn appended: by
    the second round the pool has evicted the first round's blocks."""
    first = run_token_ids(engine, chats, params)
    rng = random.Random(1)
    follow_ups = [
        chat + first[str(i)][0] + [rng.randrange(2, 500) for _ in range(8)]
        for i, chat in enumerate(chats)
    ]
    second = run_token_ids(engine, follow_ups, params)
    return [first[str(i)] for i in range(len(chats))] + [second[str(i)] for i in range(len(chats))]


@pytest.fixture(scope="module")
def expected(tiny_model):
    return two_rounds(tiny_engine(tiny_model, 1024), conversations())


def blocks_bytes(loaded, num_blocks: int) -> int:
    """Bytes of ``num_blocks`` of the tiny engine's blocks (float32, 4 tokens)."""
    mc = loaded.config
    return num_blocks * bytes_per_block(
        mc.num_layers, 4, mc.num_kv_heads, mc.head_dim, torch.float32
    )


def test_host_tier_restores_evicted_blocks_without_changing_a_token(tiny_model, expected):
    engine = tiny_engine(tiny_model, POOL_BLOCKS, kv_tier_memory=1 << 20)
    assert two_rounds(engine, conversations()) == expected
    stats = engine.get_stats()
    assert stats.tiers.spilled_blocks > 0 and stats.tiers.host_hits > 0
    assert stats.tiers.disk_hits == 0 and stats.num_blocks_used == 0


def test_seeded_sampling_is_the_same_with_tiers(tiny_model):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    plain = two_rounds(tiny_engine(tiny_model, POOL_BLOCKS), conversations(seed=2), params)
    tiered = tiny_engine(tiny_model, POOL_BLOCKS, kv_tier_memory=1 << 20)
    assert two_rounds(tiered, conversations(seed=2), params) == plain
    assert tiered.get_stats().tiers.host_hits > 0


def test_disk_tier_below_a_small_host_tier(tiny_model, expected, tmp_path):
    host = blocks_bytes(tiny_model, 8)
    engine = tiny_engine(tiny_model, POOL_BLOCKS, kv_tier_memory=host, kv_cache_dir=str(tmp_path))
    assert engine.tiers.host.num_slots == 8
    assert two_rounds(engine, conversations()) == expected
    stats = engine.get_stats().tiers
    assert stats.demoted_blocks > 0 and stats.disk_hits > 0 and stats.failed_loads == 0
    engine.shutdown()


def test_a_restarted_engine_finds_its_prefixes_on_disk(tiny_model, expected, tmp_path):
    chats = conversations()
    first = tiny_engine(tiny_model, 1024, kv_cache_dir=str(tmp_path))
    run_token_ids(first, chats, GREEDY)
    first.shutdown()  # writes the pool's cached blocks
    again = tiny_engine(tiny_model, 1024, kv_cache_dir=str(tmp_path))
    assert two_rounds(again, chats) == expected
    # every full block of the first round's prompts came back (the last token computes)
    assert again.get_stats().tiers.disk_hits >= sum((len(c) - 1) // 4 for c in chats)
    again.shutdown()


def test_another_format_does_not_read_the_directory(tiny_model, tmp_path):
    chats = conversations(4)
    first = tiny_engine(tiny_model, 1024, kv_cache_dir=str(tmp_path))
    run_token_ids(first, chats, GREEDY)
    first.shutdown()
    other = tiny_engine(tiny_model, 1024, kv_cache_dir=str(tmp_path), kv_cache_dtype="int8")
    run_token_ids(other, chats, GREEDY)
    assert other.get_stats().tiers.disk_hits == 0
    assert other.tiers.disk.stats().dropped_foreign > 0
    other.shutdown()


def test_a_tenants_blocks_are_not_restored_for_another_salt(tiny_model):
    engine = tiny_engine(tiny_model, POOL_BLOCKS, kv_tier_memory=4 << 20)  # room for both tenants
    chats = conversations()
    for i, chat in enumerate(chats):  # tenant a fills the tiers
        engine.add_request(f"a{i}", {"prompt_token_ids": chat}, GREEDY, cache_salt="a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().tiers.spilled_blocks > 0
    for i, chat in enumerate(chats):
        engine.add_request(f"b{i}", {"prompt_token_ids": chat}, GREEDY, cache_salt="b")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().tiers.host_hits == 0
    for i, chat in enumerate(chats):
        engine.add_request(f"a2{i}", {"prompt_token_ids": chat}, GREEDY, cache_salt="a")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.get_stats().tiers.host_hits > 0


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"enable_prefix_caching": False}, "enable_prefix_caching=False"),
        ({"kv_allocation": "contiguous"}, "kv_allocation"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size=2"),
        ({"load_format": "dummy", "kv_cache_dir": "kv"}, "load_format"),
        ({"kv_tier_wait": -1.0}, "kv_tier_wait"),
    ],
)
def test_refused_combinations(setting, message):
    settings = {"kv_tier_memory": "1GiB", **setting}
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_the_stats_line_reports_the_tiers(tiny_model, caplog):
    engine = tiny_engine(tiny_model, POOL_BLOCKS, kv_tier_memory=1 << 20, log_stats_interval=1e-9)
    with caplog.at_level("INFO", logger="pagedllm"):
        two_rounds(engine, conversations(4))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV tiers: host")]
    assert lines and "restored" in lines[-1] and " 0 blocks from host" not in lines[-1]
