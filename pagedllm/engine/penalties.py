"""Repetition, presence and frequency penalties, vectorised over a batch.

Semantics (the ones vLLM and Hugging Face use):
- repetition penalty ``r`` (CTRL, HF): every token that occurs in the prompt *or* the
  output so far has its logit divided by ``r`` when positive and multiplied by ``r``
  otherwise; ``r = 1`` leaves logits unchanged.
- presence ``p`` and frequency ``f`` penalties (OpenAI): over output tokens only,
  ``logit -= p * (count > 0) + f * count``.
Repetition is applied first, then presence and frequency.
"""

from __future__ import annotations

import torch


def token_counts(padded_ids: torch.Tensor, lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Occurrences of each token id per row, as ``[num_rows, vocab_size]`` float32.

    ``padded_ids`` is ``[num_rows, max_len]`` int64; row ``i`` holds its ids in the
    first ``lengths[i]`` columns, the rest is padding (any valid id) and is not counted.
    """
    num_rows, max_len = padded_ids.shape
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.float32, device=padded_ids.device)
    if max_len == 0:
        return counts
    columns = torch.arange(max_len, device=padded_ids.device)
    is_real = (columns < lengths[:, None]).to(torch.float32)
    return counts.scatter_add_(1, padded_ids, is_real)


def apply_penalties(
    logits: torch.Tensor,
    prompt_counts: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """Return penalised ``logits`` ``[num_rows, vocab]`` (a new tensor).

    ``prompt_counts`` and ``output_counts`` come from :func:`token_counts`; the three
    penalty tensors are ``[num_rows]`` float32 (neutral values: 1, 0, 0).
    """
    seen = (prompt_counts > 0) | (output_counts > 0)
    repetition = repetition[:, None].expand_as(logits)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    penalised = torch.where(seen, penalised, logits)
    penalised -= presence[:, None] * (output_counts > 0) + frequency[:, None] * output_counts
    return penalised
