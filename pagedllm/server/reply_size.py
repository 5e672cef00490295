"""How large a reply a request may ask for: its logprob entries, bounded.

Logprobs are what can make one legal request's reply enormous: echoing a 4,000-token
prompt with 20 alternatives per position to 128 samples is ten million entries, some
300 MB of JSON. A request is refused up front (400) when its worst case exceeds the
server's ``max_logprob_entries``, as ``max_n`` bounds ``n``. An entry is one token with
its logprob at one position of one sample: the chosen token and each alternative.
"""

from __future__ import annotations

from pagedllm.engine.sampling_params import SamplingParams
from pagedllm.request_errors import InvalidRequestError

DEFAULT_MAX_LOGPROB_ENTRIES = 1_000_000
"""About 30 MB of JSON: an evaluation harness scoring a batch of 16 prompts of 16k
tokens each (``echo`` with ``logprobs=1``) fits, as does a chat reply of 8k tokens with
20 alternatives per position for each of 5 samples."""


def logprob_entries(params: SamplingParams, prompt_len: int, max_model_len: int) -> int:
    """The most logprob entries one engine request's reply holds: per sample, every
    prompt position with ``prompt_logprobs`` (the echo repeats them in every choice)
    and every output position with ``logprobs``, each position listing its token and
    its alternatives. Output positions count at ``max_tokens`` (the context left when
    unset)."""
    per_prompt_position = 0 if params.prompt_logprobs is None else params.prompt_logprobs + 1
    per_output_position = 0 if params.logprobs is None else params.logprobs + 1
    room = max(max_model_len - prompt_len, 0)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    per_sample = prompt_len * per_prompt_position + max_tokens * per_output_position
    return params.n * per_sample


def check_logprob_entries(params: SamplingParams, entries: int, limit: int) -> None:
    """InvalidRequestError when a request's ``entries`` (all its prompts) exceed
    ``limit``, naming the field that asked for them."""
    if entries <= limit:
        return
    param = "prompt_logprobs" if params.logprobs is None else "logprobs"
    raise InvalidRequestError(
        f"this request could return {entries:,} logprob entries (positions x (top "
        f"logprobs + 1) x samples), beyond this server's limit of {limit:,} "
        "(--max-logprob-entries); ask for fewer alternatives, samples or tokens",
        param,
    )
