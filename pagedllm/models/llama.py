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

from pagedllm.attention.backend import AttentionBackend
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.models.config import ModelConfig
from pagedllm.models.linear import linear
from pagedllm.models.rope import RotaryTable, apply_rope

# Returns the tensor stored under a Hugging Face parameter name, e.g.
# "model.layers.0.self_attn.q_proj.weight"; raises ModelLoadError when absent.
WeightSource = Callable[[str], torch.Tensor]


class DecoderLayer(nn.Module):
    """One pre-norm block: RMSNorm, attention, residual; RMSNorm, SwiGLU MLP, residual.

    Buffers: ``qkv_weight`` ``[q_size + 2 * kv_size, hidden]`` (rows q, then k,
    then v), ``qkv_bias`` the matching ``[q_size + 2 * kv_size]`` or ``None``,
    ``o_weight`` ``[hidden, q_size]``, ``gate_up_weight`` ``[2 * intermediate, hidden]``
    (rows gate, then up), ``down_weight`` ``[hidden, intermediate]``, norms ``[hidden]``.
    """

    def __init__(self, config: ModelConfig, layer_idx: int, get: WeightSource) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.config = config
        self.scale = config.head_dim**-0.5
        prefix = f"model.layers.{layer_idx}."
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        projections = ("q_proj", "k_proj", "v_proj")
        self.register_buffer("input_norm", get(prefix + "input_layernorm.weight"))
        self.register_buffer(
            "qkv_weight", torch.cat([get(f"{attn}{p}.weight") for p in projections])
        )
        qkv_bias = (
            torch.cat([get(f"{attn}{p}.bias") for p in projections])
            if config.attention_bias
            else None
        )
        self.register_buffer("qkv_bias", qkv_bias)
        self.register_buffer("o_weight", get(attn + "o_proj.weight"))
        self.register_buffer("post_norm", get(prefix + "post_attention_layernorm.weight"))
        self.register_buffer(
            "gate_up_weight",
            torch.cat([get(mlp + "gate_proj.weight"), get(mlp + "up_proj.weight")]),
        )
        self.register_buffer("down_weight", get(mlp + "down_proj.weight"))

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        metadata: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Update the residual stream ``hidden`` ``[T, hidden]`` in place and return it;
        with ``output_rows``, return only those rows, whose output projection and MLP
        alone are computed (attention still writes every token's K/V)."""
        c = self.config
        num_tokens = hidden.shape[0]
        normed = F.rms_norm(hidden, (c.hidden_size,), self.input_norm, c.rms_norm_eps)
        qkv = linear(normed, self.qkv_weight, self.qkv_bias)
        q_end, k_end = c.q_size, c.q_size + c.kv_size
        q = apply_rope(qkv[:, :q_end].view(num_tokens, c.num_heads, c.head_dim), cos, sin)
        k = apply_rope(qkv[:, q_end:k_end].view(num_tokens, c.num_kv_heads, c.head_dim), cos, sin)
        v = qkv[:, k_end:].reshape(num_tokens, c.num_kv_heads, c.head_dim)
        attended = attn.forward(self.layer_idx, q, k, v, metadata, self.scale)
        if output_rows is not None:
            hidden, attended = hidden[output_rows], attended[output_rows]
            num_tokens = hidden.shape[0]
        hidden += linear(attended.reshape(num_tokens, c.q_size), self.o_weight)

        normed = F.rms_norm(hidden, (c.hidden_size,), self.post_norm, c.rms_norm_eps)
        gate_up = linear(normed, self.gate_up_weight)
        gate = F.silu(gate_up[:, : c.intermediate_size])
        gate *= gate_up[:, c.intermediate_size :]
        hidden += linear(gate, self.down_weight)
        return hidden


class LlamaDecoder(nn.Module):
    """Embedding, ``num_layers`` decoder layers, final RMSNorm and the LM head.

    All buffers share one dtype (float32 or bfloat16); ``lm_head`` is ``None``
    when the config ties it to the embedding matrix.
    """

    def __init__(self, config: ModelConfig, get: WeightSource, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config

        def get_as_dtype(name: str) -> torch.Tensor:
            return get(name).to(dtype).contiguous()

        self.register_buffer("embed_tokens", get_as_dtype("model.embed_tokens.weight"))
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, get_as_dtype) for i in range(config.num_layers)
        )
        self.register_buffer("final_norm", get_as_dtype("model.norm.weight"))
        lm_head = None if config.tie_word_embeddings else get_as_dtype("lm_head.weight")
        self.register_buffer("lm_head", lm_head)
        self.rotary = RotaryTable(config, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

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
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.lookup(positions)
        last = len(self.layers) - 1
        for index, layer in enumerate(self.layers):
            rows = output_rows if index == last else None
            hidden = layer(hidden, cos, sin, attn, metadata, rows)
        c = self.config
        return F.rms_norm(hidden, (c.hidden_size,), self.final_norm, c.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab_size]`` for the ``N`` hidden rows to be sampled."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return linear(hidden, head).float()
