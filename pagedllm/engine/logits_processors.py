"""Truncation of a next-token distribution: top-k, top-p (nucleus) and min-p.

All functions work on a batch ``[num_rows, vocab]`` with one setting per row and leave
at least the most likely token of every row. Ties are broken towards the lower token
id, as ``torch.argmax`` does, so top-k = 1 keeps exactly the greedy token.

Top-k and top-p keep a prefix of the row's tokens in descending order. Finding it never
sorts the whole vocabulary: the prefix length comes from the largest ``window`` values
(``topk``, grown until every row's nucleus ends inside it), and the prefix itself from
its last value (everything above it, plus the lowest-id ties up to the count).
"""

from __future__ import annotations

import torch

FIRST_WINDOW = 256
"""Largest logits examined first for top-p; grown fourfold while a nucleus is wider."""


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
    vocab = logits.shape[-1]
    top_k = top_k.clamp(max=vocab)
    limited = top_k < vocab
    window = min(vocab, max(FIRST_WINDOW, int(top_k.masked_fill(~limited, 0).max())))
    row_max = logits.amax(dim=-1, keepdim=True)
    full_norm = (logits - row_max).exp().sum(dim=-1)
    while True:
        values = logits.topk(window, dim=-1).values
        counts = _prefix_lengths(values, row_max, full_norm, top_k, top_p)
        open_nucleus = (top_p < 1.0) & ~limited & (counts >= window)
        if window == vocab or not bool(open_nucleus.any()):
            break
        window = min(vocab, window * 4)
    last_kept = values.gather(-1, (counts.clamp(max=window) - 1)[:, None])
    last_kept.masked_fill_(counts[:, None] >= vocab, float("-inf"))
    return _keep_first(logits, counts, last_kept)


def _prefix_lengths(
    values: torch.Tensor,
    row_max: torch.Tensor,
    full_norm: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
) -> torch.Tensor:
    """Tokens each row keeps, ``[num_rows]`` int64, judged from its largest ``values``
    (descending, ``[num_rows, window]``); exact when ``top_k <= window``, when
    ``top_p == 1``, or when the count is below ``window``.
    """
    positions = torch.arange(values.shape[-1], device=values.device)
    inside_k = positions < top_k[:, None]
    weights = (values - row_max).exp().masked_fill_(~inside_k, 0.0)
    norm = torch.where(top_k < values.shape[-1], weights.sum(dim=-1), full_norm)
    probs = weights / norm[:, None]
    mass_before = probs.cumsum(dim=-1) - probs
    counts = ((mass_before < top_p[:, None]) & inside_k).sum(dim=-1).clamp_(min=1)
    return torch.where(top_p >= 1.0, top_k, counts)


def _keep_first(
    logits: torch.Tensor, counts: torch.Tensor, last_kept: torch.Tensor
) -> torch.Tensor:
    """``logits`` with ``-inf`` past the first ``counts`` tokens of each row in
    descending order (lower id first among equals); ``last_kept`` ``[num_rows, 1]`` is
    the value of the last token kept.
    """
    keep = logits >= last_kept
    if bool((keep.sum(dim=-1) > counts).any()):  # ties straddle some row's boundary
        ties = logits == last_kept
        quota = counts - (logits > last_kept).sum(dim=-1)
        keep &= ~ties | (ties.cumsum(dim=-1, dtype=torch.int32) <= quota[:, None])
    return logits.masked_fill(~keep, float("-inf"))


def mask_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, every probability below ``min_p`` times its row's maximum.

    ``probs`` ``[num_rows, vocab]`` need not be normalised (only ratios matter);
    ``min_p`` ``[num_rows]`` float32 in [0, 1], 0 keeps all.
    """
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill_(probs < threshold, 0.0)
