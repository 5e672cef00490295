"""Every engine knob, its default and its validation, in one place."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pagedllm.attention.attention_choice import AttentionKernel
from pagedllm.choice import Choice, parse_choice
from pagedllm.cpu.cpuinfo import multiplies_bfloat16
from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.cpu.kernel_choice import LinearKernel
from pagedllm.kv.block_pool import validate_block_size
from pagedllm.kv_storage.kv_quant import KVCacheDtype
from pagedllm.spec_decode.config import SpeculativeConfig, SpeculativeMethod
from pagedllm.structured_output import COMPACT_JSON_BY_DEFAULT

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


class LoadFormat(Choice):
    """``load_format`` values: read the checkpoint, or seeded random weights of its
    shape."""

    AUTO = "auto"
    DUMMY = "dummy"


class Quantization(Choice):
    """``quantization`` values: keep a GGUF file's quantized matrices in their block
    formats (on the CPU), expand every weight to ``dtype``, or round a checkpoint's
    matrices at load: to int8 per output channel, or to Q4_0 blocks."""

    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"
    Q4_0 = "q4_0"

    @property
    def rounds(self) -> bool:
        """Whether the matrices are rounded at load (int8, q4_0)."""
        return self in (Quantization.INT8, Quantization.Q4_0)


class ActivationQuantization(Choice):
    """``activation_quantization`` values: multiply quantized weights by the activations
    as they are, or by the activations rounded to int8 per block of 32 values
    (llama.cpp's arithmetic)."""

    NONE = "none"
    INT8 = "int8"


class KVAllocation(Choice):
    """``kv_allocation`` values: blocks as sequences grow, or ``max_model_len`` slots
    per request from its start."""

    PAGED = "paged"
    CONTIGUOUS = "contiguous"


class PreemptionMode(Choice):
    """``preemption_mode`` values: drop a preempted sequence's K/V, park it in the swap
    space, or swap those with a full block computed and recompute the rest."""

    RECOMPUTE = "recompute"
    SWAP = "swap"
    AUTO = "auto"


DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30
DEFAULT_BLOCK_SIZE = 16
"""Bytes of the KV pool on the CPU when ``kv_cache_memory`` is not given."""

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def parse_bytes(size: int | float | str) -> int:
    """Bytes from ``1073741824``, ``"1GiB"``, ``"512MB"`` or ``"1.5g"``."""
    if isinstance(size, (int, float)):
        return int(size)
    match = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", size)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read a memory size from {size!r} (try '2GiB' or '512MB')")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def resolve_device(device: str | torch.device) -> torch.device:
    """The torch device for a user's ``device`` option: ``"auto"`` is the first CUDA
    device when one is available, else the CPU; ``"cuda"`` without one is an error."""
    name = str(device)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(name)
    except RuntimeError as err:
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}") from err
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {name!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}, but torch sees no CUDA device")
    return resolved


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` are one device (a CUDA device named without an index is
    the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or a.index == b.index:
        return True
    current = torch.cuda.current_device()
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype for a user's ``dtype`` option on ``device``. ``auto``: bfloat16 on
    CUDA and on a CPU that multiplies bfloat16 natively (``avx512_bf16`` or ``amx_bf16``),
    float32 on other CPUs."""
    if dtype == "auto":
        native = device.type == "cuda" or multiplies_bfloat16()
        return torch.bfloat16 if native else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    if dtype not in _DTYPES:
        choices = sorted(["auto", *_DTYPES])
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {choices}")
    return _DTYPES[dtype]


Parser = Callable[[Any, "EngineConfig"], Any]
"""Reads a knob's user input (text such as ``"2GiB"``, ``"auto"`` or a choice's name,
or the final value itself) into the field's final type, given the fields declared
before it; raises ValueError naming the knob on bad input."""


def knob(
    default: Any,
    help: str,
    choices: type[Choice] | Sequence[str] | None = None,
    parse: Parser | None = None,
) -> Any:
    """A config field with its command-line help, allowed values and parser: the one
    place a knob is described; the flags of every command are generated from these. A
    :class:`~pagedllm.choice.Choice` enum as ``choices`` parses the text into its
    member; ``parse`` reads any other knob given as text (sizes, devices, dtypes).
    :meth:`EngineConfig.__post_init__` runs each parser once, in field order."""
    is_enum = isinstance(choices, type) and issubclass(choices, Choice)
    allowed = choices.values() if is_enum else choices
    metadata = {
        "help": help,
        "choices": allowed,
        "choice": choices if is_enum else None,
        "parse": parse,
    }
    return field(default=default, metadata=metadata)


def _parse_device(value: str | torch.device, config: EngineConfig) -> torch.device:
    return resolve_device(value)


def _parse_dtype(value: str | torch.dtype, config: EngineConfig) -> torch.dtype:
    return resolve_dtype(value, config.device)


def _parse_kv_cache_memory(value: int | str | None, config: EngineConfig) -> int | None:
    if value is None and config.device.type == "cpu":
        value = DEFAULT_CPU_KV_CACHE_MEMORY
    if value is None:
        return None
    size = parse_bytes(value)
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {size}")
    return size


def _parse_swap_space(value: int | str, config: EngineConfig) -> int:
    size = parse_bytes(value)
    if size < 0:
        raise ValueError(f"swap_space must be >= 0, got {size}")
    return size


BLOCK_SIZE_AUTO = 0
"""``block_size`` until the engine resolves ``"auto"`` (see
:mod:`pagedllm.engine.block_size_choice`)."""


def _parse_block_size(value: int | str) -> int:
    if value in ("auto", BLOCK_SIZE_AUTO):  # 0: "auto" parsed before (dataclasses.replace)
        return BLOCK_SIZE_AUTO
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            message = f"block_size must be a power of two or 'auto', got {value!r}"
            raise ValueError(message) from None
    return validate_block_size(value)


def _parse_nonnegative_size(value: int | str, name: str) -> int:
    size = parse_bytes(value)
    if size < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {size}")
    return size


def _parse_tier_size(value: int | str, config: EngineConfig) -> int:
    size = parse_bytes(value)
    if size < 0:
        raise ValueError(f"a tier's size must be >= 0 bytes, got {size}")
    return size


@dataclass
class EngineConfig:
    """Engine settings. Units: tokens unless a name says blocks or bytes; each field's
    ``help`` says what it does (``pagedllm serve --help`` prints them all).

    Every field holds its annotated type once constructed: a knob given as text (a
    choice's name, ``"auto"``, ``"2GiB"``) is read by its parser (:func:`knob`) once, in
    ``__post_init__``, which then checks the fields against each other."""

    model: str | None = knob(
        None,
        "a .gguf file or a Hugging Face folder (config.json + safetensors); default: the "
        "embedded SmolLM2-135M-Instruct; with load_format dummy, a preset such as llama-3-8b",
    )
    load_format: LoadFormat = knob(
        LoadFormat.AUTO,
        "auto reads the checkpoint; dummy makes seeded random weights of the model's shape "
        "(no tokenizer: prompts are token ids)",
        LoadFormat,
    )
    quantization: Quantization = knob(
        Quantization.AUTO,
        "weights a GGUF file stores quantized (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, "
        "Q6_K): auto keeps them in their block formats on the CPU (other types are expanded "
        "at load); none expands every weight to dtype; int8 rounds a checkpoint's matrices "
        "to int8 per output channel, q4_0 to Q4_0 blocks (4 bits and a scale per 32 "
        "weights), at load (CPU)",
        Quantization,
    )
    weight_expansion_memory: int = knob(
        1 << 30,
        "bytes the CPU may add beside weights kept in GGUF blocks for expanded copies "
        "(the model's dtype) that multiply calls of many rows, each weight's by measurement "
        "(quantization auto, no int8 activations, no speculation; 0: blocks alone)",
        parse=lambda value, config: _parse_nonnegative_size(value, "weight_expansion_memory"),
    )
    activation_quantization: ActivationQuantization = knob(
        ActivationQuantization.NONE,
        "int8 rounds the activations to int8 per block of 32 values where they meet weights "
        "kept in Q8_0, Q4_0 or Q4_1 blocks and multiplies on int8 products (AVX-512 VNNI, "
        "bfloat16 models, as llama.cpp does: faster for batches, results no longer equal to "
        "the dequantized model's up to rounding); none multiplies them exactly",
        ActivationQuantization,
    )
    linear_kernel: LinearKernel = knob(
        LinearKernel.AUTO,
        "CPU matrix products of float32/bfloat16 weights: auto times the kernels once per "
        "weight shape (cached per CPU model) and keeps each weight in the fastest one's "
        "form; packed forces the C++ packed_linear kernel (AVX-512, batch invariant); "
        "onednn forces torch's oneDNN on the weight reordered into its blocked layout "
        "(the plain matrix where it cannot take it); dense forces torch's GEMM on the "
        "plain matrix",
        LinearKernel,
    )
    attention_kernel: AttentionKernel = knob(
        AttentionKernel.AUTO,
        "CPU attention of a sequence's prefill chunk: auto times the C++ paged kernel "
        "against gathering its K/V for torch's SDPA (oneDNN, AMX tiles where present) once "
        "per CPU model and head layout, and sends chunks from the measured crossover rows "
        "to SDPA (none where paged wins); paged forces the C++ kernel (batch invariant); "
        "sdpa sends chunks of 16 rows or more to SDPA",
        AttentionKernel,
    )
    device: torch.device = knob(
        "auto",
        "auto (CUDA when torch sees a GPU, else the CPU), cpu, or cuda[:N]",
        parse=_parse_device,
    )
    dtype: torch.dtype = knob(
        "auto",
        "weights and activations; auto is bfloat16 on CUDA and on a CPU with bfloat16 "
        "instructions (avx512_bf16, amx_bf16), float32 on other CPUs",
        ("auto", *_DTYPES),
        parse=_parse_dtype,
    )
    kv_cache_dtype: KVCacheDtype = knob(
        KVCacheDtype.AUTO,
        "KV cache format: auto (the model's dtype), bfloat16, float16, or 8-bit fp8_e4m3, "
        "fp8_e5m2, int8 with a scale per token and KV head; int4 keeps each sequence's "
        "kv_recent_tokens in the model's dtype and re-encodes older blocks into 4 bits per "
        "element (keys per channel over a block, values per token; from 64-token blocks "
        "on keys take 5 bits and values 3; docs/capacity.md)",
        KVCacheDtype,
    )
    kv_recent_tokens: int = knob(
        128,
        "kv_cache_dtype int4: each sequence's newest tokens kept in the model's dtype (or "
        "kv_recent_dtype); a block wholly behind them is re-encoded into 4 bits once",
    )
    kv_recent_dtype: KVCacheDtype = knob(
        KVCacheDtype.AUTO,
        "kv_cache_dtype int4: the format of the recent tokens' full-size blocks: auto (the "
        "model's dtype), bfloat16, float16, or 8-bit int8, fp8_e4m3, fp8_e5m2",
        KVCacheDtype,
    )
    block_size: int = knob(
        DEFAULT_BLOCK_SIZE,
        "tokens per KV block (a power of two), or auto: 8, 16 or 32 chosen at start-up from "
        "the attention kernel's timed speed at each and the recorded request lengths "
        "(block_size_workload, else what the server recorded for this model); "
        "kv_cache_dtype int4 groups keys over a block: 3.05x smaller than bfloat16 at 16, "
        "3.56x at 64 at some cost in quality (docs/capacity.md)",
        parse=lambda value, config: _parse_block_size(value),
    )
    block_size_workload: str | None = knob(
        None,
        "block_size auto weighs the request lengths of this JSON lines file "
        '({"prompt": tokens, "output": tokens} per line) instead of the recorded ones',
    )
    kv_cache_memory: int | None = knob(
        None,
        "bytes for the whole KV pool, e.g. 2GiB; default 2GiB on the CPU, and on CUDA what "
        "gpu_memory_utilization leaves after the weights and a profiling step's activations",
        parse=_parse_kv_cache_memory,
    )
    gpu_memory_utilization: float = knob(
        0.9, "share of the GPU's memory the engine may use, KV pool included (CUDA)"
    )
    enforce_eager: bool = knob(
        False,
        "run the model operator by operator: on CUDA instead of replaying captured decode "
        "graphs, on the CPU instead of running all decoder layers as one C++ call",
    )
    max_model_len: int | None = knob(
        None,
        "longest sequence (prompt + output) a request may reach; default: the model's limit "
        "capped by what the pool holds",
    )
    max_num_seqs: int = knob(128, "sequences one step may run")
    max_num_batched_tokens: int = knob(
        1024, "tokens one step may run (decodes + prefill chunks); longer prompts are chunked"
    )
    max_n: int = knob(128, "most samples (n) one request may ask for; each holds its own KV blocks")
    reserved_fraction: float = knob(
        0.05, "share of the KV blocks only high-priority requests (priority < 0) may take"
    )
    kv_allocation: KVAllocation = knob(
        KVAllocation.PAGED,
        "paged allocates blocks as sequences grow; contiguous holds max_model_len slots per "
        "request from its start (the pre-PagedAttention baseline)",
        KVAllocation,
    )
    kv_layer_groups: bool = knob(
        True,
        "give each kind of layer (global, sliding over W tokens) its own block table per "
        "sequence over the one pool, so sliding layers give their old blocks back; off: "
        "one table for every layer (needed for kv_cache_dtype int4 with such models for now)",
    )
    enable_prefix_caching: bool = knob(
        True, "reuse the K/V of cached full blocks of earlier prompts (automatic prefix caching)"
    )
    preemption_mode: PreemptionMode = knob(
        PreemptionMode.RECOMPUTE,
        "when blocks run out: recompute drops a preempted sequence's K/V; swap parks them in "
        "swap_space; auto swaps sequences with a full block computed, recomputes the rest",
        PreemptionMode,
    )
    swap_space: int = knob(
        0, "bytes of the second KV tier for swap, e.g. 1GiB", parse=_parse_swap_space
    )
    swap_path: str | None = knob(None, "memory-map the second KV tier to this file")
    swap_read_ahead: bool = knob(
        True,
        "copy the evicted blocks of the swapped sequences that resume next back into free "
        "pool blocks beside the running steps, so their swap-in finds them in place "
        "(with prefix caching and one table of full-size blocks)",
    )
    kv_tier_memory: int = knob(
        0,
        "bytes of host memory beside the pool where evicted prefix-cache blocks wait to be "
        "found again, e.g. 4GiB (0: none, or a staging tier of two max-length prompts when "
        "kv_cache_dir is set)",
        parse=_parse_tier_size,
    )
    kv_cache_dir: str | None = knob(
        None,
        "keep evicted prefix-cache blocks in this directory too, and every cached block at "
        "shutdown: a restarted engine with the same model and settings finds them",
    )
    kv_cache_dir_size: int = knob(
        8 << 30, "size limit of kv_cache_dir, e.g. 20GiB", parse=_parse_tier_size
    )
    kv_tier_prefetch: bool = knob(
        True,
        "start loading a request's cached blocks from disk when it arrives, while it waits "
        "in the queue (else when it reaches the head of the queue)",
    )
    kv_tier_wait: float = knob(
        1.0,
        "seconds a request waits in the queue for its blocks to load from disk before it "
        "computes what has not arrived",
    )
    tensor_parallel_size: int = knob(
        1,
        "ranks (processes) that split every layer's heads and MLP, and the vocabulary, "
        "over torch.distributed (gloo, on the CPU); kv_cache_memory is per rank",
    )
    nnodes: int = knob(
        1, "machines the tensor-parallel ranks span (each runs tensor_parallel_size / nnodes)"
    )
    node_rank: int = knob(
        0,
        "this machine's index among nnodes: 0 runs the engine (and the API), the others "
        "only their ranks' share of every step",
    )
    master_addr: str = knob(
        "127.0.0.1", "address of node 0, where the ranks meet (tensor parallelism)"
    )
    master_port: int | None = knob(
        None, "port on master_addr where the ranks meet; default: a free one (one node only)"
    )
    disable_custom_all_reduce: bool = knob(
        False,
        "tensor parallelism: all-reduce through gloo only, not through shared memory "
        "between the ranks of one machine",
    )
    distributed_timeout: float = knob(
        60.0,
        "seconds the engine waits for a tensor-parallel rank inside one step before it "
        "declares the rank dead and fails",
    )
    disable_any_whitespace: bool = knob(
        COMPACT_JSON_BY_DEFAULT,
        "structured JSON outputs (json schemas, json_object) without free whitespace: one "
        "space after each ',' and ':' and none elsewhere (vLLM's name; on by default here, "
        "off in vLLM: --no-disable-any-whitespace allows any JSON whitespace); a request's "
        "structured_outputs.disable_any_whitespace overrides it",
    )
    speculative_config: SpeculativeConfig | None = knob(
        None,
        "speculative decoding, as JSON in vLLM's shape: "
        '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}, {"method": "suffix", "num_speculative_tokens": 8} or '
        '{"method": "draft_model", "model": "default", "num_speculative_tokens": 8, '
        '"activation_quantization": "int8"}; '
        "the engine guesses up to that many tokens per sequence and step, fewer (or none) "
        "when its measurements say guessing would not pay (docs/speculative_decoding.md)",
        parse=lambda value, config: SpeculativeConfig.parse(value),
    )
    seed: int = knob(0, "seed of the global random generator (unseeded requests draw from it)")
    log_stats_interval: float = knob(
        5.0, "seconds between throughput and pool log lines (0: never)"
    )

    def __post_init__(self) -> None:
        for spec in fields(self):
            value, kind, parse = (
                getattr(self, spec.name),
                spec.metadata["choice"],
                spec.metadata["parse"],
            )
            if kind is not None:
                setattr(self, spec.name, parse_choice(kind, value, spec.name))
            elif parse is not None:
                setattr(self, spec.name, parse(value, self))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.block_size == BLOCK_SIZE_AUTO and self.tensor_parallel_size > 1:
            raise ValueError("block_size='auto' runs one rank; give tensor parallelism a size")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0.0 <= self.reserved_fraction < 1.0:
            raise ValueError(f"reserved_fraction must be in [0, 1), got {self.reserved_fraction}")
        self._check_activation_quantization()
        self._check_parallel()
        self._check_linear_kernel()
        self._check_attention_kernel()
        self._check_by_age()
        self._check_tiers()

    @property
    def has_tiers(self) -> bool:
        """Whether evicted prefix-cache blocks go to lower tiers (host memory, disk)."""
        return self.kv_tier_memory > 0 or self.kv_cache_dir is not None

    def _check_tiers(self) -> None:
        """The lower tiers hold prefix-cache blocks of a paged, single-rank pool in one
        block format (not int4's two), of weights that are the same at every start."""
        if not self.has_tiers:
            return
        if self.kv_tier_wait < 0:
            raise ValueError(f"kv_tier_wait must be >= 0 seconds, got {self.kv_tier_wait}")
        if self.kv_cache_dir is not None and self.kv_cache_dir_size <= 0:
            raise ValueError("kv_cache_dir_size must be positive")
        unsupported = {
            "enable_prefix_caching": not self.enable_prefix_caching,
            "kv_allocation": self.kv_allocation is KVAllocation.CONTIGUOUS,
            "kv_cache_dtype": self.kv_cache_dtype.by_age,
            "tensor_parallel_size": self.tensor_parallel_size > 1,
            "load_format": self.kv_cache_dir is not None and self.load_format is LoadFormat.DUMMY,
        }
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(
                "the prefix cache's lower tiers (kv_tier_memory, kv_cache_dir) need prefix "
                "caching, paged allocation, one K/V block format, one rank and (for a "
                "directory) weights loaded from files; not "
                + ", ".join(f"{name}={getattr(self, name)!r}" for name in refused)
            )

    @property
    def full_block_dtype(self) -> KVCacheDtype:
        """The format of the pool's full-size blocks: ``kv_cache_dtype``, or with int4
        (whose old blocks are compact) ``kv_recent_dtype``."""
        return self.kv_recent_dtype if self.kv_cache_dtype.by_age else self.kv_cache_dtype

    def _check_by_age(self) -> None:
        """int4's compact blocks are allocated on demand and without a draft model;
        every preemption mode runs (swap parks compact blocks compact). Its recent
        window is in a format of full-size blocks (not int4 again)."""
        if self.kv_recent_dtype is not KVCacheDtype.AUTO and (
            not self.kv_cache_dtype.by_age or self.kv_recent_dtype.by_age
        ):
            raise ValueError(
                f"kv_recent_dtype={self.kv_recent_dtype.value!r} sets the format of int4's "
                f"recent window (a full-size format), not with "
                f"kv_cache_dtype={self.kv_cache_dtype.value!r}"
            )
        if not self.kv_cache_dtype.by_age:
            if self.kv_recent_tokens != type(self).kv_recent_tokens:
                raise ValueError(
                    f"kv_recent_tokens={self.kv_recent_tokens} sets how many tokens int4 keeps "
                    f"in full-size blocks; kv_cache_dtype={self.kv_cache_dtype.value!r} keeps "
                    f"every token in one format"
                )
            return
        if self.kv_recent_tokens < 0:
            raise ValueError(f"kv_recent_tokens must be >= 0, got {self.kv_recent_tokens}")
        if self.block_size != BLOCK_SIZE_AUTO and self.block_size < 16:
            raise ValueError(
                f"kv_cache_dtype='int4' groups keys over a block of at least 16 tokens; "
                f"block_size={self.block_size}"
            )
        unsupported = {
            "kv_allocation": self.kv_allocation is KVAllocation.CONTIGUOUS,
            "speculative_config": self.speculative_config is not None
            and self.speculative_config.method is SpeculativeMethod.DRAFT_MODEL,
        }
        refused = [name for name, bad in unsupported.items() if bad]
        if refused:
            raise ValueError(
                "kv_cache_dtype='int4' runs with paged allocation and no draft model for "
                "now; not with " + ", ".join(f"{name}={getattr(self, name)!r}" for name in refused)
            )

    def _check_parallel(self) -> None:
        tp, nodes = self.tensor_parallel_size, self.nnodes
        if tp < 1 or nodes < 1:
            raise ValueError(f"tensor_parallel_size and nnodes must be >= 1, got {tp} and {nodes}")
        if tp % nodes:
            raise ValueError(
                f"tensor_parallel_size={tp} must be a multiple of nnodes={nodes} (every "
                "node runs the same number of ranks)"
            )
        if not 0 <= self.node_rank < nodes:
            raise ValueError(f"node_rank must be in [0, {nodes}), got {self.node_rank}")
        if nodes > 1 and self.master_port is None:
            raise ValueError("more than one node needs master_port (and master_addr: node 0)")
        if self.distributed_timeout <= 0:
            raise ValueError(
                f"distributed_timeout must be positive, got {self.distributed_timeout}"
            )

    def _check_activation_quantization(self) -> None:
        if self.activation_quantization is ActivationQuantization.NONE:
            return
        if self.quantization is Quantization.NONE:
            raise ValueError(
                "activation_quantization='int8' multiplies weights kept quantized; "
                "quantization='none' expands them all"
            )
        if self.device.type != "cpu" or self.dtype != torch.bfloat16:
            raise ValueError(
                "activation_quantization='int8' runs bfloat16 models on the CPU, not "
                f"{self.dtype} on {self.device.type}"
            )

    def _check_attention_kernel(self) -> None:
        if self.attention_kernel is not AttentionKernel.AUTO and self.device.type != "cpu":
            raise ValueError(
                f"attention_kernel={self.attention_kernel!r} chooses a CPU kernel; "
                f"{self.device.type} runs the Triton kernel (leave it auto)"
            )

    def _check_linear_kernel(self) -> None:
        if self.linear_kernel is not LinearKernel.PACKED:
            return
        if self.device.type != "cpu":
            reason = f"runs on the CPU, not {self.device.type}"
        elif self.dtype not in (torch.float32, torch.bfloat16):
            reason = f"takes float32 or bfloat16 weights, not {self.dtype}"
        elif not avx512_kernels_available():
            reason = "needs the C++ AVX-512 kernels, which this CPU (or this build) lacks"
        else:
            return
        raise ValueError(f"linear_kernel='packed' {reason}; use auto, onednn or dense")
