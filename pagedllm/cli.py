"""The ``pagedllm`` command: generate | chat | bench | serve | router | plan."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from pagedllm.config_flags import add_config_flags, config_from_flags
from pagedllm.distributed.errors import WorkerFailedError


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--sampling-seed",
        type=int,
        default=None,
        help="the request's own seed (--seed seeds the engine's generator)",
    )


def sampling_params(args: argparse.Namespace):
    from pagedllm.engine.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
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

    engine = LLMEngine(config_from_flags(args))
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

    engine = LLMEngine(config_from_flags(args))
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
    from pagedllm.models.errors import ModelLoadError
    from pagedllm.models.hf_config import write_hf_config
    from pagedllm.models.loader_gguf import gguf_config, open_gguf
    from pagedllm.tokenizer import Tokenizer

    path = default_model_path() if args.model in (None, "default") else Path(args.model)
    if path.suffix != ".gguf":
        raise ValueError(f"--model must be a .gguf file (a folder has its tokenizer), got {path}")
    folder = Path(args.folder)
    Tokenizer.from_gguf(path).save(folder)
    try:
        write_hf_config(folder, gguf_config(open_gguf(path), path))
    except ModelLoadError as err:  # the tokenizer is still of use without it
        print(f"no config.json: {err}", file=sys.stderr)
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
    add_config_flags(generate)
    generate.set_defaults(func=cmd_generate)

    chat = commands.add_parser("chat", help="interactive streaming chat")
    chat.add_argument("--system", default=None, help="a system message")
    add_sampling_args(chat)
    add_config_flags(chat)
    chat.set_defaults(func=cmd_chat)

    # imported here: these modules build on the engine options defined above
    from pagedllm.bench.cli import add_bench_args, run_bench
    from pagedllm.plan.cli import add_plan_parser
    from pagedllm.router.cli import add_router_parser
    from pagedllm.server.cli import add_serve_parser

    bench = commands.add_parser("bench", help="throughput benchmark (JSON lines)")
    add_bench_args(bench)
    bench.set_defaults(func=run_bench)
    add_serve_parser(commands)
    add_router_parser(commands)
    add_plan_parser(commands)

    export = commands.add_parser(
        "export-tokenizer",
        help="write a model's tokenizer as a Hugging Face tokenizer folder (with a "
        "config.json describing the model)",
    )
    export.add_argument("folder", help="the folder to write (created if missing)")
    export.add_argument("--model", default=None, help="a .gguf file (default: the default model)")
    export.set_defaults(func=cmd_export_tokenizer)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # what a command that starts others passes on
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if hasattr(args, "tensor_parallel_size"):
            from pagedllm.engine.tensor_parallel.node import run_ranks_unless_engine

            status = run_ranks_unless_engine(config_from_flags(args))
            if status is not None:
                return status
        return args.func(args)
    except (ValueError, FileNotFoundError, WorkerFailedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
