"""The decoder layers as one C++ call per step (``pagedllm/cpu/layer_stack.cpp``).

A one-sequence decode step of a small model runs ~11 operators per layer whose kernels
take microseconds; calling them one by one from Python cost about as much as the
kernels themselves. For the common pre-norm architecture (RMSNorm, q/k/v with RoPE over
the whole head and no q/k norm, gated SiLU MLP, plain residual adds: Llama, Mistral,
Qwen2, SmolLM2, ...) the stack runs every layer in C++ with the same kernels in the same
order, so its results are bit for bit those of :class:`~pagedllm.models.decoder.DecoderLayer`.
Layers of several kinds (KV layer groups, :mod:`pagedllm.kv.layer_groups`) each write
and read through their own group's slot mapping and block tables. A cache whose old
blocks are 4-bit (``kv_cache_dtype="int4"``) runs the by-age kernel
in the stack as the paged backend does. Any other architecture, cache format or CPU runs
layer by layer; so does ``enforce_eager=True``.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.paged_backend import PagedAttentionBackend
from pagedllm.cpu.extension import avx512_kernels_available, ops
from pagedllm.kv_storage.int4_codec import hadamard
from pagedllm.models.block_expansion import ExpandedBlocks
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.linear import OneDNNWeight, PackedWeight, Weight
from pagedllm.models.quantized_weight import QuantizedWeight

logger = logging.getLogger("pagedllm")

# Matrix kinds of layer_stack.cpp's MatrixKind.
DENSE, PACKED, BLOCKS, INTERLEAVED, INTERLEAVED_INT8, ONEDNN = range(6)


def unsupported_reason(model: torch.nn.Module, attn: object) -> str | None:
    """Why ``model`` (a :class:`~pagedllm.models.decoder.CausalDecoder`) cannot run its
    layers as one stack over ``attn``; None when it can."""
    c = model.config
    checks = [
        (isinstance(attn, PagedAttentionBackend) and attn.uses_fast_kernel,
         "attention is not the C++ paged kernel"),
        (model.device.type == "cpu" and avx512_kernels_available(),
         "the CPU kernels need AVX-512"),
        (model.dtype in (torch.float32, torch.bfloat16), "dtype is not float32 or bfloat16"),
        (model.parallel is None, "tensor parallelism"),
        (c.spec.norm == "rms" and c.norm_layout == "pre", "not a pre-norm RMSNorm layout"),
        (not c.qk_norm, "q/k norms"),
        (model.rotary is not None and model.local_rotary is None
         and c.rotary_dim == c.head_dim, "not RoPE over whole heads"),
        (c.clip_qkv is None and c.residual_multiplier == 1.0, "clipped q/k/v or scaled residuals"),
        (c.spec.gated_mlp and c.hidden_act == "silu", "not a gated SiLU MLP"),
        (all(layer.moe is None for layer in model.layers), "mixture-of-experts layers"),
    ]  # fmt: skip
    for holds, reason in checks:
        if not holds:
            return reason
    fmt = attn.kv_cache.format
    if not fmt.quantized and fmt.dtype != model.dtype:
        return "the KV cache's format is neither the model's dtype nor int8 or fp8"
    return None


def _matrix(weight: Weight) -> tuple[int, torch.Tensor, int, int]:
    """(kind, tensor, ggml type, out_features) of a layer's weight (of its blocks, for
    one with an expanded copy)."""
    if isinstance(weight, ExpandedBlocks):
        return _matrix(weight.blocks)
    if isinstance(weight, InterleavedWeight):
        kind = INTERLEAVED_INT8 if weight.int8_activations else INTERLEAVED
        return kind, weight.blocks, int(weight.ggml_type), weight.out_features
    if isinstance(weight, QuantizedWeight):
        return BLOCKS, weight.blocks, int(weight.ggml_type), weight.out_features
    if isinstance(weight, PackedWeight):
        return PACKED, weight.panels, 0, weight.out_features
    if isinstance(weight, OneDNNWeight):
        return ONEDNN, weight.reordered, 0, weight.out_features
    return DENSE, weight, 0, weight.shape[0]


class LayerStack:
    """Every layer of ``model`` over ``attn``'s KV cache, run by one C++ call; build it
    with :meth:`build`, which returns None (and logs why) when the model or the cache is
    not of the kind it runs. It is the paged backend's own path run across the layers:
    each layer's new K/V go through the C++ ``write_kv`` (``write_kv_int8`` over an int8
    cache, keys rotated first; over an fp8 cache encoded first, by the operations of
    :func:`~pagedllm.kv_storage.kv_quant.encode_rows`) that
    :meth:`~pagedllm.attention.paged_backend.PagedAttentionBackend.write` calls, into
    the cache's per-layer views (a cache in the model's dtype, int8 or fp8)."""

    def __init__(
        self,
        model: torch.nn.Module,
        attn: PagedAttentionBackend,
        layer_groups: tuple[int, ...] = (),
    ) -> None:
        """``layer_groups``: each layer's KV layer group (empty: every layer in group 0)."""
        c = model.config
        self.attn = attn
        ops()  # builds or loads the extension, which registers the class
        self._stack = torch.classes.pagedllm_cpu.LayerStack(
            c.num_heads, c.num_kv_heads, c.rms_norm_eps, model.rotary.cos, model.rotary.sin
        )
        cache = attn.kv_cache
        layer_groups = layer_groups or (0,) * len(model.layers)
        self._groups = 1 + max(layer_groups)  # KV layer groups
        rotation = hadamard(cache.head_dim) if cache.compact is not None else None
        if cache.format.name == "int8":
            self._stack.set_int8_cache(cache.key_rotation)
        elif cache.format.quantized:  # fp8
            self._stack.set_fp8_cache(cache.format.max_code)
        for index, layer in enumerate(model.layers):
            options = layer.attention
            self._stack.add_layer(
                layer.input_layernorm,
                layer.post_attention_layernorm,
                cache.key(index),
                cache.value(index),
                options.scale,
                options.sliding_window or 0,
                options.logit_softcap or 0.0,
                layer_groups[index],
            )
            if rotation is not None:  # old blocks are 4-bit: the by-age kernel reads both
                self._stack.add_compact(cache.compact.tiles(index), cache.compact_offset, rotation)
            for weight, bias in (
                (layer.qkv_weight, layer.qkv_bias),
                (layer.o_weight, layer.o_bias),
                (layer.gate_up_weight, layer.gate_up_bias),
                (layer.down_weight, layer.down_bias),
            ):
                self._stack.add_matrix(*_matrix(weight), bias)
                if isinstance(weight, ExpandedBlocks):
                    kind, data, _, out_features = _matrix(weight.expanded)
                    self._stack.add_expanded(kind, data, out_features, bias, weight.min_rows)

    @classmethod
    def build(
        cls, model: torch.nn.Module, attn: object, layer_groups: tuple[int, ...] = ()
    ) -> LayerStack | None:
        reason = unsupported_reason(model, attn)
        if reason is not None:
            logger.info("Decoder layers run one by one: %s", reason)
            return None
        logger.info("Decoder layers run as one C++ call per step")
        return cls(model, attn, layer_groups)

    def set_profiling(self, on: bool) -> None:
        """Whether each forward pass adds its phases' wall time to :meth:`phase_seconds`
        (reset when turned on)."""
        if on:
            self._stack.reset_phases()
        self._stack.set_profiling(on)

    def phase_seconds(self) -> dict[str, float]:
        """Seconds of every layer's products, attention, K/V writes, norms, rotary,
        activation, residual adds and copies since profiling was turned on, and the
        number of ``steps`` they cover. Fused passes count once: over a cache in the
        model's dtype the K/V write is in ``rotary``; every residual add but the last
        layer's is in ``norms`` (the norm after it)."""
        return dict(self._stack.phases())

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """What the layers make of ``hidden`` ``[T, hidden_size]`` (updated in place) at
        ``positions`` (int64 ``[T]``): every row, or only ``output_rows`` after the last
        layer's attention (as :meth:`~pagedllm.models.decoder.DecoderLayer.forward`)."""
        groups = [self.attn.kernel_metadata(metadata.for_group(g)) for g in range(self._groups)]
        _, _, seq_lens, starts = groups[0]
        return self._stack.forward(
            hidden.contiguous(),
            positions.contiguous(),
            [slots for slots, *_ in groups],
            [tables for _, tables, *_ in groups],
            seq_lens,
            starts,
            output_rows,
        )
