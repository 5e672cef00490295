"""The 4-bit reference codec (pagedllm.kv_storage.int4_codec): round trips within half
a step, keys grouped per channel over exactly their group of tokens, values per token,
and the rotation that leaves scores unchanged."""

from __future__ import annotations

import pytest
import torch

from pagedllm.kv_storage.int4_codec import (
    LEVELS,
    hadamard,
    round_trip_keys,
    round_trip_values,
)


def _bound(x: torch.Tensor, dim: int, levels: int = LEVELS) -> torch.Tensor:
    """Half a step of the group along ``dim``, plus the bfloat16 rounding of its zero
    point (a relative 2^-8) and of the step (rounded up, at most 2^-7 of it per code)."""
    low, high = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    step = (high - low) / levels
    return step * (0.5 + levels * 2**-7) + low.abs() * 2**-8 + 1e-6


@pytest.mark.parametrize("levels", [LEVELS, 7, 31])
def test_values_round_trip_within_half_a_step_of_their_token(levels: int) -> None:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(5, 3, 16, 64, generator=g) * torch.rand(5, 3, 16, 1, generator=g) * 10
    back = round_trip_values(v, levels)
    assert back.dtype == torch.float32 and back.shape == v.shape
    assert ((back - v).abs() <= _bound(v, dim=-1, levels=levels)).all()


def test_each_bit_more_about_halves_the_error() -> None:
    v = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    error = {
        levels: (round_trip_values(v, levels) - v).abs().mean().item() for levels in (7, 15, 31)
    }
    assert 1.7 < error[7] / error[15] < 2.3 and 1.7 < error[15] / error[31] < 2.3


def test_keys_round_trip_per_channel_over_their_group_of_tokens() -> None:
    # channel 7 carries large values in every token, as in real keys; grouped per
    # channel, the other channels keep their own small steps
    k = torch.randn(3, 64, 64, generator=torch.Generator().manual_seed(0))
    k[..., 7] += 40.0
    back = round_trip_keys(k, group_tokens=16)
    groups = k.reshape(3, 4, 16, 64)
    bound = _bound(groups, dim=-2).expand_as(groups).reshape(k.shape)
    assert ((back - k).abs() <= bound).all()
    others = torch.cat([k[..., :7], k[..., 8:]], dim=-1)
    back_others = torch.cat([back[..., :7], back[..., 8:]], dim=-1)
    assert (back_others - others).abs().max() < 0.5  # a per-token step would be ~3


def test_each_key_group_covers_exactly_its_tokens() -> None:
    # groups of 16 tokens, each at its own offset: exact within each group's own range,
    # while one range over 32 tokens would blur the smaller group's values
    k = torch.rand(1, 32, 8, generator=torch.Generator().manual_seed(0))
    k[:, 16:] = k[:, 16:] * 100 + 1000
    back = round_trip_keys(k, group_tokens=16)
    assert (back[:, :16] - k[:, :16]).abs().max() < 1 / LEVELS
    wrong = round_trip_keys(k, group_tokens=32)  # one step of about 73: all code 0
    assert (wrong[:, :16] - k[:, :16]).abs().max() > 5 / LEVELS
    with pytest.raises(ValueError, match="groups of 16"):
        round_trip_keys(torch.zeros(1, 24, 8), group_tokens=16)


def test_constant_groups_decode_exactly() -> None:
    assert torch.equal(round_trip_values(torch.full((4, 64), 0.25)), torch.full((4, 64), 0.25))
    assert torch.equal(round_trip_keys(torch.zeros(2, 16, 64), 16), torch.zeros(2, 16, 64))


def test_the_rotation_is_orthonormal_and_keeps_scores() -> None:
    h = hadamard(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 64, generator=g), torch.randn(7, 64, generator=g)
    assert torch.allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-4)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)
