"""Turning one step's logits into next tokens, for a whole batch at once.

The engine builds a :class:`SamplingBatch` each step from the scheduled sequences
(their params, token history and random generators), then calls :class:`Sampler`.

Order of operations per row (vLLM's): ``-inf`` where the row's grammar forbids a token
(``structured_outputs``, one bitmask for the batch) and outside ``allowed_token_ids``;
``-inf`` on banned ids: the last token of each ``bad_words`` sequence whose other tokens end
the output, and the stop ids (the engine's stop set unless ``ignore_eos``, and the
request's ``stop_token_ids``: the same set the output check stops on) while the output
is shorter than ``min_tokens``; ``logit_bias`` added; repetition, presence and
frequency penalties; then greedy rows take the argmax, and the other rows divide
by the temperature, apply top-k, top-p and min-p, and draw.

Drawing is by inverse transform: one uniform ``u`` in [0, 1) per row, and the token is
the first id whose cumulative probability (float64, in id order) exceeds ``u`` times
the total. One random number per row and step (not one per vocabulary entry) keeps
drawing cheap. A seeded row takes its ``u`` from its own ``torch.Generator``, so its
tokens depend only on its seed and history, never on the rest of the batch. The
sequence owns that generator across steps (see :func:`make_generator`); unseeded rows
share the global generator.

Logprobs are those of the raw model distribution (``log_softmax`` of the logits as
given, before penalties, temperature and truncation), as vLLM returns by default.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from pagedllm.cpu.extension import argmax_rows
from pagedllm.engine.logits_processors import mask_min_p, mask_top_k_top_p
from pagedllm.engine.penalties import apply_penalties, token_counts
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError
from pagedllm.structured_output import allocate_bitmask, apply_bitmask


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A fresh generator seeded with ``seed`` on ``device``, or None when unseeded.

    A sequence keeps the one it gets for its whole life; for sample ``i`` of an
    ``n > 1`` request pass ``params.derived_seed(i)``.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class PenaltyInputs:
    """Token history and penalty values of every row, for :func:`apply_penalties`.

    Rows without penalties have empty histories and neutral values; the prompt
    history is only kept for rows with a repetition penalty.
    """

    prompt_ids: torch.Tensor
    prompt_lens: torch.Tensor
    output_ids: torch.Tensor
    output_lens: torch.Tensor
    repetition: torch.Tensor
    presence: torch.Tensor
    frequency: torch.Tensor


@dataclass
class RandomRows:
    """The rows that are drawn at random (not greedy), with their settings.

    ``rows`` ``[num_random]`` int64 indexes the batch; every other tensor is
    ``[num_random]`` and aligned with it. ``top_k`` 0 means off.
    ``uses_top_k_top_p`` and ``uses_min_p`` are False when no row needs that step.
    """

    rows: torch.Tensor
    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    generators: list[torch.Generator | None]
    uses_top_k_top_p: bool
    uses_min_p: bool


@dataclass
class TokenEdits:
    """Per-row token constraints as flat (row, token id) pairs, all int64 on the device.

    - ``bias_rows``, ``bias_ids``, ``bias_values`` (float32) ``[num_biased]``: added to
      the logits (``logit_bias``).
    - ``allowed_rows`` ``[num_restricted]``: the rows with ``allowed_token_ids``;
      ``allowed_pairs`` ``[2, num_allowed]``: (index into ``allowed_rows``, id) pairs.
    - ``max_id``: the largest id named, checked against the vocabulary (-1: none).
    """

    bias_rows: torch.Tensor
    bias_ids: torch.Tensor
    bias_values: torch.Tensor
    allowed_rows: torch.Tensor
    allowed_pairs: torch.Tensor
    max_id: int


@dataclass
class GrammarRows:
    """Rows under ``structured_outputs``: ``rows`` ``[num_constrained]`` int64 on the
    device, and their allowed tokens, ``bitmask`` (see ``allocate_bitmask``), on the host.
    """

    rows: torch.Tensor
    bitmask: torch.Tensor


@dataclass
class SamplingBatch:
    """Everything the sampler needs about the rows of one step, in logits row order.

    - ``num_logprobs[i]``: alternatives row ``i`` wants besides its token (None: no
      logprobs at all).
    - ``banned_rows``, ``banned_ids`` ``[num_banned]`` int64: (row, token) pairs set to
      ``-inf`` (stop ids before ``min_tokens``, bad words).
    - ``edits``: None when no row has ``logit_bias`` or ``allowed_token_ids``.
    - ``grammar``: None when no row has ``structured_outputs``.
    - ``penalties``: None when no row has a penalty.
    - ``random``: None when every row is greedy.
    """

    num_logprobs: list[int | None]
    banned_rows: torch.Tensor
    banned_ids: torch.Tensor
    edits: TokenEdits | None
    grammar: GrammarRows | None
    penalties: PenaltyInputs | None
    random: RandomRows | None

    @classmethod
    def from_requests(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        stop_token_ids: Collection[int],
        device: torch.device | str = "cpu",
    ) -> SamplingBatch:
        """Describe one step: row ``i`` samples the next token of a sequence with
        ``params[i]``, its prompt and output ids so far, and its own generator (None
        when unseeded). ``stop_token_ids`` is the engine's stop set (eos and end-of-turn
        ids); with the row's own ``stop_token_ids`` it is masked until ``min_tokens``.
        """
        if not len(params) == len(prompt_token_ids) == len(output_token_ids) == len(generators):
            raise ValueError("params, token ids and generators must have one entry per row")
        banned_rows, banned_ids = _min_tokens_bans(params, output_token_ids, stop_token_ids)
        _add_bad_word_bans(params, output_token_ids, banned_rows, banned_ids)
        return cls(
            num_logprobs=[p.logprobs for p in params],
            banned_rows=torch.tensor(banned_rows, dtype=torch.int64, device=device),
            banned_ids=torch.tensor(banned_ids, dtype=torch.int64, device=device),
            edits=_token_edits(params, device),
            grammar=_grammar_rows(params, output_token_ids, device),
            penalties=_penalty_inputs(params, prompt_token_ids, output_token_ids, device),
            random=random_rows(params, generators, device),
        )

    @property
    def max_num_logprobs(self) -> int | None:
        """The most alternatives any row wants, None when no row wants logprobs."""
        return max((k for k in self.num_logprobs if k is not None), default=None)


def _min_tokens_bans(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    stop_token_ids: Collection[int],
) -> tuple[list[int], list[int]]:
    rows: list[int] = []
    ids: list[int] = []
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if len(output) >= p.min_tokens:
            continue
        stop_ids = set(p.stop_token_ids)
        if not p.ignore_eos:
            stop_ids.update(stop_token_ids)
        rows.extend([row] * len(stop_ids))
        ids.extend(sorted(stop_ids))
    return rows, ids


def _add_bad_word_bans(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    rows: list[int],
    ids: list[int],
) -> None:
    """Append (row, last token) for each bad word whose other tokens end the output."""
    for row, (p, output) in enumerate(zip(params, output_token_ids, strict=True)):
        if not p.bad_words:
            continue
        if p.bad_words_token_ids is None:
            raise InvalidRequestError(
                "bad_words must be resolved with the model's tokenizer first "
                "(SamplingParams.check_for_model)",
                "bad_words",
            )
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(output) and list(output[len(output) - len(prefix) :]) == prefix:
                rows.append(row)
                ids.append(word[-1])


def _grammar_rows(
    params: Sequence[SamplingParams],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
) -> GrammarRows | None:
    rows = [row for row, p in enumerate(params) if p.structured_outputs is not None]
    if not rows:
        return None
    matchers = [params[row].grammar_matchers for row in rows]
    if any(m is None for m in matchers):
        raise InvalidRequestError(
            "structured_outputs must be compiled for the model first "
            "(SamplingParams.check_for_model)",
            "structured_outputs",
        )
    bitmask = allocate_bitmask(len(rows), matchers[0].vocab_size)
    for index, (row, matcher) in enumerate(zip(rows, matchers, strict=True)):
        matcher.fill_mask(output_token_ids[row], bitmask, index)
    return GrammarRows(torch.tensor(rows, dtype=torch.int64, device=device), bitmask)


def _token_edits(params: Sequence[SamplingParams], device: torch.device | str) -> TokenEdits | None:
    if not any(p.logit_bias or p.allowed_token_ids for p in params):
        return None
    bias_rows, bias_ids, bias_values = [], [], []
    allowed_rows, pair_rows, pair_ids = [], [], []
    for row, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            bias_rows.append(row)
            bias_ids.append(token_id)
            bias_values.append(bias)
        if p.allowed_token_ids:
            pair_rows.extend([len(allowed_rows)] * len(p.allowed_token_ids))
            pair_ids.extend(p.allowed_token_ids)
            allowed_rows.append(row)
    return TokenEdits(
        bias_rows=torch.tensor(bias_rows, dtype=torch.int64, device=device),
        bias_ids=torch.tensor(bias_ids, dtype=torch.int64, device=device),
        bias_values=_floats(bias_values, device),
        allowed_rows=torch.tensor(allowed_rows, dtype=torch.int64, device=device),
        allowed_pairs=torch.tensor([pair_rows, pair_ids], dtype=torch.int64, device=device),
        max_id=max(bias_ids + pair_ids, default=-1),
    )


def _penalty_inputs(
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
) -> PenaltyInputs | None:
    if not any(p.has_penalties for p in params):
        return None
    prompts = [
        ids if p.repetition_penalty != 1.0 else ()
        for p, ids in zip(params, prompt_token_ids, strict=True)
    ]
    outputs = [
        ids if p.has_penalties else () for p, ids in zip(params, output_token_ids, strict=True)
    ]
    prompt_ids, prompt_lens = _padded(prompts, device)
    output_ids, output_lens = _padded(outputs, device)
    return PenaltyInputs(
        prompt_ids=prompt_ids,
        prompt_lens=prompt_lens,
        output_ids=output_ids,
        output_lens=output_lens,
        repetition=_floats([p.repetition_penalty for p in params], device),
        presence=_floats([p.presence_penalty for p in params], device),
        frequency=_floats([p.frequency_penalty for p in params], device),
    )


def random_rows(
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    device: torch.device | str,
) -> RandomRows | None:
    """The rows of ``params`` that are not greedy, with their settings (None: none)."""
    rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not rows:
        return None
    chosen = [params[i] for i in rows]
    return RandomRows(
        rows=torch.tensor(rows, dtype=torch.int64, device=device),
        temperatures=_floats([p.temperature for p in chosen], device),
        top_k=torch.tensor([p.top_k for p in chosen], dtype=torch.int64, device=device),
        top_p=_floats([p.top_p for p in chosen], device),
        min_p=_floats([p.min_p for p in chosen], device),
        generators=[generators[i] for i in rows],
        uses_top_k_top_p=any(p.top_k > 0 or p.top_p < 1.0 for p in chosen),
        uses_min_p=any(p.min_p > 0.0 for p in chosen),
    )


def _floats(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _padded(
    rows: Sequence[Sequence[int]], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_rows, max_len]`` int64 ids padded with 0, and ``[num_rows]`` lengths."""
    lengths = [len(ids) for ids in rows]
    padded = torch.zeros(len(rows), max(lengths, default=0), dtype=torch.int64)
    for row, ids in enumerate(rows):
        if ids:
            padded[row, : len(ids)] = torch.as_tensor(ids, dtype=torch.int64)
    return padded.to(device), torch.tensor(lengths, dtype=torch.int64, device=device)


