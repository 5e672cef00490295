"""SuffixDecoding: draft tokens from suffix trees over a request's own tokens and over
the outputs of earlier requests.

Modelled on SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding
for Emerging AI Applications") as Arctic Inference implements it for vLLM. All lengths
and depths are counted in tokens.

Trees (:mod:`pagedllm.spec_decode.suffix_tree`, depth ``max_tree_depth``). Each request
has a tree over its prompt and output so far, updated with the tokens appended since
its previous proposal (amortized O(max_tree_depth) per token). The global tree holds
the outputs, not the prompts, of the last ``max_cached_requests`` finished requests
(those with at least one output token); finishing one more evicts the least recently
finished one's output whole.

Drafts. Each tree gives its best draft after the request's last tokens (the tree
module states the rule: ``max_spec_factor`` and ``min_token_prob`` are its ``factor``
and ``min_prob``); the request's tree's and the global tree's are compared by score
(ties: the request's). A match and its draft together never exceed ``max_tree_depth``
tokens.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.spec_decode.suffix_tree import SuffixTree, new_suffix_tree


@dataclass(frozen=True)
class SuffixConfig:
    """Knobs of :class:`SuffixProposer`."""

    max_tree_depth: int = 24
    """Longest string (tokens) stored per position; bounds match length + draft length
    (so 1 never drafts)."""
    max_cached_requests: int = 10000
    """Finished requests whose outputs the global tree keeps (0: no global tree)."""
    max_spec_factor: float = 1.0
    """A draft has at most ``floor(max_spec_factor * match length)`` tokens."""
    min_token_prob: float = 0.1
    """The draft stops before a token whose path probability is below this."""

    def __post_init__(self) -> None:
        for name in ("max_tree_depth", "max_cached_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an int, got {value!r}")
        if self.max_tree_depth < 1:
            raise ValueError(f"max_tree_depth must be positive, got {self.max_tree_depth}")
        if self.max_cached_requests < 0:
            raise ValueError(
                f"max_cached_requests must be non-negative, got {self.max_cached_requests}"
            )
        if not self.max_spec_factor > 0:
            raise ValueError(f"max_spec_factor must be positive, got {self.max_spec_factor}")
        if not 0.0 <= self.min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {self.min_token_prob}")


class _Request:
    """A request's tokens so far and its tree over them, where they are sequence 0."""

    __slots__ = ("tree", "tokens", "num_prompt_tokens")

    def __init__(self, tree: SuffixTree, num_prompt_tokens: int) -> None:
        self.tree = tree
        self.tree.extend(0, [])
        self.tokens: list[int] = []
        self.num_prompt_tokens = num_prompt_tokens

    def extend(self, token_ids: Sequence[int]) -> None:
        n = len(self.tokens)
        if len(token_ids) < n:
            raise ValueError(
                f"token_ids shrank from {n} to {len(token_ids)} tokens between proposals"
            )
        if len(token_ids) > n:
            new_tokens = [int(t) for t in token_ids[n:]]
            self.tokens.extend(new_tokens)
            self.tree.extend(0, new_tokens)


class SuffixProposer:
    """Draft tokens for running requests from their own tokens and from the outputs of
    finished requests (see the module docstring). ``native``: whether the trees are the
    C++ ones (None: when the CPU extension is built; both give the same drafts)."""

    def __init__(self, config: SuffixConfig, native: bool | None = None) -> None:
        self._config = config
        self._native = native
        self._requests: dict[str, _Request] = {}
        self._global = self._new_tree() if config.max_cached_requests else None
        self._cached: deque[int] = deque()  # global sequence ids, least recently finished first
        self._next_seq_id = 0

    def propose(
        self, request_id: str, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int
    ) -> list[int]:
        """Up to max_tokens draft tokens to follow token_ids (prompt + output so far of
        request_id). The per-request tree is created on first call and updated
        incrementally with the tokens appended since the previous call (token_ids only
        grows between calls of one request, except that it may be called again with the
        same tokens). max_tokens <= 0 returns [] (after the update: a last call with 0
        brings the tree up to date before :meth:`finish`). num_prompt_tokens is read on
        the first call only."""
        request = self._requests.get(request_id)
        if request is None:
            if num_prompt_tokens < 0:
                raise ValueError(f"num_prompt_tokens must be non-negative, got {num_prompt_tokens}")
            request = _Request(self._new_tree(), num_prompt_tokens)
            self._requests[request_id] = request
        request.extend(token_ids)
        if max_tokens <= 0:
            return []
        factor, min_prob = self._config.max_spec_factor, self._config.min_token_prob
        draft, score = request.tree.draft_after(0, max_tokens, factor, min_prob)
        if self._global is not None and self._cached:
            tokens = request.tokens
            context = tokens[max(0, len(tokens) - self._config.max_tree_depth + 1) :]
            global_draft, global_score = self._global.draft_matching(
                context, max_tokens, factor, min_prob
            )
            if global_score > score:
                draft = global_draft
        return draft

    def finish(self, request_id: str) -> None:
        """The request ended: drop its per-request tree, add its output tokens (not the
        prompt; those seen by the last :meth:`propose`) to the global tree, evicting the
        least recently finished requests' outputs beyond max_cached_requests. Unknown
        ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.add_output(request.tokens[request.num_prompt_tokens :])

    def add_output(self, output: Sequence[int]) -> None:
        """Add a finished request's output tokens to the global tree (as :meth:`finish`
        does), for a request never proposed for: no per-request tree is built."""
        if self._global is None or not output:
            return
        output = [int(t) for t in output]
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        self._global.insert(seq_id, output)
        self._cached.append(seq_id)
        while len(self._cached) > self._config.max_cached_requests:
            self._global.remove(self._cached.popleft())

    def abort(self, request_id: str) -> None:
        """Drop the request's tree without adding it to the global tree."""
        self._requests.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """Requests with a per-request tree (proposed for, not finished or aborted)."""
        return len(self._requests)

    @property
    def num_nodes(self) -> int:
        """Tree nodes held, over all per-request trees and the global tree."""
        tracked = sum(request.tree.num_nodes() for request in self._requests.values())
        return tracked + (self._global.num_nodes() if self._global is not None else 0)

    def _new_tree(self) -> SuffixTree:
        return new_suffix_tree(self._config.max_tree_depth, self._native)
