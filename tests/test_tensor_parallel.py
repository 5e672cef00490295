"""Tensor parallelism (gloo, one thread per rank): the split itself, greedy tokens and
logprobs equal to one rank's on tiny checkpoints and on the default model, prefix caching,
preemption (recompute and swap), n > 1 and beam search across ranks, and failures: a rank
killed or hung makes the engine fail with a clear error in bounded time, and no rank ever
outlives the engine."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from tiny_chat_model import write_tiny_chat_llama
from tiny_checkpoints import run_outputs

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.tiny_llama import write_tiny_llama
from pagedllm.distributed.errors import WorkerFailedError
from pagedllm.distributed.shm_all_reduce import process_alive
from pagedllm.engine import llm_engine
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.llm import LLM
from pagedllm.models.config import ModelConfig
from pagedllm.models.partition import PartitionError, TensorPartition, even_ranges
from pagedllm.server.launcher import ServerProcess, free_port

PROMPTS = [[(7 * i + j) % 500 + 2 for j in range(5 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


def shape(heads: int, kv_heads: int, **fields) -> ModelConfig:
    values = dict(
        architecture="llama",
        num_layers=2,
        hidden_size=64 * heads,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=64,
        intermediate_size=300,
        vocab_size=1001,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attention_bias=False,
    )
    values.update(fields)
    return ModelConfig(**values)


# ---- the split ------------------------------------------------------------------------


def test_even_ranges_cover_everything_once():
    for total in range(1, 20):
        for parts in range(1, 6):
            ranges = even_ranges(total, parts)
            assert [i for r in ranges for i in r] == list(range(total))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize(
    ("heads", "kv_heads", "world", "q_heads", "kv"),
    [
        (8, 4, 2, [(0, 4), (4, 8)], [(0, 2), (2, 4)]),
        (9, 3, 2, [(0, 6), (6, 9)], [(0, 2), (2, 3)]),  # uneven: whole groups, 2 + 1
        (4, 1, 2, [(0, 2), (2, 4)], [(0, 1), (0, 1)]),  # one KV head, replicated
        (8, 2, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 1), (0, 1), (1, 2), (1, 2)]),
    ],
)
def test_ranks_hold_whole_groups(heads, kv_heads, world, q_heads, kv):
    partition = TensorPartition(shape(heads, kv_heads), world)
    slices = [partition.rank_slice(r) for r in range(world)]
    assert [(s.q_heads.start, s.q_heads.stop) for s in slices] == q_heads
    assert [(s.kv_heads.start, s.kv_heads.stop) for s in slices] == kv
    group = heads // kv_heads
    for s in slices:  # every query head a rank holds reads a KV head the rank holds
        assert {h // group for h in s.q_heads} <= set(s.kv_heads)
    assert partition.max_kv_heads == max(len(s.kv_heads) for s in slices)
    local = partition.local_config(0)
    assert local.num_heads == len(slices[0].q_heads)
    assert local.num_kv_heads == len(slices[0].kv_heads)
    assert sum(len(s.intermediate) for s in slices) == 300


def test_vocabulary_shards_are_equal_and_cover_the_vocabulary():
    partition = TensorPartition(shape(4, 2), 2)
    assert partition.vocab_shard == 501
    shards = [partition.rank_slice(r).vocab for r in range(2)]
    assert shards == [range(0, 501), range(501, 1001)]


@pytest.mark.parametrize(
    ("config", "world", "words"),
    [
        (shape(4, 2, sparse_layers=(True, True), num_experts=4, num_experts_per_tok=2,
               moe_intermediate_size=32), 2, "mixture-of-experts"),
        (shape(6, 3), 4, "cannot be split"),
        (shape(4, 2, architecture="olmo2", qk_norm="projection"), 2, "norms q and k"),
    ],
)
def test_models_that_cannot_be_split_are_refused(config, world, words):
    with pytest.raises(PartitionError, match=words):
        TensorPartition(config, world)


# ---- whole engines --------------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    shapes = {"kv1": (4, 1), "kv2": (4, 2), "kv3": (6, 3), "kv4": (4, 4)}
    return {
        name: write_tiny_llama(root / name, num_attention_heads=h, num_key_value_heads=kv,
                               hidden_size=64 * h)
        for name, (h, kv) in shapes.items()
    }


def make_engine(folder: Path, tp: int, **overrides) -> LLMEngine:
    settings = dict(
        model=str(folder),
        dtype="float32",
        tensor_parallel_size=tp,
        kv_cache_memory="8MiB",
        block_size=4,
        log_stats_interval=0,
        distributed_timeout=30.0,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def outputs_of(engine: LLMEngine, prompts, params) -> dict[str, object]:
    try:
        return run_outputs(engine, prompts, params)
    finally:
        engine.shutdown()


def assert_close(xs: list, ys: list, tolerance: float = 1e-4) -> None:
    """Two lists of ``TokenLogprobs``: same tokens, ranks and top tokens; logprobs within
    ``tolerance``."""
    for x, y in zip(xs, ys, strict=True):
        assert (x.token_id, x.rank) == (y.token_id, y.rank)
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert abs(x.logprob - y.logprob) < tolerance
        assert all(abs(a - b) < tolerance for (_, a), (_, b) in zip(x.top, y.top, strict=True))


def assert_same(one: dict, two: dict, tolerance: float = 1e-4) -> None:
    """Same requests, same tokens per sample, logprobs (when asked) within ``tolerance``."""
    assert one.keys() == two.keys()
    for rid in one:
        for a, b in zip(one[rid].outputs, two[rid].outputs, strict=True):
            assert a.token_ids == b.token_ids, rid
            assert_close(a.logprobs or [], b.logprobs or [], tolerance)


@pytest.mark.parametrize(
    ("name", "gloo"),
    [("kv1", False), ("kv2", False), ("kv2", True), ("kv3", False), ("kv4", False)],
)
def test_two_ranks_generate_what_one_does(folders, name, gloo):
    params = dataclasses.replace(GREEDY, prompt_logprobs=1) if name == "kv3" else GREEDY
    one = outputs_of(make_engine(folders[name], 1), PROMPTS, params)
    engine = make_engine(folders[name], 2, disable_custom_all_reduce=gloo)
    assert (engine.executor.group.shared is None) == gloo
    assert engine.kv_cache.num_kv_heads == TensorPartition(engine.model_config, 2).max_kv_heads
    two = outputs_of(engine, PROMPTS, params)
    assert_same(one, two)
    if name == "kv3":
        for rid in one:
            assert_close(one[rid].prompt_logprobs[1:], two[rid].prompt_logprobs[1:])


def test_int4_blocks_by_age_on_two_ranks_generate_what_one_does(folders):
    """Each rank re-encodes its own heads of the same blocks into compact ones. Logprobs
    within 1e-3: the compact kernel rounds the folded query and the weights to 16 bits,
    so inputs a float rounding apart (the ranks' sums go in another order) can round a
    step apart there (measured 1.05e-4 apart, 2e-5 with 24-bit queries)."""
    by_age = dict(kv_cache_dtype="int4", kv_recent_tokens=4, block_size=16)
    one_engine = make_engine(folders["kv2"], 1, **by_age)
    one = outputs_of(one_engine, PROMPTS, GREEDY)
    pool = one_engine.block_manager.pool
    compact_ids = range(pool.compact_offset, pool.compact_offset + pool.num_compact_blocks)
    assert any(pool.block_key(b) is not None for b in compact_ids)  # blocks were re-encoded
    two_engine = make_engine(folders["kv2"], 2, **by_age)
    assert two_engine.kv_cache.compact.num_kv_heads == 1
    assert_same(one, outputs_of(two_engine, PROMPTS, GREEDY), tolerance=1e-3)


def test_each_rank_holds_the_blocks_the_planner_counts(folders):
    from pagedllm.plan.capacity import blocks_per_rank

    budget = 3 << 20
    engine = make_engine(folders["kv3"], 2, kv_cache_memory=budget)
    try:
        assert engine.num_blocks == blocks_per_rank(engine.model_config, 2, budget, 4)
        assert engine.kv_cache.nbytes <= budget  # rank 0 holds the most KV heads (2 of 3)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_default_model_on_two_ranks_generates_what_one_does():
    prompts = [[1, 504, 3458, 282, 4182, 314] + [(97 * i + 13 * j) % 49000 + 17 for j in range(i)]
               for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=1)
    results = {}
    for tp in (1, 2):
        engine = LLMEngine(EngineConfig(tensor_parallel_size=tp, kv_cache_memory="64MiB",
                                        dtype="float32", log_stats_interval=0))
        results[tp] = outputs_of(engine, prompts, params)
    assert_same(results[1], results[2])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sharing_preemption_and_parallel_samples_across_ranks(folders, mode):
    prefix = list(range(2, 34))
    prompts = [prefix + [100 + i, 200 + i] for i in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3, n=2, ignore_eos=True)
    # a pool of 64 blocks of 4 tokens: 8 requests x 2 samples x up to 58 tokens preempt
    swap = "4MiB" if mode == "swap" else 0
    results, stats = {}, {}
    for tp in (1, 2):
        pool = 64 * block_bytes(folders["kv2"], tp)
        engine = make_engine(
            folders["kv2"], tp, kv_cache_memory=pool, max_num_seqs=16, preemption_mode=mode,
            swap_space=swap,
        )
        try:
            results[tp] = run_outputs(engine, prompts, params)
            stats[tp] = engine.get_stats()
        finally:
            engine.shutdown()
    assert_same(results[1], results[2])
    assert stats[2].num_blocks_total == stats[1].num_blocks_total == 64
    assert stats[2].num_preemptions_total > 0 and stats[2].prefix_cache_hits > 0
    if mode == "swap":
        assert stats[2].swap.swap_outs > 0


def test_int4_swap_across_ranks_parks_each_ranks_own_tiles(folders):
    """Each rank parks and restores the compact and full blocks of its own KV heads
    under the same ids: two ranks swapping generate what one does, and every block of
    both tiers is free at the end."""
    prompts = [[(13 * i + 7 * j) % 480 + 2 for j in range(20 + i)] for i in range(10)]
    params = SamplingParams(max_tokens=90, temperature=0, ignore_eos=True, n=2)
    by_age = dict(
        kv_cache_dtype="int4",
        kv_recent_tokens=16,
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        preemption_mode="swap",
    )
    results, stats = {}, {}
    for tp in (1, 2):
        budget = (2 << 20) // tp  # the same blocks on rank 0, holding 1 of the 2 KV heads
        engine = make_engine(
            folders["kv2"], tp, kv_cache_memory=budget, swap_space=budget, **by_age
        )
        try:
            results[tp] = run_outputs(engine, prompts, params)
            stats[tp] = engine.get_stats()
            assert engine.block_manager.pool.num_compact_used == 0
        finally:
            engine.shutdown()
    assert_same(results[1], results[2])
    assert stats[2].swap.compact_swapped_out == stats[1].swap.compact_swapped_out > 0
    assert stats[2].swap.compact_used == stats[2].swap.used_blocks == 0


def block_bytes(folder: Path, tp: int) -> int:
    """Bytes of one block of 4 tokens on the rank holding the most KV heads."""
    from pagedllm.kv_storage.kv_cache import bytes_per_block
    from pagedllm.models.loader_safetensors import read_hf_config

    config = read_hf_config(folder)
    heads = TensorPartition(config, tp).max_kv_heads
    return bytes_per_block(config.num_layers, 4, heads, config.head_dim, torch.float32)


def test_beam_search_across_ranks(folders):
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:3]]
    found = {}
    for tp in (1, 2):
        llm = LLM.from_engine(make_engine(folders["kv3"], tp))
        try:
            outputs = llm.beam_search(prompts, params)
        finally:
            llm.llm_engine.shutdown()
        found[tp] = [[s.token_ids for s in out.sequences] for out in outputs]
    assert found[1] == found[2]


# ---- failures -------------------------------------------------------------------------


def is_gone(pid: int) -> bool:
    return not process_alive(pid)


def wait_gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(is_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


def children_of(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_dead_or_hung_rank_fails_the_engine_clearly_and_is_reaped(folders, how):
    timeout = 3.0
    engine = make_engine(folders["kv2"], 2, distributed_timeout=timeout)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    run_outputs(engine, PROMPTS[:2], params)  # the ranks work
    (rank,) = engine.executor.processes
    os.kill(rank.pid, how)
    engine.add_request("late", {"prompt_token_ids": PROMPTS[0]}, params)
    start = time.monotonic()
    expected = "rank 1 .* ended with signal SIGKILL" if how == signal.SIGKILL else "within 3 s"
    with pytest.raises(WorkerFailedError, match=expected):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < timeout + 10
    with pytest.raises(WorkerFailedError):  # and it stays failed
        engine.step()
    assert wait_gone([rank.pid])
    engine.shutdown()


ENGINE_SCRIPT = """
import sys, time
from pagedllm import EngineConfig, LLMEngine
if __name__ == "__main__":
    engine = LLMEngine(EngineConfig(model=sys.argv[1], tensor_parallel_size=2, dtype="float32",
                                    kv_cache_memory="8MiB", log_stats_interval=0))
    print(*[p.pid for p in engine.executor.processes], flush=True)
    time.sleep(600)
"""


def test_no_rank_outlives_a_killed_engine(folders, tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(ENGINE_SCRIPT))
    engine = subprocess.Popen(
        [sys.executable, str(script), str(folders["kv2"])], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert pids and not any(is_gone(pid) for pid in pids)
        engine.kill()
        engine.wait()
        assert wait_gone(pids)
    finally:
        engine.kill()


# ---- launching: the server, two nodes, torchrun -----------------------------------------


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return write_tiny_chat_llama(tmp_path_factory.mktemp("tp-chat"))


def one_rank_reply(folder: Path, prompt: str, max_tokens: int) -> str:
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB", log_stats_interval=0)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return llm.generate([prompt], params)[0].outputs[0].text


def test_server_with_two_ranks_answers_openai_and_stops_them_on_sigterm(chat_folder):
    openai = pytest.importorskip("openai")
    args = ["--model", str(chat_folder), "--tensor-parallel-size", "2"]
    args += ["--kv-cache-memory", "8MiB", "--log-stats-interval", "0", "--dtype", "float32"]
    with ServerProcess(args) as server:
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        reply = client.completions.create(
            model=chat_folder.name, prompt="The cat", max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].text == one_rank_reply(chat_folder, "The cat", 16)
        ranks = children_of(server.process.pid)
        assert ranks
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        assert wait_gone(ranks)


def generate_command(folder: Path, *extra: str) -> list[str]:
    return [
        "generate", "--model", str(folder), "--prompt", "Hello", "--raw", "--max-tokens", "12",
        "--kv-cache-memory", "8MiB", "--log-stats-interval", "0", "--dtype", "float32", *extra,
    ]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedllm.cli", *args]


def test_two_nodes_on_one_machine(chat_folder):
    expected = subprocess.run(cli(*generate_command(chat_folder)), capture_output=True,
                              text=True, check=True).stdout
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port())]
    second = subprocess.Popen(cli(*generate_command(chat_folder, *nodes, "--node-rank", "1")),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.run(cli(*generate_command(chat_folder, *nodes, "--node-rank", "0")),
                           capture_output=True, text=True, timeout=300)
    out, err = second.communicate(timeout=60)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, err
    assert first.stdout == expected
    assert out == ""  # node 1 runs its rank only: nothing to say


def test_torchrun_starts_one_process_per_rank(chat_folder):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed next to this Python")
    expected = subprocess.run(cli(*generate_command(chat_folder)), capture_output=True,
                              text=True, check=True).stdout
    command = [str(torchrun), "--nproc-per-node", "2", "--master-port", str(free_port()),
               "-m", "pagedllm.cli",
               *generate_command(chat_folder, "--tensor-parallel-size", "2")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


def test_a_node_started_with_other_options_is_refused_at_start(chat_folder):
    nodes = ["--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port())]
    second = subprocess.Popen(
        cli(*generate_command(chat_folder, *nodes, "--node-rank", "1", "--dtype", "bfloat16")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    first = subprocess.run(cli(*generate_command(chat_folder, *nodes, "--node-rank", "0")),
                           capture_output=True, text=True, timeout=300)
    _, err = second.communicate(timeout=60)
    assert first.returncode != 0
    assert "error: a tensor-parallel rank was started with engine options" in first.stderr
    assert second.returncode != 0 and "'dtype'" in err


def reduce_on_rank(rank: int, address: str, results) -> None:
    import torch.distributed as dist

    from pagedllm.distributed.group import TensorParallelGroup

    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=2)
    group = TensorParallelGroup(rank, 2)
    group.use_shared_memory(slot_bytes=4096, timeout_s=30.0)
    out = []
    for dtype, n in [(torch.float32, 1000), (torch.bfloat16, 2000), (torch.float32, 5000)]:
        x = torch.arange(n, dtype=torch.float32).mul(0.25 * (rank + 1)).to(dtype)
        group.all_reduce(x)
        out.append(x)
    results[rank] = (group.shared is not None, out)
    dist.destroy_process_group()


def test_shared_memory_all_reduce_sums_like_gloo():
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager:
        results = manager.dict()
        address = f"tcp://127.0.0.1:{free_port()}"
        ranks = [context.Process(target=reduce_on_rank, args=(r, address, results))
                 for r in range(2)]
        for process in ranks:
            process.start()
        for process in ranks:
            process.join(120)
        assert [p.exitcode for p in ranks] == [0, 0]
        (shared0, first), (shared1, second) = results[0], results[1]
    assert shared0 and shared1
    for x, y, (dtype, n) in zip(first, second, [(torch.float32, 1000), (torch.bfloat16, 2000),
                                                (torch.float32, 5000)], strict=True):
        expected = (torch.arange(n, dtype=torch.float32) * 0.25).to(dtype).float()
        expected = expected + (torch.arange(n, dtype=torch.float32) * 0.5).to(dtype).float()
        assert x.dtype == dtype and torch.equal(x, y)  # every rank the same bits
        assert torch.equal(x, expected.to(dtype))  # 5000 floats exceed the slot: gloo


def test_an_engine_failing_at_start_stops_its_ranks(folders, monkeypatch):
    started = []
    original = llm_engine.build_engine

    def build_and_note(config, loaded, executor):
        started.extend(p.pid for p in executor.processes)
        return original(config, loaded, executor)

    monkeypatch.setattr(llm_engine, "build_engine", build_and_note)
    with pytest.raises(ValueError, match="exceeds the model's limit"):
        make_engine(folders["kv2"], 2, max_model_len=100_000)
    assert started and wait_gone(started, timeout_s=30)


def test_speculation_across_ranks_keeps_the_tokens(folders):
    """Guessed tokens run on every rank; verification and rollback on rank 0 give the
    tokens one rank gives without guesses."""
    from test_engine_speculation import FIXED, OracleGuesses

    prompts = [list(range(2, 20 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, logprobs=1)
    plain = outputs_of(make_engine(folders["kv2"], 1), prompts, params)
    truth = {
        (rid, s.index): list(prompts[int(rid)]) + list(s.token_ids)
        for rid, out in plain.items()
        for s in out.outputs
    }
    engine = make_engine(folders["kv2"], 2, speculative_config=FIXED)
    engine.speculator.proposer = OracleGuesses(truth)
    guessed = outputs_of(engine, prompts, params)
    assert_same(plain, guessed)
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0


def test_a_draft_model_drafts_on_rank_0_for_every_rank(folders):
    """``draft_model`` over two ranks: the draft (the target's checkpoint in bfloat16)
    runs on rank 0 only, its K/V in rank 0's blocks; the guesses run on every rank and
    the tokens are one rank's without guesses."""
    prompts = [list(range(2, 20 + i)) for i in range(6)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = outputs_of(make_engine(folders["kv2"], 1), prompts, params)
    spec = {"method": "draft_model", "model": str(folders["kv2"]), "dtype": "bfloat16",
            "num_speculative_tokens": 3, "adaptive_draft_length": False}  # fmt: skip
    engine = make_engine(folders["kv2"], 2, speculative_config=spec)
    guessed = outputs_of(engine, prompts, params)
    assert_same(plain, guessed)
    assert engine.get_stats().spec_decode.num_accepted_tokens > 0
