"""Rotary position embeddings (RoPE) in the "rotate half" layout.

Each head vector of width ``head_dim`` is split into halves ``(x1, x2)``; at
position ``p`` pair ``i`` is rotated by the angle ``p * inv_freq[i]``:
``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``. This is the layout Hugging Face
checkpoints use; GGUF loaders undo llama.cpp's interleaved row order before the
weights reach the decoder.
"""

from __future__ import annotations

import math

import torch

from pagedllm.cpu.extension import fits_avx512_kernels, rotary
from pagedllm.models.config import ModelConfig
from pagedllm.models.errors import ModelLoadError


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """Rotation speed of each pair, radians per position, float32 ``[head_dim // 2]``."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3.1 scaling: slow pairs divided by ``factor``, fast pairs kept, a blend between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_context = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    slow = wavelength > original_context / low
    fast = wavelength < original_context / high
    blend = (original_context / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    scaled = torch.where(slow, inv_freq / factor, blended)
    return torch.where(fast, inv_freq, scaled)


class RotaryTable:
    """Precomputed ``cos`` and ``sin`` for positions ``[0, max_position_embeddings)``.

    Both tables are ``[max_positions, head_dim // 2]`` in the model dtype, on ``device``
    (angles computed there in float32, as transformers does on the model's device).
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        angles = positions[:, None] * inverse_frequencies(config).to(device)[None, :]
        self.cos = angles.cos().to(dtype)
        self.sin = angles.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` rows for ``positions`` ``[T]`` (on the tables' device, or the
        CPU), shaped ``[T, 1, head_dim // 2]``, on the tables' device."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def split_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, num_q_heads: int, num_kv_heads: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``qkv`` ``[T, (Hq + 2 Hkv) * head_dim]`` (q, then k, then v) into new
        contiguous ``q`` ``[T, Hq, head_dim]``, ``k`` and ``v`` ``[T, Hkv, head_dim]``, with
        q and k rotated to their tokens' ``positions`` (int64 ``[T]``)."""
        if fits_avx512_kernels(qkv, self.cos) and positions.dtype == torch.int64:
            return rotary(
                qkv, positions.contiguous(), self.cos, self.sin, num_q_heads, num_kv_heads
            )
        num_tokens, head_dim = qkv.shape[0], qkv.shape[1] // (num_q_heads + 2 * num_kv_heads)
        q_end, k_end = num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
        cos, sin = self.lookup(positions)
        q = apply_rope(qkv[:, :q_end].view(num_tokens, num_q_heads, head_dim), cos, sin)
        k = apply_rope(qkv[:, q_end:k_end].view(num_tokens, num_kv_heads, head_dim), cos, sin)
        v = qkv[:, k_end:].reshape(num_tokens, num_kv_heads, head_dim)
        return q, k, v


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate every head of ``x`` ``[T, H, head_dim]``; returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out[..., :half], out[..., half:]
    # Separate multiply and add (no fused multiply-add) round exactly as transformers does.
    torch.mul(x1, cos, out=out1)
    out1.sub_(x2 * sin)
    torch.mul(x2, cos, out=out2)
    out2.add_(x1 * sin)
    return out
