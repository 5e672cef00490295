"""Engine outputs as OpenAI JSON: whole responses, streaming chunks, logprobs, usage.

Choice indices: a request with ``n`` samples and a batch of prompts numbers its
choices ``prompt_index * n + sample_index``, as OpenAI and vLLM do.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

from pagedllm.engine.outputs import CompletionOutput, RequestOutput
from pagedllm.engine.sampler import TokenLogprobs
from pagedllm.tokenizer import Tokenizer


class TokenTexts:
    """The text of single token ids (special tokens kept), memoised."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def new_logprobs(output: CompletionOutput) -> list[TokenLogprobs]:
    """Logprobs of the tokens this snapshot added (``delta_token_ids``)."""
    if output.logprobs is None:
        return []
    end = len(output.token_ids)
    return output.logprobs[end - len(output.delta_token_ids) : end]


def chat_logprobs(entries: Sequence[TokenLogprobs], texts: TokenTexts) -> dict[str, object]:
    """``{"content": [{token, logprob, bytes, top_logprobs}]}`` for chat choices."""

    def item(token_id: int, logprob: float) -> dict[str, object]:
        token = texts.text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {
                **item(entry.token_id, entry.logprob),
                "top_logprobs": [item(tid, lp) for tid, lp in entry.top],
            }
            for entry in entries
        ]
    }


def completion_logprobs(
    entries: Sequence[TokenLogprobs], texts: TokenTexts, text_offset: int
) -> dict[str, object]:
    """The legacy completions shape: parallel lists, ``text_offset`` in characters
    from ``text_offset`` (where these tokens start in the choice's text)."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(text_offset)
        token = texts.text(entry.token_id)
        tokens.append(token)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{texts.text(tid): lp for tid, lp in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def usage(outputs: Sequence[RequestOutput]) -> dict[str, int]:
    """Prompt tokens once per prompt, completion tokens of every sample."""
    prompt = sum(len(output.prompt_token_ids) for output in outputs)
    completion = sum(len(o.token_ids) for output in outputs for o in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def sse(payload: dict[str, object] | str) -> str:
    """One server-sent event; ``payload`` is JSON-encoded unless it is ``[DONE]``."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
