"""Sampling one step's rows so that a failing row fails only its own request.

The whole batch is sampled in one sampler call. If that raises, every row is sampled
again on its own, seeded generators rewound first, so each row that does not fail gets
the token it would have got in the batch, and the rows of a request that fails are left
out (token None) and reported. Verifying guessed tokens
(:func:`~pagedllm.engine.spec_verify.verify`) is isolated the same way, per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Collection

import torch

from pagedllm.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from pagedllm.engine.sequence import TokenSequence
from pagedllm.engine.spec_verify import Verified, verify

logger = logging.getLogger("pagedllm")


def sample_isolated(
    sampler: Sampler,
    sequences: list[TokenSequence],
    logits: torch.Tensor,
    stop_token_ids: Collection[int],
) -> tuple[SamplerOutput | None, dict[str, Exception]]:
    """The next token of each of ``sequences`` (row ``i`` of ``logits`` is sequence
    ``i``'s; None when there are none) and the error of each request whose sampling
    failed, by request id. ``stop_token_ids``: the engine's stop set."""
    if not sequences:
        return None, {}
    seeded = [(seq.generator, seq.generator.get_state()) for seq in sequences if seq.generator]
    try:
        return _sample(sampler, sequences, logits, stop_token_ids), {}
    except Exception:
        logger.exception("sampling a batch of %d rows failed; sampling rows apart", len(logits))
    for generator, state in seeded:
        generator.set_state(state)
    token_ids: list[int | None] = []
    logprobs: list = []
    failures: dict[str, Exception] = {}
    for row, seq in enumerate(sequences):
        one = None
        if seq.request_id not in failures:
            try:
                one = _sample(sampler, [seq], logits[row : row + 1], stop_token_ids)
            except Exception as error:
                failures[seq.request_id] = error
        token_ids.append(one.token_ids[0] if one else None)
        logprobs.append(one.logprobs[0] if one and one.logprobs else None)
    return SamplerOutput(token_ids, logprobs), failures


def _sample(
    sampler: Sampler,
    sequences: list[TokenSequence],
    logits: torch.Tensor,
    stop_token_ids: Collection[int],
) -> SamplerOutput:
    batch = SamplingBatch.from_requests(
        [seq.params for seq in sequences],
        [seq.prompt_token_ids for seq in sequences],
        [seq.output_token_ids for seq in sequences],
        [seq.generator for seq in sequences],
        stop_token_ids,
        device=logits.device,
    )
    return sampler(logits, batch)


def verify_isolated(
    sequences: list[TokenSequence],
    drafts: list[list[int]],
    logits: torch.Tensor,
    stop_token_ids: Collection[int],
    draft_probs: list[torch.Tensor | None],
) -> tuple[list[Verified | None], dict[str, Exception]]:
    """:func:`~pagedllm.engine.spec_verify.verify` of the whole batch; if it raises,
    each sequence again on its own (seeded generators rewound), leaving out (None) and
    reporting the requests that fail."""
    if not sequences:
        return [], {}
    seeded = [(seq.generator, seq.generator.get_state()) for seq in sequences if seq.generator]
    try:
        return list(verify(sequences, drafts, logits, stop_token_ids, draft_probs)), {}
    except Exception:
        logger.exception("verifying %d sequences' guesses failed; verifying apart", len(sequences))
    for generator, state in seeded:
        generator.set_state(state)
    results: list[Verified | None] = []
    failures: dict[str, Exception] = {}
    first = 0
    for seq, guesses, q in zip(sequences, drafts, draft_probs, strict=True):
        rows = logits[first : first + len(guesses) + 1]
        first += len(guesses) + 1
        one = None
        if seq.request_id not in failures:
            try:
                one = verify([seq], [guesses], rows, stop_token_ids, [q])[0]
            except Exception as error:
                failures[seq.request_id] = error
        results.append(one)
    return results, failures
