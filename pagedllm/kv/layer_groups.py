"""Layers grouped by attention kind, each group with its own block table per sequence.

A model whose layers attend differently (Gemma 2/3: sliding-window layers between
global ones; Qwen2 with windows on its upper layers) keeps a table per *group* of
layers. A global group holds a sequence's whole context; a sliding group of window
``W`` releases every block wholly before the window of the sequence's next query, as an
all-sliding model does.

Every group has the same number of layers, :attr:`KVLayerGroups.num_slots`, so that one
pool serves them all: a physical block holds ``block_size`` tokens of K/V for
``num_slots`` layers, and the cache keeps one tensor per *slot* (not per layer). Layer
``l`` reads and writes slot ``layer_slot[l]`` of the blocks in its group's table. A
kind whose layer count is not a multiple of ``num_slots`` leaves the last slots of its
last group unused (padding, counted in :attr:`padding_layers`). Invariants:

- groups hold layers of one window each; every layer is in exactly one group, at one
  slot, and no two layers of a group share a slot;
- group 0 is a global group when the model has one (its table is what a one-group
  engine keeps);
- a model whose layers all attend alike has one group of every layer
  (``num_slots == num_layers``, slot ``l`` for layer ``l``): the single-table engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_PADDING_FRACTION = 1 / 8
"""Largest share of a pool's layer slots a grouping may leave unused; among groupings
within it, the one with the fewest groups (the least host work per step) is chosen."""


@dataclass(frozen=True)
class KVLayerGroups:
    """``windows[g]``: group ``g``'s sliding window in tokens (None: global);
    ``layer_group[l]`` and ``layer_slot[l]``: layer ``l``'s group and slot."""

    windows: tuple[int | None, ...]
    layer_group: tuple[int, ...]
    layer_slot: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def padding_layers(self) -> int:
        """Slots of the pool's blocks no layer uses, summed over the groups."""
        return self.num_groups * self.num_slots - self.num_layers

    @property
    def num_global(self) -> int:
        """Groups that keep a sequence's whole context."""
        return sum(window is None for window in self.windows)

    def describe(self) -> str:
        """One line for the start-up log."""
        kinds = []
        for window in dict.fromkeys(self.windows):
            count = self.windows.count(window)
            kind = "global" if window is None else f"sliding over {window} tokens"
            kinds.append(f"{count} {kind}")
        padding = f", {self.padding_layers} unused" if self.padding_layers else ""
        return (
            f"{self.num_groups} KV layer groups of {self.num_slots} layers "
            f"({', '.join(kinds)}{padding}), each with its own block table per sequence"
        )


def single_group(num_layers: int, window: int | None = None) -> KVLayerGroups:
    """Every layer in one group (one table per sequence), sliding over ``window``."""
    return KVLayerGroups((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def group_layers(layer_windows: Sequence[int | None], num_layers: int) -> KVLayerGroups:
    """Group ``num_layers`` layers by window (``layer_windows`` per layer, empty when
    none slides). Layers of one kind fill groups in layer order; the group size is the
    largest that leaves at most :data:`MAX_PADDING_FRACTION` of the slots unused."""
    if not layer_windows or len(set(layer_windows)) == 1:
        return single_group(num_layers, layer_windows[0] if layer_windows else None)
    if len(layer_windows) != num_layers:
        raise ValueError(f"{len(layer_windows)} layer windows for {num_layers} layers")
    kinds: dict[int | None, list[int]] = {}
    if None in layer_windows:
        kinds[None] = []  # a global group comes first
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    counts = [len(layers) for layers in kinds.values()]
    size = max(
        size
        for size in range(1, min(counts) + 1)
        if sum(-(-count // size) * size for count in counts) - num_layers
        <= MAX_PADDING_FRACTION * num_layers
        or size == 1
    )
    windows: list[int | None] = []
    layer_group = [0] * num_layers
    layer_slot = [0] * num_layers
    for window, layers in kinds.items():
        for start in range(0, len(layers), size):
            for slot, layer in enumerate(layers[start : start + size]):
                layer_group[layer] = len(windows)
                layer_slot[layer] = slot
            windows.append(window)
    return KVLayerGroups(tuple(windows), tuple(layer_group), tuple(layer_slot), size)
