"""The model runner's copy of every running sequence's block table, kept across steps.

One row per sequence in a persistent int32 array ``[rows, columns]``; entries past a
table's end are ``-1``. Each plan updates it by deltas (logical blocks ``start ..`` of a
sequence now live in given physical blocks) and gives back the rows of sequences that
finished or were preempted, so keeping it costs O(changed entries) per step and reading
a batch's tables is one gather, never a copy of every table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np


class BlockTableRows:
    """Block tables by sequence id; both dimensions grow on demand (doubling)."""

    def __init__(self, columns: int, rows: int = 64) -> None:
        self._table = np.full((max(rows, 1), max(columns, 1)), -1, dtype=np.int32)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(self._table.shape[0] - 1, -1, -1))

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row_of

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget these sequences' tables (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self._row_of.pop(seq_id, None)
            if row is not None:
                self._table[row] = -1
                self._free_rows.append(row)

    def update(self, seq_id: int, start: int, block_ids: Sequence[int]) -> None:
        """Logical blocks ``start .. start + len(block_ids) - 1`` of ``seq_id`` now live
        in ``block_ids``; a sequence seen for the first time must start at 0."""
        row = self._row_of.get(seq_id)
        if row is None:
            if start != 0:
                raise ValueError(f"sequence {seq_id} is new here; its table must start at 0")
            row = self._take_row(seq_id)
        end = start + len(block_ids)
        if end > self._table.shape[1]:
            self._grow(columns=max(end, 2 * self._table.shape[1]))
        self._table[row, start:end] = block_ids

    def gather(self, seq_ids: Sequence[int], width: int) -> np.ndarray:
        """A new ``[len(seq_ids), width]`` array of these sequences' first ``width``
        logical blocks (``-1`` past each table's end)."""
        if width > self._table.shape[1]:
            self._grow(columns=width)
        rows = [self._row_of[seq_id] for seq_id in seq_ids]
        return self._table[rows, :width]

    def _take_row(self, seq_id: int) -> int:
        if not self._free_rows:
            self._grow(rows=2 * self._table.shape[0])
        row = self._free_rows.pop()
        self._row_of[seq_id] = row
        return row

    def _grow(self, rows: int | None = None, columns: int | None = None) -> None:
        old_rows, old_columns = self._table.shape
        rows, columns = rows or old_rows, columns or old_columns
        table = np.full((rows, columns), -1, dtype=np.int32)
        table[:old_rows, :old_columns] = self._table
        self._table = table
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)
