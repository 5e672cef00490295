"""RMSNorm and the gated MLP activations: RMSNorm (alone or after the residual add) and
SwiGLU in one C++ pass per row where the AVX-512 kernels run
(``pagedllm/cpu/elementwise.cpp``), torch's operators elsewhere and for GeGLU. Every path
rounds like transformers' modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedllm.cpu.extension import add_rms_norm as add_rms_norm_kernel
from pagedllm.cpu.extension import fits_avx512_kernels
from pagedllm.cpu.extension import rms_norm as rms_norm_kernel
from pagedllm.cpu.extension import silu_and_mul as silu_and_mul_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2, -1) + eps) * weight`` for ``x`` ``[rows, dim]``, of the
    weight's dtype. ``x`` has that dtype too, or is float32 under a narrower weight (a
    float32 residual stream): then it is normed unrounded and the result rounded once."""
    if x.dtype == torch.float32 and weight.dtype != torch.float32:
        bfloat16 = weight.dtype == torch.bfloat16
        if bfloat16 and fits_avx512_kernels(x) and fits_avx512_kernels(weight):
            return rms_norm_kernel(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight.float(), eps).to(weight.dtype)
    if fits_avx512_kernels(x, weight):
        return rms_norm_kernel(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def add_rms_norm(
    hidden: torch.Tensor, branch: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``hidden += branch`` (in place), then :func:`rms_norm` of the sum: one C++ pass per
    row where ``hidden`` is the float32 residual stream and ``branch`` has the weight's
    dtype, else the two apart; the same bits either way."""
    if (
        hidden.dtype == torch.float32
        and branch.dtype == weight.dtype
        and fits_avx512_kernels(hidden)
        and fits_avx512_kernels(branch, weight)
    ):
        return add_rms_norm_kernel(hidden, branch, weight, eps)
    hidden += branch
    return rms_norm(hidden, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` ``[rows, width]`` for ``gate_up`` ``[rows, 2 * width]``, gate first."""
    if fits_avx512_kernels(gate_up):
        return silu_and_mul_kernel(gate_up)
    width = gate_up.shape[-1] // 2
    gate = F.silu(gate_up[:, :width])
    gate *= gate_up[:, width:]
    return gate


def activation(x: torch.Tensor, name: str) -> torch.Tensor:
    """``act(x)`` of an MLP without a gate; ``name`` as in :func:`gated_activation`."""
    if name == "silu":
        return F.silu(x)
    return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")


def gated_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(gate) * up`` ``[rows, width]`` for ``gate_up`` ``[rows, 2 * width]``, gate
    first; ``activation`` is ``"silu"``, ``"gelu_pytorch_tanh"`` or ``"gelu"`` (exact)."""
    if activation == "silu":
        return silu_and_mul(gate_up)
    width = gate_up.shape[-1] // 2
    approximate = "tanh" if activation == "gelu_pytorch_tanh" else "none"
    gate = F.gelu(gate_up[:, :width], approximate=approximate)
    gate *= gate_up[:, width:]
    return gate
