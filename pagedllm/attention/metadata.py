"""Attention metadata for one flattened batch.

A step runs the new tokens of many sequences concatenated into one ``[num_tokens]``
batch, without padding. Sequence ``i`` owns query rows
``query_start_loc[i] : query_start_loc[i + 1]``; those rows are the *last*
``q_len_i`` positions of a sequence whose total length (cached context plus the
new tokens) is ``seq_lens[i]`` tokens. Each query row attends causally to every
position of its own sequence up to and including itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where new K/V go and where each sequence's K/V live.

    Invariants (all tensors on the same device, int32 unless stated):
    - ``slot_mapping`` ``[num_tokens]`` int64: flat cache slot of each new token,
      ``block_id * block_size + offset``; ``-1`` means "do not write".
    - ``block_tables`` ``[num_seqs, max_blocks]``: physical block of each logical
      block; entries past a sequence's last block are ``-1`` (never read); entries
      wholly before the window of a sequence's first query may be the null block
      (released by a sliding window: never written, read by no kernel but the oracle).
    - ``seq_lens`` ``[num_seqs]``: tokens of each sequence after this step's writes.
    - ``query_start_loc`` ``[num_seqs + 1]``: cumulative query lengths, starting at 0.
    - ``max_query_len``, ``max_seq_len``: host-side maxima of the above, in tokens.
    - ``more_groups``: with KV layer groups (:mod:`pagedllm.kv.layer_groups`), the
      metadata of groups 1, 2, ... (this is group 0's): their own ``slot_mapping`` and
      ``block_tables``, the same sequences, lengths and queries; ``layer_groups``: each
      layer's group (empty: every layer in group 0).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int
    more_groups: tuple[AttentionMetadata, ...] = ()
    layer_groups: tuple[int, ...] = ()

    def for_group(self, group: int) -> AttentionMetadata:
        """The metadata a layer of KV layer group ``group`` attends with."""
        return self if group == 0 else self.more_groups[group - 1]

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        """The metadata layer ``layer_idx`` attends with: its KV layer group's."""
        if not self.more_groups:
            return self
        return self.for_group(self.layer_groups[layer_idx])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence runs exactly one query token."""
        return self.max_query_len == 1
