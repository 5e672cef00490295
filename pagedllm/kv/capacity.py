"""Capacity arithmetic of the KV cache: one function for each quantity.

Units: tokens; blocks of ``block_size`` tokens; bytes. Pure integer arithmetic (no torch,
no engine), shared by everything that sizes or admits: the engine's pool and its
admission check (:class:`~pagedllm.engine.llm_engine.LLMEngine`), beam search's
admission, the KV cache tensors (:mod:`~pagedllm.kv_storage.kv_cache`), the block manager and
the planner (:mod:`~pagedllm.plan.capacity`), so that none of them can disagree.

- :func:`cdiv`: ceil division, the one place it is written;
- :func:`blocks_for_tokens`: the blocks a sequence of ``n`` tokens holds;
- :func:`max_window_blocks`: the most a sequence holds under a sliding window;
- :func:`request_worst_case_blocks`: the most a request of ``n`` samples (or beams) holds;
- :func:`grouped_worst_case_blocks`: the same over layer groups, each with its own table;
- :func:`longest_sequence`: the most tokens one sequence can hold in a number of blocks;
- :func:`recent_blocks`: the most full-size blocks a sequence holds with compact ones;
- :func:`full_blocks_wanted`: the full-size blocks a pool by age keeps for its windows;
- :func:`split_by_age`: a budget's full-size and compact blocks;
- :func:`swap_split`: a swap space's full-size and compact blocks;
- :func:`block_bytes`: the bytes of one block;
- :func:`pool_blocks`: the blocks a byte budget buys.
"""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` in exact integer arithmetic, for ``b > 0``."""
    return -(-a // b)


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks a sequence of ``num_tokens`` tokens holds, ``ceil(num_tokens / block_size)``:
    it wastes at most ``block_size - 1`` slots."""
    return cdiv(num_tokens, block_size)


def max_window_blocks(window: int, num_tokens: int, block_size: int) -> int:
    """Most blocks a sequence holds under a ``window``-token sliding window during a step
    that computes ``num_tokens`` of its tokens: the blocks of the ``window + num_tokens
    - 1`` positions those queries read, at worst misaligned by ``block_size - 1``
    (``ceil((window + block_size - 1) / block_size)`` while decoding)."""
    return cdiv(window + num_tokens + block_size - 2, block_size)


def request_worst_case_blocks(
    prompt_len: int,
    max_tokens: int,
    n: int,
    block_size: int,
    *,
    upfront_tokens: int | None = None,
    window: int | None = None,
    step_tokens: int = 1,
) -> int:
    """Most blocks a request holds at once: ``n`` samples (or beams) of a ``prompt_len``-
    token prompt, each reaching ``prompt_len + max_tokens`` tokens.

    The prompt's full blocks are shared by all samples and held once; each sample holds
    its own blocks from the prompt's partly filled block up to its last token (copies on
    write of shared blocks included). ``upfront_tokens`` (contiguous allocation): the
    first sequence holds blocks for that many slots from its first step; the others
    share them and copy what they write. ``window`` (every layer slides over that many
    tokens): no sequence holds more than :func:`max_window_blocks` for a step computing
    ``step_tokens`` of its tokens. The two exclude each other, as in the block manager.
    Invariant: at least ``blocks_for_tokens(prompt_len + max_tokens)`` for one sample
    without a window, and non-decreasing in ``max_tokens`` and ``n``.
    """
    if upfront_tokens is not None and window is not None:
        raise ValueError("a sliding window needs on-demand allocation, not upfront_tokens")
    shared = prompt_len // block_size
    longest = blocks_for_tokens(prompt_len + max_tokens, block_size)
    first, own = longest, longest - shared
    if upfront_tokens is not None:
        first = max(first, blocks_for_tokens(upfront_tokens, block_size))
    if window is not None:
        bound = max_window_blocks(window, step_tokens, block_size)
        first, own = min(first, bound), min(own, bound)
    return first + (n - 1) * own


def grouped_worst_case_blocks(
    prompt_len: int,
    max_tokens: int,
    n: int,
    block_size: int,
    windows: tuple[int | None, ...],
    *,
    upfront_tokens: int | None = None,
    step_tokens: int = 1,
) -> int:
    """Most blocks a request holds when each layer group (``windows``: per group, its
    sliding window or None; :mod:`pagedllm.kv.layer_groups`) keeps its own table: the
    sum of each group's :func:`request_worst_case_blocks` (one group: exactly that)."""
    return sum(
        request_worst_case_blocks(
            prompt_len,
            max_tokens,
            n,
            block_size,
            upfront_tokens=upfront_tokens,
            window=window,
            step_tokens=step_tokens,
        )
        for window in windows
    )


def longest_sequence(
    num_blocks: int, block_size: int, windows: tuple[int | None, ...], step_tokens: int
) -> int | None:
    """Most tokens one sequence can reach holding at most ``num_blocks`` blocks over the
    layer groups of ``windows``: a global group holds a block per ``block_size`` tokens,
    a sliding one as many but at most :func:`max_window_blocks` for a step of
    ``step_tokens``. None when no group is global and the sliding ones fit (no limit).
    One group counts every block, window or not, as one table did."""
    if len(windows) == 1:
        return num_blocks * block_size
    bounds = [
        num_blocks + 1 if w is None else max_window_blocks(w, step_tokens, block_size)
        for w in windows
    ]

    def held(length_blocks: int) -> int:
        return sum(min(length_blocks, bound) for bound in bounds)

    if None not in windows and held(max(bounds)) <= num_blocks:
        return None
    low, high = 0, num_blocks  # the most blocks per table whose groups fit
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if held(middle) <= num_blocks else (low, middle - 1)
    return low * block_size


def recent_blocks(recent_tokens: int, step_tokens: int, block_size: int) -> int:
    """Most full-size blocks a sequence holds when blocks wholly behind its newest
    ``recent_tokens`` are compact, during a step computing ``step_tokens`` after one that
    computed as many (re-encoding follows the reservation, so the previous step's tokens
    are not behind the window yet), misaligned by up to ``block_size - 1``:
    ``ceil((recent_tokens + 2 * step_tokens + block_size - 1) / block_size)``."""
    return cdiv(recent_tokens + 2 * step_tokens + block_size - 1, block_size)


def full_blocks_wanted(
    max_num_seqs: int, recent_tokens: int, max_num_batched_tokens: int, block_size: int
) -> int:
    """Full-size blocks a pool whose old blocks are compact wants: the recent windows of
    ``max_num_seqs`` decoding sequences and two steps of ``max_num_batched_tokens``
    (a chunk and the one before it, not yet re-encoded)."""
    windows = max_num_seqs * recent_blocks(recent_tokens, 1, block_size)
    return windows + 2 * cdiv(max_num_batched_tokens, block_size)


def split_by_age(
    budget_bytes: int, full_block_bytes: int, compact_block_bytes: int, full_wanted: int
) -> tuple[int, int]:
    """Full-size and compact blocks of a ``budget_bytes`` pool whose old blocks are
    compact: ``full_wanted`` full-size blocks (the running sequences' recent windows),
    at most a quarter of the budget, and compact blocks with the rest."""
    num_full = min(full_wanted, budget_bytes // 4 // full_block_bytes)
    rest = budget_bytes - num_full * full_block_bytes
    return num_full, max(0, rest // compact_block_bytes)


def swap_split(
    swap_bytes: int,
    full_block_bytes: int,
    compact_block_bytes: int,
    num_full: int,
    num_compact: int,
) -> tuple[int, int]:
    """Full-size and compact blocks of a ``swap_bytes`` swap space beside a pool of
    ``num_full`` full-size and ``num_compact`` compact blocks: its bytes split in the
    proportion of the pool's bytes (a preempted sequence parks the pool's mix of recent
    full-size and older compact blocks), the full-size share rounded down to whole
    blocks and the rest compact. Without compact blocks, every byte goes to full-size
    blocks."""
    if not num_compact:
        return swap_bytes // full_block_bytes, 0
    pool_full = num_full * full_block_bytes
    pool_bytes = pool_full + num_compact * compact_block_bytes
    full = swap_bytes * pool_full // pool_bytes // full_block_bytes
    return full, (swap_bytes - full * full_block_bytes) // compact_block_bytes


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, row_bytes: int) -> int:
    """Bytes of one block across all layers: K and V of ``block_size`` tokens for every
    layer and KV head, each token's K (or V) of one head a row of ``row_bytes`` bytes
    (its elements and, in quantized formats, its scale:
    :meth:`~pagedllm.kv_storage.kv_quant.KVFormat.row_bytes`)."""
    return 2 * num_layers * block_size * num_kv_heads * row_bytes


def pool_blocks(budget_bytes: int, block_bytes: int, null_block: bool = False) -> int:
    """Blocks sequences may hold in a pool of ``budget_bytes`` bytes: the whole blocks of
    ``block_bytes`` bytes it buys (rounded down, never negative), less the null block
    the tables of a sliding window point at (``null_block``; the cache holds it on top
    of the pool)."""
    return max(0, budget_bytes // block_bytes - null_block)


DRAFT_GROUP_SIZE = 64
"""Sequences one pass of a draft model runs at most (a larger batch drafts in groups)."""


def draft_scratch_blocks(num_speculative_tokens: int, block_size: int, max_num_seqs: int) -> int:
    """Scratch blocks of a draft model's cache (``draft_model`` speculation): per drafting
    sequence, its guessed positions past its last pool block and a copy of that block
    when it is shared, ``ceil(k / block_size) + 1``, for ``DRAFT_GROUP_SIZE`` sequences
    (or ``max_num_seqs``, when fewer) at a time."""
    per_sequence = cdiv(num_speculative_tokens, block_size) + 1
    return min(max_num_seqs, DRAFT_GROUP_SIZE) * per_sequence
