"""What the engine hands back, shaped like vLLM's ``RequestOutput``.

Times are seconds from ``time.monotonic()``; derived latencies are in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.sampler import TokenLogprobs


@dataclass
class CompletionOutput:
    """One generated sequence of a request (``index`` < n).

    ``text`` and ``token_ids`` are cumulative (only this step's additions when the
    request's ``output_kind`` is DELTA); ``delta_text`` and ``delta_token_ids`` hold what
    this step added (for streaming). ``text`` never contains a stop string
    (unless ``include_stop_str_in_output``) nor an incomplete UTF-8 character.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps of one request and the latencies users quote."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_output_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first (None below 2 tokens)."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        if self.num_output_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_output_tokens - 1)

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step (or at the end of ``LLM.generate``).

    ``error``: why the engine failed this request alone (its unfinished sequences then
    end with finish reason ``"abort"``); None for a request that ran normally.
    ``prompt_logprobs``: with ``SamplingParams.prompt_logprobs``, one entry per prompt
    token (None for the first, which nothing predicts); complete once the first
    output token exists.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None
