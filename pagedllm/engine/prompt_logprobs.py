"""Log-probabilities of prompt tokens (``SamplingParams.prompt_logprobs``).

They come from the prefill pass that writes the prompt's K/V, not from a second
forward: the model runner hands back the final hidden states of the prompt positions
owed, and :func:`score_prompt_positions` projects them to the vocabulary at most
``ROWS_PER_SLICE`` rows at a time (a slice of float32 logits, not a whole chunk's),
scoring at position ``p`` the prompt token ``p + 1`` under the raw model distribution.
The first prompt token has no logprob (``None``, as in vLLM).

Prefix caching: the logits of a cached position are not kept, so a sequence that owes
prompt logprobs takes a prefix-cache hit only over positions it has already scored
(after a preemption by recompute); its first pass computes every prompt position, and
its blocks join the cache for later requests as usual. Positions scored before a
recompute are not scored again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from pagedllm.engine.sampler import TokenLogprobs, token_logprobs
from pagedllm.engine.sequence import TokenSequence

ROWS_PER_SLICE = 256
"""Hidden rows projected to the vocabulary at once (bounds the logits' memory)."""


def prompt_logits(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None], hidden: torch.Tensor
) -> Iterator[tuple[slice, torch.Tensor | None]]:
    """``hidden``'s rows projected to the vocabulary ``ROWS_PER_SLICE`` at a time: each
    slice of rows with its logits. Under tensor parallelism every rank runs this same
    loop (the projection is a collective; ranks other than 0 get ``None`` logits)."""
    for start in range(0, len(hidden), ROWS_PER_SLICE):
        rows = slice(start, start + ROWS_PER_SLICE)
        yield rows, compute_logits(hidden[rows])


def score_prompt_positions(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    spans: list[tuple[TokenSequence, range]],
) -> list[tuple[TokenSequence, list[TokenLogprobs]]]:
    """Each span's positions scored: ``hidden`` ``[sum of span lengths, hidden_size]``
    holds their final hidden states in span order; ``compute_logits`` is the model's
    projection to float32 logits."""
    targets = torch.tensor(
        [t for seq, span in spans for t in seq.all_token_ids[span.start + 1 : span.stop + 1]],
        dtype=torch.int64,
        device=hidden.device,
    )
    wanted = [seq.params.prompt_logprobs for seq, positions in spans for _ in positions]
    entries: list[TokenLogprobs] = []
    for rows, logits in prompt_logits(compute_logits, hidden):
        raw_logprobs = logits.log_softmax(dim=-1)
        entries.extend(token_logprobs(raw_logprobs, targets[rows], wanted[rows]))
    scored, offset = [], 0
    for seq, positions in spans:
        scored.append((seq, entries[offset : offset + len(positions)]))
        offset += len(positions)
    return scored
