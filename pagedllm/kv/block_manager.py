"""The scheduler's view of KV memory: block tables keyed by sequence id over one pool.

Each step the scheduler reserves the slots of the tokens every sequence computes next in
one call, :meth:`BlockManager.allocate_slots`, which either allocates or returns None and
changes nothing (no separate check first); a finished or preempted sequence returns its
blocks with :meth:`BlockManager.free`. Every call costs O(tokens appended) or O(blocks of
that sequence), never O(blocks in the pool).

The allocation policy is the manager's: on demand (PagedAttention, the default), or
``upfront_tokens`` slots held from a sequence's first step, the pre-PagedAttention
contiguous reservation kept as a baseline (no prefix caching then).

Automatic prefix caching (``enable_prefix_caching``, on by default), in three calls:

1. ``prefix = find_cached_prefix(prompt_token_ids, extra_keys)`` looks up the longest
   chain of cached full blocks of the prompt (a query; nothing changes). It never covers
   the whole prompt: the last prompt token is always computed, to produce logits.
2. ``allocate_slots(seq_id, len(prompt) - prefix.num_tokens, prefix=prefix)`` starts the
   sequence on those blocks (ref count + 1) and reserves slots for the rest, all or nothing.
3. ``commit_tokens(seq_id, token_ids)`` after the model step has written K/V for those
   tokens: every block they complete becomes cached under its content key, findable by
   later requests. Tokens are committed in order, never beyond the reserved slots.

A sequence started without a prefix object (``prefix=None``) is never cached: its extra
keys (``cache_salt``) are unknown, and sharing without them could leak across tenants.

Progress has one count per sequence: the committed tokens (K/V written), kept here, set
when a sequence starts (its prefix hit) or forks and moved on only by
:meth:`BlockManager.commit_tokens`. The other figures follow from it or
run ahead of it by what a step has reserved: the table's ``num_tokens`` counts tokens
with slots (committed plus the tokens scheduled and not yet committed, so equal between
steps); the hash chain has hashed the committed tokens' full blocks and holds the rest
pending; a sliding window's null entries are those before the window of the next query.
The engine's ``TokenSequence.num_computed_tokens`` is the same quantity on the engine's
side. :meth:`BlockManager.check_progress` states these relations and checks them.

Sliding window (``sliding_window`` ``W`` tokens, for a model whose every layer slides):
a query at position ``p`` reads positions ``p - W + 1 .. p`` only, so once a sequence's
next query sits at position ``p`` (its committed tokens), every logical block wholly
before ``p - W + 1`` is released: its reference is dropped (a shared block stays with
its other holders, a cached one waits in the free queue as evictable) and its table
entry becomes null (:mod:`pagedllm.kv.block_table`). A running sequence then holds at
most :func:`~pagedllm.kv.capacity.max_window_blocks` blocks:
``ceil((W + n + block_size - 2) / block_size)`` during a step that computes ``n`` tokens,
``ceil((W + block_size - 1) / block_size)`` while decoding. A prefix-cache hit needs
only the cached blocks inside the window of its first computed token, not the whole
chain.

Precision by age (``recent_tokens`` ``R`` with compact blocks, ``kv_cache_dtype="int4"``):
once a sequence has ``c`` committed tokens, each full block wholly before position
``c - R`` is re-encoded into a compact block, once, as the sequence's slots are next
reserved (:meth:`BlockTable.compact`; the pairs travel in the plan and the cache encodes
them before any move but a swap-out). The full block returns to the pool, or, while
others still read it, stays theirs until they pass it too and take its twin
(:mod:`pagedllm.kv.block_pool`). A prefix-cache hit takes a compact block only behind
the window of its first computed token, so a cached prompt is read at the precision a
cold one would be.

Layer groups (``group_windows``, :mod:`pagedllm.kv.layer_groups`): a model whose layers
attend differently keeps one table per group of layers for each sequence, over the one
pool. The groups share the sequence's tokens, its committed count and its hash chain;
each group releases what its own window leaves behind (a global group nothing), and a
block is cached under its content key qualified by its group
(:func:`~pagedllm.kv.prefix_hash.group_key`). An allocation takes the blocks of every
group or none; a prefix-cache hit is the longest prefix every group can serve (for a
sliding group, with its blocks inside the window of the first computed token cached).
Compact blocks keep one table only.

A swap-in (``num_restored`` tokens copied back, ``restored_compact_end`` the parked
table's ``compact_end``) brings every parked block back in its own kind: the logical
blocks before ``restored_compact_end`` get compact blocks (their compact bytes are
copied in), and so, while compact blocks are free, do the other whole blocks behind the
window of the restored tokens (the re-encoding the sequence's next reservation would
make; the swap-in encodes them from their parked bytes); the rest are full. Its prefix
hit (``find_cached_prefix(..., for_swap_in=True)``) ends before the first cached block
of another kind than that.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedllm.kv.block_pool import BlockPool, BlockPoolStats, OutOfBlocksError
from pagedllm.kv.block_table import AppendResult, BlockTable
from pagedllm.kv.capacity import cdiv
from pagedllm.kv.fragmentation import FragmentationStats
from pagedllm.kv.prefix_hash import BlockKey, PrefixHasher, group_key, iter_block_keys

SeqId = int | str


@dataclass(frozen=True)
class CachedPrefix:
    """A hit from :meth:`BlockManager.find_cached_prefix`, valid until blocks are allocated.

    ``tables[g]``: layer group ``g``'s cached full blocks covering the first
    ``num_tokens`` tokens of a ``num_prompt_tokens``-token prompt, of which the first
    ``num_nulls[g]`` are null entries (out of the group's sliding window: not needed,
    maybe not cached); ``keys``: the blocks' content keys (group 0's); ``extra_keys``
    carry on to the sequence's later blocks.
    """

    tables: tuple[tuple[int, ...], ...]
    keys: tuple[BlockKey, ...]
    num_tokens: int
    num_prompt_tokens: int
    extra_keys: tuple[str, ...]
    num_nulls: tuple[int, ...]

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Group 0's blocks (every group's table has as many entries)."""
        return self.tables[0]

    @property
    def num_null_blocks(self) -> int:
        return self.num_nulls[0]

    def held(self, group: int) -> tuple[int, ...]:
        """The cached blocks of ``group`` the sequence takes a reference to."""
        return self.tables[group][self.num_nulls[group] :]

    @property
    def held_block_ids(self) -> tuple[int, ...]:
        """Group 0's cached blocks the sequence takes a reference to."""
        return self.held(0)


