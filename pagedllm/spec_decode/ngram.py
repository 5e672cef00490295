"""Prompt lookup: guess a sequence's next tokens by finding its last n tokens earlier in
its own prompt and output, and copying what followed them there.

The longest n-gram ending the sequence (``min_n <= n <= max_n`` tokens) that also
occurs earlier in it is found; of its earlier occurrences the latest wins (recent text
is the likelier to repeat), and up to ``k`` tokens that followed it are the guess. No
match of any allowed length: no guess. Cost per sequence and step: one vectorised pass
over the tokens for the occurrences of the last token, then ``max_n`` passes over
those.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    """Guesses from the sequence's own history; no state between calls."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n} and {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to ``k`` tokens to follow ``token_ids``; [] when no n-gram of the allowed
        lengths ending the sequence occurs earlier in it (or ``k`` <= 0)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        # earlier positions holding the last token: each ends a candidate occurrence
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        matched = np.ones(len(ends), dtype=np.int64)  # tokens matched, from the end back
        for back in range(1, self.max_n):
            if back >= length - 1:
                break
            extends = (matched == back) & (ends >= back)
            extends[extends] = tokens[ends[extends] - back] == tokens[length - 1 - back]
            matched[extends] += 1
        if not len(ends) or matched.max() < self.min_n:
            return []
        start = int(ends[np.flatnonzero(matched == matched.max())[-1]]) + 1
        return tokens[start : start + k].tolist()
