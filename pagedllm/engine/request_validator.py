"""Admission: whether a request can ever run on one engine, decided before it is queued.

A request is checked against the model (its prompt's token ids in the vocabulary, text
the tokenizer can encode), the engine's limits (``max_n``, ``max_model_len``) and the KV
pool: its worst case, every sample reaching ``max_tokens``
(:func:`~pagedllm.kv.capacity.request_worst_case_blocks`), must fit the blocks its
priority may take. A refusal raises :class:`~pagedllm.request_errors.InvalidRequestError`
naming the field; a request that passes may wait for blocks but never fails for want of
them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedllm.config import EngineConfig
from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.kv.block_manager import BlockManager
from pagedllm.kv.capacity import grouped_worst_case_blocks, recent_blocks
from pagedllm.request_errors import InvalidRequestError
from pagedllm.tokenizer import Tokenizer

PromptInput = str | Mapping[str, object]


class RequestValidator:
    """The checks of requests for an engine of ``config`` over ``block_manager``'s pool,
    a model of ``vocab_size`` tokens with ``tokenizer`` (None: token ids only), and
    sequences of at most ``max_model_len`` tokens."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        block_manager: BlockManager,
    ) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.block_manager = block_manager

    def tokenize_prompt(self, prompt: PromptInput | Sequence[int]) -> tuple[str | None, list[int]]:
        """The prompt's text (None if given as ids only) and its checked token ids.

        ``prompt``: text, a list of token ids, ``{"prompt": text}`` or
        ``{"prompt_token_ids": [...]}`` (its ``"prompt"``, if any, is returned as text).
        """
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" not in prompt:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer; pass prompt_token_ids")
            _check_unicode(prompt)
            return prompt, self._check_ids(self.tokenizer.encode(prompt))
        return None, self._check_ids(prompt)

    def check(self, prompt_len: int, params: SamplingParams, priority: int) -> int:
        """Refuse ``params`` for a ``prompt_len``-token prompt at ``priority`` if the
        request can never run here; else return its output token limit (``max_tokens``,
        or what ``max_model_len`` leaves)."""
        self._check_params(params)
        max_tokens = self._check_lengths(prompt_len, params)
        self._check_fits(prompt_len, max_tokens, params.n, priority)
        return max_tokens

    def capacity_blocks(self, priority: int = 0) -> int:
        """Blocks one request of ``priority`` may ever hold: the whole pool when
        ``priority < 0``, else the pool less the reserve (full-size blocks, and the
        compact ones: any block of a sequence but its recent ones may be compact)."""
        pool = self.block_manager.pool
        full = pool.num_blocks - (0 if priority < 0 else pool.num_reserved)
        return full + pool.num_compact_blocks

    def worst_case_blocks(self, prompt_len: int, max_tokens: int, n: int) -> int:
        """Most blocks a request of ``n`` samples (or beams) of a ``prompt_len``-token
        prompt and up to ``max_tokens`` more tokens each holds at once on this engine:
        :func:`~pagedllm.kv.capacity.grouped_worst_case_blocks` under its allocation mode
        (contiguous: ``max_model_len`` slots up front) and the windows of its layer
        groups (a step computes at most ``max_num_batched_tokens`` tokens of a
        sequence)."""
        manager = self.block_manager
        return grouped_worst_case_blocks(
            prompt_len,
            max_tokens,
            n,
            self.config.block_size,
            manager.windows,
            upfront_tokens=manager.upfront_tokens,
            step_tokens=self.config.max_num_batched_tokens,
        )

    def _check_ids(self, token_ids: object) -> list[int]:
        if not isinstance(token_ids, Sequence) or isinstance(token_ids, str):
            raise InvalidRequestError("prompt_token_ids must be a list of integers", "prompt")
        ids = list(token_ids)
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        vocab = self.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(
                f"prompt token ids must be integers in [0, {vocab})", "prompt"
            )
        return ids

    def _check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: limits of this engine and model."""
        if params.n > self.config.max_n:
            raise InvalidRequestError(
                f"n must be <= {self.config.max_n} (this engine's max_n), got {params.n}", "n"
            )
        vocab = self.vocab_size
        outside = [t for t in params.stop_token_ids if t >= vocab]
        if outside:
            raise InvalidRequestError(
                f"stop_token_ids must be token ids in [0, {vocab}), got {outside[0]}",
                "stop_token_ids",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > vocab:
                raise InvalidRequestError(
                    f"{name} must be <= the vocabulary size {vocab}, got {value}", name
                )

    def _check_lengths(self, prompt_len: int, params: SamplingParams) -> int:
        """The request's output token limit, or InvalidRequestError when it can never fit."""
        limit = self.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"the prompt is {prompt_len} tokens long, but max_model_len is {limit} "
                "(prompt plus at least one output token must fit)",
                "prompt",
            )
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) is "
                f"{prompt_len + max_tokens} tokens, beyond max_model_len={limit}",
                "max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= the {max_tokens} output tokens this prompt leaves, "
                f"got {params.min_tokens}",
                "min_tokens",
            )
        return max_tokens

    def _check_fits(self, prompt_len: int, max_tokens: int, n: int, priority: int) -> None:
        """Refuse a request whose worst case (:meth:`worst_case_blocks`: all ``n``
        samples reaching ``max_tokens``) holds more blocks than the pool gives its
        priority (:meth:`capacity_blocks`); any other request fits."""
        worst_case = self.worst_case_blocks(prompt_len, max_tokens, n)
        capacity = self.capacity_blocks(priority)
        full_capacity = capacity - self.block_manager.pool.num_compact_blocks
        self._check_recent_blocks(prompt_len + max_tokens, n, full_capacity)
        if worst_case > capacity:
            raise InvalidRequestError(
                f"n={n} samples of up to {prompt_len + max_tokens} tokens each may need "
                f"{worst_case} KV blocks, but the pool holds {capacity} for this request; "
                "lower n or max_tokens",
                "n" if n > 1 else "max_tokens",
            )

    def _check_recent_blocks(self, num_tokens: int, n: int, full_capacity: int) -> None:
        """Refuse ``n`` samples of up to ``num_tokens`` tokens whose recent windows alone
        (with compact blocks: the blocks no sample can re-encode yet) exceed the
        full-size blocks it may hold: one sample computing a whole step's tokens, the
        others decoding."""
        manager = self.block_manager
        if manager.recent_tokens is None:
            return
        recent, block_size = manager.recent_tokens, manager.block_size
        step = min(self.config.max_num_batched_tokens, num_tokens)
        needed = recent_blocks(recent, step, block_size)
        needed += (n - 1) * recent_blocks(recent, 1, block_size)
        if needed > full_capacity:
            raise InvalidRequestError(
                f"n={n} samples keep their newest {manager.recent_tokens} tokens in up to "
                f"{needed} full-size KV blocks, but the pool holds {full_capacity} for this "
                "request; lower n (or kv_recent_tokens)",
                "n",
            )


def _check_unicode(text: str) -> None:
    """Refuse text a tokenizer cannot encode: lone UTF-16 surrogates (``"\\udc00"``)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"the prompt is not valid Unicode: a lone surrogate {text[error.start]!r} at "
            f"character {error.start}",
            "prompt",
        ) from None
