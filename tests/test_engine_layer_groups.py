"""Per-layer-kind block tables through the engine: a tiny random Gemma 3 (five sliding
layers of window 8, then a global one) and a Qwen2 with a window on its upper layer
keep one table per KV layer group; sliding groups give their old blocks back while the
global group keeps the whole context, and greedy tokens still equal transformers'
through chunked prefill, prefix-cache hits, parallel samples (forks), preemption by
recompute and by swap, the prefix cache's lower tiers (and a restart), speculation
(n-gram guesses rolled back, a draft model), beam search and two tensor-parallel
ranks; against one table for every layer, tokens and logprobs are bit-identical."""

from __future__ import annotations

import pytest
from tiny_checkpoints import run_outputs, run_token_ids
from transformers_oracle import reference_greedy, write_random_checkpoint

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.kv.capacity import max_window_blocks
from pagedllm.models.loader import load_model

WINDOW = 8
BLOCK = 4
NEW_TOKENS = 12
GEMMA3 = dict(
    head_dim=16,
    sliding_window=WINDOW,
    query_pre_attn_scalar=24,
    num_hidden_layers=6,
    layer_types=["sliding_attention"] * 5 + ["full_attention"],
    rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
)
PROMPTS = [[(seed * 37 + i * 11) % 250 + 3 for i in range(n)] for seed, n in enumerate((29, 41, 7))]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """``(folder, expected greedy tokens per prompt)`` of a 6-layer Gemma 3."""
    folder = tmp_path_factory.mktemp("gemma3-groups")
    reference = write_random_checkpoint(folder, "gemma3_text", **GEMMA3)
    return folder, [reference_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def engine_for(folder, **overrides) -> LLMEngine:
    settings = dict(
        model=str(folder),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_memory="1MiB",
        log_stats_interval=0,
    )
    return LLMEngine(EngineConfig(**{**settings, **overrides}))


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, n=n, ignore_eos=True)


def tokens(outputs: dict[str, list[list[int]]]) -> list[list[list[int]]]:
    return [outputs[str(i)] for i in range(len(outputs))]


def watch_groups(engine: LLMEngine) -> list[tuple[int, int, list[int]]]:
    """Record, for every sequence each plan schedules, its tokens run, its table length
    and the blocks each group holds."""
    manager, plan_step = engine.block_manager, engine.scheduler.schedule
    seen = []

    def schedule():
        plan = plan_step()
        for item in plan.scheduled:
            seq_id = item.seq.seq_id
            held = [
                len(manager.block_table(seq_id, g)) - manager.num_null_blocks(seq_id, g)
                for g in range(manager.num_groups)
            ]
            seen.append((item.num_tokens, len(manager.block_table(seq_id)), held))
        return plan

    engine.scheduler.schedule = schedule
    return seen


