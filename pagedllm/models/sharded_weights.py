"""One rank's slice of every tensor the decoder reads (Megatron-style column and row
parallelism), as a weight source over the whole checkpoint's.

Column-parallel (output rows split): q/k/v and their biases by the rank's query and KV
heads, gate/up and their biases by its intermediate range, the embedding and LM head by
its vocabulary shard (padded with zero rows to the shard size, so that every rank's
logits have one width). Row-parallel (input columns split): the output projection by
the rank's query heads, down by its intermediate range; their biases stay whole, added
once after the all-reduce. Per-head q/k norms follow the heads; everything else
(norms, learned positions) is replicated.

A quantized matrix is cut along its blocks: rows always cut cleanly; a column range that
does not fall on block boundaries (K-quants hold 256 weights per block) is dequantized
first, with one log line per matrix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from pagedllm.models.partition import RankSlice, TensorPartition
from pagedllm.models.quantized_weight import QuantizedWeight, pad_rows, slice_columns, slice_rows

logger = logging.getLogger("pagedllm")

Tensor = torch.Tensor | QuantizedWeight


def _rows(weight: Tensor, ranges: list[range]) -> Tensor:
    """The rows of ``ranges``, one after another."""
    if isinstance(weight, QuantizedWeight):
        parts = [slice_rows(weight, r) for r in ranges]
        blocks = torch.cat([p.blocks for p in parts])
        return QuantizedWeight(blocks, weight.ggml_type, weight.in_features)
    return torch.cat([weight[r.start : r.stop] for r in ranges])


def _columns(name: str, weight: Tensor, columns: range) -> Tensor:
    if isinstance(weight, QuantizedWeight):
        sliced = slice_columns(weight, columns)
        if sliced is not None:
            return sliced
        logger.info(
            "%s: columns %d-%d do not fall on %s block boundaries; this rank holds them "
            "dequantized",
            name,
            columns.start,
            columns.stop,
            weight.ggml_type.name,
        )
        weight = weight.dequantized()
    return weight[:, columns.start : columns.stop]


def _pad_rows(weight: Tensor, num_rows: int) -> Tensor:
    if isinstance(weight, QuantizedWeight):
        return pad_rows(weight, num_rows)
    missing = num_rows - weight.shape[0]
    if missing <= 0:
        return weight
    return torch.cat([weight, weight.new_zeros(missing, *weight.shape[1:])])


class ShardedWeights:
    """The weight source of rank ``rank`` over ``get``, the whole model's (names as the
    decoder reads them: Hugging Face Llama-style, q/k/v stacked in ``qkv_proj`` rows)."""

    def __init__(
        self, get: Callable[[str], Tensor], partition: TensorPartition, rank: int
    ) -> None:
        self.get = get
        self.partition = partition
        self.part: RankSlice = partition.rank_slice(rank)
        dim = partition.config.head_dim
        part = self.part
        self.q_rows = range(part.q_heads.start * dim, part.q_heads.stop * dim)
        self.kv_rows = range(part.kv_heads.start * dim, part.kv_heads.stop * dim)

    def __call__(self, name: str) -> Tensor:
        weight = self.get(name)
        c, part = self.partition.config, self.part
        leaf = name.rsplit(".", 2)
        module = leaf[-2] if len(leaf) >= 2 else ""
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = _rows(weight, [part.vocab])
            return _pad_rows(rows, self.partition.vocab_shard)
        if not name.startswith("model.layers."):
            return weight
        if module == "q_proj":
            return _rows(weight, [self.q_rows])
        if module in ("k_proj", "v_proj"):
            return _rows(weight, [self.kv_rows])
        if module == "qkv_proj":
            q, kv = c.q_size, c.kv_size
            k_rows = range(q + self.kv_rows.start, q + self.kv_rows.stop)
            v_rows = range(q + kv + self.kv_rows.start, q + kv + self.kv_rows.stop)
            return _rows(weight, [self.q_rows, k_rows, v_rows])
        if module in ("gate_proj", "up_proj"):
            return _rows(weight, [part.intermediate])
        if module == "gate_up_proj":
            width, own = c.intermediate_size, part.intermediate
            return _rows(weight, [own, range(width + own.start, width + own.stop)])
        if name.endswith("o_proj.weight"):
            return _columns(name, weight, self.q_rows)
        if name.endswith("down_proj.weight"):
            return _columns(name, weight, part.intermediate)
        if module in ("q_norm", "k_norm") and weight.dim() == 2:  # one row per head
            heads = part.q_heads if module == "q_norm" else part.kv_heads
            return weight[heads.start : heads.stop]
        return weight