@dataclass(frozen=True)
class BlockManagerStats:
    """Monitoring figures: pool counters, fragmentation of the live tables, prefix cache.

    ``prefix_cache_queries``/``prefix_cache_hits`` count prompt tokens looked up and found
    (cumulative, once per sequence started with a prefix). ``block_table_lookups``/
    ``block_table_hits`` count token slots (cumulative): a lookup is a slot
    :meth:`BlockManager.allocate_slots` reserved or a prefix hit supplied; it hits when
    the block holding it was in the sequence's table already (a partly filled last block,
    or a cached block of the prefix) and misses when the block was newly taken from the
    pool.
    """

    num_seqs: int
    pool: BlockPoolStats
    fragmentation: FragmentationStats
    prefix_cache_queries: int
    prefix_cache_hits: int
    block_table_lookups: int = 0
    block_table_hits: int = 0

    @property
    def block_table_hit_rate(self) -> float:
        if self.block_table_lookups == 0:
            return 0.0
        return self.block_table_hits / self.block_table_lookups

    @property
    def prefix_cache_hit_rate(self) -> float:
        if self.prefix_cache_queries == 0:
            return 0.0
        return self.prefix_cache_hits / self.prefix_cache_queries


@dataclass(frozen=True)
class AllocationTimes:
    """``calls`` of :meth:`BlockManager.allocate_slots` (failed ones included) and the
    ``seconds`` they took, cumulative."""

    calls: int
    seconds: float


@dataclass
class _Sequence:
    """One live sequence: its tables, one per layer group (slots reserved:
    ``num_tokens`` of each), its hash chain and its committed count, the source of its
    progress (see :meth:`BlockManager.check_progress`)."""

    tables: list[BlockTable]
    hasher: PrefixHasher | None  # None: this sequence's blocks are never cached
    num_committed: int = 0  # tokens whose K/V are written: the one progress count
    table: BlockTable = field(init=False)  # group 0's (the only one without groups)

    def __post_init__(self) -> None:
        self.table = self.tables[0]


