"""Content identity of full KV blocks, for automatic prefix caching.

The K/V of a block depend on every token before it, so a full block's identity is its
own token ids chained with its parent block's digest, plus the extra keys of the request
(model or adapter identity, a per-tenant ``cache_salt``): two blocks may share physical
memory only if their whole :class:`BlockKey` is equal. The digest is SHA-256 over a
canonical byte encoding:

    parent digest (32 bytes; 32 zero bytes for a sequence's first block)
    uint32 token count, then each token id as int64, little-endian
    for each extra key: uint32 byte length, then its UTF-8 bytes
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

ROOT_PARENT_DIGEST = bytes(32)


def hash_block(
    parent_digest: bytes | None, token_ids: Sequence[int], extra_keys: tuple[str, ...]
) -> bytes:
    """SHA-256 digest (32 bytes) of one full block, chained from ``parent_digest``."""
    hasher = hashlib.sha256(ROOT_PARENT_DIGEST if parent_digest is None else parent_digest)
    hasher.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    for key in extra_keys:
        if not isinstance(key, str):
            raise TypeError(f"extra keys must be strings, got {key!r}")
        data = key.encode()
        hasher.update(struct.pack("<I", len(data)))
        hasher.update(data)
    return hasher.digest()


@dataclass(frozen=True)
class BlockKey:
    """Everything a full block's K/V depend on; equal keys mean interchangeable blocks.

    Equality compares the contents, not just the digest, so a digest collision can never
    make two different blocks look the same.
    """

    parent_digest: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[str, ...]
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "digest", hash_block(self.parent_digest, self.token_ids, self.extra_keys)
        )


def iter_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: tuple[str, ...] = (),
    parent_digest: bytes | None = None,
) -> Iterator[BlockKey]:
    """Keys of the full blocks of ``token_ids`` in order, each chained from the one before.

    A trailing partial block has no key. Lazy: a caller that stops early hashes no further.
    """
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block_tokens = tuple(int(token) for token in token_ids[start : start + block_size])
        key = BlockKey(parent_digest, block_tokens, extra_keys)
        yield key
        parent_digest = key.digest


class PrefixHasher:
    """The running hash chain of one sequence's committed tokens.

    It keeps no token count of its own: the block manager's committed count is the one
    source. Of ``committed`` tokens, the full blocks (``committed`` rounded down to a
    whole block) are hashed and their keys were handed out as the blocks completed; the
    tokens of the partial last block, ``committed % block_size`` of them, wait in
    ``pending``. :meth:`BlockManager.check_progress
    <pagedllm.kv.block_manager.BlockManager.check_progress>` checks that relation.
    """

    def __init__(
        self,
        block_size: int,
        extra_keys: tuple[str, ...] = (),
        parent_digest: bytes | None = None,
    ) -> None:
        """Continue a chain of whole blocks ending in ``parent_digest`` (None: at the start)."""
        self.block_size = block_size
        self.extra_keys = extra_keys
        self.parent_digest = parent_digest
        self.pending: list[int] = []

    def extend(self, token_ids: Sequence[int]) -> list[BlockKey]:
        """Commit ``token_ids`` and return the keys of the blocks they complete."""
        self.pending.extend(token_ids)
        if len(self.pending) < self.block_size:
            return []
        keys = list(
            iter_block_keys(self.pending, self.block_size, self.extra_keys, self.parent_digest)
        )
        if keys:
            del self.pending[: len(keys) * self.block_size]
            self.parent_digest = keys[-1].digest
        return keys

    def copy(self) -> PrefixHasher:
        """An independent chain at the same point (for a forked sequence)."""
        twin = PrefixHasher(self.block_size, self.extra_keys, self.parent_digest)
        twin.pending = list(self.pending)
        return twin


GROUP_KEY_MARK = "kv layer group"


def group_key(key: BlockKey, group: int) -> BlockKey:
    """The key of the block holding ``key``'s tokens for layer group ``group``
    (:mod:`pagedllm.kv.layer_groups`): ``key`` itself for group 0, so a one-group
    engine's keys are unchanged; for another group a key chained from ``key``'s digest
    and naming the group, so the groups' blocks of one content never match each other."""
    if group == 0:
        return key
    return BlockKey(key.digest, (group,), (GROUP_KEY_MARK,))
