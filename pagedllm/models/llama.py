"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flattened batch.

Tokens of many sequences arrive concatenated as one ``[num_tokens]`` batch with
their positions; attention is delegated to an :class:`AttentionBackend`, so the
decoder itself holds no KV state. Weights are fused at load time (q/k/v into one
matrix, gate/up into another) so a layer runs three matrix products plus the
output projection.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.attention.backend import AttentionBackend, AttentionOptions
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.fused import rms_norm, silu_and_mul
from pagedllm.models.linear import PackedWeight, Weight, linear, prepare_weight
from pagedllm.models.rope import RotaryTable

# Returns the tensor stored under a Hugging Face parameter name, e.g.
# "model.layers.0.self_attn.q_proj.weight"; raises ModelLoadError when absent.
WeightSource = Callable[[str], torch.Tensor]


class DecoderLayer(nn.Module):
    """One pre-norm block: RMSNorm, attention, residual; RMSNorm, SwiGLU MLP, residual.

    Weights (plain or packed, see :func:`~pagedllm.models.linear.prepare_weight`):
    ``qkv_weight`` ``[q_size + 2 * kv_size, hidden]`` (rows q, then k, then v),
    ``o_weight`` ``[hidden, q_size]``, ``gate_up_weight`` ``[2 * intermediate, hidden]``
    (rows gate, then up), ``down_weight`` ``[hidden, intermediate]``. Buffers: biases of
    the same projections (``qkv_bias``, ``o_bias``, ``gate_up_bias``, ``down_bias``) or
    ``None``, norms ``[hidden]``. ``attention``: this layer's scale and sliding window.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, get: WeightSource) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        windows = config.sliding_windows
        self.attention = AttentionOptions(
            scale=config.head_dim**-0.5, sliding_window=windows[layer_idx] if windows else None
        )
        prefix = f"model.layers.{layer_idx}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        projections = ("q_proj", "k_proj", "v_proj")
        self.register_buffer("input_norm", get(prefix + "input_layernorm.weight"))
        self.qkv_weight: Weight = prepare_weight(
            torch.cat([get(f"{attn}{p}.weight") for p in projections])
        )
        qkv_bias = (
            torch.cat([get(f"{attn}{p}.bias") for p in projections])
            if config.attention_bias
            else None
        )
        self.register_buffer("qkv_bias", qkv_bias)
        self.o_weight: Weight = prepare_weight(get(attn + "o_proj.weight"))
        self.register_buffer("o_bias", get(attn + "o_proj.bias") if config.output_bias else None)
        self.register_buffer("post_norm", get(prefix + "post_attention_layernorm.weight"))
        gate_up = ("gate_proj", "up_proj")
        self.gate_up_weight: Weight = prepare_weight(
            torch.cat([get(f"{mlp}{p}.weight") for p in gate_up])
        )
        self.down_weight: Weight = prepare_weight(get(mlp + "down_proj.weight"))
        mlp_bias = config.mlp_bias
        gate_up_bias = torch.cat([get(f"{mlp}{p}.bias") for p in gate_up]) if mlp_bias else None
        self.register_buffer("gate_up_bias", gate_up_bias)
        self.register_buffer("down_bias", get(mlp + "down_proj.bias") if mlp_bias else None)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryTable,
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Update the residual stream ``hidden`` ``[T, hidden]`` in place and return it;
        with ``output_rows``, return only those rows, whose output projection and MLP
        alone are computed (attention still writes every token's K/V)."""
        c = self.config
        normed = rms_norm(hidden, self.input_norm, c.rms_norm_eps)
        qkv = linear(normed, self.qkv_weight, self.qkv_bias)
        q, k, v = rotary.split_qkv(qkv, positions, c.num_heads, c.num_kv_heads)
        attended = attn.forward(self.layer_idx, q, k, v, metadata, self.attention)
        if output_rows is not None:
            hidden, attended = hidden[output_rows], attended[output_rows]
        hidden += linear(attended.reshape(hidden.shape[0], c.q_size), self.o_weight, self.o_bias)

        normed = rms_norm(hidden, self.post_norm, c.rms_norm_eps)
        activated = silu_and_mul(linear(normed, self.gate_up_weight, self.gate_up_bias))
        hidden += linear(activated, self.down_weight, self.down_bias)
        return hidden


class LlamaDecoder(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final RMSNorm and the LM head.

    All weights share one dtype (float32, bfloat16, or float16 on CUDA) and one device,
    where the rotary tables live too; each source tensor is moved and converted as it is
    read, so no second copy of the whole model is ever built. The LM head is the embedding
    matrix when the config ties them; then one copy is kept, in the LM head's form, and
    embedding lookups read its rows.
    """

    def __init__(
        self,
        config: ModelConfig,
        get: WeightSource,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)

        def get_as_dtype(name: str) -> torch.Tensor:
            return get(name).to(device=self.device, dtype=dtype).contiguous()

        embed = get_as_dtype("model.embed_tokens.weight")
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, get_as_dtype) for i in range(config.num_layers)
        )
        self.register_buffer("final_norm", get_as_dtype("model.norm.weight"))
        if config.tie_word_embeddings:
            self.lm_head = prepare_weight(embed)
            self.embed_tokens: Weight = self.lm_head
        else:
            self.lm_head = prepare_weight(get_as_dtype("lm_head.weight"))
            self.embed_tokens = embed
        self.rotary = RotaryTable(config, dtype, self.device)

    def weights(self) -> list[torch.Tensor]:
        """Every learned tensor the forward pass reads, each once (a tied embedding once,
        packed weights as their padded panels): matrices, norm weights and biases."""
        matrices = [self.embed_tokens, self.lm_head]
        for layer in self.layers:
            matrices += [layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight]
        tensors = [w.panels if isinstance(w, PackedWeight) else w for w in matrices]
        return list({id(t): t for t in (*tensors, *self.buffers())}.values())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[T, hidden_size]`` of ``input_ids`` ``[T]``."""
        if isinstance(self.embed_tokens, PackedWeight):
            return self.embed_tokens.rows(input_ids)
        return F.embedding(input_ids, self.embed_tokens)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states ``[T, hidden_size]`` for tokens ``input_ids`` ``[T]``,
        or only rows ``output_rows`` of them (the last layer then skips the rest).

        ``positions`` ``[T]`` holds each token's 0-based index within its sequence.
        """
        hidden = self.embed(input_ids)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            rows = output_rows if index == last else None
            hidden = layer(hidden, positions, self.rotary, attn, metadata, rows)
        return rms_norm(hidden, self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab_size]`` for the ``N`` hidden rows to be sampled."""
        return linear(hidden, self.lm_head).float()