class BlockManager:
    """Owns one :class:`BlockPool` and the :class:`BlockTable` of every live sequence."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        reserved_fraction: float = 0.05,
        enable_prefix_caching: bool = True,
        upfront_tokens: int | None = None,
        sliding_window: int | None = None,
        num_compact_blocks: int = 0,
        recent_tokens: int | None = None,
        group_windows: Sequence[int | None] | None = None,
    ) -> None:
        if group_windows is not None and (
            len(group_windows) < 2
            or sliding_window is not None
            or upfront_tokens is not None
            or num_compact_blocks
            or any(window is not None and window < 1 for window in group_windows)
        ):
            raise ValueError(
                f"layer groups need two or more windows (None or >= 1), on-demand "
                f"allocation, no single sliding_window and no compact blocks, got "
                f"group_windows={group_windows}, sliding_window={sliding_window}, "
                f"upfront_tokens={upfront_tokens}, {num_compact_blocks} compact blocks"
            )
        if sliding_window is not None and (sliding_window < 1 or upfront_tokens is not None):
            raise ValueError(
                f"sliding_window must be >= 1 and needs on-demand allocation, got "
                f"{sliding_window} with upfront_tokens={upfront_tokens}"
            )
        if (recent_tokens is None) != (num_compact_blocks == 0) or (
            recent_tokens is not None
            and (recent_tokens < 0 or sliding_window is not None or upfront_tokens is not None)
        ):
            raise ValueError(
                f"compact blocks need recent_tokens >= 0 and on-demand allocation without a "
                f"sliding window, got recent_tokens={recent_tokens}, {num_compact_blocks} "
                f"compact blocks, sliding_window={sliding_window}, "
                f"upfront_tokens={upfront_tokens}"
            )
        self.pool = BlockPool(num_blocks, block_size, reserved_fraction, num_compact_blocks)
        self.recent_tokens = recent_tokens
        self.block_size = block_size
        self.upfront_tokens = upfront_tokens
        self.sliding_window = sliding_window
        self.windows: tuple[int | None, ...] = (
            (sliding_window,) if group_windows is None else tuple(group_windows)
        )
        self.enable_prefix_caching = enable_prefix_caching and upfront_tokens is None
        self._seqs: dict[SeqId, _Sequence] = {}
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0
        self._table_lookups = 0
        self._table_hits = 0
        self._allocation_calls = 0
        self._allocation_seconds = 0.0
        self._slowest_allocation = 0.0

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    @property
    def num_groups(self) -> int:
        """Layer groups, each with its own table per sequence (1 without groups)."""
        return len(self.windows)

    def live_from(self, position: int, group: int = 0) -> int:
        """The first logical block of ``group`` a query at ``position`` reads: 0 without
        a window."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, position - window + 1) // self.block_size

    def compact_before(self, num_committed: int) -> int:
        """Logical blocks wholly behind the recent window of a sequence with
        ``num_committed`` tokens: those kept compact (0 without compact blocks)."""
        if self.recent_tokens is None:
            return 0
        return max(0, num_committed - self.recent_tokens) // self.block_size

    def _usable_hit(self, block_ids: list[int | None], hit: int) -> int:
        """The longest hit of at most ``hit`` blocks whose compact blocks all lie
        behind the window of its first computed token."""
        if self.recent_tokens is None:
            return hit
        last_compact = -1  # of the first ``length`` blocks
        usable = 0
        for length, block_id in enumerate(block_ids[:hit], start=1):
            if self.pool.is_compact(block_id):
                last_compact = length - 1
            if last_compact < self.compact_before(length * self.block_size):
                usable = length
        return usable

    def _restorable_hit(self, block_ids: list[int | None], hit: int, num_tokens: int) -> int:
        """The longest hit of at most ``hit`` blocks for a swap-in of ``num_tokens``
        computed tokens: compact blocks wholly behind their window, full ones after."""
        if self.recent_tokens is None:
            return hit
        behind = self.compact_before(num_tokens)
        for index, block_id in enumerate(block_ids[:hit]):
            if self.pool.is_compact(block_id) != (index < behind):
                return index
        return hit

    # -- prefix cache --------------------------------------------------------------------

    def find_cached_prefix(
        self, token_ids: Sequence[int], extra_keys: tuple[str, ...] = (), for_swap_in: bool = False
    ) -> CachedPrefix:
        """The longest cached prefix of ``token_ids`` (a query): a chain of cached full
        blocks from the start or, with a sliding window, the longest run of whole blocks
        whose blocks inside the window of the next token are all cached; with layer
        groups, the longest that every group can serve so.

        Covers at most ``len(token_ids) - 1`` tokens rounded down to whole blocks; empty
        when prefix caching is off. ``for_swap_in``: the hit starts a swap-in of a
        sequence whose first ``len(token_ids) - 1`` tokens were computed; with compact
        blocks it ends before the first block of another kind than the restored
        sequence holds there (see the module's docstring).
        """
        groups = range(self.num_groups)
        found: list[list[int | None]] = [[] for _ in groups]  # per group, per block
        runs = [0] * self.num_groups  # per group: cached blocks ending at the current one
        keys: list[BlockKey] = []
        hit = 0  # blocks of the best hit
        if self.enable_prefix_caching:
            cacheable = token_ids[: max(0, len(token_ids) - 1)]
            for key in iter_block_keys(cacheable, self.block_size, extra_keys):
                block_ids = [self.pool.lookup(group_key(key, group)) for group in groups]
                if any(b is None and self.windows[g] is None for g, b in enumerate(block_ids)):
                    break  # a global group's chain ends here
                keys.append(key)
                length = len(keys)
                served = True
                for group, block_id in enumerate(block_ids):
                    found[group].append(block_id)
                    runs[group] = 0 if block_id is None else runs[group] + 1
                    if length - runs[group] > self.live_from(length * self.block_size, group):
                        served = False
                if served:
                    hit = length
        if for_swap_in:
            hit = self._restorable_hit(found[0], hit, max(0, len(token_ids) - 1))
        else:
            hit = self._usable_hit(found[0], hit)
        nulls = tuple(self.live_from(hit * self.block_size, group) for group in groups)
        null = self.pool.null_block
        return CachedPrefix(
            tables=tuple((null,) * nulls[g] + tuple(found[g][nulls[g] : hit]) for g in groups),
            keys=tuple(keys[:hit]),
            num_tokens=hit * self.block_size,
            num_prompt_tokens=len(token_ids),
            extra_keys=extra_keys,
            num_nulls=nulls,
        )

    @property
    def restores_cached(self) -> bool:
        """Whether a swapped sequence's parked blocks can come back as cached blocks
        ahead of its swap-in (:meth:`restore_cached`): prefix caching on, one table of
        full-size blocks, no sliding window."""
        return self.enable_prefix_caching and self.windows == (None,) and self.recent_tokens is None

    def restore_cached(
        self, prefix: CachedPrefix, token_ids: Sequence[int], max_blocks: int
    ) -> list[tuple[int, int]]:
        """Read-ahead of a swap-in: free blocks for the full blocks of ``token_ids``
        (a swapped sequence's computed tokens) that continue ``prefix`` (its hit found
        ``for_swap_in``) and that no block caches, at most ``max_blocks`` of them, in
        order. Each is cached under its content key and left free, at the tail of the
        free queue like a released table (its later blocks evicted first), so the
        sequence's swap-in finds the chain as its prefix hit once the caller has copied
        the parked K/V into them, and an allocation in need may still evict them. The
        chain's evictable blocks are kept out of this allocation's reach. Returns
        ``(logical block, block id)`` for each block to fill.
        """
        if not self.restores_cached:
            raise ValueError("restoring cached blocks needs prefix caching and one full table")
        pool = self.pool
        size = self.block_size
        parent = prefix.keys[-1].digest if prefix.keys else None
        full = token_ids[prefix.num_tokens : len(token_ids) // size * size]
        chain: list[int | None] = list(prefix.block_ids)  # None: to restore
        missing: list[BlockKey] = []
        for key in iter_block_keys(full, size, prefix.extra_keys, parent):
            block_id = pool.lookup(key)
            if block_id is None:
                if len(missing) == max_blocks:
                    break
                missing.append(key)
            chain.append(block_id)
        kept = [b for b in chain if b is not None and pool.ref_count(b) == 0]
        room = pool.num_available() - len(kept)
        if room < len(missing):  # the chain stops before the first block without room
            missing = missing[: max(0, room)]
            chain = chain[: _nth_none(chain, len(missing))]
            kept = [b for b in chain if b is not None and pool.ref_count(b) == 0]
        if not missing:
            return []
        pool.incref(kept)
        blocks = iter(pool.allocate(len(missing)))
        restored = []
        for index, block_id in enumerate(chain):
            if block_id is None:
                block_id = chain[index] = next(blocks)
                pool.cache_block(block_id, missing[len(restored)])
                restored.append((index, block_id))
        taken = set(kept).union(block for _, block in restored)
        pool.free(reversed([b for b in chain if b in taken]))
        return restored

    def _prefix_blocks_needed(
        self, prefix: CachedPrefix, num_new_tokens: int, num_restored: int
    ) -> int:
        """Free blocks starting on ``prefix`` takes: evictable hits plus blocks for new tokens
        (none before the window of the first token computed)."""
        pool = self.pool
        total_blocks = cdiv(prefix.num_tokens + num_new_tokens, self.block_size)
        needed = 0
        for group in range(self.num_groups):
            needed += sum(
                1
                for block_id in prefix.held(group)
                if pool.ref_count(block_id) == 0 and not pool.is_compact(block_id)
            )
            first_query = prefix.num_tokens + num_restored
            new_from = max(len(prefix.block_ids), self.live_from(first_query, group))
            needed += max(0, total_blocks - new_from)
        return needed

    def _restored_compact(
        self, prefix: CachedPrefix | None, num_restored: int, restored_compact_end: int
    ) -> int | None:
        """Compact blocks a sequence starting on ``prefix`` with ``num_restored`` tokens
        copied in takes for them (see the module's docstring): those parked compact
        (logical blocks before ``restored_compact_end``) and, while compact blocks are
        free, the other whole blocks behind the window of the tokens restored. None when
        the parked compact ones do not fit. Raises ValueError on misuse: a compact end
        without compact blocks or inside the window, or a prefix of full blocks before
        compact ones (not found ``for_swap_in``)."""
        if self.recent_tokens is None:
            if restored_compact_end:
                raise ValueError("restored compact blocks need a pool with compact blocks")
            return 0
        held = () if prefix is None else prefix.held_block_ids
        first = len(held)  # compact blocks exclude a sliding window: no null entries
        num_tokens = (0 if prefix is None else prefix.num_tokens) + num_restored
        behind = self.compact_before(num_tokens)
        if restored_compact_end > behind:
            raise ValueError(
                f"{restored_compact_end} restored compact blocks reach into the recent "
                f"window of {num_tokens} restored tokens"
            )
        pool = self.pool
        revived = sum(1 for b in held if pool.ref_count(b) == 0 and pool.is_compact(b))
        free = pool.num_compact_free - revived
        if restored_compact_end - first > free:
            return None
        count = max(0, min(behind - first, free))
        if count and not all(pool.is_compact(block_id) for block_id in held):
            raise ValueError("a swap-in starts on a prefix found for_swap_in")
        return count

    def _check_prefix(self, prefix: CachedPrefix) -> None:
        for group in range(self.num_groups):
            keys = prefix.keys[prefix.num_nulls[group] :]
            for block_id, key in zip(prefix.held(group), keys, strict=True):
                cached = self.pool.block_key(block_id)
                if cached is None or cached.digest != group_key(key, group).digest:
                    raise ValueError("stale prefix: its blocks were evicted; find it again")

    def _start(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        high_priority: bool,
        prefix: CachedPrefix | None,
        num_restored: int,
        num_compact: int,
    ) -> _Sequence | None:
        """Register ``seq_id`` (on the blocks of ``prefix`` if given, with its upfront
        blocks under that policy) if its first ``num_new_tokens`` tokens fit, the first
        ``num_compact`` blocks after the prefix being compact ones; else None, changing
        nothing. The caller checked that ``prefix`` is not stale."""
        needed = self._start_blocks_needed(num_new_tokens, prefix, num_restored) - num_compact
        if not self.pool.can_allocate(needed, high_priority):
            return None
        groups = range(self.num_groups)
        if prefix is None:
            seq = _Sequence([BlockTable(self.pool) for _ in groups], hasher=None)
        else:
            tables = []
            for group in groups:
                self.pool.incref(prefix.held(group))
                tables.append(
                    BlockTable(
                        self.pool,
                        list(prefix.tables[group]),
                        prefix.num_tokens,
                        prefix.num_nulls[group],
                    )
                )
            seq = _Sequence(tables, self._start_hasher(prefix), prefix.num_tokens)
        if self.upfront_tokens is not None:
            seq.table.preallocate(self.upfront_tokens, high_priority)
        self._seqs[seq_id] = seq
        return seq

    def _start_hasher(self, prefix: CachedPrefix) -> PrefixHasher | None:
        """The hash chain continuing after ``prefix``; counts the prefix-cache query."""
        if not self.enable_prefix_caching:
            return None
        self._prefix_cache_queries += prefix.num_prompt_tokens
        self._prefix_cache_hits += prefix.num_tokens
        parent = prefix.keys[-1].digest if prefix.keys else None
        return PrefixHasher(self.block_size, prefix.extra_keys, parent)

    # -- allocation ----------------------------------------------------------------------

    def num_blocks_needed(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        prefix: CachedPrefix | None = None,
        num_restored: int = 0,
        restored_compact_end: int = 0,
    ) -> int:
        """Free full-size blocks an append of ``num_new_tokens`` tokens would take from
        the pool.

        Counts new blocks, copy-on-write copies and evictable blocks a prefix hit revives
        (``num_restored`` and ``restored_compact_end`` as in :meth:`allocate_slots`; the
        restored blocks that come back compact are not counted).
        """
        seq = self._seqs.get(seq_id)
        if seq is not None:
            return self._growth_needed(seq, num_new_tokens, num_restored)
        compact = self._restored_compact(prefix, num_restored, restored_compact_end) or 0
        return self._start_blocks_needed(num_new_tokens, prefix, num_restored) - compact

    def _growth_needed(self, seq: _Sequence, num_new_tokens: int, num_restored: int) -> int:
        """Blocks every group of live ``seq`` takes for ``num_new_tokens`` more tokens."""
        first_query = self._first_query(seq, num_restored)
        return sum(
            table.num_blocks_needed(num_new_tokens, self.live_from(first_query, group))
            for group, table in enumerate(seq.tables)
        )

    def _start_blocks_needed(
        self, num_new_tokens: int, prefix: CachedPrefix | None, num_restored: int
    ) -> int:
        """Free blocks a new sequence takes, every new one full-size."""
        if prefix is None:
            total = cdiv(max(num_new_tokens, self.upfront_tokens or 0), self.block_size)
            return sum(
                max(0, total - self.live_from(num_restored, group))
                for group in range(self.num_groups)
            )
        num_tokens = max(num_new_tokens, self.upfront_tokens or 0)
        return self._prefix_blocks_needed(prefix, num_tokens, num_restored)

    def can_append(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        high_priority: bool = False,
        prefix: CachedPrefix | None = None,
        num_restored: int = 0,
        restored_compact_end: int = 0,
    ) -> bool:
        """Whether :meth:`allocate_slots` with the same arguments would succeed now (a
        query for monitoring and tests; allocating needs no check first): both kinds of
        blocks it takes are free."""
        args = (seq_id, num_new_tokens, prefix, num_restored, restored_compact_end)
        if seq_id not in self._seqs and self._restored_compact(*args[2:]) is None:
            return False
        return self.pool.can_allocate(self.num_blocks_needed(*args), high_priority)

    def allocate_slots(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        high_priority: bool = False,
        prefix: CachedPrefix | None = None,
        num_restored: int = 0,
        restored_compact_end: int = 0,
    ) -> AppendResult | None:
        """Reserve slots for the ``num_new_tokens`` tokens ``seq_id`` computes next, or
        return None and change nothing when the blocks are not available to this priority.

        Creates the sequence on first use, on the blocks of ``prefix`` if given (the new
        tokens then follow the prefix's ``num_tokens``). ``num_restored``: the first new
        tokens whose K/V are copied in rather than computed (a swap-in); with a sliding
        window, blocks outside the window of the first computed token are null entries
        (slots ``-1``), never allocated; with compact blocks, the logical blocks before
        ``restored_compact_end`` (the parked table's ``compact_end``) and those behind the
        window of the restored tokens come back compact while compact blocks are free
        (their slots are compact ids times the block size). The result's
        ``first_changed`` is 0 for a sequence created here. Raises ValueError on misuse:
        a prefix or a restored compact end for an existing sequence, or a stale prefix.
        Counts its block-table lookups and its time (:meth:`stats`).
        """
        start = time.perf_counter()
        result = self._allocate_slots(
            seq_id, num_new_tokens, high_priority, prefix, num_restored, restored_compact_end
        )
        elapsed = time.perf_counter() - start
        self._allocation_calls += 1
        self._allocation_seconds += elapsed
        self._slowest_allocation = max(self._slowest_allocation, elapsed)
        return result

    def _allocate_slots(
        self,
        seq_id: SeqId,
        num_new_tokens: int,
        high_priority: bool,
        prefix: CachedPrefix | None,
        num_restored: int,
        restored_compact_end: int,
    ) -> AppendResult | None:
        seq = self._seqs.get(seq_id)
        started = seq is None
        num_compact = 0
        if started:
            if prefix is not None:
                self._check_prefix(prefix)
            num_compact = self._restored_compact(prefix, num_restored, restored_compact_end)
            if num_compact is None:
                return None
            seq = self._start(
                seq_id, num_new_tokens, high_priority, prefix, num_restored, num_compact
            )
            if seq is None:
                return None
        elif prefix is not None or restored_compact_end:
            raise ValueError(
                f"sequence {seq_id!r} exists; a prefix or restored compact blocks only start "
                f"a sequence"
            )
        elif len(seq.tables) > 1 and not self.pool.can_allocate(
            self._growth_needed(seq, num_new_tokens, num_restored), high_priority
        ):
            return None  # every group's blocks, or none
        first_query = self._first_query(seq, num_restored)
        live_from = self.live_from(first_query)
        table = seq.table
        restored_slots = table.append_compact(num_compact) if num_compact else []
        room = len(table.block_ids) * self.block_size - table.num_tokens  # slots held, unused
        try:
            result = table.append_slots(
                num_new_tokens - len(restored_slots), high_priority, live_from
            )
        except OutOfBlocksError:
            return None
        if restored_slots:
            result.slots = restored_slots + result.slots
        if len(seq.tables) > 1:  # KV layer groups; their blocks are free (checked above)
            for group, other in enumerate(seq.tables[1:], start=1):
                more = other.append_slots(
                    num_new_tokens, high_priority, self.live_from(first_query, group)
                )
                result.copies.extend(more.copies)
                result.more_groups.append(more)
        self._table_lookups += num_new_tokens
        self._table_hits += min(num_new_tokens, room)
        if self.recent_tokens is not None:
            result.encodes, changed = table.compact(self.compact_before(seq.num_committed))
            result.first_changed = min(result.first_changed, changed)
        if started:  # every entry is new to the caller
            result.first_changed = 0
            for more in result.more_groups:
                more.first_changed = 0
            if prefix is not None:
                self._table_lookups += prefix.num_tokens
                self._table_hits += prefix.num_tokens
        return result

    def take_slowest_allocation(self) -> float:
        """Seconds of the slowest :meth:`allocate_slots` call since the last time this
        was asked (0.0 if none); for a monitor that samples it."""
        slowest, self._slowest_allocation = self._slowest_allocation, 0.0
        return slowest

    @staticmethod
    def _first_query(seq: _Sequence, num_restored: int) -> int:
        """Position of the first token of ``seq`` still to be computed: its first
        uncommitted token if it has one, else the first new token not restored."""
        if seq.num_committed < seq.table.num_tokens:
            return seq.num_committed
        return seq.table.num_tokens + num_restored

    def commit_tokens(self, seq_id: SeqId, token_ids: Sequence[int]) -> range:
        """Record that K/V of ``token_ids`` (the next uncommitted tokens) are now written.

        Blocks they complete become cached (in every layer group); with a sliding
        window, blocks no later query reads are released. Returns the logical blocks
        released, per group. Raises ValueError beyond the reserved slots.
        """
        seq = self._seqs[seq_id]
        if seq.num_committed + len(token_ids) > seq.table.num_tokens:
            raise ValueError(
                f"committing {len(token_ids)} tokens after {seq.num_committed} exceeds "
                f"the {seq.table.num_tokens} reserved slots of {seq_id!r}"
            )
        if seq.hasher is not None:
            first_block = seq.num_committed // self.block_size  # the hasher's first pending
            keys = seq.hasher.extend(token_ids)  # the blocks these tokens complete
            for index, key in enumerate(keys, start=first_block):
                for group, table in enumerate(seq.tables):
                    if index >= table.num_null:  # a null entry's K/V were never written
                        self.pool.cache_block(table.block_ids[index], group_key(key, group))
        seq.num_committed += len(token_ids)
        if len(seq.tables) == 1:
            return [seq.table.release_before(self.live_from(seq.num_committed))]
        return [
            table.release_before(self.live_from(seq.num_committed, group))
            for group, table in enumerate(seq.tables)
        ]

    def rollback(self, seq_id: SeqId) -> int:
        """Give back the slots ``seq_id`` reserved beyond its committed tokens (guessed
        tokens the model rejected): the table ends at the committed count again and the
        blocks wholly past it return to the pool (an up-front reservation keeps its
        blocks). Returns the blocks released. Nothing was hashed from those slots:
        only committed tokens enter the prefix cache."""
        seq = self._seqs[seq_id]
        min_blocks = cdiv(self.upfront_tokens or 0, self.block_size)
        return sum(table.truncate(seq.num_committed, min_blocks) for table in seq.tables)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` sharing all its blocks."""
        if child_id in self._seqs:
            raise ValueError(f"sequence {child_id!r} already exists")
        parent = self._seqs[parent_id]
        hasher = None if parent.hasher is None else parent.hasher.copy()
        tables = [table.fork() for table in parent.tables]
        self._seqs[child_id] = _Sequence(tables, hasher, parent.num_committed)

    def free(self, seq_id: SeqId) -> None:
        """Release every block of ``seq_id`` and forget it (finish or preemption).

        Its cached blocks stay findable until evicted.
        """
        for table in self._seqs.pop(seq_id).tables:
            table.free()

    # -- progress ------------------------------------------------------------------------

    def check_progress(
        self, seq_id: SeqId, num_computed_tokens: int, num_scheduled_tokens: int = 0
    ) -> None:
        """Check that the progress counts of ``seq_id`` agree with each other and with the
        caller's ``num_computed_tokens``; raise AssertionError naming each that does not.

        O(1), for tests and debugging (the state machine calls it after every rule, the
        scheduler's :meth:`~pagedllm.engine.scheduler.Scheduler.check_progress` for each
        running sequence); nothing calls it per step. With ``c`` the committed count and
        ``s = num_scheduled_tokens`` the tokens reserved and not yet committed:

        - committed, ``c`` (``_Sequence.num_committed``), is the source: tokens whose K/V
          are written in this table (computed, copied back from swap space, or a prefix
          hit). It equals the caller's computed count (the engine's
          ``TokenSequence.num_computed_tokens``) whenever control is outside the
          scheduler: the scheduler moves both in one method.
        - reserved (``BlockTable.num_tokens``): tokens with slots, ``c + s``. ``s`` is 0
          between steps and the plan's tokens of the sequence inside a step (between
          ``schedule`` and ``update_from_output``; a swap-in's restored tokens are
          committed as they are scheduled).
        - hashed (the :class:`PrefixHasher`, when the sequence is cacheable): the first
          ``c // block_size`` full blocks are hashed (so it has a parent digest iff
          ``c >= block_size``); the ``c % block_size`` tokens after them are pending.
        - released (sliding window): the first ``live_from(c)`` entries are null between
          steps; with tokens scheduled, those before the window of the first one
          computed, which lies in ``c .. c + s``.
        - blocks: ``ceil((c + s) / block_size)`` table entries, or the up-front
          reservation's if that is larger.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise AssertionError(
                f"progress of {seq_id!r}: the block manager holds no such sequence"
            )
        block_size = self.block_size
        committed, scheduled = seq.num_committed, num_scheduled_tokens
        problems = []
        if committed != num_computed_tokens:
            problems.append(f"committed {committed} != computed {num_computed_tokens}")
        hasher = seq.hasher
        if hasher is not None:
            if len(hasher.pending) != committed % block_size:
                problems.append(
                    f"{len(hasher.pending)} tokens pending in the hash chain, not "
                    f"{committed % block_size} (committed {committed} % block size {block_size})"
                )
            if (hasher.parent_digest is None) != (committed < block_size):
                problems.append(f"hash chain's parent digest does not match {committed} committed")
        for group, table in enumerate(seq.tables):
            problems.extend(
                f"group {group}: {problem}" if len(seq.tables) > 1 else problem
                for problem in self._table_problems(table, group, committed, scheduled)
            )
        problems.extend(self._compaction_problems(seq.table, committed))
        if problems:
            raise AssertionError(f"progress of sequence {seq_id!r}: " + "; ".join(problems))

    def _table_problems(
        self, table: BlockTable, group: int, committed: int, scheduled: int
    ) -> list[str]:
        """How ``group``'s table of a sequence with ``committed`` tokens and ``scheduled``
        more reserved breaks :meth:`check_progress`'s relations."""
        problems = []
        block_size = self.block_size
        if scheduled < 0 or table.num_tokens != committed + scheduled:
            problems.append(
                f"reserved {table.num_tokens} != committed {committed} + scheduled {scheduled}"
            )
        lowest = self.live_from(committed, group)
        highest = self.live_from(committed + scheduled, group) if scheduled > 0 else lowest
        if not lowest <= table.num_null <= highest:
            problems.append(
                f"{table.num_null} null entries, not in {lowest}..{highest} (sliding window "
                f"{self.windows[group]} after {committed} committed, {scheduled} scheduled)"
            )
        num_blocks = max(
            cdiv(table.num_tokens, block_size), cdiv(self.upfront_tokens or 0, block_size)
        )
        if len(table.block_ids) != num_blocks:
            problems.append(
                f"{len(table.block_ids)} table entries for {table.num_tokens} reserved tokens, "
                f"not {num_blocks}"
            )
        return problems

    def _compaction_problems(self, table: BlockTable, committed: int) -> list[str]:
        """Entries before ``compact_end`` are compact, the others full, and none is
        compact inside the recent window of ``committed`` tokens."""
        if self.recent_tokens is None:
            return []
        held = table.block_ids[table.num_null :]
        compact = [self.pool.is_compact(block_id) for block_id in held]
        num_compact = table.compact_end - table.num_null
        problems = []
        if not all(compact[:num_compact]) or any(compact[num_compact:]):
            problems.append(f"compact entries {compact} do not end at {table.compact_end}")
        if table.compact_end > max(self.compact_before(committed), table.num_null):
            problems.append(
                f"{table.compact_end} compact entries reach into the recent window of "
                f"{committed} committed tokens ({self.recent_tokens} recent)"
            )
        return problems

    # -- views ---------------------------------------------------------------------------

    @property
    def num_seqs(self) -> int:
        """Sequences holding a table."""
        return len(self._seqs)

    def block_table(self, seq_id: SeqId, group: int = 0) -> list[int]:
        """A copy of the physical block ids of ``seq_id``'s table of layer group
        ``group``, in logical order (null entries included)."""
        return list(self._seqs[seq_id].tables[group].block_ids)

    def held_block_ids(self, seq_id: SeqId) -> list[int]:
        """The blocks ``seq_id`` references (its tables less the null entries, group by
        group; a copy)."""
        return [b for table in self._seqs[seq_id].tables for b in table.held_block_ids]

    def block_ids_from(self, seq_id: SeqId, start: int, group: int = 0) -> list[int]:
        """The physical blocks of logical blocks ``start ..`` of ``seq_id``'s table of
        layer group ``group`` (a copy)."""
        return self._seqs[seq_id].tables[group].block_ids[start:]

    def num_held_blocks(self, seq_id: SeqId) -> int:
        """Blocks ``seq_id``'s tables reference (0 for an unknown sequence)."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return 0
        return sum(len(table.block_ids) - table.num_null for table in seq.tables)

    def num_null_blocks(self, seq_id: SeqId, group: int = 0) -> int:
        """Leading null entries of ``seq_id``'s table of layer group ``group`` (released
        by its sliding window)."""
        return self._seqs[seq_id].tables[group].num_null

    def compact_end(self, seq_id: SeqId) -> int:
        """Leading entries of ``seq_id``'s table that are null or compact
        (:attr:`BlockTable.compact_end`)."""
        return self._seqs[seq_id].table.compact_end

    def num_tokens(self, seq_id: SeqId) -> int:
        """Tokens ``seq_id`` has slots for."""
        return self._seqs[seq_id].table.num_tokens

    def fragmentation(self) -> FragmentationStats:
        """Fragmentation figures of the live tables, as :func:`fragmentation_stats` counts them.

        O(number of sequences) plus reserved blocks: it relies on the tables' invariants
        (every referenced block belongs to a table; blocks before a table's write position
        are full; all holders of a block agree on its fill) to visit only blocks that are
        not full.
        """
        block_size = self.block_size
        not_full: dict[int, int] = {}
        unshared_blocks = 0
        for table in (table for seq in self._seqs.values() for table in seq.tables):
            num_tokens, block_ids = table.num_tokens, table.block_ids
            unshared_blocks += max(0, cdiv(num_tokens, block_size) - table.num_null)
            for index in range(max(num_tokens // block_size, table.num_null), len(block_ids)):
                fill = max(0, num_tokens - index * block_size)
                not_full[block_ids[index]] = max(not_full.get(block_ids[index], 0), fill)
        unique_blocks = self.pool.num_used + self.pool.num_compact_used
        allocated = unique_blocks * block_size
        live = allocated - sum(block_size - fill for fill in not_full.values())
        return FragmentationStats(
            unique_blocks=unique_blocks,
            allocated_slots=allocated,
            live_tokens=live,
            internal_fragmentation_slots=allocated - live,
            slots_saved_by_sharing=unshared_blocks * block_size - allocated,
        )

    def stats(self) -> BlockManagerStats:
        return BlockManagerStats(
            num_seqs=len(self._seqs),
            pool=self.pool.stats(),
            fragmentation=self.fragmentation(),
            prefix_cache_queries=self._prefix_cache_queries,
            prefix_cache_hits=self._prefix_cache_hits,
            block_table_lookups=self._table_lookups,
            block_table_hits=self._table_hits,
        )

    def allocation_times(self) -> AllocationTimes:
        """Calls of :meth:`allocate_slots` and the seconds they took, since start-up."""
        return AllocationTimes(self._allocation_calls, self._allocation_seconds)


def _nth_none(items: Sequence[int | None], n: int) -> int:
    """The index of the ``n``-th None in ``items`` counting from 0 (its length when
    there are no more)."""
    for index, item in enumerate(items):
        if item is None:
            if n == 0:
                return index
            n -= 1
    return len(items)
