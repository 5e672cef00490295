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
    entries: Sequence[TokenLogprobs],
    texts: TokenTexts,
    text_offset: int,
    num_top: int,
    unscored_first: int | None = None,
) -> dict[str, object]:
    """The legacy completions shape: parallel lists, ``text_offset`` in characters
    from ``text_offset`` (where these tokens start in the choice's text), and per token
    its ``num_top`` most likely alternatives plus the token itself when it is not among
    them: at most ``num_top + 1`` entries, most likely first, as OpenAI and vLLM give
    them (``num_top`` 0: the token alone). Keyed by text: of entries with the same text,
    such as two partial UTF-8 bytes, the most likely. ``unscored_first``: a token before
    ``entries`` that has no logprob (an echoed prompt's first), listed with nulls."""
    tokens, offsets, token_logprobs, top_logprobs = [], [], [], []
    if unscored_first is not None:
        tokens.append(texts.text(unscored_first))
        offsets.append(text_offset)
        token_logprobs.append(None)
        top_logprobs.append(None)
        text_offset += len(tokens[-1])
    for entry in entries:
        offsets.append(text_offset)
        token = texts.text(entry.token_id)
        tokens.append(token)
        text_offset += len(token)
        token_logprobs.append(entry.logprob)
        top_logprobs.append(_top_with_token(entry, texts, num_top))
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _top_with_token(entry: TokenLogprobs, texts: TokenTexts, num_top: int) -> dict[str, float]:
    """``{text: logprob}`` of the ``num_top`` most likely tokens and the entry's own
    token, most likely first (a token outside the top is no more likely than any in it,
    so it comes last); the first of entries sharing a text keeps it."""
    top: dict[str, float] = {}
    for tid, lp in [*entry.top[:num_top], (entry.token_id, entry.logprob)]:
        top.setdefault(texts.text(tid), lp)
    return top


def prompt_logprobs_json(
    entries: Sequence[TokenLogprobs | None], texts: TokenTexts, num_top: int
) -> list[dict[str, dict[str, object]] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else the token
    and its ``num_top`` most likely alternatives by id, each with logprob, rank (1 for
    the most likely) and text."""

    def item(logprob: float, rank: int, token_id: int) -> dict[str, object]:
        return {"logprob": logprob, "rank": rank, "decoded_token": texts.text(token_id)}

    shown: list[dict[str, dict[str, object]] | None] = []
    for entry in entries:
        if entry is None:
            shown.append(None)
            continue
        alternatives = {
            str(tid): item(lp, rank, tid)
            for rank, (tid, lp) in enumerate(entry.top[:num_top], start=1)
        }
        shown.append({str(entry.token_id): item(entry.logprob, entry.rank, entry.token_id)})
        shown[-1].update(alternatives)
    return shown


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
