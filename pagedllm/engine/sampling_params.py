"""What a request asks of decoding: vLLM's ``SamplingParams``, validated on creation.

Keyword names, defaults and accepted ranges follow vLLM so that its users' code runs
unchanged. Every bad value raises ``InvalidRequestError`` (a ``ValueError``) naming
the field and the value.

Conventions:
- ``temperature`` below ``GREEDY_TEMPERATURE`` (including 0) means greedy decoding;
  top-k, top-p, min-p and the seed are then irrelevant.
- ``top_k`` 0 or -1 means "off"; -1 is normalised to 0.
- ``max_tokens=None`` means "as many as fit": the engine resolves it to
  ``max_model_len - prompt_len``.
- ``stop`` is normalised to a list of non-empty strings, ``stop_token_ids`` to a list.
- Floats must be finite numbers (not bool, NaN or infinity); ``seed`` must fit a
  signed 64-bit integer, as vLLM requires. Checks that depend on the model (token
  ids inside the vocabulary, ``n`` against the engine's ``max_n``, lengths against
  ``max_model_len`` and the KV pool) are the engine's, at ``add_request``.
- ``logit_bias`` (OpenAI's): token id -> a bias in [-100, 100] added to that logit;
  ``allowed_token_ids`` (vLLM's): only these ids may be sampled; ``bad_words``
  (vLLM's): words never generated. A bad word is encoded as it reads and, when that
  gives another first token with as many tokens, also after a space; its last token
  is banned whenever the output ends with the tokens before it (a one-token word is
  always banned). The engine or server resolves the words with the model's tokenizer
  (:meth:`SamplingParams.check_for_model`), which also checks every id against the
  vocabulary.
- ``logprobs`` / ``prompt_logprobs`` (vLLM's): the log-probability of every sampled
  / prompt token under the raw model distribution, with that many most likely
  alternatives; the first prompt token has none (see
  :mod:`pagedllm.engine.prompt_logprobs`).
- ``structured_outputs`` (vLLM's): the output follows a JSON schema, any JSON object, a
  regex, a choice or a grammar (see :mod:`pagedllm.structured_output`);
  :meth:`SamplingParams.check_for_model` compiles it. Not with ``ignore_eos`` or
  ``min_tokens``: the grammar decides where the output ends.
- ``output_kind`` (vLLM's ``RequestOutputKind``): every step's cumulative output, only
  each step's additions, or only the final output.
- Sample ``i`` of a request with ``n > 1`` and seed ``s`` uses seed ``s + i``
  (see :meth:`SamplingParams.derived_seed`), so ``n=4, seed=s`` samples exactly what
  four ``n=1`` requests with seeds ``s, s+1, s+2, s+3`` sample.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NoReturn

from pagedllm.request_errors import InvalidRequestError
from pagedllm.structured_output import GrammarMatchers, StructuredOutputsParams

if TYPE_CHECKING:
    from pagedllm.tokenizer import Tokenizer

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1
"""The range of ``seed`` and ``top_k`` (vLLM's: a torch int64)."""

MAX_LOGIT_BIAS = 100.0
"""Largest bias magnitude ``logit_bias`` accepts (OpenAI's)."""

GREEDY_TEMPERATURE = 1e-5
"""Temperatures strictly below this decode greedily (vLLM uses the same cut-off)."""


class RequestOutputKind(enum.Enum):
    """Which outputs ``LLMEngine.step`` returns for a request (vLLM's names and values).

    CUMULATIVE: one after every step that touched the request, with the text, tokens and
    logprobs so far (and the step's additions in the ``delta_`` fields). DELTA: the same
    outputs, but ``text``, ``token_ids`` and ``logprobs`` hold only that step's
    additions. FINAL_ONLY: one output, when the request finishes (what ``LLM.generate``
    asks for: no per-step copies of growing outputs)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _reject(field: str, value: object, rule: str) -> NoReturn:
    raise InvalidRequestError(f"{field} {rule}, got {value!r}", param=field)


@dataclass
class SamplingParams:
    """Decoding options of one request; see the module docstring for conventions."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    bad_words_token_ids: list[list[int]] | None = field(default=None, init=False, repr=False)
    """``bad_words`` as token sequences, set by :meth:`check_for_model`."""
    grammar_matchers: GrammarMatchers | None = field(default=None, init=False, repr=False)
    """The compiled ``structured_outputs``, set by :meth:`check_for_model`."""

    def __post_init__(self) -> None:
        self._check_counts()
        self._check_distribution_options()
        self._check_penalties()
        self.stop = self._normalised_stop(self.stop)
        self.stop_token_ids = self._normalised_stop_token_ids(self.stop_token_ids)
        self._check_token_constraints()
        if not isinstance(self.output_kind, RequestOutputKind):
            _reject("output_kind", self.output_kind, "must be a RequestOutputKind")
        if self.top_k == -1:
            self.top_k = 0

    def _check_counts(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            _reject("n", self.n, "must be an integer >= 1")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            _reject("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            _reject("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _reject("min_tokens", self.min_tokens, f"must be <= max_tokens={self.max_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                _reject(name, value, "must be an integer >= 0 or None")
        seed = self.seed
        if seed is not None and not (_is_int(seed) and INT64_MIN <= seed <= INT64_MAX):
            _reject("seed", self.seed, "must be an integer in [-2**63, 2**63 - 1] or None")

    def _check_distribution_options(self) -> None:
        if not _is_finite(self.temperature) or self.temperature < 0.0:
            _reject("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _reject("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            _reject("top_k", self.top_k, "must be an integer >= 1, or 0 or -1 to disable")
        if not _is_finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _reject("min_p", self.min_p, "must be in [0, 1]")

    def _check_penalties(self) -> None:
        if not _is_finite(self.presence_penalty) or not -2.0 <= self.presence_penalty <= 2.0:
            _reject("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not _is_finite(self.frequency_penalty) or not -2.0 <= self.frequency_penalty <= 2.0:
            _reject("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not _is_finite(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            _reject("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")

    @staticmethod
    def _normalised_stop(stop: object) -> list[str]:
        if stop is None:
            return []
        strings = [stop] if isinstance(stop, str) else stop
        if not isinstance(strings, (list, tuple)) or not all(
            isinstance(s, str) and s for s in strings
        ):
            _reject("stop", stop, "must be a non-empty string, a list of them, or None")
        return list(strings)

    @staticmethod
    def _normalised_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            _reject("stop_token_ids", ids, "must be a list of token ids >= 0, or None")
        return list(ids)

    def _check_token_constraints(self) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping) or not all(
                _is_int(t) and t >= 0 and _is_finite(b) and abs(b) <= MAX_LOGIT_BIAS
                for t, b in bias.items()
            ):
                _reject("logit_bias", bias, "must map token ids >= 0 to biases in [-100, 100]")
            self.logit_bias = {int(t): float(b) for t, b in bias.items()}
        allowed = self.allowed_token_ids
        if allowed is not None:
            if (
                not isinstance(allowed, (list, tuple))
                or not allowed
                or not all(_is_int(t) and t >= 0 for t in allowed)
            ):
                _reject("allowed_token_ids", allowed, "must be a non-empty list of token ids >= 0")
            self.allowed_token_ids = list(allowed)
        words = self.bad_words
        if words is not None:
            if not isinstance(words, (list, tuple)) or not all(
                isinstance(w, str) and w.strip() for w in words
            ):
                _reject("bad_words", words, "must be a list of words that are not blank")
            self.bad_words = list(words)
        structured = self.structured_outputs
        if structured is not None:
            if not isinstance(structured, StructuredOutputsParams):
                _reject("structured_outputs", structured, "must be a StructuredOutputsParams")
            if self.ignore_eos or self.min_tokens > 0:
                _reject(
                    "structured_outputs",
                    structured,
                    "cannot be combined with ignore_eos or min_tokens (the grammar ends it)",
                )
            if self.allowed_token_ids is not None or self.bad_words is not None:
                _reject(
                    "structured_outputs",
                    structured,
                    "cannot be combined with allowed_token_ids or bad_words (the grammar "
                    "decides which tokens may come)",
                )

    def check_for_model(self, vocab_size: int, tokenizer: Tokenizer | None) -> None:
        """Check token ids against ``vocab_size``, resolve ``bad_words`` and compile
        ``structured_outputs`` with the model's tokenizer (None when it has none).
        Raises ``InvalidRequestError`` naming the field."""
        if self.structured_outputs is not None:
            if tokenizer is None:
                _reject("structured_outputs", self.structured_outputs, "needs a tokenizer")
            self.grammar_matchers = tokenizer.grammar_compiler(vocab_size)(self.structured_outputs)
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(self, name) or ()
            outside = [t for t in ids if t >= vocab_size]
            if outside:
                _reject(name, outside[0], f"must hold token ids in [0, {vocab_size})")
        if self.bad_words:
            self._resolve_bad_words(vocab_size, tokenizer)
        self._check_some_token_allowed(tokenizer)

    def _check_some_token_allowed(self, tokenizer: Tokenizer | None) -> None:
        """``allowed_token_ids`` must keep a token that no one-token bad word bans, and
        before ``min_tokens`` one that is not a stop id."""
        if self.allowed_token_ids is None:
            return
        banned = {ids[0] for ids in self.bad_words_token_ids or () if len(ids) == 1}
        if self.min_tokens > 0:
            banned.update(self.stop_token_ids)
            if tokenizer is not None and not self.ignore_eos:
                banned.update(tokenizer.stop_token_ids)
        if set(self.allowed_token_ids) <= banned:
            _reject(
                "allowed_token_ids",
                self.allowed_token_ids,
                "must keep a token that bad_words and min_tokens do not ban",
            )

    def _resolve_bad_words(self, vocab_size: int, tokenizer: Tokenizer | None) -> None:
        if tokenizer is None:
            _reject("bad_words", self.bad_words, "needs a model with a tokenizer")

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = encode(word.lstrip())
            sequences.append(plain)
            spaced = encode(" " + word.lstrip())
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                sequences.append(spaced)
        for ids in sequences:
            if not ids or any(t >= vocab_size for t in ids):
                _reject("bad_words", self.bad_words, f"must encode to ids in [0, {vocab_size})")
        self.bad_words_token_ids = sequences

    @property
    def is_greedy(self) -> bool:
        """True when the next token is the argmax of the (penalised) logits."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any of the three penalties changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def derived_seed(self, sample_index: int) -> int | None:
        """Seed of sample ``sample_index`` (0-based, < n): ``seed + sample_index``.

        None when the request is unseeded.
        """
        if not 0 <= sample_index < self.n:
            _reject("sample_index", sample_index, f"must be in [0, n={self.n})")
        return None if self.seed is None else self.seed + sample_index


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number (int or float, not bool) that is neither NaN nor infinite."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False
