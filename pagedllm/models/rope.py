"""Rotary position embeddings (RoPE) in the "rotate half" layout.

The rotated part of each head vector (all of it, or its leading ``rotary_dim``
dimensions under partial rotary) is split into halves ``(x1, x2)``; at position ``p``
pair ``i`` is rotated by the angle ``p * inv_freq[i]``:
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
    """Rotation speed of each pair, radians per position, float32 ``[rotary_dim // 2]``,
    computed as transformers computes them (same float32 operations)."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "dynamic":
        # Dynamic NTK only changes the base once a sequence outgrows max_position_embeddings,
        # which the rotary table (and so the engine) never allows: plain RoPE is exact.
        return inv_freq
    if rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_frequencies(config, scaling)
    if rope_type == "longrope":
        # Short factors only: refuse_path_dependent_rope keeps sequences within the
        # original context, where transformers uses them too.
        factors = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (factors * config.rope_theta**exponents)
    if rope_type == "freq_factors":
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    raise ModelLoadError(f"unsupported rope scaling type {rope_type!r}")


def attention_factor(config: ModelConfig) -> float:
    """The factor transformers multiplies ``cos`` and ``sin`` by (YaRN and LongRoPE
    temper attention this way); 1 for the other rope types."""
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    if rope_type == "longrope":
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    return _yarn_mscale(factor)


def refuse_path_dependent_rope(config: ModelConfig) -> None:
    """LongRoPE switches every position of a forward pass to its long factors once the
    pass reaches past ``original_max_position_embeddings``, so a token's rotation would
    depend on how its prompt was chunked; refused unless no sequence can get there."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") != "longrope":
        return
    original = scaling["original_max_position_embeddings"]
    if config.max_position_embeddings > original:
        raise ModelLoadError(
            f"rope_type 'longrope' beyond original_max_position_embeddings={original} "
            f"(max_position_embeddings={config.max_position_embeddings}) is not implemented: "
            "its long factors apply to whole forward passes, not positions"
        )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_frequencies(config: ModelConfig, scaling: dict) -> torch.Tensor:
    """YaRN: fast pairs kept, slow pairs divided by ``factor``, a linear ramp between the
    dimensions that turn ``beta_fast`` and ``beta_slow`` times over the original context."""
    dim, base = config.rotary_dim, config.rope_theta
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or config.max_position_embeddings / original
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does, to avoid dividing by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


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
    """Precomputed ``cos`` and ``sin`` for positions ``[0, max_position_embeddings)``,
    both multiplied by the rope type's :func:`attention_factor`.

    Both tables are ``[max_positions, rotary_dim // 2]`` in the model dtype, on ``device``
    (angles computed there in float32, as transformers does on the model's device).
    """

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> None:
        refuse_path_dependent_rope(config)
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device)
        angles = positions[:, None] * inverse_frequencies(config).to(device)[None, :]
        factor = attention_factor(config)
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        self.cos = cos.to(dtype)
        self.sin = sin.to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin`` rows for ``positions`` ``[T]`` (on the tables' device, or the
        CPU), shaped ``[T, 1, rotary_dim // 2]``, on the tables' device."""
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


def apply_partial_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Rotate the leading ``rotary_dim`` dimensions of every head of ``x`` ``[T, H,
    head_dim]`` and keep the rest as they are; returns a new contiguous tensor."""
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)
