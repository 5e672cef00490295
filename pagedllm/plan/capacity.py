"""The planner's figures: KV bytes per token, blocks in a budget, sequences in a pool.

Units: tokens, blocks of ``block_size`` tokens, bytes. The KV cache of one token holds
K and V for every layer and KV head: ``2 x layers x kv_heads x head_dim`` elements.
Every quantity the engine also computes comes from the one module it uses,
:mod:`pagedllm.kv.capacity`: a block's bytes (through
:func:`~pagedllm.kv_storage.kv_cache.bytes_per_block`), the pool a budget buys
(:func:`~pagedllm.kv.capacity.pool_blocks`) and a request's worst case
(:func:`~pagedllm.kv.capacity.request_worst_case_blocks`), so a plan holds exactly the
blocks the engine allocates for that budget and the sequences it admits.

Quantized caches (fp8, int8) carry one bfloat16 scale per token, layer, K/V and KV
head, as the engine stores them: ``2 / head_dim`` bytes per element, 1.6 % at head_dim
128. Weights take ``parameters x bytes per weight`` (quantized
formats with their block scales, as the engine holds them); the
activation reserve is a fraction of the weight bytes (10-20 % is the usual rule of thumb).

Sliding windows: when every layer of a model slides over ``W`` tokens, a sequence holds
at most the blocks of its last window (:func:`~pagedllm.kv.capacity.max_window_blocks`
while decoding), as the engine releases the others, and the engine's paged pool is one
block smaller (the null block its tables point at; contiguous allocation has none). A
model with layers of several kinds (Gemma 2/3, Qwen2 with windows on some layers) is
planned as the engine runs it by default: its layers grouped by kind
(:mod:`pagedllm.kv.layer_groups`), a block holding one group's layers, each group with
its own table per sequence (:func:`~pagedllm.kv.capacity.grouped_worst_case_blocks`);
a draft model's K/V ride in the global group's blocks, and every block carries room
for them, as the engine's do.

A draft model (``draft_model`` speculation, :class:`DraftShape`) keeps its K/V in the
same blocks as the target's, in its own layers and dtype: a block's bytes are the sum,
its weights join the first device's, and the scratch blocks of its guesses
(:func:`~pagedllm.kv.capacity.draft_scratch_blocks`) come out of the KV budget before
the pool is sized, as the engine does.

K/V by age (``int4``): each sequence keeps its newest ``recent_tokens`` in full-size
blocks of the model's dtype (bfloat16 here, or the weights' float dtype) and older
blocks in compact 4-bit ones (:mod:`~pagedllm.kv_storage.compact_blocks`, scales and
zeros included). The budget is split as the engine splits it
(:func:`~pagedllm.kv.capacity.full_blocks_wanted`,
:func:`~pagedllm.kv.capacity.split_by_age`, for ``max_num_seqs`` and
``max_num_batched_tokens``); a sequence holds at most
:func:`~pagedllm.kv.capacity.recent_blocks` full-size blocks, the rest compact. Its
"KV per token" is a compact token's, contiguous allocation does not take it.

Tensor parallelism (``tensor_parallel_size`` ranks, one per device, split as
:class:`~pagedllm.models.partition.TensorPartition` says): weights, budgets, blocks
and sequences are per device. A device's weights are those of the rank holding the most
(:func:`~pagedllm.plan.model_shape.rank_parameters`); every rank's pool has as many
blocks as the pool of the rank with the most KV heads, since all ranks hold the same
block ids, so a budget's blocks and a block's bytes are that rank's.

The prefix cache's lower tiers (``kv_tier_memory``, ``kv_cache_dir_size``,
:class:`Tiers`) keep blocks the pool evicts, each shaped like a pool block (the target's
K/V of every layer), sized as the engine sizes them
(:func:`~pagedllm.kv_tiers.build.host_tier_slots`,
:func:`~pagedllm.kv_tiers.disk_tier.capacity_entries_for`); one rank and one block
format only, so not with int4 or tensor parallelism, as the engine refuses.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.kv.capacity import (
    blocks_for_tokens,
    cdiv,
    draft_scratch_blocks,
    full_blocks_wanted,
    grouped_worst_case_blocks,
    pool_blocks,
    recent_blocks,
    split_by_age,
)
from pagedllm.kv.layer_groups import KVLayerGroups, group_layers, single_group
from pagedllm.kv_storage.compact_blocks import TileLayout
from pagedllm.kv_storage.kv_cache import bytes_per_block
from pagedllm.kv_tiers.build import host_tier_slots
from pagedllm.kv_tiers.disk_tier import capacity_entries_for, slot_bytes_for
from pagedllm.models.config import ModelConfig
from pagedllm.models.partition import TensorPartition
from pagedllm.plan.model_shape import ModelShape


@dataclass(frozen=True)
class KVDtype:
    """A KV cache element type and the engine's ``kv_cache_dtype`` that stores it;
    ``quantized`` ones carry a bfloat16 scale per token and KV head; ``by_age`` ones
    (int4) keep recent tokens in ``torch_dtype`` and older blocks compact."""

    name: str
    torch_dtype: torch.dtype
    cache_format: str
    quantized: bool = False
    by_age: bool = False

    @property
    def element_bytes(self) -> int:
        return self.torch_dtype.itemsize


KV_DTYPES: dict[str, KVDtype] = {
    "float32": KVDtype("float32", torch.float32, "auto"),
    "bfloat16": KVDtype("bfloat16", torch.bfloat16, "bfloat16"),
    "float16": KVDtype("float16", torch.float16, "float16"),
    "fp8": KVDtype("fp8", torch.float8_e4m3fn, "fp8_e4m3", quantized=True),
    "int8": KVDtype("int8", torch.int8, "int8", quantized=True),
}
"""The formats a block keeps for its whole life."""
PLANNED_KV_DTYPES: dict[str, KVDtype] = {
    **KV_DTYPES,
    "int4": KVDtype("int4", torch.bfloat16, "int4", by_age=True),
}
"""Every format a plan can show: :data:`KV_DTYPES` and those that change with age."""


@dataclass(frozen=True)
class ByAge:
    """The engine options that split a pool by age (``kv_recent_tokens``,
    ``max_num_seqs``, ``max_num_batched_tokens``), the model's dtype, and the format
    of its full-size blocks (``recent_format``: a :data:`KV_DTYPES` name, the engine's
    ``kv_recent_dtype``; None: the model's dtype)."""

    recent_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    recent_dtype: torch.dtype = torch.bfloat16
    recent_format: str | None = None

    @property
    def full_kv_dtype(self) -> KVDtype:
        """The format the full-size blocks keep."""
        if self.recent_format is not None:
            return KV_DTYPES[self.recent_format]
        name = str(self.recent_dtype).removeprefix("torch.")
        return KVDtype(name, self.recent_dtype, "auto")


# Bytes per weight by storage type. The GGUF block formats are what the engine holds when
# it runs a GGUF file's quantized matrices (bytes per block / weights per block, scales
# included); int8 and int4 stand for Q8_0 and Q4_0, its 8- and 4-bit formats.
GGUF_WEIGHT_BYTES: dict[str, float] = {
    "q8_0": 34 / 32,
    "q6_k": 210 / 256,
    "q5_k": 176 / 256,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_k": 144 / 256,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}
WEIGHT_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8": 1,
    "int8": GGUF_WEIGHT_BYTES["q8_0"],
    "int4": GGUF_WEIGHT_BYTES["q4_0"],
    **GGUF_WEIGHT_BYTES,
}


@dataclass(frozen=True)
class DraftShape:
    """A draft model beside the target (``draft_model`` speculation): its shape, weights
    stored as ``weight_dtype`` (a :data:`WEIGHT_BYTES` name), K/V in ``kv_dtype``
    (float32 or bfloat16, the draft's own dtype), guessing up to
    ``num_speculative_tokens`` per sequence for up to ``max_num_seqs`` sequences."""

    model: ModelShape
    weight_dtype: str
    kv_dtype: str
    num_speculative_tokens: int
    max_num_seqs: int

    @property
    def weight_bytes(self) -> int:
        return weight_bytes(self.model.num_parameters, self.weight_dtype)

    def block_bytes(self, block_size: int) -> int:
        """The draft's bytes in each block of the pool, every draft layer."""
        return block_bytes(self.model.config, block_size, KV_DTYPES[self.kv_dtype])

    def scratch_bytes(self, block_size: int) -> int:
        """Bytes of the draft cache's scratch blocks, taken from the KV budget."""
        blocks = draft_scratch_blocks(self.num_speculative_tokens, block_size, self.max_num_seqs)
        return blocks * self.block_bytes(block_size)


def kv_elements_per_token(config: ModelConfig) -> int:
    """K and V elements one token stores across all layers: ``2 x layers x kv_heads x head_dim``."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim


def kv_bytes_per_token(config: ModelConfig, kv_dtype: KVDtype) -> int:
    """Bytes of K/V per token across all layers, scales excluded."""
    return kv_elements_per_token(config) * kv_dtype.element_bytes


def hidden_size_estimate(config: ModelConfig, num_tokens: int, element_bytes: int) -> int:
    """The textbook formula ``2 x layers x tokens x hidden x bytes``: exact without GQA, an
    overestimate by ``num_heads / num_kv_heads`` with it."""
    return 2 * config.num_layers * num_tokens * config.hidden_size * element_bytes


def block_elements_per_layer(config: ModelConfig, block_size: int) -> int:
    """K and V elements of one block in one layer (Llama-2-7B, 16 tokens: 16 x 32 heads x
    128 dims x 2)."""
    return 2 * block_size * config.num_kv_heads * config.head_dim


def layer_groups(config: ModelConfig, one_table: bool = False) -> KVLayerGroups:
    """The KV layer groups the engine keeps for ``config`` by default (paged allocation),
    or with ``one_table`` (``kv_layer_groups=False``, int4 by age) one group of every
    layer."""
    if one_table:
        return single_group(config.num_layers, config.kv_window)
    return group_layers(config.sliding_windows, config.num_layers)


def block_bytes(
    config: ModelConfig,
    block_size: int,
    kv_dtype: KVDtype,
    model_dtype: torch.dtype = torch.float32,
    num_layers: int | None = None,
) -> int:
    """Bytes of one (full-size) block across all layers (or ``num_layers``, a KV layer
    group's), K and V, scales included: exactly what the engine's pool counts for
    ``kv_cache_dtype=kv_dtype.cache_format`` and a model in ``model_dtype``."""
    return bytes_per_block(
        num_layers or config.num_layers,
        block_size,
        config.num_kv_heads,
        config.head_dim,
        model_dtype,
        kv_cache_dtype=kv_dtype.cache_format,
    )


def compact_block_bytes(config: ModelConfig, block_size: int) -> int:
    """Bytes of one compact (4-bit) block across all layers, scales and zeros included."""
    tile = TileLayout(block_size, config.head_dim).tile_bytes
    return config.num_layers * config.num_kv_heads * tile


def kv_rank_config(config: ModelConfig, tensor_parallel_size: int = 1) -> ModelConfig:
    """The layers of the rank holding the most KV heads
    (:attr:`~pagedllm.models.partition.TensorPartition.max_kv_heads`): its KV bytes
    per token and per block are a device's (the model's own config on one rank)."""
    partition = TensorPartition(config, tensor_parallel_size)
    rank = max(range(tensor_parallel_size), key=lambda r: len(partition.rank_slice(r).kv_heads))
    return partition.local_config(rank)


def blocks_per_rank(
    config: ModelConfig,
    tensor_parallel_size: int,
    kv_bytes: int,
    block_size: int,
    kv_dtype: str = "float32",
) -> int:
    """Blocks each rank's pool offers sequences for a KV budget of ``kv_bytes`` bytes per
    rank: the blocks of ``block_size`` tokens ``kv_bytes`` holds on the rank with the most
    KV heads (:func:`~pagedllm.kv.capacity.pool_blocks`, as the engine sizes every rank's
    paged pool, a block holding one KV layer group's layers), less the null block when
    some layer slides. ``kv_dtype`` is a :data:`KV_DTYPES` name."""
    rank_config = kv_rank_config(config, tensor_parallel_size)
    groups = layer_groups(config)
    per_block = block_bytes(
        rank_config, block_size, KV_DTYPES[kv_dtype], num_layers=groups.num_slots
    )
    return pool_blocks(kv_bytes, per_block, any(w is not None for w in groups.windows))


def max_seqs_paged(
    num_blocks: int,
    block_size: int,
    seq_len: int,
    prefix_len: int = 0,
    windows: tuple[int | None, ...] = (None,),
) -> int:
    """Sequences of ``seq_len`` tokens that fit in ``num_blocks`` blocks allocated on demand,
    decoding: the most ``n`` for which one request of ``n`` samples of a
    ``prefix_len``-token prompt, each reaching ``seq_len`` tokens, fits
    (:func:`~pagedllm.kv.capacity.grouped_worst_case_blocks`; ``windows``: each KV layer
    group's sliding window or None). The prefix's full blocks are held once; a partial
    last prefix block is private. Needs ``prefix_len < seq_len``.
    """
    output_len = seq_len - prefix_len
    first = grouped_worst_case_blocks(prefix_len, output_len, 1, block_size, windows)
    if num_blocks < first:
        return 0
    own = grouped_worst_case_blocks(prefix_len, output_len, 2, block_size, windows) - first
    return 1 + (num_blocks - first) // own


def max_seqs_contiguous(num_blocks: int, block_size: int, max_model_len: int) -> int:
    """Sequences that fit when each reserves ``max_model_len`` tokens up front."""
    return num_blocks // blocks_for_tokens(max_model_len, block_size)


@dataclass(frozen=True)
class MemoryBudget:
    """Where one device's memory goes, in bytes. ``total_bytes`` is ``None`` when the KV
    budget was given directly; otherwise ``kv_bytes = total - weights - activation
    reserve``, the reserve being ``activation_reserve`` (a fraction) of the weight bytes.
    ``device_parameters`` and ``weight_bytes`` are the device holding the most's (a
    draft model's weights included); ``weight_bytes_all_devices`` sums every device's
    weights."""

    total_bytes: int | None
    weight_dtype: str
    device_parameters: int
    weight_bytes: int
    weight_bytes_all_devices: int
    activation_reserve: float
    activation_reserve_bytes: int
    kv_bytes: int


def weight_bytes(num_parameters: int, weight_dtype: str) -> int:
    """Bytes of ``num_parameters`` weights stored as ``weight_dtype`` (a
    :data:`WEIGHT_BYTES` name; block formats with their scales), rounded up."""
    return math.ceil(num_parameters * WEIGHT_BYTES[weight_dtype])


def memory_budget(
    rank_parameters: Sequence[int],
    weight_dtype: str,
    activation_reserve: float,
    total_bytes: int | None = None,
    kv_bytes: int | None = None,
    draft_weight_bytes: int = 0,
) -> MemoryBudget:
    """Split one device's ``total_bytes`` into weights, activation reserve (a fraction of
    the weights) and KV cache, or take ``kv_bytes`` as its KV budget. Exactly one must be
    given. ``rank_parameters``: the parameters each device holds (one entry without tensor
    parallelism); the device holding the most sets the weights. ``draft_weight_bytes``:
    a draft model's weights, on that device too."""
    if (total_bytes is None) == (kv_bytes is None):
        raise ValueError("give either a total memory size or a KV cache budget, not both")
    if activation_reserve < 0:
        raise ValueError(f"activation reserve must be a fraction >= 0, got {activation_reserve}")
    device_parameters = max(rank_parameters)
    weights = weight_bytes(device_parameters, weight_dtype) + draft_weight_bytes
    reserve = math.ceil(weights * activation_reserve)
    if kv_bytes is None:
        kv_bytes = total_bytes - weights - reserve
        if kv_bytes <= 0:
            raise ValueError(
                f"{total_bytes:,} bytes do not hold the weights ({weights:,} bytes in "
                f"{weight_dtype}) and the activation reserve ({reserve:,} bytes)"
            )
    return MemoryBudget(
        total_bytes=total_bytes,
        weight_dtype=weight_dtype,
        device_parameters=device_parameters,
        weight_bytes=weights,
        weight_bytes_all_devices=sum(weight_bytes(p, weight_dtype) for p in rank_parameters)
        + draft_weight_bytes,
        activation_reserve=activation_reserve,
        activation_reserve_bytes=reserve,
        kv_bytes=kv_bytes,
    )


@dataclass(frozen=True)
class Workload:
    """Sequences to plan for, in tokens: ``avg_len`` per sequence (prompt + output),
    ``max_model_len`` reserved per sequence by contiguous allocation, the first
    ``prefix_len`` tokens shared by all, and a ``batch`` of sequences to size."""

    avg_len: int
    max_model_len: int
    prefix_len: int = 0
    batch: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.avg_len <= self.max_model_len:
            raise ValueError(
                f"average length {self.avg_len} must be in 1 .. max_model_len {self.max_model_len}"
            )
        if not 0 <= self.prefix_len < self.avg_len:
            # as in the engine, where every request generates at least one token
            raise ValueError(
                f"prefix length {self.prefix_len} must be in 0 .. {self.avg_len - 1}: every "
                "sequence holds at least one token of its own"
            )
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")


@dataclass(frozen=True)
class Tiers:
    """The lower tiers asked for: ``memory`` bytes of host memory (0: a staging tier of
    two ``max_model_len`` prompts when there is a directory) and a directory of at most
    ``dir_size`` bytes (None: none)."""

    memory: int = 0
    dir_size: int | None = None


@dataclass(frozen=True)
class TierCapacity:
    """One KV dtype's lower tiers: blocks of ``block_bytes`` (a pool block without a
    draft's K/V) in host memory, and on disk in slots of ``disk_slot_bytes`` (a 128-byte
    header and the block, in whole pages)."""

    block_bytes: int
    host_blocks: int
    host_tokens: int
    disk_blocks: int
    disk_tokens: int
    disk_slot_bytes: int


def tier_capacity(
    block_bytes: int, block_size: int, tiers: Tiers, max_model_len: int
) -> TierCapacity:
    """The blocks ``tiers`` hold of ``block_bytes`` each, as the engine sizes them."""
    host = host_tier_slots(tiers.memory, block_bytes, block_size, max_model_len)
    disk = 0 if tiers.dir_size is None else capacity_entries_for(tiers.dir_size, block_bytes)
    if tiers.dir_size is not None and disk < 1:
        raise ValueError(
            f"kv_cache_dir_size={tiers.dir_size} bytes holds no block of {block_bytes} bytes"
        )
    return TierCapacity(
        block_bytes=block_bytes,
        host_blocks=host,
        host_tokens=host * block_size,
        disk_blocks=disk,
        disk_tokens=disk * block_size,
        disk_slot_bytes=slot_bytes_for(block_bytes) if tiers.dir_size is not None else 0,
    )


@dataclass(frozen=True)
class DtypeCapacity:
    """One KV dtype's figures. Bytes include quantization scales only in ``block_bytes``
    and what derives from it (``num_blocks``, sequence counts). ``num_blocks`` is the
    paged pool (less the null block of a sliding window); ``contiguous_seqs`` counts in
    the contiguous pool, which keeps no null block."""

    kv_dtype: str
    element_bytes: int
    kv_bytes_per_token: int
    block_bytes_per_layer: int
    block_bytes: int
    batch_kv_bytes: int
    num_blocks: int
    num_tokens: int
    paged_seqs: int
    paged_seqs_with_prefix: int
    contiguous_seqs: int
    num_compact_blocks: int = 0
    compact_block_bytes: int = 0
    tiers: TierCapacity | None = None  # None: no tiers asked for, or int4


@dataclass(frozen=True)
class CapacityPlan:
    """A model's memory plan for one block size, budget and workload, per KV dtype, on
    each of ``tensor_parallel_size`` devices (every figure but the model's is per device)."""

    model: ModelShape
    block_size: int
    budget: MemoryBudget
    workload: Workload
    rows: tuple[DtypeCapacity, ...]
    tensor_parallel_size: int = 1
    draft: DraftShape | None = None
    by_age: ByAge | None = None
    tiers: Tiers | None = None

    @property
    def kv_config(self) -> ModelConfig:
        """The layers whose KV cache sizes a device's pool (:func:`kv_rank_config`)."""
        return kv_rank_config(self.model.config, self.tensor_parallel_size)


def dtype_capacity(
    config: ModelConfig,
    block_size: int,
    kv_bytes: int,
    workload: Workload,
    kv_dtype: KVDtype,
    tensor_parallel_size: int = 1,
    draft: DraftShape | None = None,
    by_age: ByAge | None = None,
    tiers: Tiers | None = None,
) -> DtypeCapacity:
    """The figures of one KV dtype for a budget of ``kv_bytes`` bytes per device, on each
    of ``tensor_parallel_size`` devices (see :func:`blocks_per_rank`); a ``draft``
    model's K/V in every block and its scratch blocks counted; the lower ``tiers``
    below the pool (not for int4, whose pool has two block kinds)."""
    rank_config = kv_rank_config(config, tensor_parallel_size)
    if kv_dtype.by_age:
        return by_age_capacity(rank_config, block_size, kv_bytes, workload, kv_dtype, by_age)
    if tiers is not None and tensor_parallel_size > 1:
        raise ValueError(
            "the prefix cache's lower tiers run on one rank; not with "
            f"tensor_parallel_size={tensor_parallel_size}"
        )
    per_token = kv_bytes_per_token(rank_config, kv_dtype)
    groups = layer_groups(config)
    windows = groups.windows
    per_block = block_bytes(rank_config, block_size, kv_dtype, num_layers=groups.num_slots)
    below = (
        None
        if tiers is None
        else tier_capacity(per_block, block_size, tiers, workload.max_model_len)
    )
    # contiguous allocation keeps one table for every layer and no null block
    contiguous_blocks = pool_blocks(kv_bytes, block_bytes(rank_config, block_size, kv_dtype))
    if draft is not None:
        per_token += kv_bytes_per_token(draft.model.config, KV_DTYPES[draft.kv_dtype])
        per_block += draft.block_bytes(block_size)
        kv_bytes -= draft.scratch_bytes(block_size)
        contiguous_blocks = pool_blocks(kv_bytes, per_block)
    num_blocks = pool_blocks(kv_bytes, per_block, any(w is not None for w in windows))
    return DtypeCapacity(
        kv_dtype=kv_dtype.name,
        element_bytes=kv_dtype.element_bytes,
        kv_bytes_per_token=per_token,
        block_bytes_per_layer=(
            block_elements_per_layer(rank_config, block_size) * kv_dtype.element_bytes
        ),
        block_bytes=per_block,
        batch_kv_bytes=workload.batch * workload.avg_len * per_token,
        num_blocks=num_blocks,
        num_tokens=num_blocks * block_size,
        paged_seqs=max_seqs_paged(num_blocks, block_size, workload.avg_len, windows=windows),
        paged_seqs_with_prefix=max_seqs_paged(
            num_blocks, block_size, workload.avg_len, workload.prefix_len, windows
        ),
        contiguous_seqs=max_seqs_contiguous(contiguous_blocks, block_size, workload.max_model_len),
        tiers=below,
    )


def by_age_capacity(
    config: ModelConfig,
    block_size: int,
    kv_bytes: int,
    workload: Workload,
    kv_dtype: KVDtype,
    by_age: ByAge | None,
) -> DtypeCapacity:
    """An int4 row: the pool split as the engine splits it, and the sequences that fit
    when each holds its recent window in full-size blocks and its shared prefix's
    compact blocks once."""
    if by_age is None:
        raise ValueError(f"the {kv_dtype.name} row needs the options that split its pool")
    if config.kv_window is not None:
        raise ValueError(f"{kv_dtype.name} does not run with a model whose every layer slides")
    full_bytes = block_bytes(config, block_size, by_age.full_kv_dtype, by_age.recent_dtype)
    compact_bytes = compact_block_bytes(config, block_size)
    wanted = full_blocks_wanted(
        by_age.max_num_seqs, by_age.recent_tokens, by_age.max_num_batched_tokens, block_size
    )
    num_full, num_compact = split_by_age(kv_bytes, full_bytes, compact_bytes, wanted)
    full_each = min(
        cdiv(workload.avg_len, block_size), recent_blocks(by_age.recent_tokens, 1, block_size)
    )

    def fits(prefix_len: int) -> int:
        shared = min(prefix_len // block_size, cdiv(workload.avg_len, block_size) - full_each)
        own = cdiv(workload.avg_len, block_size) - full_each - shared
        by_full = num_full // full_each
        by_compact = by_full if own == 0 else max(0, num_compact - shared) // own
        return min(by_full, by_compact)

    return DtypeCapacity(
        kv_dtype=kv_dtype.name,
        element_bytes=kv_dtype.element_bytes,
        kv_bytes_per_token=compact_bytes // block_size,
        block_bytes_per_layer=block_elements_per_layer(config, block_size)
        * by_age.full_kv_dtype.element_bytes,
        block_bytes=full_bytes,
        batch_kv_bytes=workload.batch * workload.avg_len * compact_bytes // block_size,
        num_blocks=num_full,
        num_tokens=(num_full + num_compact) * block_size,
        paged_seqs=fits(0),
        paged_seqs_with_prefix=fits(workload.prefix_len),
        contiguous_seqs=0,
        num_compact_blocks=num_compact,
        compact_block_bytes=compact_bytes,
    )


def plan_capacity(
    model: ModelShape,
    block_size: int,
    budget: MemoryBudget,
    workload: Workload,
    kv_dtypes: tuple[str, ...] = tuple(PLANNED_KV_DTYPES),
    tensor_parallel_size: int = 1,
    draft: DraftShape | None = None,
    by_age: ByAge | None = None,
    tiers: Tiers | None = None,
) -> CapacityPlan:
    """Every figure of the plan, one row per name in ``kv_dtypes`` (the target's K/V; a
    ``draft``'s beside it); ``budget`` is per device, on each of
    ``tensor_parallel_size`` devices."""
    rows = tuple(
        dtype_capacity(
            model.config,
            block_size,
            budget.kv_bytes,
            workload,
            PLANNED_KV_DTYPES[name],
            tensor_parallel_size,
            draft,
            by_age,
            tiers,
        )
        for name in kv_dtypes
    )
    return CapacityPlan(
        model, block_size, budget, workload, rows, tensor_parallel_size, draft, by_age, tiers
    )