@dataclass
class TokenLogprobs:
    """Raw-model logprobs at one position of one sequence.

    ``rank`` is 1 for the most likely token. ``top`` holds the requested number of
    most likely ``(token_id, logprob)`` pairs, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class SamplerOutput:
    """One step's result, in logits row order.

    ``logprobs`` is None when no row asked for them; otherwise entry ``i`` is None
    for rows that did not ask.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] | None


class Sampler:
    """Samples one token per row of ``[num_rows, vocab]`` float32 logits.

    When every row is greedy without penalties or bans, a step is one argmax.
    """

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw_logprobs = None if batch.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = processed_logits(logits, batch)
        token_ids = argmax_rows(logits)
        if batch.random is not None:
            token_ids[batch.random.rows] = _draw(logits[batch.random.rows], batch.random)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = token_logprobs(raw_logprobs, token_ids, batch.num_logprobs)
        return SamplerOutput(token_ids=token_ids.tolist(), logprobs=logprobs)


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Constrained, biased and penalised logits, rows aligned with ``batch``'s (greedy
    rows take their argmax); never modifies the input."""
    vocab_size = logits.shape[-1]
    if batch.grammar is not None:
        constrained = logits[batch.grammar.rows]
        apply_bitmask(constrained, batch.grammar.bitmask)
        logits = logits.index_put((batch.grammar.rows,), constrained)
    edits = batch.edits
    if edits is not None:
        if edits.max_id >= vocab_size:
            raise InvalidRequestError(
                f"token id {edits.max_id} is outside the vocabulary of {vocab_size}"
            )
        if edits.allowed_rows.numel() > 0:
            allowed = torch.zeros(
                len(edits.allowed_rows), vocab_size, dtype=torch.bool, device=logits.device
            )
            allowed[edits.allowed_pairs[0], edits.allowed_pairs[1]] = True
            restricted = logits[edits.allowed_rows].masked_fill(~allowed, float("-inf"))
            logits = logits.index_put((edits.allowed_rows,), restricted)
    if batch.banned_rows.numel() > 0:
        ban = torch.tensor(float("-inf"), device=logits.device)
        logits = logits.index_put((batch.banned_rows, batch.banned_ids), ban)
    if edits is not None and edits.bias_rows.numel() > 0:
        logits = logits.index_put(
            (edits.bias_rows, edits.bias_ids), edits.bias_values, accumulate=True
        )
    if batch.grammar is not None or (edits is not None and edits.allowed_rows.numel() > 0):
        _check_some_token_allowed(logits)
    if batch.penalties is not None:
        inputs = batch.penalties
        logits = apply_penalties(
            logits,
            token_counts(inputs.prompt_ids, inputs.prompt_lens, vocab_size),
            token_counts(inputs.output_ids, inputs.output_lens, vocab_size),
            inputs.repetition,
            inputs.presence,
            inputs.frequency,
        )
    return logits


def _check_some_token_allowed(logits: torch.Tensor) -> None:
    """InvalidRequestError when a row's constraints together allow no token at all."""
    if bool(torch.isneginf(logits).all(dim=-1).any()):
        raise InvalidRequestError(
            "the request's constraints (structured output, allowed_token_ids, bad_words, "
            "logit_bias) leave no token that may come next"
        )


