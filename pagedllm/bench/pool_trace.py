"""A block-pool trace: which sequence holds which physical block after every engine step.

``PoolTracer(engine).attach()`` records one :class:`PoolSnapshot` after each
``engine.step()``; :func:`draw_trace` turns the trace into a PNG (x = step, y = physical
block id, colour = owning sequence, shared blocks black) with a second panel of pool usage,
internal fragmentation and shared blocks. A snapshot costs O(blocks held by running
sequences): the tables are read, not the whole pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FREE = -1  # owner of a block no running sequence holds


@dataclass(frozen=True)
class PoolSnapshot:
    """The pool after one step.

    ``owners[block_id]`` is the index (in :attr:`PoolTrace.seq_ids`) of a sequence holding
    the block, or :data:`FREE`; ``shared`` lists blocks with ref count > 1. Counts are in
    blocks; ``live_tokens``/``allocated_slots``/``fragmentation_slots`` in token slots.
    """

    owners: np.ndarray
    shared: np.ndarray
    used_blocks: int
    allocated_slots: int
    live_tokens: int
    fragmentation_slots: int
    num_running: int


@dataclass
class PoolTrace:
    """Snapshots of a pool of ``num_blocks`` blocks of ``block_size`` tokens, in step order."""

    num_blocks: int
    block_size: int
    seq_ids: list[object] = field(default_factory=list)
    snapshots: list[PoolSnapshot] = field(default_factory=list)


class PoolTracer:
    """Records ``engine``'s block tables (``engine.scheduler.running`` over
    ``engine.block_manager``) into :attr:`trace`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        manager = engine.block_manager
        self.trace = PoolTrace(manager.pool.num_blocks, manager.block_size)
        self._owner_index: dict[object, int] = {}

    def attach(self) -> PoolTracer:
        """Make ``engine.step()`` record a snapshot after every call; returns ``self``."""
        step = self.engine.step

        def traced_step(*args, **kwargs):
            outputs = step(*args, **kwargs)
            self.record()
            return outputs

        self.engine.step = traced_step
        return self

    def _owner(self, seq_id: object) -> int:
        index = self._owner_index.get(seq_id)
        if index is None:
            index = self._owner_index[seq_id] = len(self.trace.seq_ids)
            self.trace.seq_ids.append(seq_id)
        return index

    def record(self) -> PoolSnapshot:
        """Append (and return) a snapshot of the pool as it is now."""
        manager = self.engine.block_manager
        pool = manager.pool
        running = [seq for seq in self.engine.scheduler.running if seq.seq_id in manager]
        held: list[int] = []
        holders: list[int] = []
        for seq in running:
            table = manager.held_block_ids(seq.seq_id)
            held += table
            holders += [self._owner(seq.seq_id)] * len(table)
        owners = np.full(self.trace.num_blocks, FREE, dtype=np.int32)
        owners[held] = holders
        shared = sorted({block_id for block_id in held if pool.ref_count(block_id) > 1})
        fragmentation = manager.fragmentation()
        snapshot = PoolSnapshot(
            owners=owners,
            shared=np.array(shared, dtype=np.int32),
            used_blocks=pool.num_used,
            allocated_slots=fragmentation.allocated_slots,
            live_tokens=fragmentation.live_tokens,
            fragmentation_slots=fragmentation.internal_fragmentation_slots,
            num_running=len(running),
        )
        self.trace.snapshots.append(snapshot)
        return snapshot


def _owner_image(trace: PoolTrace, num_rows: int) -> np.ndarray:
    """RGB ``[num_rows, num_steps, 3]`` of blocks ``0 .. num_rows - 1``: white free, owner
    colours, black shared."""
    import matplotlib.pyplot as plt

    palette = (np.array(plt.get_cmap("tab20").colors) * 255).astype(np.uint8)
    owners = np.stack([snap.owners[:num_rows] for snap in trace.snapshots], axis=1)
    image = palette[np.maximum(owners, 0) % len(palette)]
    image[owners == FREE] = 255
    for step, snap in enumerate(trace.snapshots):
        image[snap.shared[snap.shared < num_rows], step] = 0
    return image


def _blocks_to_show(trace: PoolTrace) -> int:
    """Blocks up to the highest id ever held (plus a 5 % margin), at most the pool."""
    highest = max(
        int(np.flatnonzero(snap.owners != FREE).max(initial=0)) for snap in trace.snapshots
    )
    return min(trace.num_blocks, max(8, int((highest + 1) * 1.05)))


def draw_trace(trace: PoolTrace, path: str | Path, title: str = "KV block pool") -> None:
    """Write the trace as a PNG: the pool over steps, then usage and fragmentation curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if not trace.snapshots:
        raise ValueError("the trace is empty: record at least one step")
    steps = np.arange(1, len(trace.snapshots) + 1)
    shown = _blocks_to_show(trace)
    fig, (pool_ax, curve_ax) = plt.subplots(
        2, 1, figsize=(12, 9), height_ratios=(3, 1.3), sharex=True, layout="constrained"
    )
    pool_ax.imshow(
        _owner_image(trace, shown),
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=(0.5, len(steps) + 0.5, -0.5, shown - 0.5),
    )
    hidden = trace.num_blocks - shown
    pool_ax.set_ylabel(
        f"physical block id ({hidden:,} higher ids, never held, not shown)"
        if hidden
        else "physical block id"
    )
    pool_ax.set_title(
        f"{title}\n{trace.num_blocks:,} blocks of {trace.block_size} tokens, "
        f"{len(trace.seq_ids):,} sequences (colour = owning sequence, 20 colours reused)"
    )
    pool_ax.legend(
        handles=[
            Patch(facecolor="white", edgecolor="0.5", label="free"),
            Patch(facecolor="black", label="shared (ref count > 1)"),
        ],
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
    )
    snaps = trace.snapshots
    usage = [100 * s.used_blocks / trace.num_blocks for s in snaps]
    fragmentation = [100 * s.fragmentation_slots / max(1, s.allocated_slots) for s in snaps]
    shared = [100 * len(s.shared) / trace.num_blocks for s in snaps]
    curve_ax.plot(steps, usage, label="blocks in use (% of pool)")
    curve_ax.plot(steps, fragmentation, label="internal fragmentation (% of allocated slots)")
    curve_ax.plot(steps, shared, label="shared blocks (% of pool)")
    curve_ax.set_ylim(0, 100)
    curve_ax.set_ylabel("%")
    curve_ax.set_xlabel("engine step")
    running_ax = curve_ax.twinx()
    running_ax.plot(
        steps, [s.num_running for s in snaps], color="0.4", linestyle=":", label="running sequences"
    )
    running_ax.set_ylabel("running sequences")
    running_ax.set_ylim(bottom=0)
    handles = curve_ax.get_legend_handles_labels()[0] + running_ax.get_legend_handles_labels()[0]
    curve_ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.07, 1.0), fontsize="small")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def trace_path(path: str | Path, label: str) -> Path:
    """``path`` with ``-label`` before its suffix: one picture per traced run."""
    path = Path(path)
    return path.with_name(f"{path.stem}-{label}{path.suffix}")
