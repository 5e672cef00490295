"""The attention backend over a paged :class:`~pagedllm.kv_storage.kv_cache.KVCache` on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.attention.backend import AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.reference import reference_paged_attention
from pagedllm.attention.sdpa_prefill import PrefillChunk, attend_chunk
from pagedllm.cpu import paged_attention, paged_attention_compact, write_kv, write_kv_int8
from pagedllm.cpu.extension import kernels_built
from pagedllm.kv.capacity import cdiv
from pagedllm.kv_storage.compact_blocks import decode_tiles
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_storage.kv_quant import decode_rows, encode_rows


class PagedAttentionBackend:
    """Stores each layer's new K/V in the cache (:meth:`write`, the one K/V write on the
    CPU: the cache only holds the memory, and :class:`~pagedllm.models.layer_stack.LayerStack`
    runs the same C++ write inside its step), then attends through the block tables.

    The engine calls :meth:`forward` once per layer with the same metadata; the int32 /
    int64 contiguous tensors the kernels need are made once per step and reused by
    every layer. Head dims the fast kernel does not take (not a multiple of 16, or above
    256) run through the slow reference instead. Over a cache in another format than the
    model's dtype (float16, int8, fp8, or bfloat16 under a float32 model) the kernel
    decodes K/V itself and takes a float32 query. The C++ kernels are built (or loaded
    from the extension cache) here, so a first step never pays for a compile.

    With ``sdpa_min_rows`` (chosen by :mod:`pagedllm.attention.attention_choice`), a sequence
    running at least that many query rows in a step attends through torch's SDPA over
    its gathered K/V (:mod:`pagedllm.attention.sdpa_prefill`), the other rows through
    the paged kernel; soft-capped layers run every row paged.

    Over an int8 cache keys are stored rotated and queries rotated alike
    (:mod:`pagedllm.kv_storage.key_rotation`), which the kernels never see.

    Over a cache with compact blocks (``kv_cache_dtype="int4"``) every row runs through
    the C++ kernel that reads both kinds (compact keys against the query rotated like
    them, :mod:`pagedllm.kv_storage.compact_blocks`).
    """

    def __init__(self, kv_cache: KVCache, sdpa_min_rows: int | None = None) -> None:
        self.kv_cache = kv_cache
        self.uses_fast_kernel = fast_kernel_takes(kv_cache)
        if sdpa_min_rows is not None:
            reason = sdpa_refusal(kv_cache)
            if reason is not None:
                raise ValueError(f"SDPA prefill cannot run here: {reason}")
        self.sdpa_min_rows = sdpa_min_rows
        self._prepared: dict[int, _Prepared] = {}  # by the id of a step's block tables

    def _prepare(self, metadata: AttentionMetadata) -> _Prepared:
        """Kernel-ready metadata, converted once per step and KV layer group. A step's
        tensors are not modified in place between its layers."""
        source = (
            metadata.slot_mapping,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
        )
        if any(p.source[2] is not metadata.seq_lens for p in self._prepared.values()):
            self._prepared.clear()  # a new step (its groups share their lengths)
        prepared = self._prepared.get(id(metadata.block_tables))
        if prepared is None or any(
            a is not b for a, b in zip(source, prepared.source, strict=True)
        ):
            slot_mapping, block_tables, seq_lens, query_start_loc = source
            tensors = (
                slot_mapping.to(torch.int64).contiguous(),
                block_tables.to(torch.int32).contiguous(),
                seq_lens.to(torch.int32).contiguous(),
                query_start_loc.to(torch.int32).contiguous(),
            )
            prepared = _Prepared(source, tensors, self._split_step(metadata, tensors))
            self._prepared[id(metadata.block_tables)] = prepared
        return prepared

    def kernel_metadata(self, metadata: AttentionMetadata) -> tuple[torch.Tensor, ...]:
        """Slot mapping (int64), block tables, sequence lengths and query starts (int32),
        contiguous, converted once per step."""
        return self._prepare(metadata).tensors

    def routes_to_sdpa(self, metadata: AttentionMetadata) -> bool:
        """Whether some sequence of this step attends through SDPA."""
        return self._prepare(metadata).split is not None

    def _split_step(
        self, metadata: AttentionMetadata, tensors: tuple[torch.Tensor, ...]
    ) -> StepSplit | None:
        """The step's SDPA chunks and the paged kernel's share of it; ``None`` when every
        row runs paged."""
        if self.sdpa_min_rows is None or metadata.max_query_len < self.sdpa_min_rows:
            return None
        _, block_tables, seq_lens, starts = tensors
        bounds, lengths = starts.tolist(), seq_lens.tolist()
        block_size = self.kv_cache.block_size
        chunks, paged = [], []
        for seq, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
            if end - start < self.sdpa_min_rows:
                paged.append(seq)
                continue
            blocks = block_tables[seq, : cdiv(lengths[seq], block_size)].long()
            chunks.append(PrefillChunk(start, end, lengths[seq], blocks))
        if not paged:
            return StepSplit(chunks, None, ())
        rows = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in paged])
        index = torch.tensor(paged)
        paged_starts = torch.zeros(len(paged) + 1, dtype=torch.int32)
        torch.cumsum(starts[index + 1] - starts[index], 0, out=paged_starts[1:])
        return StepSplit(
            chunks, rows, (block_tables[index].contiguous(), seq_lens[index], paged_starts)
        )

    def forward(
        self,
        layer_idx: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        """See :class:`~pagedllm.attention.backend.AttentionBackend`; ``k``, ``v`` are
        stored in the cache's format, the output has ``q``'s dtype."""
        prepared = self._prepare(metadata)
        slot_mapping, block_tables, seq_lens, query_start_loc = prepared.tensors
        self.write(layer_idx, k, v, slot_mapping)
        keys, values = self.kv_cache.key(layer_idx), self.kv_cache.value(layer_idx)
        if self.kv_cache.compact is not None:
            tables = (block_tables, seq_lens, query_start_loc)
            return self._by_age(layer_idx, q, keys, values, tables, metadata, options)
        rotation = self.kv_cache.key_rotation
        if not self.uses_fast_kernel:
            fmt = self.kv_cache.format
            return reference_paged_attention(
                q if rotation is None else (q.float() @ rotation).to(q.dtype),
                decode_rows(keys, fmt), decode_rows(values, fmt), metadata,
                options.scale, options.sliding_window, options.logit_softcap,
            )  # fmt: skip
        # The kernel takes a float32 query, or a bfloat16 one over a bfloat16 cache.
        same_bf16 = q.dtype == keys.dtype == torch.bfloat16
        query = q if q.dtype == torch.float32 or same_bf16 else q.float()
        if rotation is not None:
            query = query @ rotation
        query = query.contiguous()
        out = torch.empty_like(query)
        split = prepared.split if options.logit_softcap is None else None
        if split is None:
            tables = (block_tables, seq_lens, query_start_loc)
            self._paged(out, query, keys, values, tables, options)
            return out.to(q.dtype)
        if split.paged_rows is not None:
            paged_query = query[split.paged_rows]
            paged_out = torch.empty_like(paged_query)
            self._paged(paged_out, paged_query, keys, values, split.paged_tables, options)
            out[split.paged_rows] = paged_out
        for chunk in split.chunks:
            out[chunk.start : chunk.end] = attend_chunk(query, keys, values, chunk, options)
        return out.to(q.dtype)

    def _by_age(
        self,
        layer_idx: int,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        metadata: AttentionMetadata,
        options: AttentionOptions,
    ) -> torch.Tensor:
        """Attention over full-size and compact blocks: the C++ kernel, or without it
        the reference over every block decoded."""
        cache = self.kv_cache
        compact = cache.compact
        query = q.float().contiguous()
        rotated = (query @ hadamard(cache.head_dim)).contiguous()
        if cache.key_rotation is not None:  # full blocks hold keys rotated alike
            query = rotated
        if not self.uses_fast_kernel:
            fmt = cache.format
            compact_keys, compact_values = decode_tiles(
                compact.tiles(layer_idx), cache.block_size, cache.head_dim,
                unrotate=cache.key_rotation is None,
            )  # fmt: skip
            all_keys = torch.cat([decode_rows(keys, fmt), compact_keys])
            all_values = torch.cat([decode_rows(values, fmt), compact_values])
            return reference_paged_attention(
                query, all_keys, all_values, metadata, options.scale, options.sliding_window,
                options.logit_softcap,
            ).to(q.dtype)  # fmt: skip
        out = torch.empty_like(query)
        paged_attention_compact(
            out, query, rotated, keys, values, compact.tiles(layer_idx), cache.compact_offset,
            *tables, options.scale, options.sliding_window or 0, options.logit_softcap or 0.0,
        )  # fmt: skip
        return out.to(q.dtype)

    def write(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Stores token ``i`` of ``k``, ``v`` ``[num_tokens, num_kv_heads, head_dim]`` (any
        float dtype; converted or quantized to the cache's format here) at slot
        ``slot_mapping[i]`` (int64) of layer ``layer_idx``, all tokens in one call; slots
        equal to ``-1`` are skipped."""
        cache = self.kv_cache
        if cache.key_rotation is not None:
            k = k.float() @ cache.key_rotation
        keys, values = cache.stored_key(layer_idx), cache.stored_value(layer_idx)
        if cache.format.name == "int8" and kernels_built():  # quantized as written, in C++
            write_kv_int8(keys, values, k, v, slot_mapping)
            return
        write_kv(
            keys, values, encode_rows(k, cache.format).contiguous(),
            encode_rows(v, cache.format).contiguous(), slot_mapping,
        )  # fmt: skip

    @staticmethod
    def _paged(
        out: torch.Tensor,
        query: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        tables: tuple[torch.Tensor, ...],
        options: AttentionOptions,
    ) -> None:
        """The C++ kernel over ``tables`` = (block tables, sequence lengths, query starts)."""
        paged_attention(
            out, query, keys, values, *tables, options.scale, options.sliding_window or 0,
            options.logit_softcap or 0.0,
        )  # fmt: skip


