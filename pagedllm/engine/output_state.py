"""Per-sequence output bookkeeping: text so far, stop conditions, streaming deltas.

Stop strings never reach the user: while a sequence runs, the last
``max(len(stop)) - 1`` characters of its text are held back, since they could be the
start of a stop string that the next token completes.
"""

from __future__ import annotations

from pagedllm.engine.outputs import CompletionOutput
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.engine.sequence import SequenceStatus, TokenSequence


class SequenceDetokenizer:
    """Turns a sequence's sampled tokens into text and decides when it is done."""

    def __init__(self, seq: TokenSequence, decoder, eos_token_ids: set[int], max_tokens: int):
        """``eos_token_ids``: the model's end-of-generation ids (ignored with
        ``ignore_eos``); ``decoder``: an incremental decoder, or None for no text;
        ``max_tokens``: output tokens after which the sequence stops with "length"."""
        self.seq = seq
        self.params: SamplingParams = seq.params
        self._decoder = decoder
        self._eos_token_ids = set() if seq.params.ignore_eos else eos_token_ids
        self.max_tokens = max_tokens
        self._stops: list[str] = list(seq.params.stop)
        self._hold_back = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""
        self._emitted_chars = 0
        self._emitted_tokens = 0
        self.logprobs: list[TokenLogprobs] | None = [] if seq.params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if self.logprobs is not None else None

    def add_token(self, token_id: int, logprobs: TokenLogprobs | None) -> SequenceStatus | None:
        """Record a sampled token; return the finished status it causes, if any.

        The sampler already masks eos and stop ids until ``min_tokens`` is reached.
        """
        seq = self.seq
        seq.append_token(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs.logprob
        if token_id in self._eos_token_ids or token_id in self.params.stop_token_ids:
            if token_id not in self._eos_token_ids:
                seq.stop_reason = token_id
            return SequenceStatus.FINISHED_STOPPED
        if self._decoder is not None:
            self.text += self._decoder.add(token_id)
        if self._stops and self._truncate_at_stop_string():
            return SequenceStatus.FINISHED_STOPPED
        if seq.num_output_tokens >= self.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def _truncate_at_stop_string(self) -> bool:
        """Cut ``text`` at the first stop string, searching only where one can newly end."""
        start = max(0, self._emitted_chars - self._hold_back)
        hits = [(self.text.find(stop, start), stop) for stop in self._stops]
        hits = [(pos, stop) for pos, stop in hits if pos >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        self.seq.stop_reason = stop
        end = pos + len(stop) if self.params.include_stop_str_in_output else pos
        self.text = self.text[:end]
        return True

    def snapshot(self, finished: bool) -> CompletionOutput:
        """The output so far plus what is new since the previous snapshot; with
        ``output_kind`` DELTA, ``text``, ``token_ids`` and ``logprobs`` hold only the new
        part too."""
        seq = self.seq
        visible = len(self.text) if finished else max(0, len(self.text) - self._hold_back)
        visible = max(visible, self._emitted_chars)
        delta_text = self.text[self._emitted_chars : visible]
        delta_tokens = seq.output_token_ids[self._emitted_tokens :]
        new_from = self._emitted_tokens
        self._emitted_chars = visible
        self._emitted_tokens = seq.num_output_tokens
        if self.params.output_kind is RequestOutputKind.DELTA:
            text, token_ids = delta_text, delta_tokens
            logprobs = None if self.logprobs is None else self.logprobs[new_from:]
        else:
            text, token_ids = self.text[:visible], list(seq.output_token_ids)
            logprobs = self.logprobs
        return CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta_text,
            delta_token_ids=delta_tokens,
        )