def sampling_probabilities(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """The distributions ``[num_random, vocab]`` the random rows draw from: processed
    ``logits`` of those rows tempered, truncated by top-k, top-p and min-p, softmaxed
    (min-p leaves them unnormalised; draws scale by each row's total)."""
    logits = logits / random.temperatures[:, None]
    if random.uses_top_k_top_p:
        vocab_size = logits.shape[-1]
        top_k = torch.where(random.top_k > 0, random.top_k, vocab_size)
        logits = mask_top_k_top_p(logits, top_k, random.top_p)
    probs = logits.softmax(dim=-1)
    if random.uses_min_p:
        mask_min_p(probs, random.min_p)
    return probs


def draw_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-transform draws: per row of ``probs`` ``[rows, vocab]`` (not necessarily
    normalised), the first id whose cumulative mass (float64, id order) exceeds
    ``uniforms[row]`` ``[rows]`` (in [0, 1)) times the row's total."""
    cumulative = probs.double().cumsum(dim=-1)
    targets = uniforms * cumulative[:, -1]
    token_ids = torch.searchsorted(cumulative, targets[:, None], right=True)[:, 0]
    # u * total may round up to total (chance about 2**-53): stay inside the vocabulary
    return token_ids.clamp_(max=probs.shape[-1] - 1)


def _draw(logits: torch.Tensor, random: RandomRows) -> torch.Tensor:
    """Token ids ``[num_random]`` drawn from the truncated, tempered distributions."""
    probs = sampling_probabilities(logits, random)
    return draw_from(probs, draw_uniforms(random.generators, probs.device))


def draw_uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """``[num_rows]`` float64 uniforms in [0, 1) on ``device``: seeded rows from their own
    generator, which may live on another device than the logits (the host's by
    default), so a seeded sequence draws the same numbers on every device."""
    uniforms = torch.rand(len(generators), dtype=torch.float64, device=device)
    for row, generator in enumerate(generators):
        if generator is not None:
            on = generator.device
            uniforms[row] = torch.rand((), dtype=torch.float64, device=on, generator=generator)
    return uniforms


def token_logprobs(
    raw_logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None]:
    """Each row's token ``token_ids[i]`` scored in log-probabilities ``raw_logprobs``
    ``[rows, vocab]``, with its ``num_logprobs[i]`` most likely alternatives (None for a
    row that wants no logprobs)."""
    wanted_most = max((k for k in num_logprobs if k is not None), default=0)
    num_top = min(wanted_most, raw_logprobs.shape[-1])
    top_logprobs, top_ids = raw_logprobs.topk(num_top, dim=-1)
    chosen = raw_logprobs.gather(-1, token_ids[:, None])
    ranks = (raw_logprobs > chosen).sum(dim=-1) + 1
    rows = zip(
        num_logprobs,
        token_ids.tolist(),
        chosen[:, 0].tolist(),
        ranks.tolist(),
        top_ids.tolist(),
        top_logprobs.tolist(),
        strict=True,
    )
    return [
        None
        if wanted is None
        else TokenLogprobs(token, logprob, rank, list(zip(ids[:wanted], lps[:wanted], strict=True)))
        for wanted, token, logprob, rank, ids, lps in rows
    ]
