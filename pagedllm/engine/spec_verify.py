"""Verifying guessed tokens against the model: which guesses a step keeps, and the
token the model adds after them, with the distribution of plain decoding.

A sequence that guessed ``d_1 .. d_k`` ran ``k + 1`` query rows in the step: row ``j``
holds the model's logits for the token after ``d_1 .. d_j``. Each row is processed as a
one-token step with that history would be (constraints, bans, bias, penalties:
:func:`~pagedllm.engine.sampler.processed_logits` over rows whose output history ends
in the row's guesses), so:

- a greedy row keeps guesses while each equals its row's argmax; the model's token
  after the last kept guess is that row's argmax. The output is token for token what
  decoding without guesses gives (the model's logits are batch invariant).
- a random row runs rejection sampling. The guess ``d`` at a row with distribution
  ``p`` (tempered and truncated as the sampler would draw, normalised) was drawn from
  the proposal's ``q`` at that row; it is kept with probability ``min(1, p(d) / q(d))``,
  and on rejection the token is drawn from the residual ``max(p - q, 0)``
  renormalised. A point proposal (n-grams, suffix trees, a draft's argmax) puts all of
  ``q`` on ``d``: ``d`` is kept with probability ``p(d)`` and the residual is ``p``
  without ``d``. With every guess kept, the next token is drawn from the last row's
  ``p``. Each emitted token is then distributed exactly as plain sampling would give
  it (Leviathan et al., 2023; Chen et al., 2023).

Logprobs of emitted tokens are the model's raw ones at their rows, as without guesses.
Seeded rows draw their uniforms from the sequence's generator, unseeded ones from the
global generator; a seeded sequence's tokens then depend on its seed, history and the
guesses it was offered.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedllm.cpu.extension import argmax_rows
from pagedllm.engine.sampler import (
    SamplingBatch,
    TokenLogprobs,
    draw_from,
    draw_uniforms,
    processed_logits,
    sampling_probabilities,
    token_logprobs,
)
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.engine.sequence import TokenSequence


@dataclass
class Verified:
    """One sequence's result: ``token_ids`` to append (its kept guesses, then the
    model's token), their ``logprobs`` (None unless asked), and how many guesses were
    kept (``num_accepted = len(token_ids) - 1``)."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def residual_distribution(
    probs: torch.Tensor, draft_token: int, draft_probs: torch.Tensor | None = None
) -> torch.Tensor:
    """What to draw from after rejecting ``draft_token``: ``max(p - q, 0)`` for ``p`` the
    normalised ``probs`` and ``q`` the proposal's ``draft_probs`` (normalised), or for a
    point mass ``q`` at the token (None): ``probs`` without it. Unnormalised
    (:func:`draw_from` scales by the total)."""
    if draft_probs is not None:
        return (probs / probs.sum() - draft_probs).clamp_(min=0.0)
    residual = probs.clone()
    residual[draft_token] = 0.0
    return residual


def verify(
    sequences: Sequence[TokenSequence],
    drafts: Sequence[Sequence[int]],
    logits: torch.Tensor,
    stop_token_ids: Collection[int],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[Verified]:
    """Each sequence's kept guesses and next token. ``logits`` ``[sum(len(d) + 1), vocab]``
    float32: sequence ``i``'s ``len(drafts[i]) + 1`` rows in order, sequences in order.
    ``draft_probs[i]``: the distributions ``[>= len(drafts[i]), vocab]`` sequence ``i``'s
    guesses were drawn from, None (or no list) for guesses proposed with certainty."""
    draft_probs = draft_probs or [None] * len(sequences)
    params, prompts, histories, owners = [], [], [], []
    for seq, guesses in zip(sequences, drafts, strict=True):
        reads_history = _reads_history(seq.params)
        for j in range(len(guesses) + 1):
            params.append(seq.params)
            prompts.append(seq.prompt_token_ids)
            # a row whose processing reads no history shares the output list, uncopied
            histories.append(
                [*seq.output_token_ids, *guesses[:j]] if reads_history else seq.output_token_ids
            )
            owners.append(seq)
    if len(owners) != len(logits):
        raise ValueError(f"{len(owners)} verification rows, {len(logits)} logits rows")
    batch = SamplingBatch.from_requests(
        params, prompts, histories, [None] * len(owners), stop_token_ids, device=logits.device
    )
    processed = processed_logits(logits, batch)
    greedy_tokens = argmax_rows(processed).tolist()
    probs = None
    random_index: dict[int, int] = {}
    if batch.random is not None:
        probs = sampling_probabilities(processed[batch.random.rows], batch.random)
        random_index = {row: i for i, row in enumerate(batch.random.rows.tolist())}
    raw = None if batch.max_num_logprobs is None else logits.log_softmax(dim=-1)
    results, first = [], 0
    for seq, guesses, q in zip(sequences, drafts, draft_probs, strict=True):
        if seq.params.is_greedy:
            tokens = _greedy(guesses, greedy_tokens[first : first + len(guesses) + 1])
        else:
            rows = [random_index[first + j] for j in range(len(guesses) + 1)]
            tokens = _rejection(guesses, probs[rows], seq.generator, q)
        logprobs = None
        if raw is not None and seq.params.logprobs is not None:
            rows_used = torch.arange(first, first + len(tokens))
            logprobs = token_logprobs(
                raw[rows_used], torch.tensor(tokens), [seq.params.logprobs] * len(tokens)
            )
        results.append(Verified(tokens, logprobs))
        first += len(guesses) + 1
    return results


def _reads_history(params: SamplingParams) -> bool:
    """Whether processing a row of ``params`` reads its output history: penalties,
    ``min_tokens`` bans, bad words or a grammar."""
    return bool(
        params.has_penalties
        or params.min_tokens > 0
        or params.bad_words
        or params.structured_outputs is not None
    )


def _greedy(guesses: Sequence[int], argmaxes: list[int]) -> list[int]:
    """Keep guesses while they equal the rows' argmax, then the model's own token."""
    kept = 0
    while kept < len(guesses) and guesses[kept] == argmaxes[kept]:
        kept += 1
    return [*guesses[:kept], argmaxes[kept]]


def _rejection(
    guesses: Sequence[int],
    probs: torch.Tensor,
    generator: torch.Generator | None,
    draft_probs: torch.Tensor | None,
) -> list[int]:
    """Rejection sampling of guesses against rows ``probs`` ``[k + 1, vocab]``
    (unnormalised: each row's total is its mass); ``draft_probs`` ``[>= k, vocab]``: the
    distributions the guesses were drawn from (None: point masses)."""
    tokens: list[int] = []
    for j, guess in enumerate(guesses):
        row = probs[j]
        q = None if draft_probs is None else draft_probs[j]
        u = float(draw_uniforms([generator], row.device)[0])
        proposed = 1.0 if q is None else float(q[guess])
        if u * proposed * float(row.sum()) < float(row[guess]):
            tokens.append(guess)
            continue
        residual = residual_distribution(row, guess, q)
        if float(residual.sum()) <= 0.0:  # p equals q up to rounding: p itself
            residual = row
        u = draw_uniforms([generator], row.device)
        tokens.append(int(draw_from(residual[None], u)[0]))
        return tokens
    u = draw_uniforms([generator], probs.device)
    tokens.append(int(draw_from(probs[len(guesses)][None], u)[0]))
    return tokens
