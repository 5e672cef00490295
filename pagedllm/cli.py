"""The ``pagedllm`` command: generate | chat | bench | serve | plan."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from pagedllm.config import LOAD_FORMATS, EngineConfig
from pagedllm.kv.kv_quant import KV_CACHE_DTYPES


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that starts an engine."""
    defaults = EngineConfig.__dataclass_fields__
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF folder (default: SmolLM2); with --load-format dummy, a preset",
    )
    group.add_argument(
        "--load-format",
        default=defaults["load_format"].default,
        choices=LOAD_FORMATS,
        help="dummy: seeded random weights of the --model shape (a preset such as llama-3-8b, "
        "a config.json or a folder holding one); prompts are then token ids",
    )
    group.add_argument(
        "--device",
        default=defaults["device"].default,
        help="auto (CUDA when available, else the CPU), cpu, or cuda[:N]",
    )
    group.add_argument(
        "--dtype",
        default=defaults["dtype"].default,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="model dtype; auto is float32 on the CPU, bfloat16 on CUDA",
    )
    group.add_argument(
        "--kv-cache-dtype",
        default=defaults["kv_cache_dtype"].default,
        choices=KV_CACHE_DTYPES,
        help="KV cache format; 8-bit ones hold about twice the blocks of bfloat16",
    )
    group.add_argument("--block-size", type=int, default=defaults["block_size"].default)
    group.add_argument(
        "--kv-cache-memory",
        default=defaults["kv_cache_memory"].default,
        help="bytes for the KV pool, e.g. 2GiB or 512MB (default: 2GiB on the CPU; on CUDA "
        "what --gpu-memory-utilization leaves after weights and activations)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=defaults["gpu_memory_utilization"].default,
        help="share of the GPU's memory the engine may use, KV pool included",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly instead of replaying CUDA graphs",
    )
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--max-num-seqs", type=int, default=defaults["max_num_seqs"].default)
    group.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"].default,
    )
    group.add_argument(
        "--kv-allocation", default="paged", choices=["paged", "contiguous"]
    )
    group.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn automatic prefix caching off",
    )
    group.add_argument(
        "--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"]
    )
    group.add_argument("--swap-space", default="0", help="bytes of the second KV tier, e.g. 1GiB")
    group.add_argument("--swap-path", default=None, help="memory-map the second tier to a file")
    group.add_argument("--log-stats-interval", type=float, default=5.0)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        load_format=args.load_format,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_allocation=args.kv_allocation,
        enable_prefix_caching=args.enable_prefix_caching,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        swap_path=args.swap_path,
        log_stats_interval=args.log_stats_interval,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def sampling_params(args: argparse.Namespace):
    from pagedllm.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )


def stream_reply(engine, prompt, params, write: Callable[[str], object]) -> str:
    """Run one request on ``engine`` and write its text as it is generated."""
    request_id = engine.add_request(None, prompt, params)
    text = ""
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id:
                delta = output.outputs[0].delta_text
                write(delta)
                text += delta
    return text


def cmd_generate(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    if args.raw or engine.tokenizer is None:
        prompt = args.prompt
    else:
        messages = [{"role": "user", "content": args.prompt}]
        prompt = {"prompt_token_ids": engine.tokenizer.apply_chat_template(messages)}
    stream_reply(engine, prompt, sampling_params(args), _write_stdout)
    sys.stdout.write("\n")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from pagedllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("Chat with the model; an empty line or Ctrl-D ends the conversation.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        messages.append({"role": "user", "content": line})
        prompt = {"prompt_token_ids": engine.tokenizer.apply_chat_template(messages)}
        reply = stream_reply(engine, prompt, sampling_params(args), _write_stdout)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_export_tokenizer(args: argparse.Namespace) -> int:
    from pagedllm.models.default import default_model_path
    from pagedllm.tokenizer import Tokenizer

    path = default_model_path() if args.model in (None, "default") else Path(args.model)
    if path.suffix != ".gguf":
        raise ValueError(f"--model must be a .gguf file (a folder has its tokenizer), got {path}")
    Tokenizer.from_gguf(path).save(Path(args.folder))
    print(f"wrote the tokenizer of {path.name} to {args.folder}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine statistics")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a reply to one prompt, streamed")
    generate.add_argument("--prompt", required=True)
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as is, without the chat template"
    )
    add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive streaming chat")
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat)
    add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    # imported here: these modules build on the engine options defined above
    from pagedllm.bench.cli import add_bench_args, run_bench
    from pagedllm.plan.cli import add_plan_parser
    from pagedllm.server.cli import add_serve_parser

    bench = commands.add_parser("bench", help="throughput benchmark (JSON lines)")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)
    add_serve_parser(commands)
    add_plan_parser(commands)

    export = commands.add_parser(
        "export-tokenizer",
        help="write a model's tokenizer as a Hugging Face tokenizer folder",
    )
    export.add_argument("folder", help="the folder to write (created if missing)")
    export.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    export.set_defaults(func=cmd_export_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