def test_gemma3_keeps_a_table_per_group_and_sliding_groups_give_blocks_back(gemma3):
    folder, expected = gemma3
    engine = engine_for(folder, max_num_batched_tokens=16, max_num_seqs=4)  # in chunks
    manager = engine.block_manager
    assert manager.windows == (None,) + (WINDOW,) * 5  # 1 global layer, 5 sliding: groups of 1
    assert engine.kv_cache.num_layers == 1  # a block holds one layer of one group
    seen = watch_groups(engine)
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    for num_tokens, length, (global_held, *sliding_held) in seen:
        assert global_held == length  # the global group keeps every block
        assert max(sliding_held) <= max_window_blocks(WINDOW, num_tokens, BLOCK)
    assert max(length for _, length, _ in seen) == -(-(41 + NEW_TOKENS - 1) // BLOCK)
    decoding = [held[1:] for n, _, held in seen if n == 1]
    assert max(max(held) for held in decoding) == max_window_blocks(WINDOW, 1, BLOCK)
    engine.shutdown()


def test_prefix_hits_forks_and_recompute_keep_the_tokens(gemma3):
    folder, expected = gemma3
    pool = 80 * 2 * 2 * BLOCK * 16 * 4  # 80 blocks
    engine = engine_for(folder, kv_cache_memory=pool, max_num_batched_tokens=16, max_num_seqs=4)
    assert engine.block_manager.pool.num_blocks == 80 - 1  # the null block sits beside
    first = tokens(run_token_ids(engine, PROMPTS, greedy(n=2)))
    assert first == [[e, e] for e in expected]
    assert engine.scheduler.num_preemptions > 0  # 3 requests of 2 samples do not fit
    again = tokens(run_token_ids(engine, PROMPTS, greedy()))
    assert again == [[e] for e in expected]
    assert engine.block_manager.stats().prefix_cache_hits > 0
    engine.shutdown()


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_parks_and_restores_every_groups_blocks(gemma3, mode):
    """Preempted by swap, a sequence parks the blocks each group still holds and comes
    back with them (a sliding group's inside its window only)."""
    folder, expected = gemma3
    block = 2 * 2 * BLOCK * 16 * 4
    engine = engine_for(
        folder,
        kv_cache_memory=80 * block,
        swap_space=200 * block,
        preemption_mode=mode,
        max_num_batched_tokens=16,
        max_num_seqs=4,
    )
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), {"prompt_token_ids": prompt}, greedy(n=2))
    done, parked = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = [list(o.token_ids) for o in out.outputs]
        engine.scheduler.check_progress()  # each group's parked blocks counted
        parked = max(parked, sum(len(s.swap_block_ids) for s in engine.scheduler.swapped))
    assert [done[i] for i in range(len(PROMPTS))] == [[e, e] for e in expected]
    assert parked, "some sequence was swapped out"
    assert engine.block_manager.pool.num_used == 0
    assert engine.swap_space.stats().swap_ins > 0
    engine.shutdown()


def test_evicted_blocks_of_every_group_come_back_from_host_memory_and_disk(gemma3, tmp_path):
    """The pool evicts every group's cached blocks into the host tier (and disk); a
    request that comes back finds each content block in every group and restores the
    blocks its groups hold (a sliding group's inside its window), the tokens unchanged;
    a restarted engine finds them on disk."""
    folder, expected = gemma3
    block = 2 * 2 * BLOCK * 16 * 4
    tiers = dict(kv_tier_memory=400 * block, kv_cache_dir=str(tmp_path))
    small = dict(kv_cache_memory=80 * block, max_num_batched_tokens=16, max_num_seqs=4)
    engine = engine_for(folder, **small, **tiers)
    flood = [[(7 * i + j) % 250 + 3 for j in range(40)] for i in range(6)]
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    run_token_ids(engine, flood, greedy())  # the pool evicts the prompts' blocks
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    stats = engine.get_stats().tiers
    assert stats.spilled_blocks > 0 and stats.host_hits > 0
    engine.shutdown()  # persists every cached block
    again = engine_for(folder, **small, **tiers)
    assert tokens(run_token_ids(again, PROMPTS, greedy())) == [[e] for e in expected]
    assert again.get_stats().tiers.disk_hits > 0
    again.shutdown()


def test_beam_search_forks_every_groups_table(gemma3):
    from pagedllm import LLM
    from pagedllm.engine.beam_search import BeamSearchParams

    folder, _ = gemma3
    grouped = LLM(str(folder), dtype="float32", block_size=BLOCK, log_stats_interval=0)
    one = LLM(str(folder), dtype="float32", block_size=BLOCK, log_stats_interval=0,
              kv_layer_groups=False)  # fmt: skip
    assert grouped.llm_engine.block_manager.num_groups == 6
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    beams = [[b.tokens for b in out.sequences] for out in grouped.beam_search(prompts, params)]
    assert beams == [[b.tokens for b in out.sequences] for out in one.beam_search(prompts, params)]


def test_the_start_up_log_counts_blocks_per_group(gemma3, caplog):
    folder, _ = gemma3
    with caplog.at_level("INFO", logger="pagedllm"):
        engine = engine_for(folder, max_num_batched_tokens=16, max_num_seqs=4)
    # 256 tokens: 64 global blocks, and at most ceil((8 + 16 + 2) / 4) = 7 per sliding group
    assert "max_model_len 256, held in at most 99 blocks over the groups" in caplog.text
    assert "6 KV layer groups of 1 layers (1 global, 5 sliding over 8 tokens)" in caplog.text
    engine.shutdown()


