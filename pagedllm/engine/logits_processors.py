"""Truncation of a next-token distribution: top-k, top-p (nucleus) and min-p.

All functions work on a batch ``[num_rows, vocab]`` with one setting per row and leave
at least the most likely token of every row. Ties are broken towards the lower token
id, as ``torch.argmax`` does, so top-k = 1 keeps exactly the greedy token.
"""

from __future__ import annotations

import torch


def mask_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Return ``logits`` with ``-inf`` outside each row's top-k and then top-p set.

    - ``top_k`` ``[num_rows]`` int64: keep the ``k`` largest logits (``k >= vocab``
      keeps all).
    - ``top_p`` ``[num_rows]`` float32 in (0, 1]: of what top-k kept, keep the
      smallest most-likely-first set whose probability (renormalised after top-k)
      reaches ``p``; 1 keeps all.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    outside = rank >= top_k[:, None]
    sorted_logits.masked_fill_(outside, float("-inf"))
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside |= mass_before >= top_p[:, None]
    outside[:, 0] = False
    sorted_logits.masked_fill_(outside, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def mask_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, every probability below ``min_p`` times its row's maximum.

    ``probs`` ``[num_rows, vocab]`` need not be normalised (only ratios matter);
    ``min_p`` ``[num_rows]`` float32 in [0, 1], 0 keeps all.
    """
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill_(probs < threshold, 0.0)
