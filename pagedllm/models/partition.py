"""How a decoder splits over ``tensor_parallel_size`` ranks (Megatron-style).

Pure arithmetic, no process group: the loaders, the engine and the planner all read the
same split from here.

- Attention goes by key/value groups: each rank holds whole groups (a KV head with its
  query heads). With at least as many KV heads as ranks, the groups are dealt out as
  evenly as they go (counts differ by at most one, so 3 KV heads over 2 ranks are 2 + 1);
  with fewer KV heads than ranks, each KV head is replicated on ``ranks / kv_heads``
  ranks, which split its query heads evenly.
- The MLP's intermediate features split into contiguous ranges as even as they go.
- The vocabulary (embedding rows, LM head rows) splits into ``ceil(vocab / ranks)``-row
  shards; the last may be short (it is padded with zero rows when gathered).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedllm.kv.capacity import cdiv
from pagedllm.models.config import ModelConfig


class PartitionError(ValueError):
    """A model that cannot be split over the requested number of ranks."""


def even_ranges(total: int, parts: int) -> list[range]:
    """``range(total)`` cut into ``parts`` contiguous ranges whose lengths differ by at
    most one (the longer ones first)."""
    base, extra = divmod(total, parts)
    starts = [r * base + min(r, extra) for r in range(parts + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(parts)]


@dataclass(frozen=True)
class RankSlice:
    """What rank ``rank`` holds: query heads, KV heads and intermediate features as
    ranges of the whole model's indices, and its rows of the vocabulary."""

    rank: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range


@dataclass(frozen=True)
class TensorPartition:
    """The split of ``config`` over ``world_size`` ranks; raises :class:`PartitionError`
    for a model it cannot split."""

    config: ModelConfig
    world_size: int

    def __post_init__(self) -> None:
        c, n = self.config, self.world_size
        if n < 1:
            raise PartitionError(f"tensor_parallel_size must be >= 1, got {n}")
        if n == 1:
            return
        if c.sparse_layers and any(c.sparse_layers):
            raise PartitionError(
                "tensor parallelism does not split mixture-of-experts layers yet; run this "
                "model with tensor_parallel_size=1"
            )
        if c.qk_norm == "projection":
            raise PartitionError(
                f"{c.architecture} norms q and k over every head at once, which tensor "
                "parallelism does not split; run it with tensor_parallel_size=1"
            )
        if c.num_kv_heads < n and (n % c.num_kv_heads or c.num_heads % n):
            raise PartitionError(
                f"{c.num_kv_heads} KV heads and {c.num_heads} query heads cannot be split "
                f"over {n} ranks: with fewer KV heads than ranks, the ranks must be a "
                "multiple of the KV heads and divide the query heads"
            )
        if c.intermediate_size < n:
            raise PartitionError(
                f"an MLP of {c.intermediate_size} features cannot be split over {n} ranks"
            )

    @property
    def vocab_shard(self) -> int:
        """Rows of the vocabulary each rank holds (the last rank's real rows may be fewer)."""
        return cdiv(self.config.vocab_size, self.world_size)

    def rank_slice(self, rank: int) -> RankSlice:
        c, n = self.config, self.world_size
        if not 0 <= rank < n:
            raise ValueError(f"rank must be in [0, {n}), got {rank}")
        group = c.num_heads // c.num_kv_heads
        if c.num_kv_heads >= n:
            kv = even_ranges(c.num_kv_heads, n)[rank]
            q = range(kv.start * group, kv.stop * group)
        else:
            per_head = n // c.num_kv_heads
            head = rank // per_head
            kv = range(head, head + 1)
            q = even_ranges(c.num_heads, n)[rank]
        start = min(rank * self.vocab_shard, c.vocab_size)
        vocab = range(start, min(start + self.vocab_shard, c.vocab_size))
        return RankSlice(rank, q, kv, even_ranges(c.intermediate_size, n)[rank], vocab)

    def local_config(self, rank: int) -> ModelConfig:
        """The config of the layers rank ``rank`` runs: its head counts and MLP width
        (hidden size, vocabulary and everything else as the model's)."""
        if self.world_size == 1:
            return self.config
        part = self.rank_slice(rank)
        return dataclasses.replace(
            self.config,
            num_heads=len(part.q_heads),
            num_kv_heads=len(part.kv_heads),
            intermediate_size=len(part.intermediate),
        )

    @property
    def max_kv_heads(self) -> int:
        """KV heads of the rank holding the most: it sets the pool's blocks per budget."""
        return max(len(self.rank_slice(r).kv_heads) for r in range(self.world_size))
