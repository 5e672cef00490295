"""The fused RMSNorm, SiLU·mul and rotary kernels against the operations of transformers'
Llama modules: float32 to rounding, bfloat16 bit for bit (the kernels round where the
modules round), rotary bit for bit in both (no fused multiply-add); the residual add
fused into the norm bit for bit against the two run apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import (
    add_rms_norm,
    avx512_kernels_available,
    rms_norm,
    rotary,
    rotary_to_cache,
    silu_and_mul,
    write_kv,
)
from pagedllm.models import fused
from pagedllm.models.rope import apply_rope

pytestmark = pytest.mark.skipif(
    not avx512_kernels_available(), reason="the elementwise kernels need AVX-512"
)

DTYPES = [torch.float32, torch.bfloat16]


def transformers_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm.forward: float32 statistics, the normed value cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 40, 7])
def test_rms_norm(dtype, dim):
    generator = torch.Generator().manual_seed(dim)
    x = (3 * torch.randn(33, dim, generator=generator)).to(dtype)
    weight = torch.randn(dim, generator=generator).to(dtype)
    ours, reference = rms_norm(x, weight, 1e-5), transformers_rms_norm(x, weight, 1e-5)
    if dtype == torch.bfloat16:
        assert torch.equal(ours, reference)
    else:  # the sum of squares is taken in another order
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dim", [576, 7])
def test_rms_norm_of_a_float32_residual_stream_rounds_once(dim):
    """float32 x under a bfloat16 weight: normed in float32, the product rounded once."""
    generator = torch.Generator().manual_seed(dim)
    x = 3 * torch.randn(33, dim, generator=generator)
    weight = torch.randn(dim, generator=generator).bfloat16()
    ours = rms_norm(x, weight, 1e-5)
    exact = (x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
             * weight.double())  # fmt: skip
    assert ours.dtype == torch.bfloat16
    # within one bfloat16 rounding of the exact value, and mostly the exact value rounded
    assert ((ours.double() - exact).abs() <= 2.0**-8 * exact.abs() * (1 + 1e-5)).all()
    assert (ours == exact.float().bfloat16()).float().mean() > 0.99
    # unlike the bfloat16 kernel, which rounds the normed value before the weight
    assert not torch.equal(ours, rms_norm(x.bfloat16(), weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [576, 40, 7])
def test_add_rms_norm_has_the_bits_of_the_add_then_the_norm(dtype, dim):
    """A float32 residual stream plus a branch of the model's dtype, then the norm: the
    stream and the normed rows equal ``hidden.add_(branch)`` and :func:`rms_norm` bit for
    bit (rows 0 and 1 stay on one thread, 3,000 rows split between threads)."""
    for rows in (1, 2, 3000):
        generator = torch.Generator().manual_seed(dim + rows)
        hidden = 3 * torch.randn(rows, dim, generator=generator)
        branch = torch.randn(rows, dim, generator=generator).to(dtype)
        weight = torch.randn(dim, generator=generator).to(dtype)
        expected_hidden = hidden.clone().add_(branch)
        expected = rms_norm(expected_hidden, weight, 1e-5)
        ours = add_rms_norm(hidden, branch, weight, 1e-5)
        assert ours.dtype == dtype
        assert torch.equal(hidden, expected_hidden)
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layers_add_then_norm_takes_the_kernel_or_torch_to_the_same_bits(dtype):
    """``fused.add_rms_norm``: a contiguous branch takes the kernel, a strided one the add
    and the norm apart; stream and normed rows agree bit for bit."""
    generator = torch.Generator().manual_seed(3)
    hidden = 3 * torch.randn(9, 576, generator=generator)
    wide = torch.randn(9, 2 * 576, generator=generator).to(dtype)
    weight = torch.randn(576, generator=generator).to(dtype)
    apart_hidden = hidden.clone()
    apart = fused.add_rms_norm(apart_hidden, wide[:, ::2], weight, 1e-5)  # strided: torch
    ours = fused.add_rms_norm(hidden, wide[:, ::2].contiguous(), weight, 1e-5)
    assert torch.equal(hidden, apart_hidden)
    assert torch.equal(ours, apart)


def test_bfloat16_rounding_keeps_subnormals_and_quiets_nan():
    """The products weight x normed land on bfloat16 subnormals, ties, infinity and NaN:
    every number rounds to torch's bits and every NaN stays NaN, whichever conversion the
    kernel takes."""
    dim = 64
    x = torch.ones(4, dim, dtype=torch.bfloat16)
    weight = torch.full((dim,), 3e-39).to(torch.bfloat16)  # subnormal products
    weight[1::4] = torch.tensor([1.0 + 2**-8, 3e38, -3e38, 1e-45]).repeat(dim // 16)[: dim // 4]
    weight[::16] = float("nan")
    x[1] = 1.5  # every product of row 1 away from the subnormals: the native conversion
    x[2, :16] = float("nan")
    reference = transformers_rms_norm(x, weight, 1e-5)
    ours = rms_norm(x, weight, 1e-5)
    nan = reference.isnan()
    assert torch.equal(ours.isnan(), nan) and nan[2].all()
    assert torch.equal(ours.view(torch.int16)[~nan], reference.view(torch.int16)[~nan])
    assert (reference[0].abs() < torch.finfo(torch.bfloat16).tiny).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 9])
def test_silu_and_mul(dtype, width):
    generator = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(17, 2 * width, generator=generator)).to(dtype)
    ours = silu_and_mul(gate_up)
    reference = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    if dtype == torch.bfloat16:
        assert torch.equal(ours, reference)
    else:  # exp is a polynomial here, Sleef's in torch
        torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-30)


def test_silu_at_the_edges_of_exp():
    edges = [-200.0, -100.0, -88.0, -1.0, 0.0, 1.0, 88.0, 100.0, 200.0]
    gate = torch.tensor(edges + [float("inf"), float("-inf"), float("nan")])
    gate_up = torch.cat([gate, torch.ones_like(gate)])[None]
    ours = silu_and_mul(gate_up)[0]
    torch.testing.assert_close(ours, F.silu(gate), rtol=1e-6, atol=1e-30, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_splits_and_rotates_exactly_like_separate_operators(dtype):
    generator = torch.Generator().manual_seed(0)
    tokens, q_heads, kv_heads, head_dim = 21, 9, 3, 64
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(dtype)
    angles = torch.arange(100.0)[:, None] * torch.rand(head_dim // 2, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=generator)
    q, k, v = rotary(qkv, positions, cos, sin, q_heads, kv_heads)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q_end, k_end = q_heads * head_dim, (q_heads + kv_heads) * head_dim
    assert torch.equal(q, apply_rope(qkv[:, :q_end].view(tokens, q_heads, head_dim), c, s))
    assert torch.equal(k, apply_rope(qkv[:, q_end:k_end].view(tokens, kv_heads, head_dim), c, s))
    assert torch.equal(v, qkv[:, k_end:].reshape(tokens, kv_heads, head_dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("token_major", [False, True], ids=["head_major", "token_major"])
def test_rotary_to_cache_writes_the_bits_of_rotary_then_write_kv(dtype, token_major):
    """q returned, k and v in their slots of both caches (a skipped slot, a token-major
    cache seen through a permuted view), every other byte of the caches untouched."""
    generator = torch.Generator().manual_seed(7)
    tokens, q_heads, kv_heads, head_dim, block_size, blocks = 40, 9, 3, 64, 16, 6
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    positions = torch.randint(0, 100, (tokens,), generator=generator)
    angles = torch.randn(100, head_dim // 2, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(blocks * block_size, generator=generator)[:tokens]
    slots[5] = -1
    shape = (2, blocks, block_size, kv_heads, head_dim) if token_major else (
        2, blocks, kv_heads, block_size, head_dim)  # fmt: skip
    filled = torch.randn(shape, generator=generator).to(dtype)
    expected_caches, our_caches = filled.clone(), filled.clone()
    if token_major:
        expected_caches = expected_caches.permute(0, 1, 3, 2, 4)
        our_caches = our_caches.permute(0, 1, 3, 2, 4)
    q, k, v = rotary(qkv, positions, cos, sin, q_heads, kv_heads)
    write_kv(*expected_caches.unbind(0), k, v, slots)
    ours = rotary_to_cache(qkv, positions, cos, sin, q_heads, kv_heads, *our_caches.unbind(0),
                           slots)  # fmt: skip
    assert torch.equal(ours, q)
    assert torch.equal(our_caches, expected_caches)
    assert not torch.equal(our_caches, filled)


def test_rejects_bad_input():
    with pytest.raises(RuntimeError, match="outside the table"):
        rotary(
            torch.randn(2, 3 * 8), torch.tensor([0, 5]), torch.ones(5, 4), torch.ones(5, 4), 1, 1
        )
    with pytest.raises(RuntimeError, match="weight"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    cache = torch.zeros(2, 1, 4, 2)  # 2 blocks of 4 slots, one kv head of dim 2
    with pytest.raises(RuntimeError, match="slot 8 is outside the cache"):
        rotary_to_cache(torch.randn(1, 3 * 2), torch.tensor([0]), torch.ones(5, 1),
                        torch.ones(5, 1), 1, 1, cache, cache.clone(),
                        torch.tensor([8]))  # fmt: skip
    with pytest.raises(RuntimeError, match="the cache's dtype"):
        rotary_to_cache(torch.randn(1, 3 * 2), torch.tensor([0]), torch.ones(5, 1),
                        torch.ones(5, 1), 1, 1, cache.bfloat16(), cache.bfloat16(),
                        torch.tensor([0]))  # fmt: skip
    with pytest.raises(RuntimeError, match="hidden is a contiguous float32"):
        add_rms_norm(torch.randn(2, 8).bfloat16(), torch.randn(2, 8).bfloat16(),
                     torch.randn(8).bfloat16(), 1e-5)  # fmt: skip
    with pytest.raises(RuntimeError, match="branch is \\[rows, dim\\] of the weight's dtype"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.randn(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="weight is \\[dim\\]"):
        add_rms_norm(torch.randn(2, 8), torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        silu_and_mul(torch.randn(2, 8).half())
    with pytest.raises(RuntimeError, match="2 \\* width"):
        silu_and_mul(torch.randn(2, 7))
