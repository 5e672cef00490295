"""Sequences a fixed KV pool holds for a Gemma-3-shaped model, with one block table for
every layer (``kv_layer_groups=False``, the engine before layer groups) and with a
table per layer group (JSON lines).

The model is the ``gemma-3-1b`` preset with dummy weights (26 layers: five sliding
layers of window 512 to each global one), built once. For each context length and
each layout, an engine is built over the same pool budget (``--kv-cache-memory``,
default 1 GiB) and sequences of distinct tokens are started one after another as the
scheduler starts them: their prompt reserved and committed in chunks of
``max_num_batched_tokens``, then one decode token reserved, until the pool refuses one.
Every figure is the engine's own bookkeeping (its block manager and its pool sized by
its builder), so nothing here estimates.

Per layout and context: the pool's blocks and bytes per block, the sequences held, the
blocks each holds, and sequences per GiB; per context, ``summary``: groups against one
table.

With ``--speed``, it also decodes a short workload on both layouts (greedy, the dummy
model, prompts of ``--speed-prompt`` tokens) and reports output tokens/s, alternating
the layouts over ``--runs`` rounds, medians last.

    python benchmarks/layer_groups.py [--contexts 2048,8192] [--kv-cache-memory 1GiB]
        [--speed] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from pagedllm.bench.machine import machine_record
from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.kv.block_manager import BlockManager
from pagedllm.models.loader import LoadedModel, load_model_for

GIB = 1 << 30


def size_in_bytes(text: str) -> int:
    """A size as the engine reads one ("1GiB", "512MiB", bytes)."""
    return EngineConfig(kv_cache_memory=text).kv_cache_memory


def int_list(text: str) -> list[int]:
    return [int(item) for item in text.split(",")]


def emit(record: dict[str, object]) -> None:
    print(json.dumps(record), flush=True)


def engine_for(loaded: LoadedModel, groups: bool, args: argparse.Namespace, **more) -> LLMEngine:
    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        kv_layer_groups=groups,
        log_stats_interval=0,
        **more,
    )
    return LLMEngine(config, loaded)


def hold(engine: LLMEngine, context: int) -> int:
    """Sequences of ``context`` tokens the engine's pool holds at once, each started as
    the scheduler starts one (its prompt in chunks) and then decoding."""
    manager = engine.block_manager
    chunk = engine.config.max_num_batched_tokens
    held = 0
    while _start(manager, held, context, chunk):
        held += 1
    if held in manager:  # the sequence refused part way gives its blocks back
        manager.free(held)
    return held


def _start(manager: BlockManager, seq_id: int, context: int, chunk: int) -> bool:
    """Whether sequence ``seq_id`` reached ``context`` tokens and its next token's slot."""
    tokens = [(seq_id * 7919 + i * 13) % 50_000 + 1 for i in range(context)]
    prefix = manager.find_cached_prefix(tokens)
    done = prefix.num_tokens
    while done < context:
        size = min(chunk, context - done)
        start = prefix if seq_id not in manager else None
        if manager.allocate_slots(seq_id, size, prefix=start) is None:
            return False
        manager.commit_tokens(seq_id, tokens[done : done + size])
        done += size
    return manager.allocate_slots(seq_id, 1) is not None  # its next token


def capacity(loaded: LoadedModel, args: argparse.Namespace) -> None:
    for context in args.contexts:
        held = {}
        for groups in (False, True):
            engine = engine_for(loaded, groups, args, max_model_len=context + 1)
            manager = engine.block_manager
            sequences = hold(engine, context)
            blocks = manager.pool.num_used / max(sequences, 1)
            held[groups] = sequences
            emit({
                "measure": "capacity", "context": context, "kv_layer_groups": groups,
                "groups": manager.windows, "pool_blocks": manager.pool.num_blocks,
                "block_bytes": engine.block_bytes, "pool_gib": args.kv_cache_memory / GIB,
                "sequences": sequences, "blocks_per_sequence": round(blocks, 1),
                "sequences_per_gib": round(sequences / (args.kv_cache_memory / GIB), 2),
            })  # fmt: skip
            engine.shutdown()
        emit({
            "measure": "summary", "context": context, "one_table": held[False],
            "groups": held[True], "ratio": round(held[True] / max(held[False], 1), 2),
        })  # fmt: skip


def decode_speed(loaded: LoadedModel, args: argparse.Namespace) -> None:
    """Output tokens/s of ``--speed-requests`` requests on each layout, alternating."""

    def prompts(round_index: int) -> list[list[int]]:  # new ones each round: no cache hits
        first = round_index * args.speed_requests
        return [
            [(r * 31 + i * 17) % 50_000 + 1 for i in range(args.speed_prompt)]
            for r in range(first, first + args.speed_requests)
        ]

    params = SamplingParams(temperature=0.0, max_tokens=args.speed_output, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # fmt: skip
    engines = {groups: engine_for(loaded, groups, args) for groups in (False, True)}
    speeds: dict[bool, list[float]] = {False: [], True: []}
    for round_index in range(args.runs):
        for groups, engine in engines.items():
            start = time.monotonic()
            for index, prompt in enumerate(prompts(round_index)):
                engine.add_request(f"{round_index}-{index}", {"prompt_token_ids": prompt}, params)
            outputs = 0
            while engine.has_unfinished_requests():
                outputs += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
            speed = outputs / (time.monotonic() - start)
            speeds[groups].append(speed)
            emit({"measure": "speed", "round": round_index, "kv_layer_groups": groups,
                  "output_tokens_per_s": round(speed, 2)})  # fmt: skip
    emit({
        "measure": "speed_summary",
        "one_table": round(statistics.median(speeds[False]), 2),
        "groups": round(statistics.median(speeds[True]), 2),
        "ratio": round(statistics.median(speeds[True]) / statistics.median(speeds[False]), 3),
    })  # fmt: skip
    for engine in engines.values():
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gemma-3-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=size_in_bytes, default=4 * GIB)
    parser.add_argument("--contexts", type=int_list, default=[2048, 8192])
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--speed-requests", type=int, default=8)
    parser.add_argument("--speed-prompt", type=int, default=768)
    parser.add_argument("--speed-output", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()  # fmt: skip
    emit(machine_record())
    config = EngineConfig(model=args.model, load_format="dummy", dtype=args.dtype)
    loaded = load_model_for(config)
    capacity(loaded, args)
    if args.speed:
        decode_speed(loaded, args)


if __name__ == "__main__":
    main()