def fast_kernel_takes(kv_cache: KVCache) -> bool:
    """Whether the C++ kernel takes ``kv_cache``'s head dim (built or loaded here)."""
    return kv_cache.head_dim % 16 == 0 and kv_cache.head_dim <= 256 and kernels_built()


def sdpa_refusal(kv_cache: KVCache) -> str | None:
    """Why chunks over ``kv_cache`` cannot attend through SDPA; ``None`` when they can (a
    float32 or bfloat16 cache on the CPU, in the model's dtype, which the caller
    checks, and the C++ paged kernel for the other rows)."""
    fmt = kv_cache.format
    if kv_cache.compact is not None:
        return "the KV cache keeps old blocks in 4 bits (int4), which only the paged kernel reads"
    if kv_cache.tensor.device.type != "cpu":
        return f"the KV cache is on {kv_cache.tensor.device.type}, not the CPU"
    if fmt.quantized or fmt.dtype not in (torch.float32, torch.bfloat16):
        return f"the KV cache holds {fmt.name}, not float32 or bfloat16"
    if not fast_kernel_takes(kv_cache):
        return "the C++ paged kernel, which runs the other rows, does not take this cache"
    return None


@dataclass(frozen=True)
class _Prepared:
    """One step's metadata of one KV layer group as given (``source``), converted for
    the kernels (``tensors``), and its SDPA ``split``."""

    source: tuple[torch.Tensor, ...]
    tensors: tuple[torch.Tensor, ...]
    split: StepSplit | None


@dataclass(frozen=True)
class StepSplit:
    """A step whose long chunks run through SDPA: ``chunks``, and the rows of the other
    sequences (``paged_rows``, ``None`` when there are none) with their block tables,
    lengths and query starts renumbered from 0 (``paged_tables``)."""

    chunks: list[PrefillChunk]
    paged_rows: torch.Tensor | None
    paged_tables: tuple[torch.Tensor, ...]
