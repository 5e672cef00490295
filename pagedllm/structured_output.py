"""Structured outputs: a grammar decides which tokens may come next (xgrammar).

A request asks for one of vLLM's constraints (:class:`StructuredOutputsParams`): a JSON
schema, any JSON object, a regular expression, a choice of strings, or an EBNF grammar.
:class:`GrammarCompiler` (one per tokenizer and vocabulary size) compiles it once per
distinct constraint and caches it. Each sequence follows the grammar with a matcher
that has consumed exactly the sequence's output tokens; :class:`GrammarMatchers` finds
or rebuilds it from those tokens, so it needs no hook in the engine and survives
preemption (the tokens are the state). The sampler sets every token the matchers
forbid to ``-inf``, for all constrained rows of a batch at once, from one bitmask.

The grammar ends with the engine's stop tokens: once the structure is complete only a
stop token is allowed, so a constrained request cannot also use ``ignore_eos`` or
``min_tokens`` (refused).

JSON (a schema or any object) is compact by default: xgrammar fixes the separators to
``", "`` and ``": "`` with no other whitespace between tokens (vLLM's
``disable_any_whitespace``, which vLLM leaves off). Any JSON whitespace lets a small model
pad its output with newlines; docs/structured_outputs.md has the measurements. A
request's ``compact_json`` decides, else the compiler's default (the engine's
``disable_any_whitespace``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedllm.request_errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
ANY_OBJECT = '{"type": "object"}'
"""The schema of ``json_object``: any JSON object (any keys and values), as vLLM has it."""
COMPACT_JSON_BY_DEFAULT = True
"""The default of ``disable_any_whitespace``: compact JSON (see the module's docstring)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's structured-output request: exactly one of the fields is set.

    ``json``: a JSON schema (a dict, or its JSON text); ``json_object``: any JSON
    object; ``regex``: a regular expression; ``choice``: one of these strings;
    ``grammar``: an EBNF grammar (GBNF, with a ``root`` rule). ``compact_json``: JSON
    output (``json`` or ``json_object``) has no whitespace between tokens but one space
    after each ``,`` and ``:`` (True, as tool calls are written), or any JSON whitespace
    (False); None leaves it to the engine (``disable_any_whitespace``). Ignored by the
    other kinds.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    compact_json: bool | None = None

    def __post_init__(self) -> None:
        chosen = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(chosen) != 1:
            raise InvalidRequestError(
                f"structured outputs take exactly one of {', '.join(KINDS)}, got {chosen}",
                "structured_outputs",
            )
        if self.choice is not None:
            if not all(isinstance(c, str) and c for c in self.choice) or not self.choice:
                raise InvalidRequestError(
                    "choice must be a non-empty list of non-empty strings", "structured_outputs"
                )
            object.__setattr__(self, "choice", tuple(self.choice))

    def key(self) -> tuple[str, str]:
        """``(kind, text)``, equal for equal constraints (``compact_json`` aside)."""
        if self.json is not None:
            return ("json", self.json if isinstance(self.json, str) else json.dumps(self.json))
        if self.json_object:
            return ("json_object", "")
        if self.choice is not None:
            return ("choice", json.dumps(list(self.choice)))
        if self.regex is not None:
            return ("regex", self.regex)
        return ("grammar", self.grammar or "")


def _choice_regex(choices: Sequence[str]) -> str:
    special = set("\\^$.|?*+()[]{}")
    escaped = ["".join("\\" + c if c in special else c for c in choice) for choice in choices]
    return "(" + "|".join(escaped) + ")"


_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ", re.MULTILINE)
"""The time and source location xgrammar puts before its messages."""


def _xgrammar_reason(error: Exception) -> str:
    """xgrammar's message without its time stamp and source file (nothing a client
    can use, and nothing of the server's to show)."""
    return _XGRAMMAR_LOG_PREFIX.sub("", str(error)).strip()


class GrammarCompiler:
    """Compiles constraints for one tokenizer and vocabulary, each distinct one once.

    ``stop_token_ids``: the engine's stop set, the tokens that may end a structure.
    ``compact_json``: whether JSON is compact when a request leaves it to the engine.
    """

    def __init__(
        self,
        hf_tokenizer,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        compact_json: bool = COMPACT_JSON_BY_DEFAULT,
    ) -> None:
        import xgrammar

        info = xgrammar.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self._compiler = xgrammar.GrammarCompiler(info)
        self._cache: dict[tuple[str, str, bool], object] = {}
        self.vocab_size = vocab_size
        self.compact_json = compact_json

    def __call__(self, params: StructuredOutputsParams) -> GrammarMatchers:
        """Matchers for a request with ``params``; InvalidRequestError if it does not
        compile (a bad schema, regex or grammar)."""
        key = (*params.key(), self._compact(params))
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self._compile(params, key[2])
            except Exception as error:  # xgrammar's own error types, all about this input
                raise InvalidRequestError(
                    f"the {key[0]} constraint does not compile: {_xgrammar_reason(error)}",
                    "structured_outputs",
                ) from None
            self._cache[key] = compiled
        return GrammarMatchers(compiled, self.vocab_size)

    def _compact(self, params: StructuredOutputsParams) -> bool:
        """Whether ``params`` asks for compact JSON (False for the other kinds)."""
        if params.json is None and not params.json_object:
            return False
        return self.compact_json if params.compact_json is None else params.compact_json

    def _compile(self, params: StructuredOutputsParams, compact: bool):
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else ANY_OBJECT
            return self._compiler.compile_json_schema(schema, any_whitespace=not compact)
        if params.choice is not None:
            return self._compiler.compile_regex(_choice_regex(params.choice))
        if params.regex is not None:
            return self._compiler.compile_regex(params.regex)
        return self._compiler.compile_grammar(params.grammar)


class GrammarMatchers:
    """The matchers of one request's sequences, keyed by the output ids each consumed.

    A matcher's state is a function of the tokens it consumed, so sequences with equal
    outputs share one. A matcher moves forward with its output: the one for an output
    less its last token is taken and fed that token. When that one is gone, a matcher
    that went further down the same output (a speculative step's rows extend an output
    by guesses, and the step keeps only some of them) is rolled back to it; failing
    that, a new one is fed the whole output. Lives as long as the request's
    ``SamplingParams``.
    """

    def __init__(self, compiled, vocab_size: int) -> None:
        self._compiled = compiled
        self.vocab_size = vocab_size
        self._by_output: dict[tuple[int, ...], object] = {}

    def fill_mask(self, output: Sequence[int], bitmask: torch.Tensor, index: int) -> None:
        """Write the allowed next tokens after ``output`` into row ``index`` of ``bitmask``."""
        self._matcher(tuple(output)).fill_next_token_bitmask(bitmask, index)

    def num_accepted(self, output: Sequence[int], tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar allows after ``output`` before
        one it refuses or one that ends it (a guess is cut there: no token may follow
        the end, and the model can propose the stop token itself); the matcher is left
        as it was."""
        matcher = self._matcher(tuple(output))
        fed = allowed = 0
        for token_id in tokens:
            if not matcher.accept_token(token_id):
                break
            fed += 1
            if matcher.is_terminated():
                break
            allowed = fed
        if fed:
            matcher.rollback(fed)
        return allowed

    def _matcher(self, output: tuple[int, ...]):
        matcher = self._by_output.get(output)
        if matcher is not None:
            return matcher
        parent = output[:-1]
        matcher = self._by_output.pop(parent, None) if output else None
        if matcher is None and output:
            matcher = self._rolled_back_to(parent)
        fed = output[-1:] if matcher is not None else output
        if matcher is None:
            import xgrammar

            matcher = xgrammar.GrammarMatcher(self._compiled)
        for token_id in fed:
            if not matcher.accept_token(token_id):
                raise InvalidRequestError(
                    f"token {token_id} breaks the structured output's grammar",
                    "structured_outputs",
                )
        self._by_output[output] = matcher
        return matcher

    def _rolled_back_to(self, output: tuple[int, ...]):
        """A matcher that consumed ``output`` and more, taken and rolled back to
        ``output``; None when there is none."""
        for key in self._by_output:
            if len(key) > len(output) and key[: len(output)] == output:
                matcher = self._by_output.pop(key)
                matcher.rollback(len(key) - len(output))
                return matcher
        return None


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``[num_rows, ceil(vocab / 32)]`` int32: bit ``t`` of a row allows token ``t``."""
    import xgrammar

    return xgrammar.allocate_token_bitmask(num_rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set, in place, every logit whose bit is clear to ``-inf`` (rows aligned)."""
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=logits.shape[-1]
    )
