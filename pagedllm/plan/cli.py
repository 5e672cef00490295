"""``pagedllm plan``: print a capacity plan (text or JSON) and optionally draw it."""

from __future__ import annotations

import argparse
import json

import torch

from pagedllm.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_MEMORY,
    EngineConfig,
    parse_bytes,
)
from pagedllm.kv.block_pool import validate_block_size
from pagedllm.models.presets import PRESETS
from pagedllm.plan.capacity import (
    KV_DTYPES,
    PLANNED_KV_DTYPES,
    WEIGHT_BYTES,
    ByAge,
    CapacityPlan,
    DraftShape,
    Tiers,
    Workload,
    memory_budget,
    plan_capacity,
)
from pagedllm.plan.model_shape import ModelShape, rank_parameters, resolve_model
from pagedllm.plan.report import format_text, to_json

DEFAULT_AVG_LEN = 2048
DEFAULT_ACTIVATION_RESERVE = 0.15
# int4's full-size blocks hold the model's dtype: the weights' float dtype, else bfloat16
RECENT_DTYPES = {"float32": torch.float32, "float16": torch.float16}


def add_plan_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``plan`` on the ``pagedllm`` command's subparsers."""
    parser = subparsers.add_parser(
        "plan",
        help="KV cache capacity planner: bytes per token, blocks, concurrent sequences",
        description=__doc__,
    )
    parser.add_argument(
        "model",
        nargs="?",
        default=None,
        help=f"preset ({', '.join(PRESETS)}), .gguf file, config.json or HF folder "
        "(default: the embedded SmolLM2)",
    )
    parser.add_argument(
        "--model",
        dest="model_option",
        default=None,
        metavar="MODEL",
        help="the model, spelled as the engine commands spell it (instead of the positional)",
    )
    memory = parser.add_mutually_exclusive_group()
    memory.add_argument(
        "--memory",
        default=None,
        help="memory of each device, e.g. 80GB: its weights and "
        "activation reserve are taken out first",
    )
    memory.add_argument(
        "--kv-cache-memory",
        default=None,
        help="the KV cache budget of each device itself, as the engine's option (default "
        "2GiB, the engine's CPU default, when --memory is not given)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="devices the model is split over (default 1); figures are per device",
    )
    parser.add_argument(
        "--weight-dtype",
        default="bfloat16",
        choices=list(WEIGHT_BYTES),
        help="how the weights are stored: bytes per parameter (default bfloat16)",
    )
    parser.add_argument(
        "--activation-reserve",
        type=float,
        default=DEFAULT_ACTIVATION_RESERVE,
        help="memory for activations as a fraction of the weight bytes (typically 0.1-0.2)",
    )
    parser.add_argument(
        "--kv-dtype",
        default=",".join(PLANNED_KV_DTYPES),
        help=f"comma list of KV cache dtypes among {', '.join(PLANNED_KV_DTYPES)}",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help=f"tokens per block (default {DEFAULT_BLOCK_SIZE}; int4 groups keys over a block: "
        "16 stores 3.05x fewer bytes than bfloat16, 64 3.56x)",
    )
    parser.add_argument(
        "--kv-recent-tokens",
        type=int,
        default=EngineConfig.kv_recent_tokens,
        help="int4: each sequence's newest tokens kept in full-size blocks (default "
        f"{EngineConfig.kv_recent_tokens})",
    )
    parser.add_argument(
        "--kv-recent-dtype",
        dest="recent_format",  # the planner's names, not EngineConfig's field
        choices=["auto", *sorted(KV_DTYPES)],
        default="auto",
        help="int4: the format of the recent tokens' full-size blocks (default auto: the "
        "weights' float dtype)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="tokens one step may run, as the engine's option: sizes int4's full-size blocks",
    )
    parser.add_argument(
        "--avg-len",
        type=int,
        default=None,
        help=f"average sequence length in tokens (default {DEFAULT_AVG_LEN} or max-model-len)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens contiguous allocation reserves per sequence (default: the model's context; "
        "a larger value is planned as asked and flagged)",
    )
    parser.add_argument(
        "--prefix-len", type=int, default=0, help="tokens every sequence shares at its start"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences for the batch KV column")
    tiers = parser.add_argument_group("the prefix cache's lower tiers (evicted blocks kept)")
    tiers.add_argument(
        "--kv-tier-memory",
        dest="tier_memory",  # the planner's names, not EngineConfig's fields
        default=None,
        help="host memory of the tier beside the pool, as the engine's option, e.g. 4GiB",
    )
    tiers.add_argument(
        "--kv-cache-dir-size",
        dest="tier_dir_size",
        default=None,
        help="a kv_cache_dir of at most this size, e.g. 20GiB (the engine's default "
        f"{EngineConfig.kv_cache_dir_size >> 30}GiB)",
    )
    draft = parser.add_argument_group("draft_model speculation (its K/V ride in every block)")
    draft.add_argument(
        "--draft-model",
        default=None,
        metavar="MODEL",
        help="the draft model: a preset, .gguf file, config.json or HF folder",
    )
    draft.add_argument(
        "--draft-weight-dtype",
        default="q4_1",
        choices=list(WEIGHT_BYTES),
        help="how the draft's weights are stored (default q4_1, the default model's blocks)",
    )
    draft.add_argument(
        "--draft-kv-dtype",
        default="bfloat16",
        choices=["float32", "bfloat16"],
        help="the draft's dtype, which its K/V take (default bfloat16)",
    )
    draft.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=8,
        help="guesses per sequence and step: sizes the draft's scratch blocks (default 8)",
    )
    draft.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help="sequences one step may run, as the engine's option: sizes a draft's scratch "
        "blocks and int4's full-size blocks",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.add_argument(
        "--plot", default=None, metavar="PNG", help="draw contiguous against paged layout"
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="comma list of sequence lengths (tokens) for --plot (default: a spread around "
        "--avg-len)",
    )
    parser.set_defaults(func=run_plan)


