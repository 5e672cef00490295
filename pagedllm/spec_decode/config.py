"""``speculative_config``: how an engine guesses tokens ahead, in vLLM's shape.

Given as a dict (``LLM(speculative_config={...})``) or its JSON text (``pagedllm serve
--speculative-config '{...}'``), parsed once into :class:`SpeculativeConfig`. Every key
is checked: an unknown key or one the chosen method does not read is refused, naming
it, never ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.choice import Choice, parse_choice

MAX_SPECULATIVE_TOKENS = 16
"""Most tokens one step may guess per sequence (each is a query row in the step)."""


class SpeculativeMethod(Choice):
    """Where the guesses come from: the sequence's own earlier n-grams, suffix trees of
    its history and of earlier requests' outputs, or a draft model."""

    NGRAM = "ngram"
    SUFFIX = "suffix"
    DRAFT_MODEL = "draft_model"


_KEYS = {
    SpeculativeMethod.NGRAM: {"prompt_lookup_min", "prompt_lookup_max"},
    SpeculativeMethod.SUFFIX: {
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    },
    SpeculativeMethod.DRAFT_MODEL: {
        "model",
        "quantization",
        "dtype",
        "activation_quantization",
        "draft_vocab_size",
    },
}
_COMMON_KEYS = {"method", "num_speculative_tokens", "adaptive_draft_length"}

DEFAULT_PROMPT_LOOKUP = (2, 4)
"""(min, max) n-gram lengths when neither is given; one given sets the other to it, as
vLLM does."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``speculative_config``. ``num_speculative_tokens``: the most tokens
    guessed per sequence and step (the engine may guess fewer, down to none, when its
    measurements say a step would not pay; :mod:`pagedllm.spec_decode.draft_length`).
    ``prompt_lookup_min``/``max``: n-gram lengths (tokens) the ``ngram`` method matches;
    ``suffix_*``: the ``suffix`` method's tree bounds; ``model``: the ``draft_model``
    method's checkpoint (``"default"`` or a path; the target's own checkpoint too), with
    its ``quantization`` (``auto``, ``none``, ``int8``: as the engine's knob), ``dtype``
    (``auto``, ``float32``, ``bfloat16``) and ``activation_quantization`` (``none``,
    ``int8``); unset: ``auto``, ``auto`` and ``none``, whatever the target's are.
    ``draft_vocab_size`` (not a vLLM key for this method): the draft scores only the
    first this many token ids and each sequence's own tokens
    (:mod:`pagedllm.engine.draft_head`); unset: the whole vocabulary.
    ``adaptive_draft_length`` (on by default; not a vLLM key): off, every proposal is
    run in full whatever it costs, as vLLM does."""

    method: SpeculativeMethod
    num_speculative_tokens: int
    adaptive_draft_length: bool = True
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP[0]
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP[1]
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None
    quantization: str | None = None
    dtype: str | None = None
    activation_quantization: str | None = None
    draft_vocab_size: int | None = None

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative_config: num_speculative_tokens must be an integer in "
                f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        if not isinstance(self.adaptive_draft_length, bool):
            raise ValueError(
                "speculative_config: adaptive_draft_length must be true or false, got "
                f"{self.adaptive_draft_length!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not 1 <= low <= high:
            raise ValueError(
                "speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {low} and {high}"
            )
        size = self.draft_vocab_size
        if size is not None and (not isinstance(size, int) or size < 1):
            raise ValueError(
                f"speculative_config: draft_vocab_size must be a positive integer, got {size!r}"
            )
        if self.method is SpeculativeMethod.DRAFT_MODEL and not self.model:
            raise ValueError("speculative_config: method 'draft_model' needs a 'model'")

    @classmethod
    def parse(
        cls, value: SpeculativeConfig | dict[str, Any] | str | None
    ) -> SpeculativeConfig | None:
        """``value`` (a config, a dict, its JSON text, or None: no speculation) as a
        config; ValueError naming the offending key otherwise."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        fields = dict(value)
        if "method" not in fields or "num_speculative_tokens" not in fields:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        method = parse_choice(SpeculativeMethod, fields["method"], "speculative_config.method")
        unknown = set(fields) - _COMMON_KEYS - _KEYS[method]
        if unknown:
            raise ValueError(
                f"speculative_config: method {method.value!r} does not take "
                f"{', '.join(sorted(unknown))} (it takes "
                f"{', '.join(sorted(_COMMON_KEYS | _KEYS[method]))})"
            )
        fields["method"] = method
        if method is SpeculativeMethod.NGRAM:
            low, high = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
            if low is None and high is None:
                low, high = DEFAULT_PROMPT_LOOKUP
            fields["prompt_lookup_min"] = high if low is None else low
            fields["prompt_lookup_max"] = low if high is None else high
        return cls(**fields)
