"""The prefix cache's lower tiers on a multi-turn chat workload (JSON lines).

``--conversations`` chats of ``--turns`` turns each: every turn sends the whole history
as a chat client does (the chat template over the earlier questions and the model's own
greedy answers, as text) plus a new question of about ``--question-tokens`` tokens of
Pride and Prejudice, and lets the model answer until its end-of-turn token or
``--answer-tokens`` tokens. The defaults, 70 and 215, are LMSYS-Chat-1M's mean user
turn and response (69.5 and 214.5 tokens); ``--question-tokens 260 --answer-tokens 48``
is a passage-heavy shape. Turns go round the conversations (turn 1 of every chat, then
turn 2, ...), ``--concurrency`` requests in flight at a time (``--max-num-seqs`` of them
running, the others queued), so by the time a chat comes back its blocks have had every
other chat's traffic behind them. A first pass in a roomy pool measures the chats'
final contexts; the pool then holds ``1 / --working-set`` of them (4: a working set 4x
the pool).

Configurations, each in a fresh engine over one loaded model, rotated each of
``--runs`` rounds:

- ``off``: the pool alone (evicted blocks are recomputed);
- ``host``: evicted blocks kept in host memory beside the pool (``kv_tier_memory``
  holding the whole working set);
- ``disk``: a host tier as large as the pool over a disk tier (``kv_cache_dir``),
  blocks loaded when a request reaches the head of the queue;
- ``disk+prefetch``: the same, loads started when a request arrives.

Per configuration: time to first token p50/p99 (s), output tokens/s, prompt tokens
restored from each tier, and the ratio to ``off`` of the same round (medians).

``--measure restart``: one process writes a ``--restart-tokens`` prompt's blocks to a
cache directory and exits; a new process asks a question after the same prompt, with
the directory and without it (cold): time to first token of each, medians of
``--runs``.

    python benchmarks/tiered_cache.py [--runs 3] [--conversations 32 --turns 6]
    python benchmarks/tiered_cache.py --measure restart
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.long_context import novel_text
from pagedllm.bench.machine import machine_record
from pagedllm.bench.rounds import median_ratio, median_record, rotation
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.models.loader import LoadedModel, load_model_for

CONFIGS = ("off", "host", "disk", "disk+prefetch")


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def questions(tokenizer, count: int, num_tokens: int) -> list[str]:
    """``count`` distinct passages of about ``num_tokens`` tokens, each a question."""
    ids = tokenizer.encode(novel_text(), add_special_tokens=False)
    start = 2000
    out = []
    for i in range(count):
        chunk = ids[start + i * num_tokens : start + (i + 1) * num_tokens]
        out.append("What happens next in this passage?\n\n" + tokenizer.decode(chunk))
    return out


def run_chats(engine: LLMEngine, args: argparse.Namespace, asks: list[str]) -> dict:
    """Every turn of every conversation through ``engine``; TTFTs and token counts."""
    tok = engine.tokenizer
    histories: list[list[dict]] = [[] for _ in range(args.conversations)]
    order = [(t, c) for t in range(args.turns) for c in range(args.conversations)]
    # answers end at the end-of-turn token, as in a chat: past it (ignore_eos) the text
    # sent back would no longer be the tokens the model wrote, and no cache could match it
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens)
    ttfts, outputs, prompts = [], 0, 0
    contexts = [0] * args.conversations
    in_flight: dict[str, int] = {}
    start = time.perf_counter()
    while order or in_flight:
        while order and len(in_flight) < args.concurrency:
            turn, chat = order.pop(0)
            if any(c == chat for c in in_flight.values()):
                order.insert(0, (turn, chat))
                break
            histories[chat].append({"role": "user", "content": asks[turn * 1000 + chat]})
            ids = tok.apply_chat_template(histories[chat], add_generation_prompt=True)
            rid = f"{chat}-{turn}"
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
            in_flight[rid] = chat
            prompts += len(ids)
        for out in engine.step():
            if out.finished:
                chat = in_flight.pop(out.request_id)
                histories[chat].append({"role": "assistant", "content": out.outputs[0].text})
                contexts[chat] = len(out.prompt_token_ids) + len(out.outputs[0].token_ids)
                ttfts.append(out.metrics.time_to_first_token)
                outputs += len(out.outputs[0].token_ids)
    seconds = time.perf_counter() - start
    ttfts.sort()
    return {
        "seconds": seconds,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p99": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "output_tokens_per_s": outputs / seconds,
        "prompt_tokens": prompts,
        "final_context_tokens": sum(contexts),
    }


def engine_config(args: argparse.Namespace, config: str, pool: int, disk_dir: Path) -> EngineConfig:
    tiers: dict[str, object] = {}
    if config == "host":
        tiers = {"kv_tier_memory": pool * (args.working_set + 1)}
    elif config.startswith("disk"):
        tiers = {
            "kv_tier_memory": pool,
            "kv_cache_dir": str(disk_dir),
            "kv_cache_dir_size": pool * (args.working_set + 2),
            "kv_tier_prefetch": config == "disk+prefetch",
        }
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_memory=pool,
        max_num_seqs=args.max_num_seqs,
        **tiers,
    )


def chat_rounds(args: argparse.Namespace) -> None:
    base = EngineConfig(model=args.model, dtype=args.dtype)
    loaded: LoadedModel = load_model_for(base)
    tok = LLMEngine(base, loaded=loaded).tokenizer
    mc = loaded.config
    per_token = (
        bytes_per_block(mc.num_layers, 16, mc.num_kv_heads, mc.head_dim, loaded.model.dtype) / 16
    )
    asks = {}
    for turn in range(args.turns):
        texts = questions(tok, args.conversations, args.question_tokens)
        for chat, text in enumerate(texts[turn:] + texts[:turn]):
            asks[turn * 1000 + chat] = f"(turn {turn + 1}) {text}"
    roomy = EngineConfig(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    working_set = run_chats(LLMEngine(roomy, loaded=loaded), args, asks)["final_context_tokens"]
    pool = int(working_set * per_token / args.working_set)
    emit(**machine_record(), pool_bytes=pool, working_set=args.working_set,
         working_set_tokens=working_set)  # fmt: skip
    configs = args.configs.split(",")
    results: dict[str, list[dict]] = {c: [] for c in configs}
    for r in range(args.runs):
        for config in rotation(configs, r):
            with tempfile.TemporaryDirectory() as disk_dir:
                engine = LLMEngine(engine_config(args, config, pool, Path(disk_dir)), loaded=loaded)
                result = run_chats(engine, args, asks)
                stats = engine.get_stats()
                engine.shutdown()
            tiers = stats.tiers
            result["host_hits"] = 0 if tiers is None else tiers.host_hits
            result["disk_hits"] = 0 if tiers is None else tiers.disk_hits
            result["prefix_cache_hit_tokens"] = stats.prefix_cache_hits
            results[config].append(result)
            emit(measure="round", round=r, config=config, **result)
    for config in configs:
        rows = results[config]
        record = median_record(rows)
        if "off" in results and config != "off":
            off = results["off"]
            record["ttft_p50_speedup"] = median_ratio(off, rows, "ttft_p50")
            record["throughput_ratio"] = median_ratio(rows, off, "output_tokens_per_s")
        emit(measure="chat", config=config, runs=len(rows), **record)


RESTART_CHILD = """
import json, sys, time
from pagedllm import EngineConfig, LLMEngine, SamplingParams
from pagedllm.bench.long_context import novel_text
model, dtype, num_tokens, cache_dir, phase = sys.argv[1:]
tiers = {} if cache_dir == "-" else {"kv_cache_dir": cache_dir}
engine = LLMEngine(EngineConfig(model=None if model == "-" else model, dtype=dtype, **tiers))
ids = engine.tokenizer.encode(novel_text(), add_special_tokens=False)[1000 : 1000 + int(num_tokens)]
question = engine.tokenizer.encode(" Who speaks first?", add_special_tokens=False)
prompt = ids + (question if phase == "ask" else [])
engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            ttft = out.metrics.time_to_first_token
engine.shutdown()
print(json.dumps({"ttft": ttft}))
"""


def child(args: argparse.Namespace, cache_dir: str, phase: str) -> float:
    model = args.model or "-"
    argv = [sys.executable, "-c", RESTART_CHILD, model, args.dtype, str(args.restart_tokens)]
    done = subprocess.run([*argv, cache_dir, phase], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["ttft"]


def restart_runs(args: argparse.Namespace) -> None:
    emit(**machine_record(), restart_tokens=args.restart_tokens)
    warm, cold = [], []
    for r in range(args.runs):
        cache_dir = tempfile.mkdtemp()
        try:
            child(args, cache_dir, "write")
            pair = [("cached", cache_dir), ("cold", "-")]
            for name, where in pair if r % 2 == 0 else pair[::-1]:
                seconds = child(args, where, "ask")
                (warm if name == "cached" else cold).append(seconds)
                emit(measure="restart_round", round=r, run=name, ttft=seconds)
        finally:
            shutil.rmtree(cache_dir)
    emit(
        measure="restart",
        ttft_cached=statistics.median(warm),
        ttft_cold=statistics.median(cold),
        speedup=statistics.median(c / w for c, w in zip(cold, warm, strict=True)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--measure", choices=["chat", "restart"], default="chat")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--question-tokens", type=int, default=70)
    parser.add_argument("--answer-tokens", type=int, default=215)
    parser.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="the rest wait queued")
    parser.add_argument("--working-set", type=float, default=4.0)
    parser.add_argument("--restart-tokens", type=int, default=2048)
    args = parser.parse_args()
    if args.measure == "restart":
        restart_runs(args)
    else:
        chat_rounds(args)


if __name__ == "__main__":
    main()
