"""4-bit K/V codes with a scale and a zero point per group (the reference codec).

A group of values ``x`` is stored as codes ``c = round((x - zero) / scale)`` in 0..L
(``L = 2^bits - 1``, LEVELS = 15 by default), ``zero = min(x)`` and ``scale = (max(x) -
min(x)) / L``, both kept as bfloat16 (the codes are computed against the stored, rounded
parameters, so decoding ``zero + c * scale`` is within half a step of ``x`` but for the
rounding of ``zero``). Which values share a group differs for keys and values, as
KIVI found works best:

- keys: per channel, over ``group_tokens`` consecutive tokens of one KV head (a few
  channels carry large values in every token; a per-token scale would spend its 16
  levels on them);
- values: per token, over the ``head_dim`` channels of one KV head.

An optional rotation (an orthonormal Hadamard matrix over ``head_dim``, applied to keys
before quantizing and to queries alike, so scores are unchanged) spreads a few large
channels over all of them before the keys are grouped.
"""

from __future__ import annotations

import functools
import math

import torch

LEVELS = 15  # the largest code


def quantize_groups(
    x: torch.Tensor, dim: int, levels: int = LEVELS
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (uint8, 0..``levels``), scale and zero (bfloat16, kept dims) of ``x`` grouped
    along ``dim``."""
    x = x.float()
    low = x.amin(dim=dim, keepdim=True)
    high = x.amax(dim=dim, keepdim=True)
    zero = low.to(torch.bfloat16)
    exact = ((high - zero.float()) / levels).clamp_min(1e-30)
    scale = exact.to(torch.bfloat16)
    # round the step up, so that the largest value needs no code above `levels`
    scale = torch.where(
        scale.float() < exact, (scale.view(torch.int16) + 1).view(scale.dtype), scale
    )
    codes = ((x - zero.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    return codes, scale, zero


def _dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return zero.float() + codes.float() * scale.float()


def round_trip_keys(k: torch.Tensor, group_tokens: int, levels: int = LEVELS) -> torch.Tensor:
    """``k`` ``[..., tokens, head_dim]`` (tokens a multiple of ``group_tokens``) after
    encoding per channel in groups of ``group_tokens`` tokens into codes 0..``levels``
    and decoding (float32)."""
    *lead, tokens, dim = k.shape
    if tokens % group_tokens:
        raise ValueError(f"{tokens} tokens do not split into groups of {group_tokens}")
    grouped = k.reshape(*lead, tokens // group_tokens, group_tokens, dim)
    return _dequantize(*quantize_groups(grouped, dim=-2, levels=levels)).reshape(k.shape)


def round_trip_values(v: torch.Tensor, levels: int = LEVELS) -> torch.Tensor:
    """``v`` ``[..., head_dim]`` after encoding per token into codes 0..``levels`` and
    decoding (float32)."""
    return _dequantize(*quantize_groups(v, dim=-1, levels=levels))


@functools.cache
def hadamard(head_dim: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix of order ``head_dim`` (a power of two), float32."""
    if head_dim < 1 or head_dim & (head_dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {head_dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], dim=1), torch.cat([h, -h], dim=1)], dim=0)
    return h / math.sqrt(head_dim)