def test_one_table_for_every_layer_on_request(gemma3):
    folder, expected = gemma3
    engine = engine_for(folder, kv_layer_groups=False)
    assert engine.block_manager.windows == (None,)
    assert engine.kv_cache.num_layers == 6
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    engine.shutdown()


def test_a_draft_model_drafts_in_the_global_groups_blocks(gemma3):
    """The draft's K/V ride in group 0's blocks (the global group's, never released by
    a window); its guesses roll back in every group."""
    folder, expected = gemma3
    spec = {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
    engine = engine_for(folder, speculative_config=spec)
    assert engine.block_manager.windows[0] is None and engine.block_manager.num_groups == 6
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0
    engine.shutdown()


def test_ngram_guesses_roll_back_in_every_group(gemma3):
    folder, expected = gemma3
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = engine_for(folder, speculative_config=spec)
    assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
    engine.shutdown()


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("kv_cache_dtype", "int4"),
    ],
)
def test_what_groups_do_not_run_yet_is_refused_with_the_way_out(gemma3, option, value):
    folder, _ = gemma3
    extra = {"block_size": 16} if option == "kv_cache_dtype" else {}
    with pytest.raises(ValueError, match="kv_layer_groups=False"):
        engine_for(folder, **{option: value}, **extra)


def test_qwen2_with_a_window_on_its_upper_layer_is_exact_in_the_layer_stack_too(tmp_path):
    reference = write_random_checkpoint(
        tmp_path, "qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    )
    assert load_model(str(tmp_path)).config.sliding_windows == (None, WINDOW)
    expected = [reference_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]
    for eager in (False, True):  # the C++ layer stack, and the layers one by one
        engine = engine_for(tmp_path, enforce_eager=eager)
        assert engine.block_manager.windows == (None, WINDOW)
        stacked = engine.worker.runner.layer_stack is not None
        assert stacked == (not eager and avx512_kernels_available())
        assert tokens(run_token_ids(engine, PROMPTS, greedy())) == [[e] for e in expected]
        engine.shutdown()


def test_two_ranks_keep_the_groups_tables(gemma3):
    folder, expected = gemma3
    engine = engine_for(folder, tensor_parallel_size=2, distributed_timeout=30.0)
    try:
        assert tokens(run_token_ids(engine, PROMPTS, greedy(n=2))) == [[e, e] for e in expected]
    finally:
        engine.shutdown()


def test_groups_change_no_token_or_logprob_against_one_table(gemma3):
    """Differential: the same requests (shared prefixes, seeded sampling, two samples,
    chunked prefill) on one table for every layer and on a table per group give the
    same tokens and logprobs, bit for bit: the kernels read the same K/V, only through
    other blocks. Both pools hold everything, so both schedule the same batches (a
    preemption would change them, and with them the products' rounding)."""
    import random

    folder, _ = gemma3
    rng = random.Random(5)
    system = [rng.randrange(3, 250) for _ in range(21)]
    prompts = [
        system[: rng.randint(0, 21)] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 30))]
        for _ in range(8)
    ]
    params = SamplingParams(
        temperature=0.8, seed=11, max_tokens=10, n=2, logprobs=2, ignore_eos=True
    )
    runs = []
    for groups in (False, True):
        engine = engine_for(
            folder,
            kv_layer_groups=groups,
            kv_cache_memory="8MiB",
            max_num_batched_tokens=16,
            max_num_seqs=4,
        )
        done = {
            request_id: [
                (o.token_ids, [(t.token_id, t.logprob) for t in o.logprobs]) for o in out.outputs
            ]
            for request_id, out in run_outputs(engine, prompts, params).items()
        }
        assert engine.scheduler.num_preemptions == 0
        assert engine.block_manager.stats().prefix_cache_hits > 0
        runs.append(done)
        engine.shutdown()
    assert runs[0] == runs[1]