def build_plan(args: argparse.Namespace) -> CapacityPlan:
    """The plan the command line describes."""
    if args.model_option and args.model and args.model_option != args.model:
        raise ValueError(f"two models given: {args.model!r} and --model {args.model_option!r}")
    model = resolve_model(args.model_option or args.model)
    kv_dtypes = tuple(name.strip() for name in args.kv_dtype.split(","))
    unknown = [name for name in kv_dtypes if name not in PLANNED_KV_DTYPES]
    if unknown:
        raise ValueError(f"unknown KV dtype(s) {unknown}; choose among {list(PLANNED_KV_DTYPES)}")
    max_model_len = args.max_model_len or model.max_context
    workload = Workload(
        avg_len=args.avg_len or min(DEFAULT_AVG_LEN, max_model_len),
        max_model_len=max_model_len,
        prefix_len=args.prefix_len,
        batch=args.batch,
    )
    kv_memory = args.kv_cache_memory
    if args.memory is None and kv_memory is None:
        kv_memory = DEFAULT_CPU_KV_CACHE_MEMORY
    tensor_parallel_size = args.tensor_parallel_size
    draft = _draft(args, model)
    budget = memory_budget(
        rank_parameters(model.config, tensor_parallel_size),
        args.weight_dtype,
        args.activation_reserve,
        total_bytes=None if args.memory is None else parse_bytes(args.memory),
        kv_bytes=None if kv_memory is None else parse_bytes(kv_memory),
        draft_weight_bytes=0 if draft is None else draft.weight_bytes,
    )
    block_size = validate_block_size(args.block_size)
    by_age = None
    if any(PLANNED_KV_DTYPES[name].by_age for name in kv_dtypes):
        if draft is not None:
            raise ValueError("int4 K/V does not run with a draft model; leave int4 out")
        by_age = ByAge(
            args.kv_recent_tokens,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            RECENT_DTYPES.get(args.weight_dtype, torch.bfloat16),
            None if args.recent_format == "auto" else args.recent_format,
        )
    tiers = None
    if args.tier_memory is not None or args.tier_dir_size is not None:
        tiers = Tiers(
            memory=0 if args.tier_memory is None else parse_bytes(args.tier_memory),
            dir_size=None if args.tier_dir_size is None else parse_bytes(args.tier_dir_size),
        )
    return plan_capacity(
        model, block_size, budget, workload, kv_dtypes, tensor_parallel_size, draft, by_age, tiers
    )


def _draft(args: argparse.Namespace, target: ModelShape) -> DraftShape | None:
    """The draft model the command line names (None without ``--draft-model``);
    ValueError where the engine would refuse it."""
    if args.draft_model is None:
        return None
    if target.config.kv_window is not None:
        raise ValueError(
            "a draft model does not run with a model whose every layer slides (its "
            "out-of-window blocks leave the pool)"
        )
    draft = resolve_model(args.draft_model)
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(
            f"the draft model {draft.name} has a vocabulary of {draft.config.vocab_size} "
            f"tokens, the target {target.name} {target.config.vocab_size}"
        )
    return DraftShape(
        draft,
        args.draft_weight_dtype,
        args.draft_kv_dtype,
        args.num_speculative_tokens,
        args.max_num_seqs,
    )


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan; draw it when ``--plot`` is given."""
    plan = build_plan(args)
    print(json.dumps(to_json(plan), indent=2) if args.json else format_text(plan))
    if args.plot:
        workload = plan.workload
        from pagedllm.plan.plot import default_lengths, draw_layouts

        lengths = (
            [int(n) for n in args.lengths.split(",")]
            if args.lengths
            else default_lengths(workload.avg_len, workload.max_model_len, workload.prefix_len)
        )
        draw_layouts(plan, lengths, args.plot)
    return 0
