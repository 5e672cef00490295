"""A draft model's output layer over part of the vocabulary (``draft_vocab_size``).

A small draft spends a large share of each pass in its LM head: the default model's
49,152 x 576 head is a third of its Q4_0 bytes. A guess is worth drafting only where the
target is likely to agree, and the target mostly emits common tokens or tokens it has
already seen. So the draft scores the first ``draft_vocab_size`` token ids (byte-pair
tokenizers number tokens in the order their merges were learned, the most frequent
first) plus every token of the drafting sequence itself (its prompt and output: names
and copied text), and nothing else. Verification is unchanged, so output stays exact:
a token outside the draft's vocabulary is simply never guessed, and for a sampled
sequence the draft's distribution is zero there, which rejection sampling allows for.

The first ids are a prefix of the head's rows, multiplied in the head's own form and
kernel (a view, no copy, where the size is a whole number of its row groups). A
sequence's own tokens past them are dequantized once, when the sequence first shows
them, and multiplied in float32.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pagedllm.cpu.extension import PANEL_WIDTH
from pagedllm.engine.sequence import TokenSequence
from pagedllm.models.interleaved_weight import GROUP_ROWS, InterleavedWeight
from pagedllm.models.linear import PackedWeight, Weight, linear
from pagedllm.models.quantized_weight import QuantizedWeight

ROW_MULTIPLE = 48
"""``draft_vocab_size`` is rounded up to a multiple of this (a whole number of panels
and of interleaved groups)."""

assert ROW_MULTIPLE % PANEL_WIDTH == 0 and ROW_MULTIPLE % GROUP_ROWS == 0


def leading_rows(weight: Weight, size: int) -> Weight | None:
    """The first ``size`` output rows of ``weight`` in its own form, sharing its storage;
    None for a form that cannot be cut so (oneDNN's opaque layout, expanded copies)."""
    if isinstance(weight, torch.Tensor):
        return weight[:size]
    if isinstance(weight, PackedWeight):
        return PackedWeight(weight.panels[: size // PANEL_WIDTH], size, weight.in_features)
    if isinstance(weight, InterleavedWeight):
        blocks = weight.blocks[: size // GROUP_ROWS]
        return InterleavedWeight(
            blocks, weight.ggml_type, weight.in_features, size, weight.int8_activations
        )
    if isinstance(weight, QuantizedWeight):
        return QuantizedWeight(weight.blocks[:size], weight.ggml_type, weight.in_features)
    return None


class _OwnTokens:
    """A sequence's distinct tokens past the leading ids (``ids``, int64) and where
    their head rows are in the shared store (``rows``, int64)."""

    def __init__(self) -> None:
        self.ids = torch.empty(0, dtype=torch.int64)
        self.rows = torch.empty(0, dtype=torch.int64)
        self.seen: set[int] = set()
        self.num_read = 0  # leading tokens of the sequence looked at so far


class DraftHead:
    """The draft's logits over its first ``size`` token ids and each sequence's own
    tokens. ``finish``: the model's logit post-processing (divisor, soft cap).

    Memory: the head rows of the sequences' own tokens are dequantized once into one
    store shared by all sequences, in ``dtype``: at most ``vocab_size - size`` rows (the
    default model in bfloat16 with 16,384 leading ids: 37.7 MB at most, a few hundred
    rows for a chat). Not thread-safe (the engine's step loop owns it)."""

    def __init__(
        self,
        head: Weight,
        size: int,
        vocab_size: int,
        finish: Callable[[torch.Tensor], torch.Tensor],
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.size = min(vocab_size, -(-size // ROW_MULTIPLE) * ROW_MULTIPLE)
        leading = leading_rows(head, self.size)
        if leading is None:
            raise ValueError(
                f"speculative_config: draft_vocab_size needs the draft's LM head packed, "
                f"in GGUF blocks or plain; it is {type(head).__name__}"
            )
        self.head, self.leading = head, leading
        self.vocab_size = vocab_size
        self.finish = finish
        width = head.shape[1] if isinstance(head, torch.Tensor) else head.in_features
        self._store = torch.empty(64, width, dtype=dtype)  # rows past the leading ids
        self._store_row: dict[int, int] = {}  # token id -> its row in the store
        self._own: dict[int, _OwnTokens] = {}

    def note(self, seq: TokenSequence) -> None:
        """Take in the tokens ``seq`` gained since last noted."""
        own = self._own.setdefault(seq.seq_id, _OwnTokens())
        tokens = seq.all_token_ids
        new = []
        for token in tokens[own.num_read :]:
            if token >= self.size and token not in own.seen:
                own.seen.add(token)
                new.append(token)
        own.num_read = len(tokens)
        if new:
            self._store_rows([t for t in new if t not in self._store_row])
            own.ids = torch.cat([own.ids, torch.tensor(new, dtype=torch.int64)])
            rows = [self._store_row[t] for t in new]
            own.rows = torch.cat([own.rows, torch.tensor(rows, dtype=torch.int64)])

    def forget(self, seq_id: int) -> None:
        self._own.pop(seq_id, None)

    def logits(self, hidden: torch.Tensor, seq_ids: list[int]) -> torch.Tensor:
        """Float32 logits ``[len(seq_ids), vocab_size]`` of ``hidden`` (one row per
        sequence ``seq_ids[i]``): scored over the leading ids and the row's sequence's
        own tokens, ``-inf`` elsewhere."""
        leading = self.finish(linear(hidden, self.leading, float_output=True))
        logits = torch.full((len(seq_ids), self.vocab_size), float("-inf"))
        logits[:, : self.size] = leading
        vectors = hidden.float()
        for i, seq_id in enumerate(seq_ids):
            own = self._own.get(seq_id)
            if own is not None and len(own.ids):
                logits[i, own.ids] = self.finish(self._store[own.rows].float() @ vectors[i])
        return logits

    def _store_rows(self, tokens: list[int]) -> None:
        """The head rows of ``tokens`` appended to the store."""
        if not tokens:
            return
        ids = torch.tensor(tokens, dtype=torch.int64)
        head = self.head
        rows = head[ids] if isinstance(head, torch.Tensor) else head.rows(ids)
        first = len(self._store_row)
        end = first + len(tokens)
        if end > len(self._store):  # capacity doubles: each row is copied O(1) times
            grown = self._store.new_empty(max(end, 2 * len(self._store)), self._store.shape[1])
            grown[:first] = self._store[:first]
            self._store = grown
        self._store[first:end] = rows
        self._store_row.update((t, first + i) for i, t in enumerate(tokens))
