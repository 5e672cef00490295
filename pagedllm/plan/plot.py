"""``pagedllm plan --plot``: the same memory laid out contiguously and in paged blocks.

Top: one row per sequence, ``max_model_len`` slots reserved, the used part solid.
Bottom: that memory cut into blocks of ``block_size`` slots (row after row, same token
scale), filled by on-demand allocation (:func:`~pagedllm.plan.layout.paged_layout`):
blocks coloured by owner, the empty tail of each last block hatched (internal
fragmentation), shared prefix blocks black-edged.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from pagedllm.kv.capacity import blocks_for_tokens  # noqa: E402
from pagedllm.plan.capacity import CapacityPlan, max_seqs_paged  # noqa: E402
from pagedllm.plan.layout import SHARED_OWNER, BlockUse, paged_layout  # noqa: E402

SPREAD = (0.35, 1.6, 0.7, 1.0, 0.2, 1.3, 0.85, 0.5)
SHARED_COLOUR = "0.35"
FREE_COLOUR = "0.93"


def default_lengths(avg_len: int, max_model_len: int, prefix_len: int = 0) -> list[int]:
    """Eight sequence lengths spread around ``avg_len`` (mean ``avg_len`` before clipping
    to ``max(1, prefix_len) .. max_model_len``)."""
    shortest = max(1, prefix_len)
    return [min(max_model_len, max(shortest, round(avg_len * f))) for f in SPREAD]


def _owner_colour(owner: int) -> object:
    return SHARED_COLOUR if owner == SHARED_OWNER else plt.get_cmap("tab10")(owner % 10)


def _draw_contiguous(ax, lengths: Sequence[int], max_model_len: int) -> None:
    for row, length in enumerate(lengths):
        colour = _owner_colour(row)
        ax.broken_barh(
            [(0, max_model_len)],
            (row - 0.4, 0.8),
            facecolor="white",
            edgecolor=colour,
            hatch="//",
            linewidth=0.8,
        )
        ax.broken_barh([(0, length)], (row - 0.4, 0.8), facecolor=colour)
    used = sum(lengths)
    reserved = len(lengths) * max_model_len
    ax.set_title(
        f"Contiguous: each sequence reserves max_model_len = {max_model_len:,} slots; "
        f"{used:,} of {reserved:,} slots hold tokens ({used / reserved:.0%}), none left free"
    )
    ax.set_yticks(range(len(lengths)), [f"seq {i} ({n:,})" for i, n in enumerate(lengths)])
    ax.set_ylim(len(lengths) - 0.5, -0.5)
    ax.set_xlim(0, max_model_len)
    ax.set_xlabel("token slot within the sequence's reservation")


def _paged_segments(
    layout: Sequence[BlockUse], block_size: int, per_row: int, num_rows: int
) -> dict[tuple[int, int, str], list[tuple[int, int]]]:
    """Bar segments ``(x, width)`` in token slots, grouped by ``(row, owner, part)`` with
    part ``"filled"``, ``"empty"`` (internal fragmentation) or ``"free"``; one draw call
    per group keeps large pools quick."""
    segments: dict[tuple[int, int, str], list[tuple[int, int]]] = defaultdict(list)
    for block_id in range(per_row * num_rows):
        row, column = divmod(block_id, per_row)
        x = column * block_size
        if block_id >= len(layout):
            segments[row, SHARED_OWNER, "free"].append((x, block_size))
            continue
        use = layout[block_id]
        segments[row, use.owner, "filled"].append((x, use.filled))
        if use.filled < block_size:
            segments[row, use.owner, "empty"].append((x + use.filled, block_size - use.filled))
    return segments


def _draw_paged(ax, lengths: Sequence[int], plan: CapacityPlan) -> None:
    block_size, max_model_len = plan.block_size, plan.workload.max_model_len
    per_row = blocks_for_tokens(max_model_len, block_size)
    window = plan.model.config.kv_window  # the picture draws one table per sequence
    layout = paged_layout(lengths, block_size, plan.workload.prefix_len, window)
    segments = _paged_segments(layout, block_size, per_row, len(lengths))
    for (row, owner, part), bars in segments.items():
        colour = _owner_colour(owner)
        if part == "free":
            style = {"facecolor": FREE_COLOUR}
        elif part == "empty":
            style = {"facecolor": "white", "edgecolor": colour, "hatch": "xxx", "linewidth": 0.3}
        else:
            edge = "black" if owner == SHARED_OWNER else "white"
            style = {"facecolor": colour, "edgecolor": edge, "linewidth": 0.3}
        ax.broken_barh(bars, (row - 0.4, 0.8), **style)
    pool_blocks = per_row * len(lengths)
    used = len(layout)
    wasted = sum(block_size - use.filled for use in layout)
    avg_len, prefix_len = plan.workload.avg_len, plan.workload.prefix_len
    more = max_seqs_paged(pool_blocks - used, block_size, avg_len, prefix_len, (window,))
    ax.set_title(
        f"Paged, the same memory ({pool_blocks:,} blocks of {block_size} slots): {used:,} blocks "
        f"used ({used / pool_blocks:.0%}), {wasted:,} slots of internal fragmentation;\n"
        f"the {pool_blocks - used:,} free blocks hold {more:,} more sequences of {avg_len:,} tokens"
    )
    ax.set_yticks(range(len(lengths)), [f"blocks {r * per_row:,}-" for r in range(len(lengths))])
    ax.set_ylim(len(lengths) - 0.5, -0.5)
    ax.set_xlim(0, per_row * block_size)
    ax.set_xlabel("token slot (physical block id x block size, row after row)")


def draw_layouts(plan: CapacityPlan, lengths: Sequence[int], path: str | Path) -> None:
    """Write a PNG comparing both layouts of sequences of ``lengths`` tokens."""
    max_model_len = plan.workload.max_model_len
    if not lengths or any(not 1 <= n <= max_model_len for n in lengths):
        raise ValueError(f"plot lengths must be in 1 .. max_model_len {max_model_len}")
    height = 2.2 + 0.55 * len(lengths)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 2 * height), layout="constrained")
    _draw_contiguous(top, lengths, max_model_len)
    _draw_paged(bottom, lengths, plan)
    owners = [Patch(facecolor=_owner_colour(i), label=f"seq {i}") for i in range(len(lengths))]
    legend = [
        *owners[:10],
        Patch(facecolor="white", edgecolor="0.3", hatch="//", label="reserved, unused"),
        Patch(facecolor="white", edgecolor="0.3", hatch="xxx", label="internal fragmentation"),
        Patch(facecolor=FREE_COLOUR, label="free block"),
    ]
    if plan.workload.prefix_len >= plan.block_size:
        legend.append(Patch(facecolor=SHARED_COLOUR, edgecolor="black", label="shared prefix"))
    fig.legend(handles=legend, loc="outside right center")
    fig.suptitle(
        f"{plan.model.name}: {len(lengths)} sequences, {sum(lengths):,} tokens, "
        f"block size {plan.block_size}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)
