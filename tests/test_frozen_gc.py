"""The collector skips start-up objects while the engine runs and gets them back after."""

from __future__ import annotations

import gc
import weakref

from pagedllm.engine.frozen_gc import frozen_startup_objects


class Node:
    def __init__(self) -> None:
        self.partner: Node | None = None


def cycle() -> weakref.ref:
    """A two-object reference cycle, unreachable once this returns; a weak reference
    tells whether it was collected."""
    a, b = Node(), Node()
    a.partner, b.partner = b, a
    return weakref.ref(a)


def test_startup_objects_are_frozen_inside_and_collectable_after():
    alive = Node()
    alive.partner = alive
    with frozen_startup_objects():
        assert gc.get_freeze_count() > 0
        probe = weakref.ref(alive)
        del alive  # a frozen object that dies in a cycle meanwhile
        gc.collect()
        assert probe() is not None, "frozen objects are not walked"
        later = cycle()  # allocated after the freeze: collected as usual
        gc.collect()
        assert later() is None
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert probe() is None, "back in the oldest generation, collected after the block"
