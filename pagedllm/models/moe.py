"""Sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE).

A router scores every expert for each token; the token's ``top_k`` experts run on it
and their outputs are summed with the router's probabilities (renormalised over the
chosen ones when the architecture says so). Experts run in batches: each expert once
per step, on all the tokens routed to it, never a Python loop over tokens. Outputs are
accumulated expert by expert in ascending expert order, the order transformers adds
them in, so float32 sums round the same. Qwen2-MoE adds a shared expert, gated per token
by ``sigmoid(x . w)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.cpu.kernel_choice import KernelChoice
from pagedllm.models.fused import gated_activation
from pagedllm.models.linear import Weight, linear, prepare_weight


class SparseMoE(nn.Module):
    """Buffers: ``router`` ``[num_experts, hidden]``; ``gate_up`` ``[num_experts,
    2 * intermediate, hidden]`` (rows gate, then up, per expert); ``down`` ``[num_experts,
    hidden, intermediate]``. Optional shared expert: ``shared_gate_up``, ``shared_down``
    (plain or packed, as ``choice`` picks) and ``shared_gate`` ``[1, hidden]``."""

    def __init__(
        self,
        router: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        top_k: int,
        renormalize: bool,
        activation: str,
        shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        choice: KernelChoice | None = None,
    ) -> None:
        super().__init__()
        self.register_buffer("router", router)
        self.register_buffer("gate_up", gate_up)
        self.register_buffer("down", down)
        self.top_k = top_k
        self.renormalize = renormalize
        self.activation = activation
        self.shared_gate_up: Weight | None = None
        self.shared_down: Weight | None = None
        self.register_buffer("shared_gate", shared[2] if shared else None)
        if shared:
            self.shared_gate_up = prepare_weight(shared[0], choice)
            self.shared_down = prepare_weight(shared[1], choice)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output ``[T, hidden]`` for ``x`` ``[T, hidden]``."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, top_k]
        if self.renormalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype).flatten()  # [T * top_k], pair order
        out = torch.zeros_like(x)
        order = torch.argsort(experts.flatten(), stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.router.shape[0]).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            gate_up = F.linear(x[tokens], self.gate_up[expert])
            routed = F.linear(gated_activation(gate_up, self.activation), self.down[expert])
            routed *= weights[pairs, None]
            out.index_add_(0, tokens, routed)
        if self.shared_gate is not None:
            shared = gated_activation(linear(x, self.shared_gate_up), self.activation)
            shared = linear(shared, self.shared_down)
            out += torch.sigmoid(F.linear(x, self.shared_gate)) * shared
        return out
