"""One user request: its prompt, its n sequences and their outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedllm.engine.output_state import SequenceDetokenizer
from pagedllm.engine.outputs import RequestMetrics, RequestOutput
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import RequestOutputKind


@dataclass
class RequestState:
    """Everything the engine keeps about a request until it finishes.

    ``unforked``: samples 1..n-1 of an ``n > 1`` request, waiting for sample 0 to finish
    the prompt so they can fork from it. ``error``: set when the engine failed this
    request alone (see ``LLMEngine``); its outputs then carry it. ``prompt_logprobs``:
    one entry per prompt token scored so far (None for the first), when asked for.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[SequenceDetokenizer]
    metrics: RequestMetrics
    unforked: list[SequenceDetokenizer] = field(default_factory=list)
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def output_kind(self) -> RequestOutputKind:
        return self.sequences[0].params.output_kind

    @property
    def finished(self) -> bool:
        return all(out.seq.is_finished for out in self.sequences)

    def output(self) -> RequestOutput:
        """A snapshot; each call advances the streaming deltas."""
        finished = self.finished
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[out.snapshot(out.seq.is_finished) for out in self.sequences],
            finished=finished,
            metrics=self.metrics,
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
        )
