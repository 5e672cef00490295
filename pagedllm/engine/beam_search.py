"""Beam search: its parameters, its results, and the rule that picks the beams.

The rule is transformers' ``generate(num_beams=W, do_sample=False)`` for one prompt
(as transformers 5.x implements it), restated over plain lists:

1. Each step every running beam ``b`` (summed log-probability ``cum[b]``, nats) gives
   ``log_softmax`` of its next-token logits; candidate ``(b, t)`` scores
   ``cum[b] + logprob[b, t]`` in float32. The first step has one beam, the prompt.
2. The best ``K = max(2, 1 + number of stop tokens) * W`` candidates are ranked. A
   candidate ends its beam when ``t`` is a stop token or when it is the ``max_tokens``-th
   generated token. Only ending candidates ranked among the first ``W`` become finished
   hypotheses; the best ``W`` candidates that do not end are the next running beams.
3. A finished hypothesis of ``L`` generated tokens (its stop token included) scores
   ``cum / L ** length_penalty``; the best ``W`` hypotheses are kept.
4. The search ends when no candidate continues (``max_tokens`` reached); or, with
   ``early_stopping=True``, as soon as ``W`` hypotheses are finished; or, once ``W`` are
   finished, when the best running beam cannot beat the worst kept hypothesis by the
   estimate ``cum[best] / L' ** length_penalty``, where ``L'`` is the current generated
   length, or ``max_tokens`` when ``early_stopping="never"`` and ``length_penalty > 0``.

Stop tokens are the engine's (the tokenizer's EOS and end-of-turn tokens): pass the same
set as ``eos_token_id`` to transformers to compare. The result is the kept hypotheses,
best first. Unlike ``generate(num_beams=1)`` (greedy decoding), width 1 still follows
this rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

EarlyStopping = bool | Literal["never"]


@dataclass(frozen=True)
class BeamSearchParams:
    """Options of one beam search, in vLLM's shape.

    - ``beam_width``: beams kept each step, and hypotheses returned (``num_beams``).
    - ``max_tokens``: most tokens generated per beam (``max_new_tokens``).
    - ``length_penalty``: exponent of the generated length dividing a finished
      hypothesis' summed log-probability; above 0 favours longer outputs.
    - ``early_stopping``: ``False`` stops by the heuristic of rule 4, ``True`` as soon as
      ``beam_width`` hypotheses are finished, ``"never"`` only when no better hypothesis
      can exist (see the module docstring).
    - ``ignore_eos``: stop tokens are ordinary tokens; every hypothesis has ``max_tokens``
      tokens.
    """

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if isinstance(self.length_penalty, bool) or not isinstance(
            self.length_penalty, (int, float)
        ):
            raise ValueError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )


@dataclass
class BeamSearchSequence:
    """One finished hypothesis.

    ``token_ids``: the generated tokens (the stop token included when it ended by one);
    ``tokens``: prompt plus generated tokens (vLLM's field); ``text``: the generated text
    without special tokens (None without a tokenizer); ``cum_logprob``: summed
    log-probability of ``token_ids`` (nats); ``score``: ``cum_logprob`` divided by
    ``len(token_ids) ** length_penalty``, the rank; ``finish_reason``: ``"stop"`` or
    ``"length"``.
    """

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    cum_logprob: float
    score: float
    finish_reason: str

    @property
    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.token_ids


@dataclass
class BeamSearchOutput:
    """The result for one prompt: up to ``beam_width`` ``sequences``, best score first."""

    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence] = field(default_factory=list)


@dataclass(frozen=True)
class Beam:
    """A running beam: generated ``token_ids`` and their summed log-probability (nats)."""

    token_ids: tuple[int, ...]
    cum_logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam; ``score`` is ``cum_logprob / len(token_ids) ** length_penalty``."""

    token_ids: tuple[int, ...]
    cum_logprob: float
    score: float
    finish_reason: str


@dataclass(frozen=True)
class Continuation:
    """A next running beam: running beam ``parent`` extended by ``token_id``."""

    parent: int
    token_id: int
    cum_logprob: float


class BeamSelector:
    """The beam-choosing rule of the module docstring for one prompt, step by step.

    Invariants: ``beams`` holds at most ``beam_width`` beams, best first, all with
    ``num_generated`` tokens; ``hypotheses`` at most ``beam_width``, best score first.
    Once ``is_done``, ``beams`` is empty.
    """

    def __init__(self, params: BeamSearchParams, stop_token_ids: set[int]) -> None:
        self.params = params
        self.stop_token_ids = frozenset() if params.ignore_eos else frozenset(stop_token_ids)
        self.num_candidates = max(2, 1 + len(self.stop_token_ids)) * params.beam_width
        self.beams: list[Beam] = [Beam((), 0.0)]
        self.hypotheses: list[Hypothesis] = []
        self.num_generated = 0

    @property
    def is_done(self) -> bool:
        return not self.beams

    def step(self, logprobs: torch.Tensor) -> list[Continuation]:
        """Advance by one token given ``logprobs`` ``[len(beams), vocab]`` (log-softmax of
        each beam's logits, in beam order); returns the next beams, empty once done."""
        if len(logprobs) != len(self.beams):
            raise ValueError(f"{len(logprobs)} rows of log-probs for {len(self.beams)} beams")
        width = self.params.beam_width
        vocab = logprobs.shape[1]
        cum = torch.tensor([beam.cum_logprob for beam in self.beams], dtype=torch.float32)
        scores = (logprobs.float() + cum[:, None]).flatten()
        top_scores, top_index = torch.topk(scores, min(self.num_candidates, scores.numel()))
        self.num_generated += 1
        at_limit = self.num_generated >= self.params.max_tokens
        survivors: list[Continuation] = []
        ranked = zip(top_scores.tolist(), top_index.tolist(), strict=True)
        for rank, (score, index) in enumerate(ranked):
            parent, token_id = divmod(index, vocab)
            stops = token_id in self.stop_token_ids
            if stops or at_limit:
                if rank < width:
                    tokens = self.beams[parent].token_ids + (token_id,)
                    self._add_hypothesis(tokens, score, "stop" if stops else "length")
            elif len(survivors) < width:
                survivors.append(Continuation(parent, token_id, score))
        self.beams = [
            Beam(self.beams[c.parent].token_ids + (c.token_id,), c.cum_logprob) for c in survivors
        ]
        if self._should_stop():
            self.beams = []
            return []
        return survivors

    def _add_hypothesis(self, token_ids: tuple[int, ...], cum: float, reason: str) -> None:
        score = cum / len(token_ids) ** self.params.length_penalty
        self.hypotheses.append(Hypothesis(token_ids, cum, score, reason))
        self.hypotheses.sort(key=lambda h: h.score, reverse=True)
        del self.hypotheses[self.params.beam_width :]

    def _should_stop(self) -> bool:
        params = self.params
        if not self.beams:
            return True
        if len(self.hypotheses) < params.beam_width:
            return False
        if params.early_stopping is True:
            return True
        length = self.num_generated
        if params.early_stopping == "never" and params.length_penalty > 0:
            length = params.max_tokens
        best_possible = self.beams[0].cum_logprob / length**params.length_penalty
        return not best_possible > self.hypotheses[-1].score
